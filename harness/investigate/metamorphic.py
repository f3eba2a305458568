"""Metamorphic relations of a scan implementation: two ways of computing the same thing with the code under
test, which must agree. The oracle plays no part in the comparison; only its scale does (the agreement is
measured against the joint budget of harness/verdict/judge.py, `disagreement`: twice the budget the same-precision
baseline gives the whole case, so two results each within budget of the truth always pass).

    split_prefill(examiner, impl, case, cut)         one call == two calls, the second from the first's final state
    rows_alone(impl, case, device)                   each batch row run alone == its row of the batch (bitwise)
    packed_alone(examiner, impl, case)               the sequences of a packed row (seq_idx) == each run alone
    prefill_then_steps(examiner, impl, step, case, k)  a prefill of T tokens == a prefill of T-k, then k steps of
                                                     a step implementation (decode entry) from its final state

Each returns a `Relation`. The cases are chunk_scan cases, forward; every call of one relation runs under one
autotune choice (`choice`, a config index: the same config for every call, so that a bitwise relation is
meaningful and tuning cannot pick different kernels for the parts). A derived case is materialized for its own
shapes and dtypes, then given the original case's numbers (sliced), so that each part computes on exactly the
values the whole did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ssdiff import runtime
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.inputs import Inputs, materialize
from ssdiff.model.dtypes import torch_dtype
from ssdiff.verdict.judge import disagreement

TOKEN_MAJOR = ("x", "dt", "B", "C", "z")          # (b, L, ...) inputs; the others are per head or per row


class NotApplicable(ValueError):
    """The case is outside what the relation (or an implementation in it) can take; the reason says why."""


@dataclass
class Relation:
    """``ratios``: tensor -> the difference of the two results over their joint budget (``bitwise``: the number
    of elements that differ). ``ok``: every ratio at most 1 (bitwise: none differs)."""

    name: str
    case: Case
    ratios: dict
    bitwise: bool = False
    details: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.ratios) and all((v == 0) if self.bitwise else (math.isfinite(v) and v <= 1.0)
                                         for v in self.ratios.values())

    def message(self) -> str:
        unit = "elements differ" if self.bitwise else "x the joint budget"
        parts = ", ".join(f"{k} {v:.3g} {unit}" for k, v in sorted(self.ratios.items()))
        return f"{self.name} on {self.case.describe()}: {parts or 'nothing compared'}" + \
            "".join(f"\n  {d}" for d in self.details)


def _applicable(impl, case: Case, device) -> None:
    why = impl.skip_reason(case, str(device))
    if why:
        raise NotApplicable(why)


def derive(inputs: Inputs, case: Case, rows=None, tokens=None, override: Optional[dict] = None) -> Inputs:
    """Inputs of ``case`` (a part of ``inputs.case``) holding ``inputs``' numbers: batch rows ``rows`` and tokens
    ``tokens`` (slices) of the token-major tensors, rows of the initial states, the per-head ones as they are;
    ``override``: name -> float64 tensor to use instead (rounded through the derived case's dtype for it)."""
    out = materialize(case, inputs.device)
    rows = rows if rows is not None else slice(None)
    tokens = tokens if tokens is not None else slice(None)
    for name in out.values:
        if override and name in override:
            value = override[name]
        elif name not in inputs.values:
            raise NotApplicable(f"the part needs an input {name!r} the whole does not have")
        elif name in TOKEN_MAJOR:
            value = inputs.values[name][rows, tokens]
        elif name == "initial_states":
            value = inputs.values[name][rows]
        else:
            value = inputs.values[name]
        if tuple(value.shape) != tuple(out.values[name].shape):
            raise ValueError(f"derive: {name} has shape {tuple(value.shape)}, the part needs "
                             f"{tuple(out.values[name].shape)}")
        out.values[name] = value.to(out.dtypes[name]).to(torch.float64).to(out.device)
    return out


def _run(impl, case: Case, inputs: Inputs, choice) -> Evaluation:
    with runtime.autotune(choice):
        return impl.run(case, inputs)


def _compare(examiner, name: str, case: Case, inputs: Inputs, whole: Evaluation, parts: Evaluation,
             details=()) -> Relation:
    ev = examiner.evidence(case)
    ratios = disagreement(case, inputs, whole, parts, ev.truth, ev.baseline, examiner.factor)
    return Relation(name, case, ratios, details=list(details))


def _forward_scan(case: Case) -> Case:
    if case.entry != "chunk_scan" or case.backward or case.varlen_states:
        raise NotApplicable("the relations take forward chunk_scan cases without varlen states")
    return case


def split_prefill(examiner, impl, case: Case, cut: int, choice=0) -> Relation:
    """One call on ``case`` (no seq_idx, final states returned) against two: tokens [0, cut), then [cut, L)
    from the first call's final state as initial states."""
    case = _forward_scan(case)
    if case.segments is not None or not case.return_final_states or not 0 < cut < case.seqlen:
        raise NotApplicable("split_prefill takes a case without seq_idx that returns final states, and "
                            "0 < cut < seqlen")
    device = examiner.device
    first = case.replace(seqlen=cut)
    second = case.replace(seqlen=case.seqlen - cut, initial_states=True)
    for c in (case, first, second):
        _applicable(impl, c, device)
    inputs = examiner.evidence(case).inputs
    whole = _run(impl, case, inputs, choice)
    a = _run(impl, first, derive(inputs, first, tokens=slice(0, cut)), choice)
    carried = a.outputs["final_states"].detach().to(torch.float64)
    b = _run(impl, second, derive(inputs, second, tokens=slice(cut, None), override={"initial_states": carried}),
             choice)
    parts = Evaluation({"y": torch.cat([a.y, b.y], dim=1), "final_states": b.outputs["final_states"]})
    return _compare(examiner, "split_prefill", case, inputs, whole, parts, [f"cut at token {cut}"])


def _row_case(case: Case, row: int) -> Case:
    return case.replace(batch=1, **case.row_layout(row)) if case.segments is not None else case.replace(batch=1)


def rows_alone(impl, case: Case, device, choice=0) -> Relation:
    """Each batch row of ``case`` run as a batch of one against its row of the whole batch: the same config
    computes each row in programs of its own, so the results must be the same bit for bit."""
    case = _forward_scan(case)
    if case.batch < 2:
        raise NotApplicable("rows_alone takes a batch of at least two rows")
    _applicable(impl, case, device)
    inputs = materialize(case, device)
    whole = _run(impl, case, inputs, choice)
    differ: dict = {}
    details = []
    for row in range(case.batch):
        one = _row_case(case, row)
        _applicable(impl, one, device)
        alone = _run(impl, one, derive(inputs, one, rows=slice(row, row + 1)), choice)
        for name, value in alone.outputs.items():
            mine = whole.outputs[name][row:row + 1]
            count = int((value.detach() != mine.detach()).sum()) if value.shape == mine.shape else value.numel()
            differ[name] = differ.get(name, 0) + count
            if count:
                details.append(f"row {row}: {count} of {value.numel()} elements of {name} differ "
                               f"(largest {float((value.double() - mine.double()).abs().max()):.3g})")
    return Relation("rows_alone", case, differ, bitwise=True, details=details)


def packed_alone(examiner, impl, case: Case, choice=0) -> Relation:
    """A batch of one row packing several sequences (seq_idx, no padding) against each sequence run alone
    (from zero; the first from the row's initial states when its seq_idx is 0, which is where initial states
    enter): y, and the final state (the last sequence's)."""
    case = _forward_scan(case)
    if case.batch != 1 or case.segments is None or len(case.segments[0]) < 2 or case.padded \
            or 0 in case.segments[0]:
        raise NotApplicable("packed_alone takes one row packing two or more non-empty sequences, without padding")
    device = examiner.device
    _applicable(impl, case, device)
    inputs = examiner.evidence(case).inputs
    whole = _run(impl, case, inputs, choice)
    ys, final, start = [], None, 0
    for i, length in enumerate(case.segments[0]):
        one = case.replace(seqlen=length, segments=None, padding=None, seq_idx_start=0,
                           initial_states=case.initial_states and i == 0 and case.seq_idx_start == 0)
        _applicable(impl, one, device)
        alone = _run(impl, one, derive(inputs, one, tokens=slice(start, start + length)), choice)
        ys.append(alone.y)
        final = alone.outputs.get("final_states")
        start += length
    parts = {"y": torch.cat(ys, dim=1)}
    if final is not None and case.return_final_states:
        parts["final_states"] = final
    return _compare(examiner, "packed_alone", case, inputs, whole, Evaluation(parts),
                    [f"sequences {list(case.segments[0])}"])


def decode_case(case: Case, steps: int, state_dtype: str = "float32") -> Case:
    """The decode-entry twin of a chunk_scan case: the same sizes, features and seed, its last ``steps`` tokens
    single steps."""
    return Case(entry="decode", batch=case.batch, seqlen=case.seqlen, nheads=case.nheads, headdim=case.headdim,
                ngroups=case.ngroups, dstate=case.dstate, chunk_size=case.chunk_size, dtype=case.dtype, D=case.D,
                has_z=case.has_z, has_dt_bias=case.has_dt_bias, dt_softplus=case.dt_softplus,
                dt_limit=case.dt_limit, initial_states=case.initial_states, decode_steps=steps,
                state_dtype=state_dtype, regime=case.regime, seed=case.seed)


def prefill_then_steps(examiner, impl, step, case: Case, steps: int, choice=0) -> Relation:
    """One prefill of ``case`` (no seq_idx, final states returned) against a prefill of its first L - steps
    tokens with ``impl`` and ``steps`` single steps with ``step`` from that prefill's final state (a float32
    state): y at every token, and the final state."""
    case = _forward_scan(case)
    if case.segments is not None or not case.return_final_states or not 0 < steps <= case.seqlen:
        raise NotApplicable("prefill_then_steps takes a case without seq_idx that returns final states, and "
                            "0 < steps <= seqlen")
    device = examiner.device
    cut = case.seqlen - steps
    prefill = case.replace(seqlen=cut) if cut else None
    decode = decode_case(case, steps)
    _applicable(impl, case, device)
    if prefill is not None:
        _applicable(impl, prefill, device)
    _applicable(step, decode, device)
    inputs = examiner.evidence(case).inputs
    whole = _run(impl, case, inputs, choice)
    b, h, p, n = case.batch, case.nheads, case.headdim, case.dstate
    if prefill is not None:
        a = _run(impl, prefill, derive(inputs, prefill, tokens=slice(0, cut)), choice)
        ys, state = [a.y], a.outputs["final_states"].detach().to(torch.float64)
    else:
        ys = []
        state = inputs.values.get("initial_states", torch.zeros(b, h, p, n, dtype=torch.float64,
                                                               device=inputs.device))
    state = state.to(torch_dtype(decode.replace(dtype=decode.state_dtype))).to(torch.float64)
    stepped = _run(step, decode, derive(inputs, decode, override={"state": state}), choice)
    parts = Evaluation({"y": torch.cat(ys + [stepped.y.to(whole.y.dtype)], dim=1),
                        "final_states": stepped.outputs["final_states"]})
    return _compare(examiner, "prefill_then_steps", case, inputs, whole, parts,
                    [f"{cut} tokens prefilled, {steps} stepped with {step.name}"])


def layer_decoded(examiner, impl, case: Case, steps: int, choice=0) -> Relation:
    """A layer over the whole sequence (``case``, forward, no seq_idx, not decoded) against the same layer
    prefilling the first L - ``steps`` tokens and decoding the others one at a time through its cache
    (``layer_steps``), on the same numbers (a layer_steps twin draws them alike): y at every token, within the
    decoded twin's budget (its baseline holds the step model)."""
    if case.entry != "layer" or case.backward or case.segments is not None or case.layer_steps:
        raise NotApplicable("layer_decoded takes a forward layer case without seq_idx that is not decoded")
    if not 0 < steps < case.seqlen:
        raise NotApplicable("layer_decoded needs 0 < steps < seqlen (a prefill of at least one token)")
    decoded = case.replace(layer_steps=steps)
    device = examiner.device
    _applicable(impl, case, device)
    _applicable(impl, decoded, device)
    inputs = examiner.evidence(decoded).inputs
    whole = _run(impl, case, inputs, choice)
    stepped = _run(impl, decoded, inputs, choice)
    return _compare(examiner, "layer_decoded", decoded, inputs, Evaluation({"y": whole.y}),
                    Evaluation({"y": stepped.y}), [f"{case.seqlen - steps} tokens prefilled, {steps} decoded"])


__all__ = ["Relation", "NotApplicable", "derive", "split_prefill", "rows_alone", "packed_alone",
           "prefill_then_steps", "layer_decoded", "decode_case", "TOKEN_MAJOR"]
