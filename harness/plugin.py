"""``pytest --ssdiff-report[=ROOT]``: the HTML report of a property run, the same page a fuzz run gets.

Registered through the pytest11 entry point of the installed distribution, so any suite has it. With the option,
every verdict a property reaches through `ssdiff.verdict.judge.judge` is seen
(`ssdiff.verdict.judge.JUDGE_LISTENERS`); when a test fails, the last diverging verdict of that test is saved as a
divergence (Hypothesis replays its shrunk falsifying example last, so that is the one saved), with its stage
localization, through harness/store.py as `ssdiff fuzz` saves its own. At the end of the session the run is written
to ROOT/pytest-<time>/ (the saved run under run/, the page as index.html) and ROOT/index.html is rebuilt. ROOT
defaults to $SSDIFF_REPORTS, else reports/.

Fuzz runs made by tests (ssdiff.campaign.fuzz writes a report for every run) go to ROOT as well with the option;
without it, to a temporary folder (not the working tree) unless $SSDIFF_REPORTS is set.

Verdicts of tests that pass although a verdict diverged (tests that check the harness catches a planted bug)
are counted apart and kept out of the largest ratio seen. Not supported with pytest-xdist workers (-n).
"""

from __future__ import annotations

import datetime
import math
import os
import pathlib
import platform
import shutil
import tempfile
import time

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("ssdiff report")
    group.addoption("--ssdiff-report", nargs="?", const="", default=None, metavar="ROOT",
                    help="write an HTML report of the verdicts and divergences found by properties to "
                         "ROOT/pytest-<time>/index.html (ROOT default: $SSDIFF_REPORTS, else reports)")


_ENV = "SSDIFF_REPORTS"


def pytest_configure(config):
    option = config.getoption("--ssdiff-report", None)
    saved = os.environ.get(_ENV)
    config._ssdiff_saved_env = saved
    # Fuzz runs inside tests write their reports too (every fuzz run does): to ROOT with the option, else to a
    # temporary folder rather than the working tree, unless $SSDIFF_REPORTS says where.
    if option is None:
        if saved is None:
            config._ssdiff_temporary = os.environ[_ENV] = tempfile.mkdtemp(prefix="ssdiff-reports-")
        return
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        raise pytest.UsageError("--ssdiff-report cannot collect verdicts from pytest-xdist workers: run without -n")
    root = pathlib.Path(option or saved or "reports").resolve()
    os.environ[_ENV] = str(root)
    config.pluginmanager.register(Recorder(config, root), "ssdiff-report-recorder")


def pytest_unconfigure(config):
    temporary = getattr(config, "_ssdiff_temporary", None)
    if temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    saved = getattr(config, "_ssdiff_saved_env", None)
    if saved is None:
        os.environ.pop(_ENV, None)
    else:
        os.environ[_ENV] = saved


class Recorder:
    """Collects verdicts per test; saves a failing test's divergence; writes the run at the end."""

    def __init__(self, config, root: pathlib.Path):
        from ssdiff.verdict import judge as verdict_module

        self.config = config
        self.root = root
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.name = f"pytest-{stamp}"
        self.run_dir = root / self.name / "run"
        self.current: list = []
        self.judged = 0
        self.expected_divergences = 0
        self.worst: dict = {}
        self.worst_by_side: dict = {}
        self.divergences: list = []
        self.outcomes = {"passed": 0, "failed": 0, "skipped": 0}
        self.start = time.perf_counter()
        self._listeners = verdict_module.JUDGE_LISTENERS
        self._listeners.append(self.listen)

    # ---- hooks --------------------------------------------------------------------------------------------

    def listen(self, case, verdict):
        self.current.append((case, verdict))

    def pytest_runtest_setup(self, item):
        self.current = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when != "call":
            return
        judged, self.current = self.current, []
        self.judged += len(judged)
        diverged = [(c, v) for c, v in judged if not v.ok]
        if report.failed and diverged:
            case, verdict = diverged[-1]
            self._save(item.nodeid, case, verdict, report)
        elif diverged:
            self.expected_divergences += len(diverged)
        if report.passed or report.failed:
            for case, verdict in judged if report.failed else [(c, v) for c, v in judged if v.ok]:
                self._note(case, verdict)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.skipped):
            key = "passed" if report.passed else "failed" if report.failed else "skipped"
            self.outcomes[key] += 1
        elif report.failed:
            self.outcomes["failed"] += 1

    def pytest_sessionfinish(self, session):
        if self.listen in self._listeners:
            self._listeners.remove(self.listen)
        self._write_summary(session)
        from ssdiff.report.render import render_run

        self.page = render_run(self.run_dir, self.root, name=self.name)

    def pytest_terminal_summary(self, terminalreporter):
        page = getattr(self, "page", None)
        if page is not None:
            terminalreporter.write_line(f"ssdiff report: {page} ({len(self.divergences)} divergences, "
                                        f"{self.judged} verdicts)")

    # ---- records -----------------------------------------------------------------------------------------

    def _device(self) -> str:
        from ssdiff import runtime

        try:
            return self.config.getoption("--device") or runtime.default_device()
        except ValueError:
            return runtime.default_device()

    def _note(self, case, verdict):
        if not math.isfinite(verdict.ratio) or verdict.status not in ("ok", "diverged"):
            return
        worst = verdict.worst()
        item = {"ratio": verdict.ratio, "side": verdict.impl, "tensor": worst.name if worst else None,
                "case": case.describe()}
        if verdict.ratio >= self.worst.get(case.dtype, {}).get("ratio", -1.0):
            self.worst[case.dtype] = item
        key = f"{verdict.impl} {case.dtype}"
        if verdict.ratio >= self.worst_by_side.get(key, {}).get("ratio", -1.0):
            self.worst_by_side[key] = item

    def _save(self, nodeid: str, case, verdict, report):
        from ssdiff.investigate import localize
        from ssdiff import runtime
        from ssdiff import store

        number = len(self.divergences) + 1
        crash = getattr(report.longrepr, "reprcrash", None)
        failure = crash.message if crash is not None else str(report.longrepr)[-2000:]
        message = f"{verdict.message()}\n\nfound by {nodeid}\n{failure}"
        staged = any(t.kind == "stage" for t in verdict.tensors)
        localization = {"per_side": {verdict.impl: {"stages": localize.stages(verdict)}}} if staged else {}
        folder = store.write_divergence(store.divergence_folder(self.run_dir, number), case, {verdict.impl: verdict},
                                        message, localization, device=self._device(), runtime=runtime.describe(),
                                        oracle="float64 oracle", origin=f" by {nodeid}")
        signature = f"{verdict.impl}: {verdict.status}" + (
            f" in {', '.join(sorted(t.name for t in verdict.failing if t.kind != 'stage'))}" if verdict.failing else "")
        self.divergences.append({"number": number, "path": str(folder), "signature": signature, "test": nodeid,
                                 "case": case.describe(), "summary": verdict.message()})

    def _write_summary(self, session):
        from ssdiff import runtime
        from ssdiff import store
        from ssdiff.sides.environment import environment

        o = self.outcomes
        args = " ".join(str(a) for a in self.config.invocation_params.args)
        store.write_summary(self.run_dir, {
            "run_name": self.name, "impl": f"pytest {args}".strip(), "against": "float64 oracle",
            "device": self._device(),
            "runtime": runtime.describe(), "cases_tried": self.judged,
            "tests": f"{o['passed']} passed, {o['failed']} failed, {o['skipped']} skipped",
            "expected_divergences": self.expected_divergences,
            "elapsed_s": round(time.perf_counter() - self.start, 2),
            "largest_ratio_by_dtype": self.worst, "largest_ratio_by_side": self.worst_by_side,
            "divergences": self.divergences, "python": platform.python_version(), "platform": platform.platform(),
            "environment": environment(self._device()), "exit_status": int(session.exitstatus),
            "cwd": os.getcwd(),
        })
