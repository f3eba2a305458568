"""Huge cases: 2**31 elements or more in x or in the chunk states, the int32 offset class.

A kernel that forms a pointer offset in 32-bit integers (``pid_b * stride_x_batch + ...``) reads or writes
another element once the offset passes 2**31 - 1 (state-spaces/mamba #1015): only a case that large shows it.
At that size the float64 oracle of the whole case does not fit (x alone is 16 GiB in float64, the chunked
oracle's intermediates many times that), but it need not: in the chunk scan every head reads its own x, dt, A,
D, z, dt_bias and initial state and its group's B and C, and nothing else. So a huge case is judged on a slice
(`judged_slice`): the sides run on the whole case, and the oracle, the baseline and the verdict see the last
batch row (where every offset is largest) and two heads, the first and the last (so the first and the last
group): the slice's outputs are exactly those heads' outputs of the whole case. The verdict's coordinates are
the slice's (batch 0 is row b-1; heads 0 and 1 are heads 0 and h-1), and its notes say so.

Forward only (a gradient of B or C sums over every head of its group), the chunk_scan entry only (the fused
mixer's out_proj mixes heads). Natively, a campaign's production slots draw a huge key at a small rate
(harness/campaign/pool.py, ``Mix.huge``; the nightly workflow's campaign), and a huge case runs only where the device has
room for it (`room`): otherwise it is skipped, counted under the reason. A huge case's kernels are compiled by
the campaign when it first judges one, not ahead in the compile workers (each would draw the whole case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.inputs import Inputs
from ssdiff.inputs.widen import HEAD_AXIS

HUGE_ELEMENTS = 2 ** 31

# The tensors indexed by group, not head; every tensor with a head (group) axis past the first has the batch
# first, but the per-sequence states
_BY_GROUP = frozenset({"B", "C"})
_NOT_BY_ROW = frozenset({"varlen_states"})


def elements(case: Case) -> dict:
    """The element counts a 32-bit offset would index: x (b, L, h, p) and the chunk states (b, chunks, h, p, n)."""
    heads = case.nheads * case.headdim
    return {"x": case.batch * case.seqlen * heads, "chunk states": case.batch * case.nchunks * heads * case.dstate}


def is_huge(case: Case) -> bool:
    return case.entry == "chunk_scan" and max(elements(case).values()) >= HUGE_ELEMENTS


def judged_slice(case: Case) -> tuple:
    """(the slice's Case, the batch row, the heads) a huge ``case`` is judged on."""
    row = case.batch - 1
    heads = (0, case.nheads - 1) if case.nheads > 1 else (0,)
    part = case.replace(
        batch=1, nheads=len(heads), ngroups=len(heads) if case.ngroups > 1 else 1,
        **case.row_layout(row))
    return part, row, heads


def _groups(case: Case, heads: tuple) -> list:
    per = case.heads_per_group
    return sorted({h // per for h in heads}) if case.ngroups > 1 else [0]


def _take(name: str, t: torch.Tensor, case: Case, row: int, heads: tuple) -> torch.Tensor:
    """``name``'s tensor at the slice: its batch row, and its heads (or their groups) on its head axis."""
    axis = HEAD_AXIS.get(name)
    if axis is None:
        raise ValueError(f"harness/inputs/huge.py does not know how to slice {name!r}: its head axis is not in "
                         f"harness/inputs/widen.py's HEAD_AXIS")
    index = torch.tensor(_groups(case, heads) if name in _BY_GROUP else list(heads), device=t.device)
    if axis > 0 and name not in _NOT_BY_ROW:
        t = t[row:row + 1]
    return t.index_select(axis, index)


def slice_inputs(inputs: Inputs, row: int, heads: tuple) -> Inputs:
    """The whole case's inputs at the slice (copies: the whole case's tensors can go)."""
    case = inputs.case
    if case.backward:
        raise ValueError("a huge case is judged forward only (harness/inputs/huge.py)")
    part, _, _ = judged_slice(case)
    return Inputs(
        case=part, device=inputs.device,
        values={k: _take(k, v, case, row, heads) for k, v in inputs.values.items()},
        dtypes=dict(inputs.dtypes), grad_outputs={},
        seq_idx=None if inputs.seq_idx is None else inputs.seq_idx[row:row + 1].clone(),
        cu_seqlens=inputs.cu_seqlens, wide_order=inputs.wide_order)


def slice_outputs(result: Evaluation, case: Case, row: int, heads: tuple) -> Evaluation:
    """A side's results on the whole case at the slice, with a note of what the slice is."""
    where = f"batch row {row} of {case.batch}, heads {', '.join(map(str, heads))} of {case.nheads}"
    sizes = ", ".join(f"{k} {v:,}" for k, v in elements(case).items())
    outputs = {k: None if v is None else _take(k, v, case, row, heads) for k, v in result.outputs.items()}
    note = (f"a huge case ({sizes} elements): judged on {where} (harness/inputs/huge.py); the coordinates are the "
            f"slice's")
    return Evaluation(outputs, notes=[*result.notes, note])


def bytes_needed(case: Case) -> int:
    """About what drawing and running a huge case holds on the device at its peak: the float64 values (x and z
    twice while drawn), their copies in the case dtype, the outputs and the kernels' float32 chunk states."""
    size = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
    e = elements(case)
    x = e["x"]
    activations = 2 if case.has_z else 1
    bc = 2 * case.batch * case.seqlen * case.ngroups * case.dstate
    return int(8 * x * (activations + 1) + 8 * bc + size * x * (activations + 2) + 4 * e["chunk states"] * 2
               + 4 * case.batch * case.nchunks * case.ngroups * case.chunk_size ** 2)


def room(case: Case, device) -> Optional[str]:
    """Why ``device`` cannot take the huge ``case`` now (too little free memory), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    need = bytes_needed(case)
    if free < need:
        return (f"not enough free device memory for a huge case: about {need / 2 ** 30:.0f} GiB needed, "
                f"{free / 2 ** 30:.0f} GiB free")
    return None


@dataclass(frozen=True)
class Huge:
    """The shapes of huge keys (harness/campaign/pool.py): model widths, and a seqlen that takes x (or the chunk states)
    to between HUGE_ELEMENTS and ``margin`` times that. The chunk states (b, chunks, h, p, n) hold n / Q times x's
    elements: x crosses first where dstate <= chunk, the chunk states where dstate > chunk (x then at half of it),
    and the (dstate, chunk) pairs of each keep the other count at most x's (the device's memory)."""

    headdims: tuple = (64, 128)
    nheads: tuple = (64, 80, 128)
    max_batch: int = 2
    margin: float = 1.1

    @staticmethod
    def widths(crossing: str) -> tuple:
        """The (dstate, chunk) pairs of a key whose ``crossing`` count passes HUGE_ELEMENTS first."""
        return ((128, 256), (128, 128), (256, 256)) if crossing == "x" else ((256, 128),)

    def seqlens(self, batch: int, nheads: int, headdim: int, dstate: int, chunk: int, crossing: str) -> tuple:
        """(least, most) seqlen whose ``crossing`` count ("x" or "chunk states") is at least HUGE_ELEMENTS and at
        most ``margin`` times it."""
        if crossing == "x":
            per_token = batch * nheads * headdim
            least = math.ceil(HUGE_ELEMENTS / per_token)
            return least, max(least, int(self.margin * HUGE_ELEMENTS / per_token))
        per_chunk = batch * nheads * headdim * dstate
        chunks = math.ceil(HUGE_ELEMENTS / per_chunk)
        least = (chunks - 1) * chunk + 1                  # the first token of the chunk that crosses
        return least, max(least, int(self.margin * HUGE_ELEMENTS / per_chunk) * chunk)


__all__ = ["HUGE_ELEMENTS", "Huge", "elements", "is_huge", "judged_slice", "slice_inputs", "slice_outputs",
           "bytes_needed", "room"]
