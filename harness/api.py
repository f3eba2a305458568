"""What a script or a kernel team's own test suite calls: check one case, fuzz, minimize, replay, list known defects.

    import ssdiff
    from hypothesis import given

    @given(ssdiff.cases(entry="chunk_scan"))
    def test_my_kernel(case):
        ssdiff.check(my_kernel, case)        # raises ssdiff.Divergence with the verdict's message

The CLI and the pytest plugin are thin over these functions and the modules they call.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

from ssdiff import runtime
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer, FuzzReport
from ssdiff.examine import Examiner, Outcome, UsageError
from ssdiff.investigate import minimize as minimizing
from ssdiff.model.case import Case
from ssdiff.registry import known as registry
from ssdiff.sides.adapters.generic import CallableImplementation
from ssdiff.sides.base import Implementation
from ssdiff.sides.registry import all_implementations, register


class Divergence(AssertionError):
    """``check`` found a divergence: the message says which tensors differed, by how much against their budget,
    where, which known defect explains it (if one does), and how to replay the case. ``outcome`` holds the
    verdicts, outputs and evidence.

    What ``check`` raises is a subclass per diverging side and status (`kind_of`): Hypothesis tells failures apart
    by their exception type, so a search that meets an implementation raising on one case and computing wrong
    numbers on another reports both, and shrinking one cannot slip into the other."""

    def __init__(self, message: str, outcome: Outcome):
        super().__init__(message)
        self.outcome = outcome


_kinds: dict = {}


def kind_of(outcome: Outcome) -> type:
    """The Divergence subclass of ``outcome``'s failing sides and their statuses (one class per combination)."""
    key = tuple(sorted((side, v.status) for side, v in outcome.failing.items()))
    if key not in _kinds:
        words = "; ".join(f"{side} {status}" for side, status in key)
        _kinds[key] = type(f"Divergence[{words}]", (Divergence,), {"__module__": __name__})
    return _kinds[key]


def _side(implementation) -> str:
    """The name an Examiner resolves for what ``check`` was given (an object is registered under its name)."""
    if isinstance(implementation, str):
        return implementation
    if isinstance(implementation, Implementation):
        return register(implementation).name
    if callable(implementation):
        return register(CallableImplementation(f"{implementation.__module__}:{implementation.__qualname__}",
                                               fn=implementation)).name
    raise UsageError(f"check: expected an implementation name, an Implementation or a callable, got "
                     f"{type(implementation).__name__}")


_examiners: dict = {}


def _examiner(name: str, against: Optional[str], device: str) -> Examiner:
    """One Examiner per (side, other side, device), kept: a case checked again reuses its evidence."""
    key = (name, against, device)
    if key not in _examiners:
        _examiners[key] = Examiner([name] + ([against] if against else []), device)
    return _examiners[key]


def _replay_hint(case: Case, name: str, against: Optional[str]) -> str:
    other = f" --against {against}" if against else ""
    return (f"replay: save the case as case.json and run `ssdiff replay case.json --impl {name}{other}` "
            f"(`ssdiff minimize` with the same arguments shrinks it)\n"
            f"case: {case.to_json(indent=None)}")


def check(implementation, case: Case, *, against: Optional[str] = None, device: Optional[str] = None,
          choice="tuned") -> Outcome:
    """Examine ``case`` on ``implementation`` against the float64 oracle (and, with ``against``, against that
    implementation too) and raise `Divergence` when a side diverges; return the outcome otherwise.

    implementation: a registry name (`ssdiff list`), ``"package.module:function"``, an Implementation, or a
    callable with mamba_chunk_scan_combined's signature (what it can express is read from its parameters).
    A feature of the case the implementation cannot express is switched off first; a case it cannot take at all
    (an entry point it lacks, a dtype this runtime does not run) is rejected inside a Hypothesis test and a
    UsageError elsewhere. ``device``: default cuda where there is a GPU, else cpu (the Triton interpreter).
    ``choice``: the autotune config, "tuned" or an index."""
    name = _side(implementation)
    examiner = _examiner(name, against, device or runtime.default_device())
    fitted = examiner.fit(case)
    if fitted is None:
        why = "; ".join(examiner.skip_reasons(case)) or "outside the implementation's capabilities"
        from hypothesis import assume, currently_in_test_context

        if currently_in_test_context():
            assume(False)
        raise UsageError(f"check: {case.describe()}: {why}")
    outcome = examiner.examine(fitted, choice)
    if outcome.diverged:
        lines = [f"{fitted.describe()}"] + [v.message() for v in outcome.verdicts.values()]
        if outcome.pair:
            lines.append("the two sides differ by up to "
                         f"{max(outcome.pair.values()):.3g}x their joint budget")
        lines += registry.known_lines(outcome)
        lines.append(_replay_hint(fitted, name, against))
        raise kind_of(outcome)("\n".join(lines), outcome)
    return outcome


def fuzz(implementation: str, against: Optional[str] = None, **config) -> FuzzReport:
    """A fuzz campaign (what `ssdiff fuzz` runs): ``config`` takes FuzzConfig's fields (max_time, max_examples,
    entry, pass_, dtypes, device, keep_going, seed, out_dir, ...). Returns the report; its findings are the
    divergences, each localized, minimized and saved under ``report.out_dir``."""
    return Fuzzer(FuzzConfig(impl=implementation, against=against, **config)).run()


def minimize(case: Case, implementation: str, against: Optional[str] = None, **options) -> minimizing.Minimized:
    """Shrink a diverging ``case`` to the smallest, plainest one with the same divergence; minimized.json,
    minimized-verdict.json and repro.py go to ``out_dir`` (default ssdiff-out/minimize-<time>). ``options``: device,
    out_dir, choice, max_runs, isolate. Raises minimize.NotDiverging when the case does not diverge."""
    if options.get("out_dir") is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        options["out_dir"] = os.path.join("ssdiff-out", f"minimize-{stamp}")
    return minimizing.minimize(case, implementation, against, **options)


def replay(case: Case, implementation: str, against: Optional[str] = None, **options) -> Outcome:
    """Judge a saved case again (the same case on the same machine gives the same numbers). ``options``:
    device, choice, isolate, top (each diverging tensor's elements of the largest ratios)."""
    return minimizing.replay(case, implementation, against, **options)


def known(implementation: Optional[str] = None) -> list:
    """The known upstream defects of the installed releases (of ``implementation``'s, when given): one record
    each, with its statement, releases, status and example case."""
    if implementation is None:
        return [d for d in registry.DEFECTS if d.affects(registry.installed_version(d.package))]
    return registry.affecting(implementation)


def implementations() -> list:
    """The names of every registered implementation (`ssdiff list` says which run here, and why not)."""
    return [impl.name for impl in all_implementations()]


__all__ = ["Divergence", "check", "fuzz", "minimize", "replay", "known", "implementations"]
