"""Calibration as a benchmark: how much of the budget healthy implementations use.

Not a test. For each implementation and dtype, a fuzz campaign (ssdiff.campaign.fuzz.Fuzzer: keep going, no
localization or minimization, known defects reported) judges N cases; every output and gradient verdict's
*required factor* — its ratio times FACTOR, i.e. the FACTOR at which it would just pass — is collected:

    python -m ssdiff.tools.calibrate --impl mamba_ssm.chunk_scan_combined --impl mamba_ssm.split_conv1d_combined \
        --dtype float32,float16 --cases 1250 [--rounds 10] [--max-time S] [--device cpu] [--pass mixed] [--seed 0] \
        [--json calibration.json]

It prints per implementation and dtype: the cases judged, the tensor verdicts, the required factor's median,
99th percentile and maximum for outputs and for gradients, the divergences no known defect explains and the
known-defect matches (a side whose divergence a known defect explains is counted there, not measured). The JSON
holds the same, each undeclared divergence's case and the ten largest required factors with their cases; it is
rewritten every 100 cases, so a long run can be read while it goes on (with ``--rounds``, every implementation
and dtype has figures after the first round).
harness/README.md ("The calibration table") publishes the figures, harness/BENCHMARKS.md each run.

The search is Hypothesis's: with an example budget its second half climbs toward larger ratios (the fuzz's
target), so the tail figures are those of a search for the worst case, not of independent draws.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Optional

from ssdiff.registry import known
from ssdiff.campaign.config import PASSES
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer
from ssdiff.verdict.judge import FACTOR, REQUIRED_GROUPS, factor_spread, required_factors

WORST_KEPT = 10
CHECKPOINT = 100


@dataclass
class Row:
    """One campaign: ``impl`` in ``dtype`` on ``device``."""

    impl: str
    device: Optional[str]
    dtype: str
    factor: float = FACTOR
    cases: int = 0
    skipped: int = 0
    required: dict = field(default_factory=lambda: {group: [] for group in REQUIRED_GROUPS.values()})
    divergences: list = field(default_factory=list)      # undeclared: no known defect explains them
    known: dict = field(default_factory=dict)             # defect id -> cases it explained
    worst: list = field(default_factory=list)             # the WORST_KEPT largest required factors
    elapsed_s: float = 0.0

    def observe(self, outcome):
        """Fuzzer's ``observe`` callback: collect one judged case's required factors and divergences. A side
        whose divergence a known defect explains is counted under the defect, not measured."""
        case = outcome.case
        for side, verdict in outcome.verdicts.items():
            defect = known.matching(side, case) if not verdict.ok else None
            if defect is not None and known.explains(defect, side, outcome, self.factor):
                self.known[defect.id] = self.known.get(defect.id, 0) + 1
                continue
            for group, tensor, required in required_factors(verdict, self.factor):
                self.required[group].append(required)
                self.worst.append({"required": required, "side": side, "tensor": tensor, "case": case.describe(),
                                   "case_dict": case.to_dict()})
            self.worst = sorted(self.worst, key=lambda w: -w["required"])[:WORST_KEPT]
            if verdict.ok:
                continue
            self.divergences.append({"side": side, "status": verdict.status, "ratio": _finite(verdict.ratio),
                                     "tensors": [t.name for t in verdict.tensors if not t.ok],
                                     "message": verdict.message(), "case": case.to_dict()})

    def summary(self) -> dict:
        stats = {group: factor_spread(v) for group, v in self.required.items()}
        return {"impl": self.impl, "device": self.device, "dtype": self.dtype, "factor": self.factor,
                "cases": self.cases, "skipped": self.skipped,
                "tensor_verdicts": sum(len(v) for v in self.required.values()), "required_factor": stats,
                "divergences": self.divergences, "known": self.known, "worst": self.worst,
                "elapsed_s": round(self.elapsed_s, 1)}


def _finite(x: float):
    return x if math.isfinite(x) else str(x)


def campaign(row: Row, cases: int, pass_: str, seed: Optional[int],
             checkpoint: Callable[[], None] = lambda: None, max_time: Optional[float] = None):
    """Add one fuzz search of ``cases`` Hypothesis examples of ``row``'s implementation and dtype (or fewer,
    ``max_time`` seconds of search) to ``row``. ``checkpoint()`` is called every CHECKPOINT judged cases (a
    long run's partial figures)."""
    config = FuzzConfig(impl=row.impl, dtypes=(row.dtype,), device=row.device, pass_=pass_, seed=seed,
                        max_examples=cases, max_time=max_time, keep_going=True, localize=False, minimize=False,
                        known="report", report_dir=None, out_dir=tempfile.mkdtemp(prefix="ssdiff-calibrate-"))
    before = (row.cases, row.skipped, row.elapsed_s)
    start = time.perf_counter()

    def progress(state):
        row.cases, row.skipped = before[0] + state["tried"], before[1] + state["skipped"]
        row.elapsed_s = before[2] + time.perf_counter() - start
        if state["tried"] and row.cases % CHECKPOINT == 0 and row.cases != getattr(progress, "last", 0):
            progress.last = row.cases
            checkpoint()

    fuzzer = Fuzzer(config, progress=progress, observe=row.observe)
    row.device = config.device                        # the Fuzzer settles the default
    report = fuzzer.run()
    row.cases, row.skipped = before[0] + report.tried, before[1] + report.skipped
    row.elapsed_s = before[2] + time.perf_counter() - start


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


def table(rows: list):
    from rich.table import Table

    t = Table(title=f"required factor (ratio x FACTOR = {FACTOR:g}) of healthy implementations")
    for name in ("implementation", "device", "dtype", "cases", "tensor verdicts", "outputs median / p99 / max",
                 "gradients median / p99 / max", "divergences", "known"):
        t.add_column(name, justify="left" if name in ("implementation", "device", "dtype") else "right")
    for row in rows:
        s = row.summary()
        q = s["required_factor"]
        spread = lambda k: " / ".join(_fmt(q[k][m]) for m in ("median", "p99", "max"))
        t.add_row(row.impl, row.device, row.dtype, str(row.cases), str(s["tensor_verdicts"]), spread("outputs"),
                  spread("gradients"), str(len(row.divergences)), str(sum(row.known.values())))
    return t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssdiff.tools.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", action="append", required=True, help="implementation (repeatable)")
    parser.add_argument("--dtype", default="float32,float16", help="comma-separated dtypes")
    parser.add_argument("--cases", type=int, required=True, help="Hypothesis examples per implementation and dtype")
    parser.add_argument("--rounds", type=int, default=1,
                        help="split each campaign into this many searches (seeds seed, seed + 1, ...), every "
                             "implementation and dtype in turn: a run cut short has figures for all of them")
    parser.add_argument("--max-time", type=float, default=None,
                        help="seconds for the whole run: each search gets an equal share of what is left, and "
                             "ends at its share or its cases, whichever comes first")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: where kernels run here)")
    parser.add_argument("--pass", dest="pass_", default="mixed", choices=PASSES)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here (every %d cases)" % CHECKPOINT)
    args = parser.parse_args(argv)
    from rich.console import Console

    from ssdiff.sides.environment import environment

    console = Console(width=None if sys.stdout.isatty() else 160)
    command = " ".join(["python -m ssdiff.tools.calibrate"] + list(sys.argv[1:] if argv is None else argv))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rows = [Row(impl, args.device, dtype) for impl in args.impl for dtype in args.dtype.split(",")]
    rounds = max(1, min(args.rounds, args.cases))
    done_rounds = 0

    def write():
        console.print(", ".join(f"{r.impl} {r.dtype}: {r.cases}" for r in rows) + " cases judged")
        if not args.json:
            return
        record = {"command": command, "started": started,
                  "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "rounds_done": done_rounds, "rounds": rounds, "factor": FACTOR, "pass": args.pass_,
                  "seed": args.seed, "environment": environment(rows[0].device), "rows": [r.summary() for r in rows]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)

    deadline = None if args.max_time is None else time.monotonic() + args.max_time
    for round_ in range(rounds):
        if deadline is not None and time.monotonic() >= deadline:
            break
        share = args.cases // rounds + (1 if round_ < args.cases % rounds else 0)
        for i, row in enumerate(rows):
            searches = (rounds - round_) * len(rows) - i           # this one and those after it
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0) / searches
            campaign(row, share, args.pass_, None if args.seed is None else args.seed + round_, checkpoint=write,
                     max_time=left)
        done_rounds = round_ + 1
        write()
    console.print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
