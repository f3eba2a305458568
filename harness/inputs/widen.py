"""Several inputs of one case evaluated as one case with their heads side by side.

Heads do not interact in the chunk_scan and decode entries: head i reads group i // (nheads / ngroups) and its
own A, D, dt_bias, x, dt, z and state. So S inputs of one case are one case of S * nheads heads and S * ngroups
groups — input j's heads j * nheads .. (j + 1) * nheads - 1, its groups likewise, which keeps each head on its
own input's groups — and each result is the widened result's j-th block of heads (or groups). The verdict needs
the float64 oracle at a case's inputs and at its neighbour samples' (harness/budget/): one widened
evaluation launches as many kernels as one of them.

The fused mixer (split_conv1d) widens the same way channel by channel: its conv is depthwise, its norm per group
of channels, its SwiGLU branch per channel, and out_proj becomes block-diagonal (input j's rows read only input
j's channels; the other blocks are zeros, which add nothing in float64). Tensors that pack several parts on
one axis (zxbcdt: [SwiGLU halves, z, x, B, C, dt]; the conv's channels [x, B, C]; the output before out_proj
[SwiGLU, y]) widen part by part (`_parts`). (The layer entry's in_proj mixes the model's width: its inputs are
evaluated one by one.)

    truth, *at_neighbours = widen.evaluate(oracle.evaluate, case, [inputs, near_1, near_2])
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.inputs import Inputs

ENTRIES = ("chunk_scan", "decode", "split_conv1d")

# The axis of heads (or groups) of every tensor of those entries, by name: inputs, outputs, gradients and stages
# (harness/model/stages.py's layouts) alike.
HEAD_AXIS = {"x": 2, "dt": 2, "A": 0, "B": 2, "C": 2, "D": 0, "z": 2, "dt_bias": 0, "initial_states": 1,
             "state": 1, "y": 2, "final_states": 1, "varlen_states": 1, "dA_cumsum": 2, "chunk_states": 2,
             "passed_states": 2, "CB": 2, "scan": 2, "skip": 2, "gated": 2}


def _parts(name: str, case: Case) -> tuple:
    """(axis, sizes): ``name``'s tensor of one input is its parts of these sizes along that axis, and the widened
    tensor holds every input's part k side by side, part after part."""
    if case.entry == "split_conv1d":
        dim, gn, d0 = case.dim, case.ngroups * case.dstate, case.d_nonssm
        mixer = {"zxbcdt": (-1, (d0, d0, dim, dim, gn, gn, case.nheads)), "conv1d_weight": (0, (dim, gn, gn)),
                 "conv1d_bias": (0, (dim, gn, gn)), "conv": (-1, (dim, gn, gn)), "rmsnorm_weight": (0, (dim,)),
                 "normed": (-1, (d0, dim)), "outproj_bias": (0, (case.out_dim,)),
                 "y": (-1, (case.out_dim,) if case.out_dim is not None else (d0, dim))}
        if name in mixer:
            axis, sizes = mixer[name]
            return axis, tuple(size for size in sizes if size)
    return HEAD_AXIS[name], None


def _widen(name: str, case: Case, tensors: list) -> torch.Tensor:
    if name == "outproj_weight":                # block-diagonal: input j's rows read input j's channels only
        return _block_diagonal(case, tensors)
    axis, sizes = _parts(name, case)
    if sizes is None:
        return torch.cat(tensors, dim=axis)
    pieces = [t.split(sizes, dim=axis) for t in tensors]
    return torch.cat([piece[k] for k in range(len(sizes)) for piece in pieces], dim=axis)


def _narrow(name: str, case: Case, wide: torch.Tensor, n: int, j: int) -> torch.Tensor:
    """Input j's part of a widened result (a copy: a kept result must not hold the others' storage)."""
    if name == "outproj_weight":
        rows, cols = _outproj_blocks(case, n, j)
        return wide[rows][:, cols].contiguous()
    axis, sizes = _parts(name, case)
    if sizes is None:
        return wide.chunk(n, dim=axis)[j].contiguous()
    parts = wide.split([n * size for size in sizes], dim=axis)
    return torch.cat([part.chunk(n, dim=axis)[j] for part in parts], dim=axis).contiguous()


def _outproj_blocks(case: Case, n: int, j: int) -> tuple:
    """The rows and columns of input j's block of the widened out_proj weight (columns: its SwiGLU channels, then
    its y channels)."""
    d0, dim, out = case.d_nonssm, case.dim, case.out_dim
    rows = torch.arange(j * out, (j + 1) * out)
    cols = torch.cat([torch.arange(j * d0, (j + 1) * d0), n * d0 + torch.arange(j * dim, (j + 1) * dim)])
    return rows, cols


def _block_diagonal(case: Case, weights: list) -> torch.Tensor:
    n, first = len(weights), weights[0]
    wide = first.new_zeros(n * case.out_dim, n * (case.d_nonssm + case.dim))
    for j, weight in enumerate(weights):
        rows, cols = _outproj_blocks(case, n, j)
        wide[rows[:, None], cols[None, :]] = weight
    return wide


def widened(inputs: list) -> Inputs:
    """The Inputs of one case with ``len(inputs)`` times the heads and groups (and the mixer's widths): each
    input's tensors side by side, the cotangents repeated."""
    first, n = inputs[0], len(inputs)
    case = first.case
    wide = dataclasses.replace(case, nheads=n * case.nheads, ngroups=n * case.ngroups)
    if case.entry == "split_conv1d":
        wide = dataclasses.replace(wide, d_nonssm=n * case.d_nonssm,
                                   out_dim=None if case.out_dim is None else n * case.out_dim)
    values = {name: _widen(name, case, [i.values[name] for i in inputs]) for name in first.values}
    cotangents = {name: _widen(name, case, [v] * n) for name, v in first.grad_outputs.items()}
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
        return {name: _narrow(name, case, t, n, j) for name, t in d.items()}

    return [Evaluation(part(result.outputs, j), part(result.grads, j), part(result.stages, j), list(result.notes))
            for j in range(n)]


__all__ = ["evaluate", "widened", "ENTRIES", "HEAD_AXIS"]
