"""The layer entry: a whole Mamba-2 layer (in_proj, conv1d, SSD, gated RMSNorm, out_proj) with one set of weights
loaded into every implementation, judged output and every parameter's gradient.

What this file checks:
- the Case's layer fields validate (d_model divides d_inner, no initial / final states, layer-only fields) and a
  layer case round-trips through JSON, while cases of other entries load as before;
- the oracle side: the three evaluation orders agree on the layer, and the layer oracle is the mixer oracle on
  in_proj's output (so the mixer's checks carry over);
- the healthy float32 layer double is within budget (every layer implementation is checked against the oracle by
  the generic property, test_implementations.py, through its testing record: LAYER in
  harness/sides/adapters/layer_loading.py);
- decoding (layer_steps: a prefill through forward() with an inference cache, then one token per step()) gives
  the layer's output for the same tokens, judged like it (mamba_ssm's Mamba2; the other layers' decoding is not
  driven);
- the weights are the case's: every implementation computes with exactly them (a changed weight changes y);
- a planted bug (the gated RMSNorm over the wrong group size) is found by a short fuzz campaign, localized to
  the norm (the first divergent stage is "normed", the trigger needs ngroups > 1 and rmsnorm), minimized, and
  its repro.py diverges.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings

from ssdiff import runtime

runtime.configure()                     # before any kernel module is imported

from ssdiff import truth  # noqa: E402
from ssdiff.model.case import Case, CaseError, Regime  # noqa: E402
from ssdiff.examine import Examiner  # noqa: E402
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer  # noqa: E402
from ssdiff.sides.registry import all_implementations, get  # noqa: E402
from ssdiff.inputs import materialize  # noqa: E402
from ssdiff.sides.base import fit_case  # noqa: E402
from ssdiff.model.bounds import Bounds  # noqa: E402
from ssdiff.model.strategies import cases  # noqa: E402
from ssdiff.testing import ONE_CONFIG, RTOL, assert_close, oracles_agree  # noqa: E402

DTYPES = tuple(runtime.runnable_dtypes())
# A layer runs in_proj, the conv, five SSD kernels, the norm and out_proj: small shapes under the interpreter.
BOUNDS = Bounds(max_batch=2, max_seqlen=20, max_nheads=4, max_headdim=6, max_dstate=6, chunk_sizes=(4, 8, 16)) \
    if runtime.interpreted() else Bounds(max_batch=2, max_seqlen=256, max_nheads=16, max_headdim=64, max_dstate=64)
LAYERS = sorted(impl.name for impl in all_implementations()
                if "layer" in impl.capabilities.entries and not impl.name.startswith("ref."))


def layer_cases(**kw):
    return cases(entry="layer", dtypes=kw.pop("dtypes", DTYPES), bounds=kw.pop("bounds", BOUNDS), **kw)


LAYER = dict(entry="layer", return_final_states=False, rmsnorm_eps=1e-5, norm_before_gate=False)


# ---- the Case ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, words", [
    (dict(LAYER, nheads=2, headdim=4, d_model=3), "d_model=3 must divide d_inner"),
    (dict(LAYER, initial_states=True), "no layer implementation has learnable initial states"),
    (dict(LAYER, return_final_states=True), "a layer returns only its output"),
    (dict(LAYER, out_dim=4), "a layer's out_proj is always d_inner -> d_model"),
    (dict(LAYER, activation="identity"), "a Mamba-2 layer always uses silu"),
    (dict(LAYER, seqlen=4, layer_steps=4), "layer_steps=4 must satisfy 0 <= layer_steps < seqlen=4"),
    (dict(LAYER, seqlen=4, layer_steps=1, segments=((2, 2),)), "a decoded layer has one sequence per batch row"),
    (dict(LAYER, seqlen=4, layer_steps=1, pass_="backward"), "decoding is forward only"),
    (dict(d_model=4), "d_model=4 is only meaningful for entry 'layer'"),
    (dict(bias=True), "bias=True is only meaningful for entry 'layer'"),
])
def test_layer_fields_are_validated_with_one_line_naming_the_field(fields, words):
    with pytest.raises(CaseError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Case(**fields)


def test_a_layer_case_round_trips_and_other_entries_keep_their_json():
    case = Case(**LAYER, nheads=2, headdim=3, d_nonssm=2, d_model=4, bias=True, conv_bias=False, rmsnorm=True)
    assert Case.from_json(case.to_json()) == case
    assert case.d_inner == 8 and case.expand == 2 and "d_model=4 expand=2" in case.describe()
    assert "d_model" not in Case().to_dict() and "bias" not in Case(entry="split_conv1d").to_dict()


# ---- the oracle -------------------------------------------------------------------------------------------

@given(layer_cases(dtypes=("float32", "float16", "bfloat16")))
def test_the_three_oracle_orders_agree_on_the_layer(device, case):
    oracles_agree(case, device)


@given(layer_cases(backward=False))
def test_the_layer_oracle_is_the_mixer_oracle_on_in_projs_output(device, case):
    inputs = materialize(case, device)
    res = truth.evaluate(case, inputs)
    t = inputs.values
    zxbcdt = torch.nn.functional.linear(t["u"], t["in_proj_weight"], t.get("in_proj_bias"))
    assert_close("in_proj", res.stages["in_proj"], zxbcdt, RTOL, case)
    bias = t.get("conv1d_bias", torch.zeros(case.conv_channels, dtype=torch.float64, device=inputs.device))
    mix = truth.mixer.mixer(truth.chunked.scan, "vectorized", zxbcdt, t["conv1d_weight"], bias, t["dt_bias"],
                             -torch.exp(t["A_log"]), t["D"], chunk_size=case.chunk_size, nheads=case.nheads,
                             headdim=case.headdim, ngroups=case.ngroups, dstate=case.dstate, d_nonssm=case.d_nonssm,
                             seq_idx=inputs.seq_idx, dt_limit=case.dt_limit_or_default,
                             rmsnorm_weight=t.get("rmsnorm_weight"), rmsnorm_eps=case.rmsnorm_eps,
                             outproj_weight=t["outproj_weight"], outproj_bias=t.get("outproj_bias"),
                             norm_before_gate=case.norm_before_gate)
    assert_close("y", res.y, mix.outputs["y"], RTOL, case)


# ---- healthy implementations are within budget ------------------------------------------------------------

def assert_within_budget(spec: str, case: Case, device: str):
    with Examiner([spec], device) as examiner:
        verdict = examiner.examine(case, ONE_CONFIG).verdicts[spec]
    assert verdict.ok, f"{verdict.message()}\ncase: {case.to_json(indent=None)}"


@settings(max_examples=10)
@given(layer_cases())
@example(Case(**LAYER, batch=2, seqlen=11, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=4, d_model=7,
              d_nonssm=2, D="channel", rmsnorm=True, bias=True, pass_="backward", regime=Regime(decay="strong")))
def test_the_float32_layer_double_is_within_budget(device, case):
    assert_within_budget("ssdiff.sides.doubles:layer", case, device)


@pytest.mark.parametrize("spec", LAYERS)
def test_every_layer_computes_with_the_cases_weights(spec, device):
    """A weight changed by a tenth changes the layer's output: the module's own (random) parameters are not used."""
    impl = get(spec)
    why = impl.unavailable()
    if why:
        pytest.skip(f"{spec}: {why}")
    case = fit_case(Case(**LAYER, seqlen=5, nheads=2, headdim=4, dstate=4, chunk_size=4, d_model=8, rmsnorm=True),
                    [impl], device)
    assert case is not None
    inputs = materialize(case, device)
    with runtime.autotune(ONE_CONFIG):
        first = impl.run(case, inputs).y.double()
    assert_close("y", first, truth.evaluate(case, inputs).y, 1e-2, case)
    inputs.values["outproj_weight"] = inputs.values["outproj_weight"] * 1.1
    with runtime.autotune(ONE_CONFIG):
        second = impl.run(case, inputs).y.double()
    assert_close("y after out_proj's weight x 1.1", second, first * 1.1, 1e-2, case)


# ---- a planted norm bug: found, localized to the norm, minimized, reproduced --------------------------------

def test_a_norm_over_the_wrong_group_size_is_found_and_localized_to_the_norm(tmp_path, device):
    spec = "ssdiff.sides.doubles:layer_norm_bug"
    config = FuzzConfig(impl=spec, entry="layer", out_dir=str(tmp_path), device=device, report_dir=None,
                        max_time=None, max_examples=100, seed=3, minimize=False, dtypes=("float32",), bounds=BOUNDS)
    report = Fuzzer(config).run()
    assert report.exit_code == 1, f"nothing found in {report.tried} cases ({report.stopped})"
    finding = report.findings[0]
    side = finding.localization["per_side"][spec]
    assert side["stages"]["first"] == "normed", side["stages"]["text"]
    assert {"groups", "rmsnorm"} <= set(finding.localization["features"]["trigger"])


def test_a_planted_layer_bug_minimizes_to_a_small_case_whose_repro_diverges(tmp_path, device):
    import os
    import subprocess
    import sys

    from ssdiff.investigate.minimize import minimize_outcome

    spec = "ssdiff.sides.doubles:layer_norm_bug"
    start = Case(**LAYER, batch=2, seqlen=9, nheads=4, ngroups=2, headdim=3, dstate=4, chunk_size=4, d_model=7,
                 d_nonssm=2, rmsnorm=True, bias=True, pass_="backward")
    with Examiner([spec], device) as examiner:
        outcome = examiner.examine(start)
        assert not outcome.verdicts[spec].ok
        minimized = minimize_outcome(examiner, outcome, str(tmp_path), max_runs=80)
    small = minimized.minimal
    assert small.entry == "layer" and small.ngroups == 2 and small.rmsnorm and small.batch == 1
    assert small.seqlen < start.seqlen and not small.bias
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # its side comes through this ssdiff
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(tmp_path / "repro.py")], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 1 and "DIVERGES" in run.stdout, run.stdout + run.stderr
