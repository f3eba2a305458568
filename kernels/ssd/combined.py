"""The SSD pipeline and its public entry.

    forward   1 cumsum, 2 bmm, 3 chunk_state, 4 state_passing, 5 chunk_scan                   ssd_combined_fwd
    backward  5 gate, 3 dstates, 4 state_passing, 5 dcb_ddA, 2 dC and dB, 5 dx, 1 cumsum        ssd_combined_bwd

(stage numbers as the files: cumsum.py, bmm.py, chunk_state.py, state_passing.py, chunk_scan.py; each states
the math of its forward and backward kernels). ``ssd_chunk_scan_combined`` is a drop-in for
mamba_chunk_scan_combined (same signature, same returns), differentiable through the backward kernels
(SSDChunkScanCombinedFn).

Notation (kernels/README.md): cs = dA_cumsum, ds = dL/d(scan output) (= dy silu(z) with z, else dy), H_k the
state entering chunk k, S_k chunk k's own end state, dS_k = dL/dS_k = G_{k+1} (the reverse state recurrence).
Every reduction that crosses programs is written as per-tile partial sums (indexed by 16-wide granules, so any
configuration fills the same buffer) and summed by torch afterwards: no atomics, run-to-run identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .bmm import ssd_bmm_fwd, ssd_dB_bwd, ssd_dC_bwd
from .chunk_scan import ssd_chunk_scan_fwd, ssd_dcb_ddA_bwd, ssd_dx_bwd, ssd_gate_bwd
from .chunk_state import ssd_chunk_state_fwd, ssd_dstates_bwd, ssd_varlen_states_fwd
from .cumsum import ssd_cumsum_bwd, ssd_cumsum_fwd
from .state_passing import ssd_state_passing_bwd, ssd_state_passing_fwd


# ---- the stages in order -----------------------------------------------------------------------------------

@dataclass
class ForwardResult:
    out: torch.Tensor                      # (b, L, h, p) x.dtype
    final_states: torch.Tensor             # (b, h, p, n) float32
    dt_out: torch.Tensor                   # (b, h, c, Q) float32
    dA_cumsum: torch.Tensor                # (b, h, c, Q) float32
    CB: torch.Tensor                       # (b, c, g, Q, Q) float32
    chunk_states: torch.Tensor             # (b, c, h, p, n) float32
    passed_states: torch.Tensor            # (b, c, h, p, n) float32 (C's dtype without stages)
    pregate: Optional[torch.Tensor] = None  # (b, L, h, p): after D, before z
    scan: Optional[torch.Tensor] = None     # (b, L, h, p) float32: before D
    varlen_states: Optional[torch.Tensor] = None


def ssd_combined_fwd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                     seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                     return_varlen_states=False, keep_pregate=False, keep_states=False,
                     stages=False) -> ForwardResult:
    """Run every forward stage. ``keep_pregate``: keep the output before z gating (backward needs it);
    ``keep_states``: passed states in float32 (the backward reuses them); ``stages``: keep the fp32 scan
    output and an fp32 pre-gate output too (for localization)."""
    dt_out, dA_cs = ssd_cumsum_fwd(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                   dt_limit=dt_limit)
    CB = ssd_bmm_fwd(C, B, chunk_size)
    states = ssd_chunk_state_fwd(x, B, dt_out, dA_cs, seq_idx=seq_idx)
    # The chunk scan reads the passed states rounded to C's dtype (its tensor-core operand): stored that way
    # they cost half the traffic, bit for bit the same output. Kept in float32 where they are read exactly
    # (varlen states, the backward) or reported (stages).
    exact = stages or keep_states or return_varlen_states or C.dtype == torch.float32
    passed, final = ssd_state_passing_fwd(states, dA_cs, seq_idx=seq_idx, initial_states=initial_states,
                                          out_dtype=None if exact else C.dtype)
    want_pregate = (keep_pregate and z is not None) or (stages and (D is not None or z is not None))
    out, scan, pregate = ssd_chunk_scan_fwd(
        x, C, CB, dt_out, dA_cs, passed, seq_idx=seq_idx, D=D, z=z, return_scan=stages,
        return_pregate=want_pregate, pregate_dtype=torch.float32 if stages else None)
    varlen = None
    if return_varlen_states:
        varlen = ssd_varlen_states_fwd(x, B, dt_out, dA_cs, passed, seq_idx, cu_seqlens)
    return ForwardResult(out, final, dt_out, dA_cs, CB, states, passed, pregate, scan, varlen)


def ssd_combined_bwd(dy, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                     seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf), pregate=None, dfinal=None,
                     forward=None):
    """Gradients of every input. ``pregate`` (output before z gating) must be given when z is. ``forward``:
    (dt_out, dA_cumsum, float32 passed states) kept by the forward; without it (or where an entry is None)
    they are recomputed. CB is always recomputed.

    Returns dict: x, dt, A, B, C, D, z, dt_bias, initial_states (None where the input is None)."""
    dt_out, dA_cs, passed = forward if forward is not None else (None, None, None)
    if dt_out is None or dA_cs is None:
        dt_out, dA_cs = ssd_cumsum_fwd(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
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
    dH = ssd_dstates_bwd(ds, C, dA_cs, seq_idx=seq_idx)
    dS, dinit, dcs_last = ssd_state_passing_bwd(dH, passed, dA_cs, seq_idx=seq_idx, dfinal=dfinal,
                                                need_dinitial=initial_states is not None)
    dCB, ddA = ssd_dcb_ddA_bwd(x, ds, CB, dt_out, dA_cs, seq_idx=seq_idx)
    dC, dcs_C = ssd_dC_bwd(ds, B, C, dCB, dA_cs, passed, seq_idx=seq_idx)
    dB, T = ssd_dB_bwd(x, B, C, dCB, dt_out, dA_cs, dS, seq_idx=seq_idx)
    dx, ddt_direct, dD = ssd_dx_bwd(x, ds, B, CB, dt_out, dA_cs, dS, seq_idx=seq_idx, D=D)
    dcs = dcs_C
    dcs[..., -1] += dcs_last
    ddt, dA, ddt_bias = ssd_cumsum_bwd(dcs, T, ddA, ddt_direct, dt, A, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                       dt_limit=dt_limit)
    return dict(x=dx, dt=ddt, A=dA.to(A.dtype), B=dB, C=dC, D=dD.to(D.dtype) if D is not None else None, z=dz,
                dt_bias=ddt_bias.to(dt_bias.dtype) if dt_bias is not None else None,
                initial_states=dinit.to(initial_states.dtype) if initial_states is not None else None)


# ---- the autograd Function and the public entry ------------------------------------------------------------

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
