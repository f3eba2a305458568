"""The implementation registry.

Built-in adapters live in this package, one module each. Third parties plug in without editing ssdiff:
- an entry point in the group ``ssdiff.implementations`` whose object is an Implementation (or a zero-argument
  callable returning one);
- ``module:function`` given as a name: any callable with mamba_chunk_scan_combined's signature
  (ssdiff.sides.adapters.generic wraps it).
"""

from __future__ import annotations

import importlib
from importlib import metadata

from ssdiff.sides.base import Capabilities, Implementation

BUILTIN_MODULES = ("ssdiff.sides.adapters.oracles", "ssdiff.sides.adapters.mamba_ssm", "ssdiff.sides.adapters.fla",
                   "ssdiff.sides.adapters.ssdiff_triton", "ssdiff.sides.adapters.vllm", "ssdiff.sides.adapters.serving",
                   "ssdiff.sides.adapters.mamba_ssm_layer", "ssdiff.sides.adapters.fla_layer", "ssdiff.sides.adapters.transformers_layer",
                   "ssdiff.sides.adapters.mamba3", "ssdiff.sides.adapters.mamba3_module")
ENTRY_POINT_GROUP = "ssdiff.implementations"

_registry: dict = {}
_loaded = False


class UnknownImplementation(KeyError):
    def __str__(self):
        return self.args[0]


def register(impl: Implementation) -> Implementation:
    if not impl.name:
        raise ValueError(f"{type(impl).__name__} has no name")
    _registry[impl.name] = impl
    return impl


def _load():
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:       # a real import error inside an adapter must surface
                raise
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        register(obj if isinstance(obj, Implementation) else obj())


def all_implementations() -> list:
    _load()
    return [_registry[name] for name in sorted(_registry)]


def get(name: str) -> Implementation:
    """The implementation called ``name``, or a generic adapter for ``module:function``."""
    _load()
    if name in _registry:
        return _registry[name]
    if ":" in name:
        from ssdiff.sides.adapters.generic import CallableImplementation
        return register(CallableImplementation(name))
    known = ", ".join(sorted(_registry))
    raise UnknownImplementation(f"unknown implementation {name!r} (known: {known}; or give module:function)")


__all__ = ["Capabilities", "Implementation", "register", "get", "all_implementations",
           "UnknownImplementation"]
