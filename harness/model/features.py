"""The optional features of a Case, one record each: its key, what it is called, whether a case has it, how it
is switched off, and the pipeline stage that exists only because of it.

Every consumer speaks these keys: capabilities (`Capabilities.unsupported`), fitting a case to what the
implementations can express (harness/sides/base.py: `fit_case`), the feature ablation (`minimal_trigger`, whose
keys verdict.json stores as "trigger" and "tried"), the minimizer's feature steps (harness/investigate/shrink.py) and the
properties that draw cases within an implementation's capabilities (properties/test_upstream.py).

    present(case)            the keys of the features ``case`` has
    switch_off(case, key)    ``case`` without that feature, or None when it has none or it cannot go alone
    without(case, keys)      ``case`` with each of those features it has switched off, in table order
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ssdiff.model.case import Case, CaseError


@dataclass(frozen=True)
class Feature:
    """One optional feature.

    key: the name stored and matched (capabilities, verdict.json); label: what it is called in messages ("the
    divergence needs ngroups > 1"); off: the case without it, in words (a minimizer step); present(case) ->
    bool; switch_off(case) -> Case (raises CaseError where the feature cannot be switched off alone); stage:
    the pipeline stage that exists only because of it (harness/model/stages.py: STAGE_ORDER), or None;
    observes: it only adds what is judged (gradients, final states) to a forward pass it leaves as it is."""

    key: str
    label: str
    off: str
    present: Callable[[Case], bool]
    switch_off: Callable[[Case], Case]
    stage: Optional[str] = None
    observes: bool = False


def _no_seq_idx(c: Case) -> Case:
    return c.replace(segments=None, padding=None, gaps=None, seq_idx_start=0, varlen_states=False)


def _no_empty_sequences(c: Case) -> Case:
    """Each empty sequence left out (the gap before it joins the next gap, or the row's first or last sequence);
    a row of empty sequences alone becomes one sequence over all its tokens."""
    segments, gaps, padding = [], [], []
    for row, lengths in enumerate(c.segments):
        between = c.gaps[row] if c.gaps is not None else (0,) * (len(lengths) - 1)
        kept, kept_gaps, carried = [], [], 0
        for i, n in enumerate(lengths):
            carried += between[i - 1] if i else 0
            if n:
                if kept:
                    kept_gaps.append(carried)
                kept.append(n + (carried if not kept else 0))   # no gap before a row's first sequence
                carried = 0
        if kept:
            kept[-1] += carried                                 # the gap before a trailing empty sequence
        pad = (c.padding or (0,) * c.batch)[row]
        if not kept:
            kept, pad = [c.seqlen], 0
        segments.append(tuple(kept))
        gaps.append(tuple(kept_gaps))
        padding.append(pad)
    return c.replace(segments=tuple(segments), gaps=tuple(gaps) if any(map(any, gaps)) else None,
                     padding=tuple(padding) if any(padding) else None)


def _no_gaps(c: Case) -> Case:
    """Each gap's tokens given to the sequence before it."""
    segments = tuple(tuple(n + (gaps[i] if i < len(gaps) else 0) for i, n in enumerate(row))
                     for row, gaps in zip(c.segments, c.gaps))
    return c.replace(segments=segments, gaps=None)


def _fold_padding(c: Case) -> Case:
    segments = tuple(row[:-1] + (row[-1] + pad,) for row, pad in zip(c.segments, c.padding))
    return c.replace(segments=segments, padding=None)


def _no_final_states(c: Case) -> Case:
    if c.varlen_states:
        raise CaseError("return_final_states: stays on while varlen_states is (switch varlen_states off first)")
    return c.replace(return_final_states=False, final_state_grad=False)


def _unragged(c: Case) -> Case:
    """seqlen up to a whole number of chunks, the tokens added to each row's padding where it has some, else to its
    last sequence that has tokens: every sequence's tokens keep their places, every chunk stays."""
    delta = -c.seqlen % c.chunk_size
    changes = dict(seqlen=c.seqlen + delta)
    if c.segments is not None:
        pads = c.padding or (0,) * c.batch
        segs = []
        for row, pad in zip(c.segments, pads):
            last = max((i for i, n in enumerate(row) if n), default=None)
            if last is None and not pad:
                raise CaseError("ragged: a row of empty sequences and gaps alone has no sequence or padding to "
                                "take tokens")
            segs.append(row if pad else row[:last] + (row[last] + delta,) + row[last + 1:])
        changes["segments"] = tuple(segs)
        changes["padding"] = tuple(pad + delta if pad else 0 for pad in pads) if any(pads) else None
    return c.replace(**changes)


def _no_swiglu(c: Case) -> Case:
    """No SwiGLU branch; a layer keeps an integer expand (d_model down to a divisor of the new d_inner)."""
    if c.entry == "layer":
        return c.replace(d_nonssm=0, d_model=math.gcd(c.d_model, c.dim))
    return c.replace(d_nonssm=0)


def _one_row(c: Case) -> Case:
    """batch 1, keeping the row whose sequences show the most: padding first, then the most sequences."""
    if c.segments is None:
        return c.replace(batch=1)
    pads = c.padding or (0,) * c.batch
    keep = max(range(c.batch), key=lambda r: (pads[r] > 0, len(c.segments[r])))
    return c.replace(batch=1, **c.row_layout(keep))


# The order is the ablation's (minimal_trigger tries them in it) and `without`'s: a feature whose switch-off
# changes the fields another's reads (seq_idx before padding and ragged, varlen_states before final_states,
# backward before final_state_grad) comes first.
FEATURES = (
    Feature("groups", "ngroups > 1", "ngroups 1", lambda c: c.ngroups > 1, lambda c: c.replace(ngroups=1)),
    Feature("rmsnorm", "rmsnorm", "no rmsnorm", lambda c: c.rmsnorm,
            lambda c: c.replace(rmsnorm=False, norm_before_gate=True), stage="normed"),
    Feature("out_proj", "out_proj", "no out_proj", lambda c: c.out_dim is not None,
            lambda c: c.replace(out_dim=None, outproj_bias=False), stage="y"),
    Feature("outproj_bias", "an out_proj bias", "no out_proj bias", lambda c: c.outproj_bias,
            lambda c: c.replace(outproj_bias=False), stage="y"),
    Feature("d_nonssm", "the SwiGLU branch (d_nonssm > 0)", "no SwiGLU branch", lambda c: c.d_nonssm > 0,
            _no_swiglu, stage="normed"),
    Feature("z", "z", "no z", lambda c: c.has_z, lambda c: c.replace(has_z=False), stage="gated"),
    # the scan's D is optional; the mixer always takes one, per head or per channel
    Feature("D", "D", "D none", lambda c: c.entry in ("chunk_scan", "decode", "mamba3") and c.D != "none",
            lambda c: c.replace(D="none"), stage="skip"),
    Feature("D_channel", "per-channel D", "D per head",
            lambda c: c.entry in ("split_conv1d", "layer") and c.D == "channel",
            lambda c: c.replace(D="head"), stage="skip"),
    # the layer entry: biases of in_proj / out_proj and of the conv1d
    Feature("bias", "in_proj and out_proj biases", "no in_proj / out_proj bias", lambda c: c.bias,
            lambda c: c.replace(bias=False)),
    Feature("conv_bias", "a conv1d bias", "no conv1d bias", lambda c: c.conv_bias and c.entry == "layer",
            lambda c: c.replace(conv_bias=False), stage="conv"),
    # the decode entry: rows mapped to state slots, a half-precision state, more than one decode step
    Feature("state_batch_indices", "state_batch_indices (rows mapped to state slots)", "each row in its own slot",
            lambda c: c.state_batch_indices, lambda c: c.replace(state_batch_indices=False)),
    Feature("state_dtype", "a float16/bfloat16 state", "a float32 state", lambda c: c.state_dtype != "float32",
            lambda c: c.replace(state_dtype="float32")),
    Feature("decode_steps", "more than one decode step", "one decode step", lambda c: c.decode_steps > 1,
            lambda c: c.replace(decode_steps=1)),
    Feature("layer_steps", "decoding through the layer's step() and its cache", "the whole sequence in one forward",
            lambda c: c.layer_steps > 0, lambda c: c.replace(layer_steps=0)),
    # the mamba3 entry: the last tokens through the step function, the whole of headdim_qk rotated
    Feature("mamba3_steps", "decoding through the step function from the prefill's four states",
            "the whole sequence in one forward", lambda c: c.mamba3_steps > 0, lambda c: c.replace(mamba3_steps=0)),
    # headdim_qk 2 at rope 1/2 rotates no pair: it becomes 4 (one pair rotated, as before)
    Feature("rope_full", "rope_fraction 1 (all of headdim_qk rotated)", "rope_fraction 1/2",
            lambda c: c.rope_fraction == 1.0, lambda c: c.replace(rope_fraction=0.5, dstate=max(c.dstate, 4))),
    Feature("varlen_states", "varlen states", "no varlen states", lambda c: c.varlen_states,
            lambda c: c.replace(varlen_states=False)),
    Feature("seq_idx", "seq_idx", "no seq_idx", lambda c: c.segments is not None, _no_seq_idx),
    Feature("empty_sequence", "an empty sequence (length 0)", "no empty sequence",
            lambda c: c.segments is not None and any(0 in row for row in c.segments), _no_empty_sequences),
    Feature("gaps", "padding between sequences (seq_idx = -1 inside a row)", "no padding between sequences",
            lambda c: c.gaps is not None, _no_gaps),
    Feature("padding", "padding tokens (seq_idx = -1)", "no padding", lambda c: bool(c.padding and any(c.padding)),
            _fold_padding),
    Feature("seq_idx_start", "seq_idx not starting at 0", "seq_idx starts at 0", lambda c: c.seq_idx_start > 0,
            lambda c: c.replace(seq_idx_start=0)),
    Feature("initial_states", "initial states", "no initial states", lambda c: c.initial_states,
            lambda c: c.replace(initial_states=False)),
    # a milder decay before what moves dt: a state passed between chunks stays, where a larger dt under a strong
    # decay would erase it and the divergence it carries
    Feature("decay", "typical or strong decay", "mild decay", lambda c: c.regime.decay in ("typical", "strong"),
            lambda c: c.replace(regime={"decay": "mild"})),
    Feature("dt_limit", "dt_limit", "no dt_limit", lambda c: c.dt_limit is not None,
            lambda c: c.replace(dt_limit=None)),
    # the mixer always adds dt_bias and applies softplus
    Feature("dt_softplus", "dt_softplus", "no softplus", lambda c: c.entry in ("chunk_scan", "decode") and c.dt_softplus,
            lambda c: c.replace(dt_softplus=False)),
    Feature("dt_bias", "dt_bias", "no dt_bias", lambda c: c.entry in ("chunk_scan", "decode") and c.has_dt_bias,
            lambda c: c.replace(has_dt_bias=False)),
    Feature("ragged", "a ragged last chunk (seqlen % chunk_size != 0)", "whole chunks",
            lambda c: c.seqlen % c.chunk_size != 0, _unragged),
    Feature("strided", "strided (non-contiguous) inputs", "contiguous inputs", lambda c: c.regime.layout == "strided",
            lambda c: c.replace(regime={"layout": "contiguous"})),
    Feature("dt_large", "dt above the softplus threshold", "dt below 20", lambda c: c.regime.dt_large,
            lambda c: c.replace(regime={"dt_large": False})),
    Feature("scale", "input scale != 1", "scale 1", lambda c: c.regime.scale != 1.0,
            lambda c: c.replace(regime={"scale": 1.0})),
    Feature("batch", "batch > 1", "batch -> 1", lambda c: c.batch > 1, _one_row),
    # what only observes, last: until then it shows a divergence that the others' switch-offs may hide from the
    # rest (a misgrouped state seen in the final states while a strong decay erases it from y)
    Feature("backward", "the backward pass", "forward only", lambda c: c.backward,
            lambda c: c.replace(pass_="forward", final_state_grad=False), observes=True),
    Feature("final_state_grad", "a final-state gradient", "no final-state gradient", lambda c: c.final_state_grad,
            lambda c: c.replace(final_state_grad=False), observes=True),
    Feature("final_states", "returned final states", "no final states", lambda c: c.return_final_states,
            _no_final_states, observes=True),
)
BY_KEY = {f.key: f for f in FEATURES}
KEYS = tuple(BY_KEY)

# What a call without a seq_idx argument cannot express: each of these needs the case's segments.
NEEDS_SEQ_IDX = frozenset({"seq_idx", "empty_sequence", "gaps", "padding", "seq_idx_start", "varlen_states"})


def feature(key: str) -> Feature:
    """The record of feature ``key`` (KeyError naming the known keys when there is none)."""
    try:
        return BY_KEY[key]
    except KeyError:
        raise KeyError(f"{key!r}: no such feature (known: {', '.join(KEYS)})") from None


def present(case: Case) -> frozenset:
    """The keys of the features ``case`` has."""
    return frozenset(f.key for f in FEATURES if f.present(case))


def switch_off(case: Case, key: str) -> Optional[Case]:
    """``case`` with feature ``key`` switched off; None when the case does not have it or it cannot be
    switched off alone (the result would not be a valid Case)."""
    f = feature(key)
    if not f.present(case):
        return None
    try:
        out = f.switch_off(case)
    except CaseError:
        return None
    return out if out != case else None


def without(case: Case, keys: Iterable[str]) -> Case:
    """``case`` with each feature in ``keys`` that it has switched off, one after another in table order (one
    that cannot be switched off is left on)."""
    keys = set(keys)
    for f in FEATURES:
        if f.key in keys:
            case = switch_off(case, f.key) or case
    return case


__all__ = ["Feature", "FEATURES", "BY_KEY", "KEYS", "NEEDS_SEQ_IDX", "feature", "present", "switch_off", "without"]
