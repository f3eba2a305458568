"""The verdict: is an implementation's result within the error its dtype naturally makes?

`judge` compares every output, gradient and stage intermediate with the float64 oracle and reports each as a
ratio to a per-element budget (below 1: within it), derived from a same-precision baseline
(harness/budget/) in budget cells (`cells`), with NaN/Inf, mismatches and failed runs kept apart as
statuses of their own; `disagreement` compares two implementations the same way. The rule, its constants
(FACTOR, MIN_CELL) and their calibration: harness/README.md, "The verdict".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ssdiff.model.axes import TensorAxes, axes_of, coordinates_of
from ssdiff.model.case import Case
from ssdiff.inputs import Inputs
from ssdiff.model.dtypes import TORCH_DTYPES, UNIT_ROUNDOFF, overflow_edge, torch_dtype

FACTOR = 4.0
MIN_CELL = 16

# Called as listener(case, verdict) after every `judge`: how `pytest --ssdiff-report` sees the verdicts that
# properties reach (harness/plugin.py). Empty unless a listener is registered.
JUDGE_LISTENERS: list = []

# Verdict statuses, least to most severe. "ok" is the only passing one.
STATUSES = ("ok", "diverged", "nonfinite", "mismatch", "error", "crash", "hang")
RUN_FAILURES = ("error", "crash", "hang")
# Run failures whose process died or was killed: each re-run costs a fresh child process or a whole timeout.
PROCESS_FAILURES = ("crash", "hang")

# Axes a budget cell / error map keeps (everything else is reduced inside a cell).
LOCAL_AXES = ("batch", "seq", "chunk", "token", "head", "group", "channel")


def severity(status: str) -> int:
    return STATUSES.index(status)


def expected_dtype(kind: str, name: str, case: Case, inputs: Inputs) -> Optional[torch.dtype]:
    """The dtype an implementation must return ``name`` in (None: not checked, e.g. stages)."""
    if kind == "output":
        if name == "final_states" and case.entry == "decode":
            return TORCH_DTYPES[case.state_dtype]      # a step kernel updates its state in place, in its dtype
        return torch_dtype(case) if name == "y" or (case.entry == "mamba3" and name == "final_v") else torch.float32
    if kind == "grad":
        return inputs.dtypes.get(name)
    return None


def storage_dtype(kind: str, name: str, case: Case, inputs: Inputs) -> torch.dtype:
    """The dtype whose rounding floor applies (stages: the case dtype, as kernels may store them in it)."""
    return expected_dtype(kind, name, case, inputs) or torch_dtype(case)


# ---- which elements are judged ---------------------------------------------------------------------------

def judged_mask(kind: str, name: str, case: Case, inputs: Inputs, axes: TensorAxes, shape) -> Optional[torch.Tensor]:
    """Boolean mask of judged elements, or None for all. Excludes padding tokens of outputs and stages and the
    C.B^T entries no token uses."""
    device = inputs.device
    if kind == "grad":
        return None
    seq = inputs.seq_idx
    if "token" in axes.names and seq is not None and case.padded:    # padding: seq_idx -1
        real = (seq >= 0)                                             # (b, L)
        view = [1] * len(shape)
        view[axes.names.index("batch")] = shape[axes.names.index("batch")]
        view[axes.names.index("token")] = shape[axes.names.index("token")]
        return real.reshape(view).expand(shape).to(device)
    if kind == "stage" and name == "CB":
        b, c, g, Q, _ = shape
        L = case.seqlen
        pos = torch.arange(c * Q, device=device)
        if seq is not None:
            seqs = torch.cat([seq.long().to(device), seq.new_full((b, c * Q - L), -1).long().to(device)], dim=1)
        else:
            seqs = torch.where(pos < L, 0, -1).expand(b, c * Q)
        seqs = seqs.reshape(b, c, Q)
        same = (seqs[:, :, :, None] == seqs[:, :, None, :]) & (seqs[:, :, :, None] >= 0)
        causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=device))
        return (same & causal)[:, :, None].expand(shape)
    return None


# ---- cells ---------------------------------------------------------------------------------------------

def _axis_cell_index(axis: str, size: int, case: Case, axes: TensorAxes, device) -> Optional[tuple]:
    """Per-position cell coordinate along one axis and how many there are (None: reduced inside a cell)."""
    ar = torch.arange(size, device=device)
    if axis == "token":
        return ar // case.chunk_size, -(-size // case.chunk_size)
    if axis in ("batch", "seq", "chunk", "head", "group"):
        return ar, size
    if axis == "channel":
        keys = {}
        coords = [keys.setdefault(ch, len(keys)) for ch in axes.channels]
        return torch.tensor(coords, device=device), len(keys)
    return None


# Which local axes are given up first when cells are too small.
_COARSEN = (("token", "chunk"), ("head", "group", "channel"), ("batch", "seq"))


def cells(shape, axes: TensorAxes, case: Case, device, min_cell: int = MIN_CELL) -> tuple:
    """(an int64 tensor of ``shape``: the budget cell of each element, how many cells). The ids are dense
    without a pass over them: each axis's coordinates take every value below its span, so their mixed-radix
    number takes every value below the product (and nothing is read back from the device)."""
    numel = math.prod(shape) if shape else 1
    dropped: set = set()
    for level in range(len(_COARSEN) + 1):
        ids = torch.zeros(shape, dtype=torch.int64, device=device)
        ncells = 1
        for dim, (axis, size) in enumerate(zip(axes.names, shape)):
            if axis in dropped or not size:
                continue
            found = _axis_cell_index(axis, size, case, axes, device)
            if found is None:
                continue
            coord, span = found
            view = [1] * len(shape)
            view[dim] = size
            ids = ids * span + coord.reshape(view)
            ncells *= span
        if numel / max(ncells, 1) >= min_cell or level == len(_COARSEN):
            break
        dropped.update(_COARSEN[level])
    return ids, ncells


def _scatter(values: torch.Tensor, ids: torch.Tensor, ncells: int, reduce: str) -> torch.Tensor:
    out = torch.zeros(ncells, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, ids.reshape(-1), values.reshape(-1), reduce=reduce, include_self=False)


# ---- one tensor ------------------------------------------------------------------------------------------

@dataclass
class TensorVerdict:
    """The verdict on one tensor. ``name`` is "y", "final_states", "grad.x", "stage.CB", ...

    ratio: max error / budget over judged elements (inf for nonfinite / mismatch); out_of_budget / judged /
    excluded: element counts; max_abs, rel_rms: the error; baseline_rel_rms: the baseline's; worst: the worst
    element (index, coordinates, actual, expected, budget); elements: when asked for (`judge`'s ``top``), the
    elements of the largest ratios, largest first, each as ``worst``; ratio_map: per-element ratio reduced to the
    local axes (kept for localization, not serialized)."""

    name: str
    kind: str
    status: str
    ratio: float = 0.0
    judged: int = 0
    out_of_budget: int = 0
    excluded: int = 0
    out_of_range: int = 0
    max_abs: float = 0.0
    rel_rms: float = 0.0
    baseline_rel_rms: float = 0.0
    worst: Optional[dict] = None
    elements: list = field(default_factory=list)
    detail: str = ""
    axes: Optional[TensorAxes] = None
    ratio_map: Optional[torch.Tensor] = field(default=None, repr=False)
    map_axes: tuple = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("name", "kind", "status", "judged", "out_of_budget", "excluded",
                                             "out_of_range", "max_abs", "rel_rms", "baseline_rel_rms", "worst",
                                             "detail")}
        out["ratio"] = _json_float(self.ratio)
        for k in ("max_abs", "rel_rms", "baseline_rel_rms"):
            out[k] = _json_float(out[k])
        if self.elements:
            out["elements"] = self.elements
        return out

    def message(self, impl: str) -> str:
        label = _label(self.name)
        if self.status == "mismatch":
            return f"{impl}: {label}: {self.detail}"
        if self.status == "nonfinite":
            return f"{impl}: {label}: {self.detail}"
        w = self.worst or {}
        pct = 100.0 * self.out_of_budget / max(self.judged, 1)
        head = (f"{impl}: {label} {'diverges from' if self.status == 'diverged' else 'is within budget of'} the "
                f"float64 oracle: {self.out_of_budget:,} / {self.judged:,} elements ({pct:.1f}%) out of budget")
        if not w:
            return head
        where = ", ".join(f"{k} {v}" for k, v in w.get("coords", {}).items())
        return (f"{head}.\n  Greatest error {w['error']:.3g} at index {tuple(w['index'])} ({where}): actual "
                f"{w['actual']:.6g}, expected {w['expected']:.6g}; budget there {w['budget']:.3g} "
                f"(ratio {self.ratio:.3g}x).\n  Relative RMS error {self.rel_rms:.3g} (same-precision baseline "
                f"{self.baseline_rel_rms:.3g}); max abs error {self.max_abs:.3g}."
                + (f"\n  {self.excluded:,} elements not judged (padding tokens / unused entries)." if self.excluded else "")
                + (f"\n  {self.out_of_range:,} elements beyond the dtype's range (excluded)." if self.out_of_range else "")
                + (f"\n  Its {len(self.elements)} largest ratios to budget:" if self.elements else "")
                + "".join(f"\n    {tuple(e['index'])} ({', '.join(f'{k} {v}' for k, v in e['coords'].items())}): "
                          f"actual {e['actual']:.6g}, expected {e['expected']:.6g}, error {e['error']:.3g}, budget "
                          f"{e['budget']:.3g} ({e['ratio']:.3g}x)" for e in self.elements))


def _label(name: str) -> str:
    if name.startswith("grad."):
        return f"gradient of {name[5:]}"
    if name.startswith("stage."):
        return f"stage {name[6:]}"
    return f"output {name}"


def _json_float(x):
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def judge_tensor(name: str, kind: str, actual, truth: torch.Tensor, base: torch.Tensor, case: Case,
                 inputs: Inputs, factor: float = FACTOR, reference: Optional[torch.Tensor] = None,
                 top: int = 0, allowance: Optional[torch.Tensor] = None) -> TensorVerdict:
    """Judge one tensor. ``actual`` may be None (missing), any dtype/device; truth and base are float64.
    ``reference``: measure the error against it instead of ``truth`` (the budget still comes from truth and
    base) — used to compare two implementations. ``top``: also list the elements of the ``top`` largest ratios
    (`TensorVerdict.elements`). ``allowance``: an error per element that a known defect accounts for
    (harness/registry/known.py, `explains`), added to the budget ``factor`` times."""
    short = name.split(".", 1)[-1]
    axes = axes_of(kind, short, case)
    if actual is None:
        return TensorVerdict(name, kind, "mismatch", math.inf, detail="missing: the implementation did not return it",
                             axes=axes)
    if not isinstance(actual, torch.Tensor):
        return TensorVerdict(name, kind, "mismatch", math.inf, axes=axes,
                             detail=f"expected a tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(truth.shape):
        return TensorVerdict(name, kind, "mismatch", math.inf, axes=axes,
                             detail=f"shape {tuple(actual.shape)}, expected {tuple(truth.shape)}")
    want = expected_dtype(kind, short, case, inputs)
    if want is not None and actual.dtype != want and actual.dtype != torch.float64:
        return TensorVerdict(name, kind, "mismatch", math.inf, axes=axes,
                             detail=f"dtype {str(actual.dtype).replace('torch.', '')}, expected "
                                    f"{str(want).replace('torch.', '')}")
    device = truth.device
    a = actual.detach().to(device=device, dtype=torch.float64)
    t = truth.detach().to(torch.float64)
    # the baseline samples as one tensor (sample, *shape): each step below is then one operation for all of them
    b = torch.stack([x.detach() for x in (base if isinstance(base, (list, tuple)) else [base])]).to(
        device=device, dtype=torch.float64)
    ref = t if reference is None else reference.detach().to(device=device, dtype=torch.float64)
    mask = judged_mask(kind, short, case, inputs, axes, t.shape)
    judged = torch.ones_like(t, dtype=torch.bool) if mask is None else mask.to(device)
    # Out of the dtype's range: the oracle beyond the storage dtype's largest value, or a baseline overflow.
    stored = storage_dtype(kind, short, case, inputs)
    in_range = (torch.isfinite(ref) & (t.abs() <= torch.finfo(stored).max) & torch.isfinite(b).all(0))
    bad = judged & in_range & ~torch.isfinite(a)
    # the counts in one transfer: on a GPU every scalar read waits for the device
    counts = lambda: (int(v) for v in torch.stack([
        (judged & ~in_range).sum(), (~judged).sum(), (judged & in_range).sum(), bad.sum()]).tolist())
    out_of_range, excluded, n_judged, count = counts()
    if count:
        # An Inf of the oracle's sign where a value within the budget would round to Inf (its magnitude plus the
        # budget reaching the dtype's overflow) is out of the dtype's range too, not a divergence.
        budget = element_budget(t, b, judged & in_range, axes, case, UNIT_ROUNDOFF[stored], factor)[0]
        reach = bad & (ref.abs() + budget >= overflow_edge(stored)) & (a == math.inf * ref.sign())
        in_range, bad = in_range & ~reach, bad & ~reach
        out_of_range, excluded, n_judged, count = counts()
    judged = judged & in_range

    if count:
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        kinds = []
        if bool(torch.isnan(a[bad]).any()):
            kinds.append("NaN")
        if bool(torch.isinf(a[bad]).any()):
            kinds.append("Inf")
        where = ", ".join(f"{k} {v}" for k, v in coordinates_of(first, axes, case).items())
        inf_map, map_axes = _reduce_map(torch.where(bad, math.inf, 0.0).to(torch.float64), axes)
        return TensorVerdict(name, kind, "nonfinite", math.inf, judged=n_judged, out_of_budget=count,
                             ratio_map=inf_map, map_axes=map_axes,
                             excluded=excluded, out_of_range=out_of_range, axes=axes,
                             detail=(f"{count:,} / {n_judged:,} elements are {' and '.join(kinds)} where the oracle "
                                     f"is finite; the first at index {first} ({where}), expected {float(ref[first]):.6g}"),
                             worst={"index": list(first), "coords": coordinates_of(first, axes, case),
                                    "actual": _json_float(a[first]), "expected": float(ref[first])})

    zero = torch.zeros((), dtype=torch.float64, device=device)
    err = torch.where(judged, (a - ref).abs(), zero)
    budget, noise, ids, berr, tabs = element_budget(t, b, judged, axes, case,
                                                    UNIT_ROUNDOFF[storage_dtype(kind, short, case, inputs)], factor)
    if allowance is not None:
        budget = budget + factor * allowance.to(device=device, dtype=torch.float64)
    ratio = torch.where(judged & (err > 0), err / budget.clamp(min=torch.finfo(torch.float64).tiny), zero)

    tv = TensorVerdict(name, kind, "ok", judged=n_judged, excluded=excluded, out_of_range=out_of_range, axes=axes)
    if n_judged == 0:
        return tv
    flat = ratio.reshape(-1).argmax()
    # the figures and the worst element in one transfer (each scalar read is a device sync on a GPU)
    at_worst = torch.stack([ratio, a, ref, err, budget, berr, noise[ids]]).reshape(7, -1)[:, flat]
    norms = torch.linalg.vector_norm(torch.stack([tabs, err, berr]).reshape(3, -1), dim=1)
    figures = torch.cat([at_worst, norms, torch.stack([(ratio > 1.0).sum().to(torch.float64), err.max(),
                                                       flat.to(torch.float64)])]).tolist()
    (tv.ratio, actual, expected, error, bound, base_error, cell_noise, norm_t, err_norm, berr_norm, out_of_budget,
     tv.max_abs, flat) = figures
    tv.out_of_budget = int(out_of_budget)
    scale = norm_t if norm_t > 0 else 1.0
    tv.rel_rms = err_norm / scale
    tv.baseline_rel_rms = berr_norm / scale
    # numpy's unravel_index: torch's imports torch.fx and sympy on first use (about 4 s of a GPU campaign)
    index = tuple(int(i) for i in np.unravel_index(int(flat), tuple(t.shape)))
    tv.worst = {"index": list(index), "coords": coordinates_of(index, axes, case), "actual": actual,
                "expected": expected, "error": error, "budget": bound, "baseline_error": base_error,
                "cell_noise": cell_noise}
    tv.status = "diverged" if tv.ratio > 1.0 else "ok"
    tv.ratio_map, tv.map_axes = _reduce_map(ratio, axes)
    if top:
        tv.elements = _largest(ratio, a, ref, err, budget, top, axes, case)
    return tv


def _largest(ratio, a, ref, err, budget, top: int, axes, case: Case) -> list:
    """The elements of the ``top`` largest ratios (none of ratio 0: unjudged or exact), largest first."""
    ratios, flats = ratio.reshape(-1).topk(min(top, ratio.numel()))
    rows = torch.stack([ratios, *(t.reshape(-1)[flats] for t in (a, ref, err, budget))]).T.tolist()
    found = []
    for flat, (r, actual, expected, error, bound) in zip(flats.tolist(), rows):
        if r <= 0:
            break
        index = tuple(int(i) for i in np.unravel_index(flat, tuple(ratio.shape)))
        found.append({"index": list(index), "coords": coordinates_of(index, axes, case), "actual": actual,
                      "expected": expected, "error": error, "budget": bound, "ratio": r})
    return found


def element_budget(t, b, judged, axes: TensorAxes, case: Case, u: float, factor: float = FACTOR):
    """The budget of every element (harness/README.md, "The verdict") for oracle ``t`` and baseline samples ``b``
    (a list of tensors, or one with the samples along its first axis). Returns (budget, cell noise, cell ids,
    baseline error, |t|), masked by ``judged``."""
    zero = torch.zeros((), dtype=torch.float64, device=t.device)
    samples = b if isinstance(b, torch.Tensor) else torch.stack(list(b))
    berr = torch.where(judged, (samples - t).abs().amax(0), zero)
    tabs = torch.where(judged, t.abs(), zero)
    ids, ncells = cells(tuple(t.shape), axes, case, t.device)
    noise = _scatter(berr, ids, ncells, "amax")
    counts = _scatter(judged.to(torch.float64), ids, ncells, "sum")
    mean_abs = _scatter(tabs, ids, ncells, "sum") / counts.clamp(min=1)
    budget = factor * (noise[ids] + u * (tabs + mean_abs[ids]))
    return budget, noise, ids, berr, tabs


def budget_rule(factor: float = FACTOR) -> str:
    """`element_budget` in one line, as saved runs and reports state it (harness/README.md has the long form)."""
    return (f"per element: {factor:g} x (the largest error of the same-precision baseline samples in its cell "
            f"(batch row, chunk, head) + unit roundoff x (|expected| + the cell's mean |expected|))")


def _reduce_map(ratio: torch.Tensor, axes: TensorAxes):
    """Max ratio over the non-local axes: a small map over (batch, token/chunk, head/group/channel, seq)."""
    keep = [i for i, a in enumerate(axes.names) if a in LOCAL_AXES]
    drop = [i for i in range(ratio.dim()) if i not in keep]
    m = ratio.amax(dim=drop) if drop else ratio
    return m.to("cpu", torch.float32), tuple(axes.names[i] for i in keep)


# ---- a whole run -----------------------------------------------------------------------------------------

@dataclass
class Verdict:
    """The verdict on one implementation's run of one case against the oracle.

    status: the most severe of its tensors' statuses, or error / crash / hang for the run itself (then
    ``detail`` says what happened). ratio: the largest finite ratio over judged tensors."""

    impl: str
    status: str
    ratio: float = 0.0
    tensors: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def failing(self) -> list:
        return [t for t in self.tensors if not t.ok]

    def tensor(self, name: str) -> Optional[TensorVerdict]:
        return next((t for t in self.tensors if t.name == name), None)

    def worst(self) -> Optional[TensorVerdict]:
        """The tensor to show first: the most severe status, then the largest ratio (outputs before grads)."""
        if not self.tensors:
            return None
        return max(self.tensors, key=lambda t: (severity(t.status), t.ratio if math.isfinite(t.ratio) else 1e308,
                                                t.kind == "output"))

    def message(self) -> str:
        if self.status in RUN_FAILURES:
            what = {"error": "raised an exception", "crash": "crashed", "hang": "hung"}[self.status]
            return f"{self.impl} {what}: {self.detail}"
        bad = self.failing
        if not bad:
            w = self.worst()
            tail = f" (largest ratio {self.ratio:.3g}x, {w.name})" if w else ""
            return f"{self.impl}: every output and gradient within budget{tail}"
        lines = [t.message(self.impl) for t in sorted(bad, key=lambda t: (-severity(t.status), -_finite(t.ratio)))]
        others = len(bad) - 3
        text = "\n".join(lines[:3])
        if others > 0:
            text += f"\n  ... and {others} more tensors out of budget: " + ", ".join(t.name for t in bad[3:])
        return text

    def to_dict(self) -> dict:
        return {"impl": self.impl, "status": self.status, "ratio": _json_float(self.ratio), "detail": self.detail,
                "seconds": round(self.seconds, 3), "notes": list(self.notes),
                "tensors": [t.to_dict() for t in self.tensors], "message": self.message()}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e308


# ---- how much of its budget a verdict used ----------------------------------------------------------------

# The tensor verdicts a required factor is measured on, by kind, and the group each is counted in.
REQUIRED_GROUPS = {"output": "outputs", "grad": "gradients"}


def required_factors(verdict: Verdict, factor: float = FACTOR) -> list:
    """(group, tensor, required factor) of each judged output and gradient of ``verdict``: the FACTOR at which
    it would just pass, its ratio times ``factor``. Stages, tensors not judged (a mismatch, NaN where the truth is
    finite) and non-finite ratios are left out."""
    return [(REQUIRED_GROUPS[t.kind], t.name, t.ratio * factor) for t in verdict.tensors
            if t.kind in REQUIRED_GROUPS and t.status in ("ok", "diverged") and math.isfinite(t.ratio)]


def factor_spread(values) -> dict:
    """How many required factors, and their median, 99th percentile (linear between order statistics) and maximum;
    None where there are none. ``values``: a sequence of floats (a list, or a compact array.array)."""
    if not len(values):
        return {"verdicts": 0, "median": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    median, p99 = np.quantile(a, [0.5, 0.99])
    return {"verdicts": int(a.size), "median": float(median), "p99": float(p99), "max": float(a.max())}


def failed_run(impl: str, status: str, detail: str, seconds: float = 0.0) -> Verdict:
    """The verdict on a run that produced nothing: error, crash or hang."""
    assert status in RUN_FAILURES, status
    return Verdict(impl=impl, status=status, ratio=math.inf, detail=detail, seconds=seconds)


def judge(impl: str, case: Case, inputs: Inputs, outputs, truth, base, stages: bool = False,
          factor: float = FACTOR, seconds: float = 0.0, top: int = 0) -> Verdict:
    """Judge an implementation's ``outputs`` (ssdiff.model.evaluation.Evaluation) against the oracle's ``truth`` with the
    baseline ``base`` (Evaluations too): every output and gradient the oracle has, and with
    ``stages`` every stage both sides expose (named "stage.<name>"). ``top``: each tensor also lists the
    elements of its ``top`` largest ratios (`TensorVerdict.elements`)."""
    bases = list(base) if isinstance(base, (list, tuple)) else [base]
    tensors = []
    for name, value in truth.outputs.items():
        tensors.append(judge_tensor(name, "output", outputs.outputs.get(name), value,
                                    [e.outputs[name] for e in bases], case, inputs, factor, top=top))
    for name, value in truth.grads.items():
        tensors.append(judge_tensor(f"grad.{name}", "grad", outputs.grads.get(name), value,
                                    [e.grads[name] for e in bases], case, inputs, factor, top=top))
    if stages:
        for name, value in truth.stages.items():
            if name in outputs.stages and name in bases[0].stages:
                tensors.append(judge_tensor(f"stage.{name}", "stage", outputs.stages[name], value,
                                            [e.stages[name] for e in bases if name in e.stages], case, inputs,
                                            factor, top=top))
    judged = [t for t in tensors if t.kind != "stage"]
    status = max((t.status for t in judged), key=severity, default="ok")
    finite = [t.ratio for t in judged if math.isfinite(t.ratio)]
    ratio = max(finite, default=0.0) if status in ("ok", "diverged") else math.inf
    verdict = Verdict(impl=impl, status=status, ratio=ratio, tensors=tensors, notes=list(getattr(outputs, "notes", [])),
                      seconds=seconds)
    for listener in JUDGE_LISTENERS:
        listener(case, verdict)
    return verdict


def judge_named(name: str, case: Case, inputs: Inputs, outputs, truth, base, factor: float = FACTOR,
                allowance: Optional[torch.Tensor] = None) -> TensorVerdict:
    """`judge`'s verdict on the one output or gradient ``name`` ("y", "grad.A", ...), with an ``allowance``."""
    bases = list(base) if isinstance(base, (list, tuple)) else [base]
    kind, short = ("grad", name[len("grad."):]) if name.startswith("grad.") else ("output", name)
    field = "grads" if kind == "grad" else "outputs"
    return judge_tensor(name, kind, getattr(outputs, field).get(short), getattr(truth, field)[short],
                        [getattr(e, field)[short] for e in bases], case, inputs, factor, allowance=allowance)


def disagreement(case: Case, inputs: Inputs, a, b, truth, base, factor: float = FACTOR) -> dict:
    """How far two implementations' results are from each other, per tensor, as a ratio to their joint
    budget (twice one budget: by the triangle inequality two results each within budget of the oracle are
    within it of each other). Tensors either side lacks (or got wrong in shape) are left out."""
    out = {}
    bases = list(base) if isinstance(base, (list, tuple)) else [base]
    pairs = [("output", k, k, a.outputs.get(k), b.outputs.get(k), truth.outputs[k], [e.outputs[k] for e in bases])
             for k in truth.outputs]
    pairs += [("grad", f"grad.{k}", k, a.grads.get(k), b.grads.get(k), truth.grads[k], [e.grads[k] for e in bases])
              for k in truth.grads]
    for kind, label, _, va, vb, t, bb in pairs:
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or va.shape != t.shape \
                or vb.shape != t.shape:
            continue
        tv = judge_tensor(label, kind, va.to(torch.float64), t, bb, case, inputs, 2 * factor,
                          reference=vb.to(torch.float64))
        out[label] = tv.ratio
    return out
