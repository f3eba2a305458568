"""The compile pool: on a GPU, which kernel specializations a round of the search may use.

Natively, Triton compiles a kernel once per specialization: its constexprs (block sizes fitted to headdim,
dstate, chunk size; feature flags), its dtypes, and every integer argument's class (== 1, divisible by 16,
other) — and sizes, strides and offsets are such arguments. Autotuning then benchmarks every config once per
autotune key (chunk size, headdim, dstate, nheads...). A case drawn freely meets a new specialization almost
every time: a compile of seconds (and, tuned, a benchmark of every config) for a judgement of milliseconds.

So on a GPU every case of a search round is drawn from one of a few `CompileKey`s: each fixes what shapes
the tensors (dtype, batch, nheads, ngroups, headdim, dstate, chunk size, layout, the mixer's widths) and the
class of seqlen (its 2-adic valuation up to 16, and that of its chunk count, each with "is 1"); seqlen within
that class, the sequence layout, initial states, every feature flag and the values vary freely. After each
round one key is swapped for a fresh draw (`Pool.rotate`), so over a campaign odd sizes still come up. Keys
come in kinds: "small" (GPU_BOUNDS), "production" (model shapes: `Production`) and "boundary" (one dimension
at a block-size boundary of the implementation's configs, run with that config: harness/tiling.py).

Under the Triton interpreter nothing compiles: there is no pool and cases are drawn freely.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

from harness.strategies import Bounds, divisors
from harness.tiling import Boundary

KINDS = ("small", "production", "boundary")


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
    boundary: Optional[Boundary] = None      # the config a boundary key runs with

    def fits(self, seqlen: int) -> bool:
        return (self.seqlen_min <= seqlen <= self.seqlen_max
                and seqlen_class(seqlen, self.chunk_size) == seqlen_class(self.seqlen, self.chunk_size))

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
        return out

    def case(self):
        """The key's representative: its own seqlen, default features."""
        from harness.case import Case, Regime

        return Case(seqlen=self.seqlen, regime=Regime(layout=self.layout), **self.fixed())

    def describe(self) -> str:
        text = (f"{self.kind} {self.entry} {self.dtype} b={self.batch} h={self.nheads} g={self.ngroups} "
                f"p={self.headdim} n={self.dstate} Q={self.chunk_size} L~{self.seqlen} {self.layout}")
        return text + (f" [{self.boundary.describe()}]" if self.boundary else "")


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
    """Which share of a round's keys is of each kind; ``size`` keys at a time."""

    size: int = 4
    production: float = 0.25
    boundary: float = 0.25


class Pool:
    """The keys of the current round, for one campaign (its entries, dtypes, bounds, boundaries)."""

    def __init__(self, entries, dtypes, bounds: Bounds, boundaries=(), mix: Mix = Mix(),
                 production: Production = Production(), seed: Optional[int] = None, accept=None):
        """``accept(key) -> bool``: whether the implementations can run the key's cases at all (a key they
        would skip wholesale is drawn again, up to 20 times)."""
        self.entries, self.dtypes, self.bounds = tuple(entries), tuple(dtypes), bounds
        self.boundaries, self.mix, self.production = tuple(boundaries), mix, production
        self.rng = random.Random(seed)
        self.accept = accept or (lambda key: True)
        # Boundary keys take the boundaries in a shuffled cycle, so that a campaign's rotations cover them all.
        self._boundary_order = list(self.boundaries)
        self.rng.shuffle(self._boundary_order)
        self._next_boundary = 0
        self.keys = [self.draw(kind) for kind in self._kinds(mix.size)]
        self.round = 0
        self._plan_next()

    def _kinds(self, count: int) -> list:
        """Kinds for ``count`` keys in the mix's proportions (rounded, at least one small key)."""
        kinds = []
        for kind, share in (("production", self.mix.production),
                            ("boundary", self.mix.boundary if self.boundaries else 0.0)):
            kinds += [kind] * int(round(share * count))
        kinds = kinds[:count - 1]
        return ["small"] * (count - len(kinds)) + kinds

    def _plan_next(self):
        self._slot = self.rng.randrange(len(self.keys))
        self.upcoming = self.draw(self.keys[self._slot].kind)

    def rotate(self) -> list:
        """The next round's keys: one swapped for `upcoming` (drawn a round ahead, so that it can be compiled
        while the round runs), and the key after it drawn."""
        self.round += 1
        self.keys[self._slot] = self.upcoming
        self._plan_next()
        return list(self.keys)

    # ---- drawing one key ---------------------------------------------------------------------------------

    def draw(self, kind: str) -> CompileKey:
        for _ in range(20):
            key = self._draw(kind)
            if self.accept(key):
                break
        return key

    def _draw(self, kind: str) -> CompileKey:
        rng, b = self.rng, self.bounds
        entry, dtype = rng.choice(self.entries), rng.choice(self.dtypes)
        boundary = None
        if kind == "production":
            prod = self.production
            headdim, dstate = rng.choice(prod.headdims), rng.choice(prod.dstates)
            chunk = rng.choice(prod.chunk_sizes)
            batch = rng.randint(1, prod.max_batch)
            seqlen = int(round(math.exp(rng.uniform(math.log(prod.min_seqlen), math.log(prod.max_seqlen)))))
            room = prod.max_elements // (batch * seqlen * headdim)
            nheads = rng.choice([h for h in prod.nheads if h <= room] or [1])
            lo = prod.min_seqlen
            hi = min(prod.max_seqlen, max(lo, prod.max_elements // (batch * nheads * headdim)))
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
        layout = rng.choice(("contiguous", "strided")) if entry == "chunk_scan" else "contiguous"
        mixer = {}
        if entry == "split_conv1d":
            mixer = dict(d_nonssm=rng.choice((0, 0, 2, 3)), out_dim=rng.choice((None, rng.randint(1, 8))),
                         conv_width=rng.randint(1, 4))
        return CompileKey(kind=kind, dtype=dtype, entry=entry, batch=batch, nheads=nheads, ngroups=ngroups,
                          headdim=headdim, dstate=dstate, chunk_size=chunk, layout=layout, seqlen=seqlen,
                          seqlen_min=lo, seqlen_max=hi, boundary=boundary, **mixer)


__all__ = ["CompileKey", "Pool", "Mix", "Production", "KINDS", "spec_class", "seqlen_class"]
