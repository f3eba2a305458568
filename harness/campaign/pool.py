"""The compile pool: on a GPU, which kernel specializations a round of the search may use.

Natively, Triton compiles a kernel once per specialization: its constexprs (block sizes fitted to headdim,
dstate, chunk size; feature flags), its dtypes, and every integer argument's class (== 1, divisible by 16,
other) — and sizes, strides and offsets are such arguments. Autotuning then benchmarks every config once per
autotune key (chunk size, headdim, dstate, nheads...). A case drawn freely meets a new specialization almost
every time: a compile of seconds (and, tuned, a benchmark of every config) for a judgement of milliseconds.

So on a GPU every case of a search round is drawn from one of a few `CompileKey`s: each fixes what shapes
the tensors (dtype, batch, nheads, ngroups, headdim, dstate, chunk size, layout, the mixer's and the layer's
widths), the class of seqlen (its 2-adic valuation up to 16, and that of its chunk count, each with "is 1"; for a
decoded layer, of its prefill: the steps run one token each) and the features that select a kernel variant or a
code path (`FLAGS`: constexpr switches such as D per channel, z, softplus, arguments passed as a tensor or None
such as initial states, seq_idx, final-state gradients, and a layer's biases, norm and decoding); seqlen within
that class, sequence lengths and padding, dt_limit's values, the value regime and the seed vary freely. After each
round one key is swapped for a fresh draw (`Pool.rotate`), so over a campaign odd sizes still come up; the swaps
are planned rounds ahead (`Pool.ahead`), so that their keys can be compiled before the search reaches them. Each key
is the best of SPREAD candidates at adding pairs of feature values its round lacks (`Pool.draw`), so that a
round's few keys meet features together more often than independent draws would. Keys
come in kinds: "small" (GPU_BOUNDS), "production" (model shapes: `Production`; none for the layer entry, whose
production slots take small keys), "boundary" (one dimension at a block-size boundary of the implementation's
configs, run with that config: harness/sides/tiling.py) and "huge" (2**31 elements or more in x or in the chunk states,
forward chunk_scan cases judged on a slice: harness/inputs/huge.py; drawn by a production slot at the rate `Mix.huge`).

Under the Triton interpreter nothing compiles: there is no pool and cases are drawn freely.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Optional

from ssdiff.inputs.huge import Huge
from ssdiff.model.bounds import Bounds
from ssdiff.model.strategies import divisors
from ssdiff.sides.tiling import Boundary

KINDS = ("small", "production", "boundary", "huge")


def spec_class(n: int) -> tuple:
    """How Triton specializes an integer argument, refined to what products of it need: (n == 1, 2-adic
    valuation capped at 4)."""
    v = 0
    while n > 0 and n % 2 == 0 and v < 4:
        n //= 2
        v += 1
    return (n == 1 and v == 0, v)


def seqlen_class(seqlen: int, chunk_size: int) -> tuple:
    return spec_class(seqlen) + spec_class(-(-seqlen // chunk_size))


# Case fields that select a kernel variant or a code path without being a size (see the module docstring), by
# entry. "seq_idx" and "dt_limit" stand for the presence of segments and of a dt_limit; varlen_states applies to
# forward cases and final_state_grad to backward ones (the others of the key go without). A layer's layer_steps
# is pinned at its value (0: no decoding); a key with layer_steps > 0 has forward cases only.
FLAGS = {
    "chunk_scan": ("D", "has_z", "has_dt_bias", "dt_softplus", "dt_limit", "initial_states", "seq_idx",
                   "return_final_states", "varlen_states", "final_state_grad"),
    "split_conv1d": ("D", "dt_limit", "initial_states", "seq_idx", "return_final_states", "final_state_grad",
                     "activation", "rmsnorm", "norm_before_gate", "outproj_bias"),
    "decode": ("D", "has_z", "has_dt_bias", "dt_softplus", "dt_limit", "initial_states", "state_dtype",
               "state_batch_indices"),
    "layer": ("D", "dt_limit", "seq_idx", "rmsnorm", "norm_before_gate", "bias", "conv_bias", "layer_steps"),
}


# The entries a pool draws keys for.
POOLED_ENTRIES = frozenset(FLAGS)


def flags_of(case) -> tuple:
    """``case``'s values of its entry's FLAGS, as (name, value) pairs."""
    def value(name):
        if name == "seq_idx":
            return case.segments is not None
        if name == "dt_limit":
            return case.dt_limit is not None
        return getattr(case, name)
    return tuple((name, value(name)) for name in FLAGS.get(case.entry, ()))


def _halves(seqlen: int) -> tuple:
    return (seqlen // 2, seqlen - seqlen // 2) if seqlen >= 2 else (seqlen,)


@dataclass(frozen=True)
class CompileKey:
    """What a round's cases share; see the module docstring."""

    kind: str
    dtype: str
    entry: str
    batch: int
    nheads: int
    ngroups: int
    headdim: int
    dstate: int
    chunk_size: int
    layout: str
    seqlen: int                              # the seqlen the key was drawn with (its class's representative)
    seqlen_min: int
    seqlen_max: int
    d_nonssm: int = 0
    out_dim: Optional[int] = None
    conv_width: int = 4
    d_model: int = 0                         # the layer entry's model width
    boundary: Optional[Boundary] = None      # the config a boundary key runs with
    flags: tuple = ()                        # (name, value) of FLAGS[entry] (none pinned when empty)

    @property
    def pinned(self) -> dict:
        return dict(self.flags)

    @property
    def steps(self) -> int:
        """The tokens its cases decode one at a time (a decoded layer's layer_steps; 0 otherwise)."""
        return self.pinned.get("layer_steps", 0)

    @property
    def forward_only(self) -> bool:
        """A decoded layer's cases and a huge key's (harness/inputs/huge.py) are forward only."""
        return bool(self.steps) or self.kind == "huge"

    def fits(self, seqlen: int) -> bool:
        # the chunked kernels see the prefill (all of seqlen but the single-token steps)
        k = self.steps
        return (self.seqlen_min <= seqlen <= self.seqlen_max
                and seqlen_class(seqlen - k, self.chunk_size) == seqlen_class(self.seqlen - k, self.chunk_size))

    def snap(self, seqlen: int) -> int:
        """The seqlen of the key's class nearest ``seqlen`` (the key's own when none is near)."""
        seqlen = min(max(seqlen, self.seqlen_min), self.seqlen_max)
        for step in range(0, 2 * self.chunk_size + 32):
            for candidate in (seqlen - step, seqlen + step):
                if self.fits(candidate):
                    return candidate
        return self.seqlen

    def fixed(self) -> dict:
        """The Case fields the key fixes (seqlen aside)."""
        out = dict(entry=self.entry, dtype=self.dtype, batch=self.batch, nheads=self.nheads, ngroups=self.ngroups,
                   headdim=self.headdim, dstate=self.dstate, chunk_size=self.chunk_size)
        if self.entry == "split_conv1d":
            out.update(d_nonssm=self.d_nonssm, out_dim=self.out_dim, conv_width=self.conv_width)
        if self.entry == "layer":
            out.update(d_model=self.d_model, d_nonssm=self.d_nonssm, conv_width=self.conv_width)
        return out

    def case(self, backward: bool = False):
        """The key's representative for one pass: its own seqlen, its flags (two sequences per row where it
        has seq_idx; a forward-only flag off backward and a backward-only one off forward), values at their
        defaults. A key whose cases are forward only (`forward_only`) has its forward representative for both
        passes."""
        from ssdiff.model.case import Case, Regime

        fields = dict(seqlen=self.seqlen, regime=Regime(layout=self.layout), **self.fixed())
        if self.entry == "layer":
            fields.update(return_final_states=False, rmsnorm_eps=1e-5)     # as layer_features draws them
        backward = backward and not self.forward_only
        pin = self.pinned
        for name, value in pin.items():
            if name == "seq_idx":
                fields["segments"] = (_halves(self.seqlen),) * self.batch if value else None
            elif name == "dt_limit":
                fields["dt_limit"] = (0.0, 1.0) if value else None
            elif name not in ("varlen_states", "final_state_grad"):
                fields[name] = value
        if backward:
            fields["pass_"] = "backward"
            fields["final_state_grad"] = bool(pin.get("final_state_grad")) and fields.get("return_final_states", True)
        else:
            fields["varlen_states"] = bool(pin.get("varlen_states")) and fields.get("segments") is not None
        if self.entry == "split_conv1d" and not fields.get("rmsnorm", True):
            fields["norm_before_gate"] = True
        if fields.get("out_dim", 0) is None:
            fields["outproj_bias"] = False
        return Case(**fields)

    def describe(self) -> str:
        text = (f"{self.kind} {self.entry} {self.dtype} b={self.batch} h={self.nheads} g={self.ngroups} "
                f"p={self.headdim} n={self.dstate} Q={self.chunk_size} L~{self.seqlen} {self.layout}")
        if self.entry == "layer":
            text += f" d_model={self.d_model} d_nonssm={self.d_nonssm} conv{self.conv_width}"
        on = [name if value is True else f"{name}={value}" for name, value in self.flags if value is not False]
        text += f" {{{', '.join(on)}}}" if self.flags else ""
        return text + (f" [{self.boundary.describe()}]" if self.boundary else "")


# Candidates drawn for each key (`Pool.draw`).
SPREAD = 3


def features_of(key: CompileKey) -> frozenset:
    """What a key's cases share besides sizes: its flags and whether heads share groups (ngroups > 1)."""
    return frozenset(key.flags) | {("ngroups > 1", key.ngroups > 1)}


def feature_pairs(key: CompileKey) -> set:
    """Every pair of `features_of` ``key``: what two keys share when both have those two values."""
    found = sorted(features_of(key), key=repr)
    return {(a, b) for i, a in enumerate(found) for b in found[i + 1:]}


@dataclass(frozen=True)
class Production:
    """Model shapes (Mamba-2 2.7B: h 80 p 64 n 128; Codestral: h 128 n 128 g 8; Falcon-H1: n 256; chunk 256)
    with x (b L h p) at most ``max_elements``, so that the float64 oracle keeps up."""

    headdims: tuple = (64, 128, 64, 80)
    dstates: tuple = (128, 256, 128)
    chunk_sizes: tuple = (256, 128)
    nheads: tuple = (8, 16, 24, 32, 48, 64, 80, 128)
    min_seqlen: int = 2048
    max_seqlen: int = 16384
    max_batch: int = 2
    max_elements: int = 2 ** 22


@dataclass(frozen=True)
class Mix:
    """Which share of a round's keys is of each kind; ``size`` keys at a time. ``huge``: the chance that a
    production slot's draw is a huge key instead (harness/inputs/huge.py; chunk_scan only, none in a backward-only
    campaign)."""

    size: int = 4
    production: float = 0.25
    boundary: float = 0.25
    huge: float = 0.0


class Pool:
    """The keys of the current round, for one campaign (its entries, dtypes, bounds, boundaries)."""

    def __init__(self, entries, dtypes, bounds: Bounds, boundaries=(), mix: Mix = Mix(),
                 production: Production = Production(), seed: Optional[int] = None, fit=None,
                 backward: Optional[bool] = None, huge: Huge = Huge()):
        """``fit(case) -> Case or None``: the case with what the implementations cannot express switched off,
        or None when they cannot run it. A key is what its fitted representative is (a key whose representative
        cannot run is drawn again, up to 20 times), so that its cases, fitted the same way, keep its variant.
        ``backward``: the campaign's pass (True: backward only, so no key whose cases are forward only; None:
        mixed)."""
        self.entries, self.dtypes, self.bounds = tuple(entries), tuple(dtypes), bounds
        self.boundaries, self.mix, self.production, self.huge = tuple(boundaries), mix, production, huge
        self.backward = backward
        self.rng = random.Random(seed)
        self.fit = fit or (lambda case: case)
        # Boundary keys take the boundaries in a shuffled cycle, so that a campaign's rotations cover them all.
        self._boundary_order = list(self.boundaries)
        self.rng.shuffle(self._boundary_order)
        self._next_boundary = 0
        # a slot keeps its kind through rotations (a layer key drawn for a production slot is a small key)
        self.kinds = self._kinds(mix.size)
        self.keys = []
        for kind in self.kinds:
            self.keys.append(self.draw(kind, self.keys))
        self.round = 0
        self._future = list(self.keys)      # the keys once every planned rotation is made
        self._plan: list = []               # (slot, key) of the rotations to come, in order
        self._extend(1)

    def _kinds(self, count: int) -> list:
        """Kinds for ``count`` keys in the mix's proportions (rounded, at least one small key)."""
        kinds = []
        for kind, share in (("production", self.mix.production),
                            ("boundary", self.mix.boundary if self.boundaries else 0.0)):
            kinds += [kind] * int(round(share * count))
        kinds = kinds[:count - 1]
        return ["small"] * (count - len(kinds)) + kinds

    def _extend(self, count: int) -> None:
        """Plan rotations until ``count`` are planned: each swaps one slot's key for a fresh draw against the keys
        that round will have, so that planning ahead draws exactly what rotating one round at a time would."""
        while len(self._plan) < count:
            slot = self.rng.randrange(len(self._future))
            key = self.draw(self.kinds[slot], [k for i, k in enumerate(self._future) if i != slot])
            self._future[slot] = key
            self._plan.append((slot, key))

    @property
    def upcoming(self) -> CompileKey:
        """The key the next rotation brings in."""
        return self._plan[0][1]

    def ahead(self, rounds: int) -> list:
        """The keys the next ``rounds`` rotations bring in, in order (planned now, so that they can be compiled
        while the rounds before them run)."""
        self._extend(rounds)
        return [key for _, key in self._plan[:rounds]]

    def rotate(self) -> list:
        """The next round's keys: one swapped for `upcoming`, and one more rotation planned."""
        self.round += 1
        slot, key = self._plan.pop(0)
        self.keys[slot] = key
        self._extend(1)
        return list(self.keys)

    # ---- drawing one key ---------------------------------------------------------------------------------

    def draw(self, kind: str, others=()) -> CompileKey:
        """A key of ``kind``: of SPREAD candidates, the one whose features (`features_of`) add the most pairs of
        (feature, value) that the ``others`` keys of its round lack, so that a round's few keys meet features
        together (ngroups > 1 with the gated RMSNorm, say) more often than independent draws do."""
        seen = set().union(*(feature_pairs(k) for k in others))
        start, best = self._next_boundary, None
        for _ in range(SPREAD):
            self._next_boundary = start            # candidates of a boundary key share its boundary
            key = self._fitted(kind)
            new = len(feature_pairs(key) - seen)
            if best is None or new > best[0]:
                best = (new, key, self._next_boundary)
        self._next_boundary = best[2]
        return best[1]

    def _fitted(self, kind: str) -> CompileKey:
        for _ in range(20):
            key = self._draw(kind)
            fitted = self.fit(key.case())
            if fitted is not None:
                return self._refit(key, fitted)
        return key

    @staticmethod
    def _refit(key: CompileKey, fitted) -> CompileKey:
        """``key`` with what fitting its representative changed (a feature switched off, a size reduced)."""
        changes = {name: getattr(fitted, name) for name in key.fixed() if getattr(fitted, name) != getattr(key, name)}
        if fitted.seqlen != key.seqlen:
            changes.update(seqlen=fitted.seqlen, seqlen_min=min(key.seqlen_min, fitted.seqlen),
                           seqlen_max=max(key.seqlen_max, fitted.seqlen))
        if fitted.regime.layout != key.layout:
            changes["layout"] = fitted.regime.layout
        pin = dict(key.flags)
        for name, value in flags_of(fitted):
            if name not in ("varlen_states", "final_state_grad"):       # pass-specific: off in the forward case
                pin[name] = value
        if "varlen_states" in pin and (not pin.get("seq_idx") or fitted.batch != 1):
            pin["varlen_states"] = False
        changes["flags"] = tuple(pin.items())
        return replace(key, **changes)

    def _draw_flags(self, entry: str, batch: int, seqlen_max: int) -> tuple:
        """FLAGS[entry], drawn as the strategies draw them (harness/model/strategies.py)."""
        rng = self.rng
        coin = lambda: rng.random() < 0.5
        if entry == "layer":
            pin = dict(D=rng.choice(("head", "channel")), dt_limit=coin(), seq_idx=coin(), rmsnorm=coin())
            pin.update(norm_before_gate=pin["rmsnorm"] and coin(), bias=coin(), conv_bias=coin())
            # decoding is forward only and has one sequence per row; its prefill keeps a token
            decodes = not pin["seq_idx"] and self.backward is not True and seqlen_max > 1 and coin()
            pin["layer_steps"] = rng.randint(1, min(4, seqlen_max - 1)) if decodes else 0
            return tuple((name, pin[name]) for name in FLAGS[entry])
        pin = {"D": rng.choice(("head", "none", "channel") if entry != "split_conv1d" else ("head", "channel"))}
        if entry != "split_conv1d":
            pin.update(has_z=coin(), has_dt_bias=coin(), dt_softplus=coin())
        pin.update(dt_limit=coin(), initial_states=coin())
        if entry == "decode":
            pin.update(state_dtype=rng.choice(tuple(dict.fromkeys(("float32", *self.dtypes)))),
                       state_batch_indices=coin())
        else:
            pin.update(seq_idx=coin(), return_final_states=coin())
            pin["final_state_grad"] = pin["return_final_states"] and coin()
            if entry == "chunk_scan":
                pin["varlen_states"] = pin["seq_idx"] and batch == 1 and coin()
        if entry == "split_conv1d":
            pin.update(activation=rng.choice(("silu", "identity")), rmsnorm=coin())
            pin["norm_before_gate"] = not pin["rmsnorm"] or coin()
            pin["outproj_bias"] = coin()
        return tuple((name, pin[name]) for name in FLAGS[entry])

    def _draw(self, kind: str) -> CompileKey:
        rng, b = self.rng, self.bounds
        entry, dtype = rng.choice(self.entries), rng.choice(self.dtypes)
        boundary = None
        if kind == "production" and self.mix.huge and rng.random() < self.mix.huge:
            kind = "huge"
        if kind == "huge":              # forward chunk_scan cases only
            kind, entry = ("huge", "chunk_scan") if "chunk_scan" in self.entries and self.backward is not True \
                else ("production", entry)
        if kind == "production" and entry == "layer":
            # the float64 layer oracle, with every parameter's gradient, is too slow at model widths for a campaign
            kind = "small"
        if kind == "huge":
            hz = self.huge
            crossing = rng.choice(("x", "chunk states"))
            headdim, (dstate, chunk) = rng.choice(hz.headdims), rng.choice(hz.widths(crossing))
            nheads, batch = rng.choice(hz.nheads), rng.randint(1, hz.max_batch)
            lo, hi = hz.seqlens(batch, nheads, headdim, dstate, chunk, crossing)
            seqlen = rng.randint(lo, hi)
            ngroups = rng.choice([g for g in (1, 8) if nheads % g == 0])
        elif kind == "production":
            prod = self.production
            headdim, dstate = rng.choice(prod.headdims), rng.choice(prod.dstates)
            chunk = rng.choice(prod.chunk_sizes)
            batch = rng.randint(1, prod.max_batch)
            # nheads among those that leave room for min_seqlen tokens, then seqlen log-uniform in what is left
            room = prod.max_elements // (batch * prod.min_seqlen * headdim)
            nheads = rng.choice([h for h in prod.nheads if h <= room] or [min(prod.nheads)])
            lo = prod.min_seqlen
            hi = min(prod.max_seqlen, max(lo, prod.max_elements // (batch * nheads * headdim)))
            seqlen = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
            ngroups = rng.choice([g for g in (1, 8, nheads) if nheads % g == 0])
        else:
            headdim, dstate = rng.randint(1, b.max_headdim), rng.randint(1, b.max_dstate)
            nheads = rng.randint(1, b.max_nheads)
            chunk, batch = rng.choice(b.chunk_sizes), rng.randint(1, b.max_batch)
            if kind == "boundary":
                boundary = self._boundary_order[self._next_boundary % len(self._boundary_order)]
                self._next_boundary += 1
                if boundary.dim == "headdim":
                    headdim = boundary.value
                elif boundary.dim == "dstate":
                    dstate = boundary.value
                else:
                    nheads = boundary.value
            ngroups = rng.choice(divisors(nheads))
            lo, hi = 1, b.max_seqlen
            seqlen = rng.randint(lo, hi)
        # a huge key's cases are contiguous: the strided layout's wide tensor would be another copy of x
        layout = rng.choice(("contiguous", "strided")) if entry == "chunk_scan" and kind != "huge" else "contiguous"
        mixer = {}
        flags = self._draw_flags(entry, batch, hi)
        if entry == "split_conv1d":
            mixer = dict(d_nonssm=rng.choice((0, 0, 2, 3)), out_dim=rng.choice((None, rng.randint(1, 8))),
                         conv_width=rng.randint(1, 4))
            if mixer["out_dim"] is None:
                flags = tuple((n, False if n == "outproj_bias" else v) for n, v in flags)
        if entry == "layer":
            d_nonssm = rng.choice((0, 0, 2, 4))
            mixer = dict(d_nonssm=d_nonssm, d_model=rng.choice(divisors(nheads * headdim + d_nonssm)),
                         conv_width=rng.randint(1, 4))
            steps = dict(flags)["layer_steps"]
            if steps:                       # every case of the key keeps a prefill of at least one token
                lo = steps + 1
                seqlen = seqlen if seqlen >= lo else rng.randint(lo, hi)
        return CompileKey(kind=kind, dtype=dtype, entry=entry, batch=batch, nheads=nheads, ngroups=ngroups,
                          headdim=headdim, dstate=dstate, chunk_size=chunk, layout=layout, seqlen=seqlen,
                          seqlen_min=lo, seqlen_max=hi, boundary=boundary, flags=flags, **mixer)


__all__ = ["CompileKey", "Pool", "Mix", "Production", "KINDS", "FLAGS", "POOLED_ENTRIES", "SPREAD", "flags_of",
           "features_of", "feature_pairs", "spec_class", "seqlen_class"]
