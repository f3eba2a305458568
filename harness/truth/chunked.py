"""The chunked float64 oracle: the evaluation order of every fast kernel, vectorized.

Inside each chunk of Q tokens the quadratic form; between chunks a state carried forward:

    dA_cumsum -> chunk_states (each chunk's own end state) -> passed_states (state entering each chunk)
    -> CB (C B^T per chunk and group) -> scan (intra-chunk part + C . passed state)

Memory is O(b c h Q^2 + b c h p n): runs L = 65536, h = 128 on a large GPU. Groups stay groups (no
expansion to heads) in the heavy contractions. Shares no code with the other oracles' scan.
"""

from __future__ import annotations

import math

import torch

from ssdiff.model.evaluation import Evaluation


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt after bias, softplus (log(1 + e^x) below 20, identity above) and dt_limit: torch.clamp, whose gradient
    passes a value exactly on a bound (torch.maximum / torch.minimum would halve it there)."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        below = dt <= 20.0
        dt = torch.where(below, torch.log(1.0 + torch.exp(torch.where(below, dt, torch.zeros_like(dt)))), dt)
    low, high = dt_limit
    return dt.clamp(min=low, max=None if high == math.inf else high)


def scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
         dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None) -> Evaluation:
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Q = chunk_size
    c = -(-L // Q)
    pad = c * Q - L
    r = h // g                                       # heads per group: head = group * r + j
    has_seq_idx = seq_idx is not None

    d = process_dt(dt, dt_bias, dt_softplus, dt_limit)                       # (b, L, h)
    seq = seq_idx.long() if has_seq_idx else torch.zeros(b, L, dtype=torch.long, device=x.device)
    # Pad to whole chunks with tokens that change nothing: dt = 0 (no decay, no input), same sequence as
    # the last real token.
    def chunks(t, fill=0.0):
        if pad:
            t = torch.cat([t, t.new_full((b, pad) + t.shape[2:], fill)], dim=1)
        return t.reshape((b, c, Q) + t.shape[2:])
    seq_c = chunks(seq) if not pad else torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1).reshape(b, c, Q)
    real_c = seq_c >= 0
    d_c = chunks(d)                                                          # (b, c, Q, h)
    dA_c = d_c * A
    cs = torch.cumsum(dA_c, dim=2)                                           # (b, c, Q, h)
    x_c = chunks(x).reshape(b, c, Q, g, r, p)
    B_c, C_c = chunks(B), chunks(C)                                          # (b, c, Q, g, n)
    cs_g = cs.reshape(b, c, Q, g, r)
    dx = d_c.reshape(b, c, Q, g, r)[..., None] * x_c                        # (b, c, Q, g, r, p)

    # Decay between tokens i >= j of a chunk as a direct sum over (j, i] — not a difference of cumsums,
    # which leaves rounding residue (and gradient residue) where the true decay is exactly exp(0) or exp(-1e3).
    dA_g = dA_c.reshape(b, c, Q, g, r).permute(0, 1, 3, 4, 2)                 # (b, c, g, r, Q)
    strictly_below = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=x.device), diagonal=-1)
    terms = torch.where(strictly_below, dA_g[..., :, None].expand(*dA_g.shape, Q), torch.zeros((), dtype=x.dtype,
                                                                                              device=x.device))
    seg = torch.cumsum(terms, dim=-2)                                        # seg[i, j] = sum_{j<k<=i} dA_k

    # Intra-chunk (diagonal blocks).
    CB = torch.einsum("bcign,bcjgn->bcgij", C_c, B_c)                       # (b, c, g, Q, Q)
    same = (seq_c[:, :, :, None] == seq_c[:, :, None, :]) & real_c[:, :, :, None] & real_c[:, :, None, :]
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=x.device))
    allowed = (same & causal)[:, :, None, None]                              # (b, c, 1, 1, i, j)
    decay = torch.exp(torch.where(allowed, seg, torch.full_like(seg, -math.inf)))
    y_diag = torch.einsum("bcgij,bcgrij,bcjgrp->bcigrp", CB, decay, dx)

    # Each chunk's own end state: tokens of the same sequence as the chunk's last token.
    last_seq = seq_c[:, :, -1]                                               # (b, c)
    own = (seq_c == last_seq[:, :, None]) & real_c                           # (b, c, Q)
    to_end = torch.exp(seg[..., -1, :]).permute(0, 1, 4, 2, 3) * own[..., None, None]   # (b, c, Q, g, r)
    chunk_states = torch.einsum("bcjgr,bcjgrp,bcjgn->bcgrpn", to_end, dx, B_c)  # (b, c, g, r, p, n)

    # Carry states across chunks. A state survives chunk k iff the sequence does not change in it.
    prev_last = torch.cat([torch.zeros_like(last_seq[:, :1]), last_seq[:, :-1]], dim=1)   # before chunk k
    survives = (last_seq == prev_last) & (last_seq >= 0)                     # (b, c)
    keep = torch.exp(cs_g[:, :, -1]) * survives[..., None, None]             # (b, c, g, r)
    initial = (initial_states.reshape(b, g, r, p, n) if initial_states is not None
               else x.new_zeros(b, g, r, p, n))
    states = _CarryStates.apply(chunk_states, keep, initial)                 # (b, c + 1, g, r, p, n)
    passed = states[:, :c]                                                   # the state entering each chunk
    final = states[:, c].reshape(b, h, p, n)

    # Inter-chunk (off-diagonal) part: tokens of the sequence that was running at the chunk start.
    reaches = (seq_c == prev_last[:, :, None]) & real_c                      # (b, c, Q)
    from_start = torch.exp(cs_g) * reaches[..., None, None]                  # (b, c, Q, g, r)
    y_off = torch.einsum("bcign,bcgrpn,bcigr->bcigrp", C_c, passed, from_start)
    y = (y_diag + y_off).reshape(b, c * Q, h, p)[:, :L]

    stages = {
        "dt": d,
        "dA_cumsum": cs.reshape(b, c * Q, h)[:, :L],
        "chunk_states": chunk_states.reshape(b, c, h, p, n),
        "passed_states": passed.reshape(b, c, h, p, n),
        "CB": CB * (torch.arange(c * Q, device=x.device) < L).reshape(c, Q)[None, :, None, :, None]
        * (torch.arange(c * Q, device=x.device) < L).reshape(c, Q)[None, :, None, None, :],
        "scan": y,
    }

    varlen = None
    if has_seq_idx and b == 1:
        varlen = _sequence_end_states(seq[0], seg[0], cs_g[0], dx[0], B_c[0], passed[0], prev_last[0], Q, L)

    if D is not None:
        y = y + (D[:, None] if D.dim() == 1 else D) * x
        stages["skip"] = y
    if z is not None:
        y = y * (z / (1.0 + torch.exp(-z)))
        stages["gated"] = y
    return Evaluation({"y": y, "final_states": final, "varlen_states": varlen}, stages=stages)


class _CarryStates(torch.autograd.Function):
    """The states between chunks, S_0 = initial, S_{k+1} = keep_k S_k + chunk_states_k, as one autograd function:
    (b, c + 1, g, r, p, n): one fused multiply-add a chunk each way, where a loop of autograd nodes would make the
    chunks most of a long case's operations. Backward: with G_k the gradient reaching S_k
    directly, the whole gradient of S_k is T_c = G_c, T_k = G_k + keep_k T_{k+1}; chunk_states_k gets T_{k+1},
    keep_k gets sum over (p, n) of T_{k+1} S_k, the initial state T_0."""

    @staticmethod
    def forward(ctx, chunk_states, keep, initial):
        b, c = chunk_states.shape[:2]
        keep6 = keep[..., None, None]
        states = chunk_states.new_empty((b, c + 1) + chunk_states.shape[2:])
        at = states.unbind(1)
        at[0].copy_(initial)
        for k, (add, mul) in enumerate(zip(chunk_states.unbind(1), keep6.unbind(1))):
            torch.addcmul(add, mul, at[k], out=at[k + 1])
        ctx.save_for_backward(keep6, states)
        return states

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        keep6, states = ctx.saved_tensors
        c = keep6.shape[1]
        whole = torch.empty_like(grad)
        at, g_at, mul_at = whole.unbind(1), grad.unbind(1), keep6.unbind(1)
        at[c].copy_(g_at[c])
        for k in reversed(range(c)):
            torch.addcmul(g_at[k], mul_at[k], at[k + 1], out=at[k])
        d_keep = (whole[:, 1:] * states[:, :c]).sum((-1, -2))
        return whole[:, 1:], d_keep, whole[:, 0]


def _sequence_end_states(seq, seg, cs_g, dx, B_c, passed, prev_last, Q, L):
    """The state after the last token of each sequence of one batch row: (nseq, h, p, n)."""
    at, before = seq.tolist(), prev_last.tolist()           # read once: a device scalar read per token is a sync
    ends = [t for t in range(L) if at[t] >= 0 and (t == L - 1 or at[t + 1] != at[t])]
    states = []
    for t in ends:
        k, i = divmod(t, Q)
        members = (seq[k * Q:k * Q + i + 1] == at[t])                     # tokens of this chunk up to t
        w = torch.exp(seg[k, :, :, i, :i + 1]).permute(2, 0, 1) * members[:, None, None]   # (j, g, r)
        state = torch.einsum("jgr,jgrp,jgn->grpn", w, dx[k, :i + 1], B_c[k, :i + 1])
        if at[t] == before[k]:
            state = state + torch.exp(cs_g[k, i])[..., None, None] * passed[k]
        g, r, p, n = state.shape
        states.append(state.reshape(g * r, p, n))
    return torch.stack(states) if states else None
