"""The dtypes a case names, and the two facts of each that judging needs: its unit roundoff and where it overflows."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}


def torch_dtype(case) -> torch.dtype:
    """The torch dtype of ``case.dtype`` (what activations are handed to implementations in)."""
    return TORCH_DTYPES[case.dtype]


def overflow_edge(dtype: torch.dtype) -> float:
    """The magnitude from which a value rounds to Inf in ``dtype``: its largest finite value plus half a unit
    in the last place there (65520 in float16)."""
    info = torch.finfo(dtype)
    return float(info.max) * (1.0 + UNIT_ROUNDOFF[dtype] / (2.0 - 2.0 * UNIT_ROUNDOFF[dtype]))


__all__ = ["TORCH_DTYPES", "UNIT_ROUNDOFF", "torch_dtype", "overflow_edge"]
