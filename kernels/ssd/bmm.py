"""Stage 2: C . B^T inside each chunk, per group (native groups: never expanded to heads); and its backward,
dC and dB (one kernel, two modes: ``IS_DC``), whose programs own a group and sum over its heads.

    forward   CB[b, c, g, i, j] = sum_n C[b, cQ+i, g, n] B[b, cQ+j, g, n]        (zero where a token is past L)
    backward  dC_i = sum_j dCB_ij B_j + sum_{h in g} reach_i exp(cs_i) H_k^T ds_i;     dcs_i = C_i . (2nd term)
              dB_j = sum_i dCB_ij C_i + sum_{h in g} own_j exp(cs_last - cs_j) dt'_j dS_k^T x_j;
              T_j = B_j . (2nd term), whose dA gradient is ddA_t += sum_{j < t} T_j  (d(cs_last - cs_j)/d dA_t
              = [j < t]; summed in stage 1's backward)

dCB comes from the chunk scan's backward (chunk_scan.py); H_k is the state entering chunk k, dS_k the
gradient at chunk k's own end state (state_passing.py); reach/own as in chunk_state.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .common import last_in_chunk, load_seq, seq_bounds, tile_major

G16 = configs.GRANULE


@configs.autotune("bmm", key=["Q", "N"])
@triton.jit
def ssd_fwd_kernel_bmm(
    C, B, CB,
    L, G, NC, Q, N,
    s_c_b, s_c_l, s_c_g, s_c_n,
    s_b_b, s_b_l, s_b_g, s_b_n,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    n_n = tl.cdiv(Q, BN)
    i_bcg, i_mn = tile_major(tl.cdiv(Q, BM) * n_n)
    i_m, i_n = i_mn // n_n, i_mn % n_n
    i_b, i_c, i_g = i_bcg // (NC * G), (i_bcg // G) % NC, i_bcg % G
    o_i = i_m * BM + tl.arange(0, BM)
    o_j = i_n * BN + tl.arange(0, BN)
    t_i, t_j = i_c * Q + o_i, i_c * Q + o_j
    m_i = (o_i < Q) & (t_i < L)
    m_j = (o_j < Q) & (t_j < L)
    p_C = C + i_b.to(tl.int64) * s_c_b + i_g * s_c_g + t_i.to(tl.int64)[:, None] * s_c_l
    p_B = B + i_b.to(tl.int64) * s_b_b + i_g * s_b_g + t_j.to(tl.int64)[None, :] * s_b_l
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, N, BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < N
        b_C = tl.load(p_C + o_k[None, :] * s_c_n, mask=m_i[:, None] & m_k[None, :], other=0.0)   # [BM, BK]
        b_B = tl.load(p_B + o_k[:, None] * s_b_n, mask=m_k[:, None] & m_j[None, :], other=0.0)   # [BK, BN]
        b_acc += tl.dot(b_C, b_B.to(b_C.dtype))
    p_out = CB + i_bcg.to(tl.int64) * Q * Q + o_i[:, None] * Q + o_j[None, :]
    tl.store(p_out, b_acc, mask=(o_i < Q)[:, None] & (o_j < Q)[None, :])


def ssd_bmm_fwd(C, B, chunk_size):
    """C, B (b, L, g, n) -> CB (b, c, g, Q, Q) float32."""
    b, L, g, n = C.shape
    Q = chunk_size
    nc = triton.cdiv(L, Q)
    CB = torch.empty(b, nc, g, Q, Q, device=C.device, dtype=torch.float32)
    ssd_fwd_kernel_bmm[lambda m: (b * nc * g * triton.cdiv(Q, m["BM"]) * triton.cdiv(Q, m["BN"]),)](
        C, B, CB, L, g, nc, Q, n, *C.stride(), *B.stride())
    return CB


# ---- backward: dC and dB -----------------------------------------------------------------------------------

@configs.autotune("bwd_dbc", key=["Q", "P", "N", "HPG", "IS_DC"])
@triton.heuristics({"HAS_SEQ_IDX": lambda a: a["seq_idx"] is not None})
@triton.jit
def ssd_bwd_kernel_dbc(
    U, V, W, dCB, dt_out, dA_cs, seq_idx, states, out, dcs_part,
    L, H, G, HPG, NC, Q, P, N, NGN,
    s_u_b, s_u_l, s_u_h, s_u_p, s_v_b, s_v_l, s_v_g, s_v_n, s_w_b, s_w_l, s_w_g, s_w_n, s_seq_b, s_seq_l,
    IS_DC: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
):
    """IS_DC: out = dC, U = ds, V = B, W = C, states = H (passed states).
    else:     out = dB, U = x,  V = C, W = B, states = dS (gradient of the chunk states)."""
    n_n = tl.cdiv(N, BN)
    i_bcg, i_mn = tile_major(tl.cdiv(Q, BM) * n_n)
    i_m, i_n = i_mn // n_n, i_mn % n_n
    i_b, i_c, i_g = i_bcg // (NC * G), (i_bcg // G) % NC, i_bcg % G
    o_r = i_m * BM + tl.arange(0, BM)            # rows: token i (dC) or j (dB)
    o_n = i_n * BN + tl.arange(0, BN)
    t_r = i_c * Q + o_r
    m_r = (o_r < Q) & (t_r < L)
    m_n = o_n < N
    p_dCB = dCB + i_bcg.to(tl.int64) * Q * Q
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    # through C.B^T: dC = dCB @ B (columns j <= i), dB = dCB^T @ C (rows i >= j)
    if IS_DC:
        lo = 0
        hi = tl.minimum((i_m + 1) * BM, Q)
    else:
        lo = (i_m * BM // BK) * BK
        hi = Q
    for k in range(lo, hi, BK):
        o_k = k + tl.arange(0, BK)
        t_k = i_c * Q + o_k
        m_k = (o_k < Q) & (t_k < L)
        if IS_DC:
            b_d = tl.load(p_dCB + o_r[:, None] * Q + o_k[None, :], mask=(o_r < Q)[:, None] & (o_k < Q)[None, :],
                          other=0.0)
        else:
            b_d = tl.load(p_dCB + o_k[None, :] * Q + o_r[:, None], mask=(o_r < Q)[:, None] & (o_k < Q)[None, :],
                          other=0.0)
        b_v = tl.load(V + i_b.to(tl.int64) * s_v_b + t_k.to(tl.int64)[:, None] * s_v_l + i_g * s_v_g
                      + o_n[None, :] * s_v_n, mask=m_k[:, None] & m_n[None, :], other=0.0)                # [BK, BN]
        b_acc += tl.dot(b_d.to(b_v.dtype), b_v)
    # through the states
    o_seq = i_b.to(tl.int64) * s_seq_b
    seq_last, seq_prev = seq_bounds(seq_idx, o_seq, s_seq_l, i_c, L, Q, HAS_SEQ_IDX)
    b_seq = load_seq(seq_idx, o_seq, s_seq_l, t_r, o_r < Q, L, seq_last, HAS_SEQ_IDX)
    b_w = tl.load(W + i_b.to(tl.int64) * s_w_b + t_r.to(tl.int64)[:, None] * s_w_l + i_g * s_w_g
                  + o_n[None, :] * s_w_n, mask=m_r[:, None] & m_n[None, :], other=0.0).to(tl.float32)    # [BM, BN]
    for hh in range(HPG):
        i_h = i_g * HPG + hh
        o_cs = ((i_b.to(tl.int64) * H + i_h) * NC + i_c) * Q
        b_cs = tl.load(dA_cs + o_cs + o_r, mask=o_r < Q, other=0.0)
        if IS_DC:
            m_a = m_r & (b_seq == seq_prev) & (b_seq >= 0)
            b_a = tl.where(m_a, tl.exp(b_cs), 0.0)
        else:
            b_cs_last = tl.load(dA_cs + o_cs + last_in_chunk(i_c, L, Q))
            b_dt = tl.load(dt_out + o_cs + o_r, mask=o_r < Q, other=0.0)
            m_a = m_r & (b_seq == seq_last) & (b_seq >= 0)
            b_a = tl.where(m_a, tl.exp(b_cs_last - b_cs) * b_dt, 0.0)
        p_S = states + ((i_b.to(tl.int64) * NC + i_c) * H + i_h) * P * N
        b_Z = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, P, BP):
            o_p = k + tl.arange(0, BP)
            m_p = o_p < P
            b_u = tl.load(U + i_b.to(tl.int64) * s_u_b + t_r.to(tl.int64)[:, None] * s_u_l + i_h * s_u_h
                          + o_p[None, :] * s_u_p, mask=m_r[:, None] & m_p[None, :], other=0.0)               # [BM, BP]
            b_s = tl.load(p_S + o_p[:, None] * N + o_n[None, :], mask=m_p[:, None] & m_n[None, :], other=0.0)
            b_Z += tl.dot(b_u.to(V.dtype.element_ty), b_s.to(V.dtype.element_ty))   # input-dtype operands
        b_Z *= b_a[:, None]
        b_acc += b_Z
        o_part = (i_b.to(tl.int64) * H + i_h) * NC + i_c
        tl.store(dcs_part + (o_part * NGN + i_n * (BN // 16)) * Q + o_r, tl.sum(b_w * b_Z, axis=1), mask=o_r < Q)
    p_out = out + ((i_b.to(tl.int64) * L + t_r[:, None]) * G + i_g) * N + o_n[None, :]
    tl.store(p_out, b_acc.to(out.dtype.element_ty), mask=m_r[:, None] & m_n[None, :])


def _dbc(is_dc, U, V, W, dCB, dt_out, dA_cumsum, seq_idx, states, out_dtype):
    b, L, h, p = U.shape
    g, n = V.shape[2], V.shape[3]
    nc, Q = dA_cumsum.shape[2], dA_cumsum.shape[3]
    ngn = triton.cdiv(n, G16)
    out = torch.empty(b, L, g, n, device=U.device, dtype=out_dtype)
    part = torch.empty(b, h, nc, ngn, Q, device=U.device, dtype=torch.float32)
    ssd_bwd_kernel_dbc[lambda m: (b * nc * g * triton.cdiv(Q, m["BM"]) * triton.cdiv(n, m["BN"]),)](
        U, V, W, dCB, dt_out, dA_cumsum, seq_idx, states, out, part, L, h, g, h // g, nc, Q, p, n, ngn,
        *U.stride(), *V.stride(), *W.stride(), *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        IS_DC=is_dc)
    return out, configs.used_slots(part, ssd_bwd_kernel_dbc, "BN", 3).sum(3)


def ssd_dC_bwd(ds, B, C, dCB, dA_cumsum, passed_states, seq_idx=None):
    """dC (b, L, g, n) in C's dtype, and the dcs (b, h, c, Q) of the inter-chunk output."""
    return _dbc(True, ds, B, C, dCB, dA_cumsum, dA_cumsum, seq_idx, passed_states, C.dtype)


def ssd_dB_bwd(x, B, C, dCB, dt_out, dA_cumsum, dchunk_states, seq_idx=None):
    """dB (b, L, g, n) in B's dtype, and T (b, h, c, Q): ddA_t += sum_{j < t} T_j."""
    return _dbc(False, x, C, B, dCB, dt_out, dA_cumsum, seq_idx, dchunk_states, B.dtype)
