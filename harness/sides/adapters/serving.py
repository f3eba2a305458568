"""How a serving engine calls vLLM's varlen prefill, as scenarios the harness can judge.

A serving engine does not call the prefill once per sequence: it splits a long prompt over several steps
(chunked prefill), carrying each sequence's state from one call to the next and telling the chunk metadata how
many tokens are already computed; it packs unrelated requests side by side, empty ones included; and with
prefix caching it keeps the state at every chunk end. Each scenario is judged the way every implementation is:

- `ChunkedPrefill` (registered as ``vllm.chunked_prefill``) is an implementation: each sequence of a case is cut
  at a point drawn from the case's seed, the first parts prefilled in one call, the rest in a second call from the
  states the first returned (``initial_states``) with the first parts counted as computed tokens; y and the
  final states are assembled and judged against the float64 oracle of the whole case like any other output.
- `intermediate_states` returns the intermediate states (``return_intermediate_states``): the state at the end
  of each logical chunk is the final state of the case cut at that token (`prefix_case`, `prefix_inputs`), so
  each is judged as the varlen states of that prefix (ssdiff.investigate.serving).
- `neighbour_mismatches` runs each sequence alone, in its pack, and beside an empty request, and lists the
  outputs that differ. The logical chunks of a sequence are the same in every pack (they follow its own token
  positions), every program reads only its own chunk, and nothing accumulates across programs (no atomics), so
  under one autotune config the sequence's outputs must be bitwise the same.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ssdiff.model.case import Case
from ssdiff.sides.chunk_metadata import chunk_metadata
from ssdiff.model.evaluation import Evaluation
from ssdiff.sides.registry import register
from ssdiff.sides.adapters.vllm import ChunkScanCombinedVarlen, Pack, pack, run_varlen
from ssdiff.inputs import Inputs, cu_seqlens, seq_idx_rows

TIME_MAJOR = ("x", "dt", "B", "C", "z")


@dataclass(frozen=True)
class Piece:
    """``length`` tokens of batch row ``row`` from token ``start``, ``computed`` tokens of its request before."""

    row: int
    start: int
    length: int
    computed: int = 0


def sequences(case: Case) -> list:
    """The case's sequences as pieces, in pack order (a row without seq_idx is one sequence)."""
    out = []
    for row in range(case.batch):
        start = 0
        for length in (case.segments[row] if case.segments is not None else (case.seqlen,)):
            out.append(Piece(row, start, length))
            start += length
    return out


def pack_pieces(case: Case, tensors: dict, pieces: Sequence[Piece], initial_states: Optional[torch.Tensor]) -> Pack:
    """A pack of ``pieces`` (copied out of the case's tensors, in order) with one initial state per piece."""
    packed = {}
    for name in TIME_MAJOR:
        if name in tensors:
            t = tensors[name]
            parts = [t[p.row, p.start:p.start + p.length] for p in pieces]
            packed[name] = torch.cat(parts) if parts else t[0, :0]
    for name in ("A", "D", "dt_bias"):
        if name in tensors:
            packed[name] = tensors[name]
    meta = chunk_metadata([p.length for p in pieces], case.chunk_size, [p.computed for p in pieces])
    return Pack(tensors=packed, rows=tuple(p.row for p in pieces), initial_states=initial_states, metadata=meta,
                last_of_row=())


def sequence_initial_states(case: Case, tensors: dict) -> Optional[torch.Tensor]:
    """The per-sequence initial states the adapter gives the case's sequences (`sequences`), or None."""
    return pack(case, tensors).initial_states if "initial_states" in tensors else None


# ---- chunked prefill ---------------------------------------------------------------------------------------

def cut_points(case: Case, pieces: Sequence[Piece]) -> list:
    """Where each sequence is cut (1 .. length - 1; a one-token sequence is not cut), drawn from the seed."""
    rng = random.Random(case.seed * 7919 + 17)
    return [rng.randint(1, p.length - 1) if p.length > 1 else p.length for p in pieces]


class ChunkedPrefill(ChunkScanCombinedVarlen):
    """The prefill in two calls, as chunked prefill runs it: see the module docstring. ``carry`` false
    plants the bug of a runner that forgets the carried state (properties/test_vllm.py shows the property
    catches it)."""

    name = "vllm.chunked_prefill"
    description = ("vllm mamba_chunk_scan_combined_varlen in two calls (chunked prefill: states carried, "
                   "first parts counted as computed tokens; forward only)")

    def __init__(self, name: Optional[str] = None, carry: bool = True):
        if name:
            self.name = name
        self.carry = carry

    def forward(self, case, tensors, inputs, want_stages):
        rel = self.release
        seqs = sequences(case)
        h0 = sequence_initial_states(case, tensors)
        cuts = cut_points(case, seqs)
        first = [dataclasses.replace(p, length=c) for p, c in zip(seqs, cuts)]
        y1, states1 = run_varlen(rel, case, pack_pieces(case, tensors, first, h0))
        rest = [(i, Piece(p.row, p.start + c, p.length - c, computed=c)) for i, (p, c) in enumerate(zip(seqs, cuts))
                if p.length > c]
        final = states1.clone()
        y = torch.empty(tensors["x"].shape, dtype=y1.dtype, device=y1.device)
        offset = 0
        for p in first:
            y[p.row, p.start:p.start + p.length] = y1[offset:offset + p.length]
            offset += p.length
        if rest:
            carried = states1[[i for i, _ in rest]]
            if not self.carry:
                carried = torch.zeros_like(carried)
            y2, states2 = run_varlen(rel, case, pack_pieces(case, tensors, [p for _, p in rest], carried))
            offset = 0
            for k, (i, p) in enumerate(rest):
                y[p.row, p.start:p.start + p.length] = y2[offset:offset + p.length]
                offset += p.length
                final[i] = states2[k]
        outputs = {"y": y}
        last_of_row = [max(i for i, p in enumerate(seqs) if p.row == row and p.length) for row in range(case.batch)]
        if case.return_final_states:
            outputs["final_states"] = final[last_of_row]
        if case.varlen_states:
            outputs["varlen_states"] = final
        notes = self.notes() + [f"chunked prefill: sequences cut at {cuts}"]
        return Evaluation(outputs=outputs, notes=notes)


# ---- prefix-cache states -------------------------------------------------------------------------------

def prefix_case(case: Case, end: int) -> Case:
    """Batch-1 ``case`` cut after token ``end``, asking for one final state per sequence."""
    segs = case.segments[0] if case.segments is not None else (case.seqlen,)
    kept, start = [], 0
    for length in segs:
        if start >= end:
            break
        kept.append(min(length, end - start))
        start += length
    return case.replace(seqlen=end, segments=(tuple(kept),), padding=None, varlen_states=True,
                        return_final_states=True)


def prefix_inputs(inputs: Inputs, sub: Case) -> Inputs:
    """``inputs`` restricted to the first ``sub.seqlen`` tokens (the same numbers: nothing is redrawn)."""
    L = sub.seqlen
    values = {k: (v[:, :L] if k in TIME_MAJOR else v) for k, v in inputs.values.items()}
    device = inputs.device
    seq = seq_idx_rows(sub)
    cu = cu_seqlens(sub)
    return dataclasses.replace(inputs, case=sub, values=values, grad_outputs={}, wide_order=(),
                               seq_idx=seq.to(device), cu_seqlens=cu.to(device))


def intermediate_states(rel, case: Case, tensors: dict) -> tuple:
    """vLLM's state at the end of every logical chunk (nchunks, H, P, N) and the pack's metadata."""
    p = pack(case, tensors)
    _, states = run_varlen(rel, case, p, return_intermediate_states=True)
    return states, p.metadata


# ---- neighbours in the pack ----------------------------------------------------------------------------

def neighbour_mismatches(rel, case: Case, tensors: dict, empty_computed: int = 0,
                         run: Callable = run_varlen) -> list:
    """Each non-empty sequence of ``case`` run alone, in the case's pack (its empty sequences included), and with
    an empty request before it (``empty_computed`` tokens already computed: an unaligned count gives it a
    zero-length chunk) and one after; the outputs (y over its tokens and its final state) that differ from the
    alone run, as one line each."""
    seqs = sequences(case)
    h0 = sequence_initial_states(case, tensors)
    h, p, n = case.nheads, case.headdim, case.dstate
    device = tensors["x"].device
    if h0 is None:
        h0 = torch.zeros(len(seqs), h, p, n, dtype=torch.float32, device=device)
    garbage = torch.randn(1, h, p, n, generator=torch.Generator().manual_seed(case.seed)).to(device)

    def runs(pieces, states):
        y, final = run(rel, case, pack_pieces(case, tensors, pieces, states))
        return y, final

    def ys(y, pieces):
        out, offset = [], 0
        for piece in pieces:
            out.append(y[offset:offset + piece.length])
            offset += piece.length
        return out

    all_y, all_final = runs(seqs, h0)
    packed = ys(all_y, seqs)
    problems = []
    empty = Piece(row=0, start=0, length=0, computed=empty_computed)
    for i, piece in enumerate(seqs):
        if not piece.length:
            continue        # no token to run alone (its returned state: vllm-varlen-empty-sequence-state)
        alone_y, alone_final = runs([piece], h0[i:i + 1])
        beside = [empty, piece, empty]
        beside_y, beside_final = runs(beside, torch.cat([garbage, h0[i:i + 1], garbage]))
        for label, y, final in (("in its pack", packed[i], all_final[i]),
                                (f"beside empty requests ({empty_computed} computed tokens)",
                                 ys(beside_y, beside)[1], beside_final[1])):
            for what, got, want in (("y", y, alone_y), ("final state", final, alone_final[0])):
                if not torch.equal(got, want):
                    diff = (got.double() - want.double()).abs()
                    problems.append(f"sequence {i} (row {piece.row}, tokens {piece.start}..{piece.start + piece.length}"
                                    f") {label}: {what} differs from the sequence alone (max |diff| "
                                    f"{diff.max().item():.3g} at {tuple(int(v) for v in (diff == diff.max()).nonzero()[0])})")
    return problems


register(ChunkedPrefill())
