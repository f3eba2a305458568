"""The public entry: ``ssd_chunk_scan_combined``, a drop-in for mamba_chunk_scan_combined (same signature,
same returns), differentiable through ssdiff's Triton backward kernels."""

from __future__ import annotations

import math

import torch

from kernels.ssd.backward import ssd_combined_bwd
from kernels.ssd.forward import ssd_combined_fwd


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, return_varlen_states):
    b, L, h, p = x.shape
    if dt.shape != (b, L, h):
        raise ValueError(f"dt: expected shape {(b, L, h)}, got {tuple(dt.shape)}")
    if A.shape != (h,):
        raise ValueError(f"A: expected shape {(h,)}, got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (b, L) or h % B.shape[2]:
        raise ValueError(f"B: expected (batch, seqlen, ngroups, dstate) with ngroups dividing nheads={h}, "
                         f"got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C: expected B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    if D is not None and D.shape not in ((h,), (h, p)):
        raise ValueError(f"D: expected shape {(h,)} or {(h, p)}, got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z: expected x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None and dt_bias.shape != (h,):
        raise ValueError(f"dt_bias: expected shape {(h,)}, got {tuple(dt_bias.shape)}")
    if initial_states is not None and initial_states.shape != (b, h, p, B.shape[3]):
        raise ValueError(f"initial_states: expected shape {(b, h, p, B.shape[3])}, "
                         f"got {tuple(initial_states.shape)}")
    if seq_idx is not None and seq_idx.shape != (b, L):
        raise ValueError(f"seq_idx: expected shape {(b, L)}, got {tuple(seq_idx.shape)}")
    if return_varlen_states:
        if cu_seqlens is None or seq_idx is None or b != 1:
            raise ValueError("return_varlen_states needs cu_seqlens, seq_idx and batch 1")


class SSDChunkScanCombinedFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                return_final_states=False, return_varlen_states=False):
        if seq_idx is not None and seq_idx.dtype != torch.int32:
            seq_idx = seq_idx.to(torch.int32)
        grad = any(ctx.needs_input_grad)
        res = ssd_combined_fwd(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                               initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                               dt_softplus=dt_softplus, dt_limit=dt_limit,
                               return_varlen_states=return_varlen_states, keep_pregate=z is not None,
                               keep_states=grad)
        # Kept for the backward (mamba_chunk_scan_combined recomputes them): the processed dt and its cumsum
        # (2 floats per token and head) and the float32 states entering each chunk (dstate/chunk_size of
        # x's element count, in float32). Recomputing them is the chunk-state and state-passing stages again.
        kept = (res.dt_out, res.dA_cumsum, res.passed_states) if grad else (None, None, None)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, res.pregate, *kept)
        ctx.chunk_size, ctx.dt_softplus, ctx.dt_limit = chunk_size, dt_softplus, dt_limit
        ctx.return_varlen_states = return_varlen_states
        out = res.out
        if not return_varlen_states:
            return out if not return_final_states else (out, res.final_states)
        return (out, res.varlen_states) if not return_final_states else (out, res.final_states, res.varlen_states)

    @staticmethod
    def backward(ctx, dout, *rest):
        if ctx.return_varlen_states:
            raise RuntimeError("return_varlen_states=True is forward only (as in mamba_chunk_scan_combined): call "
                               "without it to differentiate")
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, pregate, dt_out, dA_cs, passed = ctx.saved_tensors
        dfinal = rest[0] if rest else None
        g = ssd_combined_bwd(dout, x, dt, A, B, C, ctx.chunk_size, D=D, z=z, dt_bias=dt_bias,
                             initial_states=initial_states, seq_idx=seq_idx, dt_softplus=ctx.dt_softplus,
                             dt_limit=ctx.dt_limit, pregate=pregate, dfinal=dfinal,
                             forward=(dt_out, dA_cs, passed))
        return (g["x"], g["dt"], g["A"], g["B"], g["C"], None, g["D"], g["z"], g["dt_bias"], g["initial_states"],
                None, None, None, None, None, None)


def ssd_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                            seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                            return_final_states=False, return_varlen_states=False):
    """Mamba-2 SSD, chunked, with ssdiff's Triton kernels (forward and backward).

    Args:
        x: (batch, seqlen, nheads, headdim)
        dt: (batch, seqlen, nheads)
        A: (nheads,)
        B, C: (batch, seqlen, ngroups, dstate), ngroups dividing nheads (heads in contiguous blocks per group)
        chunk_size: int
        D: (nheads,) or (nheads, headdim) or None
        z: like x, or None (gates the output with silu(z))
        dt_bias: (nheads,) or None
        initial_states: (batch, nheads, headdim, dstate) or None; feeds only tokens of sequence 0
        seq_idx: (batch, seqlen) int, non-decreasing, -1 marks padding tokens (they affect nothing)
        cu_seqlens: (nseq + 1,), only with return_varlen_states (batch 1)
        dt_softplus: apply softplus (identity above 20) to dt + dt_bias
        dt_limit: (low, high) clamp of the processed dt
    Returns:
        out (batch, seqlen, nheads, headdim) in x's dtype; with return_final_states also final_states
        (batch, nheads, headdim, dstate) float32; with return_varlen_states also varlen_states
        (nseq, nheads, headdim, dstate) float32 — as mamba_chunk_scan_combined.
    """
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, return_varlen_states)
    return SSDChunkScanCombinedFn.apply(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                        cu_seqlens, dt_softplus, tuple(dt_limit), return_final_states,
                                        return_varlen_states)
