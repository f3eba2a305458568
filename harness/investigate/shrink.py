"""Delta debugging over the Case: smaller and plainer candidates of a case, and the greedy loop that keeps a
step only while a predicate ("the same divergence persists") holds.

This module knows nothing about verdicts: harness/investigate/minimize.py supplies the predicate. Every candidate is a
valid Case (the Case constructor checks h % g, segment sums, ...; invalid candidates are never tried).
Candidates come biggest-reduction first, so the loop spends its runs where they pay most.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from ssdiff.model.case import Case, CaseError
from ssdiff.model.features import feature, present, switch_off

@dataclass
class Step:
    """One tried candidate: what it changed, the candidate, and whether the divergence persisted."""

    change: str
    case: Case
    kept: bool


@dataclass
class Shrunk:
    """original, the smallest ``minimal`` reached, every step tried, the predicate runs, and why it stopped: at a
    local minimum (no candidate keeps the divergence), or with its run or time bound spent (`partial`)."""

    original: Case
    minimal: Case
    steps: list = field(default_factory=list)
    runs: int = 0
    stopped: str = "a local minimum"

    @property
    def partial(self) -> bool:
        """Whether it stopped before a local minimum: ``minimal`` is the smallest reached, not a minimum."""
        return self.stopped != "a local minimum"

    @property
    def kept(self) -> list:
        return [s for s in self.steps if s.kept]

    def irrelevant_features(self) -> list:
        """Features of the original that the minimal case no longer has: the divergence did not need them."""
        return sorted(present(self.original) - present(self.minimal))


def _try(case: Case, change: str, **fields) -> Optional[tuple]:
    try:
        candidate = case.replace(**fields)
    except (CaseError, TypeError, ValueError):
        return None
    if candidate == case:
        return None
    return change, candidate


def _smaller(value: int, floor: int = 1) -> list:
    """floor, then halves: the big jumps first."""
    out = []
    for v in (floor, value // 2, value - 1):
        if floor <= v < value and v not in out:
            out.append(v)
    return out


def _switched_off(case: Case, key: str) -> Optional[tuple]:
    smaller = switch_off(case, key)
    return None if smaller is None else (feature(key).off, smaller)


def _fit_segments(case: Case, seqlen: int) -> dict:
    """Segments cut to a new seqlen (the same boundaries where they still fit, padding kept if it fits)."""
    if case.segments is None:
        return {}
    if case.gaps is not None:
        case = switch_off(case, "gaps")              # the gaps' tokens join their sequences first
    segments, padding = [], []
    for row, lengths in enumerate(case.segments):
        pad = min((case.padding or (0,) * case.batch)[row], seqlen - 1)
        room, kept = seqlen - pad, []
        for n in lengths:
            if room <= 0:
                break
            kept.append(min(n, room))
            room -= kept[-1]
        if room > 0:
            kept[-1] += room
        segments.append(tuple(kept))
        padding.append(pad)
    out = dict(segments=tuple(segments), gaps=None)
    out["padding"] = tuple(padding) if any(padding) else None
    return out


# The features the minimizer switches off, in the order it tries them.
FEATURE_STEPS = ("seq_idx", "empty_sequence", "gaps", "padding", "seq_idx_start", "initial_states", "z", "dt_limit",
                 "rmsnorm", "d_nonssm", "out_proj", "outproj_bias", "varlen_states", "final_state_grad", "dt_bias",
                 "dt_softplus", "backward", "final_states", "D", "D_channel", "state_batch_indices", "state_dtype",
                 "bias", "conv_bias", "layer_steps")


def candidates(case: Case) -> Iterator[tuple]:
    """(change, smaller Case) pairs, biggest reductions first; each is valid."""
    tries = []
    # sizes
    tries.append(_switched_off(case, "batch"))
    if case.entry == "decode":
        # fewer decode steps, and a shorter prefill (seqlen and decode_steps move together)
        for s in _smaller(case.decode_steps):
            tries.append(_try(case, f"decode_steps {case.decode_steps} -> {s}", decode_steps=s))
        for L in _smaller(case.seqlen, floor=case.decode_steps):
            tries.append(_try(case, f"prefill {case.prefill_len} -> {L - case.decode_steps} tokens", seqlen=L))
    for L in _smaller(case.seqlen):
        tries.append(_try(case, f"seqlen {case.seqlen} -> {L}", seqlen=L, **_fit_segments(case, L)))
        if case.segments is not None:
            tries.append(_try(switch_off(case, "seq_idx"), f"seqlen {case.seqlen} -> {L}, no seq_idx", seqlen=L))
    for h in _smaller(case.nheads):
        for g in sorted({case.ngroups, 1, h} | {d for d in range(1, h + 1) if h % d == 0 and d <= case.ngroups}):
            if h % g == 0:
                tries.append(_try(case, f"nheads {case.nheads} -> {h} (ngroups {g})", nheads=h, ngroups=g))
    for g in _smaller(case.ngroups):
        tries.append(_try(case, f"ngroups {case.ngroups} -> {g}", ngroups=g))
    for p in _smaller(case.headdim):
        tries.append(_try(case, f"headdim {case.headdim} -> {p}", headdim=p))
    for n in _smaller(case.dstate):
        tries.append(_try(case, f"dstate {case.dstate} -> {n}", dstate=n))
    q = case.chunk_size // 2
    while q >= 1 and q >= case.chunk_size // 8:
        tries.append(_try(case, f"chunk_size {case.chunk_size} -> {q}", chunk_size=q))
        q //= 2
    if case.entry == "layer":
        # d_model among the divisors of d_inner; then sizes that move d_inner keep d_model (1 divides all)
        for m in _smaller(case.d_model):
            if case.d_inner % m == 0:
                tries.append(_try(case, f"d_model {case.d_model} -> {m}", d_model=m))
        for w in _smaller(case.conv_width):
            tries.append(_try(case, f"conv width {case.conv_width} -> {w}", conv_width=w))
        if case.d_nonssm > 0:
            tries.append(_try(case, f"d_nonssm {case.d_nonssm} -> 0", d_nonssm=0))
        for s in _smaller(case.layer_steps):
            tries.append(_try(case, f"layer_steps {case.layer_steps} -> {s}", layer_steps=s))
        if case.layer_steps:                # a shorter prefill, the decoded tokens kept
            for L in _smaller(case.seqlen, floor=case.layer_steps + 1):
                tries.append(_try(case, f"prefill {case.seqlen - case.layer_steps} -> {L - case.layer_steps} tokens",
                                  seqlen=L))
    if case.entry == "split_conv1d":
        for w in _smaller(case.conv_width):
            tries.append(_try(case, f"conv width {case.conv_width} -> {w}", conv_width=w))
        if case.out_dim is not None and case.out_dim > 1:
            tries.append(_try(case, f"out_dim {case.out_dim} -> 1", out_dim=1))
        if case.d_nonssm > 1:
            tries.append(_try(case, f"d_nonssm {case.d_nonssm} -> 1", d_nonssm=1))
    # features switched off (harness/model/features.py), then plainer settings
    tries.extend(_switched_off(case, key) for key in FEATURE_STEPS)
    if case.D == "channel":
        tries.append(_try(case, "D per head", D="head"))
    if case.entry in ("split_conv1d", "layer"):
        if case.entry == "split_conv1d":
            tries.append(_try(case, "activation identity", activation="identity"))
        tries.append(_try(case, "norm before gate", norm_before_gate=True))
    if case.dtype != "float32":
        tries.append(_try(case, f"{case.dtype} -> float32", dtype="float32"))
    # regime: plainer values
    r = case.regime
    tries.append(_switched_off(case, "strided"))
    tries.append(_switched_off(case, "dt_large"))
    for field_name, plain, change in (("decay", "typical", "typical decay"), ("values", "integer", "integer values")):
        if getattr(r, field_name) != plain:
            tries.append(_try(case, change, regime=dataclasses.replace(r, **{field_name: plain})))
    tries.append(_switched_off(case, "scale"))
    if case.seed != 0:
        tries.append(_try(case, "seed -> 0", seed=0))
    seen = set()
    for item in tries:
        if item is not None and item[1] not in seen:
            seen.add(item[1])
            yield item


def shrink(case: Case, persists: Callable[[Case], bool], on_step: Optional[Callable[[Step], None]] = None,
           max_runs: int = 400, deadline: Optional[float] = None) -> Shrunk:
    """Greedy delta debugging: take the first candidate that keeps ``persists`` true, start over from it; stop
    when no candidate does (a local minimum), after ``max_runs`` predicate runs, or once time.perf_counter()
    passes ``deadline`` (the run under way finishes): then the smallest case reached is the result, partial."""
    result = Shrunk(original=case, minimal=case)
    tried = set()
    progress = True
    while progress:
        progress = False
        for change, candidate in candidates(result.minimal):
            if candidate in tried:
                continue
            if result.runs >= max_runs:
                result.stopped = f"its run bound ({max_runs} runs) spent"
                return result
            if deadline is not None and time.perf_counter() >= deadline:
                result.stopped = "its time bound spent"
                return result
            tried.add(candidate)
            result.runs += 1
            kept = bool(persists(candidate))
            step = Step(change, candidate, kept)
            result.steps.append(step)
            if on_step:
                on_step(step)
            if kept:
                result.minimal = candidate
                progress = True
                break
    return result
