"""Stage 6: the output of each chunk.

    scan_i = reach_i exp(cs_i) C_i . H_k                                    (the state entering chunk k)
           + sum_{j <= i, same sequence} CB_ij exp(cs_i - cs_j) dt_j x_j      (inside the chunk)
    skip_i = scan_i + D x_i          (D (h,) or (h, p))
    y_i    = skip_i * silu(z_i)      (if z)

reach_i: token i belongs to the sequence running when the chunk starts (and is not padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ssd import configs
from kernels.ssd.common import idx64, in_chunk, load_seq, seq_bounds, tile_major


@configs.autotune("chunk_scan", key=["Q", "P", "N"])
@triton.heuristics({
    "HAS_SEQ_IDX": lambda a: a["seq_idx"] is not None,
    "HAS_D": lambda a: a["D"] is not None,
    "HAS_Z": lambda a: a["z"] is not None,
    "STORE_SCAN": lambda a: a["scan_out"] is not None,
    "STORE_PREGATE": lambda a: a["pregate_out"] is not None,
})
@triton.jit
def ssd_fwd_kernel_chunk_scan(
    x, C, CB, dt_out, dA_cs, passed, seq_idx, D, z, out, scan_out, pregate_out,
    L, H, G, NC, Q, P, N,
    s_x_b, s_x_l, s_x_h, s_x_p,
    s_c_b, s_c_l, s_c_g, s_c_n,
    s_z_b, s_z_l, s_z_h, s_z_p,
    s_seq_b, s_seq_l,
    HAS_SEQ_IDX: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
    STORE_SCAN: tl.constexpr, STORE_PREGATE: tl.constexpr, IDX64: tl.constexpr,
    BM: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):
    n_p = tl.cdiv(P, BP)
    i_bch, i_mp = tile_major(tl.cdiv(Q, BM) * n_p)
    i_m, i_p = i_mp // n_p, i_mp % n_p
    i_b, i_c, i_h = i_bch // (NC * H), (i_bch // H) % NC, i_bch % H
    i_g = i_h // (H // G)
    o_i = i_m * BM + tl.arange(0, BM)
    o_p = i_p * BP + tl.arange(0, BP)
    t_i = i_c * Q + o_i
    m_i = (o_i < Q) & (t_i < L)
    m_p = o_p < P

    o_seq = i_b.to(tl.int64) * s_seq_b
    seq_last, seq_prev = seq_bounds(seq_idx, o_seq, s_seq_l, i_c, L, Q, HAS_SEQ_IDX)
    b_seq_i = load_seq(seq_idx, o_seq, s_seq_l, t_i, o_i < Q, L, seq_last, HAS_SEQ_IDX)
    o_cs = ((i_b.to(tl.int64) * H + i_h) * NC + i_c) * Q
    b_cs_i = tl.load(dA_cs + o_cs + o_i, mask=o_i < Q, other=0.0)
    p_x = x + i_b.to(tl.int64) * s_x_b + i_h * s_x_h

    b_acc = tl.zeros([BM, BP], dtype=tl.float32)
    # off-diagonal: the state entering the chunk, read by the tokens of the sequence running there
    p_C = C + i_b.to(tl.int64) * s_c_b + i_g * s_c_g + t_i.to(tl.int64)[:, None] * s_c_l
    p_H = passed + i_bch.to(tl.int64) * P * N + o_p[None, :] * N
    for k in range(0, N, BN):
        o_n = k + tl.arange(0, BN)
        m_n = o_n < N
        b_C = tl.load(p_C + o_n[None, :] * s_c_n, mask=m_i[:, None] & m_n[None, :], other=0.0)   # [BM, BN]
        b_H = tl.load(p_H + o_n[:, None], mask=m_n[:, None] & m_p[None, :], other=0.0)          # [BN, BP]
        b_acc += tl.dot(b_C, b_H.to(b_C.dtype))
    m_reach = m_i & (b_seq_i == seq_prev) & (b_seq_i >= 0)
    b_acc *= tl.where(m_reach, tl.exp(b_cs_i), 0.0)[:, None]

    # diagonal block: causal, same sequence
    p_CB = CB + ((i_b.to(tl.int64) * NC + i_c) * G + i_g) * Q * Q + o_i[:, None] * Q
    p_xc = p_x + (i_c * Q).to(tl.int64) * s_x_l             # x at the chunk's first token
    hi = tl.minimum((i_m + 1) * BM, Q)
    for k in range(0, hi, BK):
        o_j = k + tl.arange(0, BK)
        t_j = i_c * Q + o_j
        m_j = (o_j < Q) & (t_j < L)
        b_cs_j = tl.load(dA_cs + o_cs + o_j, mask=o_j < Q, other=0.0)
        b_dt_j = tl.load(dt_out + o_cs + o_j, mask=o_j < Q, other=0.0)
        b_seq_j = load_seq(seq_idx, o_seq, s_seq_l, t_j, o_j < Q, L, seq_last, HAS_SEQ_IDX)
        m_ij = (o_j[None, :] <= o_i[:, None]) & m_i[:, None] & m_j[None, :] \
            & (b_seq_i[:, None] == b_seq_j[None, :]) & (b_seq_j[None, :] >= 0)
        b_decay = tl.exp(tl.where(m_ij, b_cs_i[:, None] - b_cs_j[None, :], float("-inf")))
        b_cb = tl.load(p_CB + o_j[None, :], mask=(o_i < Q)[:, None] & (o_j < Q)[None, :], other=0.0)
        b_w = b_cb * b_decay * b_dt_j[None, :]                                                       # [BM, BK]
        b_xj = tl.load(p_xc + in_chunk(o_j, IDX64)[:, None] * s_x_l + o_p[None, :] * s_x_p,
                       mask=m_j[:, None] & m_p[None, :], other=0.0)                                  # [BK, BP]
        b_acc += tl.dot(b_w.to(b_xj.dtype), b_xj)

    m_out = m_i[:, None] & m_p[None, :]
    o_y = ((i_b.to(tl.int64) * L + t_i[:, None]) * H + i_h) * P + o_p[None, :]         # contiguous (b, L, h, p)
    if STORE_SCAN:
        tl.store(scan_out + o_y, b_acc, mask=m_out)
    if HAS_D:
        b_xi = tl.load(p_x + t_i.to(tl.int64)[:, None] * s_x_l + o_p[None, :] * s_x_p, mask=m_out, other=0.0)
        if D_PER_CHANNEL:
            b_D = tl.load(D + i_h * P + o_p, mask=m_p, other=0.0).to(tl.float32)[None, :]
        else:
            b_D = tl.load(D + i_h).to(tl.float32)
        b_acc += b_D * b_xi.to(tl.float32)
    if STORE_PREGATE:
        tl.store(pregate_out + o_y, b_acc.to(pregate_out.dtype.element_ty), mask=m_out)
    if HAS_Z:
        b_z = tl.load(z + i_b.to(tl.int64) * s_z_b + t_i.to(tl.int64)[:, None] * s_z_l + i_h * s_z_h
                      + o_p[None, :] * s_z_p, mask=m_out, other=0.0).to(tl.float32)
        b_acc *= b_z * tl.sigmoid(b_z)
    tl.store(out + o_y, b_acc.to(out.dtype.element_ty), mask=m_out)


def ssd_chunk_scan_fwd(x, C, CB, dt_out, dA_cumsum, passed_states, seq_idx=None, D=None, z=None,
                       out_dtype=None, return_scan=False, return_pregate=False,
                       pregate_dtype=None):
    """x (b, L, h, p); C (b, L, g, n); CB (b, c, g, Q, Q); dt_out, dA_cumsum (b, h, c, Q);
    passed_states (b, c, h, p, n); D (h,) or (h, p); z like x.

    Returns (out, scan, pregate): out (b, L, h, p) contiguous in ``out_dtype`` (default x.dtype);
    scan (float32, before D) and pregate (after D, before z; ``pregate_dtype``, default x.dtype) when asked."""
    b, L, h, p = x.shape
    g, n = C.shape[2], C.shape[3]
    nc, Q = dA_cumsum.shape[2], dA_cumsum.shape[3]
    out = torch.empty(b, L, h, p, device=x.device, dtype=out_dtype or x.dtype)
    scan = torch.empty(b, L, h, p, device=x.device, dtype=torch.float32) if return_scan else None
    pregate = (torch.empty(b, L, h, p, device=x.device, dtype=pregate_dtype or x.dtype)
               if return_pregate else None)
    D_c = D.contiguous() if D is not None else None
    ssd_fwd_kernel_chunk_scan[lambda m: (b * nc * h * triton.cdiv(Q, m["BM"]) * triton.cdiv(p, m["BP"]),)](
        x, C, CB, dt_out, dA_cumsum, passed_states, seq_idx, D_c, z, out, scan, pregate,
        L, h, g, nc, Q, p, n, *x.stride(), *C.stride(),
        *(z.stride() if z is not None else (0, 0, 0, 0)),
        *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        D_PER_CHANNEL=D is not None and D.dim() == 2, IDX64=idx64(Q, x.stride(1)))
    return out, scan, pregate
