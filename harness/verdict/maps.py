"""Compact error maps for reports: the verdict's per-element ratio-to-budget map (harness/verdict/judge.py keeps it,
max-reduced to the local axes batch / token / chunk / head / group / channel) turned into small JSON:

- ``matrix``: rows x chunks (rows are heads, groups, or the mixer's channel parts by head / group), the largest
  ratio in each cell — what the head x chunk heatmap shows;
- ``group_matrix``: the same by group (heads pooled per group), when the case has ngroups > 1 and rows are
  heads;
- ``sequence``: one row per batch row (or per sequence for varlen states), the largest ratio at each token —
  what the error-along-the-sequence plot shows.

Large maps are max-pooled (never averaged: one bad element must stay visible) to at most MAX_ROWS rows,
MAX_COLS columns and MAX_TOKENS tokens; ``*_bin`` says how many original rows/columns/tokens one entry covers.
Values are rounded to 4 significant digits. `error_maps` is what a fuzz run writes as error_maps.json.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ssdiff.model.axes import TensorAxes, group_of, owner
from ssdiff.model.case import Case

MAX_ROWS = 64
MAX_COLS = 128
MAX_TOKENS = 1024
FORMAT = 1


def _round(x: float) -> float:
    return float(f"{x:.4g}") if math.isfinite(x) else x


def _pool(t: torch.Tensor, dim: int, limit: int):
    """Max-pool ``t`` along ``dim`` to at most ``limit`` entries. Returns (tensor, bin width)."""
    size = t.shape[dim]
    if size <= limit:
        return t, 1
    width = math.ceil(size / limit)
    pad = width * math.ceil(size / width) - size
    if pad:
        shape = list(t.shape)
        shape[dim] = pad
        t = torch.cat([t, t.new_zeros(shape)], dim=dim)
    shape = list(t.shape)
    shape[dim:dim + 1] = [t.shape[dim] // width, width]
    return t.reshape(shape).amax(dim=dim + 1), width


def _row_keys(axis: str, size: int, axes: TensorAxes) -> list:
    """One (label, kind, index) per position of the row axis; kind is head, group or other."""
    keys = []
    for i in range(len(axes.channels) if axis == "channel" else size):
        kind, k, part = owner(axis, i, axes)
        if kind == "other":            # swiglu / out: one row per channel is too many; pooled below by MAX_ROWS
            label = f"{part} {k}"
        else:
            label = ("" if part is None else f"{part} ") + ("h" if kind == "head" else "g") + str(k)
        keys.append((label, kind, k))
    return keys


def tensor_map(t, case: Case) -> Optional[dict]:
    """The compact maps of one TensorVerdict (None when it has no error map: ok-without-map, mismatch...)."""
    m = getattr(t, "ratio_map", None)
    if m is None:
        return None
    m = m.to(torch.float32).clone()
    axes = list(t.map_axes)
    tensor_axes = getattr(t, "axes", None) or TensorAxes(tuple(axes))
    out: dict = {"name": t.name, "status": t.status, "ratio": _round(t.ratio), "axes": axes}

    # ---- rows: the head / group / channel axis, channels collapsed to their (part, index) keys
    row_axis = next((a for a in ("head", "group", "channel") if a in axes), None)
    if row_axis is not None:
        dim = axes.index(row_axis)
        keys = _row_keys(row_axis, m.shape[dim], tensor_axes)
        labels = list(dict.fromkeys(k[0] for k in keys))
        index = {lab: i for i, lab in enumerate(labels)}
        member = torch.tensor([index[k[0]] for k in keys])
        moved = m.movedim(dim, -1)
        pooled = moved.new_zeros(moved.shape[:-1] + (len(labels),))
        pooled = pooled.scatter_reduce(-1, member.expand(moved.shape), moved, reduce="amax", include_self=True)
        m = pooled.movedim(-1, dim)
        row_kinds = {k[0]: (k[1], k[2]) for k in keys}
    else:
        labels, row_kinds = [""], {"": ("other", 0)}
        m = m.unsqueeze(-1)
        axes = axes + ["row"]
        row_axis, dim = "row", len(axes) - 1
    rdim = axes.index(row_axis)

    # ---- the sequence profile: rows of batch (or seq) x token, everything else pooled
    if "token" in axes:
        tdim = axes.index("token")
        keep = [d for d in range(m.dim()) if d == tdim or axes[d] in ("batch", "seq")]
        drop = [d for d in range(m.dim()) if d not in keep]
        prof = m.amax(dim=drop) if drop else m
        if prof.dim() == 1:
            prof = prof.unsqueeze(0)
        prof, tbin = _pool(prof, 1, MAX_TOKENS)
        out["sequence"] = [[_round(float(v)) for v in row] for row in prof.tolist()]
        out["sequence_bin"] = tbin
        out["sequence_rows"] = "batch" if "batch" in axes else "seq"

    # ---- the matrix: rows x chunks (or x batch rows, or one column)
    if "token" in axes:
        tdim = axes.index("token")
        L = m.shape[tdim]
        nchunks = math.ceil(L / case.chunk_size)
        pad = nchunks * case.chunk_size - L
        if pad:
            shape = list(m.shape)
            shape[tdim] = pad
            m = torch.cat([m, m.new_zeros(shape)], dim=tdim)
        shape = list(m.shape)
        shape[tdim:tdim + 1] = [nchunks, case.chunk_size]
        m = m.reshape(shape).amax(dim=tdim + 1)
        cols_axis, cdim = "chunk", tdim
    elif "chunk" in axes:
        cols_axis, cdim = "chunk", axes.index("chunk")
    elif "batch" in axes or "seq" in axes:
        cols_axis = "batch" if "batch" in axes else "seq"
        cdim = axes.index(cols_axis)
    else:
        cols_axis, cdim = None, None
    keep = [d for d in (rdim, cdim) if d is not None]
    drop = [d for d in range(m.dim()) if d not in keep]
    mat = m.amax(dim=drop) if drop else m
    if cdim is None:
        mat = mat.unsqueeze(-1)
    elif cdim < rdim:
        mat = mat.transpose(0, 1)
    mat, rbin = _pool(mat, 0, MAX_ROWS)
    mat, cbin = _pool(mat, 1, MAX_COLS)
    if rbin > 1:
        labels = [f"{labels[i]}..{labels[min(i + rbin, len(labels)) - 1]}" for i in range(0, len(labels), rbin)]
    out["matrix"] = [[_round(float(v)) for v in row] for row in mat.tolist()]
    out["rows"] = labels
    out["rows_axis"] = {"channel": "channel part"}.get(row_axis, row_axis if row_axis != "row" else None)
    out["cols_axis"] = cols_axis
    out["cols_bin"] = cbin
    out["rows_bin"] = rbin

    # ---- by group, where groups matter: heads pooled into their groups
    if case.ngroups > 1 and rbin == 1 and any(row_kinds[lab][0] in ("head", "group") for lab in labels):
        full = torch.tensor(out["matrix"])
        groups = torch.zeros(case.ngroups, full.shape[1])
        for r, lab in enumerate(labels):
            g = group_of(*row_kinds[lab], case)
            if g is None:
                continue
            groups[g] = torch.maximum(groups[g], full[r])
        if row_axis != "group":
            out["group_matrix"] = [[_round(float(v)) for v in row] for row in groups.tolist()]
    return out


def error_maps(case: Case, verdicts: dict) -> dict:
    """{"format", "sides": {side: {tensor name: tensor_map}}} for every tensor with an error map."""
    sides = {}
    for side, verdict in verdicts.items():
        maps = {}
        for t in getattr(verdict, "tensors", []):
            tm = tensor_map(t, case)
            if tm is not None:
                maps[t.name] = tm
        sides[side] = maps
    return {"format": FORMAT, "chunk_size": case.chunk_size, "seqlen": case.seqlen, "sides": sides}


__all__ = ["error_maps", "tensor_map", "MAX_ROWS", "MAX_COLS", "MAX_TOKENS"]
