"""What each dimension of an output, gradient or stage intermediate means, in the oracle's layouts
(harness/model/stages.py), and what one of its indices points at.

Labels: batch, token, chunk, head, group, seq (one varlen sequence), channel (the mixer's packed channels),
and the ones a budget cell reduces: p (headdim), n (dstate), i / j (positions in a chunk), tap (conv), out
(out_proj rows), model (the layer's d_model inputs of in_proj), angle (a Mamba-3 rotary pair). A channel axis lists, per channel, its part and the head or group it belongs to.

    axes_of(kind, name, case)          the TensorAxes of output / grad / stage ``name``
    owner(axis, i, axes)               the head or group (and channel part) position i along an axis belongs to
    coordinates_of(index, axes, case)  an element's coordinates in words: batch, token and its chunk, head, ...
    token_sequences(case)              per (row, token): which packed sequence, and how far into it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ssdiff.model.case import Case
from ssdiff.model.stages import BY_NAME

# Channel parts indexed by head (headdim channels each; dt one per head) and by group (dstate channels each);
# the rest (swiglu, out) belong to no head.
HEAD_PARTS = ("z", "x", "dt", "ssm", "A", "trap")
GROUP_PARTS = ("B", "C")

# Axes whose coordinate is the index itself.
_PLAIN = ("batch", "seq", "chunk", "group", "p", "n", "i", "j", "tap", "out", "model", "angle")


@dataclass(frozen=True)
class TensorAxes:
    """names: one label per dimension. channels: for a channel axis, one (part, index) per channel — part is
    z / x / dt / ssm (index = head), B / C (index = group), swiglu or out (index 0)."""

    names: tuple
    channels: tuple = ()


def channel_parts(case: Case, parts) -> tuple:
    """One (part, head or group) per channel of the packed ``parts``: ((part, width), ...) in channel order."""
    out = []
    for part, width in parts:
        for c in range(width):
            if part in ("z", "x", "ssm"):
                out.append((part, c // case.headdim))
            elif part in GROUP_PARTS:
                out.append((part, c // case.dstate))
            elif part in ("dt", "A", "trap"):
                out.append((part, c))
            else:
                out.append((part, 0))
    return tuple(out)


# The mamba3 entry's outputs and inputs (harness/truth/mamba3.py); its states lead with the sequence (a batch row,
# or a cu_seqlens sequence).
MAMBA3_AXES = {
    "y": ("batch", "token", "head", "p"), "v": ("batch", "token", "head", "p"), "z": ("batch", "token", "head", "p"),
    "q": ("batch", "token", "group", "n"), "k": ("batch", "token", "group", "n"),
    "dt": ("batch", "token", "head"), "adt": ("batch", "token", "head"), "trap": ("batch", "token", "head"),
    "angles": ("batch", "token", "head", "angle"), "q_bias": ("head", "n"), "k_bias": ("head", "n"), "D": ("head",),
    "final_angle": ("seq", "head", "angle"), "init_angle": ("seq", "head", "angle"),
    "final_states": ("seq", "head", "p", "n"), "initial_states": ("seq", "head", "p", "n"),
    "final_k": ("seq", "head", "n"), "init_k": ("seq", "head", "n"),
    "final_v": ("seq", "head", "p"), "init_v": ("seq", "head", "p"),
}


def mamba3_layer_axes(name: str, case: Case) -> TensorAxes:
    """The mamba3_layer entry's output and inputs: u and y over d_model, in_proj's rows by part (harness/truth/
    mamba3_layer.py: z, x, B, C, dd_dt, dd_A, trap, angles), the scan's per-head parameters."""
    gn, h, dim = case.ngroups * case.dstate, case.nheads, case.dim
    rows = (("z", dim), ("x", dim), ("B", gn), ("C", gn), ("dt", h), ("A", h), ("trap", h), ("angle", case.rope_angles))
    plain = {"y": ("batch", "token", "model"), "u": ("batch", "token", "model"), "dt_bias": ("head",), "D": ("head",),
             "k_norm_weight": ("n",), "q_norm_weight": ("n",), "k_bias": ("head", "n"), "q_bias": ("head", "n")}
    if name in plain:
        return TensorAxes(plain[name])
    if name == "in_proj_weight":
        return TensorAxes(("channel", "model"), channel_parts(case, rows))
    if name == "rmsnorm_weight":
        return TensorAxes(("channel",), channel_parts(case, (("ssm", dim),)))
    if name == "outproj_weight":
        return TensorAxes(("model", "channel"), channel_parts(case, (("ssm", dim),)))
    raise KeyError(f"no axes for mamba3_layer {name!r}")


def axes_of(kind: str, name: str, case: Case) -> TensorAxes:
    """The axes of output / grad / stage ``name`` for ``case`` (the oracle's layouts)."""
    gn = case.ngroups * case.dstate
    ssm_width = ((("swiglu", case.d_nonssm),) if case.d_nonssm else ()) + (("ssm", case.dim),)
    conv_parts = (("x", case.dim), ("B", gn), ("C", gn))
    zxbcdt_parts = ((("swiglu", 2 * case.d_nonssm),) if case.d_nonssm else ()) + (("z", case.dim),) + conv_parts \
        + (("dt", case.nheads),)
    if case.entry == "mamba3" and name in MAMBA3_AXES:
        return TensorAxes(MAMBA3_AXES[name])
    if case.entry == "mamba3_layer":
        return mamba3_layer_axes(name, case)
    if case.entry == "layer":
        # the layer's own tensors: its input and output (d_model channels), in_proj (zxbcdt channels x d_model)
        if name in ("y", "u") and kind in ("output", "grad", "stage"):
            return TensorAxes(("batch", "token", "channel"), channel_parts(case, (("out", case.d_model),)))
        if kind == "grad" and name == "in_proj_weight":
            return TensorAxes(("channel", "model"), channel_parts(case, zxbcdt_parts))
        if kind == "grad" and name == "in_proj_bias":
            return TensorAxes(("channel",), channel_parts(case, zxbcdt_parts))
        if kind == "grad" and name == "A_log":
            return TensorAxes(("head",))
        if kind == "grad" and name == "outproj_weight":
            return TensorAxes(("model", "channel"), channel_parts(case, ssm_width))
        if kind == "grad" and name == "outproj_bias":
            return TensorAxes(("model",))
        if kind == "stage" and name == "in_proj":
            return TensorAxes(("batch", "token", "channel"), channel_parts(case, zxbcdt_parts))
    if kind == "output" or (kind == "stage" and name == "y"):
        if name == "y":
            if case.entry in ("chunk_scan", "decode"):      # decode: token = the decode step
                return TensorAxes(("batch", "token", "head", "p"))
            if case.out_dim is not None:
                return TensorAxes(("batch", "token", "channel"), channel_parts(case, (("out", case.out_dim),)))
            return TensorAxes(("batch", "token", "channel"), channel_parts(case, ssm_width))
        if name == "final_states":
            return TensorAxes(("batch", "head", "p", "n"))
        if name == "varlen_states":
            return TensorAxes(("seq", "head", "p", "n"))
    if kind == "grad":
        if name in ("x", "z"):
            return TensorAxes(("batch", "token", "head", "p"))
        if name == "dt":
            return TensorAxes(("batch", "token", "head"))
        if name in ("B", "C"):
            return TensorAxes(("batch", "token", "group", "n"))
        if name in ("A", "dt_bias"):
            return TensorAxes(("head",))
        if name == "D":
            return TensorAxes(("head",) if case.D == "head" else ("head", "p"))
        if name == "initial_states":
            return TensorAxes(("batch", "head", "p", "n"))
        if name == "zxbcdt":
            return TensorAxes(("batch", "token", "channel"), channel_parts(case, zxbcdt_parts))
        if name == "conv1d_weight":
            return TensorAxes(("channel", "tap"), channel_parts(case, conv_parts))
        if name == "conv1d_bias":
            return TensorAxes(("channel",), channel_parts(case, conv_parts))
        if name == "rmsnorm_weight":
            return TensorAxes(("channel",), channel_parts(case, (("ssm", case.dim),)))
        if name == "outproj_weight":
            return TensorAxes(("out", "channel"), channel_parts(case, ssm_width))
        if name == "outproj_bias":
            return TensorAxes(("out",))
    if kind == "stage" and name in BY_NAME:
        parts = {"conv": conv_parts, "normed": ssm_width}
        return TensorAxes(BY_NAME[name].axes, channel_parts(case, parts[name]) if name in parts else ())
    raise KeyError(f"no axes for {kind} {name!r}")


def owner(axis: str, i: int, axes: TensorAxes) -> tuple:
    """What position ``i`` along ``axis`` belongs to: (kind, index, part) with kind "head" (index a head),
    "group" (index a group) or "other" (index ``i``); part is the channel part on a channel axis, else None."""
    if axis == "channel" and axes.channels:
        part, k = axes.channels[i]
        if part in HEAD_PARTS:
            return "head", k, part
        if part in GROUP_PARTS:
            return "group", k, part
        return "other", i, part
    if axis in ("head", "group"):
        return axis, i, None
    return "other", i, None


def group_of(kind: str, index: int, case: Case) -> Optional[int]:
    """The group of an `owner` result: a head's group, a group itself, or None."""
    if kind == "head":
        return index // case.heads_per_group
    if kind == "group":
        return index
    return None


def coordinates_of(index, axes: TensorAxes, case: Case) -> dict:
    """Coordinates of the element at ``index``, in dimension order: batch, token (and its chunk), head (and its
    group), group, channel (and its head or group, and part), seq, p, n, ..."""
    out = {}
    for axis, i in zip(axes.names, index):
        if axis == "token" and case.entry == "decode":
            out["step"] = i                          # a decoded token: its step and its place in the sequence
            out["token"] = case.prefill_len + i
        elif axis == "token":
            out["token"] = i
            out["chunk"] = i // case.chunk_size
        elif axis == "head" or (axis == "channel" and axes.channels):
            kind, k, part = owner(axis, i, axes)
            if part is not None:
                out["channel"] = i
            if kind == "head":
                out["head"] = k
            group = group_of(kind, k, case)
            if group is not None:
                out["group"] = group
            if part is not None:
                out["part"] = part
        elif axis in _PLAIN:
            out[axis] = i
    return out


def token_sequences(case: Case) -> list:
    """Per batch row, per token: (ordinal of its sequence in the row, offset from that sequence's start), or
    None at a padding token. Needs ``case.segments``."""
    out = []
    pads = case.padding or (0,) * case.batch
    for r, (row, pad) in enumerate(zip(case.segments, pads)):
        marks, gaps = [], (0, *case.gaps[r]) if case.gaps is not None else (0,) * len(row)
        for k, (n, gap) in enumerate(zip(row, gaps)):
            marks.extend([None] * gap)
            marks.extend((k, off) for off in range(n))
        marks.extend([None] * pad)
        out.append(marks)
    return out


__all__ = ["TensorAxes", "HEAD_PARTS", "GROUP_PARTS", "channel_parts", "axes_of", "owner", "group_of",
           "coordinates_of", "token_sequences"]
