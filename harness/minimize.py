"""Minimize a divergence: the smallest, plainest Case on which the same divergence persists, and its repro.py.

"The same divergence" (every step is checked, like the PyTorch accuracy minifier does):
- the same sides fail, with the same status (diverged, nonfinite, crash, ...);
- in at least one of the same outputs / gradients;
- at the same first divergent stage, when the original's was known from stage intermediates;
- still well over budget: a ratio of at least MIN_RATIO (or a non-finite one) on a failing side.

The search is harness/shrink.py's greedy delta debugging over the Case. Results go next to the case:
minimized.json (the minimal case), minimized-verdict.json (its verdict, what replay compares against) and
repro.py (harness/repro.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from harness import localize, oracle, repro
from harness import baseline
from harness.case import Case, CaseError
from harness.fuzz import FuzzConfig, Fuzzer, Outcome, fit_case
from harness.inputs import materialize
from harness.shrink import Shrunk, Step, shrink

MIN_RATIO = 4.0
RUN_FAILURES = ("error", "crash", "hang")


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


def sides_of(case_path: Path) -> list:
    """The sides recorded next to a fuzz finding (verdict.json), or []."""
    record = Path(case_path).with_name("verdict.json")
    if not record.exists():
        return []
    try:
        return list(json.loads(record.read_text(encoding="utf-8")).get("verdicts", {}))
    except (json.JSONDecodeError, OSError):
        return []


def _failing(outcome: Outcome) -> dict:
    return {side: v for side, v in outcome.verdicts.items() if not v.ok}


def _first_stage(fuzzer: Fuzzer, case: Case, side: str, choice) -> Optional[str]:
    staged = fuzzer.examine(case, choice, want_stages=True, sides=[side]).verdicts[side]
    if staged.status in RUN_FAILURES:
        return None
    found = localize.stages(staged)
    return found["first"] if not found.get("inferred") else None


def persists_predicate(fuzzer: Fuzzer, original: Outcome, first_stage: Optional[str], choice) -> Callable:
    failing = _failing(original)
    impls = list(fuzzer.impls.values())
    device = fuzzer.config.device

    def persists(candidate: Case) -> bool:
        if any(impl.skip_reason(candidate, device) for impl in impls):
            return False
        try:
            again = fuzzer.examine(candidate, choice, sides=list(failing))
        except (CaseError, RuntimeError, ValueError):
            return False
        strong = False
        for side, before in failing.items():
            after = again.verdicts.get(side)
            if after is None or after.ok or after.status != before.status:
                return False
            if before.status not in RUN_FAILURES:
                names_before = {t.name for t in before.failing if t.kind != "stage"}
                names_after = {t.name for t in after.failing if t.kind != "stage"}
                if not names_before & names_after:
                    return False
            strong |= not math.isfinite(after.ratio) or after.ratio >= MIN_RATIO
        if not strong:
            return False
        if first_stage is not None:
            side = next(iter(failing))
            if _first_stage(fuzzer, candidate, side, choice) != first_stage:
                return False
        return True

    return persists


def minimize(case: Case, impl: str, against: Optional[str] = None, device: Optional[str] = None,
             out_dir=None, choice="tuned", on_step: Optional[Callable[[Step], None]] = None,
             max_runs: int = 300, isolate: bool = False, write_repro: bool = True) -> Minimized:
    """Shrink ``case`` while impl (vs against, or vs the oracle) keeps the same divergence; write the results
    into ``out_dir``. Raises NotDiverging when the case does not diverge."""
    fuzzer = Fuzzer(FuzzConfig(impl=impl, against=against, device=device, max_time=None, max_examples=1,
                               isolate=isolate, localize=False, report_dir=None,
                               out_dir=str(out_dir) if out_dir else None))
    try:
        fitted = fit_case(case, list(fuzzer.impls.values()), fuzzer.config.device)
        if fitted is None:
            reasons = [i.skip_reason(case, fuzzer.config.device) for i in fuzzer.impls.values()]
            raise NotDiverging("the case is outside an implementation's capabilities: "
                               + "; ".join(r for r in reasons if r))
        original = fuzzer.examine(fitted, choice)
        if not original.diverged:
            raise NotDiverging(f"{fitted.describe()}: no divergence — "
                               + "; ".join(v.message() for v in original.verdicts.values()))
        failing = _failing(original)
        side = next(iter(failing))
        first = None
        if failing[side].status not in RUN_FAILURES:
            first = _first_stage(fuzzer, fitted, side, choice)
        shrunk = shrink(fitted, persists_predicate(fuzzer, original, first, choice), on_step=on_step,
                        max_runs=max_runs)
        final = fuzzer.examine(shrunk.minimal, choice, want_stages=True)
        out = Path(out_dir) if out_dir else Path(fuzzer.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        result = Minimized(original=fitted, minimal=shrunk.minimal, shrunk=shrunk, outcome=final,
                           first_stage=first, out_dir=out)
        (out / "minimized.json").write_text(shrunk.minimal.to_json() + "\n", encoding="utf-8")
        record = {
            "original": fitted.to_dict(), "minimal": shrunk.minimal.to_dict(),
            "minimal_description": shrunk.minimal.describe(), "sides": fuzzer.sides(), "device": fuzzer.config.device,
            "autotune": choice, "first_stage": first, "runs": shrunk.runs,
            "steps_kept": [s.change for s in shrunk.kept],
            "irrelevant_features": shrunk.irrelevant_features(),
            "verdicts": {s: v.to_dict() for s, v in final.verdicts.items()},
        }
        (out / "minimized-verdict.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        result.files = [out / "minimized.json", out / "minimized-verdict.json"]
        if write_repro:
            inputs = materialize(shrunk.minimal, fuzzer.config.device)
            truth = oracle.evaluate(shrunk.minimal, inputs, fuzzer.config.oracle)
            base = baseline.evaluate_samples(shrunk.minimal, inputs, truth=truth)
            message = "\n".join(v.message() for v in final.verdicts.values())
            result.repro_path = repro.write(out / "repro.py", shrunk.minimal, fuzzer.sides(), inputs, truth, base,
                                            fuzzer.config.factor, message)
            result.files.append(result.repro_path)
        return result
    finally:
        fuzzer.runner.close()


def replay(case: Case, impl: str, against: Optional[str] = None, device: Optional[str] = None, choice="tuned",
           isolate: bool = False) -> Outcome:
    """Judge ``case`` again (the same case on the same machine gives the same numbers)."""
    fuzzer = Fuzzer(FuzzConfig(impl=impl, against=against, device=device, max_time=None, max_examples=1,
                               isolate=isolate, localize=False, report_dir=None))
    try:
        return fuzzer.examine(case, choice)
    finally:
        fuzzer.runner.close()


def stored_verdicts(case_path: Path) -> Optional[dict]:
    """The verdicts saved next to a case file (minimized-verdict.json for minimized.json, else verdict.json)."""
    path = Path(case_path)
    for name in (("minimized-verdict.json",) if path.name == "minimized.json" else ("verdict.json",)):
        record = path.with_name(name)
        if record.exists():
            try:
                return json.loads(record.read_text(encoding="utf-8")).get("verdicts")
            except (json.JSONDecodeError, OSError):
                return None
    return None


__all__ = ["minimize", "replay", "Minimized", "NotDiverging", "sides_of", "stored_verdicts", "MIN_RATIO"]
