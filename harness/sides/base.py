"""What an implementation is to the harness: a name, its capabilities, and a forward function.

An adapter subclasses `Implementation` and writes `forward(case, tensors, inputs)`, which calls the code under
test and returns its outputs (and, when it can, stage intermediates in the layout of
harness/model/stages.py). The shared `run` does the rest: builds native tensors in the case's layout,
differentiates for backward cases, and collects everything into an `Evaluation` (harness/model/evaluation.py). A case outside the capabilities is
skipped with the reason (`Implementation.skip_reason`), never reshaped to fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ssdiff.model.case import Case, CaseError
from ssdiff.model.evaluation import Evaluation, evaluate_graph
from ssdiff.model.features import FEATURES, present, without
from ssdiff.inputs import Inputs


@dataclass(frozen=True)
class Capabilities:
    """entries: entry points it runs; dtypes / devices ("cpu", "cuda"); backward: has gradients;
    unsupported: keys of the case features (harness/model/features.py) it cannot express; stages: the stage
    intermediates it exposes; limits: extra checks, each ``case -> reason or None``."""

    entries: frozenset = frozenset({"chunk_scan"})
    dtypes: frozenset = frozenset({"float32", "float16", "bfloat16"})
    devices: frozenset = frozenset({"cpu", "cuda"})
    backward: bool = True
    unsupported: frozenset = frozenset()
    stages: tuple = ()
    limits: tuple = ()


class Implementation:
    """Subclass and set ``name``, ``description``, ``capabilities``; write ``forward``."""

    name: str = ""
    description: str = ""
    capabilities: Capabilities = Capabilities()
    # The order its scan evaluates in: "chunked" (the baseline's model, harness/budget/) or "recurrent"
    # (token by token: the evidence adds the model in the token order, whose rounding grows with the tokens a state
    # carries, as a token recurrence's does; harness/examine.py).
    evaluation_order: str = "chunked"

    def unavailable(self) -> Optional[str]:
        """Why this implementation cannot run in this environment (missing package...), or None."""
        return None

    def kernel_modules(self) -> tuple:
        """The modules (or their names) defining the Triton kernels it launches: their autotune configs give
        the block-size boundaries the search draws at (harness/sides/tiling.py). Empty without Triton kernels."""
        return ()

    def refuses(self, backward: bool, device: str, dtype: Optional[str] = None) -> Optional[str]:
        """Why a whole pass (in ``dtype``, when given) is refused on ``device`` whatever the case — a
        version/hardware guard of the code under test, or a limit that no case of the pass escapes — or None.
        Properties skip such a pass with this reason instead of drawing cases for it."""
        return None

    def skip_reason(self, case: Case, device: str) -> Optional[str]:
        """Why ``case`` is outside this implementation's capabilities on ``device``, or None."""
        why = self.unavailable() or self.refuses(case.backward, device, case.dtype)
        if why:
            return why
        cap = self.capabilities
        kind = torch.device(device).type
        if case.entry not in cap.entries:
            return f"{self.name} does not implement entry point {case.entry!r}"
        if case.dtype not in cap.dtypes:
            return f"{self.name} does not run {case.dtype} on this runtime"
        if kind not in cap.devices:
            return f"{self.name} needs a {'GPU' if 'cuda' in cap.devices else 'CPU'} (device {kind!r} given)"
        if case.backward and not cap.backward:
            return f"{self.name} has no backward"
        missing = sorted(present(case) & cap.unsupported)
        if missing:
            return f"{self.name} cannot express: {', '.join(missing)}"
        for limit in cap.limits:
            why = limit(case)
            if why:
                return why
        return None

    def forward(self, case: Case, tensors: dict, inputs: Inputs, want_stages: bool) -> Evaluation:
        """Call the code under test on ``tensors`` (native dtypes, the case's layout). When ``want_stages``,
        also fill ``Evaluation.stages`` with whatever stage intermediates it can expose (oracle layout)."""
        raise TypeError(f"{type(self).__name__} must define forward() or run()")

    def run(self, case: Case, inputs: Inputs, want_stages: bool = False) -> Evaluation:
        """Forward (and for backward cases, gradients of every differentiable input)."""
        tensors = inputs.native(requires_grad=case.backward)
        return evaluate_graph(case, inputs, tensors, lambda: self.forward(case, tensors, inputs, want_stages))


def fit_case(case: Case, impls, device: str) -> Optional[Case]:
    """``case`` with the features some implementation cannot express switched off (harness/model/features.py) and,
    if a size limit still rejects it, dstate / headdim nudged up to the nearest accepted; None when it still
    falls outside one's capabilities (entry, dtype, a limit)."""
    for _ in range(len(FEATURES)):
        before = case
        for impl in impls:
            cap = impl.capabilities
            wanted = set(present(case) & cap.unsupported)
            if case.backward and not cap.backward:
                wanted.add("backward")
            case = without(case, wanted)
        if case == before:
            break
    if not any(impl.skip_reason(case, device) for impl in impls):
        return case
    # A size limit (e.g. conv channels % 8 == 0 for causal_conv1d): nudge dstate and headdim up a little.
    for extra_p in range(4):
        for extra_n in range(8):
            try:
                nudged = case.replace(dstate=case.dstate + extra_n, headdim=case.headdim + extra_p)
            except CaseError:
                continue
            if not any(impl.skip_reason(nudged, device) for impl in impls):
                return nudged
    return None


def limit(check: Callable[[Case], bool], reason: str) -> Callable[[Case], Optional[str]]:
    """A capability limit: ``reason`` when ``check(case)`` is true."""
    return lambda case: reason if check(case) else None
