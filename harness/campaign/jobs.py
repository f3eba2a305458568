"""One campaign split over several processes: `ssdiff fuzz --jobs N` on this host, and the driver loop that
`ssdiff fuzz --cluster` (harness/campaign/cluster.py) shares with it.

Natively, a search is bound by the host, not the device: an examined case is thousands of small launches (the
float64 oracle, the baseline samples, the verdicts) with the GPU idle between them. N jobs keep N host cores
launching. Each job is an independent campaign (harness/campaign/fuzz.py) with a seed of its own — its own compile keys
(harness/campaign/pool.py) and its own Hypothesis search — and a share of the compile workers (SSDIFF_COMPILE_WORKERS)
and of the example budget; the time budget is every job's. Each writes into <out>/job-<i>/ (its summary.json,
progress.json and log.txt). When they end, their summaries are merged into <out>/summary.json and their
divergences moved to <out>/divergence-NNN/, one per signature (a signature another job found first counts as
a repeat and stays in its job's folder), so the run reads, renders and replays as one campaign. Without
--keep-going the first divergence stops every job. A job that dies takes only its own cases with it: its
log.txt says why, and the merged summary names it with its last case. A job silent for longer than its
post-processing bound plus HANG_GRACE_S (no case judged, no exit) is hung: it is interrupted, then killed, and
counts as a dead job. Each job runs in a session of its own, so the driver's loss leaves the jobs running to
their budgets; `python -m ssdiff.campaign.jobs DIR` merges their folders afterwards.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from typing import Optional

from rich.markup import escape

from ssdiff import exits as status
from ssdiff import store

# Job i searches with seed + i * SEED_STRIDE (the campaign's seed plus round numbers stay below it).
SEED_STRIDE = 100_000
# Options the parent sets for each job (with how many values each takes).
_PER_JOB = {"--jobs": 1, "--seed": 1, "--out": 1, "--max-examples": 1, "--cluster": 1}
# A job neither ending nor judging a case for its post-processing bound plus this long is hung (the bound covers
# localizing and minimizing, which say nothing; this, a case compiling cold and the start-up).
HANG_GRACE_S = 300.0
# A hung (or stopped) job gets a SIGINT (the search ends after its case), a second one this long after (the
# campaign is interrupted, its summary written), then SIGKILL this long after that.
STOP_GRACE_S = 15.0
# How often the driver prints the joint progress line (seconds).
LINE_S = 15.0


def job_argv(argv: list, seed: int, out: Optional[str], max_examples: Optional[int],
             drop: Optional[dict] = None) -> list:
    """The fuzz command line of one job: ``argv`` (the parent's, after ``fuzz``) without the options each job
    gets its own value of (and those of ``drop``: name -> how many values), then those values (``out`` None:
    no --out, the caller adds it)."""
    per_job = dict(_PER_JOB, **(drop or {}))
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in per_job:
            skip = 0 if "=" in arg else per_job[name]
            continue
        kept.append(arg)
    kept += ["--seed", str(seed)] + (["--out", out] if out is not None else []) + ["--no-report"]
    if max_examples is not None:
        kept += ["--max-examples", str(max_examples)]
    return kept


def shares(total: Optional[int], jobs: int) -> list:
    """``total`` examples dealt out to ``jobs`` (None: no example budget)."""
    if total is None:
        return [None] * jobs
    return [total // jobs + (i < total % jobs) for i in range(jobs)]


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _larger(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    if not a:
        return b
    if not b:
        return a
    return b if b.get("ratio", -1.0) > a.get("ratio", -1.0) else a


def merge(out: pathlib.Path, job_dirs: list, seed: int, elapsed: float, exits: list,
          notes: Optional[list] = None) -> dict:
    """The jobs' summaries as one campaign's (see the module docstring); moves each new signature's divergence
    folder to ``out``. Throughput is per minute of the longest job's search (the jobs ran side by side).
    ``notes``: per job, more of its entry under ``jobs`` (where it ran, what went wrong, its last case)."""
    summaries = [_read(d / store.SUMMARY) for d in job_dirs]
    base = next((s for s in summaries if s), {})
    merged = dict(base)
    merged.pop("format", None)
    jobs, skip_reasons, errors, worst, worst_side, known = [], {}, [], {}, {}, {}
    # required factors: counts add up and maxima compare, medians and percentiles do not merge (each job's are
    # under jobs)
    required: dict = {}
    divergences, by_signature, tf32_explained = [], {}, []
    tried = skipped = production = 0
    per_case: dict = {}
    search_s, setup_s, first_judged, first_div = 0.0, 0.0, None, None
    for i, (d, s, code) in enumerate(zip(job_dirs, summaries, exits)):
        jobs.append({"job": i, "seed": seed + i * SEED_STRIDE, "dir": str(d), "exit": code,
                     "cases_tried": s.get("cases_tried"), "stopped": s.get("stopped") or "no summary: see log.txt",
                     "required_factor_by_side": s.get("required_factor_by_side", {}), **(notes[i] if notes else {})})
        if not s:
            continue
        for key, groups in (s.get("required_factor_by_side") or {}).items():
            for group, spread in groups.items():
                acc = required.setdefault(key, {}).setdefault(group, {"verdicts": 0, "median": None, "p99": None,
                                                                       "max": None})
                acc["verdicts"] += spread["verdicts"]
                if spread["max"] is not None:
                    acc["max"] = spread["max"] if acc["max"] is None else max(acc["max"], spread["max"])
        tried += s.get("cases_tried", 0)
        skipped += s.get("cases_skipped", 0)
        for why, n in (s.get("skip_reasons") or {}).items():
            skip_reasons[why] = skip_reasons.get(why, 0) + n
        errors += s.get("harness_errors") or []
        for dtype, w in (s.get("largest_ratio_by_dtype") or {}).items():
            worst[dtype] = _larger(worst.get(dtype), w)
        for key, w in (s.get("largest_ratio_by_side") or {}).items():
            worst_side[key] = _larger(worst_side.get(key), w)
        for entry in s.get("known") or []:
            seen = known.setdefault(entry["id"], dict(entry, reproduced=0, matched_not_reproduced=0,
                                                      first_example=None))
            seen["reproduced"] += entry.get("reproduced", 0)
            seen["matched_not_reproduced"] += entry.get("matched_not_reproduced", 0)
            if entry.get("first_example") is not None and (
                    seen["first_example"] is None or entry.get("first_after_s", 0) < seen.get("first_after_s", 0)):
                seen.update({k: v for k, v in entry.items() if k.startswith("first")})
        t = s.get("throughput") or {}
        search_s = max(search_s, t.get("search_s") or 0.0)
        setup_s = max(setup_s, t.get("setup_s") or 0.0)
        production += t.get("production_shape_cases") or 0
        if t.get("first_judged_after_s") is not None:
            first_judged = min(first_judged or 1e30, t["first_judged_after_s"])
        for kind, c in (t.get("per_case") or {}).items():
            acc = per_case.setdefault(kind, {"cases": 0})
            acc["cases"] += c["cases"]
            for name, mean in c.items():          # the means per case: examine_s and each phase's
                if name.endswith("_s"):
                    acc[name] = acc.get(name, 0.0) + mean * c["cases"]
        if s.get("first_divergence_after_s") is not None:
            first_div = min(first_div or 1e30, s["first_divergence_after_s"])
        tf32_explained += [dict(item, job=i) for item in s.get("tf32_explained") or []]
        for item in s.get("divergences") or []:
            item = dict(item, job=i)
            known_one = by_signature.get(item["signature"])
            if known_one is not None:
                known_one["repeats"] += 1 + item.get("repeats", 0)
                continue
            number = len(divergences) + 1
            target = out / f"divergence-{number:03d}"
            source = pathlib.Path(item["path"]) if item.get("path") else None
            if source is not None and not source.is_dir() and (d / source.name).is_dir():
                source = d / source.name        # written elsewhere (a cluster worker's node), brought here since
            if source is not None and source.is_dir():
                if target.exists():
                    shutil.rmtree(target)
                shutil.move(str(source), str(target))
                item["path"] = str(target)
            item["number"] = number
            by_signature[item["signature"]] = item
            divergences.append(item)
    minutes = search_s / 60.0
    merged.update({
        "seed": seed, "jobs": jobs, "cases_tried": tried, "cases_skipped": skipped, "skip_reasons": skip_reasons,
        "harness_errors": errors, "elapsed_s": round(elapsed, 2),
        "stopped": "; ".join(sorted({j["stopped"] for j in jobs})),
        "first_divergence_after_s": first_div, "largest_ratio_by_dtype": worst, "largest_ratio_by_side": worst_side,
        "required_factor_by_side": required, "divergences": divergences, "tf32_explained": tf32_explained,
        "known": list(known.values()),
        "throughput": {
            "judged": tried, "skipped": skipped,
            "judged_per_minute": round(tried / minutes, 1) if minutes > 0 else None,
            "first_judged_after_s": first_judged, "setup_s": round(setup_s, 2), "search_s": round(search_s, 2),
            "production_shape_cases": production, "jobs": len(job_dirs),
            "per_case": {kind: {name: (value if name == "cases" else round(value / acc["cases"], 4))
                                for name, value in acc.items()}
                         for kind, acc in sorted(per_case.items()) if acc["cases"]}},
    })
    return merged


def _line(states: list, elapsed: float, max_time: Optional[float], what: str = "jobs") -> str:
    """One progress line for the jobs' progress states together."""
    from ssdiff.campaign.progress import progress_text

    worst: dict = {}
    for s in states:
        for dtype, w in (s.get("worst") or {}).items():
            worst[dtype] = _larger(worst.get(dtype), w)
    tried = sum(s.get("tried", 0) for s in states)
    merged = {"tried": tried, "skipped": sum(s.get("skipped", 0) for s in states), "elapsed": elapsed,
              "per_minute": 60.0 * tried / elapsed if elapsed > 0 else 0.0, "worst": worst,
              "divergences": sum(s.get("divergences", 0) for s in states),
              "known": sum(s.get("known", 0) for s in states)}
    return f"{len(states)} {what}: " + progress_text(merged, max_time)


class Job:
    """One job: a `ssdiff fuzz` process of this host writing into ``folder``. The driver (`drive`) asks each
    shard the same: `update` (has it ended, where does it stand), `stop` (SIGINT: end the search after the case),
    `kill`, `finish` (its results into ``folder``), and reads ``code`` (its exit status, once ended), ``state`` (its
    last progress), ``fault`` (what went wrong, or None), ``name`` and ``where`` (more of its entry under jobs)."""

    def __init__(self, index: int, cmd: list, folder: pathlib.Path, env: dict):
        self.index, self.folder = index, folder
        self.name = f"job {index}"
        self.where: dict = {}
        self.code: Optional[int] = None
        self.ended = False
        self.state: dict = {}
        self.fault: Optional[str] = None
        self._log = open(folder / "log.txt", "w", encoding="utf-8")
        # Each job in a session of its own: a Ctrl-C at the terminal reaches the parent alone, which passes one
        # SIGINT on (a job's first SIGINT ends its search gracefully; a second would interrupt it at once).
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)

    def update(self) -> None:
        if not self.ended:
            self.state = _read(self.folder / store.PROGRESS) or self.state
            self.code = self._proc.poll()
            self.ended = self.code is not None

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)       # its compile workers and children too
            except OSError:
                self._proc.kill()

    def finish(self) -> None:
        self._log.close()


def post_time(args) -> float:
    """The shards' post-processing bound (FuzzConfig.post_time, as harness/campaign/config.py's plan sets it)."""
    from ssdiff.campaign.config import POST_EXAMPLES_S, POST_MIN_S, POST_SHARE

    if getattr(args, "post_time", None) is not None:
        return args.post_time
    return max(POST_MIN_S, POST_SHARE * args.max_time) if args.max_time is not None else POST_EXAMPLES_S


def drive(shards: list, args, out: pathlib.Path, seed: int, console, err_console, what: str = "jobs",
          extra: Optional[dict] = None, states_text=None) -> int:
    """Watch the shards to their end (a joint progress line every LINE_S; without --keep-going the first
    divergence stops the others; a silent shard is hung: stopped, then killed), merge them into ``out``, print
    what they found and return the exit status (ssdiff.exits). ``extra``: more of the merged summary;
    ``states_text(shards)``: the per-worker part of the progress line."""
    start = time.monotonic()
    silent_limit = post_time(args) + HANG_GRACE_S
    heard = {s.index: (start, None) for s in shards}        # when each shard's progress last changed, and to what
    interrupted: dict = {}                                  # a hung shard's index -> the SIGINTs sent, the first when
    stopping, last = False, 0.0

    def watch():
        nonlocal stopping, last
        while True:
            now = time.monotonic()
            for s in shards:
                s.update()
                key = (s.state.get("tried"), s.state.get("skipped"), s.state.get("elapsed"))
                if key != heard[s.index][1]:
                    heard[s.index] = (now, key)
                if s.ended:
                    continue
                if s.index not in interrupted and now - heard[s.index][0] > silent_limit:
                    s.fault = (f"hung (no case judged and no exit for {silent_limit:.0f} s: its post-processing "
                               f"bound plus {HANG_GRACE_S:.0f} s), so stopped by the driver")
                    interrupted[s.index] = [1, now]
                    s.stop()
                elif s.index in interrupted:
                    sent, first = interrupted[s.index]
                    if now - first > 2 * STOP_GRACE_S:
                        s.kill()
                    elif now - first > STOP_GRACE_S and sent == 1:
                        interrupted[s.index][0] = 2
                        s.stop()                # the second SIGINT: the campaign is interrupted, its summary written
            if all(s.ended for s in shards):
                return
            if not args.keep_going and not stopping and any(s.code == status.DIVERGENCE for s in shards):
                stopping = True                  # a divergence: the other jobs stop (and write their summaries)
                for s in shards:
                    if not s.ended:
                        s.stop()
            if now - last > LINE_S:
                last = now
                line = _line([s.state for s in shards], now - start, args.max_time, what)
                if states_text is not None:
                    line += " | " + states_text(shards)
                err_console.print(line, highlight=False, soft_wrap=True)
            time.sleep(0.5)

    try:
        watch()
    except KeyboardInterrupt:
        for s in shards:
            if not s.ended:
                s.stop()
        watch()
    finally:
        for s in shards:
            s.finish()
    codes = [s.code for s in shards]
    dirs = [s.folder for s in shards]
    if all(code == status.USAGE for code in codes):        # bad usage: every job said why, the same way
        err_console.print((dirs[0] / "log.txt").read_text(encoding="utf-8").strip(), highlight=False, markup=False)
        return status.USAGE
    notes = []
    for s in shards:
        note = dict(s.where)
        if s.fault is None and s.code not in (status.OK, status.DIVERGENCE, status.TOO_LITTLE):
            s.fault = "died"
        if s.fault is not None:
            note.update(fault=s.fault, last_case=s.state.get("last"), cases_when_lost=s.state.get("tried"))
        notes.append(note)
    merged = merge(out, dirs, seed, time.monotonic() - start, codes, notes)
    merged.update(extra or {})
    store.write_summary(out, merged)
    for d in merged["divergences"]:
        console.rule(f"divergence {d['number']} (job {d['job']}, after {d['found_after_s']:.1f} s)")
        message = pathlib.Path(d["path"]) / store.MESSAGE
        console.print(message.read_text(encoding="utf-8") if message.is_file() else d["summary"], highlight=False,
                      markup=False, soft_wrap=True)
        console.print(f"-> {d['path']}", highlight=False, soft_wrap=True)
    for item in merged["tf32_explained"]:
        console.print(f"TF32's loss (job {item['job']}): {item['case']}: replayed with exact float32 dots: "
                      f"{item['replay']} -> {item['path']}", highlight=False, soft_wrap=True)
    for entry in merged["known"]:
        if entry["reproduced"]:
            console.print(f"known {entry['id']}: reproduced in {entry['reproduced']} case(s), first: "
                          f"{entry.get('first_case')}", highlight=False, soft_wrap=True)
    for s in shards:
        if s.fault is not None:
            said = (f"{s.name} {s.fault}; exit status {s.code}; after {s.state.get('tried', 0)} case(s), its last: "
                    f"{s.state.get('last') or 'none judged'}; {s.folder}/log.txt")
            err_console.print(f"[yellow]{escape(said)}[/]", highlight=False, soft_wrap=True)
    if not args.no_report:
        from ssdiff.campaign.config import FuzzConfig
        from ssdiff.report import render_run

        console.print(f"report: {render_run(out, FuzzConfig(impl=args.impl).report_dir)}", highlight=False,
                      soft_wrap=True)
    t = merged["throughput"]
    worst = ", ".join(f"{d} {w['ratio']:.3g}x ({w['tensor']}, {w['side']})"
                      for d, w in sorted(merged["largest_ratio_by_dtype"].items()))
    console.print(f"{t['judged']} cases judged in {len(shards)} {what} ({t['judged_per_minute']}/min), "
                  f"{t['skipped']} skipped; largest ratio to budget: {worst or 'none'}; output: {out}/ (summary.json)",
                  highlight=False, soft_wrap=True)
    if merged["divergences"]:
        return status.DIVERGENCE
    if any(s.fault is not None for s in shards):
        return status.JOB_DIED
    return status.TOO_LITTLE if t["judged"] == 0 else status.OK


def output_folder(args) -> pathlib.Path:
    return pathlib.Path(args.out or os.path.join("ssdiff-out", f"fuzz-{datetime.now().strftime('%Y%m%d-%H%M%S')}"))


def run(args, argv: list, console, err_console) -> int:
    """`ssdiff fuzz --jobs N`: start the jobs, show their joint progress, merge them (module docstring)."""
    n = min(args.jobs, args.max_examples) if args.max_examples else args.jobs      # no job without an example
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    out = output_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    workers = os.environ.get("SSDIFF_COMPILE_WORKERS") or str(max(1, ((os.cpu_count() or 2) - 1) // n))
    env = dict(os.environ, SSDIFF_COMPILE_WORKERS=workers)
    shards = []
    for i, examples in enumerate(shares(args.max_examples, n)):
        d = out / f"job-{i}"
        d.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "ssdiff.cli", "fuzz", *job_argv(argv, seed + i * SEED_STRIDE, str(d), examples)]
        shards.append(Job(i, cmd, d, env))
    err_console.print(f"fuzz {args.impl} in {n} jobs (seeds {seed} + {SEED_STRIDE} i, {workers} compile workers each) "
                      f"-> {out}", highlight=False, soft_wrap=True)
    return drive(shards, args, out, seed, console, err_console)


def merge_afterwards(out) -> dict:
    """Merge the job-<i>/ folders a run left in ``out`` (its driver lost before it merged them) into
    ``out``/summary.json, as the driver would have; the merged summary."""
    out = pathlib.Path(out)
    dirs = sorted((d for d in out.glob("job-*") if d.is_dir() and d.name[4:].isdigit()), key=lambda d: int(d.name[4:]))
    if not dirs:
        raise store.RunError(f"{out}: no job-<i>/ folders to merge")
    summaries = [_read(d / store.SUMMARY) for d in dirs]
    # each job's summary holds its own seed, seed + i * SEED_STRIDE
    seed = next((s["seed"] - i * SEED_STRIDE for i, s in enumerate(summaries) if s.get("seed") is not None), 0)
    merged = merge(out, dirs, seed, max((s.get("elapsed_s") or 0.0) for s in summaries), [None] * len(dirs),
                   [{"merged_afterwards": True} for _ in dirs])
    store.write_summary(out, merged)
    return merged


__all__ = ["run", "drive", "merge", "merge_afterwards", "job_argv", "shares", "post_time", "Job", "SEED_STRIDE",
           "HANG_GRACE_S", "STOP_GRACE_S"]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m ssdiff.campaign.jobs DIR  (merge the job-<i>/ folders a --jobs or --cluster run "
              "left in DIR)", file=sys.stderr)
        sys.exit(status.USAGE)
    try:
        summary = merge_afterwards(sys.argv[1])
    except store.RunError as err:
        print(f"ssdiff merge: {err}", file=sys.stderr)
        sys.exit(status.USAGE)
    print(f"{summary['cases_tried']} cases of {len(summary['jobs'])} jobs, {len(summary['divergences'])} "
          f"divergence(s) -> {pathlib.Path(sys.argv[1]) / store.SUMMARY}")
