"""TF32's loss told from a defect: a float32 divergence on a GPU whose float32 dots run in TF32, examined again with
exact float32 dots.

On a CUDA GPU Triton's float32 `tl.dot` is TF32 unless TRITON_F32_DEFAULT=ieee (runtime.fp32_dot), and the budget
models TF32's rounding points (harness/budget/). At elements whose true value cancels to nearly zero a backward
kernel can sum TF32 products of much larger terms than the model's order does, and exceed the budget without a
defect (LIMIT). The case examined again under TRITON_F32_DEFAULT=ieee (`exact_float32_dots`: the same config, the
budget modelled for exact dots; Triton compiles the kernels anew, the option being part of its cache key) tells
the two apart: within budget there, the loss is TF32's; still out of budget, the divergence stands. `ssdiff fuzz`
does this for each float32 divergence it finds on such a GPU (harness/campaign/fuzz.py), the generic property for
each float32 case that diverges natively.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

from ssdiff import runtime
from ssdiff.examine import Examiner
from ssdiff.truth import DEFAULT_ORACLE
from ssdiff.verdict.judge import FACTOR

LIMIT = "harness/README.md, 'Known limit: TF32 in the fused mixer's backward'"


def applies(case, device) -> bool:
    """Whether ``case`` ran with TF32 float32 dots on ``device``."""
    return case.dtype == "float32" and str(device).startswith("cuda") and runtime.fp32_dot() == "tf32"


def hint(case, device) -> Optional[str]:
    """What a float32 divergence on a GPU whose float32 dots run in TF32 should be replayed under, else None."""
    if not applies(case, device):
        return None
    return (f"float32 dots ran in TF32 here: a replay under TRITON_F32_DEFAULT=ieee tells TF32's loss from a "
            f"defect ({LIMIT})")


@contextlib.contextmanager
def exact_float32_dots():
    """Within the block Triton's float32 dots are exact (TRITON_F32_DEFAULT=ieee), and so is the budget's model of
    them (runtime.fp32_dot); the setting before is restored after."""
    before = os.environ.get("TRITON_F32_DEFAULT")
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_F32_DEFAULT", None)
        else:
            os.environ["TRITON_F32_DEFAULT"] = before


def replay(impl: str, case, choice, device, against: Optional[str] = None, oracle_name: str = DEFAULT_ORACLE,
           factor: float = FACTOR) -> Optional[str]:
    """Where ``impl`` diverged on a float32 ``case`` under TF32 (`applies`): the case examined again in this process
    with exact float32 dots under the same autotune ``choice`` (against the oracle, or ``against``; with the same
    oracle and factor). The verdicts there, on one line, when every side is within budget (the loss is TF32's),
    else None: the divergence stands (also where it does not apply)."""
    if not applies(case, device):
        return None
    with exact_float32_dots(), Examiner([impl] + ([against] if against else []), device, oracle_name=oracle_name,
                                        factor=factor) as examiner:
        outcome = examiner.examine(case, choice)
    if outcome.diverged:
        return None
    return " ".join(" ".join(v.message() for v in outcome.verdicts.values()).split())


__all__ = ["LIMIT", "applies", "hint", "exact_float32_dots", "replay"]
