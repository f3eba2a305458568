"""The recurrent float64 oracle: the SSD map as its definition, one token at a time.

    S_t = exp(dt'_t * A_h) * S_{t-1} + dt'_t * outer(x_t, B_t[group(h)])
    y_t = S_t @ C_t[group(h)] + D * x_t

Sequence boundaries (seq_idx) reset S to zero; initial_states feed only the sequence numbered 0; padding
tokens (seq_idx = -1) hold a zero state. O(L) Python steps: slow, obviously right, differentiable.
Shares no code with any kernel and none with the other two oracles' scan.
"""

from __future__ import annotations

import math

import torch

from ssdiff.model.evaluation import Evaluation


def process_dt(dt_t, dt_bias, dt_softplus, dt_limit):
    """dt for one step (b, h): + bias, softplus (identity above 20), clamp to dt_limit."""
    if dt_bias is not None:
        dt_t = dt_t + dt_bias
    if dt_softplus:
        dt_t = torch.where(dt_t <= 20.0, torch.log1p(torch.exp(torch.clamp(dt_t, max=20.0))), dt_t)
    lo, hi = dt_limit
    dt_t = torch.clamp(dt_t, min=lo)
    if hi != math.inf:
        dt_t = torch.clamp(dt_t, max=hi)
    return dt_t


def group_of_head(nheads: int, ngroups: int) -> list[int]:
    """Heads are split into ngroups contiguous blocks."""
    return [head // (nheads // ngroups) for head in range(nheads)]


def starts_new_sequence(seq_idx, t: int):
    """(b,) bool: does token t begin a new sequence? (Token 0 always does.)"""
    if t == 0:
        return torch.ones(seq_idx.shape[0], dtype=torch.bool, device=seq_idx.device)
    return seq_idx[:, t] != seq_idx[:, t - 1]


def scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
         dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None) -> Evaluation:
    """x (b, L, h, p), dt (b, L, h), A (h,), B/C (b, L, g, n), D (h,) or (h, p), z like x, dt_bias (h,),
    initial_states (b, h, p, n), seq_idx (b, L) int. All float64. Returns y (b, L, h, p) and the stages."""
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Q = chunk_size
    nchunks = -(-L // Q)
    heads = group_of_head(h, g)
    has_seq_idx = seq_idx is not None
    if seq_idx is None:
        seq_idx = torch.zeros(b, L, dtype=torch.int64, device=x.device)
    seq_idx = seq_idx.long()
    zeros = x.new_zeros(b, h, p, n)

    S = zeros            # the true state
    S_local = zeros      # the state from zero at the current chunk start (for the chunk_states stage)
    dA_sum = x.new_zeros(b, h)
    ys, dts, dA_cumsums = [], [], []
    chunk_states, passed_states = [], []
    segment_ends = []    # (row, state) at each sequence's last token, in order
    for t in range(L):
        if t % Q == 0:
            passed_states.append(S if t > 0 else (initial_states if initial_states is not None else zeros))
            S_local = zeros
            dA_sum = x.new_zeros(b, h)
        new = starts_new_sequence(seq_idx, t)
        if t == 0:
            start = initial_states if initial_states is not None else zeros
            keep = (seq_idx[:, 0] == 0).to(x.dtype)
            S_prev = start * keep[:, None, None, None]
        else:
            S_prev = torch.where(new[:, None, None, None], zeros, S)
        S_local_prev = torch.where(new[:, None, None, None], zeros, S_local)

        d = process_dt(dt[:, t], dt_bias, dt_softplus, dt_limit)                # (b, h)
        dA = d * A                                                             # (b, h)
        Bt = B[:, t][:, heads]                                                 # (b, h, n)
        Ct = C[:, t][:, heads]
        update = (d[:, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]        # (b, h, p, n)
        decay = torch.exp(dA)[:, :, None, None]
        padding = (seq_idx[:, t] < 0)[:, None, None, None]
        S = torch.where(padding, zeros, decay * S_prev + update)
        S_local = torch.where(padding, zeros, decay * S_local_prev + update)
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ct))
        dts.append(d)
        dA_sum = dA_sum + dA
        dA_cumsums.append(dA_sum)
        if (t + 1) % Q == 0 or t == L - 1:
            chunk_states.append(S_local)
        last_of_segment = (seq_idx[:, t] >= 0) & ((seq_idx[:, t + 1] != seq_idx[:, t]) if t + 1 < L
                                                  else torch.ones_like(seq_idx[:, t], dtype=torch.bool))
        for row in torch.nonzero(last_of_segment).flatten().tolist():
            segment_ends.append((row, S[row]))

    y_scan = torch.stack(ys, dim=1)
    stages = {
        "dt": torch.stack(dts, dim=1),
        "dA_cumsum": torch.stack(dA_cumsums, dim=1),
        "chunk_states": torch.stack(chunk_states, dim=1),
        "passed_states": torch.stack(passed_states, dim=1),
        "CB": _chunk_cb(B, C, Q, nchunks),
        "scan": y_scan,
    }
    y = y_scan
    if D is not None:
        skip = D[:, None] if D.dim() == 1 else D                                 # (h, 1) or (h, p)
        y = y + skip * x
        stages["skip"] = y
    if z is not None:
        y = y * z * torch.sigmoid(z)
        stages["gated"] = y
    varlen = None
    if b == 1 and has_seq_idx and segment_ends:
        varlen = torch.stack([state for _, state in segment_ends])
    return Evaluation({"y": y, "final_states": S, "varlen_states": varlen}, stages=stages)


def _chunk_cb(B, C, Q, nchunks):
    """CB (b, c, g, Q, Q): for each chunk and group, C_i . B_j, element by element over chunks."""
    b, L, g, n = B.shape
    out = B.new_zeros(b, nchunks, g, Q, Q)
    blocks = []
    for c in range(nchunks):
        lo, hi = c * Q, min(L, (c + 1) * Q)
        block = torch.einsum("bign,bjgn->bgij", C[:, lo:hi], B[:, lo:hi])
        blocks.append(torch.nn.functional.pad(block, (0, Q - (hi - lo), 0, Q - (hi - lo))))
    return torch.stack(blocks, dim=1) if blocks else out
