"""Stage 3: each chunk's own end state (from zero at the chunk start), and the same reduction run backward.

    forward  S[b, c, h] = sum_j own_j exp(cs_last - cs_j) dt_j  x_j^T B_j        (p, n)
             own_j: token j belongs to the sequence of the chunk's last token (and is not padding)
    backward dH[b, c, h] = sum_i reach_i exp(cs_i)  ds_i^T C_i                     (p, n)
             reach_i: token i belongs to the sequence running when the chunk starts; ds = dL/d(scan output)

One kernel, two weightings (``MODE``): both are "weighted x^T B over the tokens of one chunk".
Also the varlen end states (one state per sequence of a packed batch-1 row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .common import idx64, in_chunk, last_in_chunk, load_seq, seq_bounds, tile_major


@triton.heuristics({"HAS_SEQ_IDX": lambda a: a["seq_idx"] is not None})
@triton.jit
def ssd_kernel_chunk_state(
    X, Bm, dt_out, dA_cs, seq_idx, S,
    L, H, G, NC, Q, P, N,
    s_x_b, s_x_l, s_x_h, s_x_p,
    s_b_b, s_b_l, s_b_g, s_b_n,
    s_seq_b, s_seq_l,
    MODE: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, IDX64: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    n_n = tl.cdiv(N, BN)
    i_bch, i_pn = tile_major(tl.cdiv(P, BP) * n_n)
    i_p, i_n = i_pn // n_n, i_pn % n_n
    i_b, i_c, i_h = i_bch // (NC * H), (i_bch // H) % NC, i_bch % H
    i_g = i_h // (H // G)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = i_n * BN + tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N

    o_seq = i_b.to(tl.int64) * s_seq_b
    seq_last, seq_prev = seq_bounds(seq_idx, o_seq, s_seq_l, i_c, L, Q, HAS_SEQ_IDX)
    o_cs = ((i_b.to(tl.int64) * H + i_h) * NC + i_c) * Q
    t_0 = i_c * Q                                  # the chunk's first token
    n_q = tl.minimum(Q, L - t_0)                   # its tokens before L
    b_cs_last = tl.load(dA_cs + o_cs + last_in_chunk(i_c, L, Q))
    p_X = X + i_b.to(tl.int64) * s_x_b + t_0.to(tl.int64) * s_x_l + i_h * s_x_h + o_p[:, None] * s_x_p
    p_B = Bm + i_b.to(tl.int64) * s_b_b + t_0.to(tl.int64) * s_b_l + i_g * s_b_g + o_n[None, :] * s_b_n
    b_acc = tl.zeros([BP, BN], dtype=tl.float32)
    for k in range(0, n_q, BK):
        o_q = k + tl.arange(0, BK)
        o_t = t_0 + o_q
        m_t = o_q < n_q
        b_cs = tl.load(dA_cs + o_cs + o_q, mask=o_q < Q, other=0.0)
        b_seq = load_seq(seq_idx, o_seq, s_seq_l, o_t, o_q < Q, L, seq_last, HAS_SEQ_IDX)
        if MODE == 0:
            b_dt = tl.load(dt_out + o_cs + o_q, mask=o_q < Q, other=0.0)
            m_w = m_t & (b_seq == seq_last) & (b_seq >= 0)
            b_w = tl.where(m_w, tl.exp(b_cs_last - b_cs) * b_dt, 0.0)
        else:
            m_w = m_t & (b_seq == seq_prev) & (b_seq >= 0)
            b_w = tl.where(m_w, tl.exp(b_cs), 0.0)
        o_k = in_chunk(o_q, IDX64)
        b_x = tl.load(p_X + o_k[None, :] * s_x_l, mask=m_p[:, None] & m_t[None, :], other=0.0)
        b_b = tl.load(p_B + o_k[:, None] * s_b_l, mask=m_t[:, None] & m_n[None, :], other=0.0)
        if MODE == 0:
            # B scaled by its decay to the chunk end and dt, rounded to the input dtype (as Mamba-2 kernels)
            b_bw = (b_b.to(tl.float32) * b_w[:, None]).to(b_x.dtype)                     # [BK, BN]
            b_acc += tl.dot(b_x, b_bw)
        else:
            b_acc += tl.dot((b_x.to(tl.float32) * b_w[None, :]).to(b_b.dtype), b_b)
    p_S = S + i_bch.to(tl.int64) * P * N + o_p[:, None] * N + o_n[None, :]
    tl.store(p_S, b_acc, mask=m_p[:, None] & m_n[None, :])


# The same kernel under two autotuners (two names, two config lists).
ssd_fwd_kernel_chunk_state = configs.autotune("chunk_state", key=["Q", "P", "N", "MODE"])(ssd_kernel_chunk_state)
ssd_bwd_kernel_dstates = configs.autotune("bwd_dstates", key=["Q", "P", "N", "MODE"])(ssd_kernel_chunk_state)


def _chunk_reduce(mode, X, Bm, dt_out, dA_cs, seq_idx):
    b, L, h, p = X.shape
    g, n = Bm.shape[2], Bm.shape[3]
    _, _, nc, Q = dA_cs.shape
    S = torch.empty(b, nc, h, p, n, device=X.device, dtype=torch.float32)
    seq_strides = seq_idx.stride() if seq_idx is not None else (0, 0)
    kernel = ssd_fwd_kernel_chunk_state if mode == 0 else ssd_bwd_kernel_dstates
    kernel[lambda m: (b * nc * h * triton.cdiv(p, m["BP"]) * triton.cdiv(n, m["BN"]),)](
        X, Bm, dt_out, dA_cs, seq_idx, S, L, h, g, nc, Q, p, n, *X.stride(), *Bm.stride(), *seq_strides, MODE=mode,
        IDX64=idx64(Q, X.stride(1), Bm.stride(1)))
    return S


def ssd_chunk_state_fwd(x, B, dt_out, dA_cumsum, seq_idx=None):
    """x (b, L, h, p), B (b, L, g, n), dt_out / dA_cumsum (b, h, c, Q) float32, seq_idx (b, L) int32 or None.

    Returns chunk_states (b, c, h, p, n) float32: each chunk's end state from zero, over the tokens of the
    sequence of the chunk's last token (zero when that token is padding)."""
    return _chunk_reduce(0, x, B, dt_out, dA_cumsum, seq_idx)


def ssd_dstates_bwd(ds, C, dA_cumsum, seq_idx=None):
    """The gradient reaching each passed state from the chunk output: (b, c, h, p, n) float32."""
    return _chunk_reduce(1, ds, C, dA_cumsum, dA_cumsum, seq_idx)


# ---- varlen end states -------------------------------------------------------------------------------------

@configs.autotune("varlen_states", key=["Q", "P", "N"])
@triton.jit
def ssd_fwd_kernel_varlen_states(
    X, Bm, dt_out, dA_cs, seq_idx, passed, cu_seqlens, out,
    L, H, G, NC, Q, P, N,
    s_x_l, s_x_h, s_x_p, s_b_l, s_b_g, s_b_n, s_seq_l,
    BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Batch 1: the state after the last token of sequence s = program_id(0) // H."""
    i_sh, i_pn = tl.program_id(0), tl.program_id(1)
    n_n = tl.cdiv(N, BN)
    i_p, i_n = i_pn // n_n, i_pn % n_n
    i_s, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = i_n * BN + tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    t_last = tl.load(cu_seqlens + i_s + 1) - 1
    empty = t_last < tl.load(cu_seqlens + i_s)          # no token: nothing of the pack is its state
    t_end = tl.maximum(t_last, 0)
    i_c = t_end // Q
    q_end = t_end - i_c * Q
    seq_end = tl.load(seq_idx + t_end.to(tl.int64) * s_seq_l)
    seq_prev = tl.load(seq_idx + (i_c * Q - 1).to(tl.int64) * s_seq_l, mask=i_c > 0, other=0)
    o_cs = (i_h.to(tl.int64) * NC + i_c) * Q
    b_cs_end = tl.load(dA_cs + o_cs + q_end)
    p_X = X + i_h * s_x_h + o_p[:, None] * s_x_p
    p_B = Bm + i_g * s_b_g + o_n[None, :] * s_b_n
    b_acc = tl.zeros([BP, BN], dtype=tl.float32)
    for k in range(0, q_end + 1, BK):
        o_q = k + tl.arange(0, BK)
        o_t = i_c * Q + o_q
        m_t = o_q <= q_end
        b_cs = tl.load(dA_cs + o_cs + o_q, mask=m_t, other=0.0)
        b_dt = tl.load(dt_out + o_cs + o_q, mask=m_t, other=0.0)
        b_seq = tl.load(seq_idx + o_t.to(tl.int64) * s_seq_l, mask=m_t, other=-1)
        b_w = tl.where(m_t & (b_seq == seq_end), tl.exp(b_cs_end - b_cs) * b_dt, 0.0)
        b_x = tl.load(p_X + o_t.to(tl.int64)[None, :] * s_x_l, mask=m_p[:, None] & m_t[None, :], other=0.0)
        b_b = tl.load(p_B + o_t.to(tl.int64)[:, None] * s_b_l, mask=m_t[:, None] & m_n[None, :], other=0.0)
        # one small product per sequence: exact fp32 (no operand rounding, no TF32)
        b_acc += tl.dot(b_x.to(tl.float32) * b_w[None, :], b_b.to(tl.float32), input_precision="ieee")
    # the state carried into the chunk, if this sequence was already running there
    p_H = passed + (i_c.to(tl.int64) * H + i_h) * P * N + o_p[:, None] * N + o_n[None, :]
    b_H = tl.load(p_H, mask=m_p[:, None] & m_n[None, :], other=0.0)
    carry = tl.where(seq_end == seq_prev, tl.exp(b_cs_end), 0.0)
    b_acc += carry * b_H
    b_acc = tl.where(empty, 0.0, b_acc)
    p_out = out + i_sh.to(tl.int64) * P * N + o_p[:, None] * N + o_n[None, :]
    tl.store(p_out, b_acc, mask=m_p[:, None] & m_n[None, :])


def ssd_varlen_states_fwd(x, B, dt_out, dA_cumsum, passed_states, seq_idx, cu_seqlens):
    """Batch 1 only. One end state per sequence: (nseq, h, p, n) float32.

    cu_seqlens (nseq + 1,) gives where each sequence ends; membership follows seq_idx (as everywhere). An empty
    sequence (a repeated offset) ends in the state it starts from: the initial state (passed_states' first) for
    the sequence numbered 0, zeros for any other; cu_seqlens' sequences are numbered on from seq_idx's number of
    the first non-empty one (from 0 when every one is empty)."""
    b, L, h, p = x.shape
    assert b == 1, "varlen states need batch 1"
    assert seq_idx is not None, "varlen states need seq_idx"
    g, n = B.shape[2], B.shape[3]
    _, _, nc, Q = dA_cumsum.shape
    nseq = cu_seqlens.numel() - 1
    out = torch.empty(nseq, h, p, n, device=x.device, dtype=torch.float32)
    if nseq == 0:
        return out
    ssd_fwd_kernel_varlen_states[lambda m: (nseq * h, triton.cdiv(p, m["BP"]) * triton.cdiv(n, m["BN"]))](
        x, B, dt_out, dA_cumsum, seq_idx, passed_states, cu_seqlens, out, L, h, g, nc, Q, p, n,
        x.stride(1), x.stride(2), x.stride(3), B.stride(1), B.stride(2), B.stride(3), seq_idx.stride(1))
    bounds = cu_seqlens.tolist()
    if any(a == b for a, b in zip(bounds, bounds[1:])):
        full = [i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
        base = int(seq_idx[0, bounds[full[0]]]) - full[0] if full else 0
        if 0 <= -base < nseq and bounds[-base] == bounds[1 - base]:
            out[-base] = passed_states[0, 0].float()
    return out
