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

With a shared example database (``example_db``, harness/campaign/cluster.py) its divergent cases of these sides are
judged before any new case, and each new divergence's case is saved there.

The output directory is a saved run (harness/store.py); the HTML report goes to
<report_dir>/<out_dir's name>/index.html (harness/report).
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import time
from datetime import datetime
from typing import Callable, Optional

from ssdiff import runtime, store
from ssdiff.campaign.config import GPU_BOUNDS, FuzzConfig, plan
from ssdiff.campaign.results import Finding, FuzzReport
from ssdiff.campaign.schedule import (COMPILE_AHEAD_ROUNDS, ROUND_EXAMPLES, Budget, Schedule, round_shares)
from ssdiff.examine import Examiner, Outcome, UsageError
from ssdiff.investigate import localize, tf32
from ssdiff.model.strategies import cases, maybe_boundary
from ssdiff.registry import known
from ssdiff.report import render_run
from ssdiff.verdict.judge import PROCESS_FAILURES, RUN_FAILURES, budget_rule

# How often a campaign rewrites progress.json in its output folder (seconds).
PROGRESS_FILE_S = 2.0
# With keep_going, a divergence seen this many times no longer steers the targeted search (its ratio is left out
# of the target): the search looks elsewhere for what it has not found.
STEER_AFTER = 3


class Fuzzer:
    """Runs one fuzz campaign. ``progress(state: dict)`` is called after every case; ``observe(outcome)``
    after every judged one (a calibration run collects its ratios there). Its parts: ``examiner`` (every case is
    examined through it), ``plan`` (ssdiff.campaign.config.Plan), ``budget`` and ``schedule``
    (ssdiff.campaign.schedule), ``report`` (ssdiff.campaign.results.FuzzReport); `judge` fits, examines and
    records one case."""

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
        self.plan = plan(cfg, self.examiner)
        self.pool = self.plan.pool
        # The shared example database (harness/campaign/cluster.py): its cases judged first, new divergences saved.
        self.shared = None
        if cfg.example_db is not None:
            from ssdiff.campaign.cluster import SharedCases

            self.shared = SharedCases(cfg.example_db, cfg.impl, cfg.against, cfg.oracle)
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
        self.budget = Budget(cfg.max_time, cfg.max_examples, lambda: self.report.tried)
        compiler = None
        if self.pool is not None and cfg.compile_ahead:
            from ssdiff.campaign.precompile import Compiler

            compiler = Compiler(self.impls, cfg.device, cfg.autotune)
        self.schedule = Schedule(cfg.autotune, self.plan.backward, self.budget, self.report, compiler)
        self._progress_written = -PROGRESS_FILE_S
        self._signatures: dict = {}
        self._post_deadline: Optional[float] = None

    # ---- known defects ------------------------------------------------------------------------------------

    def note_known(self, outcome: Outcome) -> set:
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
                             first_side=side, first_message=v.message(), first_after_s=round(self.budget.elapsed(), 2))
        return explained

    # ---- the campaign ------------------------------------------------------------------------------------

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
                          found_after_s=self.budget.elapsed(), cases_before=self.report.tried - 1)
        self._signatures[sig] = finding
        self.report.findings.append(finding)
        if self.shared is not None:
            self.shared.save(outcome.case, outcome.choice)
        if self.report.first_divergence_s is None:
            self.report.first_divergence_s = finding.found_after_s
        finding.path = str(self._write(finding))
        if not self.config.keep_going:
            self._replay_with_exact_dots(finding)
            if self.config.localize and not finding.tf32_replay:
                self.localize(finding)
                self._write(finding)
        return finding

    def _replay_with_exact_dots(self, finding: Finding) -> None:
        """A float32 finding under TF32 examined again with exact float32 dots (harness/investigate/tf32.py). Within
        budget there it moves from the findings to tf32_explained: TF32's loss, reported apart. Not under a sweep
        of configs (the replay runs one), nor where a side's run failed (error, crash, hang): TF32 moves numbers,
        and the replay runs in this process, where a hang would hold it."""
        cfg, o = self.config, finding.outcome
        if finding.tf32_replay is not None or not tf32.applies(o.case, cfg.device) or o.choice == "sweep" \
                or any(v.status in RUN_FAILURES for v in o.verdicts.values()):
            return
        said = tf32.replay(cfg.impl, o.case, o.choice, cfg.device, cfg.against, cfg.oracle, cfg.factor)
        finding.tf32_replay = said or ""
        if said:
            self.report.findings.remove(finding)
            self.report.tf32_explained.append(finding)
            self.report.first_divergence_s = min((f.found_after_s for f in self.report.findings), default=None)
            folder = store.tf32_folder(self.out_dir, finding.number)
            shutil.rmtree(folder, ignore_errors=True)
            finding.path = str(shutil.move(finding.path, folder))
        self._write(finding)

    def post_deadline(self) -> float:
        """When localization and minimization must end: the post-processing bound (Plan.post_time) from the first
        time one of them began."""
        if self._post_deadline is None:
            self._post_deadline = time.perf_counter() + self.plan.post_time
        return self._post_deadline

    def _merge_causes(self) -> None:
        """One cause, one finding: findings whose failing sides, minimal trigger and first divergent stages agree
        (Finding.cause) become the cases of the first of them; their folders go. A stage not known cannot tell
        causes apart: a finding without one joins the one cause of its sides and trigger whose stage is known."""
        first: dict = {}
        triggers: dict = {}             # cause -> the triggers of its findings
        for finding in list(self.report.findings):
            key = finding.cause()
            if key is None:
                continue
            triggers.setdefault(key, set()).add(finding.trigger())
            if key not in first:
                first[key] = finding
                continue
            self._merge_into(first[key], finding)
        for key, finding in list(first.items()):
            if finding.stage_known():
                continue
            known = [k for k, f in first.items() if f.stage_known() and k[0] == key[0] and key[1] in triggers[k]]
            if len(known) == 1:
                self._merge_into(first[known[0]], finding)

    def _merge_into(self, kept: Finding, finding: Finding) -> None:
        kept.cases += [finding.as_case()] + finding.cases
        self.report.findings.remove(finding)
        shutil.rmtree(finding.path, ignore_errors=True)
        self._write(kept)

    def localize(self, finding: Finding) -> None:
        """Stage, coordinates, trigger (harness/investigate/localize.py): re-runs with stages, ablations, configs.
        With keep_going it runs after the search, as minimization does: natively each ablation is a new kernel
        specialization compiled on the spot, which in the middle of a search would spend its time budget."""
        try:
            finding.localization, finding.staged = localize.investigate(
                self.examiner, finding.outcome, self.config.ablation_runs,
                explore_configs=self.config.autotune != "tuned", deadline=self.post_deadline())
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
            cases_before=finding.cases_before, cases=finding.cases)

    def message(self, finding: Finding) -> str:
        o = finding.outcome
        lines = [f"divergence {finding.number}: {o.case.describe()}"]
        for v in o.verdicts.values():
            lines.append(v.message())
        if o.pair:
            worst = max(o.pair.items(), key=lambda kv: kv[1] if math.isfinite(kv[1]) else 1e308)
            lines.append(f"the two sides differ by up to {worst[1]:.3g}x their joint budget ({worst[0]})")
        lines.append(finding.localization.get("text", ""))
        if finding.cases:
            lines.append(f"the same cause (sides, trigger and first divergent stage) in {finding.divergent_cases} "
                         f"divergent cases; besides this one:")
            lines += [f"  {c['count']} case(s) {c['dtype']} {c['pass']}: {c['signature']} (e.g. {c['description']})"
                      for c in finding.cases]
        if finding.minimized is not None and finding.minimized.partial:
            lines.append(f"minimized partially ({finding.minimized.shrunk.stopped}): the smallest case reached, "
                         f"{finding.minimized.minimal.describe()}")
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
        elapsed = self.budget.elapsed()
        state = {"tried": r.tried, "skipped": r.skipped, "elapsed": elapsed,
                 "per_minute": 60.0 * r.tried / elapsed if elapsed > 0 else 0.0,
                 "max_time": self.config.max_time, "max_examples": self.config.max_examples,
                 "worst": r.worst, "divergences": len(r.findings),
                 "known": sum(k["reproduced"] for k in r.known.values()),
                 "ahead": self.schedule.compiler.progress() if self.schedule.compiler else None,
                 "last": last.case.describe() if last else None}
        if elapsed - self._progress_written >= PROGRESS_FILE_S:
            self._progress_written = elapsed
            store.write_progress(self.out_dir, state)
        if self.progress is not None:
            self.progress(state)

    def request_stop(self, why: str = "interrupted") -> None:
        """End the search after the case being judged (a signal handler may call it): the summary and the
        report are written as for a spent budget."""
        self.budget.request_stop(why)

    def _minimize(self, finding: Finding):
        """Shrink one finding in its folder (minimized.json, minimized-verdict.json, repro.py). A run that
        crashed or hung is not minimized (every candidate would cost a child process or a timeout)."""
        from ssdiff.investigate.minimize import NotDiverging, minimize_outcome

        if any(v.status in PROCESS_FAILURES for v in finding.outcome.verdicts.values()):
            finding.minimize_problem = "not minimized: a side crashed or hung"
            return
        if time.perf_counter() >= self.post_deadline():
            finding.minimize_problem = f"not minimized: the post-processing bound ({self.plan.post_time:g} s) was spent"
            return
        start = time.perf_counter()
        try:
            finding.minimized = minimize_outcome(self.examiner, finding.outcome, finding.path,
                                                 max_runs=self.config.minimize_runs, deadline=self.post_deadline())
        except (NotDiverging, runtime.DeviceOutOfMemory) as exc:
            finding.minimize_problem = str(exc)
        finding.minimize_seconds = time.perf_counter() - start

    def judge(self, case, choice, target=None) -> bool:
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
            self._progress(None)
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
            self._progress(None)
            return False
        self.report.note_judged(outcome, self.budget.elapsed())
        explained = self.note_known(outcome)
        self.report.note_ratios(outcome, cfg.factor, explained)
        if self.observe is not None:
            self.observe(outcome)
        # Known defects do not steer the search, nor does a divergence already seen STEER_AFTER times: it climbs
        # toward the largest error nothing explains yet.
        seen = self._signatures.get(outcome.signature())
        ratio = outcome.worst_ratio(excluding=explained | (set(outcome.failing) if seen is not None
                                                            and seen.repeats + 1 >= STEER_AFTER else set()))
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

    def _rounds(self, search, stop_reason: list) -> None:
        """The search under a time budget or a compile pool, ``search(examples, seed, targeted, key)`` a round,
        until the budget is spent or ``stop_reason`` says why it ends."""
        cfg = self.config
        # A time budget alone, or a compile pool: rounds of ROUND_EXAMPLES, each a fresh search (seeded
        # from the campaign's seed and the round), alternating plain generation with targeted search: once
        # a target is observed Hypothesis's mutations toward it crowd out fresh draws, so one unbounded
        # targeted search would stay near its first cases. With a compile pool a round is one search per
        # key (`round_shares`), and one key is swapped between rounds.
        idle = 0
        for round_ in itertools.count():
            examples = ROUND_EXAMPLES if cfg.max_examples is None else \
                min(ROUND_EXAMPLES, cfg.max_examples - self.report.tried)
            if examples <= 0:               # the keys' representative cases spent the example budget
                break
            before = self.report.tried
            if self.schedule.compiler is not None and self.schedule.judge_pending(self.judge):
                stop_reason.append("divergence found")
                break
            if self.pool is None:
                search(examples, None if cfg.seed is None else cfg.seed + round_, targeted=round_ % 2 == 1)
            else:
                for slot, key, share in round_shares(self.pool.keys, examples, round_):
                    search(share, None if cfg.seed is None else f"{cfg.seed}/{round_}/{slot}",
                           targeted=round_ % 2 == 1, key=key)
                    if stop_reason or self.budget.spent():
                        break
            if stop_reason or self.budget.spent():
                break
            idle = idle + 1 if self.report.tried == before else 0
            if idle >= 5:
                stop_reason.append("five rounds judged no case (every drawn case was skipped)")
                break
            if self.pool is not None:
                new = self.pool.upcoming
                self.pool.rotate()
                # the one key now planned COMPILE_AHEAD_ROUNDS rotations ahead (the others are queued)
                self.schedule.compile_ahead(self.pool.ahead(COMPILE_AHEAD_ROUNDS)[-1:])
                if self.schedule.representatives([new], self.judge):
                    stop_reason.append("divergence found")
                    break

    def _post_process(self) -> None:
        """After the search, within the post-processing bound: with keep_going the TF32 replays, localization
        and the merge of one cause's findings; then minimization."""
        cfg = self.config
        if cfg.keep_going:
            for finding in list(self.report.findings):
                self._replay_with_exact_dots(finding)
            self._write_summary()
        if cfg.localize and cfg.keep_going:
            for finding in self.report.findings:
                self.localize(finding)
                self._write(finding)
            self._merge_causes()
            self._write_summary()
        if cfg.minimize:
            for finding in self.report.findings:
                self._minimize(finding)
                self._write(finding)

    def run(self) -> FuzzReport:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis import strategies as st
        from hypothesis import target

        cfg = self.config
        self.budget.start()
        self.report.setup_s = self.budget.started - self._created
        os.makedirs(self.out_dir, exist_ok=True)
        if cfg.autotune == "random":
            choices = st.integers(0, 7)
        else:
            choices = st.just(cfg.autotune)
        entry = self.plan.entries[0] if len(self.plan.entries) == 1 else None

        def strategy(key):
            """(case, boundary or None, choice, key or None): from a compile key of the round, or drawn freely."""
            if key is not None:
                return st.tuples(cases(key=key, bounds=self.plan.bounds, backward=self.plan.backward), st.just(key.boundary),
                                 choices, st.just(key))
            return maybe_boundary(self.plan.boundaries, self.plan.bounds.boundary_rate).flatmap(lambda b: st.tuples(
                cases(entry=entry, dtypes=cfg.dtypes, bounds=self.plan.bounds, backward=self.plan.backward, boundary=b),
                st.just(b), choices, st.none()))

        class Stop(Exception):
            pass

        stop_reason = []

        def explore(drawn):
            if stop_reason:
                raise Stop()
            why = self.budget.spent()
            if why:
                stop_reason.append(why)
                raise Stop()
            case, boundary, choice, key = drawn
            if case.entry not in self.plan.entries:
                return
            if key is not None:
                choice = self.schedule.choice_for(key, case, choice)
            elif boundary is not None and cfg.autotune in ("tuned", "random"):
                choice = boundary.config        # the config whose block this case straddles
            if self.judge(case, choice, target):
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
            if self.shared is not None and self.shared.replay(self.plan, self.budget, self.judge):
                stop_reason.append("divergence found")        # a stored case diverged again, before any new case
            if self.pool is not None and not stop_reason:
                # Every key and the next round's compiled ahead, not waited for: this process compiles what it
                # needs before the workers have it (a cold cache) or loads it from disk (warm), and the workers'
                # variants are on disk by the time it asks for them. Each key's representative case first.
                self.schedule.compile_ahead(self.pool.keys)
                self.schedule.compile_ahead(self.pool.ahead(COMPILE_AHEAD_ROUNDS))
                if self.schedule.representatives(self.pool.keys, self.judge):
                    stop_reason.append("divergence found")
            if stop_reason:
                pass
            elif cfg.max_examples is not None and self.pool is None:
                search(cfg.max_examples, cfg.seed)
            else:
                self._rounds(search, stop_reason)
            self.report.search_s = self.budget.elapsed()
            if not stop_reason:
                stop_reason.append(self.budget.spent() or "Hypothesis finished its examples")
            self.report.stopped = stop_reason[0]
            self._post_process()
        finally:
            self.report.search_s = self.report.search_s or self.budget.elapsed()
            if self.schedule.compiler is not None:
                self.schedule.compiler.close()
            self.examiner.close()
            self.report.elapsed = self.budget.elapsed()
            self.report.stopped = self.report.stopped or "interrupted"
            self._write_summary()
        if cfg.report_dir:
            self.report.report_path = str(render_run(self.out_dir, cfg.report_dir))
        return self.report


__all__ = ["Fuzzer", "FuzzConfig", "FuzzReport", "Finding", "Outcome", "UsageError", "GPU_BOUNDS"]
