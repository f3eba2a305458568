"""ssdiff.runtime: a forced autotune config that does not fit the device is passed over; and the device policy
of this suite (conftest.py) holds.

On an H200, mamba_ssm's config 0 of some kernels needs 296 KB of shared memory in float32 (the limit is
227 KB). The benchmarking autotuner skips such a config; a forced choice (``--autotune 0``, or the drawn config
of a GPU property) does too, runs the next config that fits and says so in the launch record, rather than
reporting OutOfResources as the implementation erroring. The interpreter never runs out of shared memory, so
the refusal is simulated here by a pre_hook that raises triton's own OutOfResources (the autotuner calls it
before the launch, natively as interpreted).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ssdiff import runtime
from ssdiff.model.case import Case
from ssdiff.inputs import materialize

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


def _run(choice, device):
    kind = torch.device(device).type
    if kind not in runtime.kernel_devices():
        pytest.skip(f"Triton kernels do not run on {kind} here (they run on: "
                    f"{', '.join(sorted(runtime.kernel_devices())) or 'nothing'})")
    x = torch.arange(4, dtype=torch.float32, device=device)
    y = torch.zeros_like(x)
    with runtime.autotune(choice):
        _scale[(1,)](x, y, 4, BLOCK=4)
        launches = runtime.launches()
    return y.cpu(), launches


def test_a_forced_config_that_does_not_fit_is_passed_over_and_named(device):
    y, launches = _run(0, device)
    assert torch.equal(y, torch.arange(4, dtype=torch.float32) * 3)       # config #1 ran
    (launch,) = launches
    assert launch.index == 1 and launch.nconfigs == 3
    assert "config #0 does not fit this device" in launch.skipped and "shared memory" in launch.skipped


def test_a_forced_config_that_fits_runs_as_asked(device):
    y, launches = _run(2, device)
    assert torch.equal(y, torch.arange(4, dtype=torch.float32) * 5)
    assert launches[0].index == 2 and launches[0].skipped == ""


# ---- the device policy -----------------------------------------------------------------------------------

def test_inputs_have_no_default_device():
    with pytest.raises(TypeError):
        materialize(Case())


def test_no_property_materializes_inputs_on_a_named_device():
    """Inputs go to the ``device`` fixture: no module of properties/ passes a literal device name to
    materialize."""
    named = re.compile(r"""materialize\([^()]*["'](cpu|cuda)""")
    found = [f"{path.name}:{number}: {line.strip()}" for path in sorted(Path(__file__).parent.glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if named.search(line)]
    assert not found, "\n".join(found)


def test_running_out_of_device_memory_is_retried_once_then_named():
    calls = []

    def once():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "ran"

    assert runtime.retry_on_oom(once, "the side") == "ran" and len(calls) == 2

    def always():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(runtime.DeviceOutOfMemory, match="out of device memory in the side: CUDA out of memory"):
        runtime.retry_on_oom(always, "the side")

    def wrong():
        raise ValueError("a bug, not the machine")

    with pytest.raises(ValueError, match="a bug"):
        runtime.retry_on_oom(wrong, "the side")


@triton.jit
def _twice_plus_one(x):
    return 2 * x + 1


@triton.jit
def _helper_per_program(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _twice_plus_one(_twice_plus_one(tl.load(x_ptr + offs))))


def test_a_kernel_calling_helpers_in_every_program_computes_alike_and_leaves_the_language_as_it_was(device):
    """Patch 6 of ssdiff.runtime (triton.language patched once per launch, not at each helper call): helpers called
    by every program of a grid compute what they say, and once the launch ends triton.language holds its own
    functions again (natively the same facts hold with no patch at all)."""
    x = torch.arange(64, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    _helper_per_program[(8,)](x, y, BLOCK=8)
    assert torch.equal(y, 4 * x + 3)
    for module in (tl, tl.core, tl.math):
        patched = [name for name in dir(module) if callable(getattr(module, name))
                   and getattr(getattr(module, name), "__name__", "") == "<lambda>"]
        assert not patched, f"{module.__name__} still holds the interpreter's patches: {patched[:5]}"
