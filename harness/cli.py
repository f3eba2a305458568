"""The ssdiff command line: thin over the library (harness.*); every command is a function here."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import sys
import time
import traceback

STARTED = time.perf_counter()       # the process's start, near enough: the throughput's setup time counts from here

from rich.console import Console
from rich.table import Table

from ssdiff import exits, runtime  # noqa: E402

console = Console()


def cmd_list(args) -> int:
    from ssdiff import runtime
    from ssdiff.sides import upstream
    from ssdiff.model.case import ENTRY_POINTS
    from ssdiff.sides.registry import all_implementations, get

    runtime.configure()
    out = Console(width=max(console.width, 132)) if not console.is_terminal else console
    impls = list(all_implementations()) + [get(target) for target in args.impl or ()]
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "chunk_scan": "scan",
             "split_conv1d": "mixer", "layer": "layer"}

    def names(values, order):
        return ", ".join(short.get(v, v) for v in order if v in values)

    out.print(f"[bold]runtime[/]: {runtime.describe()}")
    mamba, fla = upstream.mamba_ssm_problem(), upstream.fla_problem()
    if mamba is None:
        rel = upstream.mamba_ssm()
        stand = (f"; CPU stand-ins (float64-checked) for {', '.join(sorted(rel.standins))}" if rel.standins else "")
        out.print(f"[bold]mamba_ssm[/]: {rel.label} from {rel.location} (package __init__ not run){stand}")
    else:
        out.print(f"[bold]mamba_ssm[/]: not usable here: {mamba}")
    out.print(f"[bold]fla[/]: {upstream.fla().label}" if fla is None else f"[bold]fla[/]: not usable here: {fla}")
    from ssdiff.sides import upstream_vllm

    served = upstream_vllm.vllm_problem()
    if served is None:
        rel = upstream_vllm.vllm()
        out.print(f"[bold]vllm[/]: {rel.label} from {rel.location} (package __init__ not run; its "
                  f"model_executor/layers/mamba/ops only); stood in: {', '.join(sorted(rel.standins))} "
                  f"(no compiled extension, no platform machinery; harness/sides/upstream_vllm.py)", highlight=False)
    else:
        out.print(f"[bold]vllm[/]: not usable here: {served}", highlight=False)
    out.print(f"[bold]sglang[/]: not usable here: {upstream_vllm.sglang_problem()}", highlight=False)

    table = Table(title="ssdiff implementations")
    for col in ("name", "available here", "devices", "dtypes", "entry", "bwd", "stages"):
        table.add_column(col, overflow="fold")
    if args.verbose:
        table.add_column("what it is", overflow="fold")
    reasons = []
    for impl in impls:
        why = impl.unavailable()
        cap = impl.capabilities
        if why is None:
            here = "[green]yes[/]"
        elif why.startswith("needs a GPU"):
            here, _ = "[yellow]GPU only[/]", reasons.append((impl.name, why))
        else:
            here, _ = "[red]no[/]", reasons.append((impl.name, why))
        row = [impl.name, here, names(cap.devices, ("cpu", "cuda")),
               names(cap.dtypes, ("float32", "float16", "bfloat16")), names(cap.entries, ENTRY_POINTS),
               "yes" if cap.backward else "no", str(len(cap.stages)) if cap.stages else "-"]
        if args.verbose:
            row.append(impl.description)
        table.add_row(*row)
    out.print(table)
    for name, why in reasons:
        out.print(f"  {why}" if why.startswith(name) else f"  {name}: {why}", highlight=False)
    return 0


def cmd_selfcheck(args) -> int:
    from ssdiff.tools import selfcheck

    table = Table(title=f"oracle self-check: each oracle against ref.recurrent "
                        f"(rtol {selfcheck.RTOL:g}, atol {selfcheck.ATOL:g})")
    for col in ("case", "oracle", "worst quantity", "relative difference", "of tolerance", "ok"):
        table.add_column(col)
    rows = selfcheck.run(device=args.device)
    for row in rows:
        table.add_row(row.case.describe(), row.oracle, row.worst_name, f"{row.worst_relative:.2e}", f"{row.worst:.2g}",
                      "[green]yes[/]" if row.ok else "[red]NO[/]")
    console.print(table)
    bad = [r for r in rows if not r.ok]
    console.print(f"{len(rows) - len(bad)}/{len(rows)} comparisons within tolerance")
    return 1 if bad else 0


def cmd_case(args) -> int:
    from ssdiff.model.case import Case, CaseError

    status = exits.OK
    for path in args.paths:
        try:
            console.print(f"{path}: {Case.load(path).describe()}", highlight=False)
        except CaseError as err:
            print(f"ssdiff case: {path}: {err}", file=sys.stderr)
            status = exits.USAGE
    return status


def cmd_report(args) -> int:
    """Render saved runs (fuzz output directories) as HTML pages and rebuild the index of runs."""
    from ssdiff.report import browser, render

    if args.output and len(args.runs) != 1:
        console.print("[red]ssdiff report: --output takes exactly one run directory[/]")
        return 2
    status, rendered = 0, 0
    for run_dir in args.runs:
        try:
            page = render.render_run(run_dir, args.reports, name=args.name, output=args.output, index=False)
        except render.RunError as err:
            print(f"ssdiff report: {err}", file=sys.stderr)
            status = 2
            continue
        rendered += 1
        console.print(f"{run_dir} -> {page} ({page.stat().st_size / 1024:.0f} KB)", highlight=False)
        if args.browser_check:
            shot = page.with_name("screenshot.png")
            check = browser.open_page(page, screenshot=shot)
            errors, requests = check.console_errors, check.network_requests
            console.print(f"  {check.version}: loaded in {check.load_ms:.0f} ms, {len(errors)} console errors, "
                          f"{len(requests)} network requests, screenshot {shot}", highlight=False)
            for line in errors + requests:
                console.print(f"  {line}", highlight=False)
            if errors or requests or not check.loaded:
                status = max(status, 1)
    if args.output is None and rendered:
        console.print(f"index: {render.render_index(args.reports)}", highlight=False)
    return status


def cmd_fuzz(args) -> int:
    """Fuzz an implementation against another (or the oracle); exit 1 on a divergence, 0 on none, 2 on bad usage.
    `ssdiff demo` runs it on the built-in default target (DEMO below) with a short budget."""
    from ssdiff.campaign.fuzz import Fuzzer

    config = _fuzz_config(args)
    if getattr(args, "cluster", None):
        from ssdiff.campaign import cluster

        return cluster.run(args, args.argv[1:], console, Console(stderr=True))
    if getattr(args, "jobs", 1) > 1:
        from ssdiff.campaign import jobs

        return jobs.run(args, args.argv[1:], console, Console(stderr=True))
    fuzzer = Fuzzer(config, started=STARTED)
    args.run_folder = fuzzer.out_dir
    report = _run_with_progress(fuzzer)
    _print_run(fuzzer, report)
    return report.exit_code


def _fuzz_config(args):
    """The FuzzConfig the flags of `ssdiff fuzz` (or `demo`) say."""
    from ssdiff.campaign.fuzz import FuzzConfig
    from ssdiff.model.strategies import Bounds

    demo = args.command == "demo"
    impl, against = (DEMO["impl"], DEMO["against"]) if demo else (args.impl, args.against)
    max_time, max_examples = getattr(args, "max_time", None), getattr(args, "max_examples", None)
    if max_time is None and max_examples is None:
        max_time = DEMO["max_time"] if demo else 300.0
    autotune = getattr(args, "autotune", "tuned")
    if isinstance(autotune, str) and autotune.isdigit():
        autotune = int(autotune)
    bounds = None
    sizes = {k: getattr(args, k, None) for k in ("max_batch", "max_seqlen", "max_nheads", "max_headdim", "max_dstate")}
    chunk_sizes = getattr(args, "chunk_sizes", None)
    if any(v is not None for v in sizes.values()) or chunk_sizes:
        from ssdiff import runtime
        from ssdiff.campaign.config import GPU_BOUNDS

        start = GPU_BOUNDS if (args.device or runtime.default_device()).startswith("cuda") else Bounds()
        fields = {k: v for k, v in sizes.items() if v is not None}
        if chunk_sizes:
            fields["chunk_sizes"] = chunk_sizes
        bounds = Bounds(**{**start.__dict__, **fields})
    config = FuzzConfig(
        impl=impl, against=against, max_time=max_time, max_examples=max_examples,
        entry=getattr(args, "entry", None), pass_=getattr(args, "pass_", DEMO["pass_"] if demo else "mixed"),
        dtypes=tuple(args.dtype.split(",")) if getattr(args, "dtype", None) else None, autotune=autotune,
        device=args.device, out_dir=getattr(args, "out", None), isolate=getattr(args, "isolate", False),
        timeout=getattr(args, "timeout", 300.0), keep_going=getattr(args, "keep_going", False),
        seed=getattr(args, "seed", None), localize=not getattr(args, "no_localize", False),
        minimize=not getattr(args, "no_minimize", False), bounds=bounds, pool=getattr(args, "pool", None),
        known=DEMO["known"] if demo else getattr(args, "known", "report"), huge=getattr(args, "huge", 0.0),
        oracle=getattr(args, "oracle", None) or "ref.chunked", post_time=getattr(args, "post_time", None),
        example_db=getattr(args, "example_db", None))
    if getattr(args, "no_report", False):
        config.report_dir = None
    return config


def _run_with_progress(fuzzer):
    """Run the campaign, its first line and progress on stderr (a live line on a terminal, one every 15 s
    elsewhere); the first Ctrl-C ends the search after the case being judged."""
    import time

    from rich.live import Live
    from rich.text import Text

    from ssdiff.campaign.progress import progress_text

    config = fuzzer.config
    err_console = Console(stderr=True)
    against_text = config.against or f"the float64 oracle ({config.oracle})"
    budget = " and ".join(([f"{config.max_time:g} s"] if config.max_time is not None else [])
                          + ([f"{config.max_examples} cases"] if config.max_examples is not None else []))
    post = "localize and minimize" if config.localize and config.minimize else \
        "localize" if config.localize else "minimize" if config.minimize else None
    err_console.print(f"fuzz {config.impl} against {against_text} on {config.device} "
                      f"({', '.join(config.dtypes)}; pass {config.pass_}; autotune {config.autotune}"
                      f"{'; isolated' if config.isolate else ''}) -> {fuzzer.out_dir}; search up to {budget}"
                      + (f", then {post} within {fuzzer.plan.post_time:g} s" if post else ""),
                      highlight=False, soft_wrap=True)
    state = {"tried": 0, "skipped": 0, "elapsed": 0.0, "worst": {}, "divergences": 0}
    last_print = [0.0]

    def line() -> Text:
        return Text(progress_text(state, config.max_time, config.max_examples))

    class Line:
        def __rich__(self):
            return line()

    def progress(update: dict):
        state.update(update)
        if not err_console.is_terminal and time.monotonic() - last_print[0] > 15:
            last_print[0] = time.monotonic()
            err_console.print(line(), highlight=False, soft_wrap=True)

    fuzzer.progress = progress

    def interrupted(signum, frame):
        # The first Ctrl-C (or a `--jobs` parent's SIGINT) ends the search after the case being judged, with
        # the summary and report written; a second one interrupts at once.
        fuzzer.request_stop("interrupted")
        signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        previous = signal.signal(signal.SIGINT, interrupted)
    except ValueError:                      # not the main thread: no handler, Ctrl-C interrupts at once
        previous = None
    try:
        if err_console.is_terminal:
            with Live(Line(), console=err_console, refresh_per_second=2, transient=False):
                report = fuzzer.run()
        else:
            report = fuzzer.run()
            err_console.print(line(), highlight=False, soft_wrap=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return report


def _print_run(fuzzer, report) -> None:
    """What the campaign found and measured: each finding, the known defects, the tallies, the verdict line."""
    err_console = Console(stderr=True)
    for finding in report.findings:
        console.rule(f"divergence {finding.number} (after {finding.found_after_s:.1f} s, "
                     f"{finding.cases_before + 1} cases judged)")
        console.print(fuzzer.message(finding), highlight=False, markup=False, soft_wrap=True)
        console.print(f"-> {finding.path}", highlight=False, soft_wrap=True)
        if finding.minimized is not None:
            result = finding.minimized
            partial = f" (partial: {result.shrunk.stopped})" if result.partial else ""
            console.print(f"minimized in {finding.minimize_seconds:.1f} s ({result.shrunk.runs} runs){partial}: "
                          f"{result.minimal.describe()}", highlight=False, soft_wrap=True)
            console.print(f"-> {result.repro_path}", highlight=False, soft_wrap=True)
        elif finding.minimize_problem:
            err_console.print(f"  minimize: {finding.minimize_problem}", highlight=False, soft_wrap=True)
    for finding in report.tf32_explained:
        console.rule(f"divergence {finding.number}: TF32's loss (after {finding.found_after_s:.1f} s)")
        console.print(fuzzer.message(finding), highlight=False, markup=False, soft_wrap=True)
        console.print(f"-> {finding.path}", highlight=False, soft_wrap=True)
    if report.known:
        console.rule("known defects of the installed releases")
        for entry in report.known.values():
            if entry["reproduced"]:
                seen = (f"reproduced in {entry['reproduced']} case(s), first after {entry['first_after_s']:.1f} s: "
                        f"{entry['first_case']}")
            elif entry["matched_not_reproduced"]:
                seen = f"predicate matched {entry['matched_not_reproduced']} time(s), not reproduced"
            else:
                seen = "predicate never matched"
            if entry["reproduced"] and entry["matched_not_reproduced"]:
                seen += f"; matched {entry['matched_not_reproduced']} more time(s) without diverging"
            console.print(f"{entry['id']} ({entry['status']}): {seen}", highlight=False, soft_wrap=True)
    if report.report_path:
        console.print(f"report: {report.report_path}", highlight=False, soft_wrap=True)
    worst = ", ".join(f"{d} {w['ratio']:.3g}x ({w['tensor']}, {w['side']})" for d, w in sorted(report.worst.items()))
    console.print(f"{report.tried} cases judged, {report.skipped} skipped; stopped: {report.stopped}; "
                  f"largest ratio to budget: {worst or 'none'}", highlight=False, soft_wrap=True)
    memory = {why: n for why, n in report.skip_reasons.items() if why.startswith("out of device memory")}
    if memory:
        err_console.print(f"[yellow]{sum(memory.values())} case(s) not judged for want of device memory ("
                          + "; ".join(f"{why}: {n}" for why, n in memory.items())
                          + "): other processes on the device, or cases too large for it[/]",
                          highlight=False, soft_wrap=True)
    drawn = report.tried + report.skipped + len(report.harness_errors)
    if report.skipped and report.skipped >= report.tried:
        top = sorted(report.skip_reasons.items(), key=lambda kv: -kv[1])[:3]
        err_console.print(f"[yellow]{report.skipped} of {drawn} drawn case(s) were skipped, not judged; the most "
                          f"common reasons: " + "; ".join(f"{why} ({n})" for why, n in top) + "[/]",
                          highlight=False, soft_wrap=True)
    if report.harness_errors:
        errors = {}
        for item in report.harness_errors:
            errors[item["error"].split(" (at ")[0]] = errors.get(item["error"].split(" (at ")[0], 0) + 1
        top = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        err_console.print(f"[yellow]{len(report.harness_errors)} of {drawn} drawn case(s) failed inside ssdiff itself "
                          f"(not the implementation): " + "; ".join(f"{why} ({n})" for why, n in top)
                          + " (cases in summary.json)[/]", highlight=False, soft_wrap=True)
    known_cases = sum(entry["reproduced"] for entry in report.known.values())
    verdict = (f"{len(report.findings)} new cause(s), {report.divergent_cases} divergent case(s)" if report.findings
               else f"judged too little to mean anything: {report.judged_too_little}" if report.judged_too_little
               else "no new divergence")
    apart = ([f"{known_cases} case(s) of known defects"] if known_cases else []) + \
        ([f"{len(report.tf32_explained)} float32 divergence(s) within budget with exact float32 dots: TF32's loss"]
         if report.tf32_explained else [])
    if apart:
        verdict += f" ({'; '.join(apart)})"
    console.print(f"{verdict}; output: {report.out_dir}/ (summary.json"
                  f"{', divergence-*/case.json, verdict.json' if report.findings else ''})", highlight=False,
                  soft_wrap=True)


# The built-in default target of `ssdiff demo` (README quick start): the fused mixer against its reference,
# forward only, until the seed divergence (harness/truth/README.md, "The fused mixer") is found or the time budget is spent.
# The seed divergence is a known defect (harness/registry/known.py); the demo finds it unaided (--known ignore).
DEMO = {"impl": "mamba_ssm.split_conv1d_combined", "against": "mamba_ssm.split_conv1d_ref", "max_time": 120.0,
        "pass_": "forward", "known": "ignore"}


def _add_fuzz_arguments(p, demo: bool = False):
    from ssdiff.model.case import ENTRY_POINTS
    from ssdiff.campaign.config import PASSES
    from ssdiff.truth import ORACLES

    if not demo:
        p.add_argument("--impl", required=True, metavar="NAME",
                       help="the implementation to fuzz: a name from `ssdiff list`, or module:attr")
        p.add_argument("--against", default=None, metavar="NAME",
                       help="a second implementation to compare with (default: the float64 oracle)")
    p.add_argument("--max-time", type=_seconds, default=None, metavar="S",
                   help=f"time budget of the search in seconds (default {DEMO['max_time']:g} for demo, 300 for "
                        f"fuzz, unless --max-examples is given)")
    p.add_argument("--max-examples", type=_positive_int, default=None, metavar="N",
                   help="example budget (cases judged)")
    p.add_argument("--post-time", type=_seconds, default=None, metavar="S",
                   help="seconds for localizing and minimizing the divergences after the search (default: half the "
                        "time budget, at least 30; 600 with an example budget alone); what is unfinished then is "
                        "saved as it stands, said to be partial")
    p.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default ssdiff-out/fuzz-<time>)")
    p.add_argument("--seed", type=_nonnegative_int, default=None, help="Hypothesis seed (reproducible search)")
    if demo:
        return
    p.add_argument("--entry", choices=ENTRY_POINTS, default=None, help="entry point (default: every one both take)")
    p.add_argument("--pass", dest="pass_", choices=PASSES, default="mixed",
                   help="forward only, forward+backward (gradients), or mixed (drawn per case; default)")
    p.add_argument("--dtype", default=None, metavar="D[,D]",
                   help="dtypes, comma-separated (default: every dtype all sides run here)")
    p.add_argument("--autotune", default="tuned", metavar="POLICY",
                   help="autotune configs: tuned (default), an index N (config N %% count of every kernel), "
                        "random (an index drawn per case), sweep (every config, every case)")
    p.add_argument("--pool", action=argparse.BooleanOptionalAction, default=None,
                   help="draw each search round from a few compile keys, compiled ahead (harness/campaign/pool.py; default: "
                        "natively yes, under the interpreter no)")
    p.add_argument("--huge", type=_chance, default=0.0, metavar="RATE",
                   help="the chance a production key is huge instead: 2**31 elements or more in x or the chunk "
                        "states, forward chunk_scan cases judged on a slice (harness/inputs/huge.py; natively only, "
                        "where the device has room; the nightly campaign's)")
    p.add_argument("--isolate", action="store_true",
                   help="run implementations in a child process: abort, segfault, a poisoned CUDA context and "
                        "hangs become verdicts and the run goes on")
    p.add_argument("--timeout", type=_seconds, default=300.0, metavar="S", help="seconds per run under --isolate")
    p.add_argument("--keep-going", action="store_true", help="do not stop at the first divergence (bucket them)")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="run the campaign as N processes side by side, each with its own seed and a share of the "
                        "example budget and compile workers, merged into one output (harness/campaign/jobs.py); exit 3 "
                        "when a job died without a divergence found")
    p.add_argument("--cluster", default=None, metavar="ADDRESS|auto|local[:N]",
                   help="run those campaigns as workers of a Ray cluster, one GPU each (else one CPU, interpreted): "
                        "at ADDRESS, the running one (auto), or one started here (local:N, N workers; elsewhere "
                        "--jobs N of them, default one per GPU, else per CPU); one merged output, exit statuses as "
                        "--jobs (harness/campaign/cluster.py; needs pip install 'ssdiff[cluster]')")
    p.add_argument("--example-db", default=None, metavar="PATH|redis://...",
                   help="a shared example database (a directory, or Redis): its divergent cases of these sides are "
                        "judged first, before any new case, and each new divergence's case is saved there "
                        "(default: none)")
    p.add_argument("--no-report", action="store_true", help="do not render the HTML report")
    p.add_argument("--no-localize", action="store_true", help="skip stage / coordinate / feature localization")
    p.add_argument("--no-minimize", action="store_true", help="do not minimize divergences (minimized.json, repro.py)")
    p.add_argument("--known", choices=("report", "skip", "ignore"), default="report",
                   help="known upstream defects (`ssdiff known`): report (judge and label them; default), skip "
                        "(leave their cases out, but those of a record that bounds its error), ignore (do not "
                        "consult the registry: they count as new)")
    p.add_argument("--oracle", choices=ORACLES, default=None, help="the float64 truth (default ref.chunked)")
    for name in ("batch", "seqlen", "nheads", "headdim", "dstate"):
        p.add_argument(f"--max-{name}", dest=f"max_{name}", type=_positive_int, default=None, metavar="N",
                       help=f"largest {name} drawn")
    p.add_argument("--chunk-sizes", type=_chunk_sizes, default=None, metavar="Q[,Q]",
                   help="chunk sizes drawn (powers of two)")


class Parser(argparse.ArgumentParser):
    """argparse with bad usage said in one line (the flag, what was expected, what was given) and exit status 2."""

    def error(self, message):
        self.exit(exits.USAGE, f"{self.prog}: {message}\n")


def _integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def _nonnegative_int(text: str) -> int:
    return _integer(text, 0, "a non-negative integer")


def _seconds(text: str) -> float:
    """A time budget: a positive finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number of seconds, got {text!r}")
    return value


def _chance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a chance between 0 and 1, got {text!r}")
    return value


def _chunk_sizes(text: str) -> tuple:
    """Comma-separated powers of two."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(q < 1 or q & (q - 1) for q in sizes):
        raise argparse.ArgumentTypeError(f"expected powers of two separated by commas (4,8,16), got {text!r}")
    return sizes


def _device(text: str) -> str:
    """A device torch can use here."""
    why = runtime.device_problem(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


def _sides_for(args, path) -> tuple:
    """--impl/--against, or the sides recorded next to the case: a saved run's verdict.json, or a finding's
    finding.json (reports/findings/ID/)."""
    from ssdiff.examine import UsageError
    from ssdiff.registry.findings import recorded_sides as finding_sides
    from ssdiff.store import recorded_sides

    if args.impl:
        return args.impl, args.against
    recorded = recorded_sides(path) or finding_sides(path)
    if not recorded:
        raise UsageError(f"{path}: no verdict.json or finding.json next to it names the implementations: give --impl")
    return recorded[0], (recorded[1] if len(recorded) > 1 else args.against)


def cmd_minimize(args) -> int:
    """Shrink a diverging case; exit 1 when the divergence persists (minimized), 0 when it no longer diverges."""
    import time
    from pathlib import Path

    from ssdiff.model.case import Case
    from ssdiff.investigate.minimize import NotDiverging, minimize
    from ssdiff.registry import known

    path = Path(args.case)
    case = Case.load(path)
    impl, against = _sides_for(args, path)
    err = Console(stderr=True)
    start = time.perf_counter()
    kept = [0]

    def on_step(step):
        if step.kept:
            kept[0] += 1
            err.print(f"  [{time.perf_counter() - start:5.1f} s] kept: {step.change:<32} -> {step.case.describe()}",
                      highlight=False, soft_wrap=True)

    err.print(f"minimize {impl}{' vs ' + against if against else ' vs the oracle'}: {case.describe()}",
              highlight=False, soft_wrap=True)
    try:
        result = minimize(case, impl, against, device=args.device, out_dir=args.out or path.parent, on_step=on_step,
                          max_runs=args.max_runs, isolate=args.isolate, choice=args.autotune, max_time=args.max_time)
    except NotDiverging as exc:
        console.print(f"nothing to minimize: {exc}", highlight=False, soft_wrap=True)
        return 0
    console.rule("minimized")
    console.print(f"original: {result.original.describe()}", highlight=False, soft_wrap=True)
    console.print(f"minimal:  {result.minimal.describe()}", highlight=False, soft_wrap=True)
    console.print(f"{len(result.shrunk.kept)} steps kept of {result.shrunk.runs} tried in "
                  f"{time.perf_counter() - start:.1f} s; first divergent stage kept: {result.first_stage or 'n/a'}"
                  + (f"; partial: {result.shrunk.stopped}, the smallest case reached" if result.partial else ""),
                  highlight=False)
    if result.irrelevant():
        console.print("did not matter (removed): " + ", ".join(result.irrelevant()), highlight=False)
    for v in result.outcome.verdicts.values():
        console.print(v.message(), highlight=False, markup=False, soft_wrap=True)
    for line in known.known_lines(result.outcome):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for f in result.files:
        console.print(f"-> {f}", highlight=False, soft_wrap=True)
    return 1


def cmd_replay(args) -> int:
    """Judge a saved case again; compare with the verdict stored next to it. Exit 1 if it diverges."""
    from pathlib import Path

    from ssdiff.model.case import Case
    from ssdiff.investigate.minimize import replay
    from ssdiff.registry import known
    from ssdiff.store import stored_verdicts

    path = Path(args.case)
    case = Case.load(path)
    impl, against = _sides_for(args, path)
    outcome = replay(case, impl, against, device=args.device, choice=args.autotune, isolate=args.isolate,
                     top=args.worst)
    console.print(case.describe(), highlight=False, soft_wrap=True)
    for v in outcome.verdicts.values():
        console.print(v.message(), highlight=False, markup=False, soft_wrap=True)
    for line in known.known_lines(outcome):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    stored = stored_verdicts(path)
    if stored:
        same = True
        for side, v in outcome.verdicts.items():
            old = stored.get(side)
            now = v.to_dict()
            if old is None or (old["status"], old["ratio"]) != (now["status"], now["ratio"]):
                same = False
                console.print(f"{side}: stored {old and (old['status'], old['ratio'])}, now "
                              f"{(now['status'], now['ratio'])}", highlight=False)
        console.print("reproduces the stored verdict exactly" if same else "DIFFERS from the stored verdict",
                      highlight=False)
    return 1 if outcome.diverged else 0


def _config_choice(text: str):
    """--autotune of replay and minimize: "tuned" or a non-negative config index."""
    if text == "tuned":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected 'tuned' or a config index (0, 1, ...), got {text!r}")


def cmd_known(args) -> int:
    """The known-defect registry (harness/registry/known.py) for the installed releases: one line per defect with its
    status and the command that reproduces it; ``--case ID`` prints that defect's example case as JSON; ``--repro
    ID`` writes finding ID's repro.py from its files under reports/findings/ (``--out FILE`` elsewhere)."""
    from ssdiff.registry import known
    from ssdiff import runtime
    from ssdiff.sides.registry import get

    runtime.configure()
    if args.repro:
        from ssdiff.registry import findings

        try:
            path = findings.write_repro(args.repro, args.out)
        except findings.NoRepro as why:
            print(f"ssdiff known: {why}", file=sys.stderr)
            return 2
        print(path)
        return 0
    if args.case:
        if args.case not in known.BY_ID:
            print(f"ssdiff known: no defect {args.case!r} (known: {', '.join(known.BY_ID)})", file=sys.stderr)
            return 2
        print(known.BY_ID[args.case].example.to_json())
        return 0
    names = {get(name).name for name in args.impl} if args.impl else None
    for d in known.DEFECTS:
        if names is not None and not names & set(d.implementations):
            continue
        version = known.installed_version(d.package)
        installed = f"{d.package} {version} {'affected' if d.affects(version) else 'not affected'}" if version \
            else f"{d.package} not installed"
        console.print(f"{d.id} ({d.status}; {d.severity}): {', '.join(d.implementations)}; {d.releases}; "
                      f"{installed}\n  {d.statement}\n  upstream: {d.upstream}\n  reproduce: {d.replay_command()}",
                      highlight=False, markup=False, soft_wrap=True)
    return 0


def cmd_bisect(args) -> int:
    """Which releases of a package a case diverges on (harness/registry/bisect.py): a table of the releases probed
    (release, verdict, ratio) and the first bad and first good release."""
    import time

    from ssdiff.examine import UsageError
    from ssdiff.registry import bisect

    start = time.perf_counter()
    try:
        what = bisect.target(args.target, args.impl, args.package)
        if args.store and what.record is None:
            raise bisect.BisectError("--store needs a known defect's id (its result goes to reports/findings/ID/)")
        console.print(f"bisect {what.package} {args.releases or '(every release)'} for {what.impl} on {args.target}",
                      highlight=False, soft_wrap=True)

        def show(probe):
            ratio = f"{probe.ratio:.3g}" if probe.ratio is not None else "-"
            console.print(f"  {probe.release:<14} {probe.verdict:<5} {ratio:>10}  {probe.seconds:6.1f} s  "
                          f"{probe.detail}", highlight=False, markup=False, soft_wrap=True)

        result = bisect.bisect(what.case_json, what.impl, what.package, args.releases, what.hint, args.offline,
                               args.device, show, what.raises)
    except bisect.BisectError as err:
        raise UsageError(str(err)) from None
    console.rule("releases probed")
    console.print(f"{'release':<14} {'verdict':<7} {'ratio':>10}", highlight=False)
    for probe in result.tested:
        ratio = f"{probe.ratio:.3g}" if probe.ratio is not None else "-"
        console.print(f"{probe.release:<14} {probe.verdict:<7} {ratio:>10}", highlight=False)
    console.print(f"first bad: {result.first_bad or 'none in the range'}; first good: "
                  f"{result.first_good or 'none in the range'} ({len(result.tested)} of {len(result.releases)} "
                  f"releases probed, {time.perf_counter() - start:.0f} s)", highlight=False)
    if args.store:
        console.print(f"-> {bisect.store(what.record, result)}", highlight=False, soft_wrap=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ssdiff import runtime

    parser = Parser(prog="ssdiff", description=__doc__.splitlines()[0], epilog=exits.SUMMARY)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    p = sub.add_parser("list", help="every implementation, whether it runs here, and why not")
    p.add_argument("--impl", action="append", metavar="MODULE:FUNCTION",
                   help="also list a callable with mamba_chunk_scan_combined's signature (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="describe each implementation")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("selfcheck", help="the three float64 oracles against each other")
    p.add_argument("--device", type=_device, default=runtime.default_device())
    p.set_defaults(func=cmd_selfcheck)
    p = sub.add_parser("case", help="validate case files and print each one's one-line description")
    p.add_argument("paths", nargs="+", metavar="CASE.json")
    p.set_defaults(func=cmd_case)
    p = sub.add_parser("demo", help="the built-in default job (README quick start): fuzz the fused Mamba-2 mixer "
                                    "against its reference until the seed divergence is found")
    _add_fuzz_arguments(p, demo=True)
    p.set_defaults(func=cmd_fuzz)
    p = sub.add_parser("fuzz", help="search (Hypothesis) for cases where an implementation diverges; localize them")
    _add_fuzz_arguments(p)
    p.set_defaults(func=cmd_fuzz)
    for name, func, text in (("minimize", cmd_minimize, "shrink a diverging case.json to the smallest case with the "
                                                        "same divergence; write minimized.json and repro.py"),
                             ("replay", cmd_replay, "judge a saved case.json again, compare with its stored "
                                                    "verdict and name the known defect that explains a divergence")):
        p = sub.add_parser(name, help=text)
        p.add_argument("case", metavar="CASE.json")
        p.add_argument("--impl", help="implementation (default: the sides in the verdict.json next to the case)")
        p.add_argument("--against", help="the other side (default: the float64 oracle, or the recorded side)")
        p.add_argument("--device", type=_device, default=None)
        p.add_argument("--isolate", action="store_true", help="run implementations in a child process")
        p.add_argument("--autotune", default="tuned", type=_config_choice, metavar="CHOICE",
                       help="tuned (default), or an index N: every autotuned kernel runs config N %% its count (a "
                            "divergence that depends on the config)")
        if name == "replay":
            p.add_argument("--worst", type=_nonnegative_int, default=0, metavar="N",
                           help="also list, for each tensor out of budget, its N elements of the largest ratios")
        if name == "minimize":
            p.add_argument("--out", help="output folder (default: the case's folder)")
            p.add_argument("--max-runs", type=_positive_int, default=300, help="at most this many candidate runs")
            p.add_argument("--max-time", type=_seconds, default=None, metavar="S",
                           help="seconds shrinking may take (default: no bound); the smallest case reached then "
                                "is written, said to be partial")
        p.set_defaults(func=func)
    p = sub.add_parser("known", help="the known upstream defects (registry), for the installed releases")
    p.add_argument("--impl", action="append", metavar="NAME", help="only this implementation's (repeatable)")
    p.add_argument("--case", metavar="ID", help="print defect ID's example case (JSON) and exit")
    p.add_argument("--repro", metavar="ID", help="write finding ID's repro.py (FINDINGS.md) from its files under "
                                                 "reports/findings/ID/, print its path and exit")
    p.add_argument("--out", metavar="FILE", help="with --repro: write it to FILE (default: reports/findings/ID/repro.py)")
    p.set_defaults(func=cmd_known)
    p = sub.add_parser("bisect", help="which releases of a package a known defect's example or a case diverges on")
    p.add_argument("target", metavar="FINDING|CASE.json", help="a known defect's id (its example) or a case file")
    p.add_argument("--impl", metavar="NAME", help="the implementation (default: the record's first)")
    p.add_argument("--package", help="the package whose releases are bisected (default: the record's, else mamba-ssm)")
    p.add_argument("--releases", metavar="A..B", help="only releases from A to B (either end optional)")
    p.add_argument("--offline", action="store_true", help="only releases already in the release cache")
    p.add_argument("--device", type=_device, default=None)
    p.add_argument("--store", action="store_true", help="write the result to reports/findings/ID/bisect.json")
    p.set_defaults(func=cmd_bisect)
    p = sub.add_parser("report", help="render saved runs (fuzz output directories) as self-contained HTML pages")
    p.add_argument("runs", nargs="+", metavar="DIR", help="a saved run: summary.json and divergence-*/ folders")
    p.add_argument("--reports", default=None, metavar="ROOT",
                   help="reports folder: each run goes to ROOT/<run name>/index.html, the index to ROOT/index.html "
                        "(default: $SSDIFF_REPORTS, else reports)")
    p.add_argument("--name", default=None, help="the run's name in the reports folder (default: DIR's name)")
    p.add_argument("--output", default=None, metavar="FILE", help="write the page to FILE instead (no index)")
    p.add_argument("--browser-check", action="store_true",
                   help="open each page in headless Chromium: print its load time, console errors and network "
                        "requests (exit 1 if any), and save a screenshot beside it")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv=None) -> int:
    """Run one command; the exit status follows ssdiff.exits: bad input and environments are one line and 2, and a
    failure inside ssdiff is one line and 5, its traceback saved to a file."""
    from ssdiff.examine import UsageError
    from ssdiff.model.case import CaseError
    from ssdiff.registry.findings import NoRepro
    from ssdiff.sides.registry import UnknownImplementation
    from ssdiff.store import RunError

    args = None
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return args.func(args)
    except (UsageError, CaseError, RunError, UnknownImplementation, NoRepro) as err:
        print(f"ssdiff {args.command}: {err}", file=sys.stderr)
        return exits.USAGE
    except KeyboardInterrupt:
        print("ssdiff: interrupted", file=sys.stderr)
        return 130
    except Exception as err:                # a bug of ssdiff's own: one line, the traceback kept
        path = _save_traceback(getattr(args, "run_folder", None) or "ssdiff-out")
        first = (str(err).splitlines() or [""])[0][:200]
        command = f"ssdiff {args.command}" if args is not None else "ssdiff"
        print(f"{command}: internal error ({type(err).__name__}: {first}); its traceback is in {path}: please report "
              f"it with that file", file=sys.stderr)
        return exits.INTERNAL


def _save_traceback(folder) -> str:
    """The exception being handled, written with the command line and versions into ``folder``; its path."""
    os.makedirs(folder, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(folder, f"internal-error-{stamp}.txt")
    with open(path, "w", encoding="utf-8") as out:
        out.write(f"ssdiff {' '.join(sys.argv[1:])}\npython {sys.version.split()[0]}, {runtime.describe()}\n\n")
        out.write(traceback.format_exc())
    return path


if __name__ == "__main__":
    sys.exit(main())
