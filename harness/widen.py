"""Several inputs of one case evaluated as one case with their heads side by side.

Heads do not interact in the chunk_scan and decode entries: head i reads group i // (nheads / ngroups) and its
own A, D, dt_bias, x, dt, z and state. So S inputs of one case are one case of S * nheads heads and S * ngroups
groups — input j's heads j * nheads .. (j + 1) * nheads - 1, its groups likewise, which keeps each head on its
own input's groups — and each result is the widened result's j-th block of heads (or groups). The verdict needs
the float64 oracle at a case's inputs and at its neighbour samples' (harness/baseline.py): one widened
evaluation launches as many kernels as one of them. (The split_conv1d and layer entries mix heads in out_proj
and in_proj: their inputs are evaluated one by one.)

    truth, *at_neighbours = widen.evaluate(oracle.evaluate, case, [inputs, near_1, near_2])
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from harness.case import Case
from harness.evaluation import Evaluation
from harness.inputs import Inputs

ENTRIES = ("chunk_scan", "decode")

# The axis of heads (or groups) of every tensor of those entries, by name: inputs, outputs, gradients and stages
# (harness/oracle/result.py's layouts) alike.
HEAD_AXIS = {"x": 2, "dt": 2, "A": 0, "B": 2, "C": 2, "D": 0, "z": 2, "dt_bias": 0, "initial_states": 1,
             "state": 1, "y": 2, "final_states": 1, "varlen_states": 1, "dA_cumsum": 2, "chunk_states": 2,
             "passed_states": 2, "CB": 2, "scan": 2, "skip": 2, "gated": 2}


def widened(inputs: list) -> Inputs:
    """The Inputs of one case with ``len(inputs)`` times the heads and groups: each input's tensors side by side
    on their head (group) axis, the cotangents repeated."""
    first, n = inputs[0], len(inputs)
    case = first.case
    wide = dataclasses.replace(case, nheads=n * case.nheads, ngroups=n * case.ngroups)
    values = {name: torch.cat([i.values[name] for i in inputs], dim=HEAD_AXIS[name]) for name in first.values}
    cotangents = {name: torch.cat([v] * n, dim=HEAD_AXIS[name]) for name, v in first.grad_outputs.items()}
    return dataclasses.replace(first, case=wide, values=values, grad_outputs=cotangents)


def evaluate(evaluator: Callable[[Case, Inputs], Evaluation], case: Case, inputs: list) -> list:
    """``evaluator(case, inputs[j])`` for every j, from one evaluation where the entry allows (ENTRIES), else one
    by one."""
    if case.entry not in ENTRIES or len(inputs) == 1:
        return [evaluator(case, i) for i in inputs]
    wide = widened(inputs)
    result = evaluator(wide.case, wide)
    n = len(inputs)

    def part(d: dict, j: int) -> dict:
        # copies, not views: a kept result must not hold the others' storage
        return {name: t.chunk(n, dim=HEAD_AXIS[name])[j].contiguous() for name, t in d.items()}

    return [Evaluation(part(result.outputs, j), part(result.grads, j), part(result.stages, j), list(result.notes))
            for j in range(n)]


__all__ = ["evaluate", "widened", "ENTRIES", "HEAD_AXIS"]
