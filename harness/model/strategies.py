"""Hypothesis strategies for Cases, built from small pieces (one concern each) and composed.

Only small descriptions are drawn (sizes, flags, a seed); tensors come from `ssdiff.inputs`. Dependent
choices are drawn in order (ngroups from the divisors of nheads, segment lengths that sum to seqlen), so every
drawn Case is valid and shrinking moves toward the simplest one (Case() defaults are the shrink targets).

    cases(entry=..., dtypes=..., bounds=..., backward=...)   the strategy most callers want

Two refinements the fuzzer uses: ``boundary=`` (harness/sides/tiling.py) puts one dimension at a block-size
boundary of the implementation's configs; ``key=`` (harness/campaign/pool.py, on a GPU) fixes every shape field but
seqlen, which stays in the key's specialization class, and the features that select a kernel variant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from hypothesis import strategies as st

from ssdiff.model.bounds import Bounds
from ssdiff.model.case import Case, Regime


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def shapes(draw, bounds: Bounds = Bounds(), boundary=None, key=None) -> dict:
    """batch, seqlen, nheads, ngroups (a divisor of nheads), headdim, dstate, chunk_size. ``boundary``: one
    dimension at its value; ``key``: everything but seqlen fixed, seqlen in the key's class."""
    if key is not None:
        fixed = {k: getattr(key, k) for k in ("batch", "nheads", "ngroups", "headdim", "dstate", "chunk_size")}
        return dict(seqlen=key.snap(draw(st.integers(key.seqlen_min, key.seqlen_max))), **fixed)
    at = {boundary.dim: boundary.value} if boundary is not None else {}
    nheads = at.get("nheads") or draw(st.integers(1, bounds.max_nheads))
    return dict(
        batch=draw(st.integers(1, bounds.max_batch)),
        seqlen=draw(st.integers(1, bounds.max_seqlen)),
        nheads=nheads,
        ngroups=draw(st.sampled_from(divisors(nheads))),
        headdim=at.get("headdim") or draw(st.integers(1, bounds.max_headdim)),
        dstate=at.get("dstate") or draw(st.integers(1, bounds.max_dstate)),
        chunk_size=draw(st.sampled_from(bounds.chunk_sizes)),
    )


def maybe_boundary(boundaries: Sequence, rate: float):
    """None (most draws; the shrink target), or one of ``boundaries`` with probability ``rate``."""
    if not boundaries or rate <= 0:
        return st.none()
    percent = max(1, int(round(100 * rate)))
    return st.integers(0, 99).flatmap(lambda r: st.sampled_from(tuple(boundaries)) if r < percent else st.none())


@st.composite
def lengths_summing_to(draw, total: int, max_parts: int = 4) -> tuple:
    """Positive integers summing to ``total`` (cut points drawn, sorted)."""
    if total <= 0:
        return ()
    parts = draw(st.integers(1, min(max_parts, total)))
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1))) \
        if parts > 1 else []
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _pinned(pin: Optional[dict], name: str, strategy):
    """``strategy``, or the key's value of ``name`` where a compile key pins it (harness/campaign/pool.py: FLAGS)."""
    return st.just(pin[name]) if pin is not None and name in pin else strategy


@st.composite
def sequence_layout(draw, batch: int, seqlen: int, chunk_size: int, allow_padding: bool = True,
                    present: Optional[bool] = None, allow_gaps: bool = True) -> dict:
    """segments / padding / gaps / seq_idx_start, or nothing (``present``: whether there are segments; None:
    drawn). Boundaries land mid-chunk and on chunk edges; some rows get an empty sequence, padding between two
    sequences (unless ``allow_gaps`` is false: a key that pins varlen states), or only empty sequences and padding."""
    if not (draw(st.booleans()) if present is None else present):
        return {}
    segments, padding, gaps = [], [], []
    for _ in range(batch):
        if allow_padding and draw(st.integers(0, 11)) == 11:
            # every sequence of the row empty: the row is all padding
            count = draw(st.integers(1, 2))
            segments.append((0,) * count)
            gaps.append((0,) * (count - 1))
            padding.append(seqlen)
            continue
        pad = draw(st.integers(0, min(3, seqlen - 1))) if allow_padding and seqlen > 1 and draw(st.booleans()) else 0
        between = (draw(st.integers(1, min(3, seqlen - pad - 1)))
                   if allow_padding and allow_gaps and seqlen - pad > 2 and draw(st.integers(0, 3)) == 3 else 0)
        real = seqlen - pad - between
        if draw(st.booleans()) and real >= chunk_size:
            # boundaries exactly on chunk edges
            whole = real // chunk_size
            lens = [chunk_size] * whole
            lens[-1] += real - whole * chunk_size
        else:
            lens = list(draw(lengths_summing_to(real)))
        if draw(st.integers(0, 2)) == 2:
            lens.insert(draw(st.integers(0, len(lens))), 0)          # an empty sequence
        row_gaps = [0] * (len(lens) - 1)
        if between and row_gaps:
            row_gaps[draw(st.integers(0, len(row_gaps) - 1))] = between
        else:
            pad += between
        segments.append(tuple(lens))
        gaps.append(tuple(row_gaps))
        padding.append(pad)
    out = dict(segments=tuple(segments))
    if any(padding):
        out["padding"] = tuple(padding)
    if any(map(any, gaps)):
        out["gaps"] = tuple(gaps)
    if draw(st.booleans()):
        out["seq_idx_start"] = draw(st.integers(1, 2))
    return out


@st.composite
def regimes(draw, layouts: Sequence[str] = ("contiguous", "strided")) -> Regime:
    return Regime(
        decay=draw(st.sampled_from(("typical", "none", "mild", "strong"))),
        dt_large=draw(st.booleans()),
        values=draw(st.sampled_from(("normal", "integer"))),
        scale=draw(st.sampled_from((1.0, 0.25, 4.0))),
        layout=draw(st.sampled_from(tuple(layouts))),
    )


@st.composite
def scan_features(draw, batch: int, seqlen: int, chunk_size: int, entry: str, pin: Optional[dict] = None) -> dict:
    """The optional features of the scan (D, z, dt_bias, softplus, dt_limit, initial states, seq_idx); ``pin``:
    a compile key's flags, held at their values."""
    scan_like = entry in ("chunk_scan", "decode")
    out = dict(D=draw(_pinned(pin, "D", st.sampled_from(("head", "none", "channel") if scan_like
                                                        else ("head", "channel")))))
    if scan_like:
        for name in ("has_z", "has_dt_bias", "dt_softplus"):
            out[name] = draw(_pinned(pin, name, st.booleans()))
    if draw(_pinned(pin, "dt_limit", st.booleans())):
        lo = draw(st.sampled_from((0.0, 0.001, 0.01)))
        out["dt_limit"] = (lo, draw(st.sampled_from((0.05, 0.1, 1.0, math.inf))))
    out["initial_states"] = draw(_pinned(pin, "initial_states", st.booleans())) and entry != "layer"  # no layer has them
    if entry == "decode":               # one sequence per row; the step kernel always updates its state
        return out
    out.update(draw(sequence_layout(batch, seqlen, chunk_size, present=(pin or {}).get("seq_idx"),
                                    allow_gaps=not (pin or {}).get("varlen_states"))))
    # a layer returns only its output
    out["return_final_states"] = draw(_pinned(pin, "return_final_states", st.booleans())) and entry != "layer"
    return out


@st.composite
def layer_features(draw, nheads: int, headdim: int, key=None) -> dict:
    """The layer's own configuration: d_conv, the SwiGLU branch (d_ssm < d_inner), d_model (a divisor of
    d_inner, so expand is an integer), the gated RMSNorm (Mamba-2's eps 1e-5), biases; a ``key`` fixes the
    widths (d_model, d_nonssm, conv width) and its flags."""
    pin = key.pinned if key else None
    d_nonssm = key.d_nonssm if key else draw(st.sampled_from((0, 0, 2, 4)))
    d_inner = nheads * headdim + d_nonssm
    out = dict(conv_width=key.conv_width if key else draw(st.integers(1, 4)), d_nonssm=d_nonssm,
               d_model=key.d_model if key else draw(st.sampled_from(divisors(d_inner))),
               rmsnorm=draw(_pinned(pin, "rmsnorm", st.booleans())), rmsnorm_eps=1e-5,
               bias=draw(_pinned(pin, "bias", st.booleans())), conv_bias=draw(_pinned(pin, "conv_bias", st.booleans())))
    out["norm_before_gate"] = draw(_pinned(pin, "norm_before_gate",
                                           st.booleans() if out["rmsnorm"] else st.just(False)))
    return out


@st.composite
def decode_features(draw, seqlen: int, dtypes: Sequence[str], max_steps: int = 6, pin: Optional[dict] = None) -> dict:
    """The decode entry's own fields: how many of the seqlen tokens are single steps (the rest is the prefill),
    the state's dtype (float32 or one of the case dtypes allowed), rows mapped to state slots."""
    return dict(decode_steps=draw(st.integers(1, min(seqlen, max_steps))),
                state_dtype=draw(_pinned(pin, "state_dtype", st.sampled_from(tuple(dict.fromkeys(("float32",
                                                                                                   *dtypes)))))),
                state_batch_indices=draw(_pinned(pin, "state_batch_indices", st.booleans())))


@st.composite
def mixer_features(draw, nheads: int, headdim: int, key=None) -> dict:
    """The split-conv1d mixer's own features (conv width, activation, SwiGLU branch, norm, out_proj); a
    ``key`` fixes the widths (conv width, d_nonssm, out_dim) and its flags."""
    pin = key.pinned if key else None
    out = dict(conv_width=key.conv_width if key else draw(st.integers(1, 4)),
               activation=draw(_pinned(pin, "activation", st.sampled_from(("silu", "identity")))))
    out["rmsnorm"] = draw(_pinned(pin, "rmsnorm", st.booleans()))
    if out["rmsnorm"]:
        out["norm_before_gate"] = draw(_pinned(pin, "norm_before_gate", st.booleans()))
    out["d_nonssm"] = key.d_nonssm if key else draw(st.sampled_from((0, 0, 2, 3)))
    if (key.out_dim is not None) if key else draw(st.booleans()):
        out["out_dim"] = key.out_dim if key else draw(st.integers(1, 8))
        out["outproj_bias"] = draw(_pinned(pin, "outproj_bias", st.booleans()))
    return out


@st.composite
def cases(draw, entry: Optional[str] = None, dtypes: Sequence[str] = ("float32",), bounds: Bounds = Bounds(),
          backward: Optional[bool] = None, layouts: Sequence[str] = ("contiguous", "strided"),
          varlen: bool = True, boundary=None, key=None) -> Case:
    """A valid Case. ``entry``/``backward`` None: drawn. ``dtypes``: the dtypes allowed. ``boundary`` /
    ``key``: see the module docstring (a key fixes entry, dtype and layout too)."""
    if key is not None:
        entry, dtypes, layouts = key.entry, (key.dtype,), (key.layout,)
    entry = entry or draw(st.sampled_from(("chunk_scan", "split_conv1d")))    # decode only when asked for
    if entry == "mamba3":
        return draw(mamba3_cases(dtypes, bounds, backward))
    if entry == "mamba3_layer":
        return draw(mamba3_layer_cases(dtypes, bounds, backward))
    pin = key.pinned if key is not None else None
    shape = draw(shapes(bounds, boundary, key))
    fields = dict(entry=entry, dtype=draw(st.sampled_from(tuple(dtypes))), **shape)
    fields.update(draw(scan_features(shape["batch"], shape["seqlen"], shape["chunk_size"], entry, pin)))
    if entry == "split_conv1d":
        fields.update(draw(mixer_features(shape["nheads"], shape["headdim"], key)))
    if entry == "decode":
        fields.update(draw(decode_features(shape["seqlen"], dtypes, pin=pin)))
    if entry == "layer":
        fields.update(draw(layer_features(shape["nheads"], shape["headdim"], key)))
        layouts = ("contiguous",)                       # a layer's input is one contiguous tensor
    fields["regime"] = draw(regimes(layouts))
    # a key that pins decoding (layer_steps > 0), and a huge key, have forward cases only, whatever ``backward`` asks
    steps = (pin or {}).get("layer_steps")
    forward_only = key is not None and key.forward_only
    do_backward = (draw(st.booleans()) if backward is None else backward) and entry != "decode" and not forward_only
    if do_backward:
        fields["pass_"] = "backward"
        fields["final_state_grad"] = fields["return_final_states"] and draw(_pinned(pin, "final_state_grad",
                                                                                    st.booleans()))
    elif (varlen and entry == "chunk_scan" and shape["batch"] == 1 and "segments" in fields and "gaps" not in fields
          and draw(_pinned(pin, "varlen_states", st.booleans()))):
        fields["varlen_states"] = True
    elif entry == "layer" and "segments" not in fields and shape["seqlen"] > 1 and (
            draw(st.booleans()) if steps is None else steps):
        # decode the last tokens through the layer's step() and its cache (forward, one sequence per row; a key
        # pins how many, and its seqlen leaves a prefill)
        fields["layer_steps"] = steps or draw(st.integers(1, min(4, shape["seqlen"] - 1)))
    fields["seed"] = draw(st.integers(0, 2**16))
    return Case(**fields)


@st.composite
def mamba3_cases(draw, dtypes: Sequence[str] = ("float32",), bounds: Bounds = Bounds(),
                 backward: Optional[bool] = None) -> Case:
    """A valid Case of the mamba3 entry: ngroups (nheads_qk) a divisor of nheads, an even dstate (headdim_qk) with
    a rotated pair at the drawn rope fraction, D per head or none, z, the four initial states, cu_seqlens
    (segments, batch 1, sometimes with an empty sequence), and, forward, the last tokens through the step function (``mamba3_steps``)."""
    shape = draw(shapes(bounds))
    rope = draw(st.sampled_from((0.5, 1.0)))
    least = 2 if rope == 1.0 else 4
    shape["dstate"] = max(least, shape["dstate"] // 2 * 2)
    fields = dict(entry="mamba3", dtype=draw(st.sampled_from(tuple(dtypes))), rope_fraction=rope,
                  has_dt_bias=False, dt_softplus=False, D=draw(st.sampled_from(("head", "none"))),
                  has_z=draw(st.booleans()), initial_states=draw(st.booleans()),
                  return_final_states=draw(st.booleans()), **shape)
    if shape["batch"] == 1:
        fields.update({k: v for k, v in draw(sequence_layout(1, shape["seqlen"], shape["chunk_size"],
                                                             allow_padding=False)).items() if k == "segments"})
    fields["regime"] = draw(regimes(("contiguous",)))
    if draw(st.booleans()) if backward is None else backward:
        fields["pass_"] = "backward"
        fields["final_state_grad"] = fields["return_final_states"] and draw(st.booleans())
    elif "segments" not in fields and draw(st.booleans()):
        fields["mamba3_steps"] = draw(st.integers(1, min(4, shape["seqlen"])))
    fields["seed"] = draw(st.integers(0, 2**16))
    return Case(**fields)


@st.composite
def mamba3_layer_cases(draw, dtypes: Sequence[str] = ("float32",), bounds: Bounds = Bounds(),
                       backward: Optional[bool] = None) -> Case:
    """A valid Case of the mamba3_layer entry: the scan of `mamba3_cases` (no initial or final states, D per head,
    z from in_proj) inside a Mamba3 module: d_model a divisor of d_inner, the output norm or not, and, forward
    without segments, the last tokens through step() (``layer_steps``)."""
    scan = draw(mamba3_cases(dtypes, bounds, backward))
    d_inner = scan.nheads * scan.headdim
    fields = dict(entry="mamba3_layer", batch=scan.batch, seqlen=scan.seqlen, nheads=scan.nheads, headdim=scan.headdim,
                  ngroups=scan.ngroups, dstate=scan.dstate, chunk_size=scan.chunk_size, dtype=scan.dtype,
                  rope_fraction=scan.rope_fraction, segments=scan.segments, regime=scan.regime, pass_=scan.pass_,
                  return_final_states=False, rmsnorm=draw(st.booleans()), rmsnorm_eps=1e-5,
                  d_model=draw(st.sampled_from([d for d in range(1, d_inner + 1) if d_inner % d == 0])))
    if not scan.backward and scan.segments is None and scan.seqlen > 1 and draw(st.booleans()):
        fields["layer_steps"] = draw(st.integers(1, min(4, scan.seqlen - 1)))
    fields["seed"] = draw(st.integers(0, 2**16))
    return Case(**fields)
