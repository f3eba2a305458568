"""ssdiff minimize / replay / repro.py: the seed divergence shrinks to a tiny case whose standalone repro fails
until the one-line upstream fix is applied; planted bugs keep their stage; replay reproduces stored verdicts;
replay and minimize name the known defect that explains a divergence; bad input is refused clearly."""

import importlib.util
import inspect
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ssdiff import runtime
from ssdiff.inputs.drawing import draw
from ssdiff.registry import known
from ssdiff.reproduce import repro
from ssdiff.model.case import Case, Regime
from ssdiff.cli import main
from ssdiff.model.evaluation import Evaluation
from ssdiff.examine import Examiner, failing_tensors
from ssdiff.investigate.localize import stages
from ssdiff.investigate.minimize import minimize
from ssdiff.verdict.judge import judge
from ssdiff.testing import usable

SEED_PAIR = ("mamba_ssm.split_conv1d_combined", "mamba_ssm.split_conv1d_ref")
SEED_START = Case(entry="split_conv1d", batch=2, seqlen=24, nheads=4, ngroups=2, headdim=8, dstate=8, chunk_size=16,
                  rmsnorm=True, D="channel", out_dim=6, regime=Regime(decay="mild"), seed=7)


def _run_repro(path: Path, extra_path: str = "") -> subprocess.CompletedProcess:
    return repro.run(path, first=extra_path)


@pytest.fixture(scope="module")
def seed_minimized(tmp_path_factory, device):
    out = tmp_path_factory.mktemp("seed")
    (out / "case.json").write_text(SEED_START.to_json())
    return minimize(SEED_START, *SEED_PAIR, device=device, out_dir=out)


def test_seed_divergence_minimizes_to_a_tiny_grouped_case(seed_minimized):
    m = seed_minimized.minimal
    assert (m.batch, m.ngroups) == (1, 2)
    assert m.nheads <= 4 and m.seqlen <= 8 and m.headdim <= 8 and m.dstate <= 8
    assert m.rmsnorm, "the divergence needs the gated RMSNorm"
    sides = seed_minimized.outcome.verdicts
    assert sides[SEED_PAIR[0]].ok and not sides[SEED_PAIR[1]].ok, "the oracle sides with the combined kernel"


def test_seed_repro_fails_until_the_upstream_fix(seed_minimized, tmp_path):
    repro = seed_minimized.repro_path
    text = repro.read_text()
    assert not re.search(r"^\s*(from|import) (ssdiff|harness)", text, re.M), "repro.py must not need ssdiff"
    before = _run_repro(repro)
    assert before.returncode == 1, before.stdout + before.stderr
    assert "the float64 oracle agrees with mamba_ssm.split_conv1d_combined" in before.stdout
    # The one-line upstream fix, in a temporary copy: normalize per group of dim // ngroups in the ref too.
    installed = Path(importlib.util.find_spec("mamba_ssm").submodule_search_locations[0])
    fixed = tmp_path / "fixed"
    shutil.copytree(installed, fixed / "mamba_ssm", ignore=shutil.ignore_patterns("__pycache__"))
    source = fixed / "mamba_ssm" / "ops" / "triton" / "ssd_combined.py"
    code = source.read_text()
    call = 'z=rearrange(z, "b l h p -> b l (h p)"), eps=rmsnorm_eps,'
    assert code.count(call) == 1, "the ref's rmsnorm call moved: update this test"
    source.write_text(code.replace(call, call + " group_size=dim // ngroups,"))
    after = _run_repro(repro, extra_path=str(fixed))
    assert after.returncode == 0, after.stdout + after.stderr
    assert "no divergence: fixed" in after.stdout


def test_seed_repro_draws_and_runs_kernels_with_ssdiffs_own_code(seed_minimized):
    """One `draw` and one set of runtime patches: repro.py inlines harness/inputs/drawing.py whole and, where the
    kernels ran under the Triton interpreter, the patches harness/runtime.py installs, verbatim."""
    text = seed_minimized.repro_path.read_text()
    assert inspect.getsource(inspect.getmodule(draw)) in text
    if runtime.interpreted() and seed_minimized.outcome.inputs.device.type == "cpu":
        for fn in (*repro.INTERPRETER_PATCHES, runtime._patch_autotuner_choice):
            assert inspect.getsource(fn) in text, fn.__name__


def test_replay_reproduces_the_stored_verdict(seed_minimized, device, capsys):
    code = main(["replay", str(seed_minimized.out_dir / "minimized.json"), "--impl", SEED_PAIR[0], "--against",
                 SEED_PAIR[1], "--device", device])
    out = capsys.readouterr().out
    assert code == 1 and "reproduces the stored verdict exactly" in out


PLANTED = [
    ("ssdiff.sides.doubles:group_bug", Case(batch=2, seqlen=24, nheads=4, ngroups=2, headdim=4, dstate=4, chunk_size=8,
                                       seed=3)),
    ("ssdiff.sides.doubles:reset_bug", Case(batch=1, seqlen=24, nheads=2, headdim=4, dstate=4, chunk_size=8,
                                       segments=((10, 14),), regime=Regime(decay="mild"), seed=3)),
    ("ssdiff.sides.doubles:mask_bug", Case(batch=1, seqlen=21, nheads=2, headdim=4, dstate=4, chunk_size=8, seed=3)),
]


@pytest.mark.parametrize("spec, start", PLANTED, ids=[p[0].split(":")[1] for p in PLANTED])
def test_planted_bugs_minimize_to_the_same_stage(spec, start, device, tmp_path, capsys):
    with Examiner([spec], device) as examiner:
        before = stages(examiner.examine(start, stages=True).verdicts[spec])["first"]
        assert before is not None, "the planted bug must diverge on the starting case"
        result = minimize(start, spec, device=device, out_dir=tmp_path)
        after = stages(examiner.examine(result.minimal, stages=True).verdicts[spec])["first"]
    assert after == before
    assert result.minimal.seqlen <= start.seqlen and result.minimal.nheads <= start.nheads
    assert result.minimal != start
    run = _run_repro(result.repro_path, extra_path=str(Path(__file__).resolve().parents[1]))
    assert run.returncode == 1, run.stdout + run.stderr
    assert main(["replay", str(tmp_path / "minimized.json"), "--impl", spec, "--device", device]) == 1
    out = capsys.readouterr().out
    assert "reproduces the stored verdict exactly" in out and "known defect" not in out
    assert main(["replay", str(tmp_path / "minimized.json"), "--impl", spec, "--device", device, "--worst", "2"]) == 1
    assert "largest ratios to budget:\n    (" in capsys.readouterr().out


def test_replay_names_the_known_defect_that_explains_a_divergence(tmp_path, device, capsys, monkeypatch):
    defect = known.BY_ID["mamba-ref-norm-over-whole-dim"]
    impl = usable(defect.implementations[0], defect.example.dtype, defect.example.backward, device)
    case = tmp_path / "case.json"
    case.write_text(defect.example.to_json())
    command = ["replay", str(case), "--impl", impl.name, "--device", device]
    assert main(command) == 1
    out = capsys.readouterr().out
    assert f"{impl.name}: known defect {defect.id} ({defect.releases}; {defect.status}): {defect.statement}" in out
    # a divergence in the record's domain that is more than the record accounts for is named a finding of its own
    monkeypatch.setattr(known, "explains", lambda *args, **kwargs: False)
    assert main(command) == 1
    out = capsys.readouterr().out
    assert f"lies in known defect {defect.id}'s domain, but the divergence is more than it accounts for" in out
    assert f"{impl.name}: known defect" not in out


def test_minimize_names_the_known_defect_of_its_minimal_case(tmp_path, device, capsys):
    defect = known.BY_ID["mamba-ref-norm-over-whole-dim"]
    impl = usable(defect.implementations[0], defect.example.dtype, defect.example.backward, device)
    case = tmp_path / "case.json"
    case.write_text(defect.example.to_json())
    assert main(["minimize", str(case), "--impl", impl.name, "--device", device, "--max-runs", "8"]) == 1
    assert f"{impl.name}: known defect {defect.id} ({defect.releases}" in capsys.readouterr().out


def test_replay_of_a_case_a_side_does_not_take_names_what(tmp_path, device, capsys):
    usable("mamba_ssm.split_conv1d_ref", "float32", False, device)
    case = tmp_path / "case.json"
    case.write_text(Case(entry="split_conv1d", seqlen=8, headdim=4, dstate=4, chunk_size=4, d_nonssm=2,
                         return_final_states=False, seed=1).to_json())
    assert main(["replay", str(case), "--impl", "mamba_ssm.split_conv1d_ref", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "mamba_ssm.split_conv1d_ref cannot express: d_nonssm" in err, err


def test_minimize_refuses_bad_input(tmp_path, device, capsys):
    bad = tmp_path / "case.json"
    bad.write_text("{not json")
    assert main(["minimize", str(bad), "--impl", "ref.chunked", "--device", device]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    good = tmp_path / "ok.json"
    good.write_text(Case().to_json())
    assert main(["minimize", str(good), "--impl", "no.such.impl", "--device", device]) == 2
    assert "unknown implementation 'no.such.impl'" in capsys.readouterr().err
    assert main(["minimize", str(good), "--impl", "ref.recurrent", "--device", device]) == 0
    assert "nothing to minimize" in capsys.readouterr().out


SMALL = Case(entry="chunk_scan", batch=1, seqlen=8, nheads=2, headdim=4, dstate=4, chunk_size=4,
             return_final_states=True, regime=Regime(decay="strong", dt_large=True), seed=3)


def _nudged_at_a_small_budget(outcome, key: str = "y"):
    """The outcome's outputs with one element of ``key`` (the one with the smallest budget) off by twice its
    budget, an error below the largest budget of the tensor; returns (outputs, flat index, its budget, largest)."""
    budget, judged, truth = repro._budgets(outcome.case, outcome.inputs, outcome.truth, outcome.baseline, 4.0)[key]
    index = int(torch.argmin(torch.where(judged, budget, torch.full_like(budget, math.inf))))
    small, largest = float(budget.flatten()[index]), float(budget[judged].max())
    assert 2 * small < largest, "the case needs budgets that differ across elements"
    side = next(iter(outcome.outputs))
    y = outcome.truth.outputs[key].clone().flatten()
    y[index] += 2 * small
    nudged = Evaluation({**outcome.outputs[side].outputs, key: y.reshape(truth.shape)})
    return {side: nudged}, index, small, largest


def test_repro_watches_the_elements_out_of_their_own_budgets(device):
    """An error over a small element's budget but under the tensor's largest budget: the verdict finds it, and
    repro.py watches that element with its own budget (the largest error against the largest budget would not)."""
    with Examiner(["ref.quadratic"], device) as examiner:
        outcome = examiner.examine(SMALL)
    outputs, index, small, largest = _nudged_at_a_small_budget(outcome)
    verdict = judge("nudged", SMALL, outcome.inputs, next(iter(outputs.values())), outcome.truth, outcome.baseline)
    assert not verdict.ok and "y" in failing_tensors(verdict)
    watched = repro.watched_elements(SMALL, outcome.inputs, outcome.truth, outcome.baseline, 4.0, outputs)
    assert watched["y"][0] == [index, pytest.approx(small)]
    assert repro.allowed_errors(SMALL, outcome.inputs, outcome.truth, outcome.baseline, 4.0)["y"] == \
        pytest.approx(largest)
    clean = repro.watched_elements(SMALL, outcome.inputs, outcome.truth, outcome.baseline, 4.0, outcome.outputs)
    assert clean == {}, "a side within every budget leaves nothing watched"


def test_repro_exits_1_where_a_watched_element_is_out_of_its_budget(device, tmp_path):
    """repro.py holds each watched element to its own budget: the same side passes with the budgets ssdiff
    recorded, and fails once the element's recorded budget is one no error meets. The side is one repro.py calls
    directly (mamba_ssm's kernel), so that the script runs where ssdiff is importable only from its checkout."""
    side = "mamba_ssm.chunk_scan_combined"
    with Examiner([side], device) as examiner:
        outcome = examiner.examine(SMALL, 0)          # natively one config: "tuned" compiles and times them all
    outputs, index, small, _ = _nudged_at_a_small_budget(outcome)
    path = repro.write(tmp_path / "repro.py", SMALL, [side], outcome.inputs, outcome.truth, outcome.baseline, 4.0,
                       "a nudged element", 0, outputs=outputs)
    text = path.read_text()
    assert f"[{index}, " in text
    passed = repro.run(path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    path.write_text(text.replace(f"[{index}, {small!r}]", f"[{index}, -1.0]"))
    failed = repro.run(path)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"y: element {index} (flat)" in failed.stdout and "1 of the 1 watched elements" in failed.stdout


@pytest.mark.parametrize("side", ["fla.fused_recurrent_simple_gla", "fla.naive_recurrent_simple_gla"])
def test_repro_writes_flas_simple_gla_out_with_the_adapters_map(side, device, tmp_path):
    """repro.py calls fla's simple_gla kernel itself (harness/truth/README.md's simple_gla map written out, no ssdiff import): on a
    case with every feature the map carries, the side it writes is within every budget ssdiff judged the adapter
    by, so the two compute the same thing."""
    impl = usable(side, "float32", True, device)
    case = Case(entry="chunk_scan", batch=2, seqlen=7, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=4,
                D="channel", has_z=True, dt_limit=(0.01, 2.0), initial_states=True, return_final_states=True,
                final_state_grad=True, pass_="backward", regime=Regime(decay="mild"), seed=4)
    with Examiner([impl.name], device) as examiner:
        outcome = examiner.examine(case, 0)
    assert outcome.verdicts[impl.name].ok, outcome.verdicts[impl.name].message()
    path = repro.write(tmp_path / "repro.py", case, [impl.name], outcome.inputs, outcome.truth, outcome.baseline,
                       4.0, "a healthy case", 0)
    text = path.read_text()
    assert not re.search(r"^\s*(from|import) (ssdiff|harness)", text, re.M) and "fla.ops.simple_gla" in text
    ran = repro.run(path)
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_every_smaller_case_keeps_what_holds_of_its_outcome(device, tmp_path):
    """``holds`` (what the findings catalogue asks: that the record explains the divergence) is kept by every case
    the minimizer keeps: with it refusing outcomes of fewer heads than the start, the minimum keeps them all."""
    spec, start = PLANTED[-1]
    heads = start.nheads
    result = minimize(start, spec, device=device, out_dir=tmp_path, write_repro=False,
                      holds=lambda outcome: outcome.case.nheads == heads)
    assert result.minimal.nheads == heads and result.minimal != start
