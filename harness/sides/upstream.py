"""Loading the upstream packages under test (mamba_ssm, fla) and detecting what the installed release can do.

mamba_ssm's package ``__init__`` imports its CUDA selective-scan extension, so ``import mamba_ssm`` fails on
every machine without it (harness/truth/README.md, "Running upstream without CUDA extensions"). `mamba_ssm()` registers a bare package object with the installed
``__path__`` instead, imports only the Triton ops, puts the float64-checked torch stand-ins of
ssdiff.sides.standins where causal_conv1d / selective_scan_cuda are missing, and records what it did. Any release
2.0.0 - 2.3.2.post1 loads this way: put its install directory first on PYTHONPATH (one release per process).
2.0.0 and 2.0.1 are broken as shipped (2.0.0 imports its own modules as ``src.ops.*``; both import a
k_activations.py they do not contain) and are reported unavailable with that reason. What a release can
express is read from it: cu_seqlens / return_varlen_states from the signature, seq_idx = -1 padding from the
release number (2.2.6.post3 added the check to the chunk-state kernel; verified against 2.2.5 and 2.3.0).
`fla()` loads fla's simple_gla ops the same way, without fla's and fla.ops's package ``__init__`` (they import
every layer and op, seconds of a campaign's start); fla.layers still imports as usual.

Nothing here raises a traceback at a user for a missing package: `Unavailable` carries a one-line reason,
which adapters report through `Implementation.unavailable()`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Optional

from ssdiff import runtime
from ssdiff.sides import standins

# seq_idx = -1 marks padding tokens (kept out of every state) since this release (harness/truth/README.md, "Sequence boundaries").
PADDING_SINCE = "2.2.6.post3"


class Unavailable(RuntimeError):
    """An upstream package (or one of its entry points) cannot run here; the message says why, on one line."""


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def version_at_least(version: str, floor: str) -> bool:
    from packaging.version import Version
    return Version(version) >= Version(floor)


@contextlib.contextmanager
def _temporary_module(name: str, module: types.ModuleType):
    """``module`` importable as ``name`` for the duration of the block only (the importer keeps its reference)."""
    had = name in sys.modules
    old = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if had:
            sys.modules[name] = old
        else:
            sys.modules.pop(name, None)


def package_without_init(name: str) -> types.ModuleType:
    """The package ``name`` as a bare module object whose submodules import without running its __init__."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(f"package {name} is not installed")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__file__ = spec.origin
    module.__package__ = name
    module.__spec__ = spec
    module.ssdiff_without_init = True
    init = spec.origin or ""
    try:
        with open(init, encoding="utf-8") as handle:
            found = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", handle.read())
        module.__version__ = found.group(1) if found else "unknown"
    except OSError:
        module.__version__ = "unknown"
    sys.modules[name] = module
    return module


# ---- mamba_ssm -------------------------------------------------------------------------------------------

@dataclass
class MambaRelease:
    """One installed mamba_ssm release, loaded without its package __init__.

    ``standins``: which CUDA extensions were replaced by ssdiff.sides.standins (names of standins.NOTES).
    ``missing``: entry name -> why this release cannot run it here."""

    version: str
    location: str
    ssd_combined: types.ModuleType
    ssd_minimal: Optional[types.ModuleType]
    standins: frozenset
    missing: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"mamba-ssm {self.version}"

    def params(self, function) -> frozenset:
        return frozenset(inspect.signature(function).parameters)

    @property
    def varlen_states(self) -> bool:
        """cu_seqlens / return_varlen_states arrived after 2.0 (detected from the signature)."""
        return {"cu_seqlens", "return_varlen_states"} <= self.params(self.ssd_combined.mamba_chunk_scan_combined)

    @property
    def padding(self) -> bool:
        return version_at_least(self.version, PADDING_SINCE)

    @property
    def grouped_norm_backward(self) -> bool:
        """Does the fused mixer's backward pass group_size to the gated RMSNorm (its forward always does)?
        2.0.4 and 2.1.0 call _layer_norm_bwd without it, 2.2.5 on with it (read from the source)."""
        fn = getattr(self.ssd_combined, "MambaSplitConv1dScanCombinedFn", None)
        if fn is None:
            return True
        calls = [line for line in inspect.getsource(fn.backward).splitlines()
                 if "_layer_norm_bwd(" in line and not line.strip().startswith("#")]
        return all("group_size" in line for line in calls)

    def padding_reason(self) -> Optional[str]:
        if self.padding:
            return None
        return f"{self.label} does not honor seq_idx = -1 padding (since {PADDING_SINCE})"

    def notes(self, uses: tuple = ()) -> list:
        """What a verdict must repeat about a run that used the extensions ``uses``."""
        out = [f"{self.label} ({self.location})"]
        out += [standins.NOTES[name] for name in uses if name in self.standins]
        return out

    def private(self, name: str):
        """A sub-kernel host function as ssd_combined imported it (stage intermediates)."""
        fn = getattr(self.ssd_combined, name, None)
        if fn is None:
            raise Unavailable(f"{self.label} has no {name}")
        return fn

    def call(self, name: str, *args, **kwargs):
        """Call sub-kernel ``name`` passing only the keyword arguments its signature has."""
        fn = self.private(name)
        accepted = self.params(fn)
        return fn(*args, **{k: v for k, v in kwargs.items() if k in accepted})


def _install_conv_standins(module: types.ModuleType) -> bool:
    """Fill causal_conv1d names that ``module`` imported as None (extension absent). True if any."""
    replaced = False
    for attr, standin in (("causal_conv1d_fn", standins.causal_conv1d_fn),
                          ("causal_conv1d_fwd_function", standins.causal_conv1d_fwd),
                          ("causal_conv1d_bwd_function", standins.causal_conv1d_bwd),
                          ("causal_conv1d_update_function", standins.causal_conv1d_update),
                          ("causal_conv1d_cuda", standins.causal_conv1d_cuda)):
        if attr in vars(module) and getattr(module, attr) is None:
            setattr(module, attr, standin)
            replaced = True
    return replaced


def _load_mamba() -> MambaRelease:
    runtime.configure()
    package = package_without_init("mamba_ssm")
    version = getattr(package, "__version__", "unknown")
    location = (package.__path__ or ["?"])[0]
    label = f"mamba-ssm {version}"
    try:
        ssd_combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("mamba_ssm", "src"):
            # 2.0.0 imports its modules as src.ops.* (the authors' tree); 2.0.0 and 2.0.1 lack k_activations.py.
            raise Unavailable(f"{label} is broken as shipped: its Triton ops import {err.name}, which the release "
                              f"does not contain") from None
        raise Unavailable(f"{label}: its Triton ops do not import here ({one_line(err)})") from None
    except Exception as err:       # a release that does not import with this torch/triton
        raise Unavailable(f"{label}: its Triton ops do not import here ({one_line(err)})") from None
    used = set()
    missing = {}
    if _install_conv_standins(ssd_combined):
        used.add("causal_conv1d")

    # mamba_split_conv1d_scan_ref reaches selective_scan_fn (selective_scan_interface imports the extension).
    try:
        if importlib.util.find_spec("selective_scan_cuda") is None:
            with _temporary_module("selective_scan_cuda", standins.selective_scan_cuda):
                interface = importlib.import_module("mamba_ssm.ops.selective_scan_interface")
            used.add("selective_scan_cuda")
        else:
            interface = importlib.import_module("mamba_ssm.ops.selective_scan_interface")
        if _install_conv_standins(interface):
            used.add("causal_conv1d")
    except Exception as err:
        missing["selective_scan"] = f"{label}: selective_scan_interface does not import ({one_line(err)})"

    try:
        ssd_minimal = importlib.import_module("mamba_ssm.modules.ssd_minimal")
    except ModuleNotFoundError as err:
        ssd_minimal = None
        missing["ssd_minimal"] = (f"{label} has no mamba_ssm/modules/ssd_minimal.py"
                                  if err.name == "mamba_ssm.modules.ssd_minimal"
                                  else f"{label}: ssd_minimal does not import ({one_line(err)})")
    except Exception as err:
        ssd_minimal = None
        missing["ssd_minimal"] = f"{label}: ssd_minimal does not import ({one_line(err)})"
    return MambaRelease(version=version, location=location, ssd_combined=ssd_combined, ssd_minimal=ssd_minimal,
                        standins=frozenset(used), missing=missing)


@functools.lru_cache(maxsize=None)
def _cached(loader):
    """Load once per process; a failure is remembered too (its reason does not change within a process)."""
    try:
        return loader()
    except Unavailable as err:
        return err


def loaded(loader):
    """What ``loader()`` loads, once per process, or raise the Unavailable it raised (remembered too)."""
    found = _cached(loader)
    if isinstance(found, Unavailable):
        raise found
    return found


def problem(loader) -> Optional[str]:
    """Why ``loader()`` cannot load, or None."""
    try:
        loaded(loader)
    except Unavailable as err:
        return str(err)
    return None


def mamba_ssm() -> MambaRelease:
    """The installed mamba_ssm release (loaded once per process), or raise Unavailable."""
    return loaded(_load_mamba)


def mamba_ssm_problem() -> Optional[str]:
    return problem(_load_mamba)


# ---- fla -------------------------------------------------------------------------------------------------

@dataclass
class FlaRelease:
    version: str
    simple_gla: types.ModuleType
    naive: types.ModuleType

    @property
    def label(self) -> str:
        return f"fla-core {self.version}"


def _load_fla() -> FlaRelease:
    runtime.configure()
    if importlib.util.find_spec("fla") is None:
        raise Unavailable("package fla (fla-core) is not installed")
    import warnings
    try:
        with warnings.catch_warnings():
            # fla warns that Triton "is not supported on current platform" on a CPU: the interpreter is.
            warnings.simplefilter("ignore")
            # without fla's and fla.ops's package __init__ (see the module docstring); fla.layers still imports
            fla = package_without_init("fla")
            package_without_init("fla.ops")
            simple_gla = importlib.import_module("fla.ops.simple_gla")
            naive = importlib.import_module("fla.ops.simple_gla.naive")
    except Exception as err:
        raise Unavailable(f"fla does not import here ({one_line(err)})") from None
    return FlaRelease(version=getattr(fla, "__version__", "unknown"), simple_gla=simple_gla, naive=naive)


def fla() -> FlaRelease:
    """The installed fla release (loaded once per process), or raise Unavailable."""
    found = _cached(_load_fla)
    if isinstance(found, Unavailable):
        raise found
    return found


def fla_problem() -> Optional[str]:
    try:
        fla()
    except Unavailable as err:
        return str(err)
    return None


# ---- any callable ----------------------------------------------------------------------------------------

def load_callable(target: str):
    """``package.module:function`` -> the function. mamba_ssm modules load without the package __init__
    (and with stand-ins), like the built-in adapters. Raises Unavailable with the reason."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise Unavailable(f"{target!r}: expected package.module:function")
    top = module_name.split(".")[0]
    if top == "mamba_ssm":
        mamba_ssm()
    else:
        runtime.configure()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise Unavailable(f"{target}: module {err.name} is not installed") from None
    except Exception as err:
        raise Unavailable(f"{target}: importing {module_name} failed ({one_line(err)})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise Unavailable(f"{target}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise Unavailable(f"{target}: {attr} is not callable")
    return obj
