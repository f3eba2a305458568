"""The fuzz campaign: Hypothesis searches for a case on which an implementation diverges from the float64
oracle (or from another implementation); each divergence is localized (harness/investigate/localize.py), minimized
(harness/investigate/minimize.py) and saved (harness/store.py), and the run is rendered as an HTML report.

    report = Fuzzer(FuzzConfig(impl="mamba_ssm.split_conv1d_combined",
                               against="mamba_ssm.split_conv1d_ref", max_time=300)).run()

`ssdiff fuzz` is this call plus printing. Every case is examined by one ssdiff.examine.Examiner (inputs,
truth and baseline once per case). The search is a Hypothesis property (`cases()` from harness/model/strategies.py,
one autotune config index drawn per case when asked; at bounds.boundary_rate a case straddles a block size
of the sides' kernels and runs the config with that block: harness/sides/tiling.py; natively, every round's cases
come from the compile keys of harness/campaign/pool.py, one key swapped per round) with ``hypothesis.target`` on log10 of the case's worst
ratio that no known defect explains, so that with an example budget the second half of it climbs toward larger
errors; a time budget alone runs rounds of ROUND_EXAMPLES, plain generation and targeted search in turn. It stops at the
first divergence unless ``keep_going`` (then divergences are bucketed by which side fails, how, and in which
tensors, and localized once the search ends, the time budget being the search's), at the time budget, or at the
example budget. Cases outside an implementation's capabilities are
first fitted (the features it cannot express switched off) and skipped, with the reason counted, when that is
not enough.

The output directory is a saved run (harness/store.py); the HTML report goes to
<report_dir>/<out_dir's name>/index.html (harness/report).
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import shutil
import time
from array import array
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Optional

from ssdiff.inputs import huge
from ssdiff.registry import known
from ssdiff.investigate import localize
from ssdiff import truth
from ssdiff import runtime
from ssdiff import store
from ssdiff.investigate import tf32
from ssdiff.sides import tiling
from ssdiff.examine import PHASES, Examiner, Outcome, UsageError
from ssdiff.campaign.pool import POOLED_ENTRIES, Mix, Pool
from ssdiff.sides.environment import environment
from ssdiff.model.strategies import Bounds, cases, maybe_boundary
from ssdiff.verdict.judge import (FACTOR, PROCESS_FAILURES, REQUIRED_GROUPS, RUN_FAILURES, budget_rule, factor_spread,
                             required_factors)

PASSES = ("forward", "backward", "mixed")


def at_production_shape(case) -> bool:
    """A case at the shapes models run (the throughput figure's production share)."""
    return case.seqlen >= 2048 and case.dstate >= 128


ROUND_EXAMPLES = 100
# Natively, the keys of the next rounds' rotations are compiled ahead (harness/campaign/precompile.py), this many: on a warm
# cache the workers, with nothing of the current keys to do, get that far ahead of the search.
COMPILE_AHEAD_ROUNDS = 3
# The percentage of a round's cases drawn from its huge key, when it has one (harness/inputs/huge.py: each takes seconds).
HUGE_CASES_PERCENT = 2
# How long a key's representative case waits for the workers compiling it ahead (harness/campaign/precompile.py); past
# that, this process compiles what is missing itself.
COMPILE_WAIT_S = 120.0
# How often a campaign rewrites progress.json in its output folder (seconds).
PROGRESS_FILE_S = 2.0
AUTOTUNE_POLICIES = ("tuned", "random", "sweep")

# Larger shapes where kernels run natively (the float64 oracle on a GPU keeps up).
GPU_BOUNDS = Bounds(max_batch=2, max_seqlen=300, max_nheads=12, max_headdim=64, max_dstate=64,
                    chunk_sizes=(16, 32, 64, 128, 256))


@dataclass
class FuzzConfig:
    """impl / against: implementation specs (registry names or module:attr); against None: the oracle is
    the other side. max_time (s) / max_examples: budgets (None: unbounded; at least one should be set).
    entry: an entry point, or None for every one both sides take. pass_: forward, backward or mixed.
    dtypes: None for every dtype all sides run here. autotune: "tuned", a config index, "random" (an index
    drawn per case) or "sweep" (every config of every kernel, each case). isolate: run implementations in
    a child process (crash and hang become verdicts); timeout: seconds per run there."""

    impl: str
    against: Optional[str] = None
    max_time: Optional[float] = 300.0
    max_examples: Optional[int] = None
    entry: Optional[str] = None
    pass_: str = "mixed"
    dtypes: Optional[tuple] = None
    autotune: object = "tuned"
    device: Optional[str] = None
    out_dir: Optional[str] = None
    isolate: bool = False
    timeout: float = 300.0
    keep_going: bool = False
    # Known upstream defects (harness/registry/known.py): "report" judges and labels them, "skip" leaves their cases out,
    # "ignore" does not consult the registry (a divergence it would match counts as new).
    known: str = "report"
    seed: Optional[int] = None
    localize: bool = True
    # Minimize each divergence found (minimized.json, minimized-verdict.json, repro.py in its folder).
    minimize: bool = True
    minimize_runs: int = 150
    bounds: Optional[Bounds] = None
    # Draw each round's cases from a rotating pool of compile keys (harness/campaign/pool.py): None natively only (where
    # kernels compile), True always, False never.
    pool: Optional[bool] = None
    # The pool's kinds of key; None: Mix() with the default bounds, no production keys with bounds given (a
    # campaign told to stay small stays small).
    pool_mix: Optional[Mix] = None
    # The chance a production key is huge instead (harness/inputs/huge.py; Mix.huge): natively, the nightly campaign's.
    huge: float = 0.0
    # With a pool: compile each key's representative case ahead in worker processes (harness/campaign/precompile.py).
    compile_ahead: bool = True
    oracle: str = truth.DEFAULT_ORACLE
    factor: float = FACTOR
    ablation_runs: Optional[int] = None
    # The HTML report goes to <report_dir>/<out_dir's name>/index.html (harness/report); None: no report.
    report_dir: Optional[str] = field(default_factory=lambda: os.environ.get("SSDIFF_REPORTS") or "reports")


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
    def exit_code(self) -> int:
        return 1 if self.findings else 0

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
            "divergences": [{"number": f.number, "path": f.path, "signature": _sig_text(f.outcome.signature()),
                             "repeats": f.repeats, "found_after_s": round(f.found_after_s, 2),
                             "cases_before": f.cases_before, "case": f.outcome.case.describe(),
                             "summary": f.localization.get("text", ""),
                             "minimized": f.minimized.minimal.describe() if f.minimized else None,
                             "minimize_problem": f.minimize_problem or None,
                             "tf32_replay": f.tf32_replay} for f in self.findings],
            "tf32_explained": [{"number": f.number, "path": f.path, "signature": _sig_text(f.outcome.signature()),
                                "repeats": f.repeats, "found_after_s": round(f.found_after_s, 2),
                                "case": f.outcome.case.describe(), "replay": f.tf32_replay}
                               for f in self.tf32_explained],
            "known_policy": cfg.known, "known": list(self.known.values()),
            "python": platform.python_version(), "platform": platform.platform(),
            "environment": environment(cfg.device),
        }


def _sig_text(sig) -> str:
    return "; ".join(f"{side}: {status}" + (f" in {', '.join(names)}" if names else "") for side, status, names in sig)


def round_shares(keys, examples: int, round_: int) -> list:
    """(slot, key, examples) of each search of a pooled round: its ``examples`` spread over its keys, a huge key
    HUGE_CASES_PERCENT of them, the others equal shares (the remainder one each, from slot ``round_`` on), in slot
    order from ``round_`` (so that a round cut short by the budget does not always cut the same kind of key).
    One search per key, not one whose draws pick the key: Hypothesis picks a key where its draws lead (unequal
    shares; a targeted search climbs in the key of its largest ratio), while a key's share of the cases should be
    its share of the keys (a production key's, the pool's Mix.production)."""
    n = len(keys)
    order = [(round_ + i) % n for i in range(n)]
    big = [i for i in order if keys[i].kind == "huge"]
    regular = [i for i in order if keys[i].kind != "huge"]
    counts = dict.fromkeys(order, 0)
    if regular:
        for i in big:
            counts[i] = round(examples * HUGE_CASES_PERCENT / 100)
        left = examples - sum(counts.values())
        for j, i in enumerate(regular):
            counts[i] = left // len(regular) + (j < left % len(regular))
    else:
        for j, i in enumerate(big):
            counts[i] = examples // len(big) + (j < examples % len(big))
    return [(i, keys[i], counts[i]) for i in order if counts[i]]


class Fuzzer:
    """Runs one fuzz campaign. ``progress(state: dict)`` is called after every case; ``observe(outcome)``
    after every judged one (a calibration run collects its ratios there)."""

    def __init__(self, config: FuzzConfig, progress: Optional[Callable[[dict], None]] = None,
                 observe: Optional[Callable[[Outcome], None]] = None, started: Optional[float] = None):
        """``started``: a time.perf_counter() reading from before the caller's imports (the CLI's), so that
        the throughput's setup time includes them."""
        self.config = config
        self._created = started if started is not None else time.perf_counter()
        self.progress = progress
        self.observe = observe
        runtime.configure()
        cfg = config
        cfg.device = cfg.device or runtime.default_device()
        self.examiner = Examiner([cfg.impl] + ([cfg.against] if cfg.against else []), cfg.device,
                                 oracle_name=cfg.oracle, factor=cfg.factor, isolate=cfg.isolate, timeout=cfg.timeout)
        self.impls = self.examiner.impls
        if cfg.pass_ not in PASSES:
            raise UsageError(f"--pass must be one of {', '.join(PASSES)}, got {cfg.pass_!r}")
        if cfg.known not in known.KNOWN_POLICIES:
            raise UsageError(f"--known must be one of {', '.join(known.KNOWN_POLICIES)}, got {cfg.known!r}")
        if not (cfg.autotune in AUTOTUNE_POLICIES or (isinstance(cfg.autotune, int) and cfg.autotune >= 0)):
            raise UsageError(f"--autotune must be tuned, random, sweep or a config index, got {cfg.autotune!r}")
        if cfg.max_time is None and cfg.max_examples is None:
            raise UsageError("give a time budget or an example budget (or both)")
        if not 0.0 <= cfg.huge <= 1.0:
            raise UsageError(f"--huge is a chance between 0 and 1, got {cfg.huge!r}")
        entries = set.intersection(*(set(i.capabilities.entries) for i in self.impls.values()))
        if cfg.entry is not None:
            if cfg.entry not in entries:
                raise UsageError(f"entry {cfg.entry!r} is not implemented by every side (they share: "
                                 f"{', '.join(sorted(entries)) or 'none'})")
            entries = {cfg.entry}
        if not entries:
            raise UsageError("the implementations share no entry point")
        self.entries = tuple(sorted(entries))
        runnable = set(runtime.runnable_dtypes())
        dtypes = set.intersection(runnable, *(set(i.capabilities.dtypes) for i in self.impls.values()))
        if cfg.dtypes:
            unknown = [d for d in cfg.dtypes if d not in dtypes]
            if unknown:
                raise UsageError(f"dtype {unknown[0]} cannot be judged here for every side "
                                 f"(runnable: {', '.join(sorted(dtypes)) or 'none'}; "
                                 f"{runtime.dtype_skip_reason(unknown[0]) or 'an implementation does not take it'})")
            dtypes = set(cfg.dtypes)
        if not dtypes:
            raise UsageError("no dtype runs here for every side")
        cfg.dtypes = tuple(d for d in ("float32", "float16", "bfloat16") if d in dtypes)
        has_backward = all(i.capabilities.backward for i in self.impls.values())
        if cfg.pass_ == "backward" and not has_backward:
            raise UsageError("--pass backward: an implementation has no backward")
        self.backward = {"forward": False, "backward": True, "mixed": None}[cfg.pass_] if has_backward else False
        self.bounds = cfg.bounds or (GPU_BOUNDS if cfg.device.startswith("cuda") else Bounds())
        # Block-size boundaries of every side's kernels (harness/sides/tiling.py), drawn at bounds.boundary_rate.
        found = {}
        for impl in self.impls.values():
            for b in tiling.boundaries(impl, cfg.device):
                found.setdefault((b.dim, b.value, b.block), b)
        self.boundaries = tuple(found[k] for k in sorted(found))
        # Natively, cases come from a rotating pool of compile keys (harness/campaign/pool.py; its entries only, and only
        # where a side has kernels to compile); interpreted, or with no kernels (a torch-only layer), freely.
        self.pool = None
        use_pool = (not runtime.interpreted()) if cfg.pool is None else cfg.pool
        if use_pool and any(i.kernel_modules() for i in self.impls.values()) and set(self.entries) <= POOLED_ENTRIES:
            mix = cfg.pool_mix or (Mix(huge=cfg.huge) if cfg.bounds is None else Mix(production=0.0))
            self.pool = Pool(self.entries, cfg.dtypes, self.bounds, self.boundaries, mix=mix,
                             seed=cfg.seed, fit=self.examiner.fit, backward=self.backward)
        if cfg.huge and (self.pool is None or cfg.pool_mix is not None or cfg.bounds is not None):
            raise UsageError("--huge draws production keys of the compile pool: natively (where the pool is on), "
                             "with the default sizes")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.out_dir = cfg.out_dir or os.path.join("ssdiff-out", f"fuzz-{stamp}")
        self.report = FuzzReport(config=cfg, out_dir=self.out_dir)
        if cfg.known != "ignore":
            for spec in self.examiner.sides:
                for defect in known.affecting(spec):
                    self.report.known.setdefault(defect.id, {
                        "id": defect.id, "implementations": list(defect.implementations),
                        "releases": defect.releases, "statement": defect.statement, "status": defect.status,
                        "reproduced": 0, "matched_not_reproduced": 0, "first_example": None})
        self._start = None
        self._stop_requested: Optional[str] = None
        self._progress_written = -PROGRESS_FILE_S
        self._signatures: dict = {}
        self._tuned_pending: list = []      # representatives judged under config 0, to be judged tuned
        self.compiler = None
        if self.pool is not None and cfg.compile_ahead:
            from ssdiff.campaign.precompile import Compiler

            self.compiler = Compiler(self.impls, cfg.device, cfg.autotune)

    # ---- known defects ------------------------------------------------------------------------------------

    def _note_known(self, outcome: Outcome) -> set:
        """Count what the registry explains in ``outcome``; return the sides whose divergence it explains."""
        explained = set()
        for side, v in outcome.verdicts.items():
            defect = known.matching(side, outcome.case) if self.config.known != "ignore" else None
            if defect is None:
                continue
            entry = self.report.known[defect.id]
            if v.ok:
                entry["matched_not_reproduced"] += 1
                continue
            if known.explanation(side, outcome, self.config.factor) is not defect:
                continue            # a divergence beyond what the defect accounts for: a finding of its own
            entry["reproduced"] += 1
            explained.add(side)
            if entry["first_example"] is None:
                entry.update(first_example=outcome.case.to_dict(), first_case=outcome.case.describe(),
                             first_side=side, first_message=v.message(), first_after_s=round(self._elapsed(), 2))
        return explained

    # ---- the campaign ------------------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return time.perf_counter() - self._start

    def _time_left(self, cap: float) -> float:
        """``cap`` seconds, or what is left of the time budget if less."""
        if self.config.max_time is None:
            return cap
        return min(cap, self.config.max_time - self._elapsed())

    def _out_of_budget(self) -> Optional[str]:
        cfg = self.config
        if self._stop_requested:
            return self._stop_requested
        if cfg.max_time is not None and self._elapsed() >= cfg.max_time:
            return f"time budget ({cfg.max_time:g} s) spent"
        if cfg.max_examples is not None and self.report.tried >= cfg.max_examples:
            return f"example budget ({cfg.max_examples}) spent"
        return None

    def _note_ratios(self, outcome: Outcome, explained: set = frozenset()):
        """The largest ratios so far and every required factor, of what no known defect explains (the ``explained``
        sides are left out)."""
        dtype = outcome.case.dtype
        for side, v in outcome.verdicts.items():
            if side in explained:
                continue
            key = f"{side} {dtype}"
            groups = self.report.required.setdefault(key, {group: array("d") for group in REQUIRED_GROUPS.values()})
            for group, _, required in required_factors(v, self.config.factor):
                groups[group].append(required)
            if not math.isfinite(v.ratio) or v.status not in ("ok", "diverged"):
                continue
            worst = v.worst()
            item = {"ratio": v.ratio, "side": side, "tensor": worst.name if worst else None,
                    "case": outcome.case.describe()}
            if v.ratio >= self.report.worst.get(dtype, {}).get("ratio", -1.0):
                self.report.worst[dtype] = item
            if v.ratio >= self.report.worst_by_side.get(key, {}).get("ratio", -1.0):
                self.report.worst_by_side[key] = item

    def _record(self, outcome: Outcome) -> Finding:
        """The finding of the outcome's signature: a new one (saved in its folder; without keep_going replayed
        with exact float32 dots where TF32 applies, then localized), or the earlier one, its repeats counted."""
        sig = outcome.signature()
        if sig in self._signatures:
            self._signatures[sig].repeats += 1
            return self._signatures[sig]
        loc = {"sides": localize.sides(outcome.verdicts, outcome.pair or None)}
        loc["text"] = loc["sides"]["text"]
        number = len(self.report.findings) + len(self.report.tf32_explained) + 1
        finding = Finding(number=number, outcome=outcome, localization=loc,
                          found_after_s=self._elapsed(), cases_before=self.report.tried - 1)
        self._signatures[sig] = finding
        self.report.findings.append(finding)
        if self.report.first_divergence_s is None:
            self.report.first_divergence_s = finding.found_after_s
        finding.path = str(self._write(finding))
        if not self.config.keep_going:
            self._replay_with_exact_dots(finding)
            if self.config.localize and not finding.tf32_replay:
                self._localize(finding)
                self._write(finding)
        return finding

    def _replay_with_exact_dots(self, finding: Finding) -> None:
        """A float32 finding under TF32 replayed with exact float32 dots (harness/investigate/tf32.py). Within budget there it
        moves from the findings to tf32_explained: TF32's loss, reported apart. Not replayed (the message keeps
        the hint) under a sweep of configs, another oracle or factor: `ssdiff replay` runs one config and judges
        with the default oracle and factor. Nor where a side's run failed (error, crash, hang): TF32 moves numbers,
        and the replay runs in-process, where a hang holds it for the replay's whole timeout."""
        cfg, o = self.config, finding.outcome
        if finding.tf32_replay is not None or not tf32.applies(o.case, cfg.device) or o.choice == "sweep" \
                or cfg.factor != FACTOR or cfg.oracle != truth.DEFAULT_ORACLE \
                or any(v.status in RUN_FAILURES for v in o.verdicts.values()):
            return
        said = tf32.replay(cfg.impl, o.case, o.choice, cfg.device, finding.path, cfg.against)
        finding.tf32_replay = said or ""
        if said:
            self.report.findings.remove(finding)
            self.report.tf32_explained.append(finding)
            self.report.first_divergence_s = min((f.found_after_s for f in self.report.findings), default=None)
            folder = store.tf32_folder(self.out_dir, finding.number)
            shutil.rmtree(folder, ignore_errors=True)
            finding.path = str(shutil.move(finding.path, folder))
        self._write(finding)

    def _localize(self, finding: Finding) -> None:
        """Stage, coordinates, trigger (harness/investigate/localize.py): re-runs with stages, ablations, configs. With
        keep_going it runs after the search, as minimization does: natively each ablation is a new kernel
        specialization compiled on the spot, and localizing one divergence in the middle of a campaign took
        its whole time budget (an H200 layer campaign: 11 cases judged in 165 s)."""
        try:
            finding.localization, finding.staged = localize.investigate(
                self.examiner, finding.outcome, self.config.ablation_runs,
                explore_configs=self.config.autotune != "tuned")
        except runtime.DeviceOutOfMemory as err:        # the machine's limit: the divergence stands, unlocalized
            finding.localization, finding.staged = {"text": f"not localized: {err}"}, {}

    def _write(self, finding: Finding):
        o = finding.outcome
        folder = finding.path or store.divergence_folder(self.out_dir, finding.number)
        return store.write_divergence(
            folder, o.case, o.verdicts, self.message(finding),
            finding.localization, finding.staged, autotune=o.choice, device=self.config.device,
            runtime=runtime.describe(), oracle=self.config.oracle, budget_rule=budget_rule(self.config.factor),
            pair_ratio_by_tensor=o.pair, found_after_s=round(finding.found_after_s, 2),
            cases_before=finding.cases_before)

    def message(self, finding: Finding) -> str:
        o = finding.outcome
        lines = [f"divergence {finding.number}: {o.case.describe()}"]
        for v in o.verdicts.values():
            lines.append(v.message())
        if o.pair:
            worst = max(o.pair.items(), key=lambda kv: kv[1] if math.isfinite(kv[1]) else 1e308)
            lines.append(f"the two sides differ by up to {worst[1]:.3g}x their joint budget ({worst[0]})")
        lines.append(finding.localization.get("text", ""))
        if finding.tf32_replay:
            lines.append(f"replayed with exact float32 dots (TRITON_F32_DEFAULT=ieee): {finding.tf32_replay} The "
                         f"loss is TF32's ({tf32.LIMIT})")
        elif finding.tf32_replay == "":
            lines.append("replayed with exact float32 dots (TRITON_F32_DEFAULT=ieee): still out of budget, so not "
                         "TF32's loss")
        else:
            hint = tf32.hint(o.case, self.config.device)
            if hint:
                lines.append(hint)
        return "\n".join(lines)

    def _write_summary(self):
        store.write_summary(self.out_dir, self.report.summary())

    def _progress(self, last: Optional[Outcome]):
        """Tell ``progress`` where the campaign stands, and (every PROGRESS_FILE_S) write it to progress.json
        in the output folder, for whoever watches a long run (`ssdiff fuzz --jobs` merges its jobs' lines)."""
        r = self.report
        elapsed = self._elapsed()
        state = {"tried": r.tried, "skipped": r.skipped, "elapsed": elapsed,
                 "per_minute": 60.0 * r.tried / elapsed if elapsed > 0 else 0.0,
                 "max_time": self.config.max_time, "max_examples": self.config.max_examples,
                 "worst": r.worst, "divergences": len(r.findings),
                 "known": sum(k["reproduced"] for k in r.known.values()),
                 "ahead": self.compiler.progress() if self.compiler else None,
                 "last": last.case.describe() if last else None}
        if elapsed - self._progress_written >= PROGRESS_FILE_S:
            self._progress_written = elapsed
            store.write_progress(self.out_dir, state)
        if self.progress is not None:
            self.progress(state)

    def request_stop(self, why: str = "interrupted") -> None:
        """End the search after the case being judged (a signal handler may call it): the summary and the
        report are written as for a spent budget."""
        self._stop_requested = why

    def _minimize(self, finding: Finding):
        """Shrink one finding in its folder (minimized.json, minimized-verdict.json, repro.py). A run that
        crashed or hung is not minimized (every candidate would cost a child process or a timeout)."""
        from ssdiff.investigate.minimize import NotDiverging, minimize_outcome

        if any(v.status in PROCESS_FAILURES for v in finding.outcome.verdicts.values()):
            finding.minimize_problem = "not minimized: a side crashed or hung"
            return
        start = time.perf_counter()
        try:
            finding.minimized = minimize_outcome(self.examiner, finding.outcome, finding.path,
                                                 max_runs=self.config.minimize_runs)
        except (NotDiverging, runtime.DeviceOutOfMemory) as exc:
            finding.minimize_problem = str(exc)
        finding.minimize_seconds = time.perf_counter() - start

    def _judge(self, case, choice, target=None) -> bool:
        """Fit, judge and record one drawn case; True when the campaign should stop (a divergence found)."""
        cfg = self.config
        fitted = self.examiner.fit(case)
        reason = None
        if fitted is None:
            reason = next(iter(self.examiner.skip_reasons(case)), "outside the capabilities")
        elif cfg.known == "skip":
            # where a record bounds its error (harness/registry/known.py, `KnownDefect.bounds`) it explains part of a verdict,
            # never a case
            defect = next((d for d in (known.matching(s, fitted) for s in self.examiner.sides)
                           if d is not None and not d.bounds(fitted)), None)
            reason = f"known defect {defect.id} (--known skip)" if defect else None
        if reason:
            self.report.skipped += 1
            self.report.skip_reasons[reason] = self.report.skip_reasons.get(reason, 0) + 1
            return False
        try:
            outcome = self.examiner.examine(fitted, choice)
        except runtime.DeviceOutOfMemory as err:
            # the machine's limit (other processes on the device, a case too large for what is free): the case
            # is not judged, and the summary counts it under what ran out
            reason = str(err).split(":", 1)[0]
            runtime.release_memory()
            self.report.skipped += 1
            self.report.skip_reasons[reason] = self.report.skip_reasons.get(reason, 0) + 1
            return False
        except Exception as err:
            # The harness itself (oracle, baseline, judge) failed on this case: a bug of ours, recorded
            # with the case so it can be replayed, and the search goes on.
            from ssdiff.sides.runner import short_error

            self.report.harness_errors.append({"case": fitted.to_dict(), "error": short_error(err)})
            return False
        self.report.tried += 1
        if self.report.first_judged_s is None:
            self.report.first_judged_s = self._elapsed()
        production = at_production_shape(fitted)
        self.report.production_cases += production
        tally = self.report.case_seconds.setdefault("production" if production else "other",
                                                    dict.fromkeys(("cases", "examine", *PHASES), 0.0))
        tally["cases"] += 1
        tally["examine"] += outcome.seconds
        for phase in PHASES:
            tally[phase] += outcome.phases.get(phase, 0.0)
        explained = self._note_known(outcome)
        self._note_ratios(outcome, explained)
        if self.observe is not None:
            self.observe(outcome)
        # Known defects do not steer the search: it climbs toward the largest error nothing explains.
        ratio = outcome.worst_ratio(excluding=explained)
        if target is not None:
            target(math.log10(max(ratio, 1e-12)) if math.isfinite(ratio) else 12.0, label="log10 ratio to budget")
        if set(outcome.failing) - explained:
            finding = self._record(outcome)
            self._write_summary()
            if not cfg.keep_going and not finding.tf32_replay:
                self._progress(outcome)
                return True
        self._progress(outcome)
        return False

    def _compile_ahead(self, keys) -> None:
        """Natively: compile the keys' representative cases in worker processes (harness/campaign/precompile.py), in the
        order they are judged (`_representatives_of`)."""
        if self.compiler is None:
            return
        # not a huge key's: each worker would draw the whole case (harness/inputs/huge.py)
        self.compiler.submit([case for case, _ in self._representatives_of(keys) if not huge.is_huge(case)])

    def _representatives_of(self, keys) -> list:
        """(case, the config it is judged under) of each key's representatives: forward ones first, then backward
        ones, production shapes last in each (the cheapest verdicts first)."""
        backward = (False, True) if self.backward is None else (self.backward,)
        cfg, reps = self.config, []
        for key in keys:
            choice = key.boundary.config if key.boundary is not None and cfg.autotune in ("tuned", "random") \
                else (0 if cfg.autotune == "random" else cfg.autotune)
            # one case for both passes where the key's cases are forward only (a decoded layer)
            reps += [(case, choice, key.kind in ("production", "huge"))
                     for case in dict.fromkeys(key.case(backward=b) for b in backward)]
        return [(case, choice) for case, choice, _ in sorted(reps, key=lambda rep: (rep[0].backward, rep[2]))]

    def _representatives(self, keys) -> bool:
        """Judge each key's representative case first (what was compiled ahead); True when a divergence stops
        the campaign. Where cases are compiled ahead, each representative is judged as soon as the config it runs
        under is in (the workers compile every case's config 0 first, then config 1, ...; while the workers are
        still starting, this process compiles it instead): one to be judged tuned whose configs are not all in
        yet is judged under config 0 and waits, unjudged tuned, in `_tuned_pending` (`_judge_tuned_pending`). In
        `_representatives_of`' order: a cold campaign's first verdicts are its cheapest, and none waits for every
        config of every kernel."""
        reps = self._representatives_of(keys)
        later = [] if self.compiler is not None else reps
        for case, choice in (reps if self.compiler is not None else []):
            if choice == "sweep" or (choice == "tuned" and self.compiler.wait(case, 0)):
                later.append((case, choice))    # every config: judged once all are in (or all are in already)
                continue
            if choice == "tuned":
                self._tuned_pending.append(case)
            first = 0 if choice == "tuned" else choice
            if self.compiler.ready():
                self._wait_for_workers(case, index=first)
            # else the workers are still starting (spawning, importing): compiled here, sooner; the job, when a
            # worker gets to it, finds the variants on disk
            if self._out_of_budget():           # a wait ends with the budget: no case is begun after it
                return False
            if self._judge(case, first):
                return True
        for case, choice in later:
            if self.compiler is not None:
                self._wait_for_workers(case)
            if self._out_of_budget():
                return False
            if self._judge(case, choice):
                return True
        return False

    def _wait_for_workers(self, case, index=None) -> None:
        """Wait (at most COMPILE_WAIT_S, or what is left of the budget) for the workers' jobs of ``case`` (those of
        config ``index`` alone when given), the time counted in the throughput's compile_wait_s."""
        start = time.perf_counter()
        self.compiler.wait(case, self._time_left(COMPILE_WAIT_S), index=index)
        self.report.compile_wait_s += time.perf_counter() - start

    def _judge_tuned_pending(self) -> bool:
        """Judge tuned the representatives judged under config 0 whose every config is in by now (between
        rounds); True when a divergence stops the campaign."""
        for case in [c for c in self._tuned_pending if self.compiler.wait(c, 0)]:
            self._tuned_pending.remove(case)
            if self._out_of_budget():
                return False
            if self._judge(case, "tuned"):
                return True
        return False

    def _choice_for(self, key, case, choice):
        """The config a drawn case of ``key`` runs under: a boundary key's under its config; a tuned one under
        config 0 while its key's representative is still compiling (tuned, a case in this process would compile
        every config of every kernel itself first), and counted (`FuzzReport.untuned_while_compiling`)."""
        cfg = self.config
        if key is not None and key.boundary is not None and cfg.autotune in ("tuned", "random"):
            return key.boundary.config          # the config whose block this case straddles
        if choice == "tuned" and key is not None and self.compiler is not None \
                and not self.compiler.wait(key.case(backward=case.backward), 0):
            self.report.untuned_while_compiling += 1
            return 0
        return choice

    def run(self) -> FuzzReport:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis import strategies as st
        from hypothesis import target

        cfg = self.config
        self._start = time.perf_counter()
        self.report.setup_s = self._start - self._created
        os.makedirs(self.out_dir, exist_ok=True)
        if cfg.autotune == "random":
            choices = st.integers(0, 7)
        else:
            choices = st.just(cfg.autotune)
        entry = self.entries[0] if len(self.entries) == 1 else None

        def strategy(key):
            """(case, boundary or None, choice, key or None): from a compile key of the round, or drawn freely."""
            if key is not None:
                return st.tuples(cases(key=key, bounds=self.bounds, backward=self.backward), st.just(key.boundary),
                                 choices, st.just(key))
            return maybe_boundary(self.boundaries, self.bounds.boundary_rate).flatmap(lambda b: st.tuples(
                cases(entry=entry, dtypes=cfg.dtypes, bounds=self.bounds, backward=self.backward, boundary=b),
                st.just(b), choices, st.none()))

        class Stop(Exception):
            pass

        stop_reason = []

        def explore(drawn):
            if stop_reason:
                raise Stop()
            why = self._out_of_budget()
            if why:
                stop_reason.append(why)
                raise Stop()
            case, boundary, choice, key = drawn
            if case.entry not in self.entries:
                return
            if key is not None:
                choice = self._choice_for(key, case, choice)
            elif boundary is not None and cfg.autotune in ("tuned", "random"):
                choice = boundary.config        # the config whose block this case straddles
            if self._judge(case, choice, target):
                stop_reason.append("divergence found")
                raise Stop()

        def search(max_examples: int, seed, targeted: bool = True, key=None):
            test = given(strategy(key))(explore)
            test = settings(max_examples=max_examples, deadline=None, database=None,
                            phases=[Phase.generate, Phase.target] if targeted else [Phase.generate],
                            suppress_health_check=list(HealthCheck), print_blob=False,
                            report_multiple_bugs=False)(test)
            if seed is not None:
                test = hypothesis_seed(seed)(test)
            try:
                test()
            except Stop:
                pass

        try:
            if self.pool is not None:
                # Every key and the next round's compiled ahead, not waited for: this process compiles what it
                # needs before the workers have it (a cold cache) or loads it from disk (warm), and the workers'
                # variants are on disk by the time it asks for them. Each key's representative case first.
                self._compile_ahead(self.pool.keys)
                self._compile_ahead(self.pool.ahead(COMPILE_AHEAD_ROUNDS))
                if self._representatives(self.pool.keys):
                    stop_reason.append("divergence found")
            if stop_reason:
                pass
            elif cfg.max_examples is not None and self.pool is None:
                search(cfg.max_examples, cfg.seed)
            else:
                # A time budget alone, or a compile pool: rounds of ROUND_EXAMPLES, each a fresh search (seeded from the campaign's
                # seed and the round), until the budget is spent, alternating plain generation with targeted
                # search. Hypothesis draws a search's first tenth of examples (at most 50) small, and once a
                # target is observed its mutations toward it crowd out fresh draws (2 of 100 drawn cases had
                # ngroups > 1 with rmsnorm, against 18 without targeting): one unbounded targeted search would
                # spend a CPU campaign near its first cases.
                # With a compile pool a round is one search per key (`round_shares`), and one key is swapped
                # between rounds.
                idle = 0
                for round_ in itertools.count():
                    examples = ROUND_EXAMPLES if cfg.max_examples is None else \
                        min(ROUND_EXAMPLES, cfg.max_examples - self.report.tried)
                    if examples <= 0:               # the keys' representative cases spent the example budget
                        break
                    before = self.report.tried
                    if self.compiler is not None and self._judge_tuned_pending():
                        stop_reason.append("divergence found")
                        break
                    if self.pool is None:
                        search(examples, None if cfg.seed is None else cfg.seed + round_, targeted=round_ % 2 == 1)
                    else:
                        for slot, key, share in round_shares(self.pool.keys, examples, round_):
                            search(share, None if cfg.seed is None else f"{cfg.seed}/{round_}/{slot}",
                                   targeted=round_ % 2 == 1, key=key)
                            if stop_reason or self._out_of_budget():
                                break
                    if stop_reason or self._out_of_budget():
                        break
                    idle = idle + 1 if self.report.tried == before else 0
                    if idle >= 5:
                        stop_reason.append("five rounds judged no case (every drawn case was skipped)")
                        break
                    if self.pool is not None:
                        new = self.pool.upcoming
                        self.pool.rotate()
                        # the one key now planned COMPILE_AHEAD_ROUNDS rotations ahead (the others are queued)
                        self._compile_ahead(self.pool.ahead(COMPILE_AHEAD_ROUNDS)[-1:])
                        if self._representatives([new]):
                            stop_reason.append("divergence found")
                            break
            self.report.search_s = self._elapsed()
            if not stop_reason:
                stop_reason.append(self._out_of_budget() or "Hypothesis finished its examples")
            self.report.stopped = stop_reason[0]
            if cfg.keep_going:
                for finding in list(self.report.findings):
                    self._replay_with_exact_dots(finding)
                self._write_summary()
            if cfg.localize and cfg.keep_going:
                for finding in self.report.findings:
                    self._localize(finding)
                    self._write(finding)
                self._write_summary()
            if cfg.minimize:
                for finding in self.report.findings:
                    self._minimize(finding)
        finally:
            self.report.search_s = self.report.search_s or self._elapsed()
            if self.compiler is not None:
                self.compiler.close()
            self.examiner.close()
            self.report.elapsed = self._elapsed()
            self.report.stopped = self.report.stopped or "interrupted"
            self._write_summary()
        if cfg.report_dir:
            from ssdiff.report import render_run

            self.report.report_path = str(render_run(self.out_dir, cfg.report_dir))
        return self.report


__all__ = ["FuzzConfig", "Fuzzer", "FuzzReport", "Finding", "Outcome", "UsageError"]
