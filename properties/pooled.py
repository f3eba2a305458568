"""How properties draw their cases natively under a profile that searches afresh (gpu, nightly): from a few compile
keys.

Natively every new shape compiles every kernel it launches (seconds each, against a tenth of a second to judge a
case), so that 200 freely drawn examples a property would spend the run compiling. Under such a profile a property
draws each case from one of KEYS compile keys (harness/campaign/pool.py: a key fixes what the kernels specialize on; seqlen
within its class, the sequence layout, the values and the features a key does not pin vary), the keys drawn once
per run for each (label, dtype, pass) from the run's seed: SSDIFF_POOL_SEED, else a fresh one every run, so that
runs meet other keys. A failing example prints its whole case, which replays without its key.

The dev profile is derandomized natively instead (the same free draws every run, which a kept Triton cache holds),
and under the interpreter nothing compiles: both draw freely. SSDIFF_POOLED=1 (or 0) forces the choice. A property
that launches kernels as many times as the profile asks draws through `cases_here`, which makes that choice (one
that runs a handful of examples at any profile, such as test_layer's upstream layers, draws freely).
"""

from __future__ import annotations

import os
import random
import zlib
from typing import Callable, Optional, Sequence

from hypothesis import settings
from hypothesis import strategies as st

from ssdiff import runtime
from ssdiff.campaign.pool import Mix, Pool
from ssdiff.model.strategies import Bounds, cases

KEYS = 3
SEED = int(os.environ.get("SSDIFF_POOL_SEED") or random.SystemRandom().randrange(2 ** 31))

_keys: dict = {}


def pooled() -> bool:
    """Whether properties draw from compile keys here (see the module docstring)."""
    forced = os.environ.get("SSDIFF_POOLED")
    if forced in ("0", "1"):
        return forced == "1"
    return not runtime.interpreted() and not settings.default.derandomize


def keys(label: str, entries: Sequence[str], dtype: str, backward: Optional[bool], bounds: Bounds,
         fit: Optional[Callable] = None, seed: Optional[int] = None) -> tuple:
    """The run's KEYS small keys for ``label`` (an implementation, or what a property's cases are for) in ``dtype``
    and pass ``backward`` (None: both), their representatives fitted by ``fit(case) -> Case or None``
    (harness/campaign/pool.py `Pool`). The same for every example of the run."""
    seed = SEED if seed is None else seed
    ident = (label, tuple(entries), dtype, backward, bounds, seed)
    if ident not in _keys:
        mixed = zlib.crc32(f"{seed} {label} {dtype} {backward}".encode())
        _keys[ident] = tuple(Pool(entries, (dtype,), bounds, mix=Mix(size=KEYS, production=0.0, boundary=0.0),
                                  seed=mixed, fit=fit, backward=backward).keys)
    return _keys[ident]


def runnable_by(impl, device: Optional[str] = None) -> Callable:
    """A ``fit`` for `keys`: the case itself where ``impl`` runs it on ``device`` (the default device), else None."""
    device = device or runtime.default_device()
    return lambda case: case if impl.skip_reason(case, device) is None else None


def cases_here(label: str, entries: Sequence[str], dtypes: Sequence[str], backward: Optional[bool], bounds: Bounds,
               fit: Optional[Callable] = None):
    """A property's cases of one of ``entries`` in one of ``dtypes``: from the run's keys for ``label`` where
    properties draw from compile keys (`pooled`: `cases_from_keys`, ``fit`` as for `keys`), otherwise drawn
    freely (ssdiff.model.strategies.cases). The one way a property that launches kernels at the profile's example count draws its cases."""
    if pooled():
        return cases_from_keys(label, entries, dtypes, backward, bounds, fit)
    return st.sampled_from(tuple(entries)).flatmap(
        lambda entry: cases(entry=entry, dtypes=tuple(dtypes), bounds=bounds, backward=backward))


def cases_from_keys(label: str, entries: Sequence[str], dtypes: Sequence[str], backward: Optional[bool],
                    bounds: Bounds, fit: Optional[Callable] = None, seed: Optional[int] = None):
    """A strategy: a case of one of the run's keys (`keys`) for ``label``, in one of ``dtypes``."""
    return st.sampled_from(tuple(dtypes)).flatmap(
        lambda dtype: st.sampled_from(keys(label, entries, dtype, backward, bounds, fit, seed)).flatmap(
            lambda key: cases(key=key, bounds=bounds, backward=backward)))
