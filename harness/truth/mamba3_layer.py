"""The Mamba3 module (SISO) in float64 from its parameters (the mamba3_layer entry):

    in_proj(u) -> [z, x (d_inner each), B, C (ngroups * d_state each), dd_dt, dd_A, trap (nheads each), angles]
    dt = softplus(dd_dt + dt_bias),  A = min(-softplus(dd_A), -A_FLOOR),  adt = A dt          (per token and head)
    k = RMSNorm(B) per B/C head (over d_state, weight k_norm_weight),  q = RMSNorm(C) likewise (q_norm_weight)
    angles shared by every head; q_bias, k_bias (C_bias, B_bias) per head
    y = the Mamba-3 scan (harness/truth/mamba3.py, in the order asked) with D, and z's gate unless rmsnorm
    rmsnorm (is_outproj_norm): y = RMSNorm(y) per head (over headdim) * rmsnorm_weight * silu(z)
    out = y @ outproj_weight^T

The norms' eps is the case's ``rmsnorm_eps``. `decode` reaches the same output as a prefill that returns the four
states followed by one recurrence step per token (the module's forward with an inference cache, then step()).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssdiff.model.evaluation import Evaluation
from ssdiff.truth import mamba3

A_FLOOR = 1e-4          # Mamba3's A_floor: the decay rate is at least this


def _rms(x, weight, eps):
    """x normalized over its last axis by its root mean square, times weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def projections(case, t: dict) -> tuple:
    """The scan's float64 tensors (harness/truth/mamba3.py's names) from u and the module's parameters, and z
    (b, L, h, p)."""
    h, p, g, n, a = case.nheads, case.headdim, case.ngroups, case.dstate, case.rope_angles
    zx = F.linear(t["u"], t["in_proj_weight"])
    z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(zx, [h * p, h * p, g * n, g * n, h, h, h, a], dim=-1)
    dt = F.softplus(dd_dt + t["dt_bias"])
    A = torch.clamp(-F.softplus(dd_A), max=-A_FLOOR)
    z = z.unflatten(-1, (h, p))
    scan = dict(q=_rms(C.unflatten(-1, (g, n)), t["q_norm_weight"], case.rmsnorm_eps),
                k=_rms(B.unflatten(-1, (g, n)), t["k_norm_weight"], case.rmsnorm_eps),
                v=x.unflatten(-1, (h, p)), dt=dt, adt=A * dt, trap=trap, q_bias=t["q_bias"], k_bias=t["k_bias"],
                angles=angles[:, :, None, :].expand(-1, -1, h, -1), D=t["D"])
    if not case.rmsnorm:
        scan["z"] = z
    return scan, z


def _out(case, t: dict, y, z) -> torch.Tensor:
    """The scan's y (b, L, h, p) through the output norm (rmsnorm) and out_proj: (b, L, d_model)."""
    if case.rmsnorm:
        weight = t["rmsnorm_weight"].unflatten(-1, (case.nheads, case.headdim))
        y = _rms(y, weight, case.rmsnorm_eps) * z * torch.sigmoid(z)
    return F.linear(y.flatten(-2), t["outproj_weight"])


def call(name: str, case, t: dict) -> Evaluation:
    """Oracle order ``name`` (its scan's order) on a mamba3_layer case's float64 tensors: y (b, L, d_model)."""
    scan, z = projections(case, t)
    res = mamba3.call(name, case.mamba3_scan, scan)
    return Evaluation({"y": _out(case, t, res.outputs["y"], z)})


def decode(case, t: dict, prefill: int) -> Evaluation:
    """y (b, L, d_model) reached as generation reaches it: the chunked order over tokens [0, prefill) returning its
    four final states, then the recurrence one token at a time from them (`mamba3.step`)."""
    scan, z = projections(case, t)
    b, L, h, p = scan["v"].shape
    first = mamba3.chunked({k: (v[:, :prefill] if v.dim() > 2 else v) for k, v in scan.items()}, None,
                           case.chunk_size)
    heads = [i // (h // case.ngroups) for i in range(h)]
    rows = []
    for row in range(b):
        states = tuple(first.outputs[name][row] for name in mamba3.STATE_OUTPUTS)
        tail = []
        for i in range(prefill, L):
            y, states = mamba3.step(scan, row, i, states, heads)
            tail.append(y)
        rows.append(torch.stack(tail))
    steps = torch.stack(rows) + scan["D"][:, None] * scan["v"][:, prefill:]
    if "z" in scan:
        steps = steps * scan["z"][:, prefill:] * torch.sigmoid(scan["z"][:, prefill:])
    y = torch.cat([first.outputs["y"], steps], dim=1)
    return Evaluation({"y": _out(case, t, y, z)})
