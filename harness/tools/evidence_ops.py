"""What examining a case costs in torch operations: a benchmark that prints a table.

On a GPU the evidence (inputs, the float64 oracle at the case's inputs and its neighbours', the baseline samples)
and the verdict are thousands of small operations, each a kernel launch and its host-side dispatch, and every
scalar read back (``.item()``, ``float(t)``) a wait for the device. Their counts, unlike their times, are the same
on every machine: this counts them on the device given (the CPU by default), for cases drawn as a GPU campaign
draws them (GPU_BOUNDS):

    python -m ssdiff.tools.evidence_ops [--entry chunk_scan] [--dtype bfloat16] [--pass backward] [--cases 8]
        [--seed 1] [--device cpu] [--impl ref.quadratic]
    python -m ssdiff.tools.evidence_ops --by-chunks 1,8,32,64 [--dtype bfloat16] [--pass backward]
    python -m ssdiff.tools.evidence_ops --phases [--device cuda] [--impl mamba_ssm.chunk_scan_combined] [--dtype bfloat16]

Columns, per case: the evidence (materialize, oracle, baseline samples: `Examiner.evidence`) and the verdict of
one side (`verdict.judge`), as operations and as scalar reads. ``--by-chunks``: one chunk_scan case per count of
chunks (b=1 h=2 p=16 n=128, chunk 64), the evidence's operations by part: what grows with a long sequence (the
production shapes' 8 to 256 chunks). ``--phases``: seconds, not counts, of each part of examining a warm case
(`Examiner`'s own timing, harness/examine.py PHASES: the device synchronized after each part), for a small
shape and a production one (PHASE_SHAPES), the mean of the seeds after a first, compiling one.
"""

from __future__ import annotations

import argparse
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

SCALAR_READS = ("aten._local_scalar_dense.default", "aten.item.default")


class Counting(TorchDispatchMode):
    """Counts the aten operations dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def reads(self) -> int:
        return sum(self.ops[name] for name in SCALAR_READS)


def drawn(entry: str, dtype: str, backward: bool, count: int, seed: int) -> list:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    from ssdiff.campaign.config import GPU_BOUNDS
    from ssdiff.model.strategies import cases

    found = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(entry=entry, dtypes=(dtype,), bounds=GPU_BOUNDS, backward=backward))
    def collect(case):
        found.append(case)

    collect()
    return found[:count]


def by_chunks(counts, dtype: str, backward: bool, device: str) -> int:
    from ssdiff.examine import Examiner
    from ssdiff.model.case import Case

    print("| chunks | inputs ops (the case's and its neighbours') | oracle ops (at the inputs and two neighbours) "
          "| baseline ops (five samples) |")
    print("|---|---|---|---|")
    for c in counts:
        case = Case(batch=1, seqlen=64 * c, nheads=2, headdim=16, dstate=128, chunk_size=64, dtype=dtype,
                    pass_="backward" if backward else "forward", seed=1)
        parts = {}
        with Examiner([], device, meter=lambda phase: parts.setdefault(phase, Counting())) as examiner:
            examiner.evidence(case)
        print(f"| {c} | {parts['inputs'].total} | {parts['oracle'].total} | {parts['baseline'].total} |")
    return 0


# --phases: a shape a GPU campaign draws, and one at production shapes (seqlen >= 2048, dstate >= 128)
PHASE_SHAPES = {
    "small": dict(batch=2, seqlen=200, nheads=6, headdim=32, ngroups=2, dstate=32, chunk_size=64),
    "production": dict(batch=1, seqlen=2048, nheads=16, headdim=64, ngroups=1, dstate=128, chunk_size=256),
}
# ... and under the interpreter, where those would take minutes
PHASE_SHAPES_INTERPRETED = {"small": dict(batch=1, seqlen=16, nheads=2, headdim=4, ngroups=1, dstate=4, chunk_size=8)}


def phases(impl: str, dtype: str, device: str, seeds: int = 3) -> int:
    from ssdiff import runtime
    from ssdiff.model.case import Case
    from ssdiff.examine import PHASES, Examiner
    from ssdiff.verdict.judge import RUN_FAILURES

    shapes = PHASE_SHAPES_INTERPRETED if runtime.interpreted() else PHASE_SHAPES
    print("| shape | " + " | ".join(PHASES) + " | total |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    with Examiner([impl], device) as examiner:
        for shape in shapes.values():
            times = []
            for seed in range(seeds):
                outcome = examiner.examine(Case(**shape, dtype=dtype, has_z=True, pass_="backward", seed=seed))
                if outcome.verdicts[impl].status in RUN_FAILURES:
                    raise SystemExit(f"{impl} failed on {outcome.case.describe()}: {outcome.verdicts[impl].detail}")
                times.append(outcome.phases)
            warm = times[1:] or times                      # the first seed compiles
            mean = {k: sum(t[k] for t in warm) / len(warm) for k in PHASES}
            described = Case(**shape, dtype=dtype, has_z=True, pass_="backward").describe().split(" | seed")[0] \
                .replace(" | ", ", ")
            print(f"| {described} | " + " | ".join(f"{mean[k]:.3f} s" for k in PHASES)
                  + f" | {sum(mean.values()):.3f} s |")
    return 0


def main(argv=None) -> int:
    from ssdiff import runtime

    runtime.configure()
    parser = argparse.ArgumentParser(prog="python -m ssdiff.tools.evidence_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default="chunk_scan")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pass", dest="pass_", choices=("forward", "backward"), default="backward")
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--impl", default="ref.quadratic", help="the side whose verdict is counted")
    parser.add_argument("--by-chunks", default=None, metavar="N,N,...",
                        help="count the evidence of one chunk_scan case per number of chunks instead")
    parser.add_argument("--phases", action="store_true",
                        help="time each part of examining a warm case instead (--impl then defaults to "
                             "mamba_ssm.chunk_scan_combined)")
    args = parser.parse_args(argv)
    if args.phases:
        impl = "mamba_ssm.chunk_scan_combined" if args.impl == "ref.quadratic" else args.impl
        return phases(impl, args.dtype, args.device)
    if args.by_chunks:
        return by_chunks([int(n) for n in args.by_chunks.split(",")], args.dtype, args.pass_ == "backward",
                         args.device)

    from ssdiff.verdict import judge as verdict
    from ssdiff.examine import Examiner

    examiner = Examiner([args.impl], args.device)
    rows = []
    for case in drawn(args.entry, args.dtype, args.pass_ == "backward", args.cases, args.seed):
        with Counting() as evidence:
            ev = examiner.evidence(case)
        run = examiner.runner.run(args.impl, case, ev.inputs, False, "tuned")
        with Counting() as judged:
            verdict.judge(args.impl, case, ev.inputs, run.outputs, ev.truth, ev.baseline)
        rows.append((case.describe(), evidence.total, evidence.reads, judged.total, judged.reads))
    print("| case | evidence ops | evidence scalar reads | verdict ops | verdict scalar reads |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")
    mean = lambda i: sum(r[i] for r in rows) / max(len(rows), 1)
    print(f"| mean of {len(rows)} | {mean(1):.0f} | {mean(2):.0f} | {mean(3):.0f} | {mean(4):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
