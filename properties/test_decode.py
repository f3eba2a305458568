"""The decode entry: a prefill, then single-token steps of a step kernel, judged token by token.

What this file checks:
- the Case's decode fields validate (1 <= decode_steps <= seqlen, decode only, forward only, no seq_idx) and
  cases without them load as before;
- the oracle side: the prefill state is ref.recurrent's state after the prefill (to the state dtype's rounding),
  the three evaluation orders agree on the decoded tokens and the final state, and decoding every token equals
  the chunk scan's output;
- the healthy float32 step double is within budget on generated decode cases (the step kernels, mamba_ssm's and
  vLLM's selective_state_update, are checked against the oracle by the generic property, test_implementations.py,
  through their testing records: DECODE in harness/sides/adapters/mamba_ssm.py);
- each planted step bug (the state not decayed before the update; a group read by the wrong heads) is found by a
  short fuzz campaign and localized to the decoded tokens: the failing outputs are y and/or the final state, and
  a group bug sits on the misgrouped heads.

Divergence has one definition: harness/verdict/judge.py's `judge` through ssdiff.examine.Examiner.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, note

from ssdiff import runtime

runtime.configure()                     # before any kernel module is imported

from ssdiff.model.case import Case, CaseError, Regime  # noqa: E402
from ssdiff.examine import Examiner  # noqa: E402
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer  # noqa: E402
from ssdiff.inputs import materialize  # noqa: E402
from ssdiff.model.dtypes import TORCH_DTYPES, UNIT_ROUNDOFF  # noqa: E402
from ssdiff.truth import evaluate, recurrent  # noqa: E402
from ssdiff.model.bounds import Bounds  # noqa: E402
from ssdiff.model.strategies import cases  # noqa: E402
from ssdiff.testing import ONE_CONFIG, RTOL, assert_close, oracles_agree  # noqa: E402

DTYPES = tuple(runtime.runnable_dtypes())
# Each decode step is one kernel launch (batch * nheads programs under the interpreter): small shapes there.
BOUNDS = Bounds(max_batch=2, max_seqlen=12, max_nheads=4, max_headdim=6, max_dstate=8) if runtime.interpreted() \
    else Bounds(max_batch=4, max_seqlen=64, max_nheads=16, max_headdim=64, max_dstate=128)


def decode_cases(**kw):
    return cases(entry="decode", dtypes=kw.pop("dtypes", DTYPES), bounds=kw.pop("bounds", BOUNDS), **kw)


# ---- the Case ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, words", [
    (dict(entry="decode", seqlen=4, decode_steps=5), "decode_steps=5 must satisfy 1 <= decode_steps <= seqlen=4"),
    (dict(entry="decode", seqlen=4, decode_steps=0), "decode_steps=0 must satisfy"),
    (dict(seqlen=4, decode_steps=2), "decode_steps=2 is only meaningful for entry 'decode'"),
    (dict(state_dtype="float16"), "state_dtype='float16' is only meaningful for entry 'decode'"),
    (dict(entry="decode", state_dtype="float64"), "state_dtype: expected one of"),
    (dict(entry="decode", pass_="backward"), "the decode entry is forward only"),
    (dict(entry="decode", seqlen=4, segments=((2, 2),)), "the decode entry has one sequence per batch row"),
])
def test_decode_fields_are_validated_with_one_line_naming_the_field(fields, words):
    with pytest.raises(CaseError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Case(**fields)


def test_a_case_without_the_decode_fields_loads_as_before_and_a_decode_case_round_trips():
    old = Case.from_json('{"entry": "chunk_scan", "batch": 1, "seqlen": 16, "nheads": 2, "headdim": 4, '
                         '"ngroups": 1, "dstate": 4, "chunk_size": 8, "dtype": "float32"}')
    assert old == Case()
    case = Case(entry="decode", batch=2, seqlen=7, decode_steps=3, state_dtype="float16", state_batch_indices=True)
    assert Case.from_json(case.to_json()) == case
    assert "steps=3" in case.describe() and case.prefill_len == 4


# ---- the oracle -------------------------------------------------------------------------------------------

@given(decode_cases(dtypes=("float32", "float16", "bfloat16")))
def test_the_prefill_state_is_the_recurrent_state_after_the_prefill(device, case):
    """inputs' prefill state (the chunked order's) equals ref.recurrent's state after the first seqlen -
    decode_steps tokens, up to rounding it to the state dtype (a value on a rounding boundary may go either way)."""
    inputs = materialize(case, device)
    t = inputs.float64()
    P = case.prefill_len
    assume(P > 0)
    cut = lambda name: t[name][:, :P] if name in t else None
    state = recurrent.scan(cut("x"), cut("dt"), t["A"], cut("B"), cut("C"), chunk_size=case.chunk_size,
                           dt_bias=t.get("dt_bias"), dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
                           initial_states=t.get("initial_states")).outputs["final_states"]
    dtype = TORCH_DTYPES[case.state_dtype]
    info = torch.finfo(dtype)                           # subnormals: a spacing of tiny * eps
    assert torch.allclose(inputs.values["state"], state, rtol=2 * UNIT_ROUNDOFF[dtype], atol=info.tiny * info.eps), \
        case.describe()
    assert inputs.dtypes["state"] == TORCH_DTYPES[case.state_dtype]


@given(decode_cases(dtypes=("float32", "float16", "bfloat16")))
@example(Case(entry="decode", batch=2, seqlen=5, nheads=4, ngroups=2, headdim=3, dstate=5, decode_steps=5, D="channel",
              has_z=True, initial_states=True, state_batch_indices=True, regime=Regime(decay="strong")))
def test_the_three_oracle_orders_agree_on_decoded_tokens(device, case):
    oracles_agree(case, device)


@given(decode_cases(dtypes=("float32",)))
def test_decoding_every_token_is_the_chunk_scan(device, case):
    """With decode_steps = seqlen (no prefill) and a float32 state, the decoded y and final state are the chunk
    scan's on the same values (the same draws: the decode entry draws the chunk scan's inputs)."""
    case = case.replace(decode_steps=case.seqlen, state_dtype="float32")
    scan = case.replace(entry="chunk_scan", decode_steps=1, state_dtype="float32", state_batch_indices=False,
                        return_final_states=True)
    decoded, whole = evaluate(case, materialize(case, device)), evaluate(scan, materialize(scan, device))
    assert_close("decoded y vs chunk scan y", decoded.outputs["y"], whole.outputs["y"], RTOL, case)
    assert_close("decoded final state vs chunk scan", decoded.outputs["final_states"], whole.outputs["final_states"],
                 RTOL, case)


# ---- step kernels within budget ---------------------------------------------------------------------------

def assert_within_budget(spec: str, case: Case, device: str):
    with Examiner([spec], device) as examiner:
        outcome = examiner.examine(case, ONE_CONFIG)
    verdict = outcome.verdicts[spec]
    note(f"case: {case.to_json(indent=None)}; ratio {verdict.ratio:.3g}")
    assert verdict.ok, f"{verdict.message()}\ncase: {case.to_json(indent=None)}"


@given(decode_cases())
@example(Case(entry="decode", batch=2, seqlen=6, nheads=6, ngroups=3, headdim=5, dstate=7, decode_steps=4, D="none",
              has_z=True, has_dt_bias=False, state_batch_indices=True, regime=Regime(decay="mild", scale=4.0)))
def test_the_float32_step_double_is_within_budget(device, case):
    assert_within_budget("ssdiff.sides.doubles:step", case, device)


# ---- planted step bugs: found and localized to the decoded tokens ------------------------------------------

def campaign(spec: str, out, device: str, **kw):
    config = FuzzConfig(impl=spec, entry="decode", out_dir=str(out), device=device, report_dir=None, max_time=None,
                        max_examples=kw.pop("max_examples", 100), seed=kw.pop("seed", 3), minimize=False,
                        dtypes=("float32",), bounds=BOUNDS, **kw)
    report = Fuzzer(config).run()
    assert report.exit_code == 1, f"nothing found in {report.tried} cases ({report.stopped})"
    return report.findings[0]


def failing_outputs(finding, spec: str) -> set:
    return {t.name for t in finding.outcome.verdicts[spec].failing}


def test_a_state_not_decayed_before_the_update_is_found_in_the_decoded_tokens(tmp_path, device):
    spec = "ssdiff.sides.doubles:step_no_decay_bug"
    finding = campaign(spec, tmp_path, device)
    assert failing_outputs(finding, spec) <= {"y", "final_states"} and failing_outputs(finding, spec)
    side = finding.localization["per_side"][spec]
    coords = {c["tensor"]: c for c in side["coordinates"]}
    assert set(coords) <= {"y", "final_states"} and coords
    if "y" in coords:                                   # the decoded tokens, as steps and sequence positions
        case = finding.outcome.case
        tokens = coords["y"]["tokens"]
        assert case.prefill_len <= tokens["first"] <= tokens["last"] < case.seqlen, coords["y"]["text"]
        assert set(coords["y"]["decode_steps"]) <= set(range(case.decode_steps)), coords["y"]["text"]


def test_a_group_read_by_the_wrong_heads_is_found_on_the_misgrouped_heads(tmp_path, device):
    spec = "ssdiff.sides.doubles:step_group_bug"
    finding = campaign(spec, tmp_path, device, max_examples=200)
    case = finding.outcome.case
    assert failing_outputs(finding, spec) <= {"y", "final_states"} and failing_outputs(finding, spec)
    r = case.heads_per_group
    misgrouped = {h for h in range(case.nheads) if h % case.ngroups != h // r}
    for coords in finding.localization["per_side"][spec]["coordinates"]:
        assert set(coords["heads"]) <= misgrouped and coords["heads"], coords["text"]
    assert "groups" in finding.localization["features"]["trigger"]


def test_a_planted_step_bug_minimizes_to_a_small_decode_case_whose_repro_diverges(tmp_path, device):
    """The minimizer shrinks decode steps and the prefill with the rest; repro.py (its float64 oracle runs the
    prefill, rounds the state to its dtype and decodes from it) exits non-zero while the bug is there."""
    import os
    import subprocess
    import sys

    from ssdiff.investigate.minimize import minimize_outcome

    spec = "ssdiff.sides.doubles:step_no_decay_bug"
    start = Case(entry="decode", batch=2, seqlen=7, nheads=4, ngroups=2, headdim=3, dstate=5, decode_steps=3,
                 D="channel", has_z=True, state_batch_indices=True, state_dtype="float16")
    with Examiner([spec], device) as examiner:
        outcome = examiner.examine(start)
        assert not outcome.verdicts[spec].ok
        minimized = minimize_outcome(examiner, outcome, str(tmp_path), max_runs=60)
    small = minimized.minimal
    assert small.entry == "decode" and small.decode_steps == 1 and small.batch == 1 and small.nheads == 1
    assert small.prefill_len >= 1 or small.initial_states     # a decay bug needs a state to decay
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # its sides come through this ssdiff
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(tmp_path / "repro.py")], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 1 and "DIVERGES" in run.stdout, run.stdout + run.stderr
