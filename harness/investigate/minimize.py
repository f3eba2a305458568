"""Minimize a divergence: the smallest, plainest Case on which the same divergence persists, and its repro.py.

A step is kept (every step is checked, like the PyTorch accuracy minifier does) when the divergence is the
same (ssdiff.examine.same_divergence: the same sides fail with the same status, in at least one of the same
outputs or gradients), still well over budget (a ratio of at least MIN_RATIO, or a non-finite one, on a
failing side), and at the same first divergent stage when the original's was measured from stage
intermediates.

The search is harness/investigate/shrink.py's greedy delta debugging over the Case. Results go next to the case (harness/store.py):
minimized.json (the minimal case), minimized-verdict.json (its verdict, what replay compares against) and
repro.py (harness/reproduce/repro.py), written from the minimal case's own inputs, truth and baseline.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ssdiff.reproduce import repro
from ssdiff import runtime
from ssdiff import store
from ssdiff.model.case import Case, CaseError
from ssdiff.examine import Examiner, Outcome, UsageError, same_divergence
from ssdiff.truth import DEFAULT_ORACLE
from ssdiff.investigate.localize import first_stage as first_stage_of
from ssdiff.investigate.shrink import Shrunk, Step, shrink
from ssdiff.verdict.judge import FACTOR, RUN_FAILURES

MIN_RATIO = 4.0


class NotDiverging(Exception):
    """The case given to minimize does not diverge (any more)."""


@dataclass
class Minimized:
    original: Case
    minimal: Case
    shrunk: Shrunk
    outcome: Outcome
    first_stage: Optional[str]
    out_dir: Path
    repro_path: Optional[Path] = None
    files: list = field(default_factory=list)

    def irrelevant(self) -> list:
        return self.shrunk.irrelevant_features()

    @property
    def partial(self) -> bool:
        """Whether shrinking stopped at its run or time bound: ``minimal`` is the smallest reached."""
        return self.shrunk.partial


def _raised(verdict) -> str:
    """The exception type an "error" verdict's run raised (its detail starts "TypeName: ...")."""
    return verdict.detail.split(":", 1)[0]


def persists_predicate(examiner: Examiner, original: Outcome, first_stage: Optional[str], kept: list,
                       accept: Optional[Callable[[Case], bool]] = None,
                       holds: Optional[Callable[[Outcome], bool]] = None) -> Callable:
    """``candidate -> bool``: the original's divergence persists on ``candidate`` (the module docstring). The
    outcome of each candidate kept is appended to ``kept``. ``accept``: candidates it rejects are not tried;
    ``holds``: a candidate's outcome it rejects is not kept."""
    failing = list(original.failing)
    choice = original.choice

    def persists(candidate: Case) -> bool:
        if accept is not None and not accept(candidate):
            return False
        if examiner.skip_reasons(candidate):
            return False
        try:
            again = examiner.examine(candidate, choice, sides=failing)
        except (CaseError, RuntimeError, ValueError):
            return False
        if not same_divergence(original, again, MIN_RATIO) or (holds is not None and not holds(again)):
            return False
        # A run that raised must raise the same exception type: two defects that raise (selective_state_update
        # with D None, with dt_bias None) are not one, and shrinking must not trade one for the other.
        if any(_raised(v) != _raised(again.verdicts[s]) for s, v in original.failing.items() if v.status == "error"):
            return False
        if first_stage is not None and first_stage_of(examiner, candidate, failing[0], choice) != first_stage:
            return False
        kept.append(again)
        return True

    return persists


def minimize_outcome(examiner: Examiner, original: Outcome, out_dir, on_step: Optional[Callable[[Step], None]] = None,
                     max_runs: int = 300, write_repro: bool = True,
                     accept: Optional[Callable[[Case], bool]] = None,
                     holds: Optional[Callable[[Outcome], bool]] = None,
                     deadline: Optional[float] = None) -> Minimized:
    """Shrink the diverging ``original`` (examined by ``examiner``) and write minimized.json,
    minimized-verdict.json and repro.py into ``out_dir``. Raises NotDiverging when it does not diverge.
    ``accept``: a condition every smaller case must keep (a known defect's predicate, say); ``holds``: one every
    smaller case's outcome must keep (that the defect explains its divergence, say). Shrinking stops at
    ``max_runs`` runs or once time.perf_counter() passes ``deadline``: the smallest case reached is written, and
    minimized-verdict.json says it is partial."""
    if not original.diverged:
        raise NotDiverging(f"{original.case.describe()}: no divergence — "
                           + "; ".join(v.message() for v in original.verdicts.values()))
    choice = original.choice if original.choice != "sweep" else "tuned"
    if choice != original.choice:
        original = examiner.examine(original.case, choice)
        if not original.diverged:
            raise NotDiverging(f"{original.case.describe()}: diverges only when every autotune config is swept")
    examiner.keep(original)
    failing = original.failing
    side = next(iter(failing))
    first = None if failing[side].status in RUN_FAILURES else first_stage_of(examiner, original.case, side, choice)
    kept = [original]
    shrunk = shrink(original.case, persists_predicate(examiner, original, first, kept, accept, holds),
                    on_step=on_step, max_runs=max_runs, deadline=deadline)
    examiner.keep(kept[-1])                          # the minimal case: examined again with its evidence
    final = examiner.examine(shrunk.minimal, choice, stages=True)
    out = Path(out_dir)
    result = Minimized(original=original.case, minimal=shrunk.minimal, shrunk=shrunk, outcome=final,
                       first_stage=first, out_dir=out)
    result.files = store.write_minimized(out, shrunk.minimal, {
        "original": original.case.to_dict(), "minimal": shrunk.minimal.to_dict(),
        "minimal_description": shrunk.minimal.describe(), "sides": examiner.sides, "device": examiner.device,
        "autotune": choice, "first_stage": first, "runs": shrunk.runs, "stopped": shrunk.stopped,
        "partial": shrunk.partial,
        "steps_kept": [s.change for s in shrunk.kept],
        "irrelevant_features": shrunk.irrelevant_features(),
        "verdicts": {side: v.to_dict() for side, v in final.verdicts.items()},
    })
    if write_repro:
        message = "\n".join(v.message() for v in final.verdicts.values())
        result.repro_path = repro.write(out / store.REPRO, shrunk.minimal, examiner.sides, final.inputs, final.truth,
                                        final.baseline, examiner.factor, message, choice, outputs=final.outputs)
        result.files.append(result.repro_path)
    return result


def minimize(case: Case, impl: str, against: Optional[str] = None, device: Optional[str] = None,
             out_dir=None, choice="tuned", on_step: Optional[Callable[[Step], None]] = None,
             max_runs: int = 300, isolate: bool = False, write_repro: bool = True,
             oracle_name: str = DEFAULT_ORACLE, factor: float = FACTOR,
             accept: Optional[Callable[[Case], bool]] = None,
             holds: Optional[Callable[[Outcome], bool]] = None, max_time: Optional[float] = None) -> Minimized:
    """Shrink ``case`` while impl (vs against, or vs the oracle) keeps the same divergence; write the results
    into ``out_dir`` (default ssdiff-out/minimize-<time>). ``max_time``: seconds shrinking may take (the run under
    way finishes; None: no bound). Raises NotDiverging when the case does not diverge."""
    deadline = None if max_time is None else time.perf_counter() + max_time
    runtime.configure()
    device = device or runtime.default_device()
    with Examiner([impl] + ([against] if against else []), device, oracle_name=oracle_name, factor=factor,
                  isolate=isolate) as examiner:
        fitted = examiner.fit(case)
        if fitted is None:
            raise NotDiverging("the case is outside an implementation's capabilities: "
                               + "; ".join(examiner.skip_reasons(case)))
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = out_dir or os.path.join("ssdiff-out", f"minimize-{stamp}")
        return minimize_outcome(examiner, examiner.examine(fitted, choice), out, on_step=on_step,
                                max_runs=max_runs, write_repro=write_repro, accept=accept, holds=holds,
                                deadline=deadline)


def replay(case: Case, impl: str, against: Optional[str] = None, device: Optional[str] = None, choice="tuned",
           isolate: bool = False, top: int = 0) -> Outcome:
    """Judge ``case`` again (the same case on the same machine gives the same numbers). A side that does not
    take the case (a feature it lacks, a dtype it does not run) is a UsageError naming what, not a run."""
    runtime.configure()
    with Examiner([impl] + ([against] if against else []), device or runtime.default_device(),
                  isolate=isolate, top=top) as examiner:
        reasons = examiner.skip_reasons(case)
        if reasons:
            raise UsageError("this case is not one every side takes: " + "; ".join(reasons))
        return examiner.examine(case, choice)


__all__ = ["minimize", "minimize_outcome", "replay", "Minimized", "NotDiverging", "MIN_RATIO"]
