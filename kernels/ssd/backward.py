"""Backward kernels. Notation as in kernels/README.md: cs = dA_cumsum, ds = dL/d(scan output)
(= dy * silu(z) with z, else dy), H_k the state entering chunk k, S_k chunk k's own end state,
dS_k = dL/dS_k = G_{k+1} (from the reverse state recurrence, state_passing.py).

    gate      ds = dy silu(z);  dz = dy o silu'(z)            (o: output before gating, kept by the forward)
    dcb_ddA   dCB[g, i, j] = sum_{h in g} mask_ij exp(cs_i - cs_j) dt_j (ds_i . x_j)   and, from the same
              per-head summand (one pass), G_ij = CB_ij * (summand): ddA_t = sum_{i >= t} sum_{j < t} G_ij as
              a running prefix (never as dcs_i = rowsum - colsum then a reverse cumsum, which cancels the
              large diagonal terms catastrophically in float32 under strong decay)
    dbc (C)   dC_i = sum_j dCB_ij B_j + sum_{h in g} reach_i exp(cs_i) H_k^T ds_i;  dcs_i += C_i . (that 2nd term)
    dbc (B)   dB_j = sum_i dCB_ij C_i + sum_{h in g} own_j exp(cs_last - cs_j) dt_j dS_k^T x_j;
              T_j = B_j . (2nd term): ddA_t += sum_{j < t} T_j  (d(cs_last - cs_j)/d dA_t = [j < t])
    dx        acc_j = sum_{i >= j} CB_ij mask exp(cs_i - cs_j) ds_i + own_j exp(cs_last - cs_j) dS_k B_j
              dx_j = dt_j acc_j + D ds_j;  ddt_j += x_j . acc_j;  dD += ds_j x_j
    cumsum    ddA += reverse cumsum of dcs (terms through cs_i itself) + exclusive prefix sum of T;
              ddt += ddA A; dA = sum ddA dt;
              through clamp (zero where clamped), softplus (sigmoid), bias.

Every reduction that crosses programs is written as per-tile partial sums (indexed by 16-wide granules, so
any configuration fills the same buffer) and summed by torch afterwards: no atomics, run-to-run identical.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.ssd import configs
from kernels.ssd.bmm import ssd_bmm_fwd
from kernels.ssd.chunk_state import ssd_chunk_state_bwd_dstates, ssd_chunk_state_fwd
from kernels.ssd.common import load_seq, seq_bounds, softplus, tile_major
from kernels.ssd.cumsum import ssd_chunk_cumsum_fwd
from kernels.ssd.state_passing import ssd_state_passing_bwd, ssd_state_passing_fwd

G16 = configs.GRANULE


# ---- z gate ----------------------------------------------------------------------------------------------

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


# ---- dCB and the intra-chunk gradient of dA, in one pass -------------------------------------------------

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


# ---- dB, dC (per group: heads summed inside the program) ---------------------------------------------------

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
            b_cs_last = tl.load(dA_cs + o_cs + Q - 1)
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


# ---- dx, ddt (direct part), dD ------------------------------------------------------------------------------

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
    b_cs_last = tl.load(dA_cs + o_cs + Q - 1)
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


# ---- through the cumsum and the dt processing ---------------------------------------------------------------

@configs.autotune("bwd_cumsum", key=["H", "Q", "DT_SOFTPLUS"])
@triton.heuristics({"HAS_DT_BIAS": lambda a: a["dt_bias"] is not None})
@triton.jit
def ssd_bwd_kernel_cumsum(
    dt, A, dt_bias, dcs, T, ddA_in, ddt_in, ddt, dA_part, ddt_bias_part,
    L, H, NC, Q, dt_min, dt_max,
    s_dt_b, s_dt_l, s_dt_h,
    DT_SOFTPLUS: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr,
):
    i_bc, i_hb = tl.program_id(0), tl.program_id(1)
    i_b, i_c = i_bc // NC, i_bc % NC
    o_q = tl.arange(0, BQ)
    o_h = i_hb * BH + tl.arange(0, BH)
    o_t = i_c * Q + o_q
    m_t = (o_q < Q) & (o_t < L)
    m_h = o_h < H
    m = m_t[:, None] & m_h[None, :]
    o_cm = ((i_b.to(tl.int64) * H + o_h[None, :]) * NC + i_c) * Q + o_q[:, None]       # (b, h, c, Q)
    m_cm = (o_q < Q)[:, None] & m_h[None, :]
    b_dcs = tl.load(dcs + o_cm, mask=m_cm, other=0.0)
    b_ddA = tl.cumsum(b_dcs, axis=0, reverse=True)                                       # sum over t >= s
    # + sum over j < s of T_j (the chunk-state terms, exp(cs_last - cs_j)): an exclusive prefix sum, taken
    # from T shifted by one so that no large term is added and subtracted again (strong decay needs this)
    b_Ts = tl.load(T + o_cm - 1, mask=m_cm & (o_q >= 1)[:, None], other=0.0)
    b_ddA += tl.cumsum(b_Ts, axis=0)
    b_ddA += tl.load(ddA_in + o_cm, mask=m_cm, other=0.0)
    b_raw = tl.load(dt + i_b.to(tl.int64) * s_dt_b + o_t.to(tl.int64)[:, None] * s_dt_l + o_h[None, :] * s_dt_h,
                    mask=m, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        b_raw += tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
    if DT_SOFTPLUS:
        b_sp = softplus(b_raw)
        b_dsp = tl.where(b_raw <= 20.0, tl.sigmoid(b_raw), 1.0)
    else:
        b_sp = b_raw
        b_dsp = tl.full(b_raw.shape, 1.0, tl.float32)
    b_dtp = tl.minimum(tl.maximum(b_sp, dt_min), dt_max)
    b_dtp = tl.where(m, b_dtp, 0.0)
    b_A = tl.load(A + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_dd = tl.load(ddt_in + o_cm, mask=m_cm, other=0.0) + b_ddA * b_A[None, :]
    b_draw = tl.where(m & (b_sp > dt_min) & (b_sp < dt_max), b_dd * b_dsp, 0.0)
    tl.store(ddt + ((i_b.to(tl.int64) * L + o_t[:, None]) * H + o_h[None, :]), b_draw.to(ddt.dtype.element_ty),
             mask=m)
    tl.store(dA_part + i_bc.to(tl.int64) * H + o_h, tl.sum(tl.where(m, b_ddA * b_dtp, 0.0), axis=0), mask=m_h)
    tl.store(ddt_bias_part + i_bc.to(tl.int64) * H + o_h, tl.sum(b_draw, axis=0), mask=m_h)


def ssd_chunk_cumsum_bwd(dcs, T, ddA, ddt_direct, dt, A, dt_bias=None, dt_softplus=False,
                         dt_limit=(0.0, math.inf)):
    """dcs, ddt_direct (b, h, c, Q) float32: gradients at dA_cumsum and at the processed dt; T (b, h, c, Q):
    the chunk-state terms, whose dA gradient is sum_{j < t} T_j; ddA: gradient at dA itself.

    Returns (ddt (b, L, h) in dt's dtype, dA (h,) float32, ddt_bias (h,) float32 or None)."""
    b, L, h = dt.shape
    nc, Q = dcs.shape[2], dcs.shape[3]
    ddt = torch.empty(b, L, h, device=dt.device, dtype=dt.dtype)
    dA_part = torch.empty(b * nc, h, device=dt.device, dtype=torch.float32)
    dbias_part = torch.empty(b * nc, h, device=dt.device, dtype=torch.float32)
    BQ = max(16, triton.next_power_of_2(Q))
    ssd_bwd_kernel_cumsum[lambda m: (b * nc, triton.cdiv(h, m["BH"]))](
        dt, A, dt_bias, dcs.contiguous(), T.contiguous(), ddA.contiguous(), ddt_direct.contiguous(), ddt, dA_part, dbias_part, L, h, nc, Q,
        float(dt_limit[0]), float(dt_limit[1]), *dt.stride(), DT_SOFTPLUS=dt_softplus, BQ=BQ)
    return ddt, dA_part.sum(0), (dbias_part.sum(0) if dt_bias is not None else None)


# ---- the whole backward ---------------------------------------------------------------------------------------

def ssd_combined_bwd(dy, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                     seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf), pregate=None, dfinal=None,
                     forward=None):
    """Gradients of every input. ``pregate`` (output before z gating) must be given when z is. ``forward``:
    (dt_out, dA_cumsum, float32 passed states) kept by the forward; without it (or where an entry is None)
    they are recomputed. CB is always recomputed.

    Returns dict: x, dt, A, B, C, D, z, dt_bias, initial_states (None where the input is None)."""
    dt_out, dA_cs, passed = forward if forward is not None else (None, None, None)
    if dt_out is None or dA_cs is None:
        dt_out, dA_cs = ssd_chunk_cumsum_fwd(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                             dt_limit=dt_limit)
    CB = ssd_bmm_fwd(C, B, chunk_size)
    if passed is None or passed.dtype != torch.float32:
        states = ssd_chunk_state_fwd(x, B, dt_out, dA_cs, seq_idx=seq_idx)
        passed, _ = ssd_state_passing_fwd(states, dA_cs, seq_idx=seq_idx, initial_states=initial_states)
    dz = None
    if z is not None:
        ds, dz = ssd_gate_bwd(dy, z, pregate)
    else:
        ds = dy
    dH = ssd_chunk_state_bwd_dstates(ds, C, dA_cs, seq_idx=seq_idx)
    dS, dinit, dcs_last = ssd_state_passing_bwd(dH, passed, dA_cs, seq_idx=seq_idx, dfinal=dfinal,
                                                need_dinitial=initial_states is not None)
    dCB, ddA = ssd_dcb_ddA_bwd(x, ds, CB, dt_out, dA_cs, seq_idx=seq_idx)
    dC, dcs_C = ssd_dC_bwd(ds, B, C, dCB, dA_cs, passed, seq_idx=seq_idx)
    dB, T = ssd_dB_bwd(x, B, C, dCB, dt_out, dA_cs, dS, seq_idx=seq_idx)
    dx, ddt_direct, dD = ssd_dx_bwd(x, ds, B, CB, dt_out, dA_cs, dS, seq_idx=seq_idx, D=D)
    dcs = dcs_C
    dcs[..., -1] += dcs_last
    ddt, dA, ddt_bias = ssd_chunk_cumsum_bwd(dcs, T, ddA, ddt_direct, dt, A, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                             dt_limit=dt_limit)
    return dict(x=dx, dt=ddt, A=dA.to(A.dtype), B=dB, C=dC, D=dD.to(D.dtype) if D is not None else None, z=dz,
                dt_bias=ddt_bias.to(dt_bias.dtype) if dt_bias is not None else None,
                initial_states=dinit.to(initial_states.dtype) if initial_states is not None else None)
