"""The Mamba-3 family (the mamba3 entry): added through the Case, the oracle orders, the budget model, the doubles
and the generic machinery the Mamba-2 entries use.

What this file checks (the three orders' agreement and gradcheck are in test_oracle_agreement.py and
test_oracle_gradcheck.py; mamba_ssm's kernels go through the generic property, test_implementations.py, by their
records in harness/sides/adapters/mamba3.py):
- the entry's fields validate with one line naming the field, and a case round-trips through JSON while other
  entries' JSON does not change; cu_seqlens may hold an empty sequence, never a gap;
- prefill-then-decode consistency of the oracle: each order run over [0, k) and then over [k, L) from the four
  final states it returned (angle, SSM, K, V) equals one run (the recurrent order steps token by token);
- the healthy float32 double, forward and through its step function, is within the same-precision budget;
- each planted bug of the double (a trapezoid weight off by one token, an angle cumsum restarting at each chunk, a
  step dropping the K state it carries) is found by a short default campaign, in the outputs its feature feeds,
  and the feature ablation names what it needs.

The Mamba3 module (the mamba3_layer entry; its oracle's agreement and gradcheck are in the same two files):
- its fields validate in one line, and its scan is a valid mamba3 case;
- prefill-then-decode consistency of its oracle: the chunked order over [0, L - k) and k recurrence steps from
  the four states it returned equal the whole-sequence truth;
- the float32 double of the module, forward, backward and decoded, is within budget; its planted B/C norm over all
  groups is found by a default campaign, with ngroups > 1 as its trigger, and its step dropping the K state in the
  decoded tokens, with layer_steps as its trigger;
- the adapter of mamba_ssm's Mamba3 (a GPU-only kernel) maps every parameter of the module it builds to a case
  tensor of the same shape, and the MIMO record says in one line why it is not driven; with the module's two
  GPU-only kernels replaced by float32 doubles of their contracts, the adapter's glue is within budget on the CPU;
- repro.py's own account of the module passes the healthy double and diverges on the planted bug.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ssdiff import runtime

runtime.configure()                     # before any kernel module is imported

from ssdiff.examine import Examiner  # noqa: E402
from ssdiff.model import features  # noqa: E402
from ssdiff.model.bounds import Bounds  # noqa: E402
from ssdiff.model.case import Case, CaseError, Regime  # noqa: E402
from ssdiff.model.strategies import cases  # noqa: E402
from ssdiff.testing import ONE_CONFIG, agrees_with_oracle, examples, found_by_campaign, state_continuation  # noqa: E402
from ssdiff.inputs import materialize  # noqa: E402
from ssdiff import truth  # noqa: E402
from ssdiff.truth import mamba3_layer  # noqa: E402

BOUNDS = Bounds(max_batch=2, max_seqlen=20, max_nheads=4, max_headdim=4, max_dstate=8, chunk_sizes=(4, 8))
# the step bug's campaign localizes its finding (the feature ablation examines a case per feature): shorter cases
SMALL = Bounds(max_batch=2, max_seqlen=10, max_nheads=2, max_headdim=4, max_dstate=8, chunk_sizes=(4,))
M3 = dict(entry="mamba3", has_dt_bias=False, dt_softplus=False)


# ---- the Case ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, words", [
    (dict(M3, dstate=5), "dstate=5 (headdim_qk) must be even"),
    (dict(M3, dstate=2), "dstate=2 (headdim_qk) must be even with at least one rotated pair at rope_fraction 0.5"),
    (dict(M3, rope_fraction=0.25), "rope_fraction=0.25 must be 0.5 or 1"),
    (dict(entry="mamba3"), "has_dt_bias / dt_softplus / dt_limit: the mamba3 entry takes DT already processed"),
    (dict(M3, D="channel"), "D: the mamba3 entry's D is per head"),
    (dict(M3, batch=2, segments=((16,), (16,))), "segments: the mamba3 entry packs sequences as cu_seqlens"),
    (dict(M3, seqlen=4, mamba3_steps=5), "mamba3_steps=5 must satisfy 0 <= mamba3_steps <= seqlen=4"),
    (dict(M3, mamba3_steps=2, pass_="backward"), "mamba3_steps: decoding is forward only"),
    (dict(mamba3_steps=2), "mamba3_steps=2 is only meaningful for entry 'mamba3'"),
    (dict(rope_fraction=1.0), "rope_fraction=1.0 is only meaningful for entry 'mamba3'"),
])
def test_mamba3_fields_are_validated_with_one_line_naming_the_field(fields, words):
    with pytest.raises(CaseError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Case(**fields)


def test_a_mamba3_case_round_trips_and_other_entries_json_is_unchanged():
    case = Case(**M3, seqlen=9, dstate=6, rope_fraction=1.0, mamba3_steps=3, initial_states=True)
    assert Case.from_json(case.to_json()) == case
    assert case.rope_angles == 3 and "rope=1 steps=3" in case.describe()
    assert "rope_fraction" not in Case().to_dict() and "mamba3_steps" not in Case().to_dict()


def test_an_empty_sequence_switches_off_as_a_feature_and_cu_seqlens_take_no_gaps():
    case = Case(**M3, seqlen=9, segments=((4, 0, 5),), initial_states=True)
    assert "empty_sequence" in features.present(case)
    assert features.switch_off(case, "empty_sequence").segments == ((4, 5),)
    with pytest.raises(CaseError, match="the mamba3 entry's sequences are cu_seqlens"):
        Case(**M3, seqlen=10, segments=((4, 5),), gaps=((1,),))


# ---- the oracle: prefill then decode ----------------------------------------------------------------------

@settings(max_examples=examples(6, 6))
@given(cases(entry="mamba3", backward=False, bounds=BOUNDS).filter(lambda c: c.segments is None and c.seqlen > 1),
       st.integers(1, BOUNDS.max_seqlen - 1))
@example(Case(**M3, batch=2, seqlen=11, nheads=4, ngroups=2, dstate=8, chunk_size=4, has_z=True, initial_states=True,
              rope_fraction=1.0, regime=Regime(decay="mild")), 5)
def test_each_oracle_order_continues_from_its_four_final_states(device, case, split):
    state_continuation(case, device, min(split, case.seqlen - 1))


# ---- the double within budget -----------------------------------------------------------------------------

@settings(max_examples=examples(3, 6))
@given(cases(entry="mamba3", dtypes=("float32", "bfloat16"), bounds=BOUNDS))
@example(Case(**M3, batch=2, seqlen=13, nheads=2, headdim=4, dstate=4, chunk_size=4, initial_states=True,
              mamba3_steps=4, has_z=True, seed=2))
# dt > 20 turns a pair by up to 20 pi a token: an angle carried unreduced between chunks lost float32 accuracy
# (1.43x on grad k) where the kernels reduce it mod 2 pi
@example(Case(**M3, batch=2, seqlen=16, nheads=6, ngroups=6, headdim=8, dstate=6, chunk_size=4, D="none", has_z=True,
              initial_states=True, return_final_states=False, rope_fraction=1.0, pass_="backward",
              regime=Regime(decay="none", dt_large=True, scale=4.0), seed=4322))
def test_the_float32_mamba3_double_is_within_budget(device, case):
    with Examiner(["ssdiff.sides.doubles:mamba3_kernel"], device) as examiner:
        agrees_with_oracle(examiner, case, ONE_CONFIG)


# ---- planted bugs: found by a default campaign ------------------------------------------------------------

def failing(finding, spec: str) -> set:
    return {t.name for t in finding.outcome.verdicts[spec].failing}


def test_a_trapezoid_weight_off_by_one_token_is_found(tmp_path, device):
    spec = "ssdiff.sides.doubles:mamba3_trap_shift_bug"
    finding, report = found_by_campaign(spec, tmp_path, device, "mamba3", BOUNDS, max_examples=20)
    assert finding.outcome.case.seqlen > 1 and failing(finding, spec), finding.outcome.case.describe()


def test_an_angle_cumsum_that_restarts_at_each_chunk_is_found_past_the_first_chunk(tmp_path, device):
    spec = "ssdiff.sides.doubles:mamba3_angle_restart_bug"
    finding, report = found_by_campaign(spec, tmp_path, device, "mamba3", BOUNDS, max_examples=20)
    case = finding.outcome.case
    assert case.seqlen - case.mamba3_steps > case.chunk_size, case.describe()    # a second chunk in the prefill
    tokens = [c["tokens"] for c in finding.localization["per_side"][spec]["coordinates"] if "tokens" in c]
    assert tokens and all(t["first"] >= case.chunk_size for t in tokens), tokens  # nothing wrong in the first chunk


def test_a_step_that_drops_the_k_state_it_carries_is_found_in_the_decoded_tokens(tmp_path, device):
    spec = "ssdiff.sides.doubles:mamba3_step_drops_k_bug"
    # a forward campaign (decoding is forward only); a strong decay hides it (e^adt ~ 0 scales the carried term)
    finding, report = found_by_campaign(spec, tmp_path, device, "mamba3", SMALL, max_examples=40, pass_="forward")
    case = finding.outcome.case
    assert case.mamba3_steps >= 1 and "mamba3_steps" in finding.localization["features"]["trigger"], case.describe()
    tokens = [c["tokens"] for c in finding.localization["per_side"][spec]["coordinates"] if "tokens" in c]
    assert tokens and all(t["first"] >= case.seqlen - case.mamba3_steps for t in tokens), tokens


def test_a_prefill_angle_state_returned_in_the_case_dtype_is_found(tmp_path, device):
    """The class of mamba_ssm's mamba3_siso_combined returning its final angle in bf16 (harness/BENCHMARKS.md): the
    double rounds the prefill's angle state to the case dtype, so half precision finds it, in the final angle or in
    what the decoded tokens rotate with it."""
    spec = "ssdiff.sides.doubles:mamba3_angle_state_bug"
    finding, report = found_by_campaign(spec, tmp_path, device, "mamba3", SMALL, max_examples=60, pass_="forward")
    case = finding.outcome.case
    assert case.dtype != "float32" and (case.return_final_states or case.mamba3_steps), case.describe()
    assert failing(finding, spec) & {"final_angle", "final_states", "final_k", "y"}, failing(finding, spec)


# ---- the Mamba3 module (mamba3_layer) ---------------------------------------------------------------------

M3L = dict(entry="mamba3_layer", return_final_states=False, rmsnorm_eps=1e-5)


@pytest.mark.parametrize("fields, words", [
    (dict(M3L, dstate=6, d_model=8, nheads=2, headdim=3), "d_model=8 must divide d_inner = nheads * headdim = 6"),
    (dict(M3L, has_dt_bias=False), "has_dt_bias / dt_softplus / dt_limit: a Mamba3 module always adds dt_bias"),
    (dict(M3L, D="none"), "D: a Mamba3 module's D is per head"),
    (dict(M3L, has_z=True), "has_z / initial_states / return_final_states: a Mamba3 module takes z from in_proj"),
    (dict(M3L, mamba3_steps=2), "mamba3_steps=2: a mamba3_layer decodes through layer_steps"),
    (dict(M3L, seqlen=4, layer_steps=4), "layer_steps=4 must satisfy 0 <= layer_steps < seqlen=4"),
    (dict(M3L, layer_steps=2, pass_="backward"), "layer_steps: decoding is forward only"),
    (dict(M3L, norm_before_gate=False), "norm_before_gate: a Mamba3 module's output norm gates after normalizing"),
    (dict(M3L, dstate=5), "the scan of this Mamba3 module: dstate=5 (headdim_qk) must be even"),
])
def test_mamba3_layer_fields_are_validated_with_one_line_naming_the_field(fields, words):
    with pytest.raises(CaseError, match=re.escape(words)):
        Case(**fields)


def test_a_mamba3_layer_case_round_trips_and_its_scan_is_a_mamba3_case():
    case = Case(**M3L, seqlen=9, dstate=6, d_model=4, rope_fraction=1.0, rmsnorm=True, layer_steps=3)
    assert Case.from_json(case.to_json()) == case
    assert "d_model=4 outproj_norm steps=3 rope=1" in case.describe()
    scan = case.mamba3_scan
    assert (scan.entry, scan.mamba3_steps, scan.has_z, scan.rope_angles) == ("mamba3", 3, False, 3)


@settings(max_examples=examples(6, 6))
@given(cases(entry="mamba3_layer", backward=False, bounds=BOUNDS).filter(lambda c: c.segments is None and c.seqlen > 1),
       st.integers(1, BOUNDS.max_seqlen - 1))
@example(Case(**M3L, batch=2, seqlen=11, nheads=4, ngroups=2, dstate=8, chunk_size=4, d_model=8, rmsnorm=True,
              rope_fraction=1.0, regime=Regime(decay="mild")), 5)
def test_the_mamba3_module_oracle_decodes_to_its_whole_sequence_truth(device, case, split):
    """Its chunked order over a prefill, then one `mamba3.step` per token from the four states the prefill returned
    (as generation runs the module), gives the output of the whole sequence in one forward."""
    inputs = materialize(case, device)
    t = inputs.float64()
    whole = truth.call("ref.recurrent", case, t, inputs.seq_idx).outputs["y"]
    decoded = mamba3_layer.decode(case, t, min(split, case.seqlen - 1)).outputs["y"]
    assert torch.allclose(decoded, whole, rtol=1e-10, atol=1e-12 * float(whole.abs().max())), \
        float((decoded - whole).abs().max())


@settings(max_examples=examples(3, 6))
@given(cases(entry="mamba3_layer", dtypes=("float32", "bfloat16"), bounds=BOUNDS))
@example(Case(**M3L, batch=2, seqlen=13, nheads=2, ngroups=2, headdim=4, dstate=4, chunk_size=4, d_model=4,
              layer_steps=3, seed=3))
@example(Case(**M3L, seqlen=12, nheads=4, ngroups=2, headdim=2, dstate=6, chunk_size=4, d_model=8, rmsnorm=True,
              segments=((5, 0, 7),), dtype="bfloat16", pass_="backward", seed=5))
def test_the_float32_mamba3_module_double_is_within_budget(device, case):
    with Examiner(["ssdiff.sides.doubles:mamba3_layer"], device) as examiner:
        agrees_with_oracle(examiner, case, ONE_CONFIG)


def test_a_b_c_norm_over_all_groups_is_found_with_groups_as_its_trigger(tmp_path, device):
    spec = "ssdiff.sides.doubles:mamba3_layer_bc_norm_bug"
    finding, report = found_by_campaign(spec, tmp_path, device, "mamba3_layer", BOUNDS, max_examples=30)
    case = finding.outcome.case
    assert case.ngroups > 1 and failing(finding, spec), case.describe()
    assert "groups" in finding.localization["features"]["trigger"], finding.localization["features"]


def test_a_module_step_that_drops_the_k_state_is_found_in_the_decoded_tokens(tmp_path, device):
    spec = "ssdiff.sides.doubles:mamba3_layer_step_drops_k_bug"
    finding, report = found_by_campaign(spec, tmp_path, device, "mamba3_layer", SMALL, max_examples=80,
                                        pass_="forward")
    case = finding.outcome.case
    assert case.layer_steps >= 1 and "layer_steps" in finding.localization["features"]["trigger"], case.describe()
    tokens = [c["tokens"] for c in finding.localization["per_side"][spec]["coordinates"] if "tokens" in c]
    assert tokens and all(t["first"] >= case.seqlen - case.layer_steps for t in tokens), tokens


def test_the_mamba3_module_adapter_gives_every_parameter_of_its_module_a_case_tensor_of_its_shape(device):
    from ssdiff.sides.registry import get

    impl = get("mamba_ssm.mamba3_module")
    for case in (Case(**M3L, seqlen=5, nheads=4, ngroups=2, headdim=4, dstate=8, d_model=8, rmsnorm=True),
                 Case(**M3L, seqlen=5, nheads=2, headdim=8, dstate=4, d_model=4, rope_fraction=1.0)):
        module = impl.build(case)
        given_ = impl.parameters(case, materialize(case, device).native())
        assert {n: tuple(p.shape) for n, p in module.named_parameters()} == \
            {n: tuple(t.shape) for n, t in given_.items()}, case.describe()
    mimo = get("mamba_ssm.mamba3_module_mimo").unavailable()
    assert mimo and "\n" not in mimo and "SISO only" in mimo, mimo


def _combined_standin(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, chunk_size=64,
                      Input_States=None, return_final_states=False, cu_seqlens=None, **_):
    """mamba3_siso_combined's contract (harness/sides/adapters/mamba3.py) computed by the float32 scan double."""
    from ssdiff.sides.doubles import Mamba3Kernel

    b, L, h, p = V.shape
    g, n, a = Q.shape[2], Q.shape[3], Angles.shape[-1]
    bounds = None if cu_seqlens is None else [int(v) for v in cu_seqlens]
    scan = Case(entry="mamba3", batch=b, seqlen=L, nheads=h, headdim=p, ngroups=g, dstate=n, chunk_size=chunk_size,
                D="none" if D is None else "head", has_z=Z is not None, has_dt_bias=False, dt_softplus=False,
                segments=None if bounds is None else (tuple(e - s for s, e in zip(bounds, bounds[1:])),),
                return_final_states=return_final_states,
                rope_fraction=next(f for f in (0.5, 1.0) if (int(n * f) // 2 * 2) // 2 == a))
    t = dict(q=Q, k=K, v=V, adt=ADT.transpose(1, 2), dt=DT.transpose(1, 2), trap=Trap.transpose(1, 2), q_bias=Q_bias,
             k_bias=K_bias, angles=Angles, D=D, z=Z)
    out, _ = Mamba3Kernel().compute(scan, {k: v.float() for k, v in t.items() if v is not None}, None)
    if not return_final_states:
        return out["y"].to(V.dtype)
    return (out["y"].to(V.dtype), out["final_angle"], out["final_states"], out["final_k"], out["final_v"].to(V.dtype))


def _step_standin(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj=None, state_out=None, out=None,
                  z=None, zproj=None, **_):
    """mamba3_step_fn's contract (SISO: rank 1, the projections ones): the state updated in place by the trapezoid
    from the K and V states and this token's rotated B, y = S C + D x (gated by z where given) written to ``out``."""
    alpha = torch.exp(A * dt)
    carried = (alpha * dt * (1 - trap))[..., None, None] * Xstate.float()[..., None] * Bstate[:, 0].float()[:, :, None]
    own = (dt * trap)[..., None, None] * x.float()[..., None] * B[:, 0].float()[:, :, None]
    state.copy_(alpha[..., None, None] * state + carried + own)
    y = torch.einsum("bhpn,bhn->bhp", state, C[:, 0].float()) + D[:, None] * x.float()
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    out.copy_(y if outproj is not None else y[:, None])


def test_the_mamba3_module_adapter_drives_the_module_with_the_case_weights(monkeypatch, device):
    """The adapter's glue (the parameter map, cu_seqlens, the prefill's cache and the step() loop) around the real
    module, its two GPU-only kernels replaced by the float32 doubles of their contracts above (the rotary step
    kernel and the norms are mamba_ssm's own): within budget of the oracle, forward, backward and decoded."""
    import dataclasses

    from ssdiff.sides.adapters import mamba3_module
    from ssdiff.sides.registry import get

    module = mamba3_module.mamba3_module()
    monkeypatch.setattr(module, "mamba3_siso_combined", _combined_standin)
    monkeypatch.setattr(module, "mamba3_step_fn", _step_standin)
    impl = get("mamba_ssm.mamba3_module")
    monkeypatch.setattr(impl, "unavailable", lambda: None)
    monkeypatch.setattr(impl, "capabilities", dataclasses.replace(impl.capabilities, devices=frozenset({"cpu", "cuda"}),
                                                                  dtypes=frozenset({"float32"})))
    shared = dict(M3L, nheads=2, headdim=4, chunk_size=16, d_model=4)
    for case in (Case(**shared, seqlen=20, ngroups=2, dstate=8, segments=((7, 0, 13),), seed=1),
                 Case(**shared, seqlen=9, rmsnorm=True, rope_fraction=1.0, dstate=4, pass_="backward", seed=2),
                 Case(**shared, batch=2, seqlen=10, dstate=8, layer_steps=4, seed=3),
                 Case(**shared, batch=2, seqlen=10, dstate=8, rmsnorm=True, layer_steps=2, seed=4)):
        with Examiner([impl.name], device) as examiner:
            agrees_with_oracle(examiner, case, ONE_CONFIG)


def test_a_mamba3_layer_repro_passes_the_healthy_double_and_diverges_on_the_planted_bug(tmp_path, device):
    """repro.py's own float64 account of the module (its template) judges as ssdiff does: the healthy double within
    the budgets it recorded, the B/C norm over all groups out of them."""
    import os
    import subprocess
    import sys

    from ssdiff.reproduce import repro

    case = Case(**M3L, seqlen=9, nheads=2, ngroups=2, headdim=2, dstate=4, chunk_size=4, d_model=4, rmsnorm=True,
                pass_="backward")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # its sides come through this ssdiff
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    for spec, code in (("ssdiff.sides.doubles:mamba3_layer", 0), ("ssdiff.sides.doubles:mamba3_layer_bc_norm_bug", 1)):
        with Examiner([spec], device) as examiner:
            outcome = examiner.examine(case)
        path = repro.write(tmp_path / f"repro_{code}.py", case, [spec], outcome.inputs, outcome.truth,
                           outcome.baseline, 4.0, "the mamba3_layer repro")
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=300)
        assert run.returncode == code and ("DIVERGES" in run.stdout) == bool(code), run.stdout + run.stderr
