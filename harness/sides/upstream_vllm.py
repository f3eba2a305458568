"""Loading vLLM's Mamba-2 SSD Triton ops from its installed wheel, without its compiled extension and without its
platform machinery, and detecting what the installed release can express.

``import vllm`` (and so any ``vllm.*`` import) runs the serving stack's start-up (env overrides, a compiled
extension, every platform plugin), which neither a CPU machine nor a bare GPU runner has. `vllm()` instead
registers bare package objects for the packages on the way to ``vllm.model_executor.layers.mamba.ops`` (their
``__init__`` never runs), imports the small modules the ops need as they ship (vllm.envs, vllm.logger,
vllm.logging_utils, vllm.utils.platform_utils, vllm.utils.math_utils, ops/triton_helpers.py), and puts a stand-in
only where a module exists to reach the compiled extension or to pick a platform:

    vllm.platforms                    `current_platform`: a CUDA GPU when one is present (its real name and
                                      compute capability: ssd_chunk_scan drops its racy wgmma configs on sm90
                                      from it), never "cpu" -- under the interpreter this is what makes the ops
                                      run their Triton kernels instead of vLLM's CPU fallbacks
    vllm.triton_utils                 triton and triton.language themselves (the shipped module disables Triton
                                      where no GPU driver is active, i.e. under the interpreter)
    vllm._custom_ops                  the compiled-extension bindings: nothing (ops/mamba_ssm.py imports it for
                                      selective_scan_fn only, which no adapter calls; any use raises)
    vllm.v1.attention.backends.utils  the two constants the ops import (PAD_SLOT_ID, NULL_BLOCK_ID), read from
                                      the shipped file (the module itself imports vLLM's whole config system)
    vllm.distributed.parallel_state   is_global_first_rank / is_local_first_rank: True (one process is rank 0);
                                      vllm.logger's warning_once asks them before logging

No stand-in computes anything: every number comes from vLLM's own kernels (softplus included: the real
ops/mamba_ssm.py imports once the extension bindings are stood in). `VllmRelease.standins` lists them and
`ssdiff list` shows them. What a release can express is read from its signatures.

sglang (`sglang()`): its copy of the ops lives in sglang.srt.layers.attention.mamba.ops; it is loaded the same
way where its wheel is installed, and the reason it cannot be is one line otherwise.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Optional

from ssdiff import runtime
from ssdiff.sides.upstream import Unavailable, loaded, one_line, package_without_init, problem

OPS = "vllm.model_executor.layers.mamba.ops"
BARE_PACKAGES = ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba",
                 OPS, "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends")
# The modules the adapters import from the wheel, as they ship (harness/sides/extract_vllm.py copies exactly these).
OP_MODULES = ("ssd_combined", "ssd_bmm", "ssd_chunk_scan", "ssd_chunk_state", "ssd_state_passing", "mamba_ssm",
              "triton_helpers")

STANDIN_NOTES = {
    "vllm.platforms": "vllm.platforms: stood in by ssdiff.sides.upstream_vllm (a CUDA platform when a GPU is present, "
                      "never 'cpu': the ops run their Triton kernels, not vLLM's CPU fallbacks)",
    "vllm.triton_utils": "vllm.triton_utils: stood in by ssdiff.sides.upstream_vllm (triton itself; the shipped module "
                         "disables Triton where no GPU driver is active)",
    "vllm._custom_ops": "vllm._custom_ops: stood in by ssdiff.sides.upstream_vllm (no compiled extension; none of its "
                        "ops is reached by the adapters)",
    "vllm.v1.attention.backends.utils": "vllm.v1.attention.backends.utils: stood in by ssdiff.sides.upstream_vllm "
                                        "(PAD_SLOT_ID and NULL_BLOCK_ID as the shipped file defines them)",
    "vllm.distributed.parallel_state": "vllm.distributed.parallel_state: stood in by ssdiff.sides.upstream_vllm (one "
                                       "process, rank 0: vllm.logger's *_once asks it)",
}


class StandInMissing(NotImplementedError):
    """Code under test reached a part of a stand-in module that was not stood in."""


class _Platform:
    """vLLM's `current_platform`, as far as the SSD ops ask it: which device family, its name and capability."""

    def __init__(self):
        import torch
        self._cuda = torch.cuda.is_available() and not runtime.interpreted()

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return self._cuda

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return self._cuda

    def get_device_capability(self, device_id: int = 0):
        import torch
        if not self._cuda:
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return types.SimpleNamespace(major=major, minor=minor, to_int=lambda: major * 10 + minor)

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        found = self.get_device_capability(device_id)
        if found is None:
            return False
        if isinstance(capability, tuple):
            return (found.major, found.minor) == capability
        return found.to_int() == capability

    def get_device_name(self, device_id: int = 0) -> str:
        import torch
        return torch.cuda.get_device_name(device_id) if self._cuda else "Triton interpreter (CPU)"

    def is_pin_memory_available(self) -> bool:
        return self._cuda

    def num_compute_units(self, device_id: int = 0) -> int:
        import torch
        return torch.cuda.get_device_properties(device_id).multi_processor_count if self._cuda else runtime.sm_count()

    def __getattr__(self, name):
        raise StandInMissing(f"vllm.platforms stand-in (ssdiff.sides.upstream_vllm): current_platform.{name} is not "
                             f"stood in")


def _module(name: str, doc: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__doc__ = doc
    module.ssdiff_standin = True
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


class _NoOps(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise StandInMissing(f"vllm._custom_ops.{name}: the compiled extension is absent (stand-in of "
                             f"ssdiff.sides.upstream_vllm)")


def _shipped_constants(path: str, names: tuple) -> dict:
    """Module-level ``NAME = literal`` assignments of a shipped source file (the file is not imported)."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = [n for n in names if n not in found]
    if missing:
        raise Unavailable(f"{path} defines no {', '.join(missing)}")
    return found


def _install_standins(root: str) -> frozenset:
    """Register the stand-in modules (they stay: the ops look current_platform up at call time too)."""
    import triton
    import triton.language as tl

    installed = set()
    if "vllm.platforms" not in sys.modules:
        sys.modules["vllm.platforms"] = _module("vllm.platforms", "ssdiff stand-in for vllm.platforms",
                                                current_platform=_Platform())
    installed.add("vllm.platforms")
    if "vllm.triton_utils" not in sys.modules:
        sys.modules["vllm.triton_utils"] = _module("vllm.triton_utils", "ssdiff stand-in for vllm.triton_utils",
                                                   HAS_TRITON=True, triton=triton, tl=tl)
    installed.add("vllm.triton_utils")
    if "vllm._custom_ops" not in sys.modules:
        ops = _NoOps("vllm._custom_ops")
        ops.ssdiff_standin = True
        sys.modules["vllm._custom_ops"] = ops
    installed.add("vllm._custom_ops")
    name = "vllm.v1.attention.backends.utils"
    if name not in sys.modules:
        constants = _shipped_constants(os.path.join(root, "v1", "attention", "backends", "utils.py"),
                                       ("PAD_SLOT_ID", "NULL_BLOCK_ID"))
        sys.modules[name] = _module(name, "ssdiff stand-in for vllm.v1.attention.backends.utils", **constants)
    installed.add(name)
    if "vllm.distributed.parallel_state" not in sys.modules:
        if "vllm.distributed" not in sys.modules:
            distributed = _module("vllm.distributed", "ssdiff stand-in for vllm.distributed (parallel_state only)")
            distributed.__path__ = []
            sys.modules["vllm.distributed"] = distributed
        first_rank = lambda: True
        sys.modules["vllm.distributed.parallel_state"] = _module(
            "vllm.distributed.parallel_state", "ssdiff stand-in for vllm.distributed.parallel_state",
            is_global_first_rank=first_rank, is_local_first_rank=first_rank)
    installed.add("vllm.distributed.parallel_state")
    return frozenset(installed)


def shipped_version(root: str, file: str = "_version.py") -> str:
    """The release number from a package's version file (vllm/_version.py; read, not imported)."""
    try:
        with open(os.path.join(root, file), encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return "unknown"
    found = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", text) or \
        re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text)
    return found.group(1) if found else "unknown"


@dataclass
class VllmRelease:
    """One installed vLLM release's SSD ops, loaded without its package __init__.

    ``ops``: short name (OP_MODULES) -> module; ``standins``: the stood-in module names (STANDIN_NOTES)."""

    version: str
    location: str
    ops: dict
    standins: frozenset
    missing: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"vllm {self.version}"

    @property
    def varlen(self):
        return self.ops["ssd_combined"].mamba_chunk_scan_combined_varlen

    @property
    def step(self):
        return self.ops["mamba_ssm"].selective_state_update

    def params(self, function) -> frozenset:
        return frozenset(inspect.signature(function).parameters)

    def notes(self) -> list:
        return [f"{self.label} ({self.location}): its Triton ops only"] + \
            [STANDIN_NOTES[name] for name in sorted(self.standins)]

    def kernel_modules(self) -> tuple:
        return tuple(self.ops[name] for name in ("ssd_chunk_state", "ssd_state_passing", "ssd_bmm",
                                                 "ssd_chunk_scan", "mamba_ssm"))

    def forget_tuned_configs(self) -> None:
        """vLLM's launch_autotuned keeps the first config each kernel picked and launches it directly from then
        on, past the autotuner; emptied before every call so that the config ssdiff asks for is the one run."""
        self.ops["triton_helpers"]._autotuned_configs.clear()


def _load_vllm() -> VllmRelease:
    runtime.configure()
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("package vllm is not installed (./dev setup installs vllm==0.33.0 with --no-deps)")
    root = list(spec.submodule_search_locations)[0]
    version = shipped_version(root)
    label = f"vllm {version}"
    for name in BARE_PACKAGES:
        package_without_init(name)
    sys.modules["vllm"].__version__ = version
    try:
        standins = _install_standins(root)
    except (OSError, Unavailable) as err:
        raise Unavailable(f"{label}: {one_line(err)}") from None
    ops = {}
    for name in OP_MODULES:
        try:
            ops[name] = importlib.import_module(f"{OPS}.{name}")
        except ModuleNotFoundError as err:
            raise Unavailable(f"{label}: {OPS}.{name} does not import here (module {err.name} is missing)") from None
        except Exception as err:
            raise Unavailable(f"{label}: {OPS}.{name} does not import here ({one_line(err)})") from None
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        # warning_once names every launch shape without a tuned step-kernel config file: noise in a campaign.
        import logging
        logging.getLogger("vllm").setLevel(logging.ERROR)
    missing = {}
    if not hasattr(ops["ssd_combined"], "mamba_chunk_scan_combined_varlen"):
        missing["varlen"] = f"{label} has no mamba_chunk_scan_combined_varlen"
    if not hasattr(ops["mamba_ssm"], "selective_state_update"):
        missing["step"] = f"{label} has no selective_state_update"
    return VllmRelease(version=version, location=root, ops=ops, standins=standins, missing=missing)


def vllm() -> VllmRelease:
    """The installed vLLM release's SSD ops (loaded once per process), or raise Unavailable."""
    return loaded(_load_vllm)


def vllm_problem() -> Optional[str]:
    return problem(_load_vllm)


def vllm_chunk_metadata_function():
    """vLLM's own chunk-metadata builder, ``BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(chunk_size,
    num_prefills, num_computed_tokens_p_cpu, query_start_loc_p_cpu, checkpoint_offsets_p=None)``, and how it
    was obtained: imported from vllm.v1.attention.backends.mamba_attn where that module imports (it needs
    vLLM's config system and its dependencies), otherwise compiled from that one function's source in the
    installed wheel (it uses only ``cdiv`` from vllm.utils.math_utils). Raises Unavailable."""
    vllm()
    name = "vllm.v1.attention.backends.mamba_attn"
    spec = importlib.util.find_spec("vllm.v1.attention.backends.mamba_attn")
    if spec is None or not spec.origin:
        raise Unavailable(f"{name} is not in the installed vllm")
    before = set(sys.modules)
    try:
        module = importlib.import_module(name)
        return module.BaseMambaAttentionMetadataBuilder._compute_chunk_metadata, f"imported from {name}"
    except Exception as err:
        why = one_line(err)
        # What the failed import left half-initialized of vllm; modules of other packages it imported (torch's
        # among them) stay: importing one again would run its registrations twice (torch._inductor's
        # TORCH_LIBRARY raises on that).
        for partial in set(sys.modules) - before:
            if partial == "vllm" or partial.startswith("vllm."):
                del sys.modules[partial]
    with open(spec.origin, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=spec.origin)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "BaseMambaAttentionMetadataBuilder":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "_compute_chunk_metadata":
                    item.decorator_list = []
                    code = compile(ast.Module(body=[item], type_ignores=[]), spec.origin, "exec")
                    from vllm.utils.math_utils import cdiv
                    namespace = {"cdiv": cdiv, "torch": importlib.import_module("torch")}
                    exec(code, namespace)
                    return namespace["_compute_chunk_metadata"], \
                        f"compiled from its source in {spec.origin} ({name} does not import here: {why})"
    raise Unavailable(f"{spec.origin} has no BaseMambaAttentionMetadataBuilder._compute_chunk_metadata")


# ---- sglang ----------------------------------------------------------------------------------------------

# Where sglang keeps its copy: 0.5.23 moved it from sglang/srt/layers/attention/mamba/ops to here.
SGLANG_OPS = ("sglang.kernels.ops.mamba.triton_ops", "sglang.srt.layers.attention.mamba.ops")
SGLANG_BARE = ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.mamba",
               "sglang.kernels.ops.attention", "sglang.kernels.ops.attention.fla", "sglang.kernels.jit",
               "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention", "sglang.srt.layers.attention.mamba",
               "sglang.srt.utils") + SGLANG_OPS


def _sglang_import_problem() -> Optional[str]:
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        return ("package sglang is not installed (./dev setup does not install it: sglang 0.5.23's SSD ops import "
                "its serving stack; harness/README.md, 'The serving forks')")
    runtime.configure()
    for name in SGLANG_BARE:
        try:
            package_without_init(name)
        except Unavailable:
            pass
    try:
        from importlib.metadata import version as distribution_version
        version = distribution_version("sglang")
    except Exception:
        version = "unknown"
    for ops in SGLANG_OPS:
        try:
            if importlib.util.find_spec(f"{ops}.ssd_combined") is None:
                continue
        except (ImportError, ValueError):
            continue
        try:
            importlib.import_module(f"{ops}.ssd_combined")
        except ModuleNotFoundError as err:
            import traceback
            serving = [f.filename for f in traceback.extract_tb(err.__traceback__) if "/sglang/srt/" in f.filename]
            if serving:
                reached = "sglang." + serving[0].split("/sglang/", 1)[1].removesuffix(".py").replace("/", ".")
                return (f"sglang {version}: {ops}.ssd_combined cannot be imported without sglang's serving stack "
                        f"(it reaches {reached}, which needs {err.name}, not installed)")
            return f"sglang {version}: {ops}.ssd_combined needs {err.name}, not installed"
        except Exception as err:
            return f"sglang {version}: {ops}.ssd_combined does not import here ({one_line(err)})"
        return f"sglang {version}: {ops} imports, but ssdiff has no adapter for it yet"
    return f"sglang {version} has none of {', '.join(SGLANG_OPS)}"


@functools.lru_cache(maxsize=None)
def sglang_problem() -> str:
    """Why sglang's copy of the SSD ops is not driven here, on one line (remembered per process)."""
    return _sglang_import_problem()
