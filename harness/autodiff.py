"""Input gradients of a case, the same way for every implementation and for the oracles."""

from __future__ import annotations

from harness.case import Case
from harness.inputs import Inputs

import torch


def differentiate(case: Case, inputs: Inputs, tensors: dict, outputs: dict) -> dict:
    """Gradients of <y, dy> (+ <final_states, dfinal> when the case asks) for every differentiable input
    in ``tensors`` that requires grad. Unused inputs get zeros. Views (the strided layout) work too."""
    roots = [outputs["y"]]
    cotangents = [inputs.grad_outputs["y"].to(outputs["y"].dtype)]
    if case.final_state_grad:
        roots.append(outputs["final_states"])
        cotangents.append(inputs.grad_outputs["final_states"].to(outputs["final_states"].dtype))
    names = [n for n in inputs.differentiable if n in tensors and tensors[n].requires_grad]
    # An output that is a constant (e.g. final_states after a padding tail is exactly zero) adds nothing.
    live = [(r, c) for r, c in zip(roots, cotangents) if r.requires_grad]
    if not live:
        return {n: torch.zeros_like(tensors[n]) for n in names}
    found = torch.autograd.grad([r for r, _ in live], [tensors[n] for n in names], [c for _, c in live],
                                allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(tensors[n])) for n, g in zip(names, found)}
