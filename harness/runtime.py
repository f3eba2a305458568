"""Everything specific to where kernels run: a CUDA GPU natively, or a CPU under the Triton interpreter.

The rest of ssdiff never asks which runtime it is on: it calls `configure()` once at start-up (the CLI and
conftest.py do) and asks this module for the default device and the dtypes that can run.
"""

from __future__ import annotations

import os

import torch


def has_gpu() -> bool:
    return torch.cuda.is_available()


def configure() -> None:
    """Choose the runtime before any Triton kernel is defined: without a GPU, the Triton interpreter
    (TRITON_INTERPRET=1 must be set before `triton.jit` decorates a kernel)."""
    if not has_gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_device() -> str:
    return "cuda" if has_gpu() else "cpu"


def runnable_dtypes() -> tuple:
    """bf16 only on a GPU: the interpreter's bf16 tl.dot is garbage and it rounds by truncation."""
    return ("float32", "float16", "bfloat16") if not interpreted() else ("float32", "float16")
