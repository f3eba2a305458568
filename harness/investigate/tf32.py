"""TF32's loss told from a defect: a float32 divergence on a GPU whose float32 dots run in TF32, replayed with exact
float32 dots.

On a CUDA GPU Triton's float32 `tl.dot` is TF32 unless TRITON_F32_DEFAULT=ieee (runtime.fp32_dot), and the budget
models TF32's rounding points (harness/budget/). At elements whose true value cancels to nearly zero a
backward kernel can sum TF32 products of much larger terms than the model's order does, and exceed the budget
without a defect (LIMIT). A replay of the case in a fresh process under TRITON_F32_DEFAULT=ieee (the same config,
the budget modelled for exact dots) tells the two apart: within budget there, the loss is TF32's; still out of
budget, the divergence stands. `ssdiff fuzz` runs this replay for each float32 divergence it finds on such a GPU
(harness/campaign/fuzz.py), properties/test_upstream.py for each float32 case that diverges natively.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Optional

from ssdiff import runtime

LIMIT = "harness/README.md, 'Known limit: TF32 in the fused mixer's backward'"
REPO = Path(__file__).resolve().parents[2]
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


def replay(impl: str, case, choice, device, folder, against: Optional[str] = None) -> Optional[str]:
    """Where ``impl`` diverged on a float32 ``case`` under TF32 (`applies`): the case replayed by `ssdiff replay` in
    a fresh process under TRITON_F32_DEFAULT=ieee with the same autotune ``choice`` (against the oracle, or
    ``against``). What the replay printed, on one line, when it is within budget there (the loss is TF32's), else
    None: the divergence stands (also where it does not apply, or the replay failed)."""
    if not applies(case, device):
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = case.to_json()
    path = folder / f"tf32-{case.seed}-{zlib.crc32(text.encode()):08x}.json"
    path.write_text(text)
    cmd = [sys.executable, "-m", "ssdiff.cli", "replay", str(path), "--impl", impl, "--device", str(device),
           "--autotune", str(choice)]
    if against:
        cmd += ["--against", against]
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S, cwd=REPO,
                             env=dict(os.environ, TRITON_F32_DEFAULT="ieee", PYTHONPATH=os.pathsep.join(paths)))
    except subprocess.TimeoutExpired:
        return None
    return " ".join(run.stdout.split()) if run.returncode == 0 else None


__all__ = ["LIMIT", "applies", "hint", "replay"]
