"""Stage 1: dt processing and the within-chunk cumulative sum of dt*A.

    dt' = clamp(softplus?(dt + dt_bias?), dt_limit)     dA_cumsum[t] = sum_{s<=t in chunk} dt'_s A_h
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from kernels.ssd import configs
from kernels.ssd.common import softplus


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


def ssd_chunk_cumsum_fwd(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
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
