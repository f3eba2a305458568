"""Stage 5: the output of each chunk; and its backward (the z gate, dCB with the intra-chunk dA gradient,
dx).

    forward   scan_i = reach_i exp(cs_i) C_i . H_k                                 (the state entering chunk k)
                     + sum_{j <= i, same sequence} CB_ij exp(cs_i - cs_j) dt'_j x_j  (inside the chunk)
              skip_i = scan_i + D x_i          (D (h,) or (h, p))
              y_i    = skip_i * silu(z_i)      (if z)

    backward  gate     ds = dy silu(z) (= dy without z);  dz = dy o silu'(z)  (o = skip, kept by the forward)
              dcb_ddA  dCB_ij = sum_{h in g} W_ij,  W_ij = mask_ij exp(cs_i - cs_j) dt'_j (ds_i . x_j);  from the
                       same per-head summand (one pass), G_ij = CB_ij W_ij:  ddA_t = sum_{i >= t} sum_{j < t} G_ij
                       as a running prefix (never as dcs_i = rowsum - colsum then a reverse cumsum, which cancels
                       the large diagonal terms catastrophically in float32 under strong decay)
              dx       acc_j = sum_{i >= j} CB_ij mask_ij exp(cs_i - cs_j) ds_i + own_j exp(cs_last - cs_j) dS_k B_j
                       dx_j = dt'_j acc_j + D ds_j;  ddt'_j += x_j . acc_j;  dD += ds_j x_j

reach_i: token i belongs to the sequence running when the chunk starts (and is not padding); own_j: token j
belongs to the sequence of the chunk's last token; mask_ij: j <= i, same sequence, not padding. dS_k: the
gradient at chunk k's own end state (state_passing.py). dCB feeds dC and dB (bmm.py); the term of dA through
the state entering the chunk, C_i . (H_k^T ds_i), comes with dC.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .common import idx64, in_chunk, last_in_chunk, load_seq, seq_bounds, tile_major

G16 = configs.GRANULE


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


# ---- backward: the z gate ----------------------------------------------------------------------------------

@configs.autotune("bwd_gate", key=["P"])
@triton.jit
def ssd_bwd_kernel_gate(
    dy, z, o, ds, dz, L, H, P,
    s_dy_b, s_dy_l, s_dy_h, s_dy_p, s_z_b, s_z_l, s_z_h, s_z_p,
    BR: tl.constexpr, BP: tl.constexpr,
):
    i_bh, i_rp = tl.program_id(0), tl.program_id(1)
    n_p = tl.cdiv(P, BP)
    i_r, i_p = i_rp // n_p, i_rp % n_p
    i_b, i_h = i_bh // H, i_bh % H
    o_t = i_r * BR + tl.arange(0, BR)
    o_p = i_p * BP + tl.arange(0, BP)
    m = (o_t < L)[:, None] & (o_p < P)[None, :]
    b_dy = tl.load(dy + i_b.to(tl.int64) * s_dy_b + o_t.to(tl.int64)[:, None] * s_dy_l + i_h * s_dy_h
                   + o_p[None, :] * s_dy_p, mask=m, other=0.0).to(tl.float32)
    b_z = tl.load(z + i_b.to(tl.int64) * s_z_b + o_t.to(tl.int64)[:, None] * s_z_l + i_h * s_z_h
                  + o_p[None, :] * s_z_p, mask=m, other=0.0).to(tl.float32)
    o_c = ((i_b.to(tl.int64) * L + o_t[:, None]) * H + i_h) * P + o_p[None, :]     # contiguous (b, L, h, p)
    b_o = tl.load(o + o_c, mask=m, other=0.0).to(tl.float32)
    b_sig = tl.sigmoid(b_z)
    tl.store(ds + o_c, (b_dy * b_z * b_sig).to(ds.dtype.element_ty), mask=m)
    tl.store(dz + o_c, (b_dy * b_o * b_sig * (1.0 + b_z * (1.0 - b_sig))).to(dz.dtype.element_ty), mask=m)


def ssd_gate_bwd(dy, z, pregate):
    """(ds, dz): the gradient at the pre-gate output (float32: the D skip and dD use it unrounded; products
    round it to the input dtype), and dz in z's dtype. Contiguous."""
    b, L, h, p = dy.shape
    ds = torch.empty(b, L, h, p, device=dy.device, dtype=torch.float32)
    dz = torch.empty(b, L, h, p, device=dy.device, dtype=z.dtype)
    ssd_bwd_kernel_gate[lambda m: (b * h, triton.cdiv(L, m["BR"]) * triton.cdiv(p, m["BP"]))](
        dy, z, pregate, ds, dz, L, h, p, *dy.stride(), *z.stride())
    return ds, dz


# ---- backward: dCB and the intra-chunk gradient of dA, in one pass -----------------------------------------

@configs.autotune("bwd_dcb_ddA", key=["Q", "P", "HPG"])
@triton.heuristics({"HAS_SEQ_IDX": lambda a: a["seq_idx"] is not None})
@triton.jit
def ssd_bwd_kernel_dcb_ddA(
    x, ds, CB, dt_out, dA_cs, seq_idx, dCB, ddA_part, run,
    L, H, G, HPG, NC, Q, P, NGQ,
    s_x_b, s_x_l, s_x_h, s_x_p, s_d_b, s_d_l, s_d_h, s_d_p, s_seq_b, s_seq_l,
    HAS_SEQ_IDX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
):
    """Per group and i-tile, walking the j-tiles up to the diagonal in order, each head's
    W_ij = mask_ij exp(cs_i - cs_j) dt_j (ds_i . x_j) is formed once and used twice:
      dCB_ij = sum_{h in g} W_ij                                           (j <= i)
      G_ij = CB_ij W_ij (i > j: the diagonal never depends on dA);  ddA_t = sum_{i >= t} sum_{j < t} G_ij,
    the latter with a running row prefix per head (kept in ``run`` between j-tiles): F_s = sum_{i > s}
    sum_{j <= s} G_ij is a column sum of an inclusive row cumsum, ddA_{s+1} = F_s. No term is added and
    subtracted again, so tiny gradients under strong decay survive in float32."""
    i_bcg, i_m = tile_major(tl.cdiv(Q, BM))
    i_b, i_c, i_g = i_bcg // (NC * G), (i_bcg // G) % NC, i_bcg % G
    o_i = i_m * BM + tl.arange(0, BM)
    t_i = i_c * Q + o_i
    m_i = (o_i < Q) & (t_i < L)
    o_seq = i_b.to(tl.int64) * s_seq_b
    seq_last, seq_prev = seq_bounds(seq_idx, o_seq, s_seq_l, i_c, L, Q, HAS_SEQ_IDX)
    b_seq_i = load_seq(seq_idx, o_seq, s_seq_l, t_i, o_i < Q, L, seq_last, HAS_SEQ_IDX)
    p_CB = CB + i_bcg.to(tl.int64) * Q * Q
    p_dCB = dCB + i_bcg.to(tl.int64) * Q * Q
    hi = tl.minimum((i_m + 1) * BM, Q)
    for k in range(0, hi, BN):
        o_j = k + tl.arange(0, BN)
        t_j = i_c * Q + o_j
        m_j = (o_j < Q) & (t_j < L)
        b_seq_j = load_seq(seq_idx, o_seq, s_seq_l, t_j, o_j < Q, L, seq_last, HAS_SEQ_IDX)
        m_ij = (o_j[None, :] <= o_i[:, None]) & m_i[:, None] & m_j[None, :] \
            & (b_seq_i[:, None] == b_seq_j[None, :]) & (b_seq_j[None, :] >= 0)
        m_q = (o_i < Q)[:, None] & (o_j < Q)[None, :]
        b_cb = tl.load(p_CB + o_i[:, None] * Q + o_j[None, :], mask=m_q, other=0.0)
        b_dcb = tl.zeros([BM, BN], dtype=tl.float32)
        for hh in range(HPG):
            i_h = i_g * HPG + hh
            o_cs = ((i_b.to(tl.int64) * H + i_h) * NC + i_c) * Q
            b_cs_i = tl.load(dA_cs + o_cs + o_i, mask=o_i < Q, other=0.0)
            b_cs_j = tl.load(dA_cs + o_cs + o_j, mask=o_j < Q, other=0.0)
            b_dt_j = tl.load(dt_out + o_cs + o_j, mask=o_j < Q, other=0.0)
            b_M = tl.zeros([BM, BN], dtype=tl.float32)
            for kp in range(0, P, BP):
                o_p = kp + tl.arange(0, BP)
                m_p = o_p < P
                b_ds = tl.load(ds + i_b.to(tl.int64) * s_d_b + t_i.to(tl.int64)[:, None] * s_d_l + i_h * s_d_h
                               + o_p[None, :] * s_d_p, mask=m_i[:, None] & m_p[None, :], other=0.0)    # [BM, BP]
                b_x = tl.load(x + i_b.to(tl.int64) * s_x_b + t_j.to(tl.int64)[None, :] * s_x_l + i_h * s_x_h
                              + o_p[:, None] * s_x_p, mask=m_p[:, None] & m_j[None, :], other=0.0)     # [BP, BN]
                b_M += tl.dot(b_ds.to(b_x.dtype), b_x)
            b_W = b_M * tl.exp(tl.where(m_ij, b_cs_i[:, None] - b_cs_j[None, :], float("-inf"))) * b_dt_j[None, :]
            b_dcb += b_W
            b_G = tl.where(m_ij & (o_j[None, :] < o_i[:, None]), b_cb * b_W, 0.0)
            p_run = run + o_cs + o_i
            b_run = tl.load(p_run, mask=(o_i < Q) & (k > 0), other=0.0)
            b_cum = b_run[:, None] + tl.cumsum(b_G, axis=1)                                    # sum_{j <= s}
            b_F = tl.sum(tl.where(o_i[:, None] > o_j[None, :], b_cum, 0.0), axis=0)             # sum_{i > s}
            o_part = ((i_b.to(tl.int64) * H + i_h) * NC + i_c) * NGQ + i_m * (BM // 16)
            tl.store(ddA_part + o_part * Q + o_j + 1, b_F, mask=(o_j + 1) < Q)
            tl.store(p_run, b_run + tl.sum(b_G, axis=1), mask=o_i < Q)
            tl.debug_barrier()          # the next j-tile's load of ``run`` may come from another thread
        tl.store(p_dCB + o_i[:, None] * Q + o_j[None, :], b_dcb, mask=m_q)
    for k in range(hi, Q, BN):                  # above the diagonal: dCB is zero, and so is F (no i > s here)
        o_j = k + tl.arange(0, BN)
        tl.store(p_dCB + o_i[:, None] * Q + o_j[None, :], tl.zeros([BM, BN], dtype=tl.float32),
                 mask=(o_i < Q)[:, None] & (o_j < Q)[None, :])
        for hh in range(HPG):
            o_part = ((i_b.to(tl.int64) * H + i_g * HPG + hh) * NC + i_c) * NGQ + i_m * (BM // 16)
            tl.store(ddA_part + o_part * Q + o_j + 1, tl.zeros([BN], dtype=tl.float32), mask=(o_j + 1) < Q)
    for hh in range(HPG):                       # ddA_0: no j < 0
        o_part = ((i_b.to(tl.int64) * H + i_g * HPG + hh) * NC + i_c) * NGQ + i_m * (BM // 16)
        tl.store(ddA_part + o_part * Q, 0.0)


def ssd_dcb_ddA_bwd(x, ds, CB, dt_out, dA_cumsum, seq_idx=None):
    """dCB (b, c, g, Q, Q) float32 (zero above the diagonal), and the intra-chunk part of the gradient at
    dA = dt*A (b, h, c, Q) float32 (added after, not through, the reverse cumsum)."""
    b, L, h, p = x.shape
    _, nc, g, Q, _ = CB.shape
    ngq = triton.cdiv(Q, G16)
    dCB = torch.empty(b, nc, g, Q, Q, device=x.device, dtype=torch.float32)
    part = torch.empty(b, h, nc, ngq, Q, device=x.device, dtype=torch.float32)
    run = torch.empty(b, h, nc, Q, device=x.device, dtype=torch.float32)
    ssd_bwd_kernel_dcb_ddA[lambda m: (b * nc * g * triton.cdiv(Q, m["BM"]),)](
        x, ds, CB, dt_out, dA_cumsum, seq_idx, dCB, part, run, L, h, g, h // g, nc, Q, p, ngq,
        *x.stride(), *ds.stride(), *(seq_idx.stride() if seq_idx is not None else (0, 0)))
    return dCB, configs.used_slots(part, ssd_bwd_kernel_dcb_ddA, "BM", 3).sum(3)


# ---- backward: dx, ddt (direct part), dD -------------------------------------------------------------------

@configs.autotune("bwd_dx", key=["Q", "P", "N"])
@triton.heuristics({"HAS_SEQ_IDX": lambda a: a["seq_idx"] is not None, "HAS_D": lambda a: a["D"] is not None})
@triton.jit
def ssd_bwd_kernel_dx(
    x, ds, Bm, CB, dt_out, dA_cs, seq_idx, dS, D, dx, ddt_part, dD_part,
    L, H, G, NC, Q, P, N, NGP, NGM,
    s_x_b, s_x_l, s_x_h, s_x_p, s_d_b, s_d_l, s_d_h, s_d_p, s_b_b, s_b_l, s_b_g, s_b_n, s_seq_b, s_seq_l,
    HAS_SEQ_IDX: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    BM: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):
    n_p = tl.cdiv(P, BP)
    i_bch, i_mp = tile_major(tl.cdiv(Q, BM) * n_p)
    i_m, i_p = i_mp // n_p, i_mp % n_p
    i_b, i_c, i_h = i_bch // (NC * H), (i_bch // H) % NC, i_bch % H
    i_g = i_h // (H // G)
    o_j = i_m * BM + tl.arange(0, BM)
    o_p = i_p * BP + tl.arange(0, BP)
    t_j = i_c * Q + o_j
    m_j = (o_j < Q) & (t_j < L)
    m_p = o_p < P
    o_seq = i_b.to(tl.int64) * s_seq_b
    seq_last, seq_prev = seq_bounds(seq_idx, o_seq, s_seq_l, i_c, L, Q, HAS_SEQ_IDX)
    b_seq_j = load_seq(seq_idx, o_seq, s_seq_l, t_j, o_j < Q, L, seq_last, HAS_SEQ_IDX)
    o_cs = ((i_b.to(tl.int64) * H + i_h) * NC + i_c) * Q
    b_cs_j = tl.load(dA_cs + o_cs + o_j, mask=o_j < Q, other=0.0)
    b_dt_j = tl.load(dt_out + o_cs + o_j, mask=o_j < Q, other=0.0)
    b_cs_last = tl.load(dA_cs + o_cs + last_in_chunk(i_c, L, Q))
    p_CB = CB + ((i_b.to(tl.int64) * NC + i_c) * G + i_g) * Q * Q
    p_ds = ds + i_b.to(tl.int64) * s_d_b + i_h * s_d_h

    b_acc = tl.zeros([BM, BP], dtype=tl.float32)
    # inside the chunk: sum over later tokens i >= j
    for k in range((i_m * BM // BK) * BK, Q, BK):
        o_i = k + tl.arange(0, BK)
        t_i = i_c * Q + o_i
        m_i = (o_i < Q) & (t_i < L)
        b_cs_i = tl.load(dA_cs + o_cs + o_i, mask=o_i < Q, other=0.0)
        b_seq_i = load_seq(seq_idx, o_seq, s_seq_l, t_i, o_i < Q, L, seq_last, HAS_SEQ_IDX)
        m_ji = (o_i[None, :] >= o_j[:, None]) & m_j[:, None] & m_i[None, :] \
            & (b_seq_i[None, :] == b_seq_j[:, None]) & (b_seq_j[:, None] >= 0)
        b_cbT = tl.load(p_CB + o_i[None, :] * Q + o_j[:, None], mask=(o_j < Q)[:, None] & (o_i < Q)[None, :],
                        other=0.0)                                                                         # [BM, BK]
        b_w = b_cbT * tl.exp(tl.where(m_ji, b_cs_i[None, :] - b_cs_j[:, None], float("-inf")))
        b_dsi = tl.load(p_ds + t_i.to(tl.int64)[:, None] * s_d_l + o_p[None, :] * s_d_p,
                        mask=m_i[:, None] & m_p[None, :], other=0.0)                                       # [BK, BP]
        b_acc += tl.dot(b_w.to(x.dtype.element_ty), b_dsi.to(x.dtype.element_ty))
    # through this chunk's own end state
    m_own = m_j & (b_seq_j == seq_last) & (b_seq_j >= 0)
    b_a = tl.where(m_own, tl.exp(b_cs_last - b_cs_j), 0.0)
    p_dS = dS + i_bch.to(tl.int64) * P * N
    b_Z = tl.zeros([BM, BP], dtype=tl.float32)
    for k in range(0, N, BN):
        o_n = k + tl.arange(0, BN)
        m_n = o_n < N
        b_b = tl.load(Bm + i_b.to(tl.int64) * s_b_b + t_j.to(tl.int64)[:, None] * s_b_l + i_g * s_b_g
                      + o_n[None, :] * s_b_n, mask=m_j[:, None] & m_n[None, :], other=0.0)                # [BM, BN]
        b_s = tl.load(p_dS + o_p[None, :] * N + o_n[:, None], mask=m_n[:, None] & m_p[None, :], other=0.0)  # [BN, BP]
        b_Z += tl.dot(b_b, b_s.to(b_b.dtype))
    b_acc += b_a[:, None] * b_Z

    m_out = m_j[:, None] & m_p[None, :]
    b_x = tl.load(x + i_b.to(tl.int64) * s_x_b + t_j.to(tl.int64)[:, None] * s_x_l + i_h * s_x_h
                  + o_p[None, :] * s_x_p, mask=m_out, other=0.0).to(tl.float32)
    tl.store(ddt_part + ((i_b.to(tl.int64) * H + i_h) * NC * NGP + i_c * NGP + i_p * (BP // 16)) * Q + o_j,
             tl.sum(b_acc * b_x, axis=1), mask=o_j < Q)
    b_dx = b_acc * b_dt_j[:, None]
    if HAS_D:
        b_dsj = tl.load(p_ds + t_j.to(tl.int64)[:, None] * s_d_l + o_p[None, :] * s_d_p, mask=m_out,
                        other=0.0).to(tl.float32)
        if D_PER_CHANNEL:
            b_D = tl.load(D + i_h * P + o_p, mask=m_p, other=0.0).to(tl.float32)[None, :]
        else:
            b_D = tl.load(D + i_h).to(tl.float32)
        b_dx += b_D * b_dsj
        # dD partials laid out (b, c, NGM, h, P)
        o_dD = (((i_b.to(tl.int64) * NC + i_c) * NGM + i_m * (BM // 16)) * H + i_h) * P + o_p
        tl.store(dD_part + o_dD, tl.sum(b_dsj * b_x, axis=0), mask=m_p)
    p_dx = dx + ((i_b.to(tl.int64) * L + t_j[:, None]) * H + i_h) * P + o_p[None, :]
    tl.store(p_dx, b_dx.to(dx.dtype.element_ty), mask=m_out)


def ssd_dx_bwd(x, ds, B, CB, dt_out, dA_cumsum, dchunk_states, seq_idx=None, D=None):
    """dx (b, L, h, p) in x's dtype; ddt (b, h, c, Q) float32 (the part through dt_j x_j); dD (D's shape,
    float32) or None."""
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nc, Q = dA_cumsum.shape[2], dA_cumsum.shape[3]
    ngp, ngm = triton.cdiv(p, G16), triton.cdiv(Q, G16)
    dx = torch.empty(b, L, h, p, device=x.device, dtype=x.dtype)
    ddt_part = torch.empty(b, h, nc, ngp, Q, device=x.device, dtype=torch.float32)
    dD_part = torch.empty((b, nc, ngm, h, p), device=x.device, dtype=torch.float32) if D is not None else None
    D_c = D.contiguous() if D is not None else None
    ssd_bwd_kernel_dx[lambda m: (b * nc * h * triton.cdiv(Q, m["BM"]) * triton.cdiv(p, m["BP"]),)](
        x, ds, B, CB, dt_out, dA_cumsum, seq_idx, dchunk_states, D_c, dx, ddt_part, dD_part,
        L, h, g, nc, Q, p, n, ngp, ngm, *x.stride(), *ds.stride(), *B.stride(),
        *(seq_idx.stride() if seq_idx is not None else (0, 0)), D_PER_CHANNEL=D is not None and D.dim() == 2)
    dD = None
    if D is not None:
        dD = configs.used_slots(dD_part, ssd_bwd_kernel_dx, "BM", 2).sum((0, 1, 2))
        if D.dim() == 1:
            dD = dD.sum(-1)
    return dx, configs.used_slots(ddt_part, ssd_bwd_kernel_dx, "BP", 3).sum(3), dD
