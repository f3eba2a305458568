"""TF32's loss told from a defect: a float32 divergence on a GPU whose float32 dots run in TF32, examined again with
exact float32 dots.

On a CUDA GPU Triton's float32 `tl.dot` is TF32 unless TRITON_F32_DEFAULT=ieee (runtime.fp32_dot), and the budget
models TF32's rounding points (harness/budget/). At elements whose true value cancels to nearly zero a backward
kernel can sum TF32 products of much larger terms than the model's order does, and exceed the budget without a
defect (LIMIT). The case examined again under TRITON_F32_DEFAULT=ieee (the same config and sides, the budget
modelled for exact dots) tells the two apart: within budget there, the loss is TF32's; still out of budget, the
divergence stands.

The examination runs in a fresh process (`python -m ssdiff.investigate.tf32`, a case in JSON on stdin, its verdict
in JSON on stdout): a process that has compiled a kernel keeps running that variant, whatever the variable says
later (measured on an H200: the same float32 outputs with the variable set in-process, bit for bit). `ssdiff fuzz`
does this for each float32 divergence it finds on such a GPU (harness/campaign/fuzz.py), the generic property for
each float32 case that diverges natively.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

from ssdiff import runtime
from ssdiff.examine import Examiner
from ssdiff.model.case import Case
from ssdiff.truth import DEFAULT_ORACLE
from ssdiff.verdict.judge import FACTOR

LIMIT = "harness/README.md, 'Known limit: TF32 in the fused mixer's backward'"
REPLAY_TIMEOUT_S = 600


def applies(case, device) -> bool:
    """Whether ``case`` ran with TF32 float32 dots on ``device``."""
    return case.dtype == "float32" and str(device).startswith("cuda") and runtime.fp32_dot() == "tf32"


def hint(case, device) -> Optional[str]:
    """What a float32 divergence on a GPU whose float32 dots run in TF32 should be replayed under, else None."""
    if not applies(case, device):
        return None
    return (f"float32 dots ran in TF32 here: a replay under TRITON_F32_DEFAULT=ieee tells TF32's loss from a "
            f"defect ({LIMIT})")


def replay(impl: str, case, choice, device, against: Optional[str] = None, oracle_name: str = DEFAULT_ORACLE,
           factor: float = FACTOR) -> Optional[str]:
    """Where ``impl`` diverged on a float32 ``case`` under TF32 (`applies`): the case examined again with exact
    float32 dots in a fresh process (`examine_exactly`), under the same autotune ``choice`` (against the oracle, or
    ``against``; with the same oracle and factor). The verdicts there, on one line, when every side is within
    budget (the loss is TF32's), else None: the divergence stands (also where it does not apply, or the replay
    failed)."""
    if not applies(case, device):
        return None
    request = {"sides": [impl] + ([against] if against else []), "case": case.to_dict(), "choice": choice,
               "device": str(device), "oracle": oracle_name, "factor": factor}
    try:
        run = subprocess.run([sys.executable, "-m", "ssdiff.investigate.tf32"], input=json.dumps(request),
                             capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S,
                             env=dict(os.environ, TRITON_F32_DEFAULT="ieee"))
    except subprocess.TimeoutExpired:
        return None
    if run.returncode != 0 or not run.stdout.strip():
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])["within_budget"]


def examine_exactly(request: dict) -> dict:
    """In the replay's process (TRITON_F32_DEFAULT=ieee set before anything compiled): the request's case examined;
    {"within_budget": the verdicts on one line, or None where a side still diverges}."""
    with Examiner(request["sides"], request["device"], oracle_name=request["oracle"],
                  factor=request["factor"]) as examiner:
        outcome = examiner.examine(Case.from_dict(request["case"]), request["choice"])
    said = " ".join(" ".join(v.message() for v in outcome.verdicts.values()).split())
    return {"within_budget": None if outcome.diverged else said}


def main() -> int:
    print(json.dumps(examine_exactly(json.loads(sys.stdin.read()))))
    return 0


__all__ = ["LIMIT", "applies", "hint", "replay", "examine_exactly"]

if __name__ == "__main__":
    sys.exit(main())
