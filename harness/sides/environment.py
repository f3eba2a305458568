"""What a run ran on: package versions, device, runtime, and which CUDA extensions were replaced by stand-ins.
Recorded by a fuzz run (summary.json, "environment") so a report rendered elsewhere later still says it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys
from typing import Optional

PACKAGES = (("torch", "torch"), ("triton", "triton"), ("mamba-ssm", "mamba_ssm"), ("fla-core", "fla-core"),
            ("vllm", "vllm"), ("numpy", "numpy"), ("hypothesis", "hypothesis"), ("ssdiff", "ssdiff"))
EXTENSIONS = ("causal_conv1d", "selective_scan_cuda")


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):       # ValueError: a stand-in module object without a spec
        return False


def environment(device: Optional[str] = None) -> dict:
    """Versions (None: not installed), the device in words, the runtime line, and the stand-ins in use."""
    from ssdiff import runtime
    from ssdiff.sides import standins

    versions = {label: _version(dist) for label, dist in PACKAGES}
    versions["python"] = platform.python_version()
    device_words = device or runtime.default_device()
    if device_words.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.device(device_words))
            device_words = (f"{device_words}: {props.name}, {props.total_memory / 2 ** 30:.0f} GiB, "
                            f"CUDA {torch.version.cuda}")
    else:
        device_words = f"{device_words}: {platform.processor() or platform.machine()}"
    stand_ins = {name: standins.NOTES[name] for name in EXTENSIONS if not _importable(name)}
    if "vllm.model_executor.layers.mamba.ops.ssd_combined" in sys.modules:
        # vLLM's ops were loaded by ssdiff.sides.upstream_vllm in this process (perhaps from an extraction with no
        # distribution metadata): its release and module stand-ins are what ran.
        from ssdiff.sides import upstream_vllm

        rel = upstream_vllm.vllm()
        versions["vllm"] = rel.version
        stand_ins.update({name: upstream_vllm.STANDIN_NOTES[name] for name in sorted(rel.standins)})
    return {"versions": versions, "device": device_words, "runtime": runtime.describe(),
            "stand_ins": stand_ins, "platform": platform.platform(), "executable": sys.executable}


__all__ = ["environment"]
