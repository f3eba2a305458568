"""ssdiff: a differential correctness harness for Mamba-2 SSD kernels.

The public API is `__all__`; everything else is reached through the modules it names and may change.

    import ssdiff
    from hypothesis import given

    @given(ssdiff.cases(entry="chunk_scan"))
    def test_my_kernel(case):
        ssdiff.check(my_kernel, case)       # ssdiff.Divergence (an AssertionError) names what differed

Importing ssdiff chooses where Triton kernels run (ssdiff.runtime.configure): natively on a GPU, under the
Triton interpreter elsewhere. Import it before any module that defines a Triton kernel.
"""

from __future__ import annotations

import importlib

from ssdiff import runtime

runtime.configure()

# public name -> the module that defines it
_WHERE = {
    "Case": "ssdiff.model.case", "CaseError": "ssdiff.model.case", "Regime": "ssdiff.model.case",
    "Bounds": "ssdiff.model.bounds", "cases": "ssdiff.model.strategies",
    "Implementation": "ssdiff.sides.base", "Capabilities": "ssdiff.sides.base", "register": "ssdiff.sides.registry",
    "UsageError": "ssdiff.examine",
    "Divergence": "ssdiff.api", "check": "ssdiff.api", "fuzz": "ssdiff.api", "minimize": "ssdiff.api",
    "replay": "ssdiff.api", "known": "ssdiff.api", "implementations": "ssdiff.api",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'ssdiff' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
