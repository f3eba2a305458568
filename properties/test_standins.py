"""The CPU stand-ins for causal_conv1d and selective_scan_cuda (ssdiff.sides.standins) against float64.

The references here are written independently of the stand-ins (explicit loops over tokens and taps, in
float64); the stand-ins compute in float32 and store in the input dtype, so they are held to a few units of
the storage dtype's rounding (relative RMS error <= 8 * eps(dtype) outputs, 32 * eps gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdiff.sides import standins

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SETTINGS = dict(max_examples=30, deadline=None)


def relative(a, b) -> float:
    """||a - b|| / ||b||, with ||b|| floored at float32's smallest normal per element: the stand-ins compute in
    float32, where a float64 reference below that floor (a gradient of 1e-142 after total decay, met on an H200
    in bf16) is 0 at best."""
    a, b = a.double(), b.double()
    scale = max(b.norm().item(), torch.finfo(torch.float32).tiny * max(b.numel(), 1) ** 0.5)
    return (a - b).norm().item() / scale


def eps(dtype) -> float:
    return max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


# ---- float64 references ----------------------------------------------------------------------------------

def conv_reference(x, weight, bias, seq_idx, silu):
    """out[b, c, t] = act(bias[c] + sum_k w[c, k] x[b, c, t - W + 1 + k]) over taps in t's sequence."""
    batch, dim, length = x.shape
    width = weight.shape[1]
    rows = []
    for t in range(length):
        acc = bias[None, :].expand(batch, dim) if bias is not None else x.new_zeros(batch, dim)
        for k in range(width):
            s = t - (width - 1) + k
            if s < 0:
                continue
            tap = weight[:, k] * x[:, :, s]
            if seq_idx is not None:
                tap = tap * (seq_idx[:, s] == seq_idx[:, t]).to(x.dtype)[:, None]
            acc = acc + tap
        rows.append(acc)
    out = torch.stack(rows, dim=-1)
    return out * torch.sigmoid(out) if silu else out


def scan_reference(u, delta, A, B, C, D, z, delta_bias, softplus):
    """The selective scan token by token; channel c reads group c // (dim // groups)."""
    batch, dim, length = u.shape
    groups = B.shape[1]
    per = dim // groups
    d = delta + (delta_bias[:, None] if delta_bias is not None else 0.0)
    if softplus:
        d = torch.where(d <= 20.0, torch.log1p(torch.exp(torch.clamp(d, max=20.0))), d)
    state = u.new_zeros(batch, dim, A.shape[1])
    outs = []
    for t in range(length):
        Bt = torch.stack([B[:, c // per, :, t] for c in range(dim)], dim=1)          # (b, dim, n)
        Ct = torch.stack([C[:, c // per, :, t] for c in range(dim)], dim=1)
        state = torch.exp(d[:, :, t, None] * A) * state + d[:, :, t, None] * Bt * u[:, :, t, None]
        outs.append((state * Ct).sum(-1))
    out = torch.stack(outs, dim=-1)
    if D is not None:
        out = out + D[:, None] * u
    if z is not None:
        out = out * z * torch.sigmoid(z)
    return out, state


# ---- causal_conv1d ---------------------------------------------------------------------------------------

@st.composite
def conv_problems(draw):
    batch, dim, length, width = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 12)), \
        draw(st.integers(1, 4))
    seq = None
    if draw(st.booleans()):
        rows = []
        for _ in range(batch):
            cuts = sorted(draw(st.sets(st.integers(1, max(1, length - 1)), max_size=3))) if length > 1 else []
            ids, current = [], 0
            for t in range(length):
                if t in cuts:
                    current += 1
                ids.append(current)
            pad = draw(st.integers(0, min(2, length - 1)))
            rows.append(ids[:length - pad] + [-1] * pad)
        seq = torch.tensor(rows, dtype=torch.int32)
    return dict(batch=batch, dim=dim, length=length, width=width, seq_idx=seq, bias=draw(st.booleans()),
                silu=draw(st.booleans()), dtype=draw(st.sampled_from(sorted(DTYPES))), seed=draw(st.integers(0, 999)))


def conv_inputs(p, device):
    """x, weight, bias (or None), the output's cotangent and seq_idx (or None) on ``device``, drawn on the CPU."""
    gen = torch.Generator().manual_seed(p["seed"])
    dt = DTYPES[p["dtype"]]
    x = torch.randn(p["batch"], p["dim"], p["length"], generator=gen, dtype=torch.float64).to(device, dt)
    w = (torch.randn(p["dim"], p["width"], generator=gen, dtype=torch.float64) / p["width"] ** 0.5).to(device, dt)
    b = torch.randn(p["dim"], generator=gen, dtype=torch.float64).to(device, dt) if p["bias"] else None
    dout = torch.randn(p["batch"], p["dim"], p["length"], generator=gen, dtype=torch.float64).to(device, dt)
    seq_idx = p["seq_idx"].to(device) if p["seq_idx"] is not None else None
    return x, w, b, dout, seq_idx


@settings(**SETTINGS)
@given(conv_problems())
def test_causal_conv1d_forward_matches_float64(device, p):
    x, w, b, _, seq_idx = conv_inputs(p, device)
    got = standins.causal_conv1d_fwd(x, w, b, seq_idx, None, None, p["silu"])
    want = conv_reference(x.double(), w.double(), b.double() if b is not None else None, seq_idx, p["silu"])
    assert got.dtype == x.dtype and got.shape == x.shape
    assert relative(got, want) <= 8 * eps(x.dtype), p


@settings(**SETTINGS)
@given(conv_problems(), st.booleans())
def test_causal_conv1d_backward_matches_float64(device, p, into_given_dx):
    x, w, b, dout, seq_idx = conv_inputs(p, device)
    leaves = [x.double().requires_grad_(), w.double().requires_grad_()]
    if b is not None:
        leaves.append(b.double().requires_grad_())
    out = conv_reference(leaves[0], leaves[1], leaves[2] if b is not None else None, seq_idx, p["silu"])
    want = torch.autograd.grad(out, leaves, dout.double())
    given_dx = torch.empty_like(x) if into_given_dx else None
    dx, dw, db, dh0 = standins.causal_conv1d_bwd(x, w, b, dout, seq_idx, None, None, given_dx, False, p["silu"])
    if into_given_dx:
        assert dx is given_dx, "the extension writes dx into the buffer it is given"
    assert dh0 is None and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert relative(dx, want[0]) <= 32 * eps(x.dtype), p
    assert relative(dw, want[1]) <= 32 * eps(x.dtype), p
    if b is not None:
        assert relative(db, want[2]) <= 32 * eps(x.dtype), p


def test_causal_conv1d_fn_is_differentiable_like_the_backward(device):
    p = dict(batch=2, dim=5, length=9, width=4, seq_idx=None, bias=True, silu=True, dtype="float32", seed=3)
    x, w, b, dout, _ = conv_inputs(p, device)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    out = standins.causal_conv1d_fn(*leaves, activation="silu")
    grads = torch.autograd.grad(out, leaves, dout)
    dx, dw, db, _ = standins.causal_conv1d_bwd(x, w, b, dout, None, None, None, None, False, True)
    for a, c in zip(grads, (dx, dw, db)):
        torch.testing.assert_close(a, c)


def test_causal_conv1d_standin_refuses_what_it_does_not_implement(device):
    x, w = torch.zeros(1, 8, 4, device=device), torch.zeros(8, 4, device=device)
    with pytest.raises(standins.StandInError, match="initial/final conv states"):
        standins.causal_conv1d_fwd(x, w, None, None, torch.zeros(1, 8, 3, device=device), None, True)
    with pytest.raises(standins.StandInError, match="activation"):
        standins.causal_conv1d_fn(x, w, activation="relu")
    with pytest.raises(standins.StandInError, match="update"):
        standins.causal_conv1d_cuda.causal_conv1d_update(x, x, w, None, True)


# ---- selective_scan_cuda ---------------------------------------------------------------------------------

@st.composite
def scan_problems(draw):
    groups = draw(st.integers(1, 3))
    dim = groups * draw(st.integers(1, 3))
    return dict(batch=draw(st.integers(1, 2)), dim=dim, groups=groups, dstate=draw(st.integers(1, 5)),
                length=draw(st.integers(1, 10)), D=draw(st.booleans()), z=draw(st.booleans()),
                bias=draw(st.booleans()), softplus=draw(st.booleans()), big_dt=draw(st.booleans()),
                dtype=draw(st.sampled_from(sorted(DTYPES))), seed=draw(st.integers(0, 999)))


def scan_inputs(p, device):
    """The selective scan's tensors (None where the problem has none) and the output's cotangent on ``device``,
    drawn on the CPU."""
    gen = torch.Generator().manual_seed(p["seed"])
    dt = DTYPES[p["dtype"]]
    b, d, g, n, L = p["batch"], p["dim"], p["groups"], p["dstate"], p["length"]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    u = randn(b, d, L).to(dt)
    delta = (F.softplus(randn(b, d, L) - 2.0) + (22.0 if p["big_dt"] else 0.0)).to(dt)
    A = -torch.exp(randn(d, n)).float()
    B, C = randn(b, g, n, L).to(dt), randn(b, g, n, L).to(dt)
    D = randn(d).float() if p["D"] else None
    z = randn(b, d, L).to(dt) if p["z"] else None
    bias = (0.1 * randn(d)).float() if p["bias"] else None
    dout = randn(b, d, L).to(dt)
    tensors = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=bias)
    return {k: t.to(device) if t is not None else None for k, t in tensors.items()}, dout.to(device)


def _double(t):
    return t.double() if t is not None else None


@settings(**SETTINGS)
@given(scan_problems())
def test_selective_scan_forward_matches_float64(device, p):
    t, _ = scan_inputs(p, device)
    res = standins.selective_scan_fwd(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                                      p["softplus"])
    want_out, want_state = scan_reference(*(_double(t[k]) for k in ("u", "delta", "A", "B", "C", "D", "z",
                                                                   "delta_bias")), p["softplus"])
    out = res[2] if p["z"] else res[0]
    assert len(res) == (3 if p["z"] else 2) and out.dtype == t["u"].dtype
    assert relative(out, want_out) <= 8 * eps(t["u"].dtype), p
    last = res[1][:, :, -1, 1::2]                       # where selective_scan_interface reads the last state
    assert relative(last, want_state) <= 8 * eps(torch.float32) * 4, p


@settings(**SETTINGS)
@given(scan_problems())
def test_selective_scan_backward_matches_float64(device, p):
    t, dout = scan_inputs(p, device)
    names = [k for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias") if t[k] is not None]
    leaves = {k: t[k].double().requires_grad_() for k in names}
    out, _ = scan_reference(*(leaves.get(k) for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")),
                            p["softplus"])
    want = dict(zip(names, torch.autograd.grad(out, [leaves[k] for k in names], dout.double())))
    res = standins.selective_scan_bwd(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                                      dout, None, None, None, p["softplus"], False)
    got = dict(zip(("u", "delta", "A", "B", "C", "D", "delta_bias"), res[:7]))
    if p["z"]:
        got["z"] = res[7]
    for k in names:
        # Reductions over tokens (A, D, delta_bias) cancel; per-token gradients are held tighter.
        budget = (64 if k in ("A", "D", "delta_bias") else 32) * eps(t["u"].dtype)
        assert got[k].shape == t[k].shape, k
        assert relative(got[k], want[k]) <= budget, (k, relative(got[k], want[k]), p)


def test_selective_scan_interface_runs_on_the_standin(device):
    """mamba_ssm's selective_scan_fn (its autograd wrapper) drives the stand-in forward and backward."""
    from ssdiff.sides import upstream
    try:
        upstream.mamba_ssm()
    except upstream.Unavailable as err:
        pytest.skip(str(err))
    import sys
    interface = sys.modules.get("mamba_ssm.ops.selective_scan_interface")
    if interface is None or not getattr(interface.selective_scan_cuda, "ssdiff_standin", False):
        pytest.skip("the real selective_scan_cuda is installed here")
    p = dict(batch=1, dim=4, groups=2, dstate=3, length=6, D=True, z=True, bias=True, softplus=True, big_dt=False,
             dtype="float32", seed=1)
    t, dout = scan_inputs(p, device)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if v is not None}
    out = interface.selective_scan_fn(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"],
                                      leaves["D"], leaves["z"], leaves["delta_bias"], True)
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    want_out, _ = scan_reference(*(_double(t[k]) for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")),
                                 True)
    assert relative(out, want_out) <= 8 * eps(torch.float32)
    assert all(torch.isfinite(g).all() for g in grads)


def seq_major(t):
    """A (batch, dim, seqlen) tensor laid out as (batch, seqlen, dim), the view mamba_ssm's callers hand over."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def test_the_standins_allocate_their_outputs_as_the_extensions_do(device):
    """Each output takes the layout of the input the extension allocates it like (`torch::empty_like`): the
    selective scan's out like delta, out_z like z, du, ddelta and dz like u, delta and z; the conv's out and dx like
    x. What mamba_split_conv1d_scan_ref's gated RMSNorm reads is the scan's out rearranged, so its strides follow
    from this (mamba-ref-norm-one-channel: with one channel in one token they are delta's)."""
    p = dict(batch=2, dim=4, groups=2, dstate=3, length=5, D=True, z=True, bias=True, softplus=True, big_dt=False,
             dtype="float32", seed=3)
    t, dout = scan_inputs(p, device)
    u, delta, z = seq_major(t["u"]), seq_major(t["delta"]), seq_major(t["z"])
    out, _, out_z = standins.selective_scan_fwd(u, delta, t["A"], t["B"], t["C"], t["D"], z, t["delta_bias"], True)
    assert out.stride() == delta.stride() != torch.empty(delta.shape).stride()
    assert out_z.stride() == z.stride()
    grads = standins.selective_scan_bwd(u, delta, t["A"], t["B"], t["C"], t["D"], z, t["delta_bias"], seq_major(dout),
                                        None, out, None, True, True)
    assert [g.stride() for g in (grads[0], grads[1], grads[7], grads[8])] == \
        [u.stride(), delta.stride(), z.stride(), out.stride()]
    conv = dict(batch=2, dim=4, length=5, width=3, seq_idx=None, bias=True, silu=True, dtype="float32", seed=4)
    x, w, b, dout, _ = conv_inputs(conv, device)
    x = seq_major(x)
    assert standins.causal_conv1d_fwd(x, w, b, None, None, None, True).stride() == x.stride()
    assert standins.causal_conv1d_fn(x, w, b, activation="silu").stride() == x.stride()
    assert standins.causal_conv1d_bwd(x, w, b, seq_major(dout), None, None, None, None, False, True)[0].stride() \
        == x.stride()
