"""How large drawn cases may get (`Bounds`): what a campaign, a property or an implementation's testing record
draws within."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    """How large drawn cases may get. The defaults keep the float64 oracles (and the Triton interpreter)
    fast on a CPU."""

    max_batch: int = 2
    max_seqlen: int = 40
    max_nheads: int = 6
    max_headdim: int = 8
    max_dstate: int = 8
    chunk_sizes: tuple = (4, 8, 16)
    max_width: int = 4
    boundary_rate: float = 0.1      # share of cases drawn at a block-size boundary (when the search has them)


__all__ = ["Bounds"]
