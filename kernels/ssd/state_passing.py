"""Stage 4: the state entering each chunk, and the final state; and its backward (the reverse recurrence).

    H_0 = initial_states (or 0)
    H_{k+1} = keep_k H_k + S_k,    keep_k = exp(cs_last_k) * [seq(last of k) == seq(last of k-1) and >= 0]
    final = H_c                    (seq(last of -1) := 0: initial states survive only into sequence 0)

Backward (G_k = dL/dH_k):  G_c = dfinal;  dS_k = G_{k+1};  G_k = dH_k(from the chunk output) + keep_k G_{k+1};
dinitial = G_0;  dcs_last_k += keep_k <G_{k+1}, H_k>   (written per tile, summed on the host: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .common import last_in_chunk, seq_bounds


@triton.jit
def _keep(dA_cs, seq_idx, i_b, i_h, k, H, NC, L, Q, s_seq_b, s_seq_l, HAS_SEQ_IDX: tl.constexpr):
    b_cs_last = tl.load(dA_cs + ((i_b.to(tl.int64) * H + i_h) * NC + k) * Q + last_in_chunk(k, L, Q))
    seq_last, seq_prev = seq_bounds(seq_idx, i_b.to(tl.int64) * s_seq_b, s_seq_l, k, L, Q, HAS_SEQ_IDX)
    return tl.where((seq_last == seq_prev) & (seq_last >= 0), tl.exp(b_cs_last), 0.0)


@configs.autotune("state_passing", key=["PN"])
@triton.heuristics({"HAS_SEQ_IDX": lambda a: a["seq_idx"] is not None,
                    "HAS_INITIAL_STATES": lambda a: a["initial_states"] is not None})
@triton.jit
def ssd_fwd_kernel_state_passing(
    S, dA_cs, seq_idx, initial_states, passed, final,
    L, H, NC, Q, PN, s_seq_b, s_seq_l,
    HAS_SEQ_IDX: tl.constexpr, HAS_INITIAL_STATES: tl.constexpr, BS: tl.constexpr,
):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_s = i_s * BS + tl.arange(0, BS)
    m_s = o_s < PN
    if HAS_INITIAL_STATES:
        b_state = tl.load(initial_states + i_bh.to(tl.int64) * PN + o_s, mask=m_s, other=0.0).to(tl.float32)
    else:
        b_state = tl.zeros([BS], dtype=tl.float32)
    for k in range(NC):
        o_k = (i_b.to(tl.int64) * NC + k) * H + i_h
        tl.store(passed + o_k * PN + o_s, b_state.to(passed.dtype.element_ty), mask=m_s)
        keep = _keep(dA_cs, seq_idx, i_b, i_h, k, H, NC, L, Q, s_seq_b, s_seq_l, HAS_SEQ_IDX)
        b_S = tl.load(S + o_k * PN + o_s, mask=m_s, other=0.0)
        b_state = keep * b_state + b_S
    tl.store(final + i_bh.to(tl.int64) * PN + o_s, b_state, mask=m_s)


def ssd_state_passing_fwd(chunk_states, dA_cumsum, seq_idx=None, initial_states=None, out_dtype=None):
    """chunk_states (b, c, h, p, n) float32, dA_cumsum (b, h, c, Q), initial_states (b, h, p, n) or None.

    Returns (passed_states (b, c, h, p, n) in ``out_dtype`` (default float32; the recurrence itself runs in
    float32 either way), final_states (b, h, p, n) float32)."""
    b, nc, h, p, n = chunk_states.shape
    Q = dA_cumsum.shape[-1]
    L = seq_idx.shape[1] if seq_idx is not None else nc * Q
    passed = torch.empty_like(chunk_states, dtype=out_dtype or torch.float32)
    final = torch.empty(b, h, p, n, device=chunk_states.device, dtype=torch.float32)
    h0 = initial_states.float().contiguous() if initial_states is not None else None
    seq_strides = seq_idx.stride() if seq_idx is not None else (0, 0)
    ssd_fwd_kernel_state_passing[lambda m: (b * h, triton.cdiv(p * n, m["BS"]))](
        chunk_states, dA_cumsum, seq_idx, h0, passed, final, L, h, nc, Q, p * n, *seq_strides)
    return passed, final


@configs.autotune("bwd_state_passing", key=["PN"])
@triton.heuristics({"HAS_SEQ_IDX": lambda a: a["seq_idx"] is not None,
                    "HAS_DFINAL": lambda a: a["dfinal"] is not None,
                    "HAS_INITIAL_STATES": lambda a: a["dinitial"] is not None})
@triton.jit
def ssd_bwd_kernel_state_passing(
    dH_out, passed, dA_cs, seq_idx, dfinal, dS, dinitial, dkeep,
    L, H, NC, Q, PN, NS, s_seq_b, s_seq_l,
    HAS_SEQ_IDX: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_INITIAL_STATES: tl.constexpr, BS: tl.constexpr,
):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_s = i_s * BS + tl.arange(0, BS)
    m_s = o_s < PN
    if HAS_DFINAL:
        b_G = tl.load(dfinal + i_bh.to(tl.int64) * PN + o_s, mask=m_s, other=0.0).to(tl.float32)
    else:
        b_G = tl.zeros([BS], dtype=tl.float32)
    for kk in range(NC):
        k = NC - 1 - kk
        o_k = (i_b.to(tl.int64) * NC + k) * H + i_h
        tl.store(dS + o_k * PN + o_s, b_G, mask=m_s)
        keep = _keep(dA_cs, seq_idx, i_b, i_h, k, H, NC, L, Q, s_seq_b, s_seq_l, HAS_SEQ_IDX)
        b_H = tl.load(passed + o_k * PN + o_s, mask=m_s, other=0.0)
        # dkeep laid out (b, h, c, NS granules of 16 state elements): one slot per tile, the rest stay 0
        tl.store(dkeep + ((i_bh.to(tl.int64) * NC + k) * NS + i_s * (BS // 16)), keep * tl.sum(b_G * b_H, axis=0))
        b_G = tl.load(dH_out + o_k * PN + o_s, mask=m_s, other=0.0) + keep * b_G
    if HAS_INITIAL_STATES:
        tl.store(dinitial + i_bh.to(tl.int64) * PN + o_s, b_G, mask=m_s)


def ssd_state_passing_bwd(dH_out, passed, dA_cumsum, seq_idx=None, dfinal=None, need_dinitial=False):
    """dH_out (b, c, h, p, n): the gradient reaching each passed state from the chunk output.

    Returns (dchunk_states (b, c, h, p, n), dinitial (b, h, p, n) or None, dcs_last (b, h, c)), float32."""
    b, nc, h, p, n = passed.shape
    Q = dA_cumsum.shape[-1]
    L = seq_idx.shape[1] if seq_idx is not None else nc * Q
    PN = p * n
    dS = torch.empty_like(passed)
    dinit = torch.empty(b, h, p, n, device=passed.device, dtype=torch.float32) if need_dinitial else None
    dfin = dfinal.float().contiguous() if dfinal is not None else None
    seq_strides = seq_idx.stride() if seq_idx is not None else (0, 0)
    ns = triton.cdiv(PN, configs.GRANULE)
    dkeep = torch.empty(b, h, nc, ns, device=passed.device, dtype=torch.float32)
    ssd_bwd_kernel_state_passing[lambda m: (b * h, triton.cdiv(PN, m["BS"]))](
        dH_out, passed, dA_cumsum, seq_idx, dfin, dS, dinit, dkeep, L, h, nc, Q, PN, ns, *seq_strides)
    return dS, dinit, configs.used_slots(dkeep, ssd_bwd_kernel_state_passing, "BS", 3).sum(-1)
