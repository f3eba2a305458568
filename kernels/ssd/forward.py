"""The forward pipeline: the five stage wrappers in order (each also callable alone), and the stage tensors
converted to the oracle's layout (harness/oracle/result.py) for localization."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from kernels.ssd.bmm import ssd_bmm_fwd
from kernels.ssd.chunk_scan import ssd_chunk_scan_fwd
from kernels.ssd.chunk_state import ssd_chunk_state_fwd, ssd_varlen_states_fwd
from kernels.ssd.cumsum import ssd_chunk_cumsum_fwd
from kernels.ssd.state_passing import ssd_state_passing_fwd


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
    dt_out, dA_cs = ssd_chunk_cumsum_fwd(dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
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


def chunk_major_to_tokens(t: torch.Tensor, seqlen: int) -> torch.Tensor:
    """(b, h, c, Q) -> (b, L, h)."""
    b, h, c, Q = t.shape
    return t.reshape(b, h, c * Q)[:, :, :seqlen].permute(0, 2, 1)


def oracle_stages(res: ForwardResult, seqlen: int, has_D: bool, has_z: bool) -> dict:
    """The stage intermediates in the oracle's layout and names."""
    L = seqlen
    Q = res.CB.shape[-1]
    valid = torch.arange(res.CB.shape[1] * Q, device=res.CB.device) < L
    valid = valid.reshape(res.CB.shape[1], Q)
    CB = res.CB * valid[None, :, None, :, None] * valid[None, :, None, None, :]
    st = {
        "dt": chunk_major_to_tokens(res.dt_out, L),
        "dA_cumsum": chunk_major_to_tokens(res.dA_cumsum, L),
        "chunk_states": res.chunk_states,
        "passed_states": res.passed_states,
        "CB": CB,
    }
    if res.scan is not None:
        st["scan"] = res.scan
    if has_D and res.pregate is not None:
        st["skip"] = res.pregate
    if has_z:
        st["gated"] = res.out
    return st
