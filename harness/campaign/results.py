"""What a campaign found and measured: each divergence (`Finding`) and the run's tallies (`FuzzReport`), whose
`summary` is summary.json's schema (harness/store.py writes it)."""

from __future__ import annotations

import math
import platform
from array import array
from dataclasses import dataclass, field
from typing import Optional

from ssdiff import exits, runtime
from ssdiff.campaign.config import FuzzConfig
from ssdiff.examine import PHASES, Outcome
from ssdiff.model.features import BY_KEY
from ssdiff.sides.environment import environment
from ssdiff.verdict.judge import REQUIRED_GROUPS, factor_spread, required_factors


def at_production_shape(case) -> bool:
    """A case at the shapes models run (the throughput figure's production share)."""
    return case.seqlen >= 2048 and case.dstate >= 128


@dataclass
class Finding:
    number: int
    outcome: Outcome
    localization: dict
    found_after_s: float
    cases_before: int
    path: Optional[str] = None
    repeats: int = 0
    staged: dict = field(default_factory=dict)     # side -> Verdict with stages (the localization re-run)
    minimized: Optional[object] = None             # ssdiff.investigate.minimize.Minimized, when minimized
    minimize_problem: str = ""                     # why it was not minimized (it no longer diverges, ...)
    minimize_seconds: float = 0.0
    # float32 under TF32 (harness/investigate/tf32.py): what the replay with exact float32 dots said within budget (the
    # finding then moves to FuzzReport.tf32_explained), "" where it still diverged there, None where not replayed
    tf32_replay: Optional[str] = None
    # the other divergences of the same cause (`cause`), merged into this one: each its signature, a case (JSON),
    # its description, dtype and pass, and how many cases had it
    cases: list = field(default_factory=list)

    @property
    def divergent_cases(self) -> int:
        """The cases this finding stands for: its own and its repeats, and those of the divergences merged in."""
        return 1 + self.repeats + sum(c["count"] for c in self.cases)

    def cause(self) -> Optional[tuple]:
        """What makes two divergences one cause: the failing sides, the minimal feature trigger and each failing
        side's first divergent stage (from the localization); None where it was not localized. Where every stage
        is known (`stage_known`), the trigger's features that only observe (harness/model/features.py) are left
        out: the stage says where the divergence enters, they only where it is seen (a misgrouped state of a
        single chunk needs the final states to be seen, of two chunks not)."""
        trigger = self.trigger()
        if trigger is None:
            return None
        per_side = self.localization.get("per_side", {})
        stages = tuple((side, per_side.get(side, {}).get("stages", {}).get("first"))
                       for side in sorted(self.outcome.failing))
        if self.stage_known():
            trigger = tuple(k for k in trigger if not (k in BY_KEY and BY_KEY[k].observes))
        return tuple(sorted(self.outcome.failing)), trigger, stages

    def trigger(self) -> Optional[tuple]:
        """The minimal feature trigger of the localization, or None."""
        trigger = self.localization.get("features", {}).get("trigger")
        return None if trigger is None else tuple(trigger)

    def stage_known(self) -> bool:
        """Whether every failing side's first divergent stage was measured (not inferred, not unknown: a side
        exposing no stages, or one whose every stage is within budget)."""
        per_side = self.localization.get("per_side", {})
        found = [per_side.get(side, {}).get("stages", {}) for side in self.outcome.failing]
        return all(f.get("first") and not f.get("inferred") for f in found)

    def as_case(self) -> dict:
        """This finding as one of the cases of another of its cause (`cases`)."""
        case = self.outcome.case
        return {"signature": signature_text(self.outcome.signature()), "case": case.to_dict(),
                "description": case.describe(), "dtype": case.dtype, "pass": case.pass_,
                "count": 1 + self.repeats}


@dataclass
class FuzzReport:
    config: FuzzConfig
    out_dir: str
    tried: int = 0
    skipped: int = 0
    skip_reasons: dict = field(default_factory=dict)
    harness_errors: list = field(default_factory=list)
    worst: dict = field(default_factory=dict)          # dtype -> {ratio, side, tensor, case}
    worst_by_side: dict = field(default_factory=dict)
    findings: list = field(default_factory=list)
    # float32 divergences under TF32 within budget replayed with exact float32 dots (harness/investigate/tf32.py): TF32's loss,
    # reported apart from the findings
    tf32_explained: list = field(default_factory=list)
    elapsed: float = 0.0
    stopped: str = ""
    first_divergence_s: Optional[float] = None
    first_judged_s: Optional[float] = None             # time to the first judged case (compilation included)
    search_s: float = 0.0                              # time spent searching (localize / minimize / report after)
    setup_s: float = 0.0                               # before the search: imports, loading the implementations
    production_cases: int = 0                          # judged cases at production shapes (at_production_shape)
    untuned_while_compiling: int = 0                   # tuned cases judged under config 0, their key compiling
    compile_wait_s: float = 0.0                        # waiting for the workers compiling ahead (precompile.py)
    # where the judged cases' time went, by shape ("production" / "other"): {"cases": n, "examine": s, and the
    # seconds of each of ssdiff.examine.PHASES}
    case_seconds: dict = field(default_factory=dict)
    report_path: Optional[str] = None
    known: dict = field(default_factory=dict)          # defect id -> what the campaign saw of it
    # "side dtype" -> {"outputs": array, "gradients": array}: every required factor (verdict.required_factors) of
    # what no known defect explains, 8 bytes each (a day's campaign judges millions of tensors)
    required: dict = field(default_factory=dict)

    @property
    def judged_too_little(self) -> Optional[str]:
        """Why the campaign cannot be said to have found nothing (no case judged; more cases failing inside ssdiff
        than judged), or None."""
        if self.tried == 0:
            return "no case was judged"
        if len(self.harness_errors) > self.tried:
            return f"{len(self.harness_errors)} cases failed inside ssdiff, more than the {self.tried} judged"
        return None

    @property
    def exit_code(self) -> int:
        """The exit-status contract (ssdiff.exits): a new divergence, judged too little, or OK."""
        if self.findings:
            return exits.DIVERGENCE
        return exits.TOO_LITTLE if self.judged_too_little else exits.OK

    @property
    def divergent_cases(self) -> int:
        return sum(f.divergent_cases for f in self.findings)

    def note_judged(self, outcome: Outcome, elapsed: float) -> None:
        """Count a judged case: how many, when the first was, how many at production shapes, where its time went."""
        self.tried += 1
        if self.first_judged_s is None:
            self.first_judged_s = elapsed
        production = at_production_shape(outcome.case)
        self.production_cases += production
        tally = self.case_seconds.setdefault("production" if production else "other",
                                             dict.fromkeys(("cases", "examine", *PHASES), 0.0))
        tally["cases"] += 1
        tally["examine"] += outcome.seconds
        for phase in PHASES:
            tally[phase] += outcome.phases.get(phase, 0.0)

    def note_ratios(self, outcome: Outcome, factor: float, explained: set = frozenset()) -> None:
        """The largest ratios so far and every required factor, of what no known defect explains (the ``explained``
        sides are left out)."""
        dtype = outcome.case.dtype
        for side, v in outcome.verdicts.items():
            if side in explained:
                continue
            key = f"{side} {dtype}"
            groups = self.required.setdefault(key, {group: array("d") for group in REQUIRED_GROUPS.values()})
            for group, _, required in required_factors(v, factor):
                groups[group].append(required)
            if not math.isfinite(v.ratio) or v.status not in ("ok", "diverged"):
                continue
            worst = v.worst()
            item = {"ratio": v.ratio, "side": side, "tensor": worst.name if worst else None,
                    "case": outcome.case.describe()}
            if v.ratio >= self.worst.get(dtype, {}).get("ratio", -1.0):
                self.worst[dtype] = item
            if v.ratio >= self.worst_by_side.get(key, {}).get("ratio", -1.0):
                self.worst_by_side[key] = item

    def throughput(self) -> dict:
        """Cases judged per minute of search, and the time to the first one."""
        minutes = self.search_s / 60.0
        per_case = {kind: {"cases": t["cases"], "examine_s": round(t["examine"] / t["cases"], 4),
                           **{f"{phase}_s": round(t[phase] / t["cases"], 4) for phase in PHASES}}
                    for kind, t in sorted(self.case_seconds.items())}
        examined = sum(t["examine"] for t in self.case_seconds.values())
        return {"judged": self.tried, "skipped": self.skipped,
                "judged_per_minute": round(self.tried / minutes, 1) if minutes > 0 else None,
                "first_judged_after_s": None if self.first_judged_s is None else round(self.first_judged_s, 2),
                "setup_s": round(self.setup_s, 2),
                "search_s": round(self.search_s, 2), "production_shape_cases": self.production_cases,
                "untuned_while_compiling": self.untuned_while_compiling,
                "compile_wait_s": round(self.compile_wait_s, 2),
                # examine: inputs, oracle, baseline, the sides' runs (compiling and tuning included) and verdicts;
                # compile_wait: representatives waiting for the workers; the rest of search_s is drawing, fitting
                # and the search's own work
                "examine_s": round(examined, 2), "per_case": per_case}

    def required_factor_by_side(self) -> dict:
        """Per side and dtype, how much of the budget its judged outputs and gradients used: the required
        factor's count, median, 99th percentile and maximum (harness/tools/calibrate.py's figures, for this campaign)."""
        rounded = lambda x: None if x is None else round(x, 4)
        return {key: {group: {k: (v if k == "verdicts" else rounded(v)) for k, v in factor_spread(values).items()}
                      for group, values in groups.items()} for key, groups in sorted(self.required.items())}

    def summary(self) -> dict:
        cfg = self.config
        return {
            "impl": cfg.impl, "against": cfg.against or f"oracle ({cfg.oracle})", "device": cfg.device,
            "runtime": runtime.describe(), "entry": cfg.entry, "pass": cfg.pass_, "dtypes": list(cfg.dtypes or ()),
            "autotune": cfg.autotune, "isolate": cfg.isolate, "timeout_s": cfg.timeout, "seed": cfg.seed,
            "max_time_s": cfg.max_time, "max_examples": cfg.max_examples, "factor": cfg.factor,
            "cases_tried": self.tried, "cases_skipped": self.skipped, "skip_reasons": self.skip_reasons,
            "harness_errors": self.harness_errors,
            "elapsed_s": round(self.elapsed, 2), "stopped": self.stopped,
            "first_divergence_after_s": None if self.first_divergence_s is None else round(self.first_divergence_s, 2),
            "throughput": self.throughput(),
            "largest_ratio_by_dtype": self.worst, "largest_ratio_by_side": self.worst_by_side,
            "required_factor_by_side": self.required_factor_by_side(),
            "divergences": [{"number": f.number, "path": f.path, "signature": signature_text(f.outcome.signature()),
                             "repeats": f.repeats, "found_after_s": round(f.found_after_s, 2),
                             "cases_before": f.cases_before, "case": f.outcome.case.describe(),
                             "summary": f.localization.get("text", ""),
                             "minimized": f.minimized.minimal.describe() if f.minimized else None,
                             "minimized_partial": f.minimized.partial if f.minimized else None,
                             "minimize_problem": f.minimize_problem or None,
                             "tf32_replay": f.tf32_replay, "divergent_cases": f.divergent_cases,
                             "cases": f.cases} for f in self.findings],
            "causes": len(self.findings), "divergent_cases": self.divergent_cases,
            "judged_too_little": self.judged_too_little,
            "tf32_explained": [{"number": f.number, "path": f.path, "signature": signature_text(f.outcome.signature()),
                                "repeats": f.repeats, "found_after_s": round(f.found_after_s, 2),
                                "case": f.outcome.case.describe(), "replay": f.tf32_replay}
                               for f in self.tf32_explained],
            "known_policy": cfg.known, "known": list(self.known.values()),
            "python": platform.python_version(), "platform": platform.platform(),
            "environment": environment(cfg.device),
        }


def signature_text(sig) -> str:
    return "; ".join(f"{side}: {status}" + (f" in {', '.join(names)}" if names else "") for side, status, names in sig)


__all__ = ["Finding", "FuzzReport", "at_production_shape", "signature_text"]
