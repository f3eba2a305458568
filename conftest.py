"""pytest configuration for ssdiff: the runtime, hypothesis profiles, and the device option.

Profiles (one place, selected by name):
    dev      quick local runs (default); derandomized natively, so that a kept Triton cache stays warm
    ci       the CPU interpreter in CI: bounded, derandomized (chosen when CI=true)
    gpu      a CUDA runner: more examples
    nightly  many examples, targeting the largest errors
Select with ``--hypothesis-profile NAME`` or ``SSDIFF_PROFILE=NAME``. ``--device cpu|cuda`` picks the device
(default: cuda when available).

The device policy: every test that runs tensors takes the ``device`` fixture and passes it on (nothing names
'cpu' or 'cuda'; `ssdiff.inputs.materialize` has no default device). A fact that holds only under the Triton
interpreter is marked ``@pytest.mark.interpreter(reason=...)`` and one that needs a GPU
``@pytest.mark.gpu(reason=...)``: elsewhere they skip, printing the reason. A mark without a reason fails.
"""

from __future__ import annotations

import os
import random

from ssdiff import runtime

# Before anything defines a Triton kernel: without a GPU, kernels run under the Triton interpreter.
runtime.configure()

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
# Natively the dev profile draws the same examples every run: each drawn shape compiles every kernel it launches
# (seconds each; a warm case is judged in a tenth of a second), and the same draws find them in a kept Triton
# cache (TRITON_CACHE_DIR). The gpu and nightly profiles search afresh every run; natively their properties draw
# from a few compile keys per run (ssdiff.testing).
settings.register_profile("dev", max_examples=20, derandomize=not runtime.interpreted(), **_common)
settings.register_profile("ci", max_examples=50, derandomize=True, database=None, print_blob=True, **_common)
settings.register_profile("gpu", max_examples=200, print_blob=True, **_common)
settings.register_profile("nightly", max_examples=2000, print_blob=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                          **_common)

PROFILE = os.environ.get("SSDIFF_PROFILE") or ("ci" if os.environ.get("CI", "").lower() in ("1", "true") else "dev")
settings.load_profile(PROFILE)


def pytest_addoption(parser):
    parser.addoption("--device", default=None, help="device to run implementations on: cpu or cuda "
                                                   "(default: cuda when available, else cpu)")


def pytest_configure(config):
    # One seed for the run's compile keys (ssdiff.testing) in every xdist worker: they inherit it from here.
    os.environ.setdefault("SSDIFF_POOL_SEED", str(random.SystemRandom().randrange(2 ** 31)))


def pytest_report_header(config):
    from ssdiff import testing      # here, not at the top: its SEED reads SSDIFF_POOL_SEED, set in pytest_configure

    keys = f", cases from compile keys (SSDIFF_POOL_SEED={testing.SEED})" if testing.pooled() else ""
    return (f"ssdiff: hypothesis profile {settings._current_profile}, device {_device(config)}, "
            f"triton interpreter {'on' if runtime.interpreted() else 'off'}{keys}")


def _device(config) -> str:
    return config.getoption("--device") or runtime.default_device()


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    """The device implementations run on (``--device``)."""
    return _device(pytestconfig)


def pytest_runtest_setup(item):
    """The interpreter and gpu marks: where the test does not hold, it skips with the mark's reason."""
    where = {"interpreter": (runtime.interpreted(), "interpreter only"),
             "gpu": (_device(item.config).startswith("cuda"), "needs a GPU")}
    for name, (holds_here, words) in where.items():
        for mark in item.iter_markers(name=name):
            reason = mark.kwargs.get("reason")
            if not reason:
                pytest.fail(f"@pytest.mark.{name} needs reason='...': why the test holds only there", pytrace=False)
            if not holds_here:
                pytest.skip(f"{words}: {reason}")


def pytest_runtest_logreport(report):
    """With SSDIFF_TEST_LOG=path: each test's outcome and duration appended as it ends, with the traceback of a
    failure (a GPU runner's run cut at its time limit keeps what failed and why; pytest prints it only at the
    end). Under xdist the controlling process writes it (it sees every worker's reports), the workers do not."""
    path = os.environ.get("SSDIFF_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not (report.when == "call" or report.failed or report.skipped):
        return
    xfail = getattr(report, "wasxfail", None)
    outcome = ("XFAIL" if report.skipped else "XPASS") if xfail is not None else report.outcome.upper()
    reason = xfail if xfail is not None else (report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple)
                                              else "")
    with open(path, "a") as log:
        log.write(f"{outcome} {report.nodeid} ({report.when}, {report.duration:.1f} s)"
                  + (f": {reason}" if reason else "") + "\n")
        if report.failed:
            log.write(report.longreprtext[-6000:] + "\n\n")
