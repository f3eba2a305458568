"""A campaign's configuration (`FuzzConfig`, what `ssdiff fuzz`'s flags fill in) and its plan: the configuration
checked against the sides and this runtime (`plan`), with what follows from it — the entry points and dtypes every
side takes here, the pass, the sizes drawn, the block-size boundaries of the sides' kernels and, natively, the
compile pool. Every problem is a UsageError naming the flag."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ssdiff import runtime, truth
from ssdiff.campaign.pool import POOLED_ENTRIES, Mix, Pool
from ssdiff.examine import Examiner, UsageError
from ssdiff.model.strategies import Bounds
from ssdiff.registry import known
from ssdiff.sides import tiling
from ssdiff.verdict.judge import FACTOR

PASSES = ("forward", "backward", "mixed")
AUTOTUNE_POLICIES = ("tuned", "random", "sweep")

# The post-processing bound (FuzzConfig.post_time) by default: this share of the search's time budget, at least
# POST_MIN_S; POST_EXAMPLES_S where the campaign has an example budget alone.
POST_SHARE = 0.5
POST_MIN_S = 30.0
POST_EXAMPLES_S = 600.0

# Larger shapes where kernels run natively (the float64 oracle on a GPU keeps up).
GPU_BOUNDS = Bounds(max_batch=2, max_seqlen=300, max_nheads=12, max_headdim=64, max_dstate=64,
                    chunk_sizes=(16, 32, 64, 128, 256))


@dataclass
class FuzzConfig:
    """impl / against: implementation specs (registry names or module:attr); against None: the oracle is
    the other side. max_time (s) / max_examples: budgets (None: unbounded; at least one should be set).
    entry: an entry point, or None for every one both sides take. pass_: forward, backward or mixed.
    dtypes: None for every dtype all sides run here. autotune: "tuned", a config index, "random" (an index
    drawn per case) or "sweep" (every config of every kernel, each case). isolate: run implementations in
    a child process (crash and hang become verdicts); timeout: seconds per run there."""

    impl: str
    against: Optional[str] = None
    max_time: Optional[float] = 300.0
    max_examples: Optional[int] = None
    entry: Optional[str] = None
    pass_: str = "mixed"
    dtypes: Optional[tuple] = None
    autotune: object = "tuned"
    device: Optional[str] = None
    out_dir: Optional[str] = None
    isolate: bool = False
    timeout: float = 300.0
    keep_going: bool = False
    # Known upstream defects (harness/registry/known.py): "report" judges and labels them, "skip" leaves their cases out,
    # "ignore" does not consult the registry (a divergence it would match counts as new).
    known: str = "report"
    seed: Optional[int] = None
    localize: bool = True
    # Minimize each divergence found (minimized.json, minimized-verdict.json, repro.py in its folder).
    minimize: bool = True
    minimize_runs: int = 150
    bounds: Optional[Bounds] = None
    # Draw each round's cases from a rotating pool of compile keys (harness/campaign/pool.py): None natively only (where
    # kernels compile), True always, False never.
    pool: Optional[bool] = None
    # The pool's kinds of key; None: Mix() with the default bounds, no production keys with bounds given (a
    # campaign told to stay small stays small).
    pool_mix: Optional[Mix] = None
    # The chance a production key is huge instead (harness/inputs/huge.py; Mix.huge): natively, the nightly campaign's.
    huge: float = 0.0
    # With a pool: compile each key's representative case ahead in worker processes (harness/campaign/precompile.py).
    compile_ahead: bool = True
    oracle: str = truth.DEFAULT_ORACLE
    factor: float = FACTOR
    ablation_runs: Optional[int] = None
    # Seconds for localizing and minimizing the divergences once the search has found them (`post_time`: None is
    # POST_SHARE of max_time, at least POST_MIN_S, or POST_EXAMPLES_S with an example budget alone); what is left
    # unfinished then is saved as it stands and said to be partial.
    post_time: Optional[float] = None
    # The shared example database (--example-db; harness/campaign/cluster.py): a directory, a redis:// URL or a
    # Hypothesis ExampleDatabase. Its divergent cases of these sides are judged first, and each new divergence's case
    # is saved there. None: none (the default).
    example_db: Optional[object] = None
    # The HTML report goes to <report_dir>/<out_dir's name>/index.html (harness/report); None: no report.
    report_dir: Optional[str] = field(default_factory=lambda: os.environ.get("SSDIFF_REPORTS") or "reports")


@dataclass(frozen=True)
class Plan:
    """What a configuration comes to on these sides, here: ``entries`` and ``dtypes`` every side takes (in
    order); ``backward`` True / False / None (both); the ``bounds`` drawn within; the block-size ``boundaries`` of
    every side's kernels (ssdiff.sides.tiling), drawn at bounds.boundary_rate; ``pool``: the compile pool
    (ssdiff.campaign.pool) natively where a side has kernels to compile, else None; ``post_time``: the seconds
    localization and minimization may take after the search."""

    entries: tuple
    dtypes: tuple
    backward: Optional[bool]
    bounds: Bounds
    boundaries: tuple
    pool: Optional[Pool]
    post_time: float


def plan(config: FuzzConfig, examiner: Examiner) -> Plan:
    """Check ``config`` against ``examiner``'s sides and this runtime (UsageError naming the flag) and plan the
    campaign. Fills in ``config.device`` and ``config.dtypes``."""
    cfg = config
    impls = examiner.impls
    if cfg.pass_ not in PASSES:
        raise UsageError(f"--pass must be one of {', '.join(PASSES)}, got {cfg.pass_!r}")
    if cfg.known not in known.KNOWN_POLICIES:
        raise UsageError(f"--known must be one of {', '.join(known.KNOWN_POLICIES)}, got {cfg.known!r}")
    if not (cfg.autotune in AUTOTUNE_POLICIES or (isinstance(cfg.autotune, int) and cfg.autotune >= 0)):
        raise UsageError(f"--autotune must be tuned, random, sweep or a config index, got {cfg.autotune!r}")
    if cfg.max_time is None and cfg.max_examples is None:
        raise UsageError("give a time budget or an example budget (or both)")
    for flag, value in (("--max-time", cfg.max_time), ("--post-time", cfg.post_time), ("--timeout", cfg.timeout)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise UsageError(f"{flag}: expected a positive finite number of seconds, got {value!r}")
    if cfg.max_examples is not None and not (isinstance(cfg.max_examples, int) and cfg.max_examples >= 1):
        raise UsageError(f"--max-examples: expected a positive integer, got {cfg.max_examples!r}")
    if not 0.0 <= cfg.huge <= 1.0:
        raise UsageError(f"--huge is a chance between 0 and 1, got {cfg.huge!r}")
    entries = set.intersection(*(set(i.capabilities.entries) for i in impls.values()))
    if cfg.entry is not None:
        if cfg.entry not in entries:
            raise UsageError(f"entry {cfg.entry!r} is not implemented by every side (they share: "
                             f"{', '.join(sorted(entries)) or 'none'})")
        entries = {cfg.entry}
    if not entries:
        raise UsageError("the implementations share no entry point")
    runnable = set(runtime.runnable_dtypes())
    dtypes = set.intersection(runnable, *(set(i.capabilities.dtypes) for i in impls.values()))
    if cfg.dtypes:
        unknown = [d for d in cfg.dtypes if d not in dtypes]
        if unknown:
            raise UsageError(f"dtype {unknown[0]} cannot be judged here for every side "
                             f"(runnable: {', '.join(sorted(dtypes)) or 'none'}; "
                             f"{runtime.dtype_skip_reason(unknown[0]) or 'an implementation does not take it'})")
        dtypes = set(cfg.dtypes)
    if not dtypes:
        raise UsageError("no dtype runs here for every side")
    cfg.dtypes = tuple(d for d in ("float32", "float16", "bfloat16") if d in dtypes)
    has_backward = all(i.capabilities.backward for i in impls.values())
    if cfg.pass_ == "backward" and not has_backward:
        raise UsageError("--pass backward: an implementation has no backward")
    backward = {"forward": False, "backward": True, "mixed": None}[cfg.pass_] if has_backward else False
    bounds = cfg.bounds or (GPU_BOUNDS if cfg.device.startswith("cuda") else Bounds())
    found = {}
    for impl in impls.values():
        for b in tiling.boundaries(impl, cfg.device):
            found.setdefault((b.dim, b.value, b.block), b)
    boundaries = tuple(found[k] for k in sorted(found))
    # Natively, cases come from a rotating pool of compile keys (its entries only, and only where a side has
    # kernels to compile); interpreted, or with no kernels (a torch-only layer), freely.
    pool = None
    use_pool = (not runtime.interpreted()) if cfg.pool is None else cfg.pool
    entries = tuple(sorted(entries))
    if use_pool and any(i.kernel_modules() for i in impls.values()) and set(entries) <= POOLED_ENTRIES:
        mix = cfg.pool_mix or (Mix(huge=cfg.huge) if cfg.bounds is None else Mix(production=0.0))
        pool = Pool(entries, cfg.dtypes, bounds, boundaries, mix=mix, seed=cfg.seed, fit=examiner.fit,
                    backward=backward)
    if cfg.huge and (pool is None or cfg.pool_mix is not None or cfg.bounds is not None):
        raise UsageError("--huge draws production keys of the compile pool: natively (where the pool is on), "
                         "with the default sizes")
    post_time = cfg.post_time if cfg.post_time is not None else (
        max(POST_MIN_S, POST_SHARE * cfg.max_time) if cfg.max_time is not None else POST_EXAMPLES_S)
    return Plan(entries, cfg.dtypes, backward, bounds, boundaries, pool, post_time)


__all__ = ["FuzzConfig", "Plan", "plan", "PASSES", "AUTOTUNE_POLICIES", "GPU_BOUNDS", "POST_SHARE", "POST_MIN_S",
           "POST_EXAMPLES_S"]
