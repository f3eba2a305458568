"""`ssdiff fuzz`: Hypothesis searches for a case on which an implementation diverges from the float64 oracle
(or from another implementation), judges every case with the noise-floor verdict (harness/verdict.py),
localizes each divergence (harness/localize.py) and writes it as case.json + verdict.json.

    report = Fuzzer(FuzzConfig(impl="mamba_ssm.split_conv1d_combined",
                               against="mamba_ssm.split_conv1d_ref", max_time=300)).run()

The search is a Hypothesis property (`cases()` from harness/strategies.py, one autotune config index drawn
per case when asked) with ``hypothesis.target`` on log10 of the case's worst ratio, so that with an example
budget the second half of it climbs toward larger errors. It stops at the first divergence unless
``keep_going`` (then divergences are bucketed by which side fails, how, and in which tensors), at the time
budget, or at the example budget. Cases outside an implementation's capabilities are first fitted (the
features it cannot express switched off: the same simplifications localization uses) and skipped, with the
reason counted, when that is not enough.

Output directory: summary.json (the configuration, the runtime, cases tried and skipped, the largest ratio
seen per dtype and per side, time to the first divergence, the divergences) and one folder per divergence,
divergence-NNN/ with case.json (replayable), verdict.json (every side's verdict, tensor by tensor, the pair's
disagreement, the localization), message.txt (the same in words) and error_maps.json (the error maps,
harness/report/maps.py). The run's HTML report goes to <report_dir>/<out_dir's name>/index.html (harness/report).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Optional

from harness import baseline, localize, oracle, runtime
from harness.case import Case
from harness.inputs import materialize
from harness.isolate import InProcessRunner, IsolatedRunner, RunResult, resolve
from harness.localize import fit_case
from harness.report.environment import environment
from harness.report.maps import error_maps
from harness.strategies import Bounds, cases
from harness.verdict import FACTOR, Verdict, disagreement, failed_run, judge, severity

PASSES = ("forward", "backward", "mixed")
AUTOTUNE_POLICIES = ("tuned", "random", "sweep")

# Larger shapes where kernels run natively (the float64 oracle on a GPU keeps up).
GPU_BOUNDS = Bounds(max_batch=2, max_seqlen=300, max_nheads=12, max_headdim=64, max_dstate=64,
                    chunk_sizes=(16, 32, 64, 128, 256))


class UsageError(ValueError):
    """The fuzz configuration cannot run (unknown implementation, nothing in common, ...): exit status 2."""


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
    seed: Optional[int] = None
    localize: bool = True
    bounds: Optional[Bounds] = None
    oracle: str = oracle.DEFAULT_ORACLE
    factor: float = FACTOR
    ablation_runs: Optional[int] = None
    # The HTML report goes to <report_dir>/<out_dir's name>/index.html (harness/report); None: no report.
    report_dir: Optional[str] = field(default_factory=lambda: os.environ.get("SSDIFF_REPORTS") or "reports")


@dataclass
class Outcome:
    """One case examined: each side's verdict (and outputs), the pair's disagreement, the config used."""

    case: Case
    choice: object
    verdicts: dict
    outputs: dict
    launches: dict
    pair: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def diverged(self) -> bool:
        return any(not v.ok for v in self.verdicts.values())

    def signature(self) -> tuple:
        """Which side fails, how, and in which tensors: divergences with one signature are one bucket."""
        sig = []
        for side, v in self.verdicts.items():
            if not v.ok:
                sig.append((side, v.status, tuple(sorted(t.name for t in v.failing if t.kind != "stage"))))
        return tuple(sig)

    def worst_ratio(self) -> float:
        finite = [v.ratio for v in self.verdicts.values() if math.isfinite(v.ratio)]
        return max(finite, default=0.0)


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
    elapsed: float = 0.0
    stopped: str = ""
    first_divergence_s: Optional[float] = None
    report_path: Optional[str] = None

    @property
    def exit_code(self) -> int:
        return 1 if self.findings else 0

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
            "largest_ratio_by_dtype": self.worst, "largest_ratio_by_side": self.worst_by_side,
            "divergences": [{"number": f.number, "path": f.path, "signature": _sig_text(f.outcome.signature()),
                             "repeats": f.repeats, "found_after_s": round(f.found_after_s, 2),
                             "cases_before": f.cases_before, "case": f.outcome.case.describe(),
                             "summary": f.localization.get("text", "")} for f in self.findings],
            "python": platform.python_version(), "platform": platform.platform(),
            "environment": environment(cfg.device),
        }


def _sig_text(sig) -> str:
    return "; ".join(f"{side}: {status}" + (f" in {', '.join(names)}" if names else "") for side, status, names in sig)


class Fuzzer:
    """Runs one fuzz campaign. ``progress(state: dict)`` is called after every case."""

    def __init__(self, config: FuzzConfig, progress: Optional[Callable[[dict], None]] = None):
        self.config = config
        self.progress = progress
        runtime.configure()
        cfg = config
        cfg.device = cfg.device or runtime.default_device()
        try:
            self.impls = {cfg.impl: resolve(cfg.impl)}
            if cfg.against:
                self.impls[cfg.against] = resolve(cfg.against)
        except KeyError as err:
            raise UsageError(str(err)) from None
        for spec, impl in self.impls.items():
            why = impl.unavailable()
            if why:
                raise UsageError(f"{spec} cannot run here: {why}")
        if cfg.pass_ not in PASSES:
            raise UsageError(f"--pass must be one of {', '.join(PASSES)}, got {cfg.pass_!r}")
        if not (cfg.autotune in AUTOTUNE_POLICIES or (isinstance(cfg.autotune, int) and cfg.autotune >= 0)):
            raise UsageError(f"--autotune must be tuned, random, sweep or a config index, got {cfg.autotune!r}")
        if cfg.max_time is None and cfg.max_examples is None:
            raise UsageError("give a time budget or an example budget (or both)")
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
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.out_dir = cfg.out_dir or os.path.join("ssdiff-out", f"fuzz-{stamp}")
        self.runner = IsolatedRunner(cfg.device, cfg.timeout) if cfg.isolate else InProcessRunner(cfg.device)
        self.report = FuzzReport(config=cfg, out_dir=self.out_dir)
        self._start = None
        self._signatures: dict = {}
        self._staged: dict = {}

    # ---- one case ----------------------------------------------------------------------------------------

    def sides(self) -> list:
        return list(self.impls)

    def examine(self, case: Case, choice="tuned", want_stages: bool = False, sides=None) -> Outcome:
        """Run every side (or ``sides``) on ``case`` and judge each against the oracle."""
        start = time.perf_counter()
        device = self.config.device
        inputs = materialize(case, device)
        truth = oracle.evaluate(case, inputs, self.config.oracle)
        base = baseline.evaluate_samples(case, inputs, truth=truth)
        verdicts, outputs, launches = {}, {}, {}
        for spec in sides or self.sides():
            if choice == "sweep":
                verdicts[spec], outputs[spec], launches[spec] = self._examine_sweep(spec, case, inputs, truth, base,
                                                                                     want_stages)
                continue
            rr = self.runner.run(spec, case, want_stages, choice)
            launches[spec] = rr.launches
            if rr.status != "ok":
                verdicts[spec] = failed_run(spec, rr.status, rr.detail, rr.seconds)
                continue
            outputs[spec] = rr.outputs
            verdicts[spec] = judge(spec, case, inputs, rr.outputs, truth, base, stages=want_stages,
                                   factor=self.config.factor, seconds=rr.seconds)
        pair = {}
        if len(outputs) == 2:
            a, b = (outputs[s] for s in self.sides())
            pair = disagreement(case, inputs, a, b, truth, base, self.config.factor)
        return Outcome(case, choice, verdicts, outputs, launches, pair, time.perf_counter() - start)

    def _examine_sweep(self, spec, case, inputs, truth, base, want_stages):
        worst_v, worst_o, worst_l, index, needed = None, None, [], 0, 1
        while index < needed:
            rr = self.runner.run(spec, case, want_stages, index)
            if rr.status != "ok":
                return failed_run(spec, rr.status, f"(autotune config index {index}) {rr.detail}", rr.seconds), None, \
                    rr.launches
            v = judge(spec, case, inputs, rr.outputs, truth, base, stages=want_stages, factor=self.config.factor,
                      seconds=rr.seconds)
            v.notes.append(f"autotune config index {index}")
            if worst_v is None or (severity(v.status), v.ratio) > (severity(worst_v.status), worst_v.ratio):
                worst_v, worst_o, worst_l = v, rr.outputs, rr.launches
            needed = max([needed] + [n for _, _, n, _ in rr.launches])
            index += 1
        return worst_v, worst_o, worst_l

    # ---- localization ------------------------------------------------------------------------------------

    def investigate(self, outcome: Outcome) -> dict:
        """Localize a divergence: sides, stages, coordinates, autotune configs, feature trigger."""
        case, choice = outcome.case, outcome.choice
        failing = {s: v for s, v in outcome.verdicts.items() if not v.ok}
        self._staged = {}
        result = {"sides": localize.sides(outcome.verdicts, outcome.pair or None)}
        texts = [result["sides"]["text"]]
        if not self.config.localize:
            result["text"] = "\n".join(texts)
            return result

        def same(candidate: Case) -> bool:
            try:
                again = self.examine(candidate, choice if choice != "sweep" else "tuned", sides=list(failing))
            except Exception:           # a case the oracle or the baseline cannot take: not the same divergence
                return False
            for spec, original in failing.items():
                v = again.verdicts.get(spec)
                if v is None or v.ok:
                    return False
                if original.status in ("error", "crash", "hang") or v.status in ("error", "crash", "hang"):
                    if v.status != original.status:
                        return False
                    continue
                before = {t.name for t in original.failing if t.kind != "stage"}
                after = {t.name for t in v.failing if t.kind != "stage"}
                if not before & after:
                    return False
            return True

        hang = any(v.status == "hang" for v in failing.values())
        trigger = None
        if not hang:
            trigger = localize.minimal_trigger(case, same, self.config.ablation_runs)
            result["features"] = trigger
        per_side = {}
        for spec, v in failing.items():
            entry: dict = {}
            if v.status in ("diverged", "nonfinite", "mismatch"):
                staged = self.examine(case, choice if choice != "sweep" else "tuned", want_stages=True,
                                      sides=[spec]).verdicts[spec]
                if staged.status in ("error", "crash", "hang"):
                    staged = v
                self._staged[spec] = staged
                st = localize.stages(staged, trigger["trigger"] if trigger else None)
                entry["stages"] = st
                coords = []
                primary = localize.describe_primary(staged, st)
                if primary is not None:
                    coords.append(localize.coordinates(primary, case))
                worst_out = localize.describe_primary(staged, None)
                if worst_out is not None and (primary is None or worst_out.name != primary.name):
                    coords.append(localize.coordinates(worst_out, case))
                entry["coordinates"] = coords
                if self._explores_configs(outcome.launches.get(spec, [])):
                    entry["configs"] = self._config_sweep(spec, case)
            per_side[spec] = entry
        result["per_side"] = per_side
        for spec, entry in per_side.items():
            prefix = f"{spec}: " if len(self.impls) > 1 else ""
            if "stages" in entry:
                texts.append(prefix + entry["stages"]["text"])
            for c in entry.get("coordinates", []):
                texts.append(prefix + "where: " + c["text"])
            if "configs" in entry:
                texts.append(prefix + entry["configs"]["text"])
        if trigger:
            texts.append(trigger["text"])
            texts.append(f"minimal case: {trigger['minimal_case_description']}")
        result["text"] = "\n".join(texts)
        return result

    def _explores_configs(self, launches) -> bool:
        return self.config.autotune != "tuned" and any(n > 1 for _, _, n, _ in launches)

    def _config_sweep(self, spec, case) -> dict:
        per_index, index, needed = [], 0, 1
        while index < needed and index < 16:
            out = self.examine(case, index, sides=[spec])
            per_index.append((index, not out.verdicts[spec].ok, out.launches.get(spec, [])))
            needed = max([needed] + [n for _, _, n, _ in out.launches.get(spec, [])])
            index += 1
        return localize.configs(per_index)

    # ---- the campaign ------------------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return time.perf_counter() - self._start

    def _out_of_budget(self) -> Optional[str]:
        cfg = self.config
        if cfg.max_time is not None and self._elapsed() >= cfg.max_time:
            return f"time budget ({cfg.max_time:g} s) spent"
        if cfg.max_examples is not None and self.report.tried >= cfg.max_examples:
            return f"example budget ({cfg.max_examples}) spent"
        return None

    def _note_ratios(self, outcome: Outcome):
        dtype = outcome.case.dtype
        for side, v in outcome.verdicts.items():
            if not math.isfinite(v.ratio) or v.status not in ("ok", "diverged"):
                continue
            worst = v.worst()
            item = {"ratio": v.ratio, "side": side, "tensor": worst.name if worst else None,
                    "case": outcome.case.describe()}
            if v.ratio >= self.report.worst.get(dtype, {}).get("ratio", -1.0):
                self.report.worst[dtype] = item
            key = f"{side} {dtype}"
            if v.ratio >= self.report.worst_by_side.get(key, {}).get("ratio", -1.0):
                self.report.worst_by_side[key] = item

    def _record(self, outcome: Outcome) -> Optional[Finding]:
        sig = outcome.signature()
        if sig in self._signatures:
            finding = self._signatures[sig]
            finding.repeats += 1
            return None
        loc = self.investigate(outcome)
        finding = Finding(number=len(self.report.findings) + 1, outcome=outcome, localization=loc,
                          found_after_s=self._elapsed(), cases_before=self.report.tried - 1,
                          staged=dict(self._staged))
        self._signatures[sig] = finding
        self.report.findings.append(finding)
        if self.report.first_divergence_s is None:
            self.report.first_divergence_s = finding.found_after_s
        finding.path = self._write(finding)
        return finding

    def _write(self, finding: Finding) -> str:
        folder = os.path.join(self.out_dir, f"divergence-{finding.number:03d}")
        os.makedirs(folder, exist_ok=True)
        o = finding.outcome
        with open(os.path.join(folder, "case.json"), "w", encoding="utf-8") as fh:
            fh.write(o.case.to_json() + "\n")
        message = self.message(finding)
        record = {
            "case": o.case.to_dict(), "case_description": o.case.describe(), "autotune": o.choice,
            "device": self.config.device, "runtime": runtime.describe(), "oracle": self.config.oracle,
            "budget_rule": f"per element: {self.config.factor:g} x (the largest error of the same-precision "
                           f"baseline samples in its cell (batch row, chunk, head) + unit roundoff x (|expected| + "
                           f"the cell's mean |expected|))",
            "verdicts": {s: v.to_dict() for s, v in o.verdicts.items()},
            "pair_ratio_by_tensor": {k: (v if math.isfinite(v) else str(v)) for k, v in o.pair.items()},
            "localization": _jsonable(finding.localization),
            "found_after_s": round(finding.found_after_s, 2), "cases_before": finding.cases_before,
            "message": message,
        }
        with open(os.path.join(folder, "verdict.json"), "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2)
            fh.write("\n")
        with open(os.path.join(folder, "message.txt"), "w", encoding="utf-8") as fh:
            fh.write(message + "\n")
        with open(os.path.join(folder, "error_maps.json"), "w", encoding="utf-8") as fh:
            json.dump(_jsonable(error_maps(o.case, {**o.verdicts, **finding.staged})), fh)
            fh.write("\n")
        return folder

    def message(self, finding: Finding) -> str:
        o = finding.outcome
        lines = [f"divergence {finding.number}: {o.case.describe()}"]
        for v in o.verdicts.values():
            lines.append(v.message())
        if o.pair:
            worst = max(o.pair.items(), key=lambda kv: kv[1] if math.isfinite(kv[1]) else 1e308)
            lines.append(f"the two sides differ by up to {worst[1]:.3g}x their joint budget ({worst[0]})")
        lines.append(finding.localization.get("text", ""))
        return "\n".join(lines)

    def _write_summary(self):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(_jsonable(self.report.summary()), fh, indent=2)
            fh.write("\n")

    def _progress(self, last: Optional[Outcome]):
        if self.progress is None:
            return
        r = self.report
        self.progress({"tried": r.tried, "skipped": r.skipped, "elapsed": self._elapsed(),
                       "max_time": self.config.max_time, "max_examples": self.config.max_examples,
                       "worst": r.worst, "divergences": len(r.findings),
                       "last": last.case.describe() if last else None})

    def run(self) -> FuzzReport:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis import strategies as st
        from hypothesis import target

        cfg = self.config
        self._start = time.perf_counter()
        os.makedirs(self.out_dir, exist_ok=True)
        impls = list(self.impls.values())
        if cfg.autotune == "random":
            choices = st.integers(0, 7)
        else:
            choices = st.just(cfg.autotune)
        strategy = st.tuples(cases(entry=self.entries[0] if len(self.entries) == 1 else None, dtypes=cfg.dtypes,
                                   bounds=self.bounds, backward=self.backward), choices)

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
            case, choice = drawn
            if case.entry not in self.entries:
                return
            fitted = fit_case(case, impls, cfg.device)
            if fitted is None:
                reason = next((i.skip_reason(case, cfg.device) for i in impls if i.skip_reason(case, cfg.device)),
                              "outside the capabilities")
                self.report.skipped += 1
                self.report.skip_reasons[reason] = self.report.skip_reasons.get(reason, 0) + 1
                return
            try:
                outcome = self.examine(fitted, choice)
            except Exception as err:
                # The harness itself (oracle, baseline, judge) failed on this case: a bug of ours, recorded
                # with the case so it can be replayed, and the search goes on.
                from harness.isolate import short_error

                self.report.harness_errors.append({"case": fitted.to_dict(), "error": short_error(err)})
                return
            self.report.tried += 1
            self._note_ratios(outcome)
            ratio = outcome.worst_ratio()
            target(math.log10(max(ratio, 1e-12)) if math.isfinite(ratio) else 12.0, label="log10 ratio to budget")
            if outcome.diverged:
                self._record(outcome)
                self._write_summary()
                if not cfg.keep_going:
                    stop_reason.append("divergence found")
                    self._progress(outcome)
                    raise Stop()
            self._progress(outcome)

        test = given(strategy)(explore)
        test = settings(max_examples=cfg.max_examples if cfg.max_examples is not None else 10 ** 9,
                        deadline=None, database=None, phases=[Phase.generate, Phase.target],
                        suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False)(test)
        if cfg.seed is not None:
            test = hypothesis_seed(cfg.seed)(test)
        try:
            test()
            if not stop_reason:
                stop_reason.append(self._out_of_budget() or "Hypothesis finished its examples")
        except Stop:
            pass
        finally:
            self.runner.close()
            self.report.elapsed = self._elapsed()
            self.report.stopped = stop_reason[0] if stop_reason else "interrupted"
            self._write_summary()
        if cfg.report_dir:
            from harness.report import render_run

            self.report.report_path = str(render_run(self.out_dir, cfg.report_dir))
        return self.report


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


__all__ = ["FuzzConfig", "Fuzzer", "FuzzReport", "Finding", "Outcome", "UsageError", "resolve", "fit_case"]
