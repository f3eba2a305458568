"""Block-size boundaries: where an implementation's tiling can go wrong, read from its autotune configs.

A Triton kernel tiles a dimension by a constexpr block size of the config that runs. A tiling bug (a mask
that forgets the partial tile, a grid sized for another block, two programs writing one output) appears only
when the dimension crosses a block size of that config, and only with that config. `boundaries(impl)` reads
the ``BLOCK*`` values of every config of every autotuned kernel the implementation launches
(`Implementation.kernel_modules()`) and returns, for each dimension a block tiles, the values at and around
each block size (b - 1, b, b + 1, 2b + 1) with the config index that runs that block. The search
(harness/model/strategies.py) draws such a case at a small rate and runs it with that config (harness/campaign/fuzz.py).

Which dimension a block tiles: an autotuner that says so (ssdiff's kernels/ssd tuners carry ``tiles``, block
-> problem dimension: P headdim, N dstate, H heads, PN their product, Q chunk positions) is taken at its word;
otherwise ``BLOCK*_H`` blocks tile heads and every other ``BLOCK*`` tiles headdim and dstate (mamba_ssm's and
fla's kernels tile the two with BLOCK_SIZE_M / N / K, one kernel one way, the next the other). Chunk positions
are left out: the drawn seqlen and chunk size already cross every block of those.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# The largest boundary value drawn per dimension (CPU, GPU): the interpreter's cost grows with the programs
# (mamba_chunk_scan_combined forward+backward, L=20: 3.3 s at the default shape, 5.7 s at headdim 129, 56 s at
# 33 heads).
CAPS = {"cpu": {"headdim": 129, "dstate": 129, "nheads": 9},
        "cuda": {"headdim": 257, "dstate": 257, "nheads": 129}}


@dataclass(frozen=True)
class Boundary:
    """``dim`` drawn at ``value``, next to block size ``block`` of config ``config`` of ``kernel``."""

    dim: str
    value: int
    block: int
    kernel: str
    config: int

    def describe(self) -> str:
        return f"{self.dim}={self.value} at {self.kernel}'s block {self.block} (config #{self.config})"


def autotuned(modules) -> list:
    """(name, Autotuner) of every autotuned Triton kernel defined in ``modules``."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return []
    found, seen = [], set()
    for module in modules:
        module = sys.modules.get(module, module) if isinstance(module, str) else module
        for name, value in sorted(vars(module).items()):
            if isinstance(value, Autotuner) and id(value) not in seen:
                seen.add(id(value))
                found.append((name, value))
    return found


DECLARED = {"P": ("headdim",), "N": ("dstate",), "H": ("nheads",), "PN": ("headdim", "dstate"), "Q": ()}


def tiled_dims(tuner, block_name: str) -> tuple:
    declared = getattr(tuner, "tiles", None)
    if declared is not None:
        return DECLARED.get(declared.get(block_name), ())
    if "BLOCK" not in block_name:
        return ()
    return ("nheads",) if block_name.endswith("_H") else ("headdim", "dstate")


def boundaries(impl, device: str) -> tuple:
    """Every boundary of ``impl``'s tiling within the platform's caps, one per (dim, value, block): the first
    config (kernel by kernel, in module order) that runs a block of that size."""
    caps = CAPS["cuda" if str(device).startswith("cuda") else "cpu"]
    out = {}
    for kernel, tuner in autotuned(impl.kernel_modules()):
        for index, config in enumerate(tuner.configs):
            for name, block in sorted(config.kwargs.items()):
                if not isinstance(block, int) or block < 2:
                    continue
                for dim in tiled_dims(tuner, name):
                    for value in (block - 1, block, block + 1, 2 * block + 1):
                        if 1 <= value <= caps[dim]:
                            out.setdefault((dim, value, block), Boundary(dim, value, block, kernel, index))
    return tuple(out[k] for k in sorted(out))
