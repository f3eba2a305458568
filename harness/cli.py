"""The ssdiff command line: thin over the library (harness.*); every command is a function here."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

console = Console()


def cmd_list(args) -> int:
    from harness.impls import all_implementations

    table = Table(title="ssdiff implementations")
    for col in ("name", "entry points", "dtypes", "devices", "bwd", "available here", "what it is"):
        table.add_column(col)
    for impl in all_implementations():
        cap = impl.capabilities
        why = impl.unavailable()
        table.add_row(impl.name, ", ".join(sorted(cap.entries)), ", ".join(sorted(cap.dtypes)),
                      ", ".join(sorted(cap.devices)), "yes" if cap.backward else "no",
                      "yes" if why is None else f"no: {why}", impl.description)
    console.print(table)
    return 0


def cmd_selfcheck(args) -> int:
    from harness import selfcheck

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
    from harness.case import Case

    for path in args.paths:
        console.print(f"{path}: {Case.load(path).describe()}", highlight=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssdiff", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="every implementation, whether it runs here, and why not")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("selfcheck", help="the three float64 oracles against each other")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_selfcheck)
    p = sub.add_parser("case", help="validate case files and print each one's one-line description")
    p.add_argument("paths", nargs="+", metavar="CASE.json")
    p.set_defaults(func=cmd_case)
    p = sub.add_parser("demo", help="the built-in default job (README quick start)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_selfcheck)
    return parser


def main(argv=None) -> int:
    from harness import runtime
    from harness.case import CaseError

    runtime.configure()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CaseError as err:
        # Bad input is one line naming the field, never a traceback.
        print(f"ssdiff: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
