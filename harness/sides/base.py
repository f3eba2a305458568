"""What an implementation is to the harness: a name, its capabilities, and a forward function.

An adapter subclasses `Implementation` and writes `forward(case, tensors, inputs)`, which calls the code under
test and returns its outputs (and, when it can, stage intermediates in the layout of
harness/model/stages.py). The shared `run` does the rest: builds native tensors in the case's layout,
differentiates for backward cases, and collects everything into an `Evaluation` (harness/model/evaluation.py). A case outside the capabilities is
skipped with the reason (`Implementation.skip_reason`), never reshaped to fit.

Its `Testing` record says how the one generic property (properties/test_implementations.py, through
ssdiff.testing) checks it against the oracle: where cases are drawn and how many, under which autotune configs,
its pinned regression cases, and whether its stage intermediates are judged. The default suits a plain upstream
adapter whose kernels are Triton; an adapter sets its own where it needs other numbers. Capabilities say what the
call can express; neither they nor the record say what is wrong with it (that is harness/registry/known.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ssdiff.model.case import Case, CaseError, Regime
from ssdiff.model.evaluation import Evaluation, evaluate_graph
from ssdiff.model.features import FEATURES, present, without
from ssdiff.model.bounds import Bounds
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


@dataclass(frozen=True)
class Domain:
    """A part of the case space the generic property draws an implementation's cases from, in the test's pass and
    dtype: entry points ``entries`` (empty: every one its capabilities list) within ``interpreted`` bounds under
    the Triton interpreter and ``native`` ones natively.

    examples / native_examples: (forward, backward) examples per dtype under the interpreter / natively, each
    scaled by SSDIFF_EXAMPLES_SCALE and capped by the hypothesis profile's max_examples; with
    ``grows_with_profile`` multiplied first by PROFILE_GROWTH's factor for the profile (gpu 5, nightly 20).
    configs: (under the interpreter, natively) how many autotune config indices are drawn (index i runs config
    i % n of a kernel with n); 1 is config 0 alone (natively "tuned" would benchmark, and so compile, every config
    of every kernel for each drawn shape). program_budget: under the interpreter, no case with more kernel
    programs (batch * nheads * chunks) than that (each program runs as Python there); None: no limit."""

    interpreted: Bounds
    native: Bounds
    entries: tuple = ()
    examples: tuple = (3, 2)
    native_examples: tuple = (6, 6)
    grows_with_profile: bool = False
    configs: tuple = (12, 2)
    program_budget: Optional[int] = 16


PROFILE_GROWTH = {"gpu": 5, "nightly": 20}


@dataclass(frozen=True)
class Pinned:
    """A regression case the generic property runs before it draws, under autotune config ``config``, narrowed to
    the implementation (what it cannot express switched off; left out where it still cannot run it or a known defect
    of the installed release explains it). It runs in its own pass and dtype; with ``every_pass`` in every pass and
    dtype the implementation is tested in (the case's own replaced); with ``last_dtype`` in the last dtype Triton
    kernels run in here (bfloat16 on a GPU, float16 under the interpreter) instead of its own."""

    case: Case
    config: int = 0
    every_pass: bool = False
    last_dtype: bool = False


# The upstream adapters' cases: tiny under the interpreter (each kernel program is Python), realistic on a GPU.
UPSTREAM = Domain(interpreted=Bounds(max_batch=2, max_seqlen=24, max_nheads=4, max_headdim=8, max_dstate=8,
                                     chunk_sizes=(8, 16)),
                  native=Bounds(max_batch=2, max_seqlen=300, max_nheads=12, max_headdim=72, max_dstate=72,
                                chunk_sizes=(16, 32, 64, 128)))
# Pure-torch code is fast anywhere: more examples under the interpreter, and no program budget (it has none).
PURE_TORCH = Domain(interpreted=UPSTREAM.interpreted, native=UPSTREAM.native, examples=(12, 12), program_budget=None)

# Every feature at once, run first in every pass and dtype whatever the example budget (narrowed to each
# implementation), under config 3.
EVERY_FEATURE = tuple(Pinned(case, config=3, every_pass=True) for case in (
    Case(batch=2, seqlen=20, nheads=4, ngroups=2, headdim=5, dstate=6, chunk_size=8, D="channel", has_z=True,
         dt_limit=(0.01, 2.0), initial_states=True, segments=((5, 12), (9, 8)), padding=(3, 3),
         regime=Regime(decay="typical", layout="strided"), seed=11),
    Case(batch=1, seqlen=19, nheads=3, ngroups=3, headdim=4, dstate=5, chunk_size=8, D="head", has_z=False,
         initial_states=True, segments=((10, 4, 3),), padding=(2,), seq_idx_start=0, varlen_states=True,
         regime=Regime(decay="mild", dt_large=True), seed=12),
    Case(entry="split_conv1d", batch=2, seqlen=20, nheads=4, ngroups=2, headdim=4, dstate=4, chunk_size=8,
         D="channel", rmsnorm=True, norm_before_gate=False, d_nonssm=2, out_dim=6, outproj_bias=True,
         initial_states=True, dt_limit=(0.001, 1.0), segments=((7, 13), (20,)), seed=13),
))


@dataclass(frozen=True)
class Testing:
    """How the generic property (properties/test_implementations.py) checks an implementation against the float64
    oracle: cases drawn from each of ``domains`` in turn (`Domain`), ``pinned`` regression cases run first
    (`Pinned`), and with ``stages`` the stage intermediates of forward cases judged as well (each against the
    oracle's stage with its own budget)."""

    domains: tuple = (UPSTREAM,)
    pinned: tuple = EVERY_FEATURE
    stages: bool = False


class Implementation:
    """Subclass and set ``name``, ``description``, ``capabilities`` (and ``testing`` where the default record does
    not suit it); write ``forward``."""

    name: str = ""
    description: str = ""
    capabilities: Capabilities = Capabilities()
    testing: Testing = Testing()
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
