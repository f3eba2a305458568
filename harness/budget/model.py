"""The same-precision model kernel: the chunked evaluation order of every fast SSD kernel, computed the way those
kernels compute, each rounding point as a `ssdiff.budget.rounding.Rounding` says.

- `scan`: the chunked scan (the dA cumsum, exp of segment sums, chunk states, state passing, C.B^T, the D skip,
  the z gate); the products rounded are the ones Mamba-2 kernels round: C, B; B scaled by its decay to the chunk
  end times dt; C.B^T scaled by the intra-chunk decay times dt; the states entering a chunk; x. In the token
  order (``order`` "recurrent", chunk size 1) the state is rounded once each token's own ``B x dt`` is added and
  y read from it, as a token recurrence reads it (the budget of a side whose ``evaluation_order`` is
  "recurrent": its rounding grows with the tokens a state holds).
- `mixer`: the fused mixer around it: the conv1d (its partial sums rounded), ``dt + dt_bias`` and softplus's
  ``exp(x) + 1``, the gated RMSNorm per group, the SwiGLU branch, the out_proj; tensors between stages stored in
  the dtypes kernels store them in (the conv1d output, the scan output the norm reads, the normed output and y
  in the case dtype; dt, dA_cumsum, C.B^T and states in float32; the pre-gate output the z gate's backward reads
  in the case dtype).
- `layer`: the mixer with in_proj in front: torch's ``F.linear`` on the stored u and weight, zxbcdt stored in
  the case dtype, ``A = -exp(A_log)`` in float32.
- `step_scan`: the decode entry's step recurrence of a selective-state-update kernel in float32, one token at a
  time: the state loaded from and stored back in its dtype every step, dt processing (`process_dt`),
  ``exp(A * dt)``, ``B * dt``, the update ``state * dA + dB * x``, the y reduction ``sum(state * C)`` over dstate,
  the D skip's ``x * D``, the z gate.

Backward runs through the same graph in float32, each input's gradient returned in that input's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ssdiff.budget.rounding import EXACT, Rounding, over_rows
from ssdiff.model.case import Case


class _LinearReading(torch.autograd.Function):
    """x @ weight^T (weight (o, d), or one per row (rows, o, d)) whose weight gradient reads ``read`` instead of x:
    the input as the backward recomputes it. x's gradient is the upstream gradient times the weight."""

    @staticmethod
    def forward(ctx, x, read, weight):
        ctx.save_for_backward(read, weight)
        return torch.matmul(x, weight.transpose(-1, -2))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        read, weight = ctx.saved_tensors
        d_weight = torch.matmul(grad.transpose(-1, -2), read)                # (..., o, d)
        if weight.dim() == 2:
            d_weight = d_weight.reshape((-1,) + d_weight.shape[-2:]).sum(0)
        return torch.matmul(grad, weight), None, d_weight


def linear(x, weight, bias, folds: int, read: Optional[torch.Tensor] = None):
    """torch's F.linear; folded, each row with its fold's weight and bias (a batched matmul). ``read``: the input
    the weight's gradient reads, where the backward recomputes it (`_LinearReading`)."""
    if not folds and read is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    w = over_rows(weight, folds, rows) if folds else weight
    out = torch.matmul(x, w.transpose(-1, -2)) if read is None else _LinearReading.apply(x, read, w)
    if bias is None:
        return out
    return out + (over_rows(bias, folds, rows, lead=1) if folds else bias)


def scan(x, dt, A, B, C, *, chunk_size, rounding: Rounding = EXACT, D=None, z=None, dt_bias=None, dt_softplus=False,
         dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, want_varlen=False, folds: int = 0,
         order: str = "chunked"):
    """The model kernel's scan on float32 tensors, rounding as ``rounding`` says.
    Returns (y, final_states, varlen_states, stages) in float32. ``folds``: 0, or the evaluations folded into
    the batch rows (`evaluate_folded`: A, D, dt_bias then carry a leading axis of folds; varlen_states is
    (folds, nseq, h, p, n)). ``order`` "recurrent" (chunk_size 1): each token's y is C times the state after
    it, ``h_t = keep(exp(dA_t) h_t-1 + B_t x_t dt_t)``, as a token recurrence reads it."""
    dot, operand, keep = rounding.dot, rounding.operand, rounding.keep
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Q = chunk_size
    c = -(-L // Q)
    pad = c * Q - L
    r = h // g
    dev = x.device

    A = over_rows(A, folds, b, lead=2)                                       # (h,), or (b, 1, 1, h) folded
    d = keep(process_dt(dt, over_rows(dt_bias, folds, b, lead=1), dt_softplus, dt_limit, rounding))   # (b, L, h) fp32
    seq = seq_idx.long() if seq_idx is not None else torch.zeros(b, L, dtype=torch.long, device=dev)

    def chunks(t):
        if pad:
            t = torch.cat([t, t.new_zeros((b, pad) + t.shape[2:])], dim=1)
        return t.reshape((b, c, Q) + t.shape[2:])

    seq_c = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1).reshape(b, c, Q) if pad else seq.reshape(b, c, Q)
    real_c = seq_c >= 0
    d_c = chunks(d)                                                          # (b, c, Q, h)
    cs = keep(torch.cumsum(d_c * A, dim=2))                                  # fp32 cumsum inside each chunk
    cs_g = cs.reshape(b, c, Q, g, r)
    d_g = d_c.reshape(b, c, Q, g, r)
    x_c = chunks(x).reshape(b, c, Q, g, r, p)
    B_c, C_c = chunks(B), chunks(C)                                          # (b, c, Q, g, n)
    xq = operand(x_c)

    # C.B^T per chunk and group, float32 out.
    Cq, Bq = operand(C_c), operand(B_c)
    CB = keep(torch.einsum("bcign,bcjgn->bcgij", Cq, Bq))                   # (b, c, g, Q, Q)

    # Intra-chunk: (C.B^T * decay(i <- j) * dt_j), rounded as a product operand, times x.
    same = (seq_c[:, :, :, None] == seq_c[:, :, None, :]) & real_c[:, :, :, None] & real_c[:, :, None, :]
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=dev))
    allowed = (same & causal)[:, :, None, None]                              # (b, c, 1, 1, i, j)
    # Segment sums sum_{j<s<=i} dA_s. Forward, their value is cs_i - cs_j in float32, as kernels compute
    # exp(dA_cs_m - dA_cs_k): its rounding grows with |cs|, not with the segment. Backward, the gradient flows
    # through the direct sum, as in the "stable" backward kernels (through cs_i - cs_j it would cancel
    # catastrophically in the gradient of A under strong decay, which Mamba-2's backward avoids).
    dA_g = (d_c * A).reshape(b, c, Q, g, r).permute(0, 1, 3, 4, 2)          # (b, c, g, r, Q)
    later = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=dev), diagonal=-1)   # [s, j]: s > j
    direct = torch.cumsum(torch.where(later, dA_g[..., :, None], torch.zeros((), dtype=dA_g.dtype, device=dev)),
                          dim=-2)                                            # (b, c, g, r, i, j)
    csT = cs_g.permute(0, 1, 3, 4, 2)                                        # (b, c, g, r, Q)
    seg = direct + ((csT[..., :, None] - csT[..., None, :]) - direct).detach()
    decay = rounding.decay(torch.where(allowed, seg, torch.full_like(seg, -math.inf)))
    W = dot(CB[:, :, :, None] * decay * d_g.permute(0, 1, 3, 4, 2)[..., None, :])      # (b, c, g, r, i, j)
    y_diag = torch.einsum("bcgrij,bcjgrp->bcigrp", W, xq)

    # Each chunk's own end state: B scaled by decay-to-end and dt, rounded, times x.
    last_seq = seq_c[:, :, -1]
    own = (seq_c == last_seq[:, :, None]) & real_c                           # (b, c, Q)
    to_end = rounding.decay(seg[..., -1, :]).permute(0, 1, 4, 2, 3) * d_g * own[..., None, None]  # (b, c, Q, g, r)
    Bs = dot(Bq[:, :, :, :, None, :] * to_end[..., None])                    # (b, c, Q, g, r, n)
    chunk_states = keep(torch.einsum("bcjgrp,bcjgrn->bcgrpn", xq, Bs))

    # State passing in float32.
    prev_last = torch.cat([torch.zeros_like(last_seq[:, :1]), last_seq[:, :-1]], dim=1)
    survives = (last_seq == prev_last) & (last_seq >= 0)
    chunk_decay = rounding.decay(cs_g[:, :, -1])
    # Backward, the gradient of the state at each chunk boundary (dstates) runs through the recurrence in
    # float32 but is stored in the input dtype where it is used: for the chunk states' inputs and as the
    # initial states' gradient (Mamba-2's state-passing backward, dstates_dtype=x.dtype).
    state = rounding.grad_store(initial_states.reshape(b, g, r, p, n)) if initial_states is not None \
        else x.new_zeros(b, g, r, p, n)
    passed, state = rounding.pass_states(chunk_states, chunk_decay * survives[..., None, None], state)
    final = state.reshape(b, h, p, n)                                        # passed: (b, c, g, r, p, n)

    # Inter-chunk: C times the entering state (both rounded), scaled by the decay from the chunk start.
    if order == "recurrent":
        if Q != 1:
            raise ValueError(f"the recurrent order is the model at chunk size 1, not {Q}")
        after = torch.cat([passed[:, 1:], state[:, None]], dim=1)            # the state after each token
        y = keep(rounding.grad_operand(torch.einsum("bcign,bcgrpn->bcigrp", Cq, dot(after))))
    else:
        reaches = (seq_c == prev_last[:, :, None]) & real_c
        from_start = rounding.decay(cs_g) * reaches[..., None, None]         # (b, c, Q, g, r)
        y_off = rounding.grad_operand(torch.einsum("bcign,bcgrpn->bcigrp", Cq, dot(passed))) * from_start[..., None]
        y = keep(y_diag + y_off)
    y = y.reshape(b, c * Q, h, p)[:, :L]

    inside = (torch.arange(c * Q, device=dev) < L).reshape(c, Q)
    stages = {
        "dt": d,
        "dA_cumsum": cs.reshape(b, c * Q, h)[:, :L],
        "chunk_states": chunk_states.reshape(b, c, h, p, n),
        "passed_states": passed.reshape(b, c, h, p, n),
        "CB": CB * inside[None, :, None, :, None] * inside[None, :, None, None, :],
        "scan": y,
    }
    varlen = None
    if want_varlen and seq_idx is not None and b == max(folds, 1):
        ends = [sequence_end_states(seq[i], seg[i], cs_g[i], d_g[i], xq[i], Bq[i], passed[i], prev_last[i], Q, L,
                                     rounding.fold(i) if folds else rounding) for i in range(b)]
        varlen = (torch.stack(ends) if ends[0] is not None else None) if folds else ends[0]
    if D is not None:
        # acc += x * D in float32 (mamba_ssm ssd_chunk_scan.py): the scan and the skip may cancel.
        per_head = D.dim() == (2 if folds else 1)
        D = over_rows(D, folds, b, lead=1)
        y = y + keep((D[..., None] if per_head else D) * x)
        stages["skip"] = y
    if z is not None:
        y = rounding.gate(y, z)
        stages["gated"] = y
    return y, final, varlen, stages


def process_dt(dt, dt_bias, dt_softplus, dt_limit, rounding: Rounding = EXACT):
    """dt as the chunk-cumsum kernel computes it in float32 (mamba_ssm ssd_chunk_state.py,
    _chunk_cumsum_fwd_kernel): ``dt += dt_bias``, softplus below 20, clamped to dt_limit. The softplus is
    Triton 3's ``log(exp(x) + 1)`` (mamba_ssm/ops/triton/softplus.py, both releases): ``exp(x) + 1`` rounds to
    float32 first, an absolute error of u that the log hands on unchanged, so dt ~ 0.05 (the usual pre-softplus
    -3) carries u / dt ~ 20 units of relative error. Both sums are rounding points. The clamp's gradient passes a
    value exactly on a bound, as the kernels' and the oracle's do."""
    keep = rounding.keep
    if dt_bias is not None:
        dt = keep(dt + dt_bias)
    if dt_softplus:
        below = dt <= 20.0
        dt = torch.where(below, torch.log(keep(torch.exp(torch.where(below, dt, torch.zeros_like(dt))) + 1.0)), dt)
    low, high = dt_limit
    return dt.clamp(min=low, max=None if high == math.inf else high)


def step_scan(x, dt, A, B, C, state, *, rounding: Rounding = EXACT, state_precision: str = "float32", D=None,
              z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf), folds: int = 0):
    """The model step kernel: ``x.shape[1]`` single-token steps from ``state`` on float32 tensors.

    x (b, s, h, p), dt (b, s, h), A (h,), B/C (b, s, g, n), state (b, h, p, n) as loaded (already in its dtype),
    D (h,) or (h, p), z like x, dt_bias (h,). As mamba_ssm's _selective_scan_update_kernel computes a step with
    the per-head parameters broadcast over headdim (Mamba-2's tie_hdim): dt (+ dt_bias, softplus) once per head
    in float32; dA = exp(A * dt); dB = B * dt; state = state * dA + dB * x, stored back in ``state_precision``;
    y = sum_n state * C in float32; y += x * D; y *= silu(z). Returns (y (b, s, h, p), final state), float32.
    ``folds`` as for `scan`."""
    keep = rounding.keep
    b, steps, h, p = x.shape
    g = B.shape[2]
    heads = torch.arange(h, device=x.device) // (h // g)
    A, dt_bias = over_rows(A, folds, b), over_rows(dt_bias, folds, b)
    per_head = D is not None and D.dim() == (2 if folds else 1)
    D = over_rows(D, folds, b)
    ys = []
    for t in range(steps):
        d = process_dt(dt[:, t], dt_bias, dt_softplus, dt_limit, rounding)             # (b, h)
        dA = keep(rounding.decay(keep(A * d)))[..., None, None]                # (b, h, 1, 1)
        dB = keep(B[:, t][:, heads] * d[..., None])                            # (b, h, n)
        update = keep(dB[:, :, None, :] * x[:, t][..., None])                  # (b, h, p, n)
        state = rounding._apply(keep(keep(state * dA) + update), state_precision)
        y = keep((state * C[:, t][:, heads][:, :, None, :]).sum(-1))           # (b, h, p)
        if D is not None:
            y = keep(y + keep((D[..., None] if per_head else D) * x[:, t]))
        if z is not None:
            y = y * F.silu(z[:, t])
        ys.append(y)
    return torch.stack(ys, dim=1), state


def conv(xBC, weight, bias, seq, activation, rounding: Rounding = EXACT, folds: int = 0,
          stored_before_activation: bool = False):
    """The depthwise causal conv1d as causal_conv1d computes it (float32; the bias first, then one
    multiply-add per tap, oldest first), each partial sum a rounding point: where the taps cancel, their
    rounding (u times the partial sums) is most of the output's error. A tap from another sequence (seq_idx)
    counts nothing. ``stored_before_activation``: the conv output is stored (`Rounding.store`) before the
    activation, as a layer that runs torch's conv1d and its silu as two ops does; silu's slope magnifies that
    rounding for negative inputs (relative by |1 + a (1 - sigmoid(a))|, 9 at a = -10). (b, L, ch) -> (b, L, ch)."""
    b, L, ch = xBC.shape
    W = weight.shape[-1]
    weight = over_rows(weight, folds, b, lead=1)                             # (ch, W), or (b, 1, ch, W) folded
    acc = over_rows(bias, folds, b, lead=1).expand(b, L, ch)
    for k in range(W):
        shift = W - 1 - k                                                    # tap k reads `shift` tokens back
        if shift >= L:
            continue
        src = F.pad(xBC, (0, 0, shift, 0))[:, :L]
        if shift:
            src = src * (F.pad(seq, (shift, 0), value=-2)[:, :L] == seq).to(src.dtype)[..., None]
        acc = rounding.keep(acc + weight[..., k] * src)
    if activation != "silu":
        return acc
    return F.silu(rounding.store(acc) if stored_before_activation else acc)


def norm(y, z, weight, ngroups, eps, norm_before_gate, rounding: Rounding = EXACT):
    """The gated RMSNorm as mamba_ssm's layer-norm kernels compute it in float32: the normalized value a rounding
    point (`Rounding.keep`) on the way forward, and so is its gradient, dy * weight, on the way back, where the
    backward kernel takes the component of dy * weight orthogonal to the normalized value (a difference of terms
    that can be far larger than the result, each rounded in float32)."""
    gate = F.silu(z)
    v = y if norm_before_gate else y * gate
    grouped = v.unflatten(-1, (ngroups, -1))
    normalized = rounding.keep(grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps))
    normed = normalized.flatten(-2) * weight
    return normed * gate if norm_before_gate else normed


def swiglu(zx0, d_nonssm, rounding: Rounding = EXACT):
    """The SwiGLU branch as mamba_ssm's _swiglu_fwd_kernel computes it in float32 (k_activations.py:
    ``x * tl.sigmoid(x) * y``), each product a rounding point."""
    x, y = zx0.split(d_nonssm, dim=-1)
    keep = rounding.keep
    return keep(keep(x * keep(torch.sigmoid(x))) * y)


def sequence_end_states(seq, seg, cs_g, d_g, x_c, B_c, passed, prev_last, Q, L, rounding: Rounding = EXACT):
    """The state after the last token of each sequence of one batch row, in float32: (nseq, h, p, n); the
    products' operands rounded as for the chunk states (B scaled by decay and dt; the entering state)."""
    at, before = seq.tolist(), prev_last.tolist()           # read once: a device scalar read per token is a sync
    ends = [t for t in range(L) if at[t] >= 0 and (t == L - 1 or at[t + 1] != at[t])]
    states = []
    for t in ends:
        k, i = divmod(t, Q)
        members = seq[k * Q:k * Q + i + 1] == at[t]
        w = rounding.decay(seg[k, :, :, i, :i + 1]).permute(2, 0, 1) * d_g[k, :i + 1] * members[:, None, None]
        Bs = rounding.dot(B_c[k, :i + 1, :, None, :] * w[..., None])                     # (j, g, r, n)
        state = torch.einsum("jgrp,jgrn->grpn", x_c[k, :i + 1], Bs)
        if at[t] == before[k]:
            state = state + rounding.decay(cs_g[k, i])[..., None, None] * rounding.dot(passed[k])
        g, r, p, n = state.shape
        states.append(state.reshape(g * r, p, n))
    return torch.stack(states) if states else None


def mixer_scan(case: Case, rounding: Rounding, x, dt, A, B, C, *, D, z, dt_bias, initial_states, seq_idx, folds):
    """The mixer's scan: the chunked model, or for a decoded layer (``layer_steps``) the chunked model over the
    prefill and the step model (`step_scan`) over the decoded tokens from its final state, held in the state
    dtype of the layer's cache (its in_proj's dtype: the case dtype). Returns (y, final, stages); a decoded
    layer exposes no SSD stages (its steps have none)."""
    kw = dict(rounding=rounding, dt_bias=dt_bias, dt_softplus=True, dt_limit=case.dt_limit_or_default, folds=folds)
    if not (case.entry == "layer" and case.layer_steps):
        y, final, _, stages = scan(x, dt, A, B, C, chunk_size=case.chunk_size, D=D, z=z, initial_states=initial_states,
                                   seq_idx=seq_idx, **kw)
        return y, final, stages
    P = case.seqlen - case.layer_steps
    cut = lambda t, a, b: t[:, a:b] if t is not None else None
    y0, state, _, _ = scan(cut(x, 0, P), cut(dt, 0, P), A, cut(B, 0, P), cut(C, 0, P), chunk_size=case.chunk_size,
                           D=D, z=cut(z, 0, P), **kw)
    state = rounding._apply(state, case.dtype)              # the cache holds the state in the case dtype
    y1, final = step_scan(cut(x, P, None), cut(dt, P, None), A, cut(B, P, None), cut(C, P, None), state,
                          state_precision=case.dtype, D=D, z=cut(z, P, None), **kw)
    return torch.cat([y0, y1], dim=1), final, {}


def mixer(tensors, case: Case, seq_idx, rounding: Rounding, folds: int):
    """The fused mixer: conv1d (stored in the case dtype) -> scan -> gated RMSNorm (stored) -> out_proj.
    ``folds`` as for `scan` (the parameters carry a leading axis of folds)."""
    h, p, g, n = case.nheads, case.headdim, case.ngroups, case.dstate
    dim = case.dim
    b, L, _ = tensors["zxbcdt"].shape
    zx0, z, xBC, dt = torch.split(tensors["zxbcdt"], [2 * case.d_nonssm, dim, dim + 2 * g * n, h], dim=-1)
    seq = seq_idx.long() if seq_idx is not None else torch.zeros(b, L, dtype=torch.long, device=xBC.device)
    store = rounding.store
    # fla's and transformers' torch paths run torch's conv1d and then the activation: a layer's conv output is
    # stored before it (the fused mixer's conv applies silu to its float32 sum)
    xBC = store(conv(xBC, tensors["conv1d_weight"], tensors["conv1d_bias"], seq, case.activation, rounding, folds,
                      stored_before_activation=case.entry == "layer"))
    x, B, C = torch.split(xBC, [dim, g * n, g * n], dim=-1)
    rms = tensors.get("rmsnorm_weight")
    zh = z.unflatten(-1, (h, p))
    # Without the norm the scan gates in float32, and with an out_proj the fused backward (mamba_ssm's
    # MambaSplitConv1dScanCombinedFn, recompute_output) takes the weight's gradient from the gated output its dz
    # kernel recomputes from the pre-gate output the forward stored in the case dtype: recomputed here, gated here.
    recompute = (case.backward and rms is None and "outproj_weight" in tensors
                 and not (case.entry == "layer" and case.layer_steps))
    y, final, stages = mixer_scan(
        case, rounding, x.unflatten(-1, (h, p)), dt, tensors["A"], B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)),
        D=tensors["D"], z=None if rms is not None or recompute else zh, dt_bias=tensors["dt_bias"],
        initial_states=tensors.get("initial_states"), seq_idx=seq_idx, folds=folds)
    stages = {"conv": xBC, **stages}
    recomputed = None
    if recompute:
        recomputed = store(store(y.detach()) * F.silu(zh.detach())).flatten(-2)
        y = stages["gated"] = rounding.gate(y, zh)
    y = y.flatten(-2)
    if rms is not None:
        # The chunk scan writes y in the case dtype and the norm kernel reads it (and writes the gradient of its
        # input in that dtype on the way back): both rounding points, which the norm's cancellation can amplify
        # (measured: one token, a 2-wide group, fp16: a gradient of D 0.55 off relative, in mamba's fused mixer,
        # its ref and ssdiff's kernel alike, bit for bit).
        y = norm(store(y), z, over_rows(rms, folds, b, lead=1), g, case.rmsnorm_eps, case.norm_before_gate, rounding)
    if case.d_nonssm:
        branch = swiglu(zx0, case.d_nonssm, rounding)
        y = torch.cat([branch, y], dim=-1)
        if recomputed is not None:
            recomputed = torch.cat([branch.detach(), recomputed], dim=-1)
    if rms is not None or case.d_nonssm:
        y = store(y)
        stages["normed"] = y
    if "outproj_weight" in tensors:
        y = linear(rounding.linear_operand(y), rounding.linear_operand(tensors["outproj_weight"]),
                    tensors.get("outproj_bias"), folds,
                    read=None if recomputed is None else rounding.linear_operand(recomputed))
    return y, final, stages


def layer(tensors, case: Case, seq_idx, rounding: Rounding, folds: int):
    """The whole layer: in_proj (torch's F.linear, its output stored in the case dtype: every layer hands zxbcdt
    to its kernels in it), A = -exp(A_log) in float32, then the fused mixer model (`mixer`)."""
    u = tensors["u"]
    zxbcdt = rounding.store(linear(rounding.linear_operand(u), rounding.linear_operand(tensors["in_proj_weight"]),
                                    tensors.get("in_proj_bias"), folds))
    bias = tensors.get("conv1d_bias")
    mixer_tensors = dict(tensors, zxbcdt=zxbcdt, A=rounding.keep(-torch.exp(tensors["A_log"])),
                         conv1d_bias=bias if bias is not None else u.new_zeros(tensors["conv1d_weight"].shape[:-1]))
    y, final, stages = mixer(mixer_tensors, case, seq_idx, rounding, folds)
    return y, final, {"in_proj": zxbcdt, **stages}


__all__ = ["linear", "scan", "process_dt", "step_scan", "conv", "norm", "swiglu", "sequence_end_states", "mixer_scan", "mixer", "layer"]
