"""Examining one case: its inputs built once, the oracle's truth and the same-precision baseline evaluated once,
every side run on those inputs and judged, the two sides compared.

    examiner = Examiner(["mamba_ssm.split_conv1d_combined", "mamba_ssm.split_conv1d_ref"], device="cpu")
    outcome = examiner.examine(case)            # verdicts, outputs, and the inputs, truth and baseline used
    same_divergence(outcome, examiner.examine(smaller_case))

The fuzz campaign, localization, minimization and replay all examine through an Examiner, so a case examined
again — with stage intermediates, under another autotune config, as a minimization candidate seen before —
reuses its evidence instead of evaluating the oracle and the baseline
again. Evidence is kept, most recent first, up to EVIDENCE_BYTES (at least the last two cases whatever their
size): every case of a campaign's localization and minimization fits at the CPU's sizes, and a production-size
case on a GPU is evaluated again rather than held. `same_divergence` is the one rule for "is this still the
divergence we had".
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from ssdiff.budget.samples import evaluate_samples, neighbours_of, token_model_too_large
from ssdiff.inputs import huge
from ssdiff import truth
from ssdiff import runtime
from ssdiff.inputs import widen
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.inputs import Inputs, materialize
from ssdiff.sides.base import fit_case
from ssdiff.sides.runner import InProcessRunner, IsolatedRunner, resolve
from ssdiff.verdict.judge import FACTOR, RUN_FAILURES, disagreement, failed_run, judge, severity

EVIDENCE_BYTES = 1 << 30
# The parts of an examination, each timed to a device synchronization at its end (a GPU runs asynchronously:
# unsynchronized, an operation's time lands in whichever later step waits for it).
PHASES = ("inputs", "oracle", "baseline", "kernels", "verdict")


@dataclass
class Evidence:
    """What every side of one case is judged against: its inputs, the oracle's truth, the baseline samples."""

    inputs: Inputs
    truth: Evaluation
    baseline: list

    def nbytes(self) -> int:
        tensors = list(self.inputs.values.values())
        for ev in [self.truth, *self.baseline]:
            tensors += [*ev.outputs.values(), *ev.grads.values(), *ev.stages.values()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclass
class Outcome:
    """One case examined: each side's verdict (and outputs), the pair's disagreement (two sides), the autotune
    choice and launches, and the evidence they were judged against."""

    case: Case
    choice: object
    verdicts: dict
    outputs: dict
    launches: dict
    evidence: Evidence
    pair: dict = field(default_factory=dict)
    seconds: float = 0.0
    # where ``seconds`` went (PHASES; the evidence's parts are 0 where it was kept from an earlier examination)
    phases: dict = field(default_factory=dict)

    @property
    def inputs(self) -> Inputs:
        return self.evidence.inputs

    @property
    def truth(self) -> Evaluation:
        return self.evidence.truth

    @property
    def baseline(self) -> list:
        return self.evidence.baseline

    @property
    def diverged(self) -> bool:
        return any(not v.ok for v in self.verdicts.values())

    @property
    def failing(self) -> dict:
        return {side: v for side, v in self.verdicts.items() if not v.ok}

    def signature(self) -> tuple:
        """Which side fails, how, and in which tensors: divergences with one signature are one bucket."""
        return tuple((side, v.status, tuple(sorted(failing_tensors(v)))) for side, v in self.failing.items())

    def worst_ratio(self, excluding=()) -> float:
        """The largest finite ratio to budget over the sides (but those in ``excluding``)."""
        finite = [v.ratio for side, v in self.verdicts.items() if side not in excluding and math.isfinite(v.ratio)]
        return max(finite, default=0.0)


def failing_tensors(verdict) -> set:
    """The outputs and gradients (not stages) a verdict finds out of budget."""
    return {t.name for t in verdict.failing if t.kind != "stage"}


def same_divergence(before: Outcome, after: Outcome, min_ratio: float = 0.0, on_what_is_left: bool = False) -> bool:
    """Whether ``after`` shows the divergence ``before`` showed: every side that failed before fails again with
    the same status and — unless the run itself failed (error, crash, hang) — in at least one of the same
    outputs or gradients. With ``min_ratio``, some failing side must also be at least that far over budget (or
    non-finite). With ``on_what_is_left`` it is judged on the outputs and gradients ``after`` still has (a feature
    switched off may take some away: final states, the gradients): some of ``before``'s failing ones must be
    among them, and the status is compared over them alone."""
    strong = min_ratio <= 0
    for side, was in before.failing.items():
        now = after.verdicts.get(side)
        if now is None or now.ok:
            return False
        status, failing = was.status, failing_tensors(was)
        if on_what_is_left and was.status not in RUN_FAILURES and now.status not in RUN_FAILURES:
            left = {t.name for t in now.tensors if t.kind != "stage"}
            failing &= left
            status = max((t.status for t in was.failing if t.name in failing), key=severity, default="ok")
        if now.status != status:
            return False
        if was.status not in RUN_FAILURES and not failing & failing_tensors(now):
            return False
        strong |= not math.isfinite(now.ratio) or now.ratio >= min_ratio
    return strong


class UsageError(ValueError):
    """The sides cannot run (unknown implementation, not available here, nothing in common, ...): exit status 2."""


class Examiner:
    """Examines cases for a fixed set of sides on one device. ``isolate``: run the sides in a child process
    (harness/sides/runner.py; ``timeout`` seconds per run). ``top``: each tensor verdict also lists the elements of its
    ``top`` largest ratios (`verdict.judge`). ``oracle_evaluations`` / ``baseline_evaluations`` count the
    evidence evaluated (one of each per distinct case while it is kept). ``meter(phase)``: a context manager entered
    around each part of assembling evidence ("inputs", "oracle", "baseline"): what counts their operations."""

    def __init__(self, sides, device: str, oracle_name: str = truth.DEFAULT_ORACLE, factor: float = FACTOR,
                 isolate: bool = False, timeout: float = 300.0, top: int = 0, meter=None):
        why = runtime.device_problem(device)
        if why:
            raise UsageError(why)
        self.sides = list(dict.fromkeys(sides))
        self.device = device
        self.oracle_name = oracle_name
        self.factor = factor
        self.top = top
        self.meter = meter
        try:
            self.impls = {spec: resolve(spec) for spec in self.sides}
        except KeyError as err:
            raise UsageError(str(err)) from None
        for spec, impl in self.impls.items():
            why = impl.unavailable()
            if why:
                raise UsageError(f"{spec} cannot run here: {why}")
        self.runner = IsolatedRunner(device, timeout) if isolate else InProcessRunner(device)
        self.recurrent = any(impl.evaluation_order == "recurrent" for impl in self.impls.values())
        self.oracle_evaluations = 0
        self.baseline_evaluations = 0
        self._evidence: OrderedDict = OrderedDict()
        self._sizes: dict = {}
        self._phases: dict = {}
        self._cuda = torch.device(device).type == "cuda"

    def _synchronized(self) -> float:
        """The time once the device has done what was launched (`PHASES`)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def _part(self, phase: str):
        """One part of assembling evidence: timed to a device synchronization into its phase, and measured by
        ``meter`` where one is given."""
        start = time.perf_counter()
        with (self.meter(phase) if self.meter is not None else contextlib.nullcontext()):
            yield
        self._phases[phase] = self._phases.get(phase, 0.0) + self._synchronized() - start

    def __enter__(self) -> "Examiner":
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.runner.close()

    # ---- evidence ----------------------------------------------------------------------------------------

    def oracle_at(self, case: Case, inputs: Inputs) -> Evaluation:
        """The oracle on ``inputs`` (what the baseline's neighbour samples are measured against)."""
        return truth.evaluate(case, inputs, self.oracle_name)

    def evidence(self, case: Case, inputs: Optional[Inputs] = None) -> Evidence:
        """The case's inputs, truth and baseline samples: evaluated on first use, then kept. ``inputs``: a huge
        case's slice (harness/inputs/huge.py), whose evidence is kept under ``case``."""
        found = self._evidence.get(case)
        if found is not None:
            self._evidence.move_to_end(case)
            return found
        with self._part("inputs"):
            inputs = materialize(case, self.device) if inputs is None else inputs
            near = neighbours_of(inputs)
        judged = inputs.case
        self.oracle_evaluations += 1
        with self._part("oracle"):
            # the truth and the oracle at the neighbour samples' inputs, side by side where the entry allows
            truth, *at_near = widen.evaluate(self.oracle_at, judged, [inputs, *near])
        self.baseline_evaluations += 1
        with self._part("baseline"):
            samples = evaluate_samples(judged, inputs, truth, at_neighbours=(near, at_near))
            if self.recurrent and judged.entry == "chunk_scan":
                # a side evaluates token by token: the model in that order too (its stages have other layouts; a
                # case too large for it is outside such a side's reach: evidence_limit)
                token = evaluate_samples(judged.replace(chunk_size=1), inputs, truth,
                                         at_neighbours=(near, at_near), order="recurrent")
                samples += [Evaluation(e.outputs, e.grads) for e in token]
        found = Evidence(inputs, truth, samples)
        self._remember(case, found)
        return found

    def _remember(self, case: Case, evidence: Evidence):
        if case not in self._evidence:
            self._sizes[case] = evidence.nbytes()
        self._evidence[case] = evidence
        self._evidence.move_to_end(case)
        while len(self._evidence) > 2 and sum(self._sizes.values()) > EVIDENCE_BYTES:
            oldest, _ = self._evidence.popitem(last=False)
            del self._sizes[oldest]

    def keep(self, outcome: Outcome):
        """Keep ``outcome``'s evidence as the most recent (a case about to be examined again after others)."""
        self._remember(outcome.case, outcome.evidence)

    # ---- cases -------------------------------------------------------------------------------------------

    def fit(self, case: Case) -> Optional[Case]:
        """``case`` with what a side cannot express switched off, or None (ssdiff.sides.base.fit_case)."""
        fitted = fit_case(case, list(self.impls.values()), self.device)
        return fitted if fitted is not None and self.evidence_limit(fitted) is None else None

    def skip_reasons(self, case: Case) -> list:
        """Why a side cannot take ``case``, or why its evidence cannot be built here (empty: it can be examined)."""
        reasons = [why for why in (impl.skip_reason(case, self.device) for impl in self.impls.values()) if why]
        return reasons + ([self.evidence_limit(case)] if self.evidence_limit(case) else [])

    def evidence_limit(self, case: Case) -> Optional[str]:
        """Why the budget cannot be built for ``case`` here, or None: a side that evaluates token by token is
        budgeted by the model in the token order too, which holds every token's state."""
        if not self.recurrent or case.entry != "chunk_scan":
            return None
        why = token_model_too_large(case)
        return f"{', '.join(s for s, i in self.impls.items() if i.evaluation_order == 'recurrent')}: {why}" if why \
            else None

    def examine(self, case: Case, choice="tuned", stages: bool = False, sides=None) -> Outcome:
        """Run every side (or ``sides``) on ``case`` under autotune ``choice`` and judge each against the oracle;
        with ``stages``, the stage intermediates too."""
        if huge.is_huge(case):
            return self._examine_huge(case, choice, list(sides or self.sides))
        start = time.perf_counter()
        self._phases = dict.fromkeys(PHASES, 0.0)
        ev = runtime.retry_on_oom(lambda: self.evidence(case), "ssdiff's evidence (inputs, oracle, baseline)")
        sides = list(sides or self.sides)
        verdicts, outputs, launches = {}, {}, {}
        for spec in sides:
            if choice == "sweep":
                verdicts[spec], outputs[spec], launches[spec] = self._sweep(spec, case, ev, stages)
                if outputs[spec] is None:
                    del outputs[spec]
                continue
            run = self.runner.run(spec, case, ev.inputs, stages, choice)
            _raise_if_oom(run)
            self._phases["kernels"] += run.seconds
            launches[spec] = run.launches
            if run.status != "ok":
                verdicts[spec] = failed_run(spec, run.status, run.detail, run.seconds)
                continue
            outputs[spec] = run.outputs
            judged = time.perf_counter()
            verdicts[spec] = judge(spec, case, ev.inputs, run.outputs, ev.truth, ev.baseline, stages=stages,
                                   factor=self.factor, seconds=run.seconds, top=self.top)
            self._phases["verdict"] += self._synchronized() - judged
        pair = {}
        if len(sides) == 2 and len(outputs) == 2:
            a, b = (outputs[s] for s in sides)
            compared = time.perf_counter()
            pair = disagreement(case, ev.inputs, a, b, ev.truth, ev.baseline, self.factor)
            self._phases["verdict"] += self._synchronized() - compared
        return Outcome(case, choice, verdicts, outputs, launches, ev, pair, time.perf_counter() - start,
                       phases=dict(self._phases))

    def _examine_huge(self, case: Case, choice, sides: list) -> Outcome:
        """A huge case (harness/inputs/huge.py): every side runs on the whole case, and is judged on its slice; no
        stages. Raises runtime.DeviceOutOfMemory where the device has no room for it."""
        start = time.perf_counter()
        self._phases = dict.fromkeys(PHASES, 0.0)
        why = huge.room(case, self.device)
        if why:
            raise runtime.DeviceOutOfMemory(why)
        part, row, heads = huge.judged_slice(case)
        whole = runtime.retry_on_oom(lambda: materialize(case, self.device), "ssdiff's inputs of a huge case")
        sliced = huge.slice_inputs(whole, row, heads)
        if self.runner.isolated:            # the child draws the case itself
            del whole
            whole = None
            runtime.release_memory()
        drawn = self._synchronized() - start
        verdicts, results, launches, runs = {}, {}, {}, {}
        for spec in sides:
            sweep = runtime.ConfigSweep() if choice == "sweep" else [choice]
            for index in sweep:
                run = self.runner.run(spec, case, whole, False, index)
                _raise_if_oom(run)
                self._phases["kernels"] += run.seconds
                runs.setdefault(spec, []).append((index, run))     # its outputs at the slice (harness/sides/runner.py)
                if run.status != "ok":
                    break
                if choice == "sweep":
                    sweep.ran(run.launches)
        del whole
        runtime.release_memory()
        ev = runtime.retry_on_oom(lambda: self.evidence(case, sliced), "ssdiff's evidence of a huge case's slice")
        self._phases["inputs"] += drawn         # drawing the whole case (its slice's inputs were given)
        for spec, tried in runs.items():
            for index, run in tried:
                if run.status != "ok":
                    v, out = failed_run(spec, run.status, run.detail, run.seconds), None
                else:
                    judged = time.perf_counter()
                    v = judge(spec, part, ev.inputs, run.outputs, ev.truth, ev.baseline, factor=self.factor,
                              seconds=run.seconds, top=self.top)
                    self._phases["verdict"] += self._synchronized() - judged
                    out = run.outputs
                if choice == "sweep":
                    v.notes.append(f"autotune config index {index}")
                if spec not in verdicts or (severity(v.status), v.ratio) > \
                        (severity(verdicts[spec].status), verdicts[spec].ratio):
                    verdicts[spec], launches[spec] = v, run.launches
                    if out is not None:
                        results[spec] = out
                    else:
                        results.pop(spec, None)
        pair = {}
        if len(sides) == 2 and len(results) == 2:
            a, b = (results[s] for s in sides)
            pair = disagreement(part, ev.inputs, a, b, ev.truth, ev.baseline, self.factor)
        return Outcome(case, choice, verdicts, results, launches, ev, pair, time.perf_counter() - start,
                       phases=dict(self._phases))

    def _sweep(self, spec, case, ev: Evidence, stages: bool):
        """Every autotune config index of every kernel the run launches; the worst verdict."""
        worst_v, worst_o, worst_l = None, None, []
        sweep = runtime.ConfigSweep()
        for index in sweep:
            run = self.runner.run(spec, case, ev.inputs, stages, index)
            _raise_if_oom(run)
            if run.status != "ok":
                return (failed_run(spec, run.status, f"(autotune config index {index}) {run.detail}", run.seconds),
                        None, run.launches)
            v = judge(spec, case, ev.inputs, run.outputs, ev.truth, ev.baseline, stages=stages, factor=self.factor,
                      seconds=run.seconds, top=self.top)
            v.notes.append(f"autotune config index {index}")
            if worst_v is None or (severity(v.status), v.ratio) > (severity(worst_v.status), worst_v.ratio):
                worst_v, worst_o, worst_l = v, run.outputs, run.launches
            sweep.ran(run.launches)
        return worst_v, worst_o, worst_l


def _raise_if_oom(run) -> None:
    """A side that found no device memory, twice, leaves the case unjudged (`runtime.DeviceOutOfMemory`)."""
    if run.status == "oom":
        raise runtime.DeviceOutOfMemory(run.detail)


__all__ = ["Examiner", "UsageError", "Evidence", "Outcome", "same_divergence", "failing_tensors", "EVIDENCE_BYTES",
           "PHASES"]
