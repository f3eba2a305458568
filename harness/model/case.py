"""The Case: a frozen, JSON-serializable description of one SSD call.

A Case holds only small values (sizes, flags, a seed); tensors are built from it by `ssdiff.inputs`.
Every consumer (oracles, adapters, the fuzzer, the minimizer, reports) reads the same record, so a saved
case.json replays exactly.

Two entry points are described:
- ``chunk_scan``: ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
  seq_idx, cu_seqlens, dt_softplus, dt_limit, return_final_states, return_varlen_states)``;
- ``split_conv1d``: the fused Mamba-2 mixer ``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight,
  conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx, dt_limit, return_final_states,
  activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups,
  norm_before_gate)``;
- ``decode``: a sequence of ``seqlen`` tokens split into a prefill ``[0, seqlen - decode_steps)`` and
  ``decode_steps`` single-token steps of a step kernel (``selective_state_update(state, x, dt, A, B, C, D, z,
  dt_bias, dt_softplus, state_batch_indices)``) starting from the prefill's final state, held in
  ``state_dtype``; judged token by token (y at each decoded token) and by the state after the last step;
- ``layer``: a whole Mamba-2 layer ``out_proj(mixer(in_proj(u)))`` with one set of weights loaded into every
  implementation (mamba_ssm's Mamba2, fla's Mamba2, transformers' Mamba2Mixer). Its configuration reuses the
  mixer's fields — nheads * headdim is d_ssm, d_nonssm is d_inner - d_ssm (the SwiGLU branch), conv_width is
  d_conv, D "channel" is D_has_hdim, rmsnorm / norm_before_gate / rmsnorm_eps, dt_limit, segments (seq_idx)
  — plus ``d_model`` (expand = d_inner / d_model), ``bias`` (in_proj and out_proj) and ``conv_bias``. The
  layer returns only its output: no final states, no initial states (none of the three layers has learnable
  initial states). With ``layer_steps`` k > 0 the last k tokens are decoded one at a time through the layer's
  step() and its inference cache, after a prefill of the others: the same output, reached through the cache.
- ``mamba3``: the Mamba-3 SISO scan ``mamba3_siso_combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z,
  Input_States, chunk_size, return_final_states, cu_seqlens)`` (harness/truth/README.md, "Mamba-3"). The sizes
  read: ngroups is nheads_qk (the B/C heads Q and K are shared over), dstate is headdim_qk (even), headdim is
  headdim_v; D is "none" or "head"; segments (batch 1) are cu_seqlens, where a length may be 0 (an empty
  sequence: its final states are its input states); initial_states gives all four input states
  (angle, SSM, K, V). Its own fields: ``rope_fraction`` (0.5 or 1: the rotated share of headdim_qk) and
  ``mamba3_steps`` k: the last k tokens go one at a time through the step function after a prefill of the others
  that returns its four states (forward only, no segments): the same output, reached through the step.
- ``mamba3_layer``: mamba_ssm's Mamba3 module (SISO) ``out_proj(norm?(scan(projections(in_proj(u)))))`` with one
  set of weights (harness/truth/mamba3_layer.py). Its sizes are the mamba3 entry's (nheads * headdim is d_inner,
  ngroups the B/C heads, dstate d_state), plus the layer's ``d_model`` and ``layer_steps`` (the last k tokens
  through step() from the prefill's four states); ``rmsnorm`` is is_outproj_norm (a gated RMSNorm per head, its
  eps and the B/C norms' ``rmsnorm_eps``). D per head, dt_bias and softplus always; no final or initial states.
  Its scan is a mamba3 case (`Case.mamba3_scan`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

ENTRY_POINTS = ("chunk_scan", "split_conv1d", "decode", "layer", "mamba3", "mamba3_layer")
DTYPES = ("float32", "float16", "bfloat16")
D_MODES = ("none", "head", "channel")
DECAYS = ("none", "mild", "typical", "strong")
VALUE_KINDS = ("normal", "integer")
LAYOUTS = ("contiguous", "strided")
PASSES = ("forward", "backward")
ACTIVATIONS = ("silu", "identity")


class CaseError(ValueError):
    """A Case (or its JSON) breaks a rule. The message names the field and the rule, on one line."""


@dataclass(frozen=True)
class Regime:
    """How the input values are drawn.

    decay:   strength of A*dt per step: none (A*dt ~ 0), mild, typical (Mamba-2: dt ~ softplus(N(-3, 1))),
             strong (A*dt << -20).
    dt_large: push dt (+ dt_bias) above the softplus threshold 20 for some heads.
    values:  "normal" (Gaussian x, B, C, z) or "integer" (small integers: exact in every dtype).
    scale:   multiplier on x, B, C, z.
    layout:  "contiguous", or "strided": x, B, C, dt, z are views of one wide zxbcdt-like tensor.
    """

    decay: str = "typical"
    dt_large: bool = False
    values: str = "normal"
    scale: float = 1.0
    layout: str = "contiguous"


@dataclass(frozen=True)
class Case:
    """One SSD call. Sizes (harness/truth/README.md, "The SSD map"): b batch, L seqlen, h nheads, p headdim, g ngroups, n dstate, Q chunk.

    segments: per batch row, the lengths of the packed sequences (seq_idx counts them from
      ``seq_idx_start``); a length may be 0 (an empty sequence: its number has no token, cu_seqlens repeats an
      offset); a row's lengths plus its gaps plus ``padding[row]`` must sum to seqlen. None: no seq_idx.
    padding: per batch row, the number of trailing tokens marked seq_idx = -1.
    gaps: per batch row, one count per pair of consecutive sequences: the tokens marked seq_idx = -1 between
      them (padding inside the row). None: none.
    varlen_states: ask for one final state per sequence (batch 1, forward only; needs segments).
    """

    entry: str = "chunk_scan"
    batch: int = 1
    seqlen: int = 16
    nheads: int = 2
    headdim: int = 4
    ngroups: int = 1
    dstate: int = 4
    chunk_size: int = 8
    dtype: str = "float32"
    # optional features of the scan
    D: str = "head"
    has_z: bool = False
    has_dt_bias: bool = True
    dt_softplus: bool = True
    dt_limit: Optional[tuple[float, float]] = None
    initial_states: bool = False
    segments: Optional[tuple[tuple[int, ...], ...]] = None
    padding: Optional[tuple[int, ...]] = None
    gaps: Optional[tuple[tuple[int, ...], ...]] = None
    seq_idx_start: int = 0
    varlen_states: bool = False
    return_final_states: bool = True
    # the split-conv1d mixer
    conv_width: int = 4
    activation: str = "silu"
    d_nonssm: int = 0
    rmsnorm: bool = False
    norm_before_gate: bool = True
    rmsnorm_eps: float = 1e-6
    out_dim: Optional[int] = None
    outproj_bias: bool = False
    # the decode entry: the last decode_steps tokens are single steps from the prefill's state (held in
    # state_dtype); state_batch_indices: rows map to state slots through a permutation drawn from the seed
    decode_steps: int = 1
    state_dtype: str = "float32"
    state_batch_indices: bool = False
    # the layer entry: the model width (expand = (nheads * headdim + d_nonssm) / d_model), a bias on in_proj and
    # out_proj, a bias on the conv1d
    d_model: int = 8
    bias: bool = False
    conv_bias: bool = True
    # the layer decoding: the last layer_steps tokens one at a time through the layer's step() and its inference
    # cache, after a prefill of the others that fills the cache (0: the whole sequence in one forward)
    layer_steps: int = 0
    # the mamba3 entry: the rotated share of headdim_qk (dstate), and the last tokens decoded by the step function
    rope_fraction: float = 0.5
    mamba3_steps: int = 0
    # how values are drawn, which pass, which seed
    regime: Regime = field(default_factory=Regime)
    pass_: str = "forward"
    final_state_grad: bool = False
    seed: int = 0

    def __post_init__(self):
        problems = list(_violations(self))
        if problems:
            raise CaseError(problems[0])

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self.nheads * self.headdim

    @property
    def nchunks(self) -> int:
        return math.ceil(self.seqlen / self.chunk_size)

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups

    @property
    def conv_channels(self) -> int:
        return self.dim + 2 * self.ngroups * self.dstate

    @property
    def zxbcdt_width(self) -> int:
        return 2 * self.d_nonssm + 2 * self.dim + 2 * self.ngroups * self.dstate + self.nheads

    @property
    def d_inner(self) -> int:
        """The layer's inner width: d_ssm (nheads * headdim) plus the SwiGLU branch (d_nonssm)."""
        return self.dim + self.d_nonssm

    @property
    def expand(self) -> int:
        return self.d_inner // self.d_model

    @property
    def has_seq_idx(self) -> bool:
        return self.segments is not None

    @property
    def padded(self) -> bool:
        """Whether some token is padding (seq_idx = -1): trailing padding, a gap, or both."""
        return bool((self.padding and any(self.padding)) or (self.gaps and any(map(any, self.gaps))))

    def row_layout(self, row: int) -> dict:
        """The sequence fields of batch row ``row`` alone (segments, padding, gaps), for a batch-1 replace."""
        pick = lambda rows: None if rows is None else (rows[row],)
        gaps = pick(self.gaps) if self.gaps is not None and any(self.gaps[row]) else None
        return dict(segments=pick(self.segments), padding=pick(self.padding), gaps=gaps)

    @property
    def backward(self) -> bool:
        return self.pass_ == "backward"

    @property
    def prefill_len(self) -> int:
        """Tokens before the first decode step (decode entry)."""
        return self.seqlen - self.decode_steps

    @property
    def rope_angles(self) -> int:
        """The mamba3 entry's rotary angles per head: pairs of headdim_qk rotated (the rotated share, even)."""
        return (int(self.dstate * self.rope_fraction) // 2 * 2) // 2

    @property
    def mamba3_scan(self) -> "Case":
        """The mamba3 case of a mamba3_layer case's scan: its sizes, chunk, rope, segments, dtype, pass and seed,
        D per head, z unless the output norm takes it, the layer's steps as ``mamba3_steps``."""
        return Case(entry="mamba3", batch=self.batch, seqlen=self.seqlen, nheads=self.nheads, headdim=self.headdim,
                    ngroups=self.ngroups, dstate=self.dstate, chunk_size=self.chunk_size, dtype=self.dtype, D="head",
                    has_z=not self.rmsnorm, has_dt_bias=False, dt_softplus=False, segments=self.segments,
                    return_final_states=False, rope_fraction=self.rope_fraction, mamba3_steps=self.layer_steps,
                    regime=self.regime, pass_=self.pass_, seed=self.seed)

    @property
    def dt_limit_or_default(self) -> tuple[float, float]:
        return self.dt_limit if self.dt_limit is not None else (0.0, math.inf)

    def replace(self, **changes) -> "Case":
        """A copy with some fields changed (validated like any Case). ``regime`` may be a dict of changes."""
        if isinstance(changes.get("regime"), dict):
            changes["regime"] = dataclasses.replace(self.regime, **changes["regime"])
        return dataclasses.replace(self, **changes)

    # ---- serialization -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name in DECODE_FIELDS and self.entry != "decode":
                continue                # other entries' JSON stays as it was before the decode entry
            if f.name in LAYER_FIELDS and self.entry not in ("layer", "mamba3_layer"):
                continue
            if f.name in MAMBA3_FIELDS and self.entry not in ("mamba3", "mamba3_layer"):
                continue
            if f.name == "gaps" and self.gaps is None:
                continue                # a case without gaps keeps the JSON it had before gaps existed
            value = getattr(self, f.name)
            if f.name == "regime":
                value = dataclasses.asdict(value)
            elif f.name == "dt_limit" and value is not None:
                value = [_float_to_json(v) for v in value]
            elif isinstance(value, tuple):
                value = _tuples_to_lists(value)
            out[f.name] = value
        return out

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any) -> "Case":
        if not isinstance(data, dict):
            raise CaseError(f"case: expected a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise CaseError(f"{unknown[0]}: unknown field (known: {', '.join(known)})")
        missing = [name for name in _REQUIRED_IN_JSON if name not in data]
        if missing:
            raise CaseError(f"{missing[0]}: missing field")
        kwargs = {}
        for name, value in data.items():
            kwargs[name] = _coerce(name, value)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Case":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise CaseError(f"case: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path) -> "Case":
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as err:
            raise CaseError(f"case: cannot read {path}: {err.strerror}") from None
        return cls.from_json(text)

    # ---- a one-line description ----------------------------------------------------------------------
    def describe(self) -> str:
        shape = (f"b={self.batch} L={self.seqlen} h={self.nheads} p={self.headdim} g={self.ngroups} "
                 f"n={self.dstate} Q={self.chunk_size}")
        feats = [self.dtype]
        if self.D != "none":
            feats.append(f"D:{self.D}")
        if self.has_z:
            feats.append("z")
        if self.has_dt_bias:
            feats.append("dt_bias")
        if self.dt_softplus:
            feats.append("softplus")
        if self.dt_limit is not None:
            feats.append(f"dt_limit={list(self.dt_limit)}")
        if self.initial_states:
            feats.append("h0")
        if self.segments is not None:
            feats.append(f"seq_idx={[list(r) for r in self.segments]}")
            if self.padding and any(self.padding):
                feats.append(f"pad={list(self.padding)}")
            if self.gaps is not None:
                feats.append(f"gaps={[list(r) for r in self.gaps]}")
            if self.seq_idx_start:
                feats.append(f"seq_start={self.seq_idx_start}")
        if self.varlen_states:
            feats.append("varlen_states")
        if self.entry == "layer":
            feats.append(f"d_model={self.d_model} expand={self.expand} conv{self.conv_width}"
                         + ("+bias" if self.conv_bias else ""))
            if self.d_nonssm:
                feats.append(f"d_nonssm={self.d_nonssm}")
            if self.rmsnorm:
                feats.append("rmsnorm" + ("(before gate)" if self.norm_before_gate else "(after gate)")
                             + (f" eps={self.rmsnorm_eps:g}" if self.rmsnorm_eps != 1e-5 else ""))
            if self.bias:
                feats.append("bias")
            if self.layer_steps:
                feats.append(f"steps={self.layer_steps}")
        if self.entry == "split_conv1d":
            feats.append(f"conv{self.conv_width}:{self.activation}")
            if self.d_nonssm:
                feats.append(f"d_nonssm={self.d_nonssm}")
            if self.rmsnorm:
                feats.append("rmsnorm" + ("(before gate)" if self.norm_before_gate else "(after gate)"))
            if self.out_dim is not None:
                feats.append(f"out_proj={self.out_dim}" + ("+bias" if self.outproj_bias else ""))
        if self.entry == "mamba3_layer":
            feats.append(f"d_model={self.d_model}" + (" outproj_norm" if self.rmsnorm else "")
                         + (f" steps={self.layer_steps}" if self.layer_steps else ""))
        if self.entry in ("mamba3", "mamba3_layer"):
            feats.append(f"rope={self.rope_fraction:g}")
            if self.mamba3_steps:
                feats.append(f"steps={self.mamba3_steps}")
        if self.entry == "decode":
            feats.append(f"steps={self.decode_steps}")
            if self.state_dtype != "float32":
                feats.append(f"state:{self.state_dtype}")
            if self.state_batch_indices:
                feats.append("state_batch_indices")
        r = self.regime
        feats.append(f"decay={r.decay}")
        if r.dt_large:
            feats.append("dt>20")
        if r.values != "normal":
            feats.append(r.values)
        if r.scale != 1.0:
            feats.append(f"scale={r.scale:g}")
        if r.layout != "contiguous":
            feats.append(r.layout)
        feats.append(self.pass_ + ("+dfinal" if self.final_state_grad else ""))
        return f"{self.entry} {shape} | {' '.join(feats)} | seed={self.seed}"


# ---- validation ------------------------------------------------------------------------------------------

DECODE_FIELDS = ("decode_steps", "state_dtype", "state_batch_indices")
LAYER_FIELDS = ("d_model", "bias", "conv_bias", "layer_steps")
MAMBA3_FIELDS = ("rope_fraction", "mamba3_steps")
_REQUIRED_IN_JSON = ("entry", "batch", "seqlen", "nheads", "headdim", "ngroups", "dstate", "chunk_size", "dtype")

_INT_FIELDS = {"batch", "seqlen", "nheads", "headdim", "ngroups", "dstate", "chunk_size", "conv_width",
               "d_nonssm", "seq_idx_start", "seed", "decode_steps", "d_model", "layer_steps", "mamba3_steps"}
_BOOL_FIELDS = {"has_z", "has_dt_bias", "dt_softplus", "initial_states", "varlen_states", "return_final_states",
                "rmsnorm", "norm_before_gate", "outproj_bias", "final_state_grad",
               "state_batch_indices", "bias", "conv_bias"}
_CHOICES = {"entry": ENTRY_POINTS, "dtype": DTYPES, "D": D_MODES, "activation": ACTIVATIONS, "pass_": PASSES,
            "state_dtype": DTYPES}
_REGIME_CHOICES = {"decay": DECAYS, "values": VALUE_KINDS, "layout": LAYOUTS}


def _violations(c: Case):
    """Yield one message per broken rule, each naming its field. Type checks come first."""
    for name in _INT_FIELDS:
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool):
            yield f"{name}: expected an integer, got {value!r}"
            return
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(c, name), bool):
            yield f"{name}: expected true or false, got {getattr(c, name)!r}"
            return
    for name, choices in _CHOICES.items():
        if getattr(c, name) not in choices:
            yield f"{name}: expected one of {', '.join(choices)}, got {getattr(c, name)!r}"
            return
    if not isinstance(c.regime, Regime):
        yield f"regime: expected an object, got {c.regime!r}"
        return
    for name, choices in _REGIME_CHOICES.items():
        if getattr(c.regime, name) not in choices:
            yield f"regime.{name}: expected one of {', '.join(choices)}, got {getattr(c.regime, name)!r}"
            return
    if not isinstance(c.regime.dt_large, bool):
        yield f"regime.dt_large: expected true or false, got {c.regime.dt_large!r}"
    if not isinstance(c.regime.scale, (int, float)) or isinstance(c.regime.scale, bool) \
            or not math.isfinite(c.regime.scale) or c.regime.scale <= 0:
        yield f"regime.scale: expected a positive finite number, got {c.regime.scale!r}"
    if not isinstance(c.rmsnorm_eps, (int, float)) or isinstance(c.rmsnorm_eps, bool) or not c.rmsnorm_eps > 0:
        yield f"rmsnorm_eps: expected a positive number, got {c.rmsnorm_eps!r}"

    for name in ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate", "chunk_size"):
        if getattr(c, name) < 1:
            yield f"{name}={getattr(c, name)} must be at least 1"
            return
    if c.nheads % c.ngroups:
        yield f"ngroups={c.ngroups} must divide nheads={c.nheads}"
    if c.chunk_size & (c.chunk_size - 1):
        yield f"chunk_size={c.chunk_size} must be a power of two"
    if c.seed < 0:
        yield f"seed={c.seed} must be non-negative"

    if c.dt_limit is not None:
        lo_hi = c.dt_limit
        if not (isinstance(lo_hi, tuple) and len(lo_hi) == 2 and all(isinstance(v, (int, float)) for v in lo_hi)):
            yield f"dt_limit: expected [low, high], got {lo_hi!r}"
        elif not (0.0 <= lo_hi[0] < lo_hi[1]):
            yield f"dt_limit={list(lo_hi)} must satisfy 0 <= low < high"

    yield from _segment_violations(c)
    yield from _mamba3_violations(c)

    if c.varlen_states:
        if c.segments is None:
            yield "varlen_states=true needs segments (one final state per sequence)"
        if c.batch != 1:
            yield f"varlen_states=true needs batch=1, got batch={c.batch}"
        if c.pass_ != "forward":
            yield "varlen_states=true is forward only: pass_ must be 'forward'"
        if c.entry != "chunk_scan":
            yield "varlen_states=true is only defined for entry 'chunk_scan'"
        if c.gaps is not None:
            yield "varlen_states=true needs no gaps (cu_seqlens cannot skip padding between sequences)"
    if c.final_state_grad and not (c.backward and c.return_final_states):
        yield "final_state_grad=true needs pass_='backward' and return_final_states=true"

    if c.entry != "decode":
        for name, default in (("decode_steps", 1), ("state_dtype", "float32"), ("state_batch_indices", False)):
            if getattr(c, name) != default:
                yield f"{name}={getattr(c, name)!r} is only meaningful for entry 'decode'"
    if c.entry not in ("layer", "mamba3_layer"):
        for name, default in (("d_model", 8), ("bias", False), ("conv_bias", True), ("layer_steps", 0)):
            if getattr(c, name) != default:
                yield f"{name}={getattr(c, name)!r} is only meaningful for entry 'layer'"
    if c.entry in ("chunk_scan", "decode"):
        for name, default in (("d_nonssm", 0), ("rmsnorm", False), ("out_dim", None), ("outproj_bias", False)):
            if getattr(c, name) != default:
                yield f"{name}={getattr(c, name)!r} is only meaningful for entry 'split_conv1d'"
    if c.entry == "decode":
        if not 1 <= c.decode_steps <= c.seqlen:
            yield f"decode_steps={c.decode_steps} must satisfy 1 <= decode_steps <= seqlen={c.seqlen}"
        if c.segments is not None:
            yield "segments: the decode entry has one sequence per batch row (rows map to state slots instead)"
        if c.pass_ != "forward":
            yield "pass_: the decode entry is forward only (a step kernel has no backward)"
    if c.entry == "layer":
        if c.d_model < 1:
            yield f"d_model={c.d_model} must be at least 1"
        elif c.d_nonssm >= 0 and c.d_inner % c.d_model:
            yield (f"d_model={c.d_model} must divide d_inner = nheads * headdim + d_nonssm = {c.d_inner} "
                   f"(expand = d_inner / d_model is an integer in every Mamba-2 layer)")
        if c.activation != "silu":
            yield "activation: a Mamba-2 layer always uses silu"
        if c.out_dim is not None or c.outproj_bias:
            yield "out_dim / outproj_bias: a layer's out_proj is always d_inner -> d_model (its bias is `bias`)"
        if c.initial_states:
            yield "initial_states: no layer implementation has learnable initial states"
        if c.return_final_states:
            yield "return_final_states: a layer returns only its output; must be false"
        if c.layer_steps:
            if not 0 < c.layer_steps < c.seqlen:
                yield (f"layer_steps={c.layer_steps} must satisfy 0 <= layer_steps < seqlen={c.seqlen} (the prefill "
                       f"that fills the cache has at least one token)")
            if c.segments is not None:
                yield "layer_steps: a decoded layer has one sequence per batch row (no segments)"
            if c.pass_ != "forward":
                yield "layer_steps: decoding is forward only (the step kernel has no backward)"
    if c.entry in ("split_conv1d", "layer"):
        if c.conv_width < 1:
            yield f"conv_width={c.conv_width} must be at least 1"
        if c.d_nonssm < 0:
            yield f"d_nonssm={c.d_nonssm} must be non-negative"
        if not c.has_dt_bias or not c.dt_softplus:
            yield f"{c.entry} always uses dt_bias and softplus: has_dt_bias and dt_softplus must be true"
        if c.D == "none":
            yield f"{c.entry} always takes D: D must be 'head' or 'channel'"
        if c.has_z:
            yield f"has_z: {c.entry} takes z from zxbcdt; leave has_z false"
        if c.out_dim is not None and (not isinstance(c.out_dim, int) or c.out_dim < 1):
            yield f"out_dim={c.out_dim!r} must be a positive integer"
        if c.outproj_bias and c.out_dim is None:
            yield "outproj_bias=true needs out_dim"


def _mamba3_violations(c: Case):
    """The mamba3 and mamba3_layer entries' rules (and their fields' defaults elsewhere)."""
    if c.entry == "mamba3_layer":
        yield from _mamba3_layer_violations(c)
        return
    if c.entry != "mamba3":
        for name, default in (("rope_fraction", 0.5), ("mamba3_steps", 0)):
            if getattr(c, name) != default:
                yield f"{name}={getattr(c, name)!r} is only meaningful for entry 'mamba3'"
        return
    if c.rope_fraction not in (0.5, 1.0):
        yield f"rope_fraction={c.rope_fraction!r} must be 0.5 or 1"
    elif c.dstate % 2 or c.rope_angles < 1:
        yield f"dstate={c.dstate} (headdim_qk) must be even with at least one rotated pair at rope_fraction {c.rope_fraction:g}"
    if c.has_dt_bias or c.dt_softplus or c.dt_limit is not None:
        yield "has_dt_bias / dt_softplus / dt_limit: the mamba3 entry takes DT already processed; all must be off"
    if c.D == "channel":
        yield "D: the mamba3 entry's D is per head ('none' or 'head')"
    if c.padding is not None or c.gaps is not None or c.seq_idx_start or c.varlen_states:
        yield ("padding / gaps / seq_idx_start / varlen_states: the mamba3 entry's sequences are cu_seqlens "
               "(segments only)")
    if c.segments is not None and c.batch != 1:
        yield f"segments: the mamba3 entry packs sequences as cu_seqlens, batch must be 1, got {c.batch}"
    if c.regime.layout != "contiguous":
        yield "regime.layout: the mamba3 entry is contiguous"
    if any(getattr(c, name) != default for name, default in (
            ("d_nonssm", 0), ("rmsnorm", False), ("out_dim", None), ("outproj_bias", False))):
        yield "d_nonssm / rmsnorm / out_dim / outproj_bias are only meaningful for entry 'split_conv1d'"
    if not 0 <= c.mamba3_steps <= c.seqlen:
        yield f"mamba3_steps={c.mamba3_steps} must satisfy 0 <= mamba3_steps <= seqlen={c.seqlen}"
    elif c.mamba3_steps:
        if c.segments is not None:
            yield "mamba3_steps: a decoded sequence is one per batch row (no segments)"
        if c.pass_ != "forward":
            yield "mamba3_steps: decoding is forward only (the step function has no backward)"


def _mamba3_layer_violations(c: Case):
    """A Mamba3 module: its scan a valid mamba3 case, and what the module fixes."""
    if c.mamba3_steps:
        yield f"mamba3_steps={c.mamba3_steps}: a mamba3_layer decodes through layer_steps"
    if not (c.has_dt_bias and c.dt_softplus) or c.dt_limit is not None:
        yield "has_dt_bias / dt_softplus / dt_limit: a Mamba3 module always adds dt_bias and applies softplus, no limit"
    if c.D != "head":
        yield "D: a Mamba3 module's D is per head; must be 'head'"
    if c.has_z or c.initial_states or c.return_final_states:
        yield ("has_z / initial_states / return_final_states: a Mamba3 module takes z from in_proj, starts from zero "
               "states and returns only its output; all must be false")
    if c.bias or c.d_nonssm or c.out_dim is not None or c.outproj_bias:
        yield "bias / d_nonssm / out_dim / outproj_bias: a Mamba3 module has no biases on its projections, no branch"
    if not c.norm_before_gate:
        yield "norm_before_gate: a Mamba3 module's output norm gates after normalizing; must be true"
    if c.padding is not None or c.gaps is not None or c.seq_idx_start or c.varlen_states:
        yield ("padding / gaps / seq_idx_start / varlen_states: a mamba3_layer's sequences are cu_seqlens "
               "(segments only)")
    if c.d_model < 1 or c.dim % c.d_model:
        yield f"d_model={c.d_model} must divide d_inner = nheads * headdim = {c.dim} (expand is an integer)"
    if c.layer_steps and not 0 < c.layer_steps < c.seqlen:
        yield (f"layer_steps={c.layer_steps} must satisfy 0 <= layer_steps < seqlen={c.seqlen} (the prefill "
               f"that fills the states has at least one token)")
    if c.layer_steps and (c.segments is not None or c.pass_ != "forward"):
        yield "layer_steps: decoding is forward only, one sequence per batch row (no segments)"
    if c.regime.layout != "contiguous" or c.final_state_grad:
        yield "regime.layout / final_state_grad: a mamba3_layer is contiguous and returns no final states"
        return
    try:
        c.mamba3_scan
    except CaseError as err:
        yield f"the scan of this Mamba3 module: {err}"


def _segment_violations(c: Case):
    if c.segments is None:
        if c.padding is not None:
            yield "padding needs segments (padding tokens are marked in seq_idx)"
        if c.gaps is not None:
            yield "gaps needs segments (padding tokens are marked in seq_idx)"
        if c.seq_idx_start:
            yield "seq_idx_start needs segments"
        return
    if not isinstance(c.segments, tuple) or len(c.segments) != c.batch:
        yield f"segments: expected one list of lengths per batch row ({c.batch}), got {c.segments!r}"
        return
    padding = c.padding if c.padding is not None else (0,) * c.batch
    if not isinstance(padding, tuple) or len(padding) != c.batch:
        yield f"padding: expected one count per batch row ({c.batch}), got {c.padding!r}"
        return
    if c.gaps is not None and (not isinstance(c.gaps, tuple) or len(c.gaps) != c.batch):
        yield f"gaps: expected one list of counts per batch row ({c.batch}), got {c.gaps!r}"
        return
    if c.seq_idx_start < 0:
        yield f"seq_idx_start={c.seq_idx_start} must be non-negative"
    for row, (lengths, pad) in enumerate(zip(c.segments, padding)):
        if not isinstance(pad, int) or pad < 0:
            yield f"padding[{row}]={pad!r} must be a non-negative integer"
            return
        if not isinstance(lengths, tuple) or not lengths:
            yield f"segments[{row}]: expected a non-empty list of lengths, got {lengths!r}"
            return
        for length in lengths:
            if not isinstance(length, int) or isinstance(length, bool) or length < 0:
                yield f"segments[{row}]: every length must be a non-negative integer, got {length!r}"
                return
        gaps = c.gaps[row] if c.gaps is not None else (0,) * (len(lengths) - 1)
        if not isinstance(gaps, tuple) or len(gaps) != len(lengths) - 1 or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in gaps):
            yield (f"gaps[{row}]={gaps!r}: expected {len(lengths) - 1} non-negative counts (one between each pair "
                   f"of the row's {len(lengths)} sequences)")
            return
        if sum(lengths) + sum(gaps) + pad != c.seqlen:
            named = f" plus gaps {list(gaps)}" if c.gaps is not None else ""
            yield (f"segments[{row}]={list(lengths)}{named} plus padding {pad} sum to "
                   f"{sum(lengths) + sum(gaps) + pad}, must equal seqlen={c.seqlen}")
    if c.gaps is not None and not any(map(any, c.gaps)):
        yield "gaps: every count is 0; leave gaps out (null) instead"


# ---- JSON coercion ---------------------------------------------------------------------------------------

def _float_to_json(value: float):
    return "inf" if value == math.inf else value


def _tuples_to_lists(value):
    if isinstance(value, tuple):
        return [_tuples_to_lists(v) for v in value]
    return value


def _lists_to_tuples(value):
    if isinstance(value, list):
        return tuple(_lists_to_tuples(v) for v in value)
    return value


def _coerce(name: str, value):
    """Turn a JSON value into the field's Python type; type errors are left for validation to name."""
    if name == "regime":
        if not isinstance(value, dict):
            raise CaseError(f"regime: expected an object, got {value!r}")
        known = {f.name for f in fields(Regime)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise CaseError(f"regime.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        return Regime(**value)
    if name == "dt_limit" and value is not None:
        if not isinstance(value, list) or len(value) != 2:
            raise CaseError(f"dt_limit: expected [low, high], got {value!r}")
        out = []
        for v in value:
            if v == "inf":
                out.append(math.inf)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(float(v))
            else:
                raise CaseError(f"dt_limit: expected numbers (or \"inf\"), got {v!r}")
        return tuple(out)
    if name in ("segments", "padding", "gaps") and value is not None:
        if not isinstance(value, list):
            raise CaseError(f"{name}: expected a list, got {value!r}")
        return _lists_to_tuples(value)
    if name in ("rmsnorm_eps", "rope_fraction") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value

