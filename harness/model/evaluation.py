"""What one evaluation of a case returns, and the one way every evaluator produces it.

An evaluator — an implementation under test, a float64 oracle, the same-precision baseline, a test double —
builds leaf tensors from the case's inputs, runs its forward on them, and for backward cases differentiates
the outputs with the case's cotangents. `evaluate_graph` does the running, differentiating and detaching;
`differentiate` is the gradient rule (the same for all of them); `Evaluation` holds the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ssdiff.model.case import Case


@dataclass
class Evaluation:
    """outputs: "y", "final_states", "varlen_states" (as the case asks); grads: input name -> gradient
    (backward cases); stages: stage name -> tensor (harness/model/stages.py's layouts); notes: facts a verdict
    must repeat (e.g. a CPU stand-in was used)."""

    outputs: dict
    grads: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def y(self):
        return self.outputs["y"]

    @property
    def final_states(self):
        return self.outputs.get("final_states")

    @property
    def varlen_states(self):
        return self.outputs.get("varlen_states")

    def detached(self) -> "Evaluation":
        detach = lambda d: {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
        return Evaluation(detach(self.outputs), detach(self.grads), detach(self.stages), list(self.notes))

    def to(self, device) -> "Evaluation":
        """A detached copy on ``device`` (what the isolated child sends back)."""
        move = lambda d: {k: (v.detach().to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
        return Evaluation(move(self.outputs), move(self.grads), move(self.stages), list(self.notes))


def differentiate(case: Case, inputs, tensors: dict, outputs: dict) -> dict:
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


def evaluate_graph(case: Case, inputs, leaves: dict, forward: Callable[[], Evaluation]) -> Evaluation:
    """Run ``forward()`` on ``leaves`` (built by the caller, requiring grad for backward cases), differentiate
    for backward cases, and return the result detached. Gradients come as autograd gives them (in their
    leaves' dtypes)."""
    with torch.set_grad_enabled(case.backward):
        result = forward()
        if case.backward:
            result.grads = differentiate(case, inputs, leaves, result.outputs)
    return result.detached()


__all__ = ["Evaluation", "differentiate", "evaluate_graph"]
