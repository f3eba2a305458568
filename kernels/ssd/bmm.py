"""Stage 4: C . B^T inside each chunk, per group (native groups: never expanded to heads).

    CB[b, c, g, i, j] = sum_n C[b, cQ+i, g, n] B[b, cQ+j, g, n]        (zero where a token is past L)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ssd import configs
from kernels.ssd.common import tile_major


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
