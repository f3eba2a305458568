"""Everything specific to where kernels run: a CUDA GPU natively, or a CPU under the Triton interpreter.

The rest of ssdiff never asks which runtime it is on. It calls `configure()` once at start-up (the CLI,
conftest.py and the upstream loader do; it is idempotent) and then asks this module:

- `default_device()`, `kernel_devices()`: where Triton kernels run ("cuda" natively, "cpu" interpreted);
- `dtype_skip_reason(dtype)` / `runnable_dtypes()`: dtype gating (bf16 only on a GPU);
- `fp32_dot()`: whether fp32 `tl.dot` is exact ("ieee") or TF32 here (what an fp32 tolerance must know);
- `autotune(choice)`: which autotune config every Triton kernel launches with — "tuned" (the default: real
  benchmarking on a GPU; the interpreter cannot benchmark, so there it is the first listed config), or an
  integer index (config ``i % n`` of every kernel with ``n`` configs); `ConfigSweep` gives the indices until
  every config of every kernel has run (some real bugs live in only one config);
- `launches()`: which config each kernel launched with during the last `autotune` block (`Launch` records);
- `out_of_memory(err)`, `release_memory()`, `retry_on_oom(fn, where)`: a device that ran out of memory is a fact
  about the machine, not a verdict: the cached blocks are handed back and the step tried once more, then
  `DeviceOutOfMemory` says where it ran out (a campaign skips the case and counts it).

Interpreter patches (harness/truth/README.md, "Running upstream without CUDA extensions"), installed by `configure()` only under the interpreter:
1. ``torch.cuda.device(None | cpu device)`` is a no-op (kernels wrap launches in it);
2. ``torch.cuda.get_device_properties(cpu device)`` answers ``multi_processor_count = sm_count()`` (backward
   kernels size their reduction splits by it; the default is the H200's 132 so CPU and GPU split alike);
3. autotuners never benchmark: each launch gets exactly one config, chosen as above;
4. integer-overflow sanitizing of every index operation is off (it doubles interpreter time, and the tiny
   shapes a CPU can afford never approach 2**31; SSDIFF_SANITIZE_OVERFLOW=1 turns it back on);
5. a kernel scalar used as a Python index (``range(0, chunk_size_limit)``) converts with ``.item()``: the
   interpreter's ``tensor.__index__`` calls ``int()`` on a 1-element array, which numpy >= 2.4 refuses.
6. ``triton.language`` is patched once per launch: the interpreter re-patches it at every call of a
   ``@triton.jit`` helper inside a kernel (``inspect.getmembers`` over four modules, about a quarter of the
   interpreter's time on ssdiff's kernels), though the launch already patched every module the helper sees; a
   helper that sees one more gets it patched, undone with the launch's; and the table from Triton dtypes to numpy
   dtypes, which the interpreter builds anew at each of its operations' lookups, is built once. Results are the
   same; only time changes.
The autotune wrapper (3) is installed on a GPU too, where "tuned" benchmarks every config of a new autotune key
as Triton does, for SSDIFF_TUNE_MS (10 ms) each rather than Triton's 125 ms: a fuzz campaign meets many keys.
On a GPU `configure()` also sets TRITON_CACHE_AUTOTUNING=1 (unless set): the results stay in Triton's cache.
The patches are self-contained functions (`_patch_interpreter`, `_patch_autotuner_choice`): repro.py inlines
them (harness/reproduce/repro.py), so a repro runs the kernels under the very patches ssdiff ran them under; all
but 6, which changes only how long a run takes.
"""

from __future__ import annotations

import contextlib
import os
import types
from dataclasses import dataclass
from typing import Callable, Optional, Union

import threadpoolctl
import torch

# H200 / H100 SXM have 132 SMs: the interpreter reports the same count so reduction splits match a GPU run.
DEFAULT_SM_COUNT = 132

_configured = False
_sm_count = int(os.environ.get("SSDIFF_SM_COUNT", DEFAULT_SM_COUNT))


# ---- which runtime ---------------------------------------------------------------------------------------

def has_gpu() -> bool:
    return torch.cuda.is_available()


def configure() -> None:
    """Choose the runtime before any Triton kernel is defined and install what it needs. Idempotent.

    Without a GPU: the Triton interpreter (TRITON_INTERPRET=1 must be set before `triton.jit` decorates a
    kernel, so call this before importing any kernel module) and its patches. kernels/ imports nothing from the
    harness: whoever imports it calls this first (conftest.py, the CLI, the ssdiff.triton adapter, the kernel
    benchmark and tuner)."""
    global _configured
    if _configured:
        return
    if not has_gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        # Autotune results on disk beside the compiled kernels (kernels whose configs have no pre_hook).
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if interpreted():
        _patch_interpreter(sm_count, os.environ.get("SSDIFF_SANITIZE_OVERFLOW", "0") == "1")
        _patch_language_once_per_launch()
        _one_blas_thread()
    _patch_autotuner_choice(_forced_index, _quick_bench, _launches, Launch)
    _configured = True


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def describe() -> str:
    """One line for reports and `ssdiff list`."""
    if interpreted():
        where = "CPU, Triton interpreter"
    else:
        where = f"GPU {torch.cuda.get_device_name()}" if has_gpu() else "CPU (no Triton runtime)"
    return (f"{where}; dtypes {', '.join(runnable_dtypes())}; fp32 dot {fp32_dot()}; "
            f"autotune {describe_choice(_choice)}; sm_count {sm_count() if interpreted() else 'device'}")


def default_device() -> str:
    """Where implementations run by default: the GPU, unless kernels are interpreted (then the CPU)."""
    return "cuda" if has_gpu() and not interpreted() else "cpu"


def device_problem(device) -> Optional[str]:
    """Why ``device`` cannot be used here (not a device torch names; a GPU torch does not see), on one line naming
    it, or None."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"device {device!r}: expected cpu or cuda (cuda:N for the N-th GPU)"
    if parsed.type not in ("cpu", "cuda"):
        return f"device {device!r}: expected cpu or cuda (cuda:N for the N-th GPU)"
    if parsed.type == "cuda":
        if not has_gpu():
            return (f"device {device!r}: torch {torch.__version__} sees no CUDA device here"
                    f"{'' if torch.version.cuda else ' (a build without CUDA)'}; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            return f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) here"
    return None


def kernel_devices() -> frozenset:
    """Devices Triton kernels run on here: the GPU natively, or the CPU under the interpreter."""
    return frozenset({"cpu"}) if interpreted() else frozenset({"cuda"} if has_gpu() else set())


def no_triton_reason() -> Optional[str]:
    """Why Triton kernels cannot run here at all, or None."""
    return None if kernel_devices() else "no Triton runtime here: no GPU, and TRITON_INTERPRET is not 1"


# ---- dtype gating ----------------------------------------------------------------------------------------

BF16_REASON = ("bfloat16 runs only on a GPU: the Triton interpreter's bf16 tl.dot is garbage (errors ~1e10) "
               "and it rounds f32->bf16 by truncation")


def runnable_dtypes() -> tuple:
    """Dtypes Triton kernels can be judged in here: bf16 only on a GPU."""
    return ("float32", "float16", "bfloat16") if not interpreted() else ("float32", "float16")


def dtype_skip_reason(dtype: str) -> Optional[str]:
    """Why a Triton kernel cannot be judged in ``dtype`` here, or None."""
    if dtype not in runnable_dtypes():
        return BF16_REASON if dtype == "bfloat16" else f"dtype {dtype!r} is not run on this runtime"
    return None


def fp32_dot() -> str:
    """"ieee" when fp32 tl.dot is exact fp32 (the interpreter, or TRITON_F32_DEFAULT=ieee), else "tf32"."""
    if interpreted():
        return "ieee"
    return "ieee" if os.environ.get("TRITON_F32_DEFAULT", "").lower() == "ieee" else "tf32"


# ---- device memory ---------------------------------------------------------------------------------------

class DeviceOutOfMemory(RuntimeError):
    """A case needed more device memory than was free, twice (`retry_on_oom`): not a verdict on any side."""


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the device running out of memory (torch's OutOfMemoryError, or a kernel library's
    error that says so)."""
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(err, (oom, DeviceOutOfMemory)) or "out of memory" in str(err).lower()


def release_memory() -> None:
    """Hand the caching allocator's free blocks back to the device (other processes on it can use them)."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def retry_on_oom(fn: Callable[[], object], where: str):
    """``fn()``; where it runs out of device memory, `release_memory` and once more; out again:
    `DeviceOutOfMemory` naming ``where`` and the allocator's message."""
    for attempt in (0, 1):
        try:
            return fn()
        except Exception as err:
            if not out_of_memory(err):
                raise
            if attempt:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise DeviceOutOfMemory(f"out of device memory in {where}: {first[:300]}") from None
        # out of the handler: the error's frames, and the tensors they held, are gone before the cache is emptied
        release_memory()


# ---- SM count the interpreter reports --------------------------------------------------------------------

def sm_count() -> int:
    return _sm_count


@contextlib.contextmanager
def with_sm_count(count: int):
    """Report ``count`` SMs to kernels under the interpreter (changes backward reduction splits)."""
    global _sm_count
    if count < 1:
        raise ValueError(f"sm_count={count} must be at least 1")
    old, _sm_count = _sm_count, count
    try:
        yield
    finally:
        _sm_count = old


# ---- interpreter patches ---------------------------------------------------------------------------------
# Self-contained (torch, types and their arguments only): repro.py inlines them.

def _patch_interpreter(count, sanitize_overflow):
    """The Triton interpreter's patches (1, 2, 4 and 5 of harness/runtime.py's docstring); ``count()``: the SM
    count reported to kernels."""
    _patch_cuda_device()
    _patch_device_properties(count)
    _patch_interpreter_index()
    _set_overflow_sanitizer(sanitize_overflow)


def _is_host(device) -> bool:
    if device is None:
        return True
    if isinstance(device, int):
        return device < 0
    if isinstance(device, str):
        device = torch.device(device)
    return isinstance(device, torch.device) and device.type == "cpu"


def _one_blas_thread():
    """numpy's BLAS on one thread: the interpreter runs each tl.dot as np.matmul on blocks of a few hundred
    elements, where BLAS threads only wait on each other and on torch's (a 128x64 @ 64x256 dot: 14 ms with numpy's
    default threads, 0.17 ms with one, on 2 cores)."""
    threadpoolctl.threadpool_limits(1, user_api="blas")


def _patch_cuda_device():
    original = torch.cuda.device
    if getattr(original, "_ssdiff_patch", False):
        return

    class device(original):  # noqa: N801 - keeps torch's name
        """torch.cuda.device that is a no-op for host tensors (device index None) under the interpreter."""
        _ssdiff_patch = True

        def __init__(self, dev):
            self._host = _is_host(dev)
            if not self._host:
                super().__init__(dev)

        def __enter__(self):
            return None if self._host else super().__enter__()

        def __exit__(self, *exc):
            return False if self._host else super().__exit__(*exc)

    torch.cuda.device = device


def _patch_device_properties(count):
    original = torch.cuda.get_device_properties
    if getattr(original, "_ssdiff_patch", False):
        return

    def get_device_properties(device=None):
        if _is_host(device) or not torch.cuda.is_available():
            return types.SimpleNamespace(name="Triton interpreter (CPU)", multi_processor_count=count(),
                                         major=9, minor=0, total_memory=0)
        return original(device)

    get_device_properties._ssdiff_patch = True
    torch.cuda.get_device_properties = get_device_properties


def _set_overflow_sanitizer(on: bool):
    try:
        import dataclasses
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=on)
    except (ImportError, AttributeError, TypeError):
        pass                       # another Triton: leave its defaults


def _patch_interpreter_index():
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_ssdiff_patch", False):
        return

    def index(self):
        data = self.handle.data
        return int(data.item()) if getattr(data, "size", 0) == 1 else int(data)

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", index)

    patch_lang_tensor._ssdiff_patch = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_language_once_per_launch():
    """Patch 6 of the module docstring: `interpreter._patch_lang` as before for a launch (its scope restored when
    the launch ends); inside one, a helper's call patches only the language modules the launch has not, into the
    launch's scope, instead of all of them again into a scope nobody restores."""
    try:
        from triton.runtime import interpreter
        original, Scope = interpreter._patch_lang, interpreter._LangPatchScope
        import triton.language as tl
    except (ImportError, AttributeError):
        return                                  # another Triton: leave it as it is
    if getattr(original, "_ssdiff_patch", False):
        return
    launch = {"scope": None, "langs": set()}

    def visible(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        outer = launch["scope"]
        if outer is None:                       # a launch: patch, and forget it when its scope is restored
            scope = original(fn)
            launch["scope"], launch["langs"] = scope, visible(fn)
            restore = scope.restore

            def restore_and_end():
                restore()
                launch["scope"], launch["langs"] = None, set()

            scope.restore = restore_and_end
            return scope
        if not visible(fn) <= launch["langs"]:  # a helper that sees a module the launch did not patch
            # patched in full, as the interpreter does; undone when the launch's scope is restored
            outer._changes.extend(original(fn)._changes)
            launch["langs"] |= visible(fn)
        return Scope()

    patch_lang._ssdiff_patch = True
    interpreter._patch_lang = patch_lang

    original_np_dtype = interpreter._get_np_dtype
    table = {}
    for name in dir(tl):                        # every Triton dtype, mapped as the interpreter maps it
        value = getattr(tl, name)
        if isinstance(value, tl.dtype) and not isinstance(value, (tl.pointer_type, tl.block_type)):
            try:
                table[value] = original_np_dtype(value)
            except KeyError:
                pass

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type) and not isinstance(tt_dtype.element_ty, tl.pointer_type):
            tt_dtype = tt_dtype.element_ty
        found = table.get(tt_dtype) if not isinstance(tt_dtype, (tl.pointer_type, tl.block_type)) else None
        return found if found is not None else original_np_dtype(tt_dtype)

    interpreter._get_np_dtype = get_np_dtype


# ---- autotune config choice ------------------------------------------------------------------------------

Choice = Union[str, int]      # "tuned" or a config index
_choice: Choice = "tuned"


@dataclass(frozen=True)
class Launch:
    """One autotuned launch: the kernel, the index of the config it ran with, how many it had, and why a
    forced config was passed over (empty when it ran as asked)."""
    kernel: str
    index: int
    nconfigs: int
    config: str
    skipped: str = ""


_launches: list = []


def describe_choice(choice: Choice) -> str:
    if choice == "tuned":
        return "tuned (benchmarked)" if not interpreted() else "tuned (interpreter: first config)"
    return f"config #{choice} of every kernel (modulo its count)"


def current_choice() -> Choice:
    return _choice


@contextlib.contextmanager
def autotune(choice: Choice = "tuned"):
    """Within the block, every autotuned Triton kernel launches with ``choice``: "tuned", or an index
    (config ``index % n`` of a kernel with ``n`` configs, after the kernel's own pruning)."""
    global _choice
    if choice != "tuned" and (not isinstance(choice, int) or isinstance(choice, bool) or choice < 0):
        raise ValueError(f"autotune choice must be 'tuned' or a non-negative config index, got {choice!r}")
    configure()
    old = _choice
    _choice = choice
    _launches.clear()
    try:
        yield
    finally:
        _choice = old


def launches() -> list:
    """The autotuned launches since the last `autotune` block began (`Launch` records)."""
    return list(_launches)


class ConfigSweep:
    """The config indices 0, 1, ... until every config of every autotuned kernel the runs launched has run (a
    kernel with n configs runs config index % n, so the largest n indices cover them all), at most ``limit``.

        sweep = ConfigSweep()
        for index in sweep:
            run = ...under autotune(index)...
            sweep.ran(run.launches)
    """

    def __init__(self, limit: Optional[int] = None):
        self.needed = 1
        self.limit = limit

    def __iter__(self):
        index = 0
        while index < self.needed and (self.limit is None or index < self.limit):
            yield index
            index += 1

    def ran(self, launches) -> None:
        """Note a run's launches (`Launch` records): their config counts say how many indices the sweep needs."""
        self.needed = max([self.needed] + [launch.nconfigs for launch in launches])


TUNE_MS = float(os.environ.get("SSDIFF_TUNE_MS", "10"))


def _quick_bench(fn, quantiles=None):
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(1, int(TUNE_MS // 5)), rep=max(1, int(TUNE_MS)), quantiles=quantiles)


def _forced_index():
    """The config index the autotune wrapper forces now, or None where "tuned" benchmarks (natively)."""
    if _choice == "tuned":
        return 0 if interpreted() else None
    return _choice


def _patch_autotuner_choice(index_now, bench=None, record=None, entry=lambda *fields: fields):
    """Every autotuned Triton kernel launches as ``index_now()`` says at the launch: None, as the autotuner tunes
    it (timing with ``bench`` where given); an index, config ``index % n`` of its n configs (after the kernel's
    own pruning) alone. ``record`` (a list) gets ``entry(kernel, index, n, config, skipped)`` of each forced
    launch. Self-contained: repro.py inlines it."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:           # no triton: nothing to choose
        return
    if getattr(Autotuner.run, "_ssdiff_patch", False):
        return
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:
        OutOfResources = ()
    original_run = Autotuner.run

    def run(self, *args, **kwargs):
        index = index_now()
        if index is None:
            # The benchmark picks the config production would run; a short one picks it as well as Triton's
            # default 125 ms per config, which a fuzz campaign pays for every new autotune key.
            if bench is not None:
                self.__dict__.setdefault("do_bench", bench)
            return original_run(self, *args, **kwargs)
        candidates = self.configs
        if self.early_config_prune is not None and len(candidates) > 1:
            # The kernel's own pruning says which configs are legal for these arguments.
            self.nargs = dict(zip(self.arg_names, args))
            candidates = self.early_config_prune(self.configs, self.nargs, **kwargs) or self.configs
        if record is not None and len(record) > 10000:   # nobody reads them outside a block: memory stays flat
            del record[:5000]
        name = getattr(self.base_fn, "__name__", "?")
        n = len(candidates)
        saved = self.configs
        # A forced config that does not fit this device (shared memory, registers: mamba_ssm's config 0 of
        # some kernels in float32 on an H200) is no finding about the kernel: the benchmarking autotuner
        # skips it too. The next config that fits runs instead, and the launch record says so.
        # The record goes in before the launch, so a config that crashes is still named.
        unfit = []
        try:
            for step in range(n):
                k = (index + step) % n
                chosen = candidates[k]
                self.configs = [chosen]
                if record is not None:
                    record.append(entry(name, k, n, str(chosen), "; ".join(unfit)))
                try:
                    return original_run(self, *args, **kwargs)
                except OutOfResources as err:
                    if step == n - 1:
                        raise
                    if record is not None:
                        record.pop()
                    unfit.append(f"config #{k} does not fit this device ({str(err).splitlines()[0][:120]})")
        finally:
            self.configs = saved

    run._ssdiff_patch = True
    Autotuner.run = run
