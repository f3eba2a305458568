"""harness.runtime's choice of autotune config: a forced config that does not fit the device is passed over.

On an H200, mamba_ssm's config 0 of some kernels needs 296 KB of shared memory in float32 (the limit is
227 KB). The benchmarking autotuner skips such a config; a forced choice (``--autotune 0``, or the drawn config
of a GPU property) does too, runs the next config that fits and says so in the launch record, rather than
reporting OutOfResources as the implementation erroring. The interpreter never runs out of shared memory, so
the refusal is simulated here by a pre_hook that raises triton's own OutOfResources.
"""

from __future__ import annotations

import pytest
import torch

from harness import runtime

runtime.configure()

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.errors import OutOfResources  # noqa: E402


def _too_big(nargs):
    raise OutOfResources(296_000, 232_448, "shared memory")


@triton.autotune(configs=[triton.Config({"SCALE": 2}, pre_hook=_too_big), triton.Config({"SCALE": 3}),
                          triton.Config({"SCALE": 5})], key=["n"])
@triton.jit
def _scale(x, y, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < n) * SCALE, mask=o < n)


def _run(choice):
    x = torch.arange(4, dtype=torch.float32)
    y = torch.zeros_like(x)
    with runtime.autotune(choice):
        _scale[(1,)](x, y, 4, BLOCK=4)
        launches = runtime.launches()
    return y, launches


@pytest.mark.skipif(not runtime.interpreted(), reason="the simulated refusal needs the interpreter's launch path")
def test_a_forced_config_that_does_not_fit_is_passed_over_and_named():
    y, launches = _run(0)
    assert torch.equal(y, torch.arange(4, dtype=torch.float32) * 3)       # config #1 ran
    (launch,) = launches
    assert launch.index == 1 and launch.nconfigs == 3
    assert "config #0 does not fit this device" in launch.skipped and "shared memory" in launch.skipped


@pytest.mark.skipif(not runtime.interpreted(), reason="the simulated refusal needs the interpreter's launch path")
def test_a_forced_config_that_fits_runs_as_asked():
    y, launches = _run(2)
    assert torch.equal(y, torch.arange(4, dtype=torch.float32) * 5)
    assert launches[0].index == 2 and launches[0].skipped == ""
