"""The noise-floor verdict (harness/verdict/judge.py) and the same-precision baseline it is built on (harness/budget/).

Healthy implementations are within budget on generated cases; an error planted at one element is reported
with the exact ratio, count and place; NaN/Inf, wrong shape, wrong dtype and missing results are verdicts of
their own; padding tokens and unused C.B^T entries are not judged.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch
from hypothesis import given

from ssdiff.budget import model, rounding, samples
from ssdiff.sides import doubles
from ssdiff import runtime
from ssdiff.inputs import widen
from ssdiff.model.axes import TensorAxes, axes_of
from ssdiff.model.case import Case, Regime
from ssdiff.model.evaluation import Evaluation
from ssdiff.inputs import materialize
from ssdiff.sides.base import fit_case
from ssdiff.truth import evaluate
from ssdiff.model.bounds import Bounds
from ssdiff.model.strategies import cases
from ssdiff.verdict.judge import FACTOR, cells, disagreement, element_budget, judge, judge_tensor
from ssdiff.model.dtypes import UNIT_ROUNDOFF
from ssdiff.testing import usable

SMALL = Bounds(max_batch=2, max_seqlen=24, max_nheads=4, max_headdim=4, max_dstate=4, chunk_sizes=(4, 8))

RICH = Case(batch=2, seqlen=21, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=8, dtype="float16", D="channel",
            has_z=True, initial_states=True, dt_limit=(0.01, 0.2), pass_="backward", final_state_grad=True, seed=3)


def prepared(case: Case, device):
    inputs = materialize(case, device)
    truth = evaluate(case, inputs)
    return inputs, truth, samples.evaluate_samples(case, inputs, truth, evaluate)


def y_of(case, inputs, truth, bases, actual):
    return judge_tensor("y", "output", actual, truth.outputs["y"], [b.outputs["y"] for b in bases], case, inputs)


# ---- healthy implementations pass -----------------------------------------------------------------------

@given(case=cases(dtypes=("float32", "float16", "bfloat16"), bounds=SMALL))
def test_healthy_float32_implementations_are_within_budget(case, device):
    impl = doubles.healthy if case.entry == "chunk_scan" else doubles.mixer
    case = fit_case(case, [impl], device)
    inputs, truth, bases = prepared(case, device)
    verdict = judge(impl.name, case, inputs, impl.run(case, inputs, want_stages=True), truth, bases, stages=True)
    assert verdict.ok, verdict.message()
    assert all(t.ok for t in verdict.tensors), [t.name for t in verdict.tensors if not t.ok]


HEALTHY_CASES = {"chunk_scan": Case(batch=2, seqlen=12, nheads=2, headdim=3, dstate=4, chunk_size=4, has_z=True),
                 "split_conv1d": Case(entry="split_conv1d", seqlen=8, nheads=2, headdim=4, dstate=4, rmsnorm=True),
                 "layer": Case(entry="layer", seqlen=5, nheads=2, headdim=4, dstate=4, chunk_size=4, d_model=8,
                               return_final_states=False, rmsnorm=True, rmsnorm_eps=1e-5, norm_before_gate=False),
                 "mamba3_layer": Case(entry="mamba3_layer", seqlen=7, nheads=2, ngroups=2, headdim=2, dstate=4,
                                      chunk_size=4, d_model=4, return_final_states=False, rmsnorm=True,
                                      rmsnorm_eps=1e-5)}


@pytest.mark.parametrize("impl", [doubles.healthy, doubles.mixer, doubles.layer, doubles.mamba3_layer],
                         ids=lambda impl: impl.name)
def test_the_healthy_doubles_compute_with_none_of_the_budgets_model(impl, device):
    """The budget is a multiple of what the budget's model (harness/budget/) gets wrong on the case: a healthy
    double that computed with that model would be measured against itself, within budget by construction in
    float32. They call none of its code (each its entry's case forward, every function called recorded)."""
    case = HEALTHY_CASES[next(iter(impl.capabilities.entries))]
    inputs = materialize(case, device)
    called = set()
    sys.setprofile(lambda frame, event, arg: called.add(frame.f_globals.get("__name__")) if event == "call" else None)
    try:
        impl.run(case, inputs, want_stages=True)
    finally:
        sys.setprofile(None)
    assert "ssdiff.sides.doubles" in called
    assert not {m for m in called if m and m.startswith("ssdiff.budget")}, sorted(called)


@pytest.mark.parametrize("other", ["ref.quadratic", "ref.recurrent"])
def test_the_oracles_are_far_within_each_others_budget(other, device):
    case = RICH.replace(segments=((5, 8, 8), (3, 10, 8)), padding=None, dtype="float32")
    inputs, truth, bases = prepared(case, device)
    ev = evaluate(case, inputs, other)
    verdict = judge(other, case, inputs, ev, truth, bases, stages=True)
    assert verdict.ok and verdict.ratio < 1e-3, verdict.message()


# ---- the ratio means what it says --------------------------------------------------------------------------

def test_an_error_planted_at_one_element_is_reported_exactly(device):
    case = RICH.replace(pass_="forward", final_state_grad=False)
    inputs, truth, bases = prepared(case, device)
    t = truth.outputs["y"]
    axes = axes_of("output", "y", case)
    budget, *_ = element_budget(t, [b.outputs["y"] for b in bases], torch.ones_like(t, dtype=torch.bool), axes,
                                case, UNIT_ROUNDOFF[torch.float16])
    where = (1, 17, 2, 1)
    for multiple, status in ((10.0, "diverged"), (0.5, "ok")):
        actual = t.clone()                          # float64 results (the oracles') skip the dtype check
        actual[where] += multiple * budget[where]
        tv = y_of(case, inputs, truth, bases, actual)
        assert tv.status == status
        assert tv.ratio == pytest.approx(multiple, rel=1e-9)
        assert tuple(tv.worst["index"]) == where
        assert tv.worst["coords"] == {"batch": 1, "token": 17, "chunk": 2, "head": 2, "group": 1, "p": 1}
        assert tv.out_of_budget == (1 if multiple > 1 else 0)
        assert tv.judged == t.numel()


def test_the_message_reads_like_torch_testing(device):
    case = RICH.replace(pass_="forward", final_state_grad=False)
    inputs, truth, bases = prepared(case, device)
    actual = truth.outputs["y"].clone()
    actual[0, 3] += 1.0                             # every element of one token: p * h = 12 elements
    tv = y_of(case, inputs, truth, bases, actual)
    text = tv.message("impl")
    assert tv.out_of_budget == case.nheads * case.headdim
    assert text.startswith("impl: output y diverges from the float64 oracle: 12 / 504 elements (2.4%) out of budget")
    for piece in ("Greatest error 1 at index (0, 3,", "budget there", "ratio", "Relative RMS error",
                  "same-precision baseline", "max abs error 1"):
        assert piece in text, text


def test_nan_and_inf_are_their_own_verdict(device):
    case = RICH.replace(pass_="forward", final_state_grad=False)
    inputs, truth, bases = prepared(case, device)
    actual = truth.outputs["y"].clone().to(torch.float16)
    actual[1, 4, 0, 2] = float("nan")
    actual[1, 9, 3, 0] = float("inf")
    tv = y_of(case, inputs, truth, bases, actual)
    assert tv.status == "nonfinite" and tv.out_of_budget == 2 and math.isinf(tv.ratio)
    assert tuple(tv.worst["index"]) == (1, 4, 0, 2)
    assert "NaN and Inf" in tv.detail


def test_shape_dtype_and_missing_results_are_mismatches(device):
    case = RICH.replace(pass_="forward", final_state_grad=False)
    inputs, truth, bases = prepared(case, device)
    y = truth.outputs["y"]
    assert "shape" in y_of(case, inputs, truth, bases, y[:, :-1].to(torch.float16)).detail
    wrong_dtype = y_of(case, inputs, truth, bases, y.to(torch.float32))
    assert wrong_dtype.status == "mismatch" and "dtype float32, expected float16" in wrong_dtype.detail
    assert y_of(case, inputs, truth, bases, y.to(torch.float16)).status == "ok"
    out = Evaluation(outputs={"y": y.to(torch.float16)})          # final_states missing
    verdict = judge("impl", case, inputs, out, truth, bases)
    assert verdict.status == "mismatch"
    assert verdict.tensor("final_states").detail.startswith("missing")


def test_outputs_at_padding_tokens_are_not_judged_but_gradients_are(device):
    case = Case(batch=2, seqlen=12, nheads=2, headdim=3, dstate=2, chunk_size=4, segments=((5, 7), (4, 5)),
                padding=(0, 3), pass_="backward", seed=5)
    inputs, truth, bases = prepared(case, device)
    out = doubles.healthy.run(case, inputs)
    out.outputs["y"] = out.outputs["y"].clone()
    out.outputs["y"][1, 9:] = 1e6                   # padding tokens of row 1: unspecified
    verdict = judge("impl", case, inputs, out, truth, bases)
    assert verdict.ok, verdict.message()
    assert verdict.tensor("y").excluded == 3 * case.nheads * case.headdim
    out.grads["x"] = out.grads["x"].clone()
    out.grads["x"][1, 10, 0, 0] += 1.0              # a gradient leaking into a padding token is judged
    assert judge("impl", case, inputs, out, truth, bases).tensor("grad.x").status == "diverged"


def test_unused_CB_entries_are_not_judged(device):
    case = Case(seqlen=10, nheads=2, headdim=2, dstate=3, chunk_size=8, segments=((3, 7),), seed=2)
    inputs, truth, bases = prepared(case, device)
    out = doubles.healthy.run(case, inputs, want_stages=True)
    cb = out.stages["CB"].clone()
    cb[0, 0, 0, 1, 5] = 99.0                        # j > i: above the causal diagonal
    cb[0, 0, 0, 5, 1] = 99.0                        # token 5 (sequence 1) with token 1 (sequence 0)
    cb[0, 1, 0, 3, 3] = 99.0                        # past the end (L = 10)
    out.stages["CB"] = cb
    staged = judge("impl", case, inputs, out, truth, bases, stages=True)
    assert staged.tensor("stage.CB").ok
    cb[0, 0, 0, 5, 4] = 99.0                        # a used entry
    assert not judge("impl", case, inputs, out, truth, bases, stages=True).tensor("stage.CB").ok


def test_two_sides_disagreement_is_measured_against_their_joint_budget(device):
    case = RICH
    inputs, truth, bases = prepared(case, device)
    good = doubles.healthy.run(case, inputs)
    bad = doubles.group_bug.run(case, inputs)
    pair = disagreement(case, inputs, good, bad, truth, bases)
    bad_alone = judge("bad", case, inputs, bad, truth, bases).tensor("y").ratio
    assert pair["y"] > 10 and pair["grad.B"] > 10
    # The joint budget is twice one budget, and the good side is within noise of the oracle.
    assert pair["y"] == pytest.approx(bad_alone / 2, rel=0.1)
    same = disagreement(case, inputs, good, good, truth, bases)
    assert max(same.values()) == 0.0


# ---- budgets -----------------------------------------------------------------------------------------------

def test_cells_follow_batch_chunk_and_head_and_merge_when_small(device):
    case = Case(batch=2, seqlen=64, nheads=4, headdim=8, dstate=4, chunk_size=16)
    ids, ncells = cells((2, 64, 4, 8), axes_of("output", "y", case), case, device)
    assert ncells == 2 * 4 * 4                             # batch x chunk x head, 128 elements each
    assert torch.equal(torch.unique(ids).cpu(), torch.arange(ncells))     # dense, as the count says
    assert ids[0, 0, 0, 0] == ids[0, 15, 0, 7] != ids[0, 16, 0, 0]
    ragged, n = cells((1, 40, 3, 2), axes_of("output", "y", case), case, device)     # a partial last chunk
    assert torch.equal(torch.unique(ragged).cpu(), torch.arange(n))
    tiny, one = cells((4,), TensorAxes(("head",)), case, device)    # 1-element cells merge into one
    assert one == 1 and int(tiny.max()) == 0


def test_the_budget_scales_with_the_dtype():
    # On the CPU, where fp32 products are exact (on a GPU they are TF32: runtime.fp32_dot()), so the float32
    # budget is float32's.
    case32 = RICH.replace(dtype="float32", pass_="forward", final_state_grad=False)
    ratios = {}
    for dtype in ("float32", "float16", "bfloat16"):
        case = case32.replace(dtype=dtype)
        inputs, truth, bases = prepared(case, "cpu")
        actual = truth.outputs["y"] * (1 + 1e-3)        # a relative error of 1e-3 everywhere
        ratios[dtype] = y_of(case, inputs, truth, bases, actual).ratio
    assert ratios["float32"] > 100 > ratios["float16"] > ratios["bfloat16"]
    assert ratios["bfloat16"] < 1.0


def test_tf32_keeps_ten_mantissa_bits_truncating_like_hopper():
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 3 * 2.0 ** -12, -(1.0 + 3 * 2.0 ** -12), 3.0e-30, float("inf")])
    r = rounding.round_to(x, "tf32")
    assert r.tolist()[:3] == [1.0 + 2.0 ** -10, 1.0, -1.0]      # toward zero, not to nearest
    assert r[3] != 0 and (r[3].view(torch.int32) & 0x1FFF) == 0
    assert math.isinf(r[4])
    assert rounding.dot_precision(Case(dtype="float16"), "cpu") == "float16"
    assert rounding.dot_precision(Case(dtype="float32"), "cpu") == "float32"
    # out_proj is torch's F.linear: fp32 on a GPU unless torch allows TF32 (off by default)
    assert rounding.linear_precision(Case(dtype="float32"), "cuda") == "float32"


def test_baseline_samples_spread_around_the_rounding_error(device):
    case = RICH.replace(pass_="forward", final_state_grad=False)
    inputs, truth, bases = prepared(case, device)
    errors = [float((b.outputs["y"] - truth.outputs["y"]).norm() / truth.outputs["y"].norm()) for b in bases]
    # float16: a few units of 2^-11 relative at most, never zero, never much larger from sample to sample
    assert all(1e-5 < e < 2e-3 for e in errors), errors
    assert len(set(errors)) == len(errors)
    assert max(errors) < 4 * min(errors)
    assert FACTOR == 4.0


FOLDED_CASES = [
    RICH,
    Case(batch=1, seqlen=13, nheads=2, headdim=3, dstate=4, chunk_size=4, dtype="float16", D="head",
         segments=((6, 7),), initial_states=True, varlen_states=True, return_final_states=True, seed=2),
    Case(entry="decode", batch=2, seqlen=9, nheads=2, headdim=3, dstate=4, chunk_size=4, dtype="float16", D="head",
         has_z=True, has_dt_bias=True, dt_softplus=True, initial_states=True, return_final_states=True, seed=4),
    Case(entry="split_conv1d", batch=2, seqlen=12, nheads=2, ngroups=2, headdim=4, dstate=3, chunk_size=4,
         dtype="float16", D="head", has_dt_bias=True, dt_softplus=True, rmsnorm=True, d_nonssm=2, out_dim=5,
         outproj_bias=True, pass_="backward", seed=5),
    Case(entry="layer", batch=1, seqlen=10, nheads=2, headdim=4, dstate=3, chunk_size=4, dtype="float16", D="channel",
         has_dt_bias=True, dt_softplus=True, rmsnorm=True, d_model=4, return_final_states=False, bias=True,
         pass_="backward", seed=6),
    Case(entry="mamba3", seqlen=11, nheads=2, ngroups=1, headdim=2, dstate=4, chunk_size=4, dtype="bfloat16",
         has_dt_bias=False, dt_softplus=False, has_z=True, initial_states=True, segments=((4, 7),), pass_="backward",
         final_state_grad=True, seed=9),
    Case(entry="mamba3", batch=2, seqlen=9, nheads=2, headdim=2, dstate=4, chunk_size=4, dtype="float16",
         has_dt_bias=False, dt_softplus=False, initial_states=True, mamba3_steps=3, seed=10),
]


@pytest.mark.parametrize("case", FOLDED_CASES, ids=lambda c: c.entry)
def test_a_folded_evaluation_gives_each_sample_as_evaluated_alone(case, device):
    # evaluate_samples folds the samples (and the neighbour inputs) into one evaluation; each fold must be that
    # sample: within a tenth of the samples' own spread of it (on the CPU they are equal bit for bit).
    inputs = materialize(case, device)
    near = samples.neighbour(inputs, 1)
    folded = samples.evaluate_folded(case, [inputs, inputs, inputs, near], (0, 1, 2, 0))
    alone = [samples.evaluate(case, inputs, sample=k) for k in range(3)] + [samples.evaluate(case, near)]
    for field in ("outputs", "grads", "stages"):
        assert getattr(folded[0], field).keys() == getattr(alone[0], field).keys()
        for name, exact in getattr(alone[0], field).items():
            spread = max((getattr(a, field)[name] - exact).abs().max().item() for a in alone[1:3])
            assert spread > 0, (field, name)                  # the perturbed samples do differ
            for f, a in zip(folded, alone):
                gap = (getattr(f, field)[name] - getattr(a, field)[name]).abs().max().item()
                assert gap <= 0.1 * spread, (field, name, gap, spread)


# the fused mixer's parts side by side: no out_proj with a SwiGLU branch, and out_proj without one; final states
# from initial ones, sequences, the norm after the gate, D per channel
WIDENED_CASES = [c for c in FOLDED_CASES if c.entry in widen.ENTRIES] + [
    Case(entry="split_conv1d", batch=2, seqlen=11, nheads=3, ngroups=3, headdim=2, dstate=3, chunk_size=4,
         D="channel", has_dt_bias=True, dt_softplus=True, rmsnorm=True, norm_before_gate=False, d_nonssm=3,
         out_dim=None, initial_states=True, return_final_states=True, final_state_grad=True,
         segments=((5, 6), (11,)), pass_="backward", seed=7),
    Case(entry="split_conv1d", batch=1, seqlen=9, nheads=4, ngroups=2, headdim=3, dstate=2, chunk_size=4,
         dtype="bfloat16", D="head", has_dt_bias=True, dt_softplus=True, activation="identity", d_nonssm=0,
         out_dim=3, initial_states=True, return_final_states=True, pass_="backward", seed=8),
]


@pytest.mark.parametrize("case", WIDENED_CASES, ids=lambda c: f"{c.entry}-{c.seed}")
def test_the_oracle_side_by_side_is_the_oracle_one_by_one(case, device):
    # the truth and the oracle at the neighbour inputs come from one evaluation with their heads side by side
    inputs = materialize(case, device)
    several = [inputs, *samples.neighbours_of(inputs)]
    for wide, alone in zip(widen.evaluate(evaluate, case, several), [evaluate(case, i) for i in several]):
        for field in ("outputs", "grads", "stages"):
            assert getattr(wide, field).keys() == getattr(alone, field).keys()
            for name, t in getattr(alone, field).items():
                # float64 sums over more heads may associate otherwise on a GPU: within its rounding of the
                # tensor's scale (on the CPU they are equal)
                scale = t.abs().max().item()
                gap = (getattr(wide, field)[name] - t).abs().max().item()
                assert gap <= 1e-12 * scale, (field, name, gap, scale)


def test_strong_decay_gradients_of_A_keep_a_tight_budget():
    # The baseline's backward is the stable one (segment sums), so grad A under strong decay is accurate to
    # a few ulp; a kernel computing it through cumsum differences is flagged. The toy kernel is stable. On the
    # CPU: a float32 baseline with exact products (on a GPU they are TF32: runtime.fp32_dot()).
    case = Case(seqlen=40, nheads=6, headdim=8, dstate=8, ngroups=2, chunk_size=16, has_z=True, initial_states=True,
                regime=Regime(decay="strong"), pass_="backward", seed=11)
    inputs, truth, bases = prepared(case, "cpu")
    for b in bases:
        rel = float((b.grads["A"] - truth.grads["A"]).norm() / truth.grads["A"].norm())
        assert rel < 1e-4, rel
    verdict = judge("toy", case, inputs, doubles.healthy.run(case, inputs), truth, bases)
    assert verdict.ok, verdict.message()


@pytest.mark.interpreter(reason="the false alarm needs the interpreter's exact fp32 dot (a GPU's is TF32, with a "
                                "budget of its own)")
def test_a_baseline_exact_by_chance_is_widened_by_its_neighbours(device):
    """Found by a 10-minute fuzz of mamba_chunk_scan_combined (fp32, CPU): at this one input the three baseline
    samples got the gradient of A (a sum over tokens with cancellation) right to 1-2e-9, while inputs one unit
    roundoff away give the same model ~2e-8 — and mamba's healthy 4.85e-8 (its sign varies from input to input)
    was reported at 4.02x. Which draw of the samples' signs lands that close is chance, so the test takes it to
    its limit: rounding samples that equal the oracle. Without neighbours that is a false alarm; the neighbour
    samples measure the model's error at the nearby inputs: within budget."""
    impl = usable("mamba_ssm.chunk_scan_combined", "float32", True, device)
    case = Case(seqlen=20, nheads=1, headdim=4, ngroups=1, dstate=5, chunk_size=16, D="channel",
                has_dt_bias=False, dt_softplus=False, dt_limit=(0.001, 1.0), initial_states=True, segments=((19,),), padding=(1,),
                return_final_states=False, regime=Regime(decay="typical", scale=0.25, layout="strided"),
                pass_="backward", seed=600)
    inputs = materialize(case, device)
    truth = evaluate(case, inputs)
    with runtime.autotune(0):                                             # as the fuzz that found it ran
        out = impl.run(case, inputs)
    wide = samples.evaluate_samples(case, inputs, truth, evaluate)
    exact = [truth] * samples.SAMPLES                                     # the samples, exact by chance
    assert len(wide) == samples.SAMPLES + samples.NEIGHBOURS
    without = judge(impl.name, case, inputs, out, truth, exact)
    assert not without.ok and without.ratio > 2, without.message()          # the false alarm
    with_neighbours = judge(impl.name, case, inputs, out, truth, exact + wide[samples.SAMPLES:])
    assert with_neighbours.ok, with_neighbours.message()


# Found by a fuzz of mamba_split_conv1d_scan_combined (fp32, interpreter; 2.3.2.post1 and 2.2.2 alike): y of
# out_proj diverged at one element of 76, 1.24x its budget, with a relative RMS error below the baseline's.
# The excess entered before out_proj, in the scan's channel 0 at token 10 (out_proj's weight ~ -1 carries it on):
# four fifths from the depthwise conv (its two taps and bias cancel; their rounding is u times the partial
# sums, and the baseline's samples never moved it) and the rest from dt (softplus as log(exp(x) + 1): the sum
# rounds to u, u / dt relative ~ 20 units; never moved either). Each sample now moves both.
MIXER_CASE = Case(entry="split_conv1d", seqlen=38, nheads=1, headdim=2, ngroups=1, dstate=7, chunk_size=16,
                  D="head", has_dt_bias=True, dt_softplus=True, conv_width=2, activation="silu", d_nonssm=2,
                  out_dim=2, return_final_states=False, regime=Regime(decay="mild", scale=4.0), pass_="forward",
                  seed=51)


@pytest.mark.interpreter(reason="the false alarm is the interpreter's exact fp32 arithmetic (a GPU's fp32 dots are "
                                "TF32, with a budget of its own)")
def test_the_conv_and_softplus_roundings_are_in_the_mixer_budget(device):
    assert_within_budget("mamba_ssm.split_conv1d_combined", MIXER_CASE, device)


# Found by the CPU calibration (mamba_split_conv1d_scan_combined 2.3.2.post1, fp32 backward, identity conv, the
# norm after the gate, 2-wide norm groups): grad D 1.14-1.34x its budget at one element of six, its relative RMS
# error four times the baseline's. The norm's backward kernel takes the component of dy * weight orthogonal to
# the normalized value, a difference of float32 terms far larger than the result; the model normalized in
# float64. The normalized value and its gradient are now float32 rounding points (model.norm).
NORM_CASE = Case(entry="split_conv1d", seqlen=8, nheads=6, headdim=1, ngroups=3, dstate=7, chunk_size=8, D="channel",
                 dt_limit=(0.01, 0.05), segments=((1, 2, 4, 1),), seq_idx_start=1, conv_width=4,
                 activation="identity", d_nonssm=3, rmsnorm=True, norm_before_gate=False, out_dim=8,
                 outproj_bias=True, regime=Regime(decay="none", scale=0.25), pass_="backward", seed=2815)


def test_the_norms_float32_normalized_value_and_its_gradient_are_in_the_mixer_budget(device):
    assert_within_budget("mamba_ssm.split_conv1d_combined", NORM_CASE, device)


def assert_within_budget(name: str, case: Case, device):
    """Implementation ``name`` is within budget on ``case`` (skipped where it cannot run), every autotuned kernel
    under its config 0: what the interpreter runs, and natively one compile per kernel and the same config every
    run (a tuned choice is a benchmark's, and compiles every config first)."""
    impl = usable(name, case.dtype, case.backward, device)
    inputs = materialize(case, device)
    truth = evaluate(case, inputs)
    bases = samples.evaluate_samples(case, inputs, truth, evaluate)
    with runtime.autotune(0):
        out = impl.run(case, inputs)
    verdict = judge(impl.name, case, inputs, out, truth, bases)
    assert verdict.ok, verdict.message()
    return verdict


# The scan's output stored in the case dtype before the gated RMSNorm (harness/budget/, `_mixer`): found by
# the CPU calibration, where 19 fp16 backward cases of one token with a 2-wide norm group were 2-613x their budget
# in the gradients of D, dt_bias, A and the conv, mamba_split_conv1d_scan_combined, its ref and ssdiff's kernel
# agreeing bit for bit (the norm's cancellation amplifies the store's rounding); this one was 135x.
NORM_STORE_CASE = Case(entry="split_conv1d", batch=1, seqlen=1, nheads=1, headdim=2, ngroups=1, dstate=19,
                       chunk_size=4, dtype="float16", conv_width=1, rmsnorm=True, norm_before_gate=False,
                       return_final_states=False, regime=Regime(decay="none"), pass_="backward", seed=0)


@pytest.mark.parametrize("name", ["mamba_ssm.split_conv1d_combined", "mamba_ssm.split_conv1d_ref", "ssdiff.triton"])
def test_the_scan_output_stored_before_the_norm_is_in_the_mixer_budget(name, device):
    assert_within_budget(name, NORM_STORE_CASE, device)


# The z gate's backward reads the pre-gate output as the forward stored it, in the case dtype (harness/budget/,
# `Rounding.gate`): found by an H200 campaign of mamba_ssm's Mamba2 (mem-eff path, no norm, float16, dt > 20,
# scale 4), whose gradients of u and in_proj were Inf at a token where the pre-gate output was 70,190, beyond
# float16's 65,504, while the model had kept it in float32 and judged them finite. mamba_ssm saves that output in
# float16 for its dz kernel; so does any float16 implementation that keeps it for the backward. Minimal: one
# element of grad z, pre-gate 68,228; with the store the model overflows there too and the element is out of range.
GATE_STORE_CASE = Case(seqlen=8, nheads=1, headdim=4, dstate=32, chunk_size=4, dtype="float16", has_z=True,
                       has_dt_bias=True, dt_softplus=True, regime=Regime(decay="none", dt_large=True, scale=4.0),
                       pass_="backward", seed=20)


def test_the_pre_gate_output_the_dz_kernel_reads_is_stored_in_the_dtype(device):
    verdict = assert_within_budget("mamba_ssm.chunk_scan_combined", GATE_STORE_CASE, device)
    assert verdict.tensor("grad.z").out_of_range == 1


# Found by an H200 fuzz of fla's Mamba2 layer in training mode (fla.mamba2_fused, --seed 4; float16, backward):
# the gradient of out_proj's weight was Inf at channels where the oracle's was finite (-8,932). Without the norm,
# mamba_ssm's fused mixer gates inside the scan in float32, but its backward takes out_proj's weight gradient
# from the gated output its dz kernel recomputes from the pre-gate output stored in float16, here 91,440 (the
# gated value fits). mamba_ssm's own layer does the same. Minimal (below): one channel of out_proj's weight, the
# gated output recomputed from an overflowed store; with the recompute the model overflows there too.
OUTPROJ_RECOMPUTE_CASE = Case(entry="layer", seqlen=9, nheads=1, headdim=42, ngroups=1, dstate=23, chunk_size=1,
                              dtype="float16", D="head", return_final_states=False, conv_width=1, rmsnorm=False,
                              rmsnorm_eps=1e-5, d_model=1, bias=True, conv_bias=False,
                              regime=Regime(decay="typical", dt_large=True, scale=4.0), pass_="backward", seed=3426)


def test_out_projs_weight_gradient_reads_the_gated_output_recomputed_from_the_stored_pre_gate_output(device):
    verdict = assert_within_budget("mamba_ssm.mamba2_mem_eff", OUTPROJ_RECOMPUTE_CASE, device)
    assert verdict.tensor("grad.outproj_weight").out_of_range >= 1


def test_a_linear_whose_weight_gradient_reads_the_recomputed_input(device):
    """model._LinearReading: the value and x's gradient of x @ w^T; w's gradient from ``read`` (shared weight,
    and one weight per row as a folded evaluation has)."""
    g = torch.Generator().manual_seed(0)
    drawn = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=g).to(device)
    x, read, up = drawn(2, 5, 7), drawn(2, 5, 7), drawn(2, 5, 3)
    for w in (drawn(3, 7), drawn(2, 3, 7)):
        x_, w_ = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = model._LinearReading.apply(x_, read, w_)
        out.backward(up)
        assert torch.allclose(out, torch.matmul(x, w.transpose(-1, -2)), rtol=1e-13, atol=1e-13)
        assert torch.allclose(x_.grad, torch.matmul(up, w), rtol=1e-13, atol=1e-13)
        d_w = torch.matmul(up.transpose(-1, -2), read)
        assert torch.allclose(w_.grad, d_w.sum(0) if w.dim() == 2 else d_w, rtol=1e-13, atol=1e-13)


# Found by a CPU fuzz of fla's Mamba2.torch_forward (0.6.0; float16, backward): the gradient of in_proj_weight was
# 1.11x its budget at one element of 119 (-1.49e-6 for -1.85e-6), with a relative RMS error a quarter of the
# baseline's. The gradient reaching zxbcdt, held in float16, was a few 1e-7: subnormal, where a rounding errs by up
# to 2^-25 whatever the value, and the samples' relative perturbation (u |t|) never moved it. Each sample now moves
# a value by half the subnormal spacing where that is larger.
SUBNORMAL_CASE = Case(entry="layer", seqlen=1, nheads=1, headdim=7, ngroups=1, dstate=1, chunk_size=8,
                      dtype="float16", D="channel", dt_limit=(0.001, 0.05), return_final_states=False,
                      conv_width=1, rmsnorm=True, norm_before_gate=False, rmsnorm_eps=1e-5, d_model=7,
                      conv_bias=False, regime=Regime(decay="typical", dt_large=True, scale=4.0), pass_="backward",
                      seed=1)


def test_float16_subnormal_gradients_are_in_the_layer_budget(device):
    assert_within_budget("fla.mamba2_torch", SUBNORMAL_CASE, device)


# Found natively (H200, the dev profile's generic property on fla.mamba2_torch, backward, bfloat16): the
# gradients of conv1d_weight, dt_bias and D were 1.16-1.21x their budget, with relative RMS errors 4-5x the
# baseline's. fla's torch_forward runs torch's conv1d in the case dtype and then the activation: the conv output is
# stored before silu, whose slope magnifies that rounding for negative inputs. The same layer in float16 (below,
# dt > 20): y 8.8x its budget before the layer model stored the conv output before its activation, its relative RMS
# error 0.16 against the baseline's 0.005; with the conv computed in float32 instead, 0.0046; with the store, 0.25x.
CONV_STORE_CASE = Case(entry="layer", seqlen=238, nheads=4, headdim=15, ngroups=4, dstate=22, chunk_size=16,
                       dtype="float16", D="head", has_dt_bias=True, dt_softplus=True, return_final_states=False,
                       conv_width=4, rmsnorm=True, norm_before_gate=False, rmsnorm_eps=1e-5, d_model=1, bias=False,
                       conv_bias=False, regime=Regime(decay="typical", dt_large=True, scale=4.0), pass_="backward",
                       seed=15)


def test_the_conv_output_a_layer_stores_before_its_activation_is_in_the_layer_budget(device):
    assert_within_budget("fla.mamba2_torch", CONV_STORE_CASE, device)


def test_the_state_passing_function_is_the_recurrence_with_its_gradient(device):
    """rounding._PassStates (the model's state passing as one function) against torch's own gradient of
    the recurrence state_k = carry_k * state_k-1 + chunk_states_k, in float64 with no rounding point; then the
    chunk states' gradient rounded to the stored dtype, as `Rounding.grad_store` rounds it."""
    g = torch.Generator().manual_seed(0)
    drawn = lambda f, *shape: f(*shape, dtype=torch.float64, generator=g).to(device).requires_grad_(True)
    cs, carry, init = drawn(torch.randn, 2, 5, 1, 3, 4, 2), drawn(torch.rand, 2, 5, 1, 3), drawn(torch.randn, 2, 1, 3, 4, 2)
    run = lambda s, c, i: rounding._PassStates.apply(s, c, i, "float32", None)
    assert torch.autograd.gradcheck(run, (cs, carry, init))
    state, plain = init, []
    for k in range(5):
        state = carry[:, k, ..., None, None] * state + cs[:, k]
        plain.append(state)
    assert torch.allclose(run(cs, carry, init), torch.stack(plain, 1), rtol=1e-13, atol=1e-13)
    # a perturbed sample: each step's sum grown by 1 + u s with the sample's signs s, drawn for all steps at once
    grow = 1.0 + rounding.UNIT["float32"] * rounding.Signs(7919).like(cs)
    state, grown = init, []
    for k in range(5):
        state = (carry[:, k, ..., None, None] * state + cs[:, k]) * grow[:, k]
        grown.append(state)
    perturbed = rounding._PassStates.apply(cs, carry, init, "float32", rounding.Signs(7919))
    assert torch.allclose(perturbed, torch.stack(grown, 1), rtol=1e-13, atol=1e-13)
    assert not torch.equal(perturbed, torch.stack(plain, 1))

    cs32 = cs.detach().float().requires_grad_(True)
    up = torch.randn(2, 5, 1, 3, 4, 2, generator=g).to(device)
    rounding._PassStates.apply(cs32, carry.detach().float(), init.detach().float(), "bfloat16", None).backward(up)
    ref32 = cs.detach().float().requires_grad_(True)
    rounding._PassStates.apply(ref32, carry.detach().float(), init.detach().float(), "float32", None).backward(up)
    assert torch.equal(cs32.grad, rounding.round_to(ref32.grad, "bfloat16"))
    assert not torch.equal(cs32.grad, ref32.grad)


def test_a_sample_moves_a_float16_subnormal_by_half_its_spacing():
    t = torch.tensor([1.5e-6, -3e-7, 0.0, 1.0], dtype=torch.float32)
    moved = rounding.perturb(t, "float16", rounding.Signs(1))
    assert torch.equal((moved - t)[:3].abs(), torch.full((3,), 2.0 ** -25))
    assert float((moved[3] - 1).abs()) == 2.0 ** -11                  # a normal value: u |t|, as before
    assert torch.equal(rounding.perturb(t, "bfloat16", rounding.Signs(1))[2:3], t[2:3])   # no floor in bf16


def test_a_sample_overflows_a_float16_value_within_one_rounding_error_of_overflow(device):
    """Every perturbed sample moves a value within one rounding error of float16's overflow (65520) outward, so
    that it is Inf there, whatever its sign; round to nearest keeps it; a value further in moves as before. (An
    H200 calibration campaign met mamba's fused mixer with the gradient of the activated conv output at 65517.5
    stored as Inf, its zxbcdt gradient Inf where the oracle's was -2384.6, and the model's two perturbed samples
    both moved that value inward: judged, not left out.)"""
    t = torch.tensor([65517.5, -65500.0, 65480.0, 1.0], dtype=torch.float32, device=device)
    assert torch.isfinite(rounding.round_to(t, "float16")).all()
    for seed in range(1, 9):
        perturbed = rounding.perturb(t, "float16", rounding.Signs(seed))
        moved = rounding.round_to(perturbed, "float16")
        assert torch.isinf(moved[:2]).all() and torch.equal(torch.sign(moved[:2]), torch.sign(t[:2]))
        assert torch.isfinite(moved[2:]).all()
        assert float((perturbed[3] - 1).abs()) == 2.0 ** -11
    assert torch.isfinite(rounding.perturb(t, "bfloat16", rounding.Signs(1))).all()


def test_an_inf_where_a_value_within_budget_would_overflow_is_out_of_range_not_a_divergence(device):
    """An Inf of the oracle's sign where the oracle's magnitude plus the element's budget reaches float16's
    overflow (65520) is out of the dtype's range: counted, not judged (an H200 calibration campaign met mamba's
    fused mixer with a float16 conv1d_weight gradient Inf where the oracle's was -65499.2). Far from the edge, or
    a NaN, or an Inf of the other sign, stays a divergence."""
    case = RICH.replace(pass_="forward", final_state_grad=False)
    inputs, truth, bases = prepared(case, device)
    t = truth.outputs["y"].clone()
    samples = [b.outputs["y"].clone() for b in bases]
    edge, far = (0, 3, 0, 0), (1, 17, 2, 1)
    for x in (t, *samples):
        x[edge], x[far] = -65499.2, 30000.0

    def judged_with(at_edge, at_far):
        actual = t.clone()
        actual[edge], actual[far] = at_edge, at_far
        return judge_tensor("y", "output", actual, t, samples, case, inputs)

    tv = judged_with(-math.inf, 30000.0)
    assert tv.status == "ok" and tv.out_of_range == 1, tv.detail
    tv = judged_with(-math.inf, math.inf)
    assert tv.status == "nonfinite" and tv.out_of_budget == 1 and tv.out_of_range == 1, tv.detail
    for wrong in (math.nan, math.inf):
        tv = judged_with(wrong, 30000.0)
        assert tv.status == "nonfinite" and tv.out_of_range == 0, tv.detail


# Found by an H200 replay of fla's chunk_simple_gla (0.6.0; bfloat16, forward; L=257, chunk 256, dt > 20): y at
# the first token of the second chunk was 0 where the oracle's was -2.3e-37 (12x its budget), and the final state
# 0 where it was -1.2e-37 (38x). There the decay from the chunk start is ~8e-40, below float32's smallest normal,
# and a GPU kernel's exp flushes it to zero. Minimal (below): two chunks of one token, the second's x zero, so its
# y and the final state are the first token's state times exp(A dt) alone.
def flush_case(device, log_decay: float):
    """A float32 case whose second token's y and final state are exp(log_decay) times the first token's state
    (1.5e3) and whose first token's y is 0; returns (case, inputs)."""
    case = Case(seqlen=2, nheads=1, headdim=1, dstate=1, chunk_size=1, D="none", has_dt_bias=False,
                dt_softplus=False, regime=Regime(decay="none"))
    inputs = materialize(case, device)
    put = lambda value: torch.full_like(inputs.values["x"][:, :1], value)
    values = dict(inputs.values, A=torch.full_like(inputs.values["A"], -1.0),
                  x=torch.cat([put(5.0), put(0.0)], dim=1),
                  dt=torch.tensor([[[100.0], [-log_decay]]], dtype=torch.float32, device=device),
                  B=torch.full_like(inputs.values["B"], 3.0),
                  C=torch.cat([torch.zeros_like(inputs.values["C"][:, :1]),
                               torch.full_like(inputs.values["C"][:, 1:], 2.0)], dim=1))
    return case, dataclasses.replace(inputs, values=values)


def test_a_decay_factor_below_float32s_smallest_normal_may_be_flushed_to_zero(device):
    """A kernel whose exp flushes exp(A dt) = 6e-39 (subnormal) to zero gives 0 where the oracle's y and final
    state are 1.8e-35: within budget, as the kernel that keeps the factor is. A kernel that zeroes them where the
    factor is 1.8e-35 (a normal float32) is not."""
    for log_decay, flushed_ok in ((-88.0, True), (-80.0, False)):
        case, inputs = flush_case(device, log_decay)
        truth = evaluate(case, inputs)
        bases = samples.evaluate_samples(case, inputs, truth, evaluate)
        t = truth.outputs["y"]
        assert float(t[0, 1].abs().max()) == pytest.approx(1500.0 * 2.0 * math.exp(log_decay), rel=1e-6)
        # round to nearest keeps the factor; the perturbed samples (folded beside it) flush it where it is subnormal
        assert [bool(b.outputs["y"][0, 1].abs().max() == 0) for b in bases[:samples.SAMPLES]] == \
            [False] + [flushed_ok] * (samples.SAMPLES - 1)
        flushed = {"y": t.clone(), "final_states": torch.zeros_like(truth.outputs["final_states"])}
        flushed["y"][0, 1] = 0.0
        for name, kept in truth.outputs.items():
            sampled = [b.outputs[name] for b in bases]
            assert judge_tensor(name, "output", kept, kept, sampled, case, inputs).ok
            tv = judge_tensor(name, "output", flushed[name], kept, sampled, case, inputs)
            assert tv.ok == flushed_ok, (log_decay, name, tv.detail)


def test_the_elements_of_the_largest_ratios_are_listed_when_asked_for(device):
    """``top``: the planted elements, largest ratio first, each with its budget; none of ratio 0; none unasked."""
    case = RICH.replace(pass_="forward", final_state_grad=False)
    inputs, truth, bases = prepared(case, device)
    t = truth.outputs["y"]
    budget, *_ = element_budget(t, [b.outputs["y"] for b in bases], torch.ones_like(t, dtype=torch.bool),
                                axes_of("output", "y", case), case, UNIT_ROUNDOFF[torch.float16])
    actual = t.clone()
    planted = {(1, 17, 2, 1): 10.0, (0, 3, 0, 0): 30.0, (1, 20, 3, 2): 2.0}
    for where, multiple in planted.items():
        actual[where] += multiple * budget[where]
    assert y_of(case, inputs, truth, bases, actual).elements == []
    tv = judge_tensor("y", "output", actual, t, [b.outputs["y"] for b in bases], case, inputs, top=5)
    assert [tuple(e["index"]) for e in tv.elements] == sorted(planted, key=planted.get, reverse=True)
    for e in tv.elements:
        assert e["ratio"] == pytest.approx(planted[tuple(e["index"])], rel=1e-9)
        assert e["budget"] == pytest.approx(float(budget[tuple(e["index"])]), rel=1e-12)
    assert "Its 3 largest ratios to budget:\n    (0, 3, 0, 0) (batch 0, token 3" in tv.message("impl")
    assert tv.to_dict()["elements"] == tv.elements
