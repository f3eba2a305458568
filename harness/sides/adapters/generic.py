"""Any callable with mamba_chunk_scan_combined's signature, named ``package.module:function``.

    CallableImplementation("vllm.model_executor.layers.mamba.ops.ssd_combined:mamba_chunk_scan_combined")

No code is written by the user: the callable is imported on first use (mamba_ssm modules without the package
__init__, like the built-in adapters), its capabilities are read from its signature (a parameter it lacks is
a feature it cannot express: D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, cu_seqlens with
return_varlen_states, return_final_states), and it is called the way mamba_chunk_scan_combined is:

    fn(x, dt, A, B, C, chunk_size, D=, z=, dt_bias=, initial_states=, seq_idx=, cu_seqlens=, dt_softplus=,
       dt_limit=, return_final_states=, return_varlen_states=)  ->  y | (y, final_states) | (y, [final,] varlen)

A callable that cannot be imported is reported unavailable with the reason, never with a traceback.
"""

from __future__ import annotations

import inspect
from typing import Optional

from ssdiff import runtime
from ssdiff.sides import upstream
from ssdiff.model.evaluation import Evaluation
from ssdiff.model.features import NEEDS_SEQ_IDX
from ssdiff.sides.base import Capabilities, Implementation

# parameter -> the features (harness/model/features.py keys) it is needed for
FEATURE_PARAMS = {
    "D": ("D",),
    "z": ("z",),
    "dt_bias": ("dt_bias",),
    "dt_softplus": ("dt_softplus",),
    "dt_limit": ("dt_limit",),
    "initial_states": ("initial_states",),
    "seq_idx": NEEDS_SEQ_IDX,
    "return_final_states": ("final_states", "final_state_grad"),
    "cu_seqlens": ("varlen_states",),
    "return_varlen_states": ("varlen_states",),
}
POSITIONAL = ("x", "dt", "A", "B", "C", "chunk_size")


class CallableImplementation(Implementation):
    """An Implementation around ``module:function``."""

    def __init__(self, target: str, fn=None):
        """``fn``: the callable itself, when the caller has it (``target`` then only names it)."""
        self.name = target
        self.target = target
        self.description = f"any callable with mamba_chunk_scan_combined's signature: {target}"
        self._fn = fn
        self._problem: Optional[str] = None
        self._loaded = False
        self._capabilities = None

    def _load(self):
        if not self._loaded:
            self._loaded = True
            try:
                self._fn = self._fn or upstream.load_callable(self.target)
            except upstream.Unavailable as err:
                self._problem = str(err)
                return
            try:
                params = inspect.signature(self._fn).parameters
            except (TypeError, ValueError):
                return                                   # no signature to read: assume the full one
            names = list(params)
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                return
            positional = [p for p in params.values()
                          if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
            if len(positional) < len(POSITIONAL) and not varargs:
                self._problem = (f"{self.target}: does not take mamba_chunk_scan_combined's arguments "
                                 f"(x, dt, A, B, C, chunk_size, ...); its parameters are {', '.join(names)}")
                return
            self._params = frozenset(names)

    def unavailable(self) -> Optional[str]:
        self._load()
        return self._problem

    @property
    def capabilities(self) -> Capabilities:
        if self._capabilities is None:
            self._load()
            params = getattr(self, "_params", None)
            unsupported = set()
            if params is not None:
                for param, feats in FEATURE_PARAMS.items():
                    if param not in params:
                        unsupported.update(feats)
            self._capabilities = Capabilities(dtypes=frozenset(runtime.runnable_dtypes()),
                                              unsupported=frozenset(unsupported))
        return self._capabilities

    def forward(self, case, tensors, inputs, want_stages):
        self._load()
        if self._problem:
            raise upstream.Unavailable(self._problem)
        t = tensors
        kwargs = dict(D=t.get("D"), z=t.get("z"), dt_bias=t.get("dt_bias"), initial_states=t.get("initial_states"),
                      seq_idx=inputs.seq_idx, dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
                      return_final_states=case.return_final_states)
        if case.varlen_states:
            kwargs.update(cu_seqlens=inputs.cu_seqlens, return_varlen_states=True)
        params = getattr(self, "_params", None)
        if params is not None:
            # Leave out what the callable does not take, when the case does not need it (its default).
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        result = self._fn(t["x"], t["dt"], t["A"], t["B"], t["C"], case.chunk_size, **kwargs)
        result = list(result) if isinstance(result, (tuple, list)) else [result]
        expected = 1 + case.return_final_states + case.varlen_states
        if len(result) != expected:
            raise TypeError(f"{self.target} returned {len(result)} values where mamba_chunk_scan_combined returns "
                            f"{expected} (y{', final_states' if case.return_final_states else ''}"
                            f"{', varlen_states' if case.varlen_states else ''})")
        outputs = {"y": result.pop(0)}
        if case.return_final_states:
            outputs["final_states"] = result.pop(0)
        if case.varlen_states:
            outputs["varlen_states"] = result.pop(0)
        if case.backward and not outputs["y"].requires_grad:
            raise TypeError(f"{self.target} returned an output that does not require grad: it has no backward")
        return Evaluation(outputs=outputs, notes=[f"generic adapter around {self.target}"])
