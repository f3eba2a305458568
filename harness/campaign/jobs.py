"""One campaign split over several processes of one host: `ssdiff fuzz --jobs N`.

Natively, a search is bound by the host, not the device: an examined case is thousands of small launches (the
float64 oracle, the baseline samples, the verdicts) with the GPU idle between them. N jobs keep N host cores
launching. Each job is an independent campaign (harness/campaign/fuzz.py) with a seed of its own — its own compile keys
(harness/campaign/pool.py) and its own Hypothesis search — and a share of the compile workers (SSDIFF_COMPILE_WORKERS)
and of the example budget; the time budget is every job's. Each writes into <out>/job-<i>/ (its summary.json,
progress.json and log.txt). When they end, their summaries are merged into <out>/summary.json and their
divergences moved to <out>/divergence-NNN/, one per signature (a signature another job found first counts as
a repeat and stays in its job's folder), so the run reads, renders and replays as one campaign. Without
--keep-going the first divergence stops every job. A job that dies takes only its own cases with it: its
log.txt says why, and the merged summary names it.
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

from ssdiff import exits as status
from ssdiff import store

# Job i searches with seed + i * SEED_STRIDE (the campaign's seed plus round numbers stay below it).
SEED_STRIDE = 100_000
# Options the parent sets for each job (with how many values each takes).
_PER_JOB = {"--jobs": 1, "--seed": 1, "--out": 1, "--max-examples": 1}


def job_argv(argv: list, seed: int, out: str, max_examples: Optional[int]) -> list:
    """The fuzz command line of one job: ``argv`` (the parent's, after ``fuzz``) without the options each job
    gets its own value of, then those values."""
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _PER_JOB:
            skip = 0 if "=" in arg else _PER_JOB[name]
            continue
        kept.append(arg)
    kept += ["--seed", str(seed), "--out", out, "--no-report"]
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


def merge(out: pathlib.Path, job_dirs: list, seed: int, elapsed: float, exits: list) -> dict:
    """The jobs' summaries as one campaign's (see the module docstring); moves each new signature's divergence
    folder to ``out``. Throughput is per minute of the longest job's search (the jobs ran side by side)."""
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
                     "required_factor_by_side": s.get("required_factor_by_side", {})})
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


def _line(states: list, elapsed: float, max_time: Optional[float]) -> str:
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
    return f"{len(states)} jobs: " + progress_text(merged, max_time)


def run(args, argv: list, console, err_console) -> int:
    """`ssdiff fuzz --jobs N`: start the jobs, show their joint progress, merge them (module docstring)."""
    n = min(args.jobs, args.max_examples) if args.max_examples else args.jobs      # no job without an example
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    out = pathlib.Path(args.out or os.path.join("ssdiff-out", f"fuzz-{datetime.now().strftime('%Y%m%d-%H%M%S')}"))
    out.mkdir(parents=True, exist_ok=True)
    workers = os.environ.get("SSDIFF_COMPILE_WORKERS") or str(max(1, ((os.cpu_count() or 2) - 1) // n))
    env = dict(os.environ, SSDIFF_COMPILE_WORKERS=workers)
    dirs, procs, logs = [], [], []
    start = time.monotonic()
    for i, examples in enumerate(shares(args.max_examples, n)):
        d = out / f"job-{i}"
        d.mkdir(exist_ok=True)
        log = open(d / "log.txt", "w", encoding="utf-8")
        cmd = [sys.executable, "-m", "ssdiff.cli", "fuzz", *job_argv(argv, seed + i * SEED_STRIDE, str(d), examples)]
        # Each job in a session of its own: a Ctrl-C at the terminal reaches the parent alone, which passes one
        # SIGINT on (a job's first SIGINT ends its search gracefully; a second would interrupt it at once).
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        dirs.append(d)
        logs.append(log)
    err_console.print(f"fuzz {args.impl} in {n} jobs (seeds {seed} + {SEED_STRIDE} i, {workers} compile workers each) "
                      f"-> {out}", highlight=False, soft_wrap=True)
    stopping, last = False, 0.0
    try:
        while any(p.poll() is None for p in procs):
            if not args.keep_going and not stopping and any(p.returncode == 1 for p in procs):
                stopping = True                  # a divergence: the other jobs stop (and write their summaries)
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGINT)
            if time.monotonic() - last > 15:
                last = time.monotonic()
                states = [_read(d / "progress.json") for d in dirs]
                err_console.print(_line(states, time.monotonic() - start, args.max_time), highlight=False,
                                  soft_wrap=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
    finally:
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if all(code == status.USAGE for code in codes):        # bad usage: every job said why, the same way
        err_console.print((dirs[0] / "log.txt").read_text(encoding="utf-8").strip(), highlight=False, markup=False)
        return status.USAGE
    merged = merge(out, dirs, seed, time.monotonic() - start, codes)
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
    for job in merged["jobs"]:
        if job["exit"] not in (0, 1):
            err_console.print(f"[yellow]job {job['job']} exited with status {job['exit']}: {job['dir']}/log.txt[/]",
                              highlight=False, soft_wrap=True)
    if not args.no_report:
        from ssdiff.campaign.fuzz import FuzzConfig
        from ssdiff.report import render_run

        console.print(f"report: {render_run(out, FuzzConfig(impl=args.impl).report_dir)}", highlight=False,
                      soft_wrap=True)
    t = merged["throughput"]
    worst = ", ".join(f"{d} {w['ratio']:.3g}x ({w['tensor']}, {w['side']})"
                      for d, w in sorted(merged["largest_ratio_by_dtype"].items()))
    console.print(f"{t['judged']} cases judged in {n} jobs ({t['judged_per_minute']}/min), {t['skipped']} skipped; "
                  f"largest ratio to budget: {worst or 'none'}; output: {out}/ (summary.json)", highlight=False,
                  soft_wrap=True)
    if merged["divergences"]:
        return status.DIVERGENCE
    if not all(code in (status.OK, status.DIVERGENCE, status.TOO_LITTLE) for code in codes):
        return status.JOB_DIED
    return status.TOO_LITTLE if t["judged"] == 0 else status.OK


__all__ = ["run", "merge", "job_argv", "shares", "SEED_STRIDE"]
