"""Fuzz throughput as a table: each implementation fuzzed for a fixed budget, cold and warm.

    python -m ssdiff.tools.bench                                  # the default implementations, 300 s each
    python -m ssdiff.tools.bench --impl mamba_ssm.chunk_scan_combined --dtype bfloat16 --budget 120 --json out.json
    python -m ssdiff.tools.bench --impl fla.chunk_simple_gla:forward --budget 300 --cold-budget 60 --cache-root /tmp/c

Each campaign is its own `ssdiff fuzz` process (so nothing compiled stays in memory between them) with a
Triton cache of its own: "cold" starts from an empty cache, "warm" runs again on the cache the cold run left
(TRITON_CACHE_DIR; the autotune results stay on disk with TRITON_CACHE_AUTOTUNING=1) with the same seed, so that
it draws the compile keys the cold run compiled (more, where it gets further); the compile-ahead jobs the cold run
finished are recorded in that cache and not run again (harness/campaign/precompile.py). Columns: cases judged
per minute of search, the time to the first judged case from the process's start (imports, compiling and the
first case's judgement included), the share at production shapes (seqlen >= 2048 and dstate >= 128), and the largest
ratio to budget any case reached; a row (--json) also holds each divergent case's case.json, replayable once the
campaign's folder is gone. A second table gives the warm campaigns' required factors (median, 99th
percentile and maximum, from summary.json: the figures harness/tools/calibrate.py collects), so that a benchmark run is
also a calibration run of its dtype. Results for the H200 and the CPU: harness/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DEFAULT = (("mamba_ssm.chunk_scan_combined", "mixed"), ("mamba_ssm.split_conv1d_combined", "mixed"),
           ("ssdiff.triton", "mixed"), ("fla.chunk_simple_gla", "forward"))


def campaign(impl: str, pass_: str, dtype: str, budget: float, cache: str, out: str, extra=()) -> dict:
    """One `ssdiff fuzz` process; returns its summary's throughput and largest ratio."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache, TRITON_CACHE_AUTOTUNING="1", SSDIFF_REPORTS=out + "-reports")
    cmd = [sys.executable, "-m", "ssdiff.cli", "fuzz", "--impl", impl, "--pass", pass_, "--dtype", dtype,
           "--max-time", str(budget), "--no-minimize", "--no-localize", "--keep-going", "--out", out, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    try:
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
    except OSError:
        return {"impl": impl, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no summary"],
                "wall_s": round(wall, 1)}
    worst = max((w["ratio"] for w in summary["largest_ratio_by_dtype"].values()), default=None)
    t = summary.get("throughput", {})
    return {"impl": impl, "device": summary.get("device"), "dtype": dtype, "pass": pass_,
            "judged": t.get("judged"), "per_minute": t.get("judged_per_minute"),
            "first_s": None if t.get("first_judged_after_s") is None else
            round(t["first_judged_after_s"] + t.get("setup_s", 0.0), 2),
            "production": t.get("production_shape_cases"),
            # where the search's time went: judging cases, waiting for the workers compiling ahead
            "examine_s": t.get("examine_s"), "compile_wait_s": t.get("compile_wait_s"),
            "largest_ratio": worst, "divergences": len(summary.get("divergences", [])),
            "divergent_cases": [_case_of(d) for d in summary.get("divergences", [])],
            "known": sum(k.get("reproduced", 0) for k in summary.get("known", [])),
            "tf32_explained": len(summary.get("tf32_explained") or []), "wall_s": round(wall, 1),
            "required_factor": {key.split(" ", 1)[1]: spread for key, spread in
                                (summary.get("required_factor_by_side") or {}).items() if key.split(" ")[0] == impl}}


def _case_of(divergence: dict):
    """The replayable case (case.json) of a summary's divergence entry, else its one-line description: a
    campaign's folder may be gone by the time its row is read."""
    from ssdiff.store import CASE

    try:
        with open(os.path.join(divergence["path"], CASE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, KeyError, ValueError):
        return divergence.get("case")


def _target(text: str) -> tuple:
    """NAME[:PASS] -> (name, pass); a NAME may hold a colon itself (``module:function``)."""
    from ssdiff.campaign.config import PASSES

    name, _, pass_ = text.rpartition(":")
    return (name, pass_) if name and pass_ in PASSES else (text, "mixed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssdiff.tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--impl", action="append", metavar="NAME[:PASS]",
                        help="implementation and pass (default: " + ", ".join(f"{i}:{p}" for i, p in DEFAULT) + ")")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds per campaign")
    parser.add_argument("--cold-budget", type=float, default=None, metavar="S",
                        help="seconds of the cold campaign (default: --budget): its figure is the time to the first "
                             "judged case, which a shorter run measures as well")
    parser.add_argument("--warm-only", action="store_true", help="skip the cold run (the cache is filled by a "
                                                                   "short unmeasured run instead)")
    parser.add_argument("--seed", type=int, default=0, help="the campaigns' seed (the same for cold and warm)")
    parser.add_argument("--cache-root", default=None, help="where the per-implementation Triton caches go")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("fuzz_args", nargs="*", help="after --: more `ssdiff fuzz` arguments")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget:g}")
    if args.cold_budget is not None and args.cold_budget <= 0:
        parser.error(f"--cold-budget must be a positive number of seconds, got {args.cold_budget:g} "
                     f"(--warm-only skips the cold campaign)")
    targets = [_target(s) for s in args.impl] if args.impl else DEFAULT
    root = args.cache_root or tempfile.mkdtemp(prefix="ssdiff-bench-")
    rows = []
    for impl, pass_ in targets:
        cache = os.path.join(root, impl.replace(":", "_"), "triton")
        out = os.path.join(root, impl.replace(":", "_"))
        # One seed for both runs: the warm run draws the compile keys the cold run compiled.
        extra = ["--seed", str(args.seed), *args.fuzz_args]
        cold_budget = 30.0 if args.warm_only else (args.cold_budget or args.budget)
        cold = campaign(impl, pass_, args.dtype, cold_budget, cache, out + "/cold", extra)
        if not args.warm_only:          # said at once: a run cut during the warm campaign keeps the cold figures
            print(json.dumps({"impl": impl, "pass": pass_, "dtype": args.dtype, "cold": cold}), file=sys.stderr,
                  flush=True)
        warm = campaign(impl, pass_, args.dtype, args.budget, cache, out + "/warm", extra)
        row = {"impl": impl, "pass": pass_, "dtype": args.dtype, "device": warm.get("device"),
               "cold": None if args.warm_only else cold, "warm": warm}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print_table(rows, args.budget, None if args.warm_only else (args.cold_budget or args.budget))
    return 0


def print_table(rows, budget, cold_budget=None):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ssdiff fuzz throughput (warm {budget:g} s campaigns"
                        + (f", cold {cold_budget:g} s)" if cold_budget else ")"))
    for col in ("implementation", "device", "dtype", "pass", "cold /min", "cold first s", "warm /min",
                "warm first s", "production", "largest ratio", "divergences"):
        table.add_column(col)

    def cell(run, key, fmt="{}"):
        return "-" if not run or run.get(key) is None else fmt.format(run[key])

    for r in rows:
        cold, warm = r["cold"], r["warm"]
        share = f"{warm['production']}/{warm['judged']}" if warm.get("judged") else "-"
        table.add_row(r["impl"], str(r["device"]), r["dtype"], r["pass"], cell(cold, "per_minute"),
                      cell(cold, "first_s"), cell(warm, "per_minute"), cell(warm, "first_s"), share,
                      cell(warm, "largest_ratio", "{:.3g}"),
                      f"{warm.get('divergences', '-')} (+{warm.get('known', 0)} known"
                      + (f", +{warm['tf32_explained']} TF32's)" if warm.get("tf32_explained") else ")")
                      if "error" not in warm else "; ".join(warm["error"]))
    console = Console(width=200)
    console.print(table)
    # what the warm campaigns' cases used of their budgets: harness/tools/calibrate.py's figures, for these campaigns
    factors = Table(title="required factor (ratio x FACTOR) of the warm campaigns' cases, no known defect's")
    for col in ("implementation", "dtype", "cases", "outputs median / p99 / max", "gradients median / p99 / max"):
        factors.add_column(col)
    spread = lambda s: "-" if not s or not s["verdicts"] else \
        " / ".join(f"{s[k]:.3g}" for k in ("median", "p99", "max")) + f" ({s['verdicts']})"
    for r in rows:
        for dtype, groups in (r["warm"].get("required_factor") or {}).items():
            factors.add_row(r["impl"], dtype, str(r["warm"].get("judged")), spread(groups.get("outputs")),
                            spread(groups.get("gradients")))
    if factors.row_count:
        console.print(factors)


if __name__ == "__main__":
    sys.exit(main())
