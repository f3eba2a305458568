"""The oracle self-check: the three float64 oracles on a fixed set of cases spanning every feature of every family
(Mamba-2's entries, then Mamba-3's), with the
largest disagreement over outputs, gradients and stages. Float64 evaluation orders agree to ~1e-15; the check
(and the property suite) holds them to rtol 1e-10, atol 1e-13."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssdiff.model.case import Case, Regime
from ssdiff.inputs import materialize
from ssdiff.truth import ORACLES, evaluate

# Agreement in the torch.testing style ||a - b|| <= rtol ||b|| + atol sqrt(n): inputs are O(0.1..10), so terms
# are O(1e-3..1e3) and float64 rounding leaves ~1e-13 absolute; a true zero (y = sum_n B C = 0 with integer
# inputs) is then 1e-17 in one order and exactly 0 in another.
RTOL = 1e-10
ATOL = 1e-13

BUILTIN_CASES = (
    Case(),
    Case(batch=2, seqlen=21, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=8, D="channel", has_z=True,
         initial_states=True, dt_limit=(0.01, 0.2), pass_="backward", final_state_grad=True),
    Case(batch=2, seqlen=21, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=4, segments=((5, 8, 8), (3, 10, 6)),
         padding=(0, 2), initial_states=True, regime=Regime(decay="strong"), pass_="backward"),
    Case(seqlen=19, nheads=4, ngroups=4, headdim=3, dstate=5, chunk_size=4, segments=((5, 8, 4),), padding=(2,),
         initial_states=True, seq_idx_start=1, varlen_states=True, regime=Regime(decay="none", dt_large=True)),
    Case(entry="split_conv1d", batch=2, seqlen=13, nheads=4, ngroups=2, headdim=4, dstate=4, chunk_size=4,
         rmsnorm=True, norm_before_gate=False, d_nonssm=3, out_dim=5, outproj_bias=True, initial_states=True,
         segments=((6, 7), (13,)), pass_="backward", final_state_grad=True),
    Case(entry="split_conv1d", batch=1, seqlen=24, nheads=6, ngroups=3, headdim=4, dstate=8, chunk_size=8,
         rmsnorm=True, D="channel", regime=Regime(decay="mild", layout="strided"), pass_="backward"),
) + (
    # Mamba-3 (the mamba3 entry): GQA with z, D and all four initial states, backward through the final states;
    # cu_seqlens with a full rope and a strong decay; prefill-then-step with chunks the sequence does not fill
    Case(entry="mamba3", batch=2, seqlen=21, nheads=4, ngroups=2, headdim=3, dstate=8, chunk_size=8,
         has_dt_bias=False, dt_softplus=False, has_z=True, initial_states=True, pass_="backward",
         final_state_grad=True),
    Case(entry="mamba3", seqlen=19, nheads=4, ngroups=1, headdim=4, dstate=6, chunk_size=4, rope_fraction=1.0,
         has_dt_bias=False, dt_softplus=False, D="none", initial_states=True, segments=((5, 9, 5),),
         regime=Regime(decay="strong"), pass_="backward"),
    Case(entry="mamba3", batch=2, seqlen=13, nheads=2, headdim=4, dstate=4, chunk_size=8, has_dt_bias=False,
         dt_softplus=False, initial_states=True, mamba3_steps=4, regime=Regime(decay="mild", values="integer")),
    # the Mamba3 module around it: B/C heads shared by two heads each, the output norm, cu_seqlens, backward
    Case(entry="mamba3_layer", seqlen=17, nheads=4, ngroups=2, headdim=3, dstate=6, chunk_size=4, d_model=6,
         rmsnorm=True, rmsnorm_eps=1e-5, return_final_states=False, segments=((9, 8),), pass_="backward"),
)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, for reporting (inf when b is zero and a is not)."""
    diff, scale = (a - b).norm().item(), b.norm().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def excess(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> float:
    """||a - b|| / (rtol ||b|| + atol sqrt(n)): at most 1 when a and b agree."""
    return (a - b).norm().item() / (rtol * b.norm().item() + atol * max(b.numel(), 1) ** 0.5)


@dataclass
class Row:
    case: Case
    oracle: str
    worst_name: str
    worst: float           # excess() of the worst quantity: <= 1 means within rtol/atol
    worst_relative: float

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0


def disagreements(case: Case, device, baseline="ref.recurrent") -> list:
    """Each other oracle against ``baseline``: the worst quantity over outputs, grads, stages."""
    inputs = materialize(case, device)
    base = evaluate(case, inputs, baseline)
    rows = []
    for name in ORACLES:
        if name == baseline:
            continue
        other = evaluate(case, inputs, name)
        pairs = [(f"out.{k}", other.outputs[k], v) for k, v in base.outputs.items()]
        pairs += [(f"grad.{k}", other.grads[k], v) for k, v in base.grads.items()]
        pairs += [(f"stage.{k}", other.stages[k], v) for k, v in base.stages.items() if k in other.stages]
        worst_name, worst, a, b = max(((n, excess(a, b), a, b) for n, a, b in pairs), key=lambda item: item[1])
        rows.append(Row(case, name, worst_name, worst, relative(a, b)))
    return rows


def run(device, cases=BUILTIN_CASES) -> list:
    rows = []
    for case in cases:
        rows.extend(disagreements(case, device))
    return rows
