"""Test support: what ssdiff's properties share, in one module of the package (``ssdiff.testing``), so that no test
module imports another and a kernel team's suite can use the same helpers.

Judging (through ssdiff.examine.Examiner, harness/verdict/judge.py's one definition of divergence):
    replay, examine, assert_agrees, agrees_with_oracle, expect_defect, whole_pass_known, known_defect
Which implementations, and whether one can run a pass here:
    DTYPES, implementations_under_test, generic_targets, usable
Cases through an implementation's testing record (harness/sides/base.py `Testing`, `Domain`, `Pinned`):
    bounds_of, bounds_here, entries_of, narrowed, fit_conv_channels, cases_for, drawn_for, pinned_cases,
    examples_of, configs_of
Fixed budgets of the other properties:
    examples, CONFIGS, ONE_CONFIG, SETTINGS, NO_SHRINK
A short seeded fuzz campaign's first finding (a planted bug found by a default campaign):
    found_by_campaign
Compile keys (natively under a profile that searches afresh, gpu and nightly, cases come from a few of them):
    KEYS, SEED, pooled, keys, runnable_by, cases_here, cases_from_keys
The oracles' own checks, as plain functions of a Case (so the teeth tests run the same checks on broken oracles):
    GRAD_RTOL, RTOL, ATOL, assert_close, oracles_agree, dt_on_its_bounds, run_on, and the metamorphic laws
    chunk_size_invariance, packed_equals_separate, state_continuation, group_broadcast, batch_independence,
    d_broadcast, padding_is_inert

Compile keys. Natively every new shape compiles every kernel it launches (seconds each, against a tenth of a
second to judge a case), so that 200 freely drawn examples a property would spend the run compiling. Under such a
profile a property draws each case from one of KEYS compile keys (harness/campaign/pool.py: a key fixes what the
kernels specialize on; seqlen within its class, the sequence layout, the values and the features a key does not
pin vary), the keys drawn once per run for each (label, dtype, pass) from the run's seed: SSDIFF_POOL_SEED, else
a fresh one every run, so that runs meet other keys. A failing example prints its whole case, which replays without
its key. The dev profile is derandomized natively instead (the same free draws every run, which a kept Triton cache
holds), and under the interpreter nothing compiles: both draw freely. SSDIFF_POOLED=1 (or 0) forces the choice. A
property that launches kernels as many times as the profile asks draws through `cases_here`, which makes that
choice (one that runs a handful of examples at any profile draws freely).
"""

from __future__ import annotations

import dataclasses
import os
import random
import zlib
from typing import Callable, Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, currently_in_test_context, note, settings
from hypothesis import strategies as st

from ssdiff import runtime

runtime.configure()                     # before any kernel module is imported

from ssdiff.model.case import Case  # noqa: E402
from ssdiff.model.features import without  # noqa: E402
from ssdiff.model.bounds import Bounds  # noqa: E402
from ssdiff.model.strategies import cases  # noqa: E402
from ssdiff.inputs import materialize  # noqa: E402
from ssdiff.truth import ORACLES, call, evaluate  # noqa: E402
from ssdiff.truth import mamba3 as mamba3_truth  # noqa: E402
from ssdiff.verdict.judge import Verdict  # noqa: E402
from ssdiff.sides.base import PROFILE_GROWTH, UPSTREAM, Domain, fit_case  # noqa: E402
from ssdiff.sides.registry import all_implementations, get  # noqa: E402
from ssdiff.examine import Examiner, Outcome  # noqa: E402
from ssdiff.registry import known  # noqa: E402
from ssdiff.campaign.pool import POOLED_ENTRIES, Mix, Pool  # noqa: E402
from ssdiff.tools.selfcheck import ATOL, RTOL, excess, relative  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")

# ---- judging: harness/verdict/judge.py through an Examiner ------------------------------------------------------


def replay(case: Case, choice: runtime.Choice = "tuned") -> str:
    """What replays ``case``: its JSON and the autotune choice."""
    return f"case: {case.to_json(indent=None)}\nautotune: {runtime.describe_choice(choice)}"


def examine(examiner: Examiner, case: Case, choice: runtime.Choice = "tuned", stages: bool = False) -> Outcome:
    """Examine ``case`` under autotune ``choice``, noting the case and the launches for replay (inside a
    hypothesis property)."""
    outcome = examiner.examine(case, choice, stages=stages)
    launched = sorted({f"{launch.kernel}#{launch.index}/{launch.nconfigs}" for side in outcome.launches.values()
                       for launch in side})
    if currently_in_test_context():     # elsewhere the assertion message carries the case
        note(f"{replay(case, choice)}; launches: {', '.join(launched) or 'none'}")
    return outcome


def assert_agrees(verdict: Verdict, case: Case, choice: runtime.Choice = "tuned", stages: bool = False):
    """The verdict passes (with ``stages``, every stage judged passes too); else its message (what differed, by
    how much against its budget) and the case."""
    assert verdict.ok, f"{verdict.message()}\n{replay(case, choice)}"
    if stages:
        bad = [t.message(verdict.impl) for t in verdict.tensors if t.kind == "stage" and not t.ok]
        assert not bad, "\n".join(bad) + f"\n{replay(case, choice)}"


def agrees_with_oracle(examiner: Examiner, case: Case, choice: runtime.Choice = "tuned",
                       stages: bool = False) -> Outcome:
    """Every side of ``examiner`` agrees with the float64 oracle on ``case`` (AssertionError naming the first
    that does not; with ``stages``, its stage intermediates too), but for a divergence a known defect that bounds
    its error accounts for (`known.explains`)."""
    outcome = examine(examiner, case, choice, stages=stages)
    for side, verdict in outcome.verdicts.items():
        defect = known.explanation(side, outcome)
        if defect is not None and defect.bounds(case):
            note(f"{side}: within known defect {defect.id}'s error: {verdict.message()}")
            continue
        assert_agrees(verdict, case, choice, stages)
    return outcome


def expect_defect(request, defect: known.KnownDefect):
    """Where the installed release has ``defect``, the test is a strict expected failure that only the
    divergence (an AssertionError) may satisfy: a precondition that does not hold fails outright (pytest.fail is
    not an AssertionError). On a fixed release the same assertion must pass."""
    if defect.affects(known.installed_version(defect.package)):
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError,
                                              reason=f"{defect.id}: {defect.statement}"))


def whole_pass_known(name: str, backward: bool, dtype: str) -> Optional[str]:
    """The id of a known defect of ``name``'s installed release that explains every case of this pass and dtype."""
    defect = known.whole_pass(name, backward, dtype)
    return defect.id if defect is not None else None


def known_defect(name: str, case: Case) -> Optional[str]:
    """The id of the known defect of ``name``'s installed release that explains ``case`` whatever diverges, or None
    (a record that bounds its error explains part of a verdict: its cases are judged, `agrees_with_oracle`)."""
    defect = known.matching(name, case)
    return defect.id if defect is not None and not defect.bounds(case) else None


# ---- which implementations -------------------------------------------------------------------------------

def generic_targets(config) -> list:
    """``--impl module:function`` (if a front end registers the option) or SSDIFF_IMPL (comma-separated)."""
    given_ = []
    try:
        option = config.getoption("--impl", default=None)
    except (ValueError, AttributeError):
        option = None
    for value in ([option] if isinstance(option, str) else (option or [])) + \
            os.environ.get("SSDIFF_IMPL", "").split(","):
        if value and ":" in value:
            given_.append(value.strip())
    return given_


def implementations_under_test(config) -> list:
    """Every registered implementation but the float64 oracles (``ref.*``, the truth itself), then the
    ``module:function`` targets given (`generic_targets`)."""
    return [impl.name for impl in all_implementations()
            if not impl.name.startswith("ref.") and ":" not in impl.name] + generic_targets(config)


def usable(name: str, dtype: str, backward: bool, device: str):
    """The implementation, or pytest.skip with the reason it cannot run this (dtype, pass) here."""
    impl = get(name)
    why = impl.unavailable()
    if why:
        pytest.skip(f"{name} unavailable: {why}")
    cap = impl.capabilities
    kind = torch.device(device).type
    if kind not in cap.devices:
        pytest.skip(f"{name} does not run on {kind} here (devices: {', '.join(sorted(cap.devices))})")
    if dtype not in cap.dtypes:
        pytest.skip(f"{name}: {runtime.dtype_skip_reason(dtype) or f'does not run {dtype}'}")
    if backward and not cap.backward:
        pytest.skip(f"{name} has no backward")
    why = impl.refuses(backward, device, dtype)
    if why:
        pytest.skip(why)
    return impl


# ---- cases through an implementation's testing record -------------------------------------------------------

def bounds_of(domain: Domain) -> Bounds:
    """The bounds ``domain`` draws within on this runtime."""
    return domain.interpreted if runtime.interpreted() else domain.native


def bounds_here() -> Bounds:
    """The upstream adapters' bounds: tiny shapes under the interpreter (each kernel program is Python),
    realistic ones on a GPU."""
    return bounds_of(UPSTREAM)


def fit_conv_channels(case: Case, bounds: Bounds) -> Case:
    """The nearest (headdim, dstate) with (dim + 2*ngroups*dstate) % 8 == 0 (causal_conv1d's layout)."""
    if case.conv_channels % 8 == 0:
        return case
    pairs = [(p, n) for p in range(1, bounds.max_headdim + 1) for n in range(1, bounds.max_dstate + 1)
             if (case.nheads * p + 2 * case.ngroups * n) % 8 == 0]
    if not pairs:
        return case
    p, n = min(pairs, key=lambda pn: (abs(pn[0] - case.headdim) + abs(pn[1] - case.dstate), pn))
    return case.replace(headdim=p, dstate=n)


def _domain_of(impl, domain: Optional[Domain]) -> Domain:
    return domain if domain is not None else impl.testing.domains[0]


def entries_of(impl, domain: Domain) -> list:
    """The entry points ``domain`` draws for ``impl``: its own that the implementation takes (all it takes when
    the domain names none)."""
    taken = sorted(impl.capabilities.entries)
    return [e for e in domain.entries if e in taken] if domain.entries else taken


def narrowed(impl, case: Case, device: str, domain: Optional[Domain] = None, where=None,
             explained: Optional[dict] = None) -> Optional[Case]:
    """``case`` narrowed to what ``impl`` can run on ``device`` (what it cannot express switched off, then
    ``where``; where a size limit refuses it, the nearest size it takes), or None where it still cannot run it, it
    has more kernel programs than ``domain`` (default: the record's first) allows under the interpreter, or a known
    defect of the installed release explains it. ``explained``, when given, counts what became of the cases that
    ``impl`` can run: known defect id -> cases it explains, None -> cases kept."""
    domain = _domain_of(impl, domain)
    case = without(case, impl.capabilities.unsupported)
    if where is not None:
        case = where(case)
    if impl.skip_reason(case, device) is not None:
        fitted = fit_conv_channels(case, bounds_of(domain)) if case.entry == "split_conv1d" else \
            fit_case(case, [impl], device)
        if fitted is None or fitted.backward != case.backward:
            return None
        case = fitted
    if runtime.interpreted() and domain.program_budget is not None and \
            case.batch * case.nheads * case.nchunks > domain.program_budget:
        return None
    if impl.skip_reason(case, device) is not None:
        return None
    defect = known_defect(impl.name, case)
    if explained is not None:
        explained[defect] = explained.get(defect, 0) + 1
    return None if defect is not None else case


@st.composite
def cases_for(draw, impl, dtype: str, backward: bool, device: str, where=None, domain: Optional[Domain] = None,
              explained: Optional[dict] = None):
    """A case ``impl`` can run on ``device``, from ``domain`` of its testing record (default: the first): drawn
    from ssdiff.model.strategies (natively under the gpu and nightly profiles, from the run's compile keys for
    ``impl`` and the domain: `cases_here`), narrowed to its capabilities, and none that a known defect of the
    installed release explains (``explained`` as for `narrowed`)."""
    domain = _domain_of(impl, domain)
    index = impl.testing.domains.index(domain) if domain in impl.testing.domains else "custom"
    label = impl.name if index == 0 else f"{impl.name}#{index}"
    if where is not None:
        label += ", narrowed"                                                  # a ``where`` fits keys of its own
    fit = lambda case: narrowed(impl, case, device, domain, where)             # noqa: E731
    case = narrowed(impl, draw(cases_here(label, entries_of(impl, domain), (dtype,), backward, bounds_of(domain), fit)),
                    device, domain, where, explained)
    assume(case is not None)
    return case


def drawn_for(impl, dtype: str, backward: bool, device: str, explained: Optional[dict] = None):
    """(the number of examples, a strategy of (case, autotune config)) for the generic property: every domain of
    ``impl``'s testing record that draws in this pass here, chosen in proportion to its examples (`examples_of`),
    the case from it (`cases_for`) and the config from its configs (`configs_of`); the number is their sum, capped
    by the profile. (0, None) where no domain draws."""
    weighted = [(domain, examples_of(domain, backward)) for domain in impl.testing.domains if entries_of(impl, domain)]
    weighted = [(domain, n) for domain, n in weighted if n > 0]
    if not weighted:
        return 0, None
    choices = [domain for domain, n in weighted for _ in range(n)]
    total = min(len(choices), settings.default.max_examples)
    return total, st.sampled_from(choices).flatmap(lambda domain: st.tuples(
        cases_for(impl, dtype, backward, device, domain=domain, explained=explained), configs_of(domain)))


def pinned_cases(impl, dtype: str, backward: bool, device: str) -> list:
    """(case, autotune config) of each pinned case of ``impl``'s testing record for this pass and dtype (its own,
    or every pass's with the pass and dtype replaced), narrowed to ``impl`` as `narrowed` does (no program budget:
    a pinned case runs whatever its size), none a known defect explains."""
    out = []
    pass_ = "backward" if backward else "forward"
    first = dataclasses.replace(impl.testing.domains[0], program_budget=None) if impl.testing.domains else \
        dataclasses.replace(UPSTREAM, program_budget=None)
    for pin in impl.testing.pinned:
        case = pin.case
        if case.entry not in impl.capabilities.entries:
            continue
        if pin.every_pass:
            if backward and case.varlen_states:
                continue
            case = case.replace(dtype=dtype, pass_=pass_, final_state_grad=backward and case.return_final_states)
        else:
            own = runtime.runnable_dtypes()[-1] if pin.last_dtype else case.dtype
            if case.backward != backward or own != dtype:
                continue
            case = case.replace(dtype=own)
        case = narrowed(impl, case, device, first)
        if case is not None:
            out.append((case, pin.config))
    return out


def _scaled(n: int) -> int:
    """``n`` scaled by SSDIFF_EXAMPLES_SCALE (at least 1), capped by the loaded hypothesis profile."""
    n = max(1, int(round(n * float(os.environ.get("SSDIFF_EXAMPLES_SCALE", "1")))))
    return min(n, settings.default.max_examples)


def examples_of(domain: Domain, backward: bool) -> int:
    """How many examples ``domain`` draws in this pass here (0: none): its count for the runtime, grown with the
    profile where it says so, scaled by SSDIFF_EXAMPLES_SCALE and capped by the profile (harness/sides/base.py)."""
    n = (domain.examples if runtime.interpreted() else domain.native_examples)[1 if backward else 0]
    if n <= 0:
        return 0
    if domain.grows_with_profile:
        n *= PROFILE_GROWTH.get(settings._current_profile, 1)
    return _scaled(n)


def configs_of(domain: Domain):
    """The autotune config indices ``domain`` draws here (index i runs config i % n of each kernel with n)."""
    n = domain.configs[0 if runtime.interpreted() else 1]
    return st.integers(0, max(1, n) - 1)


# ---- fixed budgets of the other properties --------------------------------------------------------------------

# Every autotuned kernel runs config (index % its count): drawn, so examples spread over configs and a failure
# names its config. mamba_ssm kernels have at most 11 configs. Interpreted, a config costs nothing; on a GPU each
# one is another compile of every kernel, so properties draw from two and a sweep test runs them all on one case.
CONFIGS = st.integers(0, 11) if runtime.interpreted() else st.integers(0, 1)
# A property that judges a case without drawing its config runs config 0 (what "tuned" is under the interpreter):
# natively "tuned" benchmarks every config of every kernel, a compile of each, for every drawn shape (fla's
# activation kernels have 30 per width).
ONE_CONFIG = 0


def examples(cpu: int, gpu: int) -> int:
    """Examples per property: a CPU (interpreter) or GPU budget, scaled by SSDIFF_EXAMPLES_SCALE, capped by
    the loaded hypothesis profile (so the dev profile stays quick and nightly can scale up)."""
    return _scaled(cpu if runtime.interpreted() else gpu)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                      HealthCheck.data_too_large])
# Expected failures: finding the first failing example is the point, shrinking it would only cost minutes.
NO_SHRINK = dict(SETTINGS, phases=[Phase.explicit, Phase.reuse, Phase.generate])


# ---- compile keys -------------------------------------------------------------------------------------------

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
    freely (ssdiff.model.strategies.cases). The one way a property that launches kernels at the profile's example
    count draws its cases."""
    if pooled() and set(entries) <= POOLED_ENTRIES:        # the entries a pool has keys for (not mamba3)
        return cases_from_keys(label, entries, dtypes, backward, bounds, fit)
    return st.sampled_from(tuple(entries)).flatmap(
        lambda entry: cases(entry=entry, dtypes=tuple(dtypes), bounds=bounds, backward=backward))


def cases_from_keys(label: str, entries: Sequence[str], dtypes: Sequence[str], backward: Optional[bool],
                    bounds: Bounds, fit: Optional[Callable] = None, seed: Optional[int] = None):
    """A strategy: a case of one of the run's keys (`keys`) for ``label``, in one of ``dtypes``."""
    return st.sampled_from(tuple(dtypes)).flatmap(
        lambda dtype: st.sampled_from(keys(label, entries, dtype, backward, bounds, fit, seed)).flatmap(
            lambda key: cases(key=key, bounds=bounds, backward=backward)))


# ---- campaigns ----------------------------------------------------------------------------------------------

def found_by_campaign(spec: str, out_dir, device: str, entry: str, bounds: Bounds, max_examples: int = 100,
                      seed: int = 3, **config):
    """The first finding of a short fuzz campaign of ``spec`` against the oracle on ``entry`` within ``bounds``
    (seeded, not minimized; ``config``: more FuzzConfig fields), and the campaign's report; AssertionError naming
    how many cases it tried when it finds nothing."""
    from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer

    fuzz = FuzzConfig(impl=spec, entry=entry, out_dir=str(out_dir), device=device, report_dir=None, max_time=None,
                      max_examples=max_examples, seed=seed, minimize=config.pop("minimize", False), bounds=bounds,
                      **config)
    report = Fuzzer(fuzz).run()
    assert report.exit_code == 1, f"{spec}: nothing found in {report.tried} cases ({report.stopped})"
    return report.findings[0], report


# ---- the oracles' own checks --------------------------------------------------------------------------------

# Outputs and stages: rtol 1e-10 (float64 orders agree to ~1e-15). Gradients of A and dt_bias are sums over
# every token of terms that cancel (decay-free heads with dt > 20 give dL/dA ~ 20 from terms ~ 1e3), so they
# get rtol 1e-8: measured worst 3e-9 over 1,500 generated cases.
GRAD_RTOL = 1e-8


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, case: Case):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    over = excess(actual, expected, rtol, ATOL)
    assert over <= 1.0, (f"{name}: relative difference {relative(actual, expected):.3e}, {over:.3g}x the allowed "
                         f"(rtol {rtol:g}, atol {ATOL:g}) on {case.describe()}")


def oracles_agree(case: Case, device: str, inputs=None):
    """Every oracle matches ref.recurrent on every output, gradient and stage (on ``inputs``, else the case's
    own)."""
    inputs = materialize(case, device) if inputs is None else inputs
    base = evaluate(case, inputs, "ref.recurrent")
    for name in ORACLES:
        if name == "ref.recurrent":
            continue
        other = evaluate(case, inputs, name)
        assert set(other.outputs) == set(base.outputs), f"{name}: outputs {set(other.outputs)} != {set(base.outputs)}"
        for key, value in base.outputs.items():
            assert_close(f"{name} output {key}", other.outputs[key], value, RTOL, case)
        for key, value in base.stages.items():
            assert_close(f"{name} stage {key}", other.stages[key], value, RTOL, case)
        for key, value in base.grads.items():
            assert_close(f"{name} grad {key}", other.grads[key], value, GRAD_RTOL, case)


def dt_on_its_bounds(case: Case, device: str):
    """The case's inputs with some dt exactly on each bound of dt_limit (several chunks, every head), and the mask
    of those tokens: where a clamp's gradient convention shows (torch.clamp passes the gradient on a bound,
    torch.minimum / torch.maximum halve it). ``case`` has dt_limit, no dt_bias and no softplus, so that dt is
    the clamp's input."""
    assert case.dt_limit is not None and not case.has_dt_bias and not case.dt_softplus, case.describe()
    inputs = materialize(case, device)
    dt = inputs.values["dt"].clone()
    low, high = case.dt_limit
    dt[:, 3::5], dt[:, 2::7] = high, low
    values = dict(inputs.values, dt=dt)
    return dataclasses.replace(inputs, values=values), (dt == high) | (dt == low)


def run_on(name: str, case: Case, tensors: dict, seq_idx=None):
    """Oracle ``name`` on explicit float64 tensors (for laws that edit inputs)."""
    return call(name, case, tensors, seq_idx)


# ---- metamorphic laws: each holds for every oracle ---------------------------------------------------------

TOKEN_TENSORS = {"chunk_scan": ("x", "dt", "B", "C", "z"), "split_conv1d": ("zxbcdt",),
                 "mamba3": ("q", "k", "v", "dt", "adt", "trap", "angles", "z")}


def forward_only(case: Case, **changes) -> Case:
    return case.replace(pass_="forward", final_state_grad=False, **changes)


def slice_tokens(case: Case, tensors: dict, row: int, start: int, end: int, keep_initial: bool) -> dict:
    """The inputs of batch row ``row``, tokens [start, end), as a batch-1 problem."""
    out = {}
    for name, t in tensors.items():
        if name in TOKEN_TENSORS[case.entry]:
            out[name] = t[row:row + 1, start:end]
        elif name == "initial_states":
            if keep_initial:
                out[name] = t[row:row + 1]
        else:
            out[name] = t
    return out


def chunk_size_invariance(case: Case, device: str, other_chunk_size: int):
    """Outputs and gradients do not depend on the chunk size."""
    inputs = materialize(case, device)
    other = case.replace(chunk_size=other_chunk_size)
    for name in ORACLES:
        a, b = evaluate(case, inputs, name), evaluate(other, inputs, name)
        for key in a.outputs:
            assert_close(f"{name} {key} at chunk_size {other_chunk_size}", b.outputs[key], a.outputs[key], RTOL, case)
        for key in a.grads:
            assert_close(f"{name} grad {key} at chunk_size {other_chunk_size}", b.grads[key], a.grads[key],
                         GRAD_RTOL, case)


def packed_equals_separate(case: Case, device: str):
    """Sequences packed with seq_idx give the outputs (and end states) of each sequence run alone; an empty
    sequence's end state is the state it starts from, and a gap's tokens belong to no sequence."""
    case = forward_only(case)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    for name in ORACLES:
        packed = call(name, case, tensors, inputs.seq_idx)
        ends = []
        for row, lengths in enumerate(case.segments):
            start = 0
            gaps = (0, *case.gaps[row]) if case.gaps is not None else (0,) * len(lengths)
            row_ends = []
            for k, (n, gap) in enumerate(zip(lengths, gaps)):
                start += gap
                first = case.seq_idx_start + k == 0 and case.initial_states
                if n == 0:
                    h0 = tensors.get("initial_states")
                    row_ends.append(h0[row] if first else torch.zeros(case.nheads, case.headdim, case.dstate,
                                                                        dtype=torch.float64, device=device))
                    continue
                alone_case = case.replace(batch=1, seqlen=n, segments=None, padding=None, gaps=None, seq_idx_start=0,
                                          varlen_states=False, initial_states=first)
                alone = call(name, alone_case, slice_tokens(case, tensors, row, start, start + n, first), None)
                assert_close(f"{name} y of row {row} sequence {k} (tokens {start}:{start + n}) packed vs alone",
                             packed.y[row:row + 1, start:start + n], alone.y, RTOL, case)
                row_ends.append(alone.final_states[0])
                last_real = alone.final_states[0]
                start += n
            if inputs.seq_idx[row, -1] >= 0:
                assert_close(f"{name} final state of row {row} packed vs its last non-empty sequence alone",
                             packed.final_states[row], last_real, RTOL, case)
            ends.extend(row_ends)
        if case.batch == 1 and case.entry == "chunk_scan" and packed.varlen_states is not None:
            assert_close(f"{name} varlen states vs each sequence alone", packed.varlen_states, torch.stack(ends),
                         RTOL, case)


# What a split run hands on, per entry: (the input state of the second part, the first part's output it takes).
CARRIED = {"chunk_scan": (("initial_states", "final_states"),),
           "mamba3": tuple(zip(mamba3_truth.STATE_INPUTS, mamba3_truth.STATE_OUTPUTS))}


def state_continuation(case: Case, device: str, split: int):
    """Running [0, split) then [split, L) from the first part's final states equals one run (chunk_scan; mamba3:
    all four states, the prefill-then-decode consistency of each order — the recurrent one steps)."""
    case = forward_only(case, return_final_states=True)
    if case.entry == "mamba3":
        case = case.replace(mamba3_steps=0)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    tokens, carried = TOKEN_TENSORS[case.entry], CARRIED[case.entry]
    first_case = case.replace(seqlen=split)
    second_case = case.replace(seqlen=case.seqlen - split, initial_states=True)
    for name in ORACLES:
        whole = call(name, case, tensors, None)
        first_part = {k: (v[:, :split] if k in tokens else v) for k, v in tensors.items()}
        second_part = {k: (v[:, split:] if k in tokens else v) for k, v in tensors.items()}
        first = call(name, first_case, first_part, None)
        second_part.update({state: first.outputs[final] for state, final in carried})
        second = call(name, second_case, second_part, None)
        assert_close(f"{name} y split at {split}", torch.cat([first.y, second.y], dim=1), whole.y, RTOL, case)
        for _, final in carried:
            assert_close(f"{name} {final} split at {split}", second.outputs[final], whole.outputs[final], RTOL, case)


def group_broadcast(case: Case, device: str):
    """ngroups = g equals ngroups = nheads with B and C repeat-interleaved to every head (chunk_scan)."""
    case = forward_only(case)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    per_head = dict(tensors)
    for key in ("B", "C"):
        per_head[key] = tensors[key].repeat_interleave(case.heads_per_group, dim=2)
    for name in ORACLES:
        grouped = call(name, case, tensors, inputs.seq_idx)
        expanded = call(name, case.replace(ngroups=case.nheads), per_head, inputs.seq_idx)
        assert_close(f"{name} y with ngroups={case.ngroups} vs expanded", expanded.y, grouped.y, RTOL, case)
        assert_close(f"{name} final states with ngroups={case.ngroups} vs expanded", expanded.final_states,
                     grouped.final_states, RTOL, case)


def batch_independence(case: Case, device: str):
    """Each batch row computed alone equals its row of the batched run."""
    case = forward_only(case, varlen_states=False)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    for name in ORACLES:
        batched = call(name, case, tensors, inputs.seq_idx)
        for row in range(case.batch):
            row_case = case.replace(batch=1, **case.row_layout(row))
            alone = call(name, row_case, slice_tokens(case, tensors, row, 0, case.seqlen, case.initial_states),
                         None if inputs.seq_idx is None else inputs.seq_idx[row:row + 1])
            assert_close(f"{name} row {row} alone vs batched", alone.y, batched.y[row:row + 1], RTOL, case)
            assert_close(f"{name} final state of row {row} alone vs batched", alone.final_states,
                         batched.final_states[row:row + 1], RTOL, case)


def d_broadcast(case: Case, device: str):
    """D of shape (h,) equals D of shape (h, p) holding the same value on every channel."""
    case = forward_only(case, D="head")
    inputs = materialize(case, device)
    tensors = inputs.float64()
    per_channel = dict(tensors, D=tensors["D"][:, None].expand(case.nheads, case.headdim).contiguous())
    for name in ORACLES:
        a = call(name, case, tensors, inputs.seq_idx)
        b = call(name, case.replace(D="channel"), per_channel, inputs.seq_idx)
        assert_close(f"{name} y with D (h,) vs D (h, p)", b.y, a.y, RTOL, case)


def padding_is_inert(case: Case, device: str, noise_seed: int):
    """Changing the inputs of padding tokens (seq_idx = -1) changes nothing but their own outputs."""
    case = forward_only(case)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    pad_mask = (inputs.seq_idx < 0)                                   # (b, L)
    gen = torch.Generator().manual_seed(noise_seed)
    noisy = dict(tensors)
    for key in TOKEN_TENSORS[case.entry]:
        if key in tensors:
            t = tensors[key]
            noise = torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) * 3   # same on any device
            m = pad_mask.reshape(pad_mask.shape + (1,) * (t.dim() - 2))
            noisy[key] = torch.where(m, t + noise, t)
    keep = ~pad_mask
    for name in ORACLES:
        a = call(name, case, tensors, inputs.seq_idx)
        b = call(name, case, noisy, inputs.seq_idx)
        assert_close(f"{name} y of real tokens after changing padding tokens", b.y[keep], a.y[keep], RTOL, case)
        assert_close(f"{name} final states after changing padding tokens", b.final_states, a.final_states, RTOL, case)
        if a.varlen_states is not None:
            assert_close(f"{name} varlen states after changing padding tokens", b.varlen_states, a.varlen_states,
                         RTOL, case)
