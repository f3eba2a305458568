"""Pieces shared by the SSD kernels: small @triton.jit helpers and the launch helper.

Conventions (every kernel):
- x, z, dy: (b, L, h, p); dt: (b, L, h); B, C: (b, L, g, n); seq_idx: (b, L) int32 — any strides.
- Chunk-major fp32 intermediates: dt_out and dA_cumsum (b, h, c, Q); CB (b, c, g, Q, Q); chunk states,
  passed states (b, c, h, p, n); final states (b, h, p, n). Positions past L inside the last chunk behave
  like tokens with dt = 0 of the same sequence as the last real token (they change nothing); a chunk's dA
  cumsum total is read at its last real token (``last_in_chunk``), not at Q - 1.
- Program ids are cast to int64 before they meet a stride, so offsets past 2**31 elements are safe. The
  inner loops of the chunk state and the chunk scan start from a pointer at the chunk's first token and add
  int32 token offsets (``in_chunk``; int64 only where ``idx64`` finds a chunk's span could pass int32).
- The chunk-parallel kernels (C.B^T, chunk state, chunk scan and their backward counterparts) launch a 1-D
  grid whose tile index runs fastest (``tile_major``): the tiles of one (batch, chunk, head or group) run
  side by side and share its inputs in L2, and the heads of one group follow each other (they share C, B
  and C.B^T).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """log(1 + e^x) for x <= 20 (log1p made accurate for small e^x, Kahan's trick), x above."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x <= 20.0, lp, x)


@triton.jit
def tile_major(n_tiles):
    """(outer index, tile index) of a 1-D launch of ``outer * n_tiles`` programs, tile index fastest."""
    pid = tl.program_id(0)
    return pid // n_tiles, pid % n_tiles


def idx64(chunk_size: int, *strides: int) -> bool:
    """Whether a token offset inside a chunk times one of these strides can pass int32 (``in_chunk``). The
    offsets a tile forms, its masked overshoot past the chunk's end included, stay below 2 * chunk_size (a
    token block is at most the next power of two of the chunk size)."""
    return 2 * chunk_size * max((abs(int(s)) for s in strides), default=0) >= 2 ** 31


@triton.jit
def in_chunk(o_q, IDX64: tl.constexpr):
    """Token offsets inside a chunk, for address arithmetic against a pointer already at the chunk's first
    token: int32 (cheaper in the inner loops) unless the host found, with ``idx64``, that a chunk's span of
    a stride can pass int32."""
    if IDX64:
        o_w = o_q.to(tl.int64)
    else:
        o_w = o_q
    return o_w


@triton.jit
def last_in_chunk(i_c, L, Q):
    """The position inside chunk ``i_c`` of its last token before L: where a chunk's dA cumsum total is read.
    Past it the cumsum adds only the fill's zeros, so its value at Q - 1 equals this one in exact arithmetic, but
    tl.cumsum (a parallel scan on a GPU) rounds the two positions differently: 1-2 ulps, 0.008-0.016 at
    |dA_cumsum| ~ 1e5, which exp(cs_last - cs_j) turns into a 1.6% error on the last tokens' share of the state."""
    return tl.minimum(Q, L - i_c * Q) - 1


@triton.jit
def seq_bounds(seq_idx, o_seq, s_seq_l, i_c, L, Q, HAS_SEQ_IDX: tl.constexpr):
    """(seq of the chunk's last token, seq of the token before the chunk — 0 for the first chunk).
    ``o_seq``: offset of the batch row in seq_idx."""
    if HAS_SEQ_IDX:
        p_seq = seq_idx + o_seq
        i_end = tl.minimum((i_c + 1) * Q, L) - 1
        seq_last = tl.load(p_seq + i_end.to(tl.int64) * s_seq_l)
        seq_prev = tl.load(p_seq + (i_c * Q - 1).to(tl.int64) * s_seq_l, mask=i_c > 0, other=0)
    else:
        seq_last = 0
        seq_prev = 0
    return seq_last, seq_prev


@triton.jit
def load_seq(seq_idx, o_seq, s_seq_l, o_t, m_t, L, seq_last, HAS_SEQ_IDX: tl.constexpr):
    """seq_idx of tokens ``o_t`` (positions past L take ``seq_last``: they are dt = 0 fill)."""
    if HAS_SEQ_IDX:
        p_seq = seq_idx + o_seq
        b_seq = tl.load(p_seq + o_t.to(tl.int64) * s_seq_l, mask=m_t & (o_t < L), other=0)
        b_seq = tl.where(o_t < L, b_seq, seq_last)
    else:
        b_seq = tl.zeros(o_t.shape, dtype=tl.int32)
    return b_seq
