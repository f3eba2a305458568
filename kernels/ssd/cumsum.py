"""Stage 1: dt processing and the within-chunk cumulative sum of dt*A; and its backward.

    forward   dt'_t = clamp(softplus?(dt_t + dt_bias?), dt_limit)      cs_t = sum_{s <= t in chunk} dt'_s A_h
    backward  ddA_t = sum_{s >= t} dcs_s  (a reverse cumsum: the terms through cs_s itself)
                    + sum_{j < t} T_j     (the chunk-state terms, from the dB kernel: an exclusive prefix sum)
                    + ddA_t (in)          (the intra-chunk terms, from the dCB/ddA kernel)
              ddt'_t += ddA_t A;  dA = sum_t ddA_t dt'_t;  then through the clamp (zero strictly outside
              dt_limit; at a bound it passes, as torch.clamp's and mamba_ssm's do), the softplus (sigmoid) and
              the bias: ddt, ddt_bias = sum ddt.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import configs
from .common import softplus


@configs.autotune("cumsum", key=["H", "Q", "DT_SOFTPLUS"])
@triton.heuristics({"HAS_DT_BIAS": lambda a: a["dt_bias"] is not None})
@triton.jit
def ssd_fwd_kernel_cumsum(
    dt, A, dt_bias, dt_out, dA_cs,
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
    p_dt = dt + i_b.to(tl.int64) * s_dt_b + o_t.to(tl.int64)[:, None] * s_dt_l + o_h[None, :] * s_dt_h
    b_dt = tl.load(p_dt, mask=m_t[:, None] & m_h[None, :], other=0.0).to(tl.float32)   # [BQ, BH]
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)
    b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)
    b_dt = tl.where(m_t[:, None] & m_h[None, :], b_dt, 0.0)
    b_A = tl.load(A + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_cs = tl.cumsum(b_dt * b_A[None, :], axis=0)
    # (b, h, c, Q) chunk-major layout
    o_out = ((i_b.to(tl.int64) * H + o_h[None, :]) * NC + i_c) * Q + o_q[:, None]
    m_out = (o_q < Q)[:, None] & m_h[None, :]
    tl.store(dt_out + o_out, b_dt, mask=m_out)
    tl.store(dA_cs + o_out, b_cs, mask=m_out)


def ssd_cumsum_fwd(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """dt (b, L, h) any dtype/strides, A (h,), dt_bias (h,) or None.

    Returns (dt_out, dA_cumsum), both (b, h, c, Q) float32; positions past L hold dt' = 0."""
    b, L, h = dt.shape
    Q = chunk_size
    nc = triton.cdiv(L, Q)
    dt_out = torch.empty(b, h, nc, Q, device=dt.device, dtype=torch.float32)
    dA_cs = torch.empty_like(dt_out)
    BQ = max(16, triton.next_power_of_2(Q))
    ssd_fwd_kernel_cumsum[lambda m: (b * nc, triton.cdiv(h, m["BH"]))](
        dt, A, dt_bias, dt_out, dA_cs, L, h, nc, Q, float(dt_limit[0]), float(dt_limit[1]), *dt.stride(),
        DT_SOFTPLUS=dt_softplus, BQ=BQ)
    return dt_out, dA_cs


# ---- backward ----------------------------------------------------------------------------------------------

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
    b_draw = tl.where(m & (b_sp >= dt_min) & (b_sp <= dt_max), b_dd * b_dsp, 0.0)
    tl.store(ddt + ((i_b.to(tl.int64) * L + o_t[:, None]) * H + o_h[None, :]), b_draw.to(ddt.dtype.element_ty),
             mask=m)
    tl.store(dA_part + i_bc.to(tl.int64) * H + o_h, tl.sum(tl.where(m, b_ddA * b_dtp, 0.0), axis=0), mask=m_h)
    tl.store(ddt_bias_part + i_bc.to(tl.int64) * H + o_h, tl.sum(b_draw, axis=0), mask=m_h)


def ssd_cumsum_bwd(dcs, T, ddA, ddt_direct, dt, A, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
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
        dt, A, dt_bias, dcs.contiguous(), T.contiguous(), ddA.contiguous(), ddt_direct.contiguous(), ddt, dA_part,
        dbias_part, L, h, nc, Q,
        float(dt_limit[0]), float(dt_limit[1]), *dt.stride(), DT_SOFTPLUS=dt_softplus, BQ=BQ)
    return ddt, dA_part.sum(0), (dbias_part.sum(0) if dt_bias is not None else None)
