"""Upstream implementations (mamba_ssm, fla simple_gla, any ``module:function``): what the one generic property
(test_implementations.py, which checks every implementation against the float64 oracle on generated cases) does
not.

What this file checks:
- state-spaces/mamba#647 (seed 000): on its domain the fused mixer and its reference disagree, the oracle
  agrees with the fused mixer and the reference diverges;
- every record of harness/registry/known.py: its example satisfies its predicate and, on an affected release, diverges
  (a strict expected failure; on a fixed release it must agree), and a case a record explains is run and judged,
  not skipped as outside a capability; a record that bounds its error explains no more than that;
- mamba_chunk_scan_combined under every config of every kernel, with another SM count, and stage by stage;
- the generic ``module:function`` adapter, capability skips with their reasons, stand-in notes, ``ssdiff list``,
  and other mamba_ssm releases (each in a child process, running this file and the generic property).

Divergence has one definition: harness/verdict/judge.py's `judge`, through ssdiff.examine.Examiner (the budget is a
multiple of a same-precision baseline's error; padding outputs and elements beyond the dtype's range are not
judged; dtypes are checked). No tolerance lives here. Runs on the CPU under the Triton interpreter (tiny shapes) or
natively on a GPU (``--device cuda``; bf16 and fla.chunk_simple_gla there).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from ssdiff import runtime

runtime.configure()                     # before any kernel module is imported

from ssdiff.sides import upstream  # noqa: E402
from ssdiff.registry import known  # noqa: E402
from ssdiff.model.case import Case, Regime  # noqa: E402
from ssdiff.model.evaluation import Evaluation  # noqa: E402
from ssdiff.examine import Examiner, Outcome  # noqa: E402
from ssdiff.model.features import without  # noqa: E402
from ssdiff.sides.base import UPSTREAM  # noqa: E402
from ssdiff.sides.registry import all_implementations, get  # noqa: E402
from ssdiff.sides.adapters.generic import CallableImplementation  # noqa: E402
from ssdiff.inputs import materialize  # noqa: E402
from ssdiff.model.strategies import cases  # noqa: E402
from ssdiff.verdict.judge import judge  # noqa: E402
from ssdiff.testing import (CONFIGS, DTYPES, NO_SHRINK, ONE_CONFIG, SETTINGS, agrees_with_oracle,  # noqa: E402
                            assert_agrees, bounds_here, examine, examples, expect_defect, fit_conv_channels, replay,
                            usable)

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_PREFIXES = ("mamba_ssm.", "fla.")


def upstream_names() -> list:
    """The registered upstream adapters (``module:function`` targets, registered on first use, are not)."""
    return [impl.name for impl in all_implementations()
            if impl.name.startswith(UPSTREAM_PREFIXES) and ":" not in impl.name]


# ---- seed 000: state-spaces/mamba issue #647 --------------------------------------------------------------

SEED_647_DEFECT = known.BY_ID["mamba-ref-norm-over-whole-dim"]
COMBINED, REF = "mamba_ssm.split_conv1d_combined", "mamba_ssm.split_conv1d_ref"


def seed_647_cases(device: str):
    """split_conv1d cases in #647's domain (ngroups > 1 with the gated RMSNorm) that both sides can run."""
    ref = get(REF)
    bounds = bounds_here()

    @st.composite
    def build(draw):
        case = draw(cases(entry="split_conv1d", dtypes=("float32",), bounds=bounds, backward=False))
        nheads = max(2, case.nheads - case.nheads % 2)
        ngroups = draw(st.sampled_from([g for g in range(2, nheads + 1) if nheads % g == 0]))
        case = without(case.replace(nheads=nheads, ngroups=ngroups, rmsnorm=True), ref.capabilities.unsupported)
        case = fit_conv_channels(case, bounds)
        if runtime.interpreted():
            assume(case.batch * case.nheads * case.nchunks <= UPSTREAM.program_budget)
        assume(ref.skip_reason(case, device) is None and get(COMBINED).skip_reason(case, device) is None)
        if not SEED_647_DEFECT.applies(case):
            raise AssertionError(f"not in #647's domain: {case.describe()}")   # the builder's own bug
        assume(known.matching(COMBINED, case) is None)
        return case

    return build()


SEED_647 = Case(entry="split_conv1d", batch=1, seqlen=16, nheads=4, ngroups=2, headdim=4, dstate=4, chunk_size=8,
                rmsnorm=True, regime=Regime(decay="typical"))


def _split_pair(device) -> Examiner:
    usable(COMBINED, "float32", False, device)
    usable(REF, "float32", False, device)
    return Examiner([COMBINED, REF], device)


def test_seed_647_split_conv1d_combined_vs_ref(device, request):
    """On #647's domain the fused mixer and its reference agree within their joint budget — except where the
    release has #647 (strict expected failure)."""
    examiner = _split_pair(device)
    expect_defect(request, SEED_647_DEFECT)

    @settings(max_examples=examples(cpu=3, gpu=4), **NO_SHRINK)
    @given(case=seed_647_cases(device))
    def combined_equals_ref(case):
        pair = examine(examiner, case).pair
        if not pair:
            pytest.fail(f"no pair to compare: a side did not run on {case.describe()}")
        apart = {name: ratio for name, ratio in pair.items() if not ratio <= 1.0}
        assert not apart, (f"{COMBINED} and {REF} disagree beyond their joint budget (ratio per tensor): {apart}\n"
                           f"{replay(case)}")

    combined_equals_ref()


def test_seed_647_split_conv1d_ref_vs_oracle(device, request):
    """The reference diverges from the oracle on #647's domain (strict expected failure where the release has
    #647)."""
    examiner = _split_pair(device)
    expect_defect(request, SEED_647_DEFECT)

    @settings(max_examples=examples(cpu=3, gpu=4), **NO_SHRINK)
    @given(case=seed_647_cases(device))
    def ref_agrees(case):
        assert_agrees(examine(examiner, case).verdicts[REF], case)

    ref_agrees()


def test_seed_647_oracle_agrees_with_combined(device):
    """On #647's domain the fused kernel is the correct side: it matches the float64 oracle."""
    examiner = _split_pair(device)

    @settings(max_examples=examples(cpu=3, gpu=4), **SETTINGS)
    @given(case=seed_647_cases(device), config=CONFIGS)
    @example(case=SEED_647, config=0)
    def combined_agrees(case, config):
        outcome = examiner.examine(case, config, sides=[COMBINED])
        assert_agrees(outcome.verdicts[COMBINED], case, config)

    combined_agrees()


# ---- known upstream defects (harness/registry/known.py) -----------------------------------------------------------

def release_lacks(impl, case: Case) -> Optional[str]:
    """The installed mamba_ssm release has no such feature (varlen states, seq_idx = -1 padding): why, or None."""
    if not impl.name.startswith("mamba_ssm.") or upstream.mamba_ssm_problem():
        return None
    rel = upstream.mamba_ssm()
    if case.varlen_states and not rel.varlen_states:
        return f"{rel.label} has no varlen_states"
    if case.padding and any(case.padding):
        return rel.padding_reason()
    return None


def not_here(impl, case: Case, device: str) -> Optional[str]:
    """Why ``case`` cannot run here for a reason of this environment — the implementation unavailable, a dtype
    or device this runtime does not run, a refused pass, a feature the installed release lacks — or None."""
    why = impl.unavailable() or impl.refuses(case.backward, device, case.dtype)
    if why:
        return why
    cap = impl.capabilities
    if case.dtype not in cap.dtypes or (not getattr(impl, "pure_torch", False)
                                        and runtime.dtype_skip_reason(case.dtype)):
        return f"{impl.name}: {runtime.dtype_skip_reason(case.dtype) or f'does not run {case.dtype} here'}"
    if torch.device(device).type not in cap.devices:
        return impl.skip_reason(case, device)
    return release_lacks(impl, case)


def defect_sides(defect: known.KnownDefect, case: Case, device: str) -> list:
    """The implementations of ``defect`` that take ``case``'s entry point and can run it here. Skips when none
    can for a reason of this environment; fails outright when a case of the record lies outside a capability."""
    sides = [name for name in defect.implementations if case.entry in get(name).capabilities.entries]
    if not sides:
        pytest.fail(f"{defect.id}: none of {', '.join(defect.implementations)} implements {case.entry!r}")
    runnable, why_not = [], []
    for name in sides:
        impl = get(name)
        why = impl.skip_reason(case, device)
        if why is None:
            runnable.append(name)
            continue
        here = not_here(impl, case, device)
        if here is None:
            pytest.fail(f"{defect.id}: {name} declares its case outside its capabilities ({why}); a known "
                        f"defect's case must be run and judged\n{replay(case)}")
        why_not.append(here)
    if not runnable:
        pytest.skip("; ".join(why_not))
    return runnable


def skip_where_not_measured(defect: known.KnownDefect, device: str):
    """pytest.skip where ``defect``'s example is not measured to diverge on ``device``'s type (its example_devices)."""
    if defect.example_devices and device.split(":")[0] not in defect.example_devices:
        pytest.skip(f"{defect.id}: its example is measured to diverge on {', '.join(defect.example_devices)} only "
                    f"(a numerical defect whose size follows the device's order of operations)")


def reproduces(defect: known.KnownDefect, case: Case, device: str, request, choice: runtime.Choice = "tuned"):
    """``case`` satisfies ``defect``'s predicate (a precondition: pytest.fail) and every implementation of it
    that runs here agrees with the oracle under autotune ``choice`` — which, on an affected release, must fail
    (strict xfail)."""
    if not defect.applies(case):
        pytest.fail(f"{defect.id}: its predicate does not hold for {case.describe()}")
    sides = defect_sides(defect, case, device)
    expect_defect(request, defect)
    with Examiner(sides, device) as examiner:
        outcome = examine(examiner, case, choice)
    for side, verdict in outcome.verdicts.items():
        if not verdict.ok and not known.explains(defect, side, outcome):
            pytest.fail(f"{defect.id}: {side}'s divergence is more than the record accounts for: "
                        f"{verdict.message()}\n{replay(case, choice)}")
    for verdict in outcome.verdicts.values():
        assert_agrees(verdict, case, choice)


@pytest.mark.parametrize("defect", known.DEFECTS, ids=lambda d: d.id)
def test_known_defect_reproduces(defect, device, request):
    """Each record's example diverges from the oracle on an affected release and agrees on a fixed one."""
    skip_where_not_measured(defect, device)
    reproduces(defect, defect.example, device, request, defect.example_choice)


# A CPU campaign's divergence of ssd_minimal_discrete (grad A 1.67x, mild decay, float16; none smaller diverges)
MILD_CHUNK_SUM_CASE = Case(batch=2, seqlen=12, nheads=1, headdim=6, ngroups=1, dstate=7, chunk_size=4,
                           dtype="float16", D="none", has_dt_bias=False, dt_softplus=False, initial_states=True,
                           return_final_states=False, regime=Regime(decay="mild", scale=4.0), pass_="backward",
                           seed=1330)

# Cases of a record its example does not cover: another variant of the defect, another implementation, another
# regime of its predicate.
PREDICATE_CASES = [
    pytest.param("mamba-swiglu-backward-without-out-proj",
                 Case(entry="layer", seqlen=8, nheads=2, headdim=4, dstate=4, chunk_size=8, d_nonssm=2, d_model=10,
                      return_final_states=False, rmsnorm_eps=1e-5, pass_="backward"),
                 id="swiglu-backward-through-the-mamba2-layer"),
    pytest.param("mamba-softplus-backward-nan-above-20",
                 Case(entry="layer", seqlen=4, nheads=1, headdim=2, dstate=11, chunk_size=4, conv_width=1, d_model=2,
                      return_final_states=False, rmsnorm_eps=1e-5, regime=Regime(decay="typical", dt_large=True),
                      pass_="backward"),
                 id="softplus-nan-through-the-mamba2-layers"),
    pytest.param("mamba-swiglu-backward-without-out-proj",
                 Case(entry="split_conv1d", seqlen=8, nheads=2, headdim=4, dstate=4, chunk_size=8, d_nonssm=2,
                      out_dim=3, pass_="backward"),
                 id="swiglu-out-proj-without-rmsnorm"),
    pytest.param("mamba-final-state-gradient-into-padding",
                 Case(entry="split_conv1d", seqlen=16, nheads=2, headdim=4, dstate=4, chunk_size=8,
                      segments=((6, 7),), padding=(3,), pass_="backward", final_state_grad=True, seed=3),
                 id="final-state-gradient-into-padding-of-the-mixer"),
    pytest.param("mamba-chunk-scan-ref-nan-gradients",
                 Case(seqlen=80, nheads=1, headdim=1, ngroups=1, dstate=1, chunk_size=16, D="head",
                      has_dt_bias=False, dt_softplus=False, return_final_states=False,
                      regime=Regime(decay="typical"), pass_="backward", seed=0),
                 id="chunk-scan-ref-long-row-at-typical-decay"),
    pytest.param("mamba-ssd-minimal-grad-A-strong-decay",
                 Case(seqlen=8, nheads=1, headdim=1, ngroups=1, dstate=1, chunk_size=8, D="none", has_dt_bias=False,
                      dt_softplus=False, final_state_grad=True, regime=Regime(decay="typical", dt_large=True),
                      pass_="backward", seed=3),
                 id="ssd-minimal-grad-A-with-dt-above-20"),
    pytest.param("mamba-ssd-minimal-half-precision-chunk-sum", MILD_CHUNK_SUM_CASE,
                 marks=pytest.mark.interpreter(reason="measured on the CPU only (at 1.67x its budget); a GPU's torch "
                                                      "may sum half precision in another order"),
                 id="ssd-minimal-grad-A-at-mild-decay-fp16"),
    pytest.param("mamba-ssd-minimal-half-precision-chunk-sum",
                 Case(seqlen=4, nheads=4, headdim=1, ngroups=1, dstate=1, chunk_size=4, dtype="float16", D="none",
                      has_dt_bias=False, dt_softplus=False, return_final_states=False,
                      regime=Regime(decay="none", scale=4.0), pass_="backward", seed=996),
                 marks=pytest.mark.interpreter(reason="measured on the CPU only (at 1.38x its budget); a GPU's torch "
                                                      "may sum half precision in another order"),
                 id="ssd-minimal-grad-A-without-decay-fp16"),
    pytest.param("mamba-chunk-scan-unstable-ddA",
                 Case(seqlen=16, nheads=2, headdim=4, dstate=4, chunk_size=16, return_final_states=False,
                      regime=Regime(decay="strong"), pass_="backward", seed=1),
                 id="chunk-scan-strong-decay-fp32"),
]


@pytest.mark.parametrize("defect_id, case", PREDICATE_CASES)
def test_known_defect_predicate_covers(defect_id, case, device, request):
    """Each extra case satisfies its record's predicate and diverges where the release is affected (on the device
    types its record's example is measured to diverge on)."""
    defect = known.BY_ID[defect_id]
    skip_where_not_measured(defect, device)
    reproduces(defect, case, device, request)


# fla's fused recurrent kernel, token by token, on the CPU: a long memory (no decay, dt' clamped to 0.05), its final
# state 1.51x out of the chunked model's budget (0.40x in the token order's); integer values whose own-token product
# is exact while the state it is added to rounds, y 2.59x (2.08x against the chunked model at chunk size 1, which
# reads that product apart; 0.15x in the token order's).
LONG_MEMORY_CASE = Case(seqlen=32, nheads=2, headdim=1, ngroups=2, dstate=3, chunk_size=8, D="none", has_z=False,
                        has_dt_bias=False, dt_softplus=False, dt_limit=(0.0, 0.05), initial_states=True,
                        regime=Regime(decay="none", dt_large=True, values="integer"), seed=0)
OWN_TOKEN_CASE = Case(batch=2, seqlen=17, nheads=2, headdim=8, ngroups=2, dstate=7, chunk_size=16, D="channel",
                      has_z=True, has_dt_bias=True, dt_softplus=False, initial_states=True, return_final_states=False,
                      regime=Regime(decay="mild", dt_large=True, values="integer", layout="strided"), seed=0)


def test_a_token_recurrence_is_budgeted_by_its_own_order(device):
    """A side that evaluates token by token (``evaluation_order`` "recurrent") is judged against the model in the
    token order too (each state rounded once its token is added, y read from it), whose rounding grows with the
    tokens a state carries as the recurrence's does: fla's fused recurrent kernel over a long memory, and on a y
    read from a large state, is within budget."""
    name = "fla.fused_recurrent_simple_gla"
    usable(name, "float32", False, device)
    assert get(name).evaluation_order == "recurrent"
    with Examiner([name], device) as examiner:
        agrees_with_oracle(examiner, LONG_MEMORY_CASE)
        agrees_with_oracle(examiner, OWN_TOKEN_CASE)
    # a shape whose every token's state that model cannot hold is outside the side's reach, with the reason
    production = LONG_MEMORY_CASE.replace(seqlen=16384, nheads=128, ngroups=8, headdim=64, dstate=128, chunk_size=256)
    with Examiner([name], device) as examiner:
        assert any("model in the token order" in why for why in examiner.skip_reasons(production))
        assert examiner.fit(production) is None


# A typical-decay case whose gradient of A fla's fused recurrent kernel returned 3.4x out of budget on the CPU.
GATE_SUM_CASE = Case(batch=2, seqlen=4, nheads=4, headdim=5, ngroups=2, dstate=4, chunk_size=16, D="channel",
                     has_z=False, has_dt_bias=False, dt_softplus=False, return_final_states=False,
                     regime=Regime(decay="typical", scale=4.0, layout="strided"), pass_="backward", seed=2396)
# (record, a case it bounds, the smallest relative error of grad A it must not explain under the interpreter's
# exact float32 dots, or None)
BOUNDED_RECORDS = [
    pytest.param("fla-fused-recurrent-gate-gradient-cancellation", GATE_SUM_CASE, 1.001, id="fla-gate-sum"),
    pytest.param("mamba-ssd-minimal-half-precision-chunk-sum", MILD_CHUNK_SUM_CASE, None, id="ssd-minimal-mild-decay"),
    pytest.param("mamba-chunk-scan-ref-float32-decay-sums",
                 known.BY_ID["mamba-chunk-scan-ref-float32-decay-sums"].example, None, id="chunk-scan-ref-fp32"),
]


@pytest.mark.parametrize("defect_id, case, fine", BOUNDED_RECORDS)
def test_a_record_that_bounds_its_error_explains_no_more_than_that(defect_id, case, fine, device, tmp_path):
    """A record that bounds its error on a case (harness/registry/known.py: the fla gate-sum record's running_gate_sum_error,
    the ssd_minimal and chunk_scan_ref records' decay_sum_error): a divergence of the implementation as it is, in
    the gradients the record corrupts, is the record's; the same run with its gradient of A doubled, or of x half as
    large again, is not (under the interpreter, nor one of A ``fine`` off where given), and `ssdiff fuzz` and the
    calibration count it as a divergence of its own."""
    from ssdiff.tools.calibrate import Row
    from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer

    defect = known.BY_ID[defect_id]
    side = defect.implementations[0]
    usable(side, case.dtype, True, device)
    assert defect.applies(case) and defect.bounds(case)
    with Examiner([side], device) as examiner:
        outcome = examine(examiner, case)
    verdict = outcome.verdicts[side]
    assert verdict.ok or known.explains(defect, side, outcome), verdict.message()

    def planted(name: str, factor: float) -> Outcome:
        run = outcome.outputs[side]
        grads = {**run.grads, name: run.grads[name] * factor}
        wrong = Evaluation(dict(run.outputs), grads, dict(run.stages), list(run.notes))
        judged = judge(side, outcome.case, outcome.inputs, wrong, outcome.truth, outcome.baseline)
        return dataclasses.replace(outcome, verdicts={side: judged}, outputs={side: wrong})

    fuzzer = Fuzzer(FuzzConfig(impl=side, device=device, max_examples=1, out_dir=str(tmp_path), pool=False))
    plants = [("A", 2.0), ("x", 1.5)]
    if runtime.interpreted() and fine is not None:
        # natively the float32 budget models TF32 dots, about 1e-3 of a gradient: a 0.1% error is within it there
        plants.append(("A", fine))
    for name, factor in plants:
        wrong = planted(name, factor)
        assert not wrong.verdicts[side].ok, f"grad {name} {factor}x is within budget"
        assert not known.explains(defect, side, wrong), f"grad {name} {factor}x is explained by {defect.id}"
        assert fuzzer.note_known(wrong) == set()
        row = Row(side, device, case.dtype)
        row.observe(wrong)
        assert len(row.divergences) == 1 and not row.known


def test_chunk_scan_ref_gradients_agree_below_the_overflow(device):
    """The long row of chunk-scan-ref-long-row-at-typical-decay cut to 64 tokens: its row decay (71) is below
    ln(float32 max) = 88.72, outside the record's predicate, and ssd_chunk_scan_combined_ref's gradients agree
    (the predicate's edge is where the overflow is)."""
    defect = known.BY_ID["mamba-chunk-scan-ref-nan-gradients"]
    longer = next(p.values[1] for p in PREDICATE_CASES if p.id == "chunk-scan-ref-long-row-at-typical-decay")
    shorter = longer.replace(seqlen=64)
    if not known.row_decay(longer) > known.EXP_OVERFLOW_F32 > known.row_decay(shorter):
        pytest.fail(f"row decays {known.row_decay(longer):.1f} / {known.row_decay(shorter):.1f} do not straddle "
                    f"{known.EXP_OVERFLOW_F32}")
    if defect.applies(shorter):
        pytest.fail(f"{defect.id}'s predicate holds below the overflow: {shorter.describe()}")
    usable("mamba_ssm.chunk_scan_ref", "float32", True, device)
    with Examiner(["mamba_ssm.chunk_scan_ref"], device) as examiner:
        agrees_with_oracle(examiner, shorter)


def test_a_case_hitting_a_known_defect_is_judged_not_skipped(device):
    """A known defect is not a capability limit: every record's example (and extra case) that can run here is
    inside its implementations' capabilities, and `known.matching` names a record for it where the installed
    release is affected (so `ssdiff fuzz` reports it as known)."""
    problems = []
    pairs = [(d, d.example) for d in known.DEFECTS] + [(known.BY_ID[p.values[0]], p.values[1])
                                                       for p in PREDICATE_CASES]
    for defect, case in pairs:
        affected = defect.affects(known.installed_version(defect.package))
        for name in defect.implementations:
            impl = get(name)
            if case.entry not in impl.capabilities.entries or not_here(impl, case, device):
                continue
            why = impl.skip_reason(case, device)
            if why is not None:
                problems.append(f"{defect.id}: {name} skips {case.describe()}: {why}")
            if affected and known.matching(name, case) is None:
                problems.append(f"{defect.id}: known.matching({name!r}, ...) names no record for {case.describe()}")
    assert not problems, "\n".join(problems)


# ---- every autotune config -------------------------------------------------------------------------------

SWEEP_CASE = Case(batch=1, seqlen=20, nheads=2, ngroups=1, headdim=5, dstate=3, chunk_size=8, D="channel",
                  has_z=True, initial_states=True, dt_limit=(0.001, 1.0), segments=((7, 13),))
SCAN = "mamba_ssm.chunk_scan_combined"


@pytest.mark.parametrize("pass_", ["forward", pytest.param("backward", marks=pytest.mark.slow)])
def test_every_autotune_config_matches_oracle(pass_, device):
    """mamba_chunk_scan_combined with config i of every kernel, for every i: some bugs live in one config."""
    usable(SCAN, "float32", pass_ == "backward", device)
    case = SWEEP_CASE.replace(pass_=pass_)
    examiner = Examiner([SCAN], device)
    tuned = examiner.examine(case, "tuned")           # what users get: benchmarked on a GPU, config 0 interpreted
    assert_agrees(tuned.verdicts[SCAN], case, "tuned")
    failures, sweep = [], runtime.ConfigSweep()
    for index in sweep:
        outcome = examiner.examine(case, index)
        if not outcome.verdicts[SCAN].ok:
            failures.append(f"config #{index}: {outcome.verdicts[SCAN].message()}")
        sweep.ran(outcome.launches[SCAN])
    assert sweep.needed > 1 and examiner.oracle_evaluations == 1, "the sweep did not run every config on one case"
    assert not failures, "\n".join(failures) + f"\n{replay(case)}"


@pytest.mark.interpreter(reason="only the interpreter reports a chosen SM count (runtime.with_sm_count); natively "
                                "kernels read the GPU's own")
def test_backward_with_another_sm_count_matches_oracle(device):
    """Backward kernels split reductions by the SM count; with 1 SM every head of a group lands in one program."""
    usable(SCAN, "float32", True, device)
    case = Case(batch=1, seqlen=16, nheads=4, ngroups=1, headdim=3, dstate=4, chunk_size=8, initial_states=True,
                pass_="backward", final_state_grad=True)
    with runtime.with_sm_count(1), Examiner([SCAN], device) as examiner:
        agrees_with_oracle(examiner, case)


def test_autotune_choice_is_validated():
    for bad in (-1, "fastest", 1.5, True):
        with pytest.raises(ValueError, match="autotune choice"):
            with runtime.autotune(bad):
                pass


# ---- the generic adapter ---------------------------------------------------------------------------------

GENERIC_TARGET = "mamba_ssm.ops.triton.ssd_combined:mamba_chunk_scan_combined"


@pytest.fixture(scope="module")
def generic_and_builtin(device) -> Outcome:
    """``--impl module:function`` with mamba_chunk_scan_combined itself beside the built-in adapter, forward and
    backward with every input that has a gradient, examined on one case."""
    usable(SCAN, "float32", True, device)
    generic = CallableImplementation(GENERIC_TARGET)
    assert generic.unavailable() is None
    # read from the signature: everything, but cu_seqlens / return_varlen_states only where the release has them
    assert generic.capabilities.unsupported == (frozenset() if upstream.mamba_ssm().varlen_states
                                                else frozenset({"varlen_states"}))
    case = Case(batch=2, seqlen=12, nheads=2, headdim=3, dstate=4, chunk_size=8, has_z=True, initial_states=True,
                pass_="backward", final_state_grad=True)
    with Examiner([GENERIC_TARGET, SCAN], device) as examiner:
        return examiner.examine(case, ONE_CONFIG)


def test_generic_adapter_runs_a_callable_like_the_builtin(generic_and_builtin):
    """The same verdict as the built-in adapter (both agree with the oracle, and with each other within their
    joint budget) and bitwise its forward outputs: the same kernels on the same inputs, and the forward kernels
    accumulate without atomics. An argument the generic adapter wires wrongly changes the forward or puts a
    gradient out of budget."""
    outcome = generic_and_builtin
    verdicts = [outcome.verdicts[side] for side in (GENERIC_TARGET, SCAN)]
    for verdict in verdicts:
        assert_agrees(verdict, outcome.case)
    assert verdicts[0].status == verdicts[1].status
    a, b = (outcome.outputs[side] for side in (GENERIC_TARGET, SCAN))
    assert set(a.outputs) == set(b.outputs) and set(a.grads) == set(b.grads)
    assert outcome.pair and all(ratio <= 1.0 for ratio in outcome.pair.values()), outcome.pair
    for key in b.outputs:
        assert torch.equal(a.outputs[key], b.outputs[key]), key


@pytest.mark.interpreter(reason="the interpreter runs a kernel's programs one after another, so atomic adds "
                                "(mamba_ssm's backward accumulates ddt, ddA_cumsum, dA, dD and ddt_bias with them) "
                                "sum in one order; on a GPU their order, and so the rounding, varies from run to run")
def test_generic_adapter_gradients_are_bitwise_the_builtins(generic_and_builtin):
    a, b = (generic_and_builtin.outputs[side] for side in (GENERIC_TARGET, SCAN))
    for key in b.grads:
        assert torch.equal(a.grads[key], b.grads[key]), f"grad.{key}"


@pytest.mark.parametrize("target, says", [
    ("no_such_package.module:function", "not installed"),
    ("math:no_such_function", "has no attribute"),
    ("math:pi", "not callable"),
    ("math:sqrt", "does not take mamba_chunk_scan_combined's arguments"),
    ("nocolon", "expected package.module:function"),
])
def test_generic_adapter_reports_why_not(target, says, device):
    impl = CallableImplementation(target)
    why = impl.unavailable()
    assert why and says in why and "\n" not in why
    assert impl.skip_reason(Case(), device) == why


def test_unknown_implementation_name_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown implementation 'mamba_ssm.nope'"):
        get("mamba_ssm.nope")


# ---- capabilities and skips ------------------------------------------------------------------------------

def test_cases_outside_capabilities_are_skipped_with_the_reason(device):
    scan = get("mamba_ssm.chunk_scan")
    if scan.unavailable():
        pytest.skip(scan.unavailable())
    assert "seq_idx" in scan.skip_reason(Case(segments=((8, 8),)), device)
    assert "ragged" in scan.skip_reason(Case(seqlen=12), device)
    assert "clamp" in scan.skip_reason(Case(dt_softplus=False, return_final_states=False), device)
    combined = get("mamba_ssm.chunk_scan_combined")
    if "bfloat16" not in runtime.runnable_dtypes():
        assert "bfloat16 runs only on a GPU" in combined.skip_reason(Case(dtype="bfloat16"), device)
    mixer = get("mamba_ssm.split_conv1d_combined")
    assert "% 8" in mixer.skip_reason(Case(entry="split_conv1d", nheads=1, headdim=3, dstate=3), device)
    chunk = get("fla.chunk_simple_gla")
    if torch.device(device).type != "cuda":
        assert "needs a GPU" in chunk.skip_reason(Case(), device)


def test_stand_ins_are_named_in_results(device):
    mixer = usable("mamba_ssm.split_conv1d_combined", "float32", False, device)
    from ssdiff.sides import upstream
    case = Case(entry="split_conv1d", nheads=2, headdim=4, dstate=4, seqlen=8)
    notes = mixer.run(case, materialize(case, device)).notes
    assert any(upstream.mamba_ssm().version in note_ for note_ in notes)
    if "causal_conv1d" in upstream.mamba_ssm().standins:
        assert any("stand-in" in note_ and "causal_conv1d" in note_ for note_ in notes)


def test_stage_intermediates_match_the_oracle(device):
    """The sub-kernels (chunk cumsum, chunk state, state passing, bmm, chunk scan) as stages, each judged against
    the oracle's stage with its own budget."""
    impl = usable(SCAN, "float32", False, device)
    case = Case(batch=2, seqlen=20, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=8, D="channel", has_z=True,
                initial_states=True, segments=((5, 15), (20,)))
    with Examiner([SCAN], device) as examiner:
        verdict = examiner.examine(case, ONE_CONFIG, stages=True).verdicts[SCAN]
    staged = {t.name.removeprefix("stage."): t for t in verdict.tensors if t.kind == "stage"}
    assert set(staged) == set(impl.capabilities.stages), sorted(staged)
    assert_agrees(verdict, case)
    bad = [t.message(SCAN) for t in staged.values() if not t.ok]
    assert not bad, "\n".join(bad) + f"\n{replay(case)}"


# ---- `ssdiff list` ---------------------------------------------------------------------------------------

def test_list_shows_every_implementation_and_why_not():
    pytest.importorskip("rich", reason="the ssdiff CLI prints with rich, which is not installed here")
    out = subprocess.run([sys.executable, "-m", "ssdiff.cli", "list"], capture_output=True, text=True,
                         cwd=REPO, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    for name in upstream_names():
        assert name in out.stdout
    if not runtime.has_gpu():
        assert "needs a GPU" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


# ---- other mamba_ssm releases ----------------------------------------------------------------------------

def release_dirs() -> list:
    """Directories holding one mamba-ssm release each (``pip install --target DIR mamba-ssm==X``): from
    SSDIFF_MAMBA_RELEASES (os.pathsep-separated), else .venv/mamba-releases/*/."""
    given_ = os.environ.get("SSDIFF_MAMBA_RELEASES")
    if given_:
        return [Path(p) for p in given_.split(os.pathsep) if p]
    root = REPO / ".venv" / "mamba-releases"
    return sorted(p for p in root.glob("*") if (p / "mamba_ssm").is_dir()) if root.is_dir() else []


# This file's properties and the generic property's mamba_ssm implementations, in float32
RELEASE_FILES = (Path(__file__), Path(__file__).with_name("test_implementations.py"))
RELEASE_SELECTION = os.environ.get(
    "SSDIFF_RELEASE_SELECTION",
    "not release and not fla and not float16 and not bfloat16 and not list and not generic "
    "and not every_autotune_config and (not every_implementation or mamba_ssm)")


@pytest.mark.slow
@pytest.mark.parametrize("where", release_dirs() or [None], ids=lambda p: p.name if p else "none-installed")
def test_release_runs_its_properties(where):
    """Another release, installed in its own directory, loads through the same adapters and runs the
    properties in a child process (one mamba_ssm per process): what it cannot do is skipped with a reason."""
    if where is None:
        pytest.skip("no other mamba-ssm release installed: set SSDIFF_MAMBA_RELEASES=DIR[:DIR...] (each DIR from "
                    "`MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation --no-deps "
                    "--target DIR mamba-ssm==X`) or install into .venv/mamba-releases/X")
    if not (where / "mamba_ssm").is_dir():
        pytest.fail(f"{where} holds no mamba_ssm package")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "SSDIFF_MAMBA_RELEASES": "", "SSDIFF_EXAMPLES_SCALE": os.environ.get("SSDIFF_RELEASE_EXAMPLES_SCALE",
                                                                                "0.5")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          *map(str, RELEASE_FILES), "-k", RELEASE_SELECTION],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    version = (where / "mamba_ssm" / "__init__.py").read_text().split("__version__", 1)[-1].split("\n")[0]
    print(f"mamba-ssm{version} from {where}\n{out.stdout[-6000:]}")
    assert out.returncode == 0, f"mamba-ssm{version} from {where}:\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    assert "error" not in out.stdout.splitlines()[-1].lower(), out.stdout[-3000:]


# ---- passes refused whatever the case ----------------------------------------------------------------------

def test_no_pass_is_refused_for_a_known_defect(device):
    """A known defect is judged, not refused: mamba_chunk_scan's bf16 backward (its unstable d(dA_cumsum), record
    mamba-chunk-scan-unstable-ddA) and every other mamba_ssm pass run and are judged on the device under test."""
    for impl in all_implementations():
        if not impl.name.startswith("mamba_ssm.") or impl.unavailable():
            continue
        for backward in (False, True):
            for dtype in DTYPES:
                assert impl.refuses(backward, device, dtype) is None, (impl.name, backward, dtype)


def test_a_pass_an_implementation_refuses_is_skipped_with_its_reason(monkeypatch, device):
    """A version/hardware guard of the code under test (fla's Hopper backward, #640) skips the whole pass with
    the guard's reason; drawing cases for it would only end in hypothesis's Unsatisfiable (as on an H200)."""
    impl = get("fla.fused_recurrent_simple_gla")
    if impl.unavailable():
        pytest.skip(impl.unavailable())
    monkeypatch.setattr(type(impl), "refuses",
                        lambda self, backward, dev, dtype=None: "refused: test guard" if backward else None)
    assert usable(impl.name, "float32", False, device) is impl
    with pytest.raises(pytest.skip.Exception, match="refused: test guard"):
        usable(impl.name, "float32", True, device)
    assert impl.skip_reason(Case(pass_="backward"), device) == "refused: test guard"
