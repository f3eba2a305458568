"""The quadratic ("dual", attention-like) float64 oracle.

    y = (Lmask o (C B^T)) (dt' x) + D x,   Lmask[t, s] = exp(sum_{s<r<=t} dt'_r A)  for s <= t in one sequence

over the whole sequence at once (O(L^2) memory: for small and medium cases). initial_states enter as
exp(sum_{r<=t} dt'_r A) * (S0 @ C_t) for tokens of sequence 0. Shares no code with the other oracles' scan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssdiff.model.evaluation import Evaluation


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt (b, L, h) after bias, softplus (threshold 20, as F.softplus) and dt_limit."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt, beta=1.0, threshold=20.0)
    lo, hi = dt_limit
    return dt.clamp(min=lo, max=None if hi == math.inf else hi)


def expand_groups(t, nheads):
    """(b, L, g, n) -> (b, L, h, n): each group serves nheads // g consecutive heads."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
         dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None) -> Evaluation:
    b, L, h, p = x.shape
    n = B.shape[-1]
    Q = chunk_size
    nchunks = -(-L // Q)
    has_seq_idx = seq_idx is not None
    seq = seq_idx.long() if has_seq_idx else torch.zeros(b, L, dtype=torch.int64, device=x.device)
    d = process_dt(dt, dt_bias, dt_softplus, dt_limit)                      # (b, L, h)
    dA = d * A                                                              # (b, L, h)
    cs = torch.cumsum(dA, dim=1)                                            # (b, L, h)
    Bh, Ch = expand_groups(B, h), expand_groups(C, h)

    real = seq >= 0                                                         # not padding
    same = (seq[:, :, None] == seq[:, None, :]) & real[:, :, None] & real[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    mask = (same & causal)[:, None]                                         # (b, 1, t, s)
    # log-decay from s to t as a direct sum over (s, t] (a cumsum difference leaves rounding residue where the
    # true decay is exp(0), and its gradient then leaks into dA)
    after = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(diagonal=-1)       # [r, s]: r > s
    terms = torch.where(after, dA.transpose(1, 2)[..., :, None], torch.zeros((), dtype=x.dtype, device=x.device))
    logdecay = torch.cumsum(terms, dim=-2)                                  # (b, h, t, s) = sum_{s<r<=t} dA_r
    Lmask = torch.exp(torch.where(mask, logdecay, torch.full_like(logdecay, -math.inf)))
    scores = torch.einsum("bthn,bshn->bhts", Ch, Bh) * Lmask
    y = torch.einsum("bhts,bsh,bshp->bthp", scores, d, x)

    first_seq = real & (seq == 0)                                           # tokens the initial state feeds
    if initial_states is not None:
        carry = torch.exp(cs) * first_seq[..., None]                        # (b, L, h)
        y = y + torch.einsum("bhpn,bthn,bth->bthp", initial_states, Ch, carry)

    def state_at(row, t):
        """The state (h, p, n) right after token t of batch row `row`."""
        if seq[row, t] < 0:
            return x.new_zeros(h, p, n)
        members = mask[row, 0, t]                                           # (s,) same sequence, s <= t
        w = torch.exp(torch.where(members[:, None], logdecay[row, :, t].T, torch.full_like(cs[row], -math.inf)))
        state = torch.einsum("sh,sh,shp,shn->hpn", w, d[row], x[row], Bh[row])
        if initial_states is not None and bool(first_seq[row, t]):
            state = state + torch.exp(cs[row, t])[:, None, None] * initial_states[row]
        return state

    final = torch.stack([state_at(row, L - 1) for row in range(b)])
    varlen = None
    if b == 1 and has_seq_idx:
        at = seq[0].tolist()                              # read once: a device scalar read per token is a sync
        ends = [t for t in range(L) if at[t] >= 0 and (t == L - 1 or at[t + 1] != at[t])]
        if ends:
            varlen = torch.stack([state_at(0, t) for t in ends])

    stages = {"dt": d, "dA_cumsum": _chunk_cumsum(dA, Q)}
    stages.update(_chunk_stages(x, d, dA, Bh, Ch, seq, initial_states, Q, nchunks, state_at, B, C))
    stages["scan"] = y
    if D is not None:
        y = y + (D[None, None, :, None] if D.dim() == 1 else D[None, None]) * x
        stages["skip"] = y
    if z is not None:
        y = y * F.silu(z)
        stages["gated"] = y
    return Evaluation({"y": y, "final_states": final, "varlen_states": varlen}, stages=stages)


def _chunk_cumsum(dA, Q):
    b, L, h = dA.shape
    pad = (-L) % Q
    padded = F.pad(dA, (0, 0, 0, pad)).reshape(b, -1, Q, h)
    return torch.cumsum(padded, dim=2).reshape(b, -1, h)[:, :L]


def _chunk_stages(x, d, dA, Bh, Ch, seq, initial_states, Q, nchunks, state_at, B, C):
    """Chunk-level stages from the whole-sequence view: passed states are states at chunk ends; a chunk's
    own state is the part of its end state made inside the chunk."""
    b, L, h, p = x.shape
    n = Bh.shape[-1]
    g = B.shape[2]
    passed, local = [], []
    for row in range(b):
        row_passed, row_local = [], []
        for c in range(nchunks):
            start, end = c * Q, min(L, (c + 1) * Q) - 1
            if c == 0:
                row_passed.append(initial_states[row] if initial_states is not None else x.new_zeros(h, p, n))
            else:
                row_passed.append(state_at(row, start - 1))
            if seq[row, end] < 0:
                row_local.append(x.new_zeros(h, p, n))
                continue
            members = (seq[row, start:end + 1] == seq[row, end])            # (s,) in the chunk, same sequence
            cs_local = torch.cumsum(dA[row, start:end + 1], dim=0)          # (s, h)
            w = torch.exp(cs_local[-1][None] - cs_local) * members[:, None]
            row_local.append(torch.einsum("sh,sh,shp,shn->hpn", w, d[row, start:end + 1], x[row, start:end + 1],
                                          Bh[row, start:end + 1]))
        passed.append(torch.stack(row_passed))
        local.append(torch.stack(row_local))
    pad = nchunks * Q - L
    Cp = F.pad(C, (0, 0, 0, 0, 0, pad)).reshape(b, nchunks, Q, g, -1)
    Bp = F.pad(B, (0, 0, 0, 0, 0, pad)).reshape(b, nchunks, Q, g, -1)
    CB = torch.einsum("bcign,bcjgn->bcgij", Cp, Bp)
    return {"chunk_states": torch.stack(local), "passed_states": torch.stack(passed), "CB": CB}
