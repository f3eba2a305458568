"""Pure-torch stand-ins for the two CUDA extensions mamba_ssm reaches for: causal_conv1d and selective_scan_cuda.

On a machine without them (every CPU machine; a GPU machine where they were not built) ssdiff.sides.upstream puts
these in their place, so that mamba_split_conv1d_scan_combined and mamba_split_conv1d_scan_ref can run. They
follow the extensions' calling conventions (argument order, in-place outputs, return tuples), their output
layouts (each output allocated as the extension allocates it, `torch::empty_like` of one input: the selective
scan's out takes delta's strides, not a contiguous layout, which callers that rearrange it rely on) and their
numerics (compute in float32, store in the input dtype), and are checked against float64 in
properties/test_standins.py. Every result computed with one carries a note saying so (`NOTES`).

causal_conv1d (x: (batch, dim, seqlen), weight: (dim, width), bias: (dim,), seq_idx: (batch, seqlen) int32):
    out[b, c, t] = act(bias[c] + sum_k weight[c, k] * x[b, c, t - (width - 1) + k]),
    a tap counting only when its token has the same seq_idx as token t (no initial/final conv states).
selective_scan_cuda (u, delta: (batch, dim, seqlen), A: (dim, dstate) real, B, C: (batch, groups, dstate,
seqlen), D: (dim,), z like u, delta_bias: (dim,)):
    delta' = softplus(delta + delta_bias) (identity above 20);  s_t = exp(delta'_t A) s_{t-1} + delta'_t B_t u_t
    out_t = <s_t, C_t> + D u_t;  out_z = out * silu(z).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

NOTES = {
    "causal_conv1d": "causal_conv1d: the CUDA extension is absent; a float64-checked torch stand-in "
                     "(ssdiff.sides.standins) computed the depthwise conv",
    "selective_scan_cuda": "selective_scan_cuda: the CUDA extension is absent; a float64-checked torch stand-in "
                           "(ssdiff.sides.standins) computed the selective scan",
}


class StandInError(NotImplementedError):
    """The caller asked for something the stand-in does not implement (the real extension would)."""


def _like(template: torch.Tensor, values: torch.Tensor, dtype=None) -> torch.Tensor:
    """``values`` in a tensor allocated as the extensions allocate their outputs, ``torch::empty_like(template)``
    (the template's strides where it is dense), in ``dtype`` (default the template's). Differentiable."""
    out = torch.empty_like(template, dtype=dtype or template.dtype)
    return out.copy_(values)


# ---- causal_conv1d ---------------------------------------------------------------------------------------

def conv_float32(x, weight, bias, seq_idx, silu: bool) -> torch.Tensor:
    """The depthwise causal conv in float32 (differentiable). x (b, dim, L) -> (b, dim, L) float32."""
    xf, wf = x.float(), weight.float()
    width, length = wf.shape[1], xf.shape[-1]
    acc = torch.zeros_like(xf)
    for k in range(width):
        back = width - 1 - k                    # tap k reads the token `back` steps earlier
        if back >= length:
            continue
        src = F.pad(xf, (back, 0))[..., :length]
        if seq_idx is not None and back:
            same = F.pad(seq_idx, (back, 0), value=-(2**30))[..., :length] == seq_idx
            src = src * same[:, None, :].to(src.dtype)
        acc = acc + wf[:, k, None] * src
    if bias is not None:
        acc = acc + bias.float()[:, None]
    return F.silu(acc) if silu else acc


def _no_conv_states(initial_states, final_states_out):
    if initial_states is not None or final_states_out is not None:
        raise StandInError("the causal_conv1d stand-in has no initial/final conv states")


def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
    """causal_conv1d_cuda.causal_conv1d_fwd / causal_conv1d.cpp_functions.causal_conv1d_fwd_function."""
    _no_conv_states(initial_states, final_states_out)
    with torch.no_grad():
        return _like(x, conv_float32(x, weight, bias, seq_idx, bool(silu_activation)))


def causal_conv1d_bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
                      silu_activation):
    """The backward: (dx, dweight, dbias, dinitial_states); writes dx in place when it is given."""
    _no_conv_states(initial_states, dfinal_states)
    if return_dinitial_states:
        raise StandInError("the causal_conv1d stand-in has no initial conv states")
    with torch.enable_grad():
        xf = x.detach().float().requires_grad_(True)
        wf = weight.detach().float().requires_grad_(True)
        bf = bias.detach().float().requires_grad_(True) if bias is not None else None
        out = conv_float32(xf, wf, bf, seq_idx, bool(silu_activation))
        leaves = [xf, wf] + ([bf] if bf is not None else [])
        grads = torch.autograd.grad(out, leaves, dout.float())
    dx = dx.copy_(grads[0]) if dx is not None else _like(x, grads[0])
    dbias = _like(bias, grads[2]) if bias is not None else None
    return dx, _like(weight, grads[1]), dbias, None


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal_conv1d.causal_conv1d_fn: differentiable (torch autograd through the float32 computation)."""
    if activation not in (None, "silu", "swish"):
        raise StandInError(f"activation must be None, silu or swish, got {activation!r}")
    _no_conv_states(initial_states, final_states_out)
    if return_final_states:
        raise StandInError("the causal_conv1d stand-in does not return final conv states")
    return _like(x, conv_float32(x, weight, bias, seq_idx, activation in ("silu", "swish")))


def causal_conv1d_update(*args, **kwargs):
    raise StandInError("the causal_conv1d stand-in has no decode-time update")


causal_conv1d_cuda = types.ModuleType("causal_conv1d_cuda")
causal_conv1d_cuda.__doc__ = "ssdiff stand-in for the causal_conv1d CUDA extension (ssdiff.sides.standins)"
causal_conv1d_cuda.causal_conv1d_fwd = causal_conv1d_fwd
causal_conv1d_cuda.causal_conv1d_bwd = causal_conv1d_bwd
causal_conv1d_cuda.causal_conv1d_update = causal_conv1d_update
causal_conv1d_cuda.ssdiff_standin = True


# ---- selective_scan_cuda ---------------------------------------------------------------------------------

def scan_float32(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """The selective scan in float32 (differentiable). Returns (out, out_z or None, last_state (b, dim, n))."""
    if A.is_complex():
        raise StandInError("the selective_scan stand-in handles real A only")
    uf, dlt, Af = u.float(), delta.float(), A.float()
    batch, dim, length = uf.shape
    if delta_bias is not None:
        dlt = dlt + delta_bias.float()[:, None]
    if delta_softplus:
        dlt = F.softplus(dlt, threshold=20.0)

    def per_channel(M):                          # (b, g, n, L) or (b, n, L) -> (b, dim, n, L)
        M = M.float()
        if M.dim() == 3:
            M = M[:, None]
        return M.repeat_interleave(dim // M.shape[1], dim=1)

    Bc, Cc = per_channel(B), per_channel(C)
    state = uf.new_zeros(batch, dim, Af.shape[1])
    ys = []
    for t in range(length):
        d_t = dlt[:, :, t, None]                                               # (b, dim, 1)
        state = torch.exp(d_t * Af) * state + d_t * Bc[..., t] * uf[:, :, t, None]
        ys.append((state * Cc[..., t]).sum(-1))
    out = torch.stack(ys, dim=-1) if ys else uf.new_zeros(batch, dim, 0)
    if D is not None:
        out = out + D.float()[:, None] * uf
    out_z = out * F.silu(z.float()) if z is not None else None
    return out, out_z, state


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """selective_scan_cuda.fwd: [out, x, (out_z)]; x (b, dim, 1, 2*dstate) holds the last state at 1::2."""
    with torch.no_grad():
        out, out_z, last = scan_float32(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    x = last.new_zeros(*last.shape[:2], 1, 2 * last.shape[-1])
    x[..., 0, 1::2] = last
    result = [_like(delta, out), x]
    if z is not None:
        result.append(_like(z, out_z))
    return result


def selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, dout, x, out, dz, delta_softplus, recompute_out_z):
    """selective_scan_cuda.bwd: du, ddelta, dA, dB, dC, dD, ddelta_bias, [dz, [out_z]] (recomputed in float32)."""
    names = ["u", "delta", "A", "B", "C", "D", "delta_bias", "z"]
    given = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, delta_bias=delta_bias, z=z)
    with torch.enable_grad():
        leaves = {n: given[n].detach().float().requires_grad_(True) for n in names if given[n] is not None}
        res, res_z, _ = scan_float32(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"],
                                     leaves.get("D"), leaves.get("z"), leaves.get("delta_bias"), delta_softplus)
        root = res_z if z is not None else res
        order = [n for n in names if n in leaves]
        grads = dict(zip(order, torch.autograd.grad(root, [leaves[n] for n in order], dout.float())))
    cast = {n: _like(given[n], grads[n]) for n in grads}          # each gradient in its input's dtype
    result = [cast["u"], cast["delta"], cast["A"], cast["B"], cast["C"], cast.get("D"), cast.get("delta_bias")]
    if z is not None:
        result.append(dz.copy_(grads["z"]) if dz is not None else cast["z"])
        if recompute_out_z:
            result.append(_like(out if out is not None else z, res_z.detach()))
    return result


selective_scan_cuda = types.ModuleType("selective_scan_cuda")
selective_scan_cuda.__doc__ = "ssdiff stand-in for the selective_scan CUDA extension (ssdiff.sides.standins)"
selective_scan_cuda.fwd = selective_scan_fwd
selective_scan_cuda.bwd = selective_scan_bwd
selective_scan_cuda.ssdiff_standin = True
