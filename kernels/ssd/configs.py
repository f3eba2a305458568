"""Autotune configurations of every kernel, and how block sizes are fitted to a problem.

Every kernel is a ``triton.autotune`` over a short list below. Which configuration runs is decided by
ssdiff.runtime (its patch of triton's Autotuner): "tuned" benchmarks them on a GPU (the first one in the
interpreter), an integer index forces configuration ``index % n`` of every kernel, and ``runtime.sweep``
walks indices until every configuration of every kernel has run — some bugs live in one configuration only
(a mask that is wrong only when a tile straddles the chunk end...).

Block sizes in a list are upper bounds: ``fit`` (the early_config_prune hook) clamps each to the problem, at
least 16 (what tl.dot needs). Kernels whose tiles write partial sums index them by 16-wide granules: a tile
of block size BLK writes granule slot ``tile * BLK // 16``. The buffers are left uninitialized and
``used_slots`` picks, after the launch, the slots the configuration that ran wrote (every BLK // 16-th):
no zero fill, and the host sum reads only what was written.
"""

from __future__ import annotations

import triton

GRANULE = 16


def _c(num_warps=4, num_stages=2, **blocks) -> triton.Config:
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


# name -> (configs, {block constexpr: problem dimension it tiles (an argument name)})
# The first config of each list is the one an H200 picked from a wide grid at (b, L, h, p, n, g) =
# (2, 16384, 128, 64, 128, 8), bf16, chunk 256 (``python -m ssdiff.tools.kernel_tune --wide``); the interpreter runs
# it by default too. The small ones are there for the sweep: tiles that straddle chunk, sequence and tensor
# edges.
CONFIGS = {
    "cumsum": ([_c(BH=16, num_warps=4), _c(BH=32, num_warps=2), _c(BH=64, num_warps=8)], {"BH": "H"}),
    "bmm": ([_c(BM=128, BN=128, BK=64, num_warps=8, num_stages=3), _c(BM=16, BN=32, BK=16, num_warps=2),
             _c(BM=64, BN=64, BK=64, num_warps=4, num_stages=3)], {"BM": "Q", "BN": "Q", "BK": "N"}),
    "chunk_state": ([_c(BP=64, BN=128, BK=64, num_warps=4, num_stages=3), _c(BP=16, BN=32, BK=16, num_warps=2),
                     _c(BP=64, BN=64, BK=64, num_warps=4, num_stages=3)], {"BP": "P", "BN": "N", "BK": "Q"}),
    "state_passing": ([_c(BS=1024, num_warps=2), _c(BS=16, num_warps=2), _c(BS=256, num_warps=4)], {"BS": "PN"}),
    "chunk_scan": ([_c(BM=64, BP=64, BK=32, BN=64, num_warps=4, num_stages=3),
                    _c(BM=16, BP=16, BK=32, BN=16, num_warps=2),
                    _c(BM=64, BP=64, BK=32, BN=64, num_warps=4, num_stages=4),
                    _c(BM=128, BP=64, BK=32, BN=64, num_warps=4, num_stages=3)],
                   {"BM": "Q", "BP": "P", "BK": "Q", "BN": "N"}),
    "varlen_states": ([_c(BP=32, BN=64, BK=64, num_warps=4), _c(BP=16, BN=16, BK=16, num_warps=2)],
                      {"BP": "P", "BN": "N", "BK": "Q"}),
    # backward
    "bwd_gate": ([_c(BR=16, BP=64, num_warps=4), _c(BR=16, BP=16, num_warps=2)], {"BP": "P"}),
    "bwd_dstates": ([_c(BP=64, BN=128, BK=32, num_warps=4, num_stages=3), _c(BP=16, BN=16, BK=32, num_warps=2),
                     _c(BP=64, BN=128, BK=64, num_warps=4, num_stages=2)], {"BP": "P", "BN": "N", "BK": "Q"}),
    "bwd_state_passing": ([_c(BS=1024, num_warps=4), _c(BS=16, num_warps=2), _c(BS=256, num_warps=4)],
                          {"BS": "PN"}),
    "bwd_dcb_ddA": ([_c(BM=64, BN=32, BP=64, num_warps=4, num_stages=2), _c(BM=16, BN=16, BP=16, num_warps=2),
                     _c(BM=64, BN=64, BP=64, num_warps=4, num_stages=3),
                     _c(BM=32, BN=32, BP=64, num_warps=4, num_stages=2),
                     _c(BM=128, BN=32, BP=64, num_warps=8, num_stages=2)], {"BM": "Q", "BN": "Q", "BP": "P"}),
    "bwd_dbc": ([_c(BM=128, BN=128, BK=64, BP=32, num_warps=8, num_stages=3),
                 _c(BM=16, BN=16, BK=16, BP=32, num_warps=2),
                 _c(BM=128, BN=64, BK=64, BP=32, num_warps=4, num_stages=3)],
                {"BM": "Q", "BN": "N", "BK": "Q", "BP": "P"}),
    "bwd_dx": ([_c(BM=128, BP=64, BK=32, BN=64, num_warps=4, num_stages=3),
                _c(BM=16, BP=16, BK=16, BN=32, num_warps=2),
                _c(BM=64, BP=64, BK=32, BN=64, num_warps=4, num_stages=3)],
               {"BM": "Q", "BP": "P", "BK": "Q", "BN": "N"}),
    "bwd_cumsum": ([_c(BH=16, num_warps=4), _c(BH=32, num_warps=2), _c(BH=64, num_warps=8)], {"BH": "H"}),
}


def block(value: int, cap: int, floor: int = GRANULE) -> int:
    """A power-of-two block covering ``value`` (at least ``floor``), at most ``max(cap, floor)``."""
    return max(floor, min(triton.next_power_of_2(max(int(value), 1)), max(cap, floor)))


def fitter(name: str):
    dims = CONFIGS[name][1]

    def fit(configs, nargs, **kwargs):
        args = {**nargs, **kwargs}
        out = []
        for cfg in configs:
            kw = dict(cfg.kwargs)
            for blk, dim in dims.items():
                kw[blk] = block(args[dim], kw[blk], floor=1 if blk == "BR" else GRANULE)
            out.append(triton.Config(kw, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        return out

    return fit


# name -> the Autotuner objects built from CONFIGS[name] (ssdiff.tools.kernel_tune swaps their config lists)
TUNERS: dict = {}


def autotune(name: str, key: list, reset_to_zero=None):
    """``triton.autotune`` over CONFIGS[name], keyed by ``key``, with block sizes fitted to the problem."""
    def wrap(fn):
        tuner = triton.autotune(configs=CONFIGS[name][0], key=key, reset_to_zero=reset_to_zero,
                                prune_configs_by={"early_config_prune": fitter(name)})(fn)
        tuner.tiles = CONFIGS[name][1]          # block constexpr -> the problem dimension it tiles
        TUNERS.setdefault(name, []).append(tuner)
        return tuner
    return wrap


def used_slots(part, kernel, blk: str, dim: int):
    """The granule slots of ``part`` (along ``dim``) written by the last launch of autotuned ``kernel``, whose
    tiles of block size ``blk`` write slot ``tile * blk // GRANULE``."""
    step = kernel.best_config.kwargs[blk] // GRANULE
    index = [slice(None)] * part.dim()
    index[dim] = slice(None, None, step)
    return part[tuple(index)]


def count(name: str) -> int:
    return len(CONFIGS[name][0])


def max_configs() -> int:
    """How many indices a sweep must walk to visit every configuration of every kernel."""
    return max(len(v[0]) for v in CONFIGS.values())
