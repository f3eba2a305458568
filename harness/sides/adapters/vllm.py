"""Adapters for vLLM's copies of the SSD kernels (the serving fork), loaded from its wheel by ssdiff.sides.upstream_vllm.

    vllm.chunk_scan_combined_varlen  mamba_chunk_scan_combined_varlen: varlen-only prefill over chunk-aligned
                                     metadata (chunk_scan entry; forward only)
    vllm.selective_state_update      selective_state_update: the decode step kernel (decode entry)

How a Case maps onto the varlen prefill (the mapping is the adapter's only work; it reshapes no values):
the batch rows are laid end to end into one token-major pack (x (T, H, P), dt (T, H), B and C (T, G, N), z like
x; T = batch * seqlen; a view, so a strided case stays strided); each of a row's seq_idx segments is one
sequence (a row without seq_idx is one sequence); the chunk metadata is ssdiff.sides.chunk_metadata's, the model
runner's rule. initial_states become one per sequence: a row's initial state for its sequence numbered 0, zeros
for every other sequence (a row whose seq_idx does not start at 0 has none). Outputs: y is the pack reshaped
back to (b, L, H, P); final_states per row are the returned state of the row's last sequence; varlen_states are
all of them. The states are asked for in float32 (``state_dtype``), the dtype the Case's final states have.

What the API cannot express is declared: the backward pass (vLLM is inference-only) and seq_idx = -1 padding
(the pack holds real tokens only). ``pack`` and ``run_varlen`` are public so that the serving properties
(properties/test_vllm.py) drive exactly the call the adapter makes, with its other arguments (intermediate
states, a state cache with final_state_indices, computed tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ssdiff import runtime
from ssdiff.sides import upstream_vllm
from ssdiff.model.case import Case
from ssdiff.sides.chunk_metadata import ChunkMetadata, chunk_metadata
from ssdiff.model.evaluation import Evaluation
from ssdiff.sides.registry import register
from ssdiff.sides.base import UPSTREAM, Capabilities, Implementation, Testing, limit
from ssdiff.sides.adapters.mamba_ssm import unclamped_dt


@dataclass
class Pack:
    """A batch of sequences packed token-major, as vLLM's prefill takes them.

    tensors: x, dt, B, C (and z) packed; A, D, dt_bias as given; rows: per sequence, the batch row it came
    from; initial_states: (nseq, H, P, N) float32 or None; metadata: the chunk metadata."""

    tensors: dict
    rows: tuple
    initial_states: Optional[torch.Tensor]
    metadata: ChunkMetadata
    last_of_row: tuple


def _packed(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def pack(case: Case, tensors: dict, computed: Optional[Sequence[int]] = None) -> Pack:
    """The pack of ``case``'s tensors (native dtypes, the case's layout): see the module docstring."""
    b, L = case.batch, case.seqlen
    lengths, rows, first_of_row, last_of_row = [], [], [], []
    for row in range(b):
        segs = case.segments[row] if case.segments is not None else (L,)
        first_of_row.append(len(lengths))
        lengths.extend(segs)
        rows.extend([row] * len(segs))
        # the row's final state is its last non-empty sequence's (an empty one after it adds no token)
        last_of_row.append(max(i for i, n in enumerate(lengths) if n and rows[i] == row))
    packed = {name: _packed(tensors[name]) for name in ("x", "dt", "B", "C", "z") if name in tensors}
    for name in ("A", "D", "dt_bias"):
        if name in tensors:
            packed[name] = tensors[name]
    h0 = tensors.get("initial_states")
    states = None
    if h0 is not None:
        states = h0.new_zeros(len(lengths), *h0.shape[1:])
        if case.seq_idx_start == 0:
            for row in range(b):
                states[first_of_row[row]] = h0[row]
    return Pack(tensors=packed, rows=tuple(rows), initial_states=states,
                metadata=chunk_metadata(lengths, case.chunk_size, computed), last_of_row=tuple(last_of_row))


def _int32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def run_varlen(rel: upstream_vllm.VllmRelease, case: Case, p: Pack, initial_states="pack",
               return_intermediate_states: bool = False, final_states_out: Optional[torch.Tensor] = None,
               final_state_indices: Optional[torch.Tensor] = None, state_dtype=torch.float32):
    """Call mamba_chunk_scan_combined_varlen on a pack; returns (y (T, H, P), what the call returned)."""
    t = p.tensors
    device = t["x"].device
    m = p.metadata
    out = torch.empty(t["x"].shape, dtype=t["x"].dtype, device=device)
    h0 = p.initial_states if isinstance(initial_states, str) else initial_states
    optional = dict(return_intermediate_states=return_intermediate_states, state_dtype=state_dtype,
                    final_states_out=final_states_out, final_state_indices=final_state_indices)
    accepted = rel.params(rel.varlen)
    missing = sorted(k for k, v in optional.items() if k not in accepted and v not in (None, False))
    if missing:
        raise upstream_vllm.Unavailable(f"{rel.label}'s mamba_chunk_scan_combined_varlen has no {', '.join(missing)}")
    rel.forget_tuned_configs()
    returned = rel.varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], case.chunk_size,
                          cu_seqlens=_int32(m.cu_seqlens, device), cu_chunk_seqlens=_int32(m.cu_chunk_seqlens, device),
                          last_chunk_indices=_int32(m.last_chunk_indices, device), seq_idx=_int32(m.seq_idx, device),
                          out=out, D=t.get("D"), z=t.get("z"), dt_bias=t.get("dt_bias"), initial_states=h0,
                          dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
                          **{k: v for k, v in optional.items() if k in accepted})
    return out, returned


class VllmImplementation(Implementation):
    """Common ground: the release, availability, dtype gating."""

    needs = ""
    # the upstream adapters' cases, more of them (a serving kernel's forward is all there is to check); no pinned
    # every-feature cases (test_vllm's every-feature property has its own)
    testing = Testing(domains=(dataclasses.replace(UPSTREAM, examples=(10, 10), native_examples=(20, 20)),), pinned=())

    @property
    def release(self) -> upstream_vllm.VllmRelease:
        return upstream_vllm.vllm()

    def unavailable(self) -> Optional[str]:
        problem = upstream_vllm.vllm_problem()
        if problem:
            return problem
        if self.needs in self.release.missing:
            return self.release.missing[self.needs]
        return runtime.no_triton_reason()

    def declared(self, **fields) -> Capabilities:
        base = dict(dtypes=frozenset(runtime.runnable_dtypes()),
                    devices=runtime.kernel_devices() or frozenset({"cuda"}), backward=False)
        base.update(fields)
        return Capabilities(**base)

    def skip_reason(self, case: Case, device: str) -> Optional[str]:
        if self.unavailable() is None:
            why = runtime.dtype_skip_reason(case.dtype)
            if why:
                return f"{self.name}: {why}"
        return super().skip_reason(case, device)

    def kernel_modules(self) -> tuple:
        return () if self.unavailable() else self.release.kernel_modules()

    def notes(self) -> list:
        return self.release.notes()


class ChunkScanCombinedVarlen(VllmImplementation):
    name = "vllm.chunk_scan_combined_varlen"
    description = ("vllm mamba_chunk_scan_combined_varlen (Triton; varlen prefill over chunk-aligned metadata; "
                   "forward only)")
    needs = "varlen"

    @property
    def capabilities(self) -> Capabilities:
        return self.declared(unsupported=frozenset({"padding", "gaps"}))

    def forward(self, case, tensors, inputs, want_stages):
        p = pack(case, tensors)
        y, states = run_varlen(self.release, case, p)
        outputs = {"y": y.reshape(tensors["x"].shape)}
        if case.return_final_states:
            outputs["final_states"] = states[list(p.last_of_row)]
        if case.varlen_states:
            outputs["varlen_states"] = states
        return Evaluation(outputs=outputs, notes=self.notes())


# ---- the decode step ---------------------------------------------------------------------------------------

def _state_dtype_runs(case: Case) -> Optional[str]:
    why = runtime.dtype_skip_reason(case.state_dtype) if case.entry == "decode" else None
    return f"state dtype {case.state_dtype}: {why}" if why else None


class SelectiveStateUpdate(VllmImplementation):
    """The decode entry by vLLM's step kernel (no dt_limit argument: like mamba_ssm's, it never clamps dt, so
    dt_bias without softplus is outside what it expresses), called as vLLM's Mamba-2 mixer calls it: A, dt and dt_bias
    broadcast over headdim with stride 0 (the kernel's tie_hdim path), D per head broadcast the same way (or
    per channel), ``out`` preallocated, one call per decoded token, the state updated in place in a state
    cache. With state_batch_indices, slot ``null_block_id`` (vLLM's NULL_BLOCK_ID) is reserved as vLLM
    reserves it (the cache has batch + 1 slots) and row i lives in the state_indices[i]-th of the other slots;
    without, row i in slot i and no indices are passed."""

    name = "vllm.selective_state_update"
    description = "vllm selective_state_update (Triton; the decode step kernel; forward only)"
    needs = "step"

    @property
    def capabilities(self) -> Capabilities:
        unsupported = {"dt_limit"}
        if self.unavailable() is None and "state_batch_indices" not in self.release.params(self.release.step):
            unsupported.add("state_batch_indices")
        return self.declared(
            entries=frozenset({"decode"}), unsupported=frozenset(unsupported),
            limits=(limit(lambda c: c.D == "none", "selective_state_update takes D as a required argument"),
                    limit(lambda c: not c.has_dt_bias, "selective_state_update takes dt_bias as a required "
                                                       "argument"),
                    unclamped_dt, _state_dtype_runs))

    def kernel_modules(self) -> tuple:
        # Its launch config comes from vLLM's tuned JSON files or a heuristic, not an autotuner.
        return () if self.unavailable() else (self.release.ops["mamba_ssm"],)

    def null_block_id(self) -> Optional[int]:
        """The slot index that marks a padded row, where the release's kernel takes one (null_block_id)."""
        if "null_block_id" not in self.release.params(self.release.step):
            return None
        return int(self.release.ops["mamba_ssm"].NULL_BLOCK_ID)

    def forward(self, case, tensors, inputs, want_stages):
        fn = self.release.step
        t = tensors
        b, h, p, n = case.batch, case.nheads, case.headdim, case.dstate
        rows = t["state"]
        index = inputs.state_indices
        kwargs = {}
        if index is not None:
            null = self.null_block_id()
            valid = torch.tensor([s for s in range(b + 1) if s != null][:b], device=rows.device)
            slots = valid[index.long()]
            cache = torch.zeros(b + 1, h, p, n, dtype=rows.dtype, device=rows.device)
            cache[slots] = rows
            kwargs = dict(state_batch_indices=slots.to(torch.int32))
            if null is not None:
                kwargs["null_block_id"] = null
        else:
            slots = None
            cache = rows.clone()
        A = t["A"][:, None, None].expand(h, p, n)
        dt_bias = t["dt_bias"][:, None].expand(h, p)
        D = t["D"]
        D = D[:, None].expand(h, p) if D.dim() == 1 else D
        ys = []
        for k in range(case.decode_steps):
            token = case.prefill_len + k
            z = t["z"][:, token] if "z" in t else None
            out = torch.empty(b, h, p, dtype=t["x"].dtype, device=t["x"].device)
            fn(cache, t["x"][:, token], t["dt"][:, token][..., None].expand(b, h, p), A, t["B"][:, token],
               t["C"][:, token], D, dt_bias, z=z, dt_softplus=case.dt_softplus, out=out, **kwargs)
            ys.append(out)
        outputs = {"y": torch.stack(ys, dim=1)}
        if case.return_final_states:
            outputs["final_states"] = cache[slots] if slots is not None else cache
        return Evaluation(outputs=outputs, notes=self.notes())


for _impl in (ChunkScanCombinedVarlen(), SelectiveStateUpdate()):
    register(_impl)
