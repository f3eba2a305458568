"""`ssdiff fuzz` finds planted bugs and localizes them; crashing, hanging and raising implementations become
verdicts under --isolate and the run goes on; the exit status says what happened.

The implementations are the test doubles of harness/sides/doubles.py (importable by the isolated child process):
a toy chunked kernel with a planted bug, the fused mixer with the seed-000 norm bug, and misbehaving ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import pytest

from ssdiff import runtime, store, truth
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer, UsageError
from ssdiff.campaign.pool import Mix
from ssdiff.cli import main
from ssdiff.examine import Examiner
from ssdiff.investigate import localize, tf32
from ssdiff.investigate.minimize import replay
from ssdiff.model.case import Case
from ssdiff.verdict.judge import FACTOR, Verdict

# The search, not tuning: natively "tuned" compiles and benchmarks every config of every kernel of a new shape.
ONE_CONFIG = 0


def fuzz(impl, out, device, **kw):
    kw.setdefault("max_time", None)
    kw.setdefault("seed", 4)
    kw.setdefault("minimize", False)          # the search and localization; minimizing is tested on its own
    kw.setdefault("autotune", ONE_CONFIG)      # the search, not tuning: natively "tuned" compiles every config
    config = FuzzConfig(impl=impl, out_dir=str(out), device=device, report_dir=None, **kw)
    return Fuzzer(config).run()


def only_finding(report):
    assert report.exit_code == 1, f"nothing found in {report.tried} cases ({report.stopped})"
    return report.findings[0]


# ---- planted bugs: found, and localized to the right stage, coordinates and features --------------------

def test_group_index_bug_is_found_in_chunk_states_on_the_misgrouped_heads(tmp_path, device):
    spec = "ssdiff.sides.doubles:group_bug"
    finding = only_finding(fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",)))
    case = finding.outcome.case
    side = finding.localization["per_side"][spec]
    assert side["stages"]["first"] == "chunk_states" and not side["stages"]["inferred"]
    assert "dt" in side["stages"]["within_budget"] and "CB" not in side["stages"]["within_budget"]
    coords = side["coordinates"][0]
    assert coords["tensor"] == "stage.chunk_states"
    r = case.heads_per_group
    misgrouped = {h for h in range(case.nheads) if h % case.ngroups != h // r}
    assert set(coords["heads"]) == misgrouped and len(misgrouped) < case.nheads
    assert "groups" in finding.localization["features"]["trigger"]


def test_state_not_reset_at_boundaries_is_found_in_passed_states_after_a_boundary(tmp_path, device):
    spec = "ssdiff.sides.doubles:reset_bug"
    finding = only_finding(fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",)))
    side = finding.localization["per_side"][spec]
    # What the planted bug implies whichever case the search draws (the draws differ by device: GPU bounds):
    # every stage before state passing is right, and only tokens of a sequence after the first go wrong.
    assert side["stages"]["first"] == "passed_states" and not side["stages"]["inferred"]
    assert side["stages"]["within_budget"] == ["dt", "dA_cumsum", "chunk_states"]
    (passed,) = [c for c in side["coordinates"] if c["tensor"] == "stage.passed_states"]
    assert passed["after_boundary_only"], passed["text"]
    for coords in side["coordinates"]:      # final states have no token or chunk position to place
        assert coords.get("after_boundary_only", True), coords["text"]
    assert "seq_idx" in finding.localization["features"]["trigger"]


def test_a_kernel_that_ignores_empty_sequences_is_found_on_one_and_minimized_to_one(tmp_path, device):
    """The double numbers sequences by their tokens (an empty sequence numbered 0 leaves its initial state to the
    next) and reads varlen states at cu_seqlens[i + 1] - 1; right wherever no sequence is empty: the default search
    draws empty sequences, and the minimizer keeps one in the smallest case."""
    spec = "ssdiff.sides.doubles:empty_sequence_bug"
    finding = only_finding(fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",),
                                minimize=True, minimize_runs=40))
    assert "empty_sequence" in finding.localization["features"]["trigger"]
    assert finding.minimized is not None, finding.minimize_problem
    small = finding.minimized.minimal
    assert any(0 in row for row in small.segments), small.describe()


def test_a_kernel_whose_strided_offsets_overflow_is_found_on_a_strided_view_only(tmp_path, device, monkeypatch):
    """The double computes x's element offsets from the strides it is handed in 32 bits, wrapping at STRIDED_WRAP,
    lowered here above every contiguous x the search draws: only a view into the wide projection reaches it, so
    the default search finds the bug through the strided layout."""
    from ssdiff.sides import doubles

    monkeypatch.setattr(doubles, "STRIDED_WRAP", 4096)
    spec = "ssdiff.sides.doubles:strided_offset_wrap_bug"
    finding = only_finding(fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",)))
    case = finding.outcome.case
    assert case.regime.layout == "strided" and case.batch * case.seqlen * case.dim < 4096, case.describe()
    assert "strided" in finding.localization["features"]["trigger"]


def test_wrong_mask_on_the_last_partial_chunk_is_found_there(tmp_path, device):
    spec = "ssdiff.sides.doubles:mask_bug"
    finding = only_finding(fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",)))
    side = finding.localization["per_side"][spec]
    assert side["stages"]["first"] == "scan"
    coords = side["coordinates"][0]
    assert coords["tensor"] == "stage.scan" and coords["last_partial_chunk_only"], coords["text"]
    assert finding.localization["features"]["trigger"] == ["ragged"]
    # the simplified case keeps the divergence and is a ragged case with no other optional feature on
    minimal = Case.from_dict(finding.localization["features"]["minimal_case"])
    assert minimal.seqlen % minimal.chunk_size and minimal.segments is None and not minimal.has_z


def test_with_keep_going_divergences_are_localized_after_the_search(tmp_path, device, monkeypatch):
    spec = "ssdiff.sides.doubles:mask_bug"
    searching = []
    real = Fuzzer.localize
    monkeypatch.setattr(Fuzzer, "localize", lambda self, f: (searching.append(self.report.search_s), real(self, f)))
    report = fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",), keep_going=True)
    finding = only_finding(report)
    assert searching and all(s > 0 for s in searching)          # search_s is set when the search has ended
    assert finding.localization["per_side"][spec]["stages"]["first"] == "scan"
    message = (tmp_path / "divergence-001" / "message.txt").read_text()
    assert "first divergent stage: scan" in message             # the folder is rewritten with the localization


def test_a_slow_minimization_ends_within_the_post_processing_bound_with_its_partial_minimum(tmp_path, device):
    """Every run of slow_group_bug sleeps, so its minimization cannot reach a local minimum within 3 s: the
    campaign ends within its search plus that bound (give or take the run under way), saving the smallest case
    reached and saying that it is partial."""
    spec, bound = "ssdiff.sides.doubles:slow_group_bug", 3.0
    start = time.perf_counter()
    report = fuzz(spec, tmp_path, device, max_examples=200, pass_="forward", dtypes=("float32",), minimize=True,
                  localize=False, post_time=bound)
    post = time.perf_counter() - start - report.search_s
    finding = only_finding(report)
    assert finding.minimized is not None and finding.minimized.partial, finding.minimize_problem
    assert post < bound + 4.0, f"post-processing took {post:.1f} s against a bound of {bound} s"
    saved = json.load(open(os.path.join(finding.path, "minimized-verdict.json"), encoding="utf-8"))
    assert saved["partial"] is True
    assert "minimized partially" in (tmp_path / "divergence-001" / "message.txt").read_text()


# Seeded campaigns that draw both causes in many forms: float32 alone meets a misgrouped state in a single chunk,
# seen only through the final states; with float16 too, ablations that once ended on dt_limit or ragged.
@pytest.mark.parametrize("dtypes, examples", [(("float32",), 200), (("float32", "float16"), 300)],
                         ids=["float32", "float32-float16"])
def test_one_cause_is_one_finding_whatever_else_its_cases_hold(tmp_path, device, dtypes, examples):
    """group_and_padding_bugs has two causes: heads reading the wrong group, and padding tokens computed as a
    sequence. Its divergent cases differ in everything else (dtype, pass, tensors, other features), yet there
    are exactly two findings, each one cause's: its trigger that cause's features and what only lets it be
    seen (the padding tokens' leak shows in the final states alone, a single chunk's misgrouped state too)."""
    seen_through = {"backward", "final_state_grad", "final_states"}
    causes = [("groups",), ("padding", "seq_idx")]
    report = fuzz("ssdiff.sides.doubles:group_and_padding_bugs", tmp_path, device, max_examples=examples,
                  keep_going=True, dtypes=dtypes, seed=1)
    assert report.exit_code == 1, f"nothing found in {report.tried} cases"
    triggers = [f.localization["features"]["trigger"] for f in report.findings]
    assert sorted(tuple(sorted(set(t) - seen_through)) for t in triggers) == causes, triggers
    padding = next(t for t in triggers if "padding" in t)
    assert "final_states" in padding, padding          # nothing else shows the padding tokens' leak
    assert all(f.divergent_cases > 1 for f in report.findings)        # each cause's cases were merged
    summary = json.load(open(tmp_path / "summary.json", encoding="utf-8"))
    assert summary["causes"] == len(report.findings) == 2


def test_a_stop_request_ends_the_search_after_the_case_being_judged(tmp_path, device):
    config = FuzzConfig(impl="ssdiff.sides.doubles:healthy", out_dir=str(tmp_path), device=device, report_dir=None,
                        max_time=None, max_examples=50, seed=1)
    fuzzer = Fuzzer(config, progress=lambda state: state["tried"] >= 3 and fuzzer.request_stop("interrupted"))
    report = fuzzer.run()
    assert report.tried == 3 and report.stopped == "interrupted"
    assert json.load(open(tmp_path / "summary.json"))["stopped"] == "interrupted"
    assert json.load(open(tmp_path / "progress.json"))["tried"] >= 1       # written as the campaign went


def test_a_divergence_is_written_as_case_and_verdict_files_that_replay(tmp_path, device):
    spec = "ssdiff.sides.doubles:mask_bug"
    report = fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",))
    finding = only_finding(report)
    folder = finding.path
    assert sorted(os.listdir(folder))[:3] == ["case.json", "error_maps.json", "message.txt"]
    case = Case.load(os.path.join(folder, "case.json"))
    assert case == finding.outcome.case
    record = json.load(open(os.path.join(folder, "verdict.json"), encoding="utf-8"))
    assert record["verdicts"][spec]["status"] in ("diverged", "nonfinite")
    assert record["localization"]["per_side"][spec]["stages"]["first"] == "scan"
    summary = json.load(open(os.path.join(str(tmp_path), "summary.json"), encoding="utf-8"))
    assert summary["cases_tried"] == report.tried and summary["divergences"][0]["path"] == folder
    assert summary["first_divergence_after_s"] is not None
    # replay: the saved case diverges again, the same way
    outcome = replay(case, spec, device=device)
    assert outcome.verdicts[spec].status == record["verdicts"][spec]["status"]


def test_the_summary_says_where_a_judged_cases_time_went(tmp_path, device):
    from ssdiff.examine import PHASES

    report = fuzz("ssdiff.sides.doubles:healthy", tmp_path, device, max_examples=6, pass_="backward", dtypes=("float32",))
    summary = json.load(open(tmp_path / "summary.json", encoding="utf-8"))
    per_case = summary["throughput"]["per_case"]["other"]
    assert per_case["cases"] == report.tried == 6
    parts = [per_case[f"{phase}_s"] for phase in PHASES]
    assert all(p > 0 for p in parts), per_case                   # every case computes its own evidence
    assert sum(parts) <= per_case["examine_s"] * 1.001 + 1e-4, per_case


def test_a_campaign_evaluates_the_oracle_and_the_baseline_once_per_case(tmp_path, monkeypatch, device):
    """Localization and minimization re-examine cases (with stages, with features switched off, as shrink
    candidates); each distinct case still gets one oracle evaluation at its inputs and one baseline evaluation.
    The campaign also writes what `ssdiff fuzz` writes: the finding minimized, with its repro.py."""
    from ssdiff import examine

    made, truths, baselines = {}, {}, {}
    materialize, evaluate, evaluate_samples = examine.materialize, examine.widen.evaluate, examine.evaluate_samples

    def counted_materialize(case, device):
        made[case] = materialize(case, device)
        return made[case]

    def counted_evaluate(evaluator, case, inputs):     # the truth, with the neighbours' oracle beside it
        if evaluator.__func__ is examine.Examiner.oracle_at and made.get(case) is inputs[0]:
            truths[case] = truths.get(case, 0) + 1
        return evaluate(evaluator, case, inputs)

    def counted_samples(case, *args, **kw):
        baselines[case] = baselines.get(case, 0) + 1
        return evaluate_samples(case, *args, **kw)

    monkeypatch.setattr(examine, "materialize", counted_materialize)
    monkeypatch.setattr(examine.widen, "evaluate", counted_evaluate)
    monkeypatch.setattr(examine, "evaluate_samples", counted_samples)
    report = fuzz("ssdiff.sides.doubles:mask_bug", tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",),
                  minimize=True, minimize_runs=40)
    finding = only_finding(report)
    assert finding.minimized is not None, finding.minimize_problem
    assert len(truths) > report.tried            # localization and minimization examined more cases
    assert max(truths.values()) == 1 and max(baselines.values()) == 1 and set(truths) == set(baselines)
    assert {"minimized.json", "minimized-verdict.json", "repro.py"} <= set(os.listdir(finding.path))


def test_the_oracle_is_said_to_agree_with_the_correct_side_and_the_seed_bug_is_localized(tmp_path, device):
    good, bad = "ssdiff.sides.doubles:mixer", "ssdiff.sides.doubles:mixer_norm_bug"
    finding = only_finding(fuzz(good, tmp_path, device, against=bad, max_examples=200, pass_="forward",
                                dtypes=("float32",)))
    loc = finding.localization
    assert loc["sides"]["oracle_agrees_with"] == [good] and loc["sides"]["diverging"] == [bad]
    assert loc["sides"]["text"].startswith(f"the oracle agrees with {good}")
    stages = loc["per_side"][bad]["stages"]
    assert stages["first"] == "normed" and not stages["inferred"]
    assert set(loc["features"]["trigger"]) == {"groups", "rmsnorm"}
    assert finding.outcome.pair["y"] > 1


def test_the_real_seed_divergence_is_found_and_its_stage_measured(tmp_path, device):
    """mamba_split_conv1d_scan_combined vs mamba_split_conv1d_ref (mamba-ssm as installed): the ref's own
    intermediates (conv, the scan's output, the RMSNorm's output) are recorded, so the stage is measured."""
    good, bad = "mamba_ssm.split_conv1d_combined", "mamba_ssm.split_conv1d_ref"
    finding = only_finding(fuzz(good, tmp_path, device, against=bad, max_examples=100, pass_="forward",
                                dtypes=("float32",), seed=1, known="ignore"))      # rediscovered unaided
    loc = finding.localization
    assert loc["sides"]["oracle_agrees_with"] == [good] and loc["sides"]["diverging"] == [bad]
    stages = loc["per_side"][bad]["stages"]
    assert stages["first"] == "normed" and not stages["inferred"], stages["text"]
    assert set(stages["within_budget"]) >= {"conv", "skip"}
    assert set(loc["features"]["trigger"]) == {"groups", "rmsnorm"}


def test_a_known_defect_is_reported_as_known_and_the_campaign_goes_on(tmp_path, device):
    """mamba_split_conv1d_scan_ref's norm over the whole dim (#647) is a registry record: with --known report its
    cases are judged, counted under the defect's id with the first example, and the search goes on; with
    --known skip they are left out with the reason."""
    from ssdiff.registry import known

    good, bad = "mamba_ssm.split_conv1d_combined", "mamba_ssm.split_conv1d_ref"
    defect = known.BY_ID["mamba-ref-norm-over-whole-dim"]
    if not known.affecting(bad):
        pytest.skip(f"the installed mamba-ssm ({known.installed_version('mamba-ssm')}) is not affected")
    config = dict(against=bad, max_examples=25, pass_="forward", dtypes=("float32",), seed=1)
    report = fuzz(good, tmp_path / "report", device, known="report", **config)
    entry = report.known[defect.id]
    assert report.exit_code == 0 and report.tried == 25 and entry["reproduced"] >= 1, report.stopped
    assert defect.applies(Case.from_dict(entry["first_example"])) and entry["first_side"] == bad
    summary = json.load(open(tmp_path / "report" / "summary.json", encoding="utf-8"))
    assert {k["id"]: k["reproduced"] for k in summary["known"]}[defect.id] == entry["reproduced"]
    skipped = fuzz(good, tmp_path / "skip", device, known="skip", **config)
    assert skipped.known[defect.id]["reproduced"] == 0 and skipped.exit_code == 0
    assert skipped.skip_reasons.get(f"known defect {defect.id} (--known skip)", 0) >= 1


def test_a_bug_in_one_autotune_config_is_pinned_to_it(tmp_path, device):
    spec = "ssdiff.sides.doubles:config_bug"
    finding = only_finding(fuzz(spec, tmp_path, device, max_examples=40, autotune="random", seed=1))
    configs = finding.localization["per_side"][spec]["configs"]
    assert configs["diverging"] == [1] and configs["within_budget"] == [0]
    assert len(configs["suspects"]) == 1 and configs["suspects"][0].startswith("copy_kernel [BLOCK: 32")
    assert finding.localization["features"]["trigger"] == []


def test_without_exposed_stages_the_stage_is_inferred_from_the_trigger():
    verdict = Verdict(impl="ref-like", status="diverged", ratio=50.0)
    st = localize.stages(verdict, trigger=["groups", "rmsnorm"])
    assert st["first"] == "normed" and st["inferred"]
    assert "gated RMSNorm" in st["text"] and "inferred" in st["text"]
    assert localize.stages(verdict, trigger=["groups"])["first"] is None


def test_healthy_implementations_raise_no_alarm(tmp_path, device):
    report = fuzz("ssdiff.sides.doubles:healthy", tmp_path / "toy", device, max_examples=25, pass_="mixed",
                  dtypes=("float32", "float16"))
    assert report.exit_code == 0 and report.tried == 25
    assert max(w["ratio"] for w in report.worst.values()) < 1.0
    oracles = fuzz("ref.quadratic", tmp_path / "oracles", device, against="ref.recurrent", max_examples=15)
    assert oracles.exit_code == 0 and oracles.tried == 15
    assert max(w["ratio"] for w in oracles.worst.values()) < 1e-3


def test_the_summary_holds_the_required_factors_calibration_measures(tmp_path, device):
    """summary.json's required_factor_by_side is what ssdiff.tools.calibrate collects from the same campaign's cases, per
    side and dtype: a fuzz campaign doubles as a calibration run (one budget for both on a GPU)."""
    from ssdiff.tools.calibrate import Row

    spec = "ssdiff.sides.doubles:healthy"
    rows = {dtype: Row(spec, device, dtype) for dtype in ("float32", "float16")}
    config = FuzzConfig(impl=spec, out_dir=str(tmp_path), device=device, report_dir=None, max_time=None, seed=4,
                        minimize=False, autotune=ONE_CONFIG, max_examples=12, pass_="mixed",
                        dtypes=("float32", "float16"))
    Fuzzer(config, observe=lambda outcome: rows[outcome.case.dtype].observe(outcome)).run()
    written = json.load(open(tmp_path / "summary.json", encoding="utf-8"))["required_factor_by_side"]
    seen = 0
    for dtype, row in rows.items():
        expected = row.summary()["required_factor"]
        if not expected["outputs"]["verdicts"]:
            assert f"{spec} {dtype}" not in written          # no case of this dtype drawn
            continue
        got = written[f"{spec} {dtype}"]
        for group in ("outputs", "gradients"):
            assert got[group]["verdicts"] == expected[group]["verdicts"]
            for stat in ("median", "p99", "max"):
                assert got[group][stat] == pytest.approx(expected[group][stat], abs=1e-4), (dtype, group, stat)
        seen += expected["outputs"]["verdicts"] + expected["gradients"]["verdicts"]
    assert seen > 0 and written[f"{spec} float32"]["gradients"]["verdicts"] > 0


# ---- misbehaving implementations under --isolate ------------------------------------------------------------

@pytest.mark.parametrize("name, status", [("aborts", "crash"), ("hangs", "hang"), ("raises", "error")])
def test_crash_hang_and_error_are_verdicts_under_isolate(name, status, tmp_path, device):
    spec = f"ssdiff.sides.doubles:{name}"
    report = fuzz(spec, tmp_path, device, max_examples=3, isolate=True, timeout=3.0, localize=(status == "error"))
    finding = only_finding(report)
    verdict = finding.outcome.verdicts[spec]
    assert verdict.status == status
    assert {"crash": "SIGABRT", "hang": "timeout", "error": "planted failure"}[status] in verdict.detail
    record = json.load(open(os.path.join(finding.path, "verdict.json"), encoding="utf-8"))
    assert record["verdicts"][spec]["status"] == status
    assert report.stopped == "divergence found"
    if status == "error":
        assert finding.localization["features"]["trigger"] == []


def test_the_run_goes_on_after_a_crash(tmp_path, device):
    spec = "ssdiff.sides.doubles:aborts_with_groups"
    report = fuzz(spec, tmp_path, device, max_examples=10, isolate=True, timeout=30.0, keep_going=True, localize=False,
                  pass_="forward", dtypes=("float32",), seed=2)
    assert report.tried == 10 and report.stopped.startswith("example budget")
    crash = only_finding(report)
    assert crash.outcome.verdicts[spec].status == "crash" and crash.outcome.case.ngroups > 1
    assert len(report.findings) == 1                       # one bucket, however many crashes
    assert report.worst, "cases after the crash were judged"


@pytest.mark.parametrize("isolate", [False, True])
def test_a_side_out_of_device_memory_is_skipped_and_counted_not_judged(isolate, tmp_path, device):
    spec = "ssdiff.sides.doubles:out_of_memory_with_groups"
    report = fuzz(spec, tmp_path, device, max_examples=12, isolate=isolate, timeout=60.0, keep_going=True,
                  localize=False, pass_="forward", dtypes=("float32",), seed=2)
    reason = "out of device memory in double.oom_with_groups"
    assert report.exit_code == 0 and not report.findings, [f.outcome.case for f in report.findings]
    assert report.skip_reasons.get(reason, 0) >= 1 and report.skipped >= report.skip_reasons[reason], report.skip_reasons
    assert report.tried + report.skipped == 12 and report.tried and report.worst, "the cases without groups were judged"


def test_the_command_line_says_how_many_cases_went_unjudged_for_want_of_device_memory(tmp_path, capsys, device):
    assert main(["fuzz", "--impl", "ssdiff.sides.doubles:out_of_memory_with_groups", "--max-examples", "12", "--seed",
                 "2", "--pass", "forward", "--dtype", "float32", "--keep-going", "--no-localize", "--device", device,
                 "--out", str(tmp_path / "run"), "--no-report"]) == 0
    said = capsys.readouterr().err
    assert re.search(r"\d+ case\(s\) not judged for want of device memory \(out of device memory in "
                     r"double.oom_with_groups: \d+\)", said), said


# ---- the command line ------------------------------------------------------------------------------------

def test_cli_exit_status_and_output(tmp_path, monkeypatch, capsys, device):
    monkeypatch.setenv("SSDIFF_REPORTS", str(tmp_path / "reports"))
    clean = tmp_path / "clean"
    assert main(["fuzz", "--impl", "ssdiff.sides.doubles:healthy", "--max-examples", "4", "--seed", "1",
                 "--device", device, "--out", str(clean)]) == 0
    assert json.load(open(clean / "summary.json"))["cases_tried"] == 4
    found = tmp_path / "found"
    assert main(["fuzz", "--impl", "ssdiff.sides.doubles:mask_bug", "--max-examples", "300", "--pass", "forward",
                 "--dtype", "float32", "--seed", "4", "--device", device, "--out", str(found)]) == 1
    out = capsys.readouterr().out
    assert "divergence 1" in out and "first divergent stage: scan" in out and str(found) in out
    assert (found / "divergence-001" / "case.json").is_file() and (found / "divergence-001" / "verdict.json").is_file()
    assert main(["fuzz", "--impl", "no.such.impl", "--max-examples", "1"]) == 2
    assert main(["fuzz", "--impl", "ssdiff.sides.doubles:healthy", "--dtype", "float64", "--max-examples", "1"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["fuzz", "--max-examples", "1"])
    assert exc.value.code == 2


def test_a_float32_divergence_under_tf32_says_how_to_tell_tf32_from_a_defect(monkeypatch):
    monkeypatch.setattr(runtime, "fp32_dot", lambda: "tf32")
    assert "TRITON_F32_DEFAULT=ieee" in tf32.hint(Case(dtype="float32"), "cuda")
    assert "TRITON_F32_DEFAULT=ieee" in tf32.hint(Case(dtype="float32"), "cuda:1")
    assert tf32.hint(Case(dtype="float16"), "cuda") is None
    assert tf32.hint(Case(dtype="float32"), "cpu") is None
    monkeypatch.setattr(runtime, "fp32_dot", lambda: "ieee")
    assert tf32.hint(Case(dtype="float32"), "cuda") is None


def test_a_float32_divergence_under_tf32_is_examined_again_with_exact_float32_dots(monkeypatch, device):
    """tf32.replay: only a float32 case on a GPU under TF32 is examined again, in a fresh process with
    TRITON_F32_DEFAULT=ieee (a process keeps the kernel variants it compiled) and the same config and sides:
    within budget there it explains the divergence (the verdicts on one line); still out of budget, the
    divergence stands. This process's setting is left as it was."""
    side = "ssdiff.sides.doubles:dot_sensitive"
    case = Case(seqlen=8, headdim=4, dstate=4, chunk_size=4, dtype="float32", seed=3)
    monkeypatch.setattr(tf32, "applies", lambda case, device: case.dtype == "float32")
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    with Examiner([side], device) as examiner:
        assert not examiner.examine(case).verdicts[side].ok          # off by 10% without exact dots
    said = tf32.replay(side, case, 0, device)
    assert said is not None and "dot_sensitive" in said and "\n" not in said
    assert "TRITON_F32_DEFAULT" not in os.environ
    assert tf32.replay("ssdiff.sides.doubles:group_bug", case.replace(nheads=4, ngroups=2), 0, device) is None
    assert tf32.replay(side, case.replace(dtype="float16"), 0, device) is None                     # not float32


@pytest.mark.parametrize("within_budget", [True, False])
def test_a_campaigns_float32_divergence_under_tf32_is_replayed_and_reported_apart_when_tf32s(
        tmp_path, device, monkeypatch, within_budget):
    """With keep_going, each float32 finding under TF32 is replayed with exact float32 dots after the search
    (here a planted bug, the replay faked): within budget there it is TF32's loss, moved out of the findings into
    summary.json's tf32_explained (exit 0, not localized); otherwise the finding stands and its message says so."""
    spec = "ssdiff.sides.doubles:mask_bug"
    replays, localized = [], []
    monkeypatch.setattr(tf32, "applies", lambda case, device: case.dtype == "float32")
    monkeypatch.setattr(tf32, "replay", lambda *args, **kw: (replays.append((args, kw)),
                                                             "y within budget" if within_budget else None)[1])
    real = Fuzzer.localize
    monkeypatch.setattr(Fuzzer, "localize", lambda self, f: (localized.append(f.number), real(self, f)))
    report = fuzz(spec, tmp_path, device, max_examples=300, pass_="forward", dtypes=("float32",), keep_going=True)
    assert replays, f"nothing found in {report.tried} cases"
    (args, kw) = replays[0]
    impl, case, choice, replay_device, against, oracle_name, factor = args
    assert impl == spec and case.dtype == "float32" and choice == ONE_CONFIG and replay_device == device
    assert against is None and kw == {} and (oracle_name, factor) == (truth.DEFAULT_ORACLE, FACTOR)
    summary = json.loads((tmp_path / "summary.json").read_text())
    if within_budget:
        assert report.exit_code == 0 and not report.findings and not localized
        assert len(report.tf32_explained) == len(replays) and summary["divergences"] == []
        assert all(f.tf32_replay == "y within budget" for f in report.tf32_explained)
        assert summary["tf32_explained"][0]["replay"] == "y within budget"
        # its folder is not a divergence's: a report of the run (store.read_run) lists none
        assert summary["tf32_explained"][0]["path"] == str(tmp_path / "tf32-001")
        assert "The loss is TF32's" in (tmp_path / "tf32-001" / "message.txt").read_text()
        assert store.read_run(tmp_path)["divergences"] == []
    else:
        message = (tmp_path / "divergence-001" / "message.txt").read_text()
        assert report.exit_code == 1 and len(report.findings) == len(replays) and summary["tf32_explained"] == []
        assert all(f.tf32_replay == "" for f in report.findings)
        assert localized == [f.number for f in report.findings]
        assert summary["divergences"][0]["tf32_replay"] == ""
        assert "still out of budget, so not TF32's loss" in message


def test_a_float32_divergence_tf32_explains_does_not_end_the_search(tmp_path, device, monkeypatch):
    """Without keep_going the search ends at the first divergence TF32 does not explain: one it explains (the
    replay, faked here, within budget) is reported apart and the search goes on."""
    monkeypatch.setattr(tf32, "applies", lambda case, device: case.dtype == "float32")
    monkeypatch.setattr(tf32, "replay", lambda *args, **kw: "within budget")
    report = fuzz("ssdiff.sides.doubles:mask_bug", tmp_path, device, max_examples=60, pass_="forward",
                  dtypes=("float32",))
    assert report.tf32_explained and report.exit_code == 0 and report.stopped != "divergence found"
    first = report.tf32_explained[0]
    assert report.tried > first.cases_before + 1, "the search went on after the explained divergence"
    assert [f.number for f in report.tf32_explained] == list(range(1, len(report.tf32_explained) + 1))


def test_a_run_that_failed_is_not_replayed_with_exact_float32_dots(tmp_path, device, monkeypatch):
    """TF32 moves numbers; it does not make a run raise, crash or hang: such a float32 finding is not replayed (a
    hang would hold the in-process replay for its whole timeout)."""
    monkeypatch.setattr(tf32, "applies", lambda case, device: case.dtype == "float32")
    replays = []
    monkeypatch.setattr(tf32, "replay", lambda *args, **kw: replays.append(args))
    spec = "ssdiff.sides.doubles:raises"
    finding = only_finding(fuzz(spec, tmp_path, device, max_examples=3, pass_="forward", dtypes=("float32",),
                                localize=False))
    assert finding.outcome.verdicts[spec].status == "error" and finding.outcome.case.dtype == "float32"
    assert replays == [] and finding.tf32_replay is None


def test_usage_errors_name_the_problem():
    with pytest.raises(UsageError, match="share no entry point"):
        Fuzzer(FuzzConfig(impl="ssdiff.sides.doubles:healthy", against="ssdiff.sides.doubles:mixer", report_dir=None))
    with pytest.raises(UsageError, match="budget"):
        Fuzzer(FuzzConfig(impl="ssdiff.sides.doubles:healthy", max_time=None, report_dir=None))


def test_a_tuned_case_runs_config_0_while_its_key_is_compiling(tmp_path, device):
    """A drawn case of a key whose representative's configs are not all compiled yet runs under config 0 (tuned,
    this process would compile every config of every kernel first), counted in the summary; tuned once they are
    in; a boundary key's case under its config; drawn without a key (no pool), as drawn."""
    fuzzer = Fuzzer(FuzzConfig(impl="ssdiff.triton", device=device, entry="chunk_scan", max_examples=20,
                               pool=True, compile_ahead=False, autotune="tuned", pass_="mixed",
                               dtypes=("float32",), report_dir=None, out_dir=str(tmp_path), seed=1,
                               pool_mix=Mix(size=4, production=0.25, boundary=0.25)))
    plain = next(k for k in fuzzer.pool.keys if k.boundary is None)
    edge = next(k for k in fuzzer.pool.keys if k.boundary is not None)
    compiled = set()

    class Workers:
        def wait(self, case, timeout, index=None):
            return case in compiled

    fuzzer.schedule.compiler = Workers()
    case = plain.case(backward=True)
    assert fuzzer.schedule.choice_for(plain, case, "tuned") == 0
    assert fuzzer.schedule.choice_for(edge, edge.case(), "tuned") == edge.boundary.config
    compiled.add(plain.case(backward=False))                 # the other pass's representative is not this one's
    assert fuzzer.schedule.choice_for(plain, case, "tuned") == 0
    compiled.add(case)
    assert fuzzer.schedule.choice_for(plain, case, "tuned") == "tuned"
    assert fuzzer.schedule.choice_for(plain, case, 3) == 3
    assert fuzzer.report.untuned_while_compiling == 2
    assert fuzzer.report.throughput()["untuned_while_compiling"] == 2
    fuzzer.schedule.compiler = None
    assert fuzzer.schedule.choice_for(plain, plain.case(), "tuned") == "tuned"


@pytest.mark.parametrize("workers_up", [True, False])
@pytest.mark.parametrize("compiling", [True, False])
@pytest.mark.parametrize("autotune", ["tuned", 2])
def test_representatives_are_judged_as_soon_as_their_config_is_compiled(tmp_path, device, compiling, autotune,
                                                                        workers_up):
    """With cases compiled ahead, each key's representative is judged once the config it runs under is in (or at
    once, compiled here, while the workers are still starting): one to be judged tuned meanwhile under config
    0, then tuned between rounds once every config is in, never waiting for them (straight away tuned where every
    config is in already); a boundary key's under its config alone. Forward before backward, production shapes
    last in each pass. The waits are counted in the throughput's compile_wait_s."""
    fuzzer = Fuzzer(FuzzConfig(impl="ssdiff.triton", device=device, entry="chunk_scan", max_examples=20,
                               pool=True, compile_ahead=False, autotune=autotune, pass_="mixed",
                               dtypes=("float32",), report_dir=None, out_dir=str(tmp_path), seed=1,
                               pool_mix=Mix(size=4, production=0.25, boundary=0.25)))
    keys = fuzzer.pool.keys
    assert {k.kind for k in keys} == {"small", "production", "boundary"}
    waited, judged = [], []

    class Workers:
        def submit(self, cases):
            submitted.extend(cases)

        def wait(self, case, timeout, index=None):
            if timeout > 0:                                 # a wait, not a look
                waited.append((case, index))
                time.sleep(0.01)
            return not compiling or timeout > 0

        def ready(self):
            return workers_up

    submitted = []
    fuzzer.schedule.compiler = Workers()
    fuzzer.judge = lambda case, choice, target=None: judged.append((case, choice)) and False
    fuzzer.budget.start()
    fuzzer.schedule.compile_ahead(keys)
    assert fuzzer.schedule.representatives(keys, fuzzer.judge) is False
    reps = sorted(((k.case(backward=b), k) for k in keys for b in (False, True)),
                  key=lambda rep: (rep[0].backward, rep[1].kind == "production"))
    assert submitted == [case for case, _ in reps]            # compiled in the order they are judged
    # the waits are the throughput's compile_wait_s
    assert (fuzzer.report.throughput()["compile_wait_s"] >= 0.01 * len(waited)) and (waited or
                                                                                   fuzzer.report.compile_wait_s == 0)
    waits_for_its_config = workers_up
    if autotune == 2:
        assert judged == [(case, 2) for case, _ in reps]
        assert all(((case, 2) in waited) == waits_for_its_config for case, _ in reps)
        return
    at_boundary = [(case, key.boundary.config) for case, key in reps if key.boundary]
    tuned = [(case, "tuned") for case, key in reps if not key.boundary]
    if compiling:
        assert judged == [(case, key.boundary.config if key.boundary else 0) for case, key in reps]
        assert fuzzer.schedule.pending == [case for case, _ in tuned]
        assert fuzzer.schedule.judge_pending(fuzzer.judge) is False and judged[len(reps):] == []     # still compiling
        compiling = False
        assert fuzzer.schedule.judge_pending(fuzzer.judge) is False and judged[len(reps):] == tuned  # now every config is in
        assert fuzzer.schedule.pending == []
        assert not any((case, None) in waited for case, _ in tuned)     # never waited for every config
    else:
        assert judged == at_boundary + tuned
    assert not any((case, None) in waited for case, _ in at_boundary)
    assert all(((case, key.boundary.config) in waited) == waits_for_its_config for case, key in reps if key.boundary)


def test_no_representative_is_judged_after_the_budget_ran_out_while_it_waited(tmp_path, device):
    """A representative's wait for the workers ends with the time budget, and a case not begun by then is not
    begun: judged (compiling in the campaign's own process) it would overrun the budget by its whole run."""
    fuzzer = Fuzzer(FuzzConfig(impl="ssdiff.triton", device=device, entry="chunk_scan", max_examples=None,
                               max_time=0.2, pool=True, compile_ahead=False, autotune="tuned", pass_="forward",
                               dtypes=("float32",), report_dir=None, out_dir=str(tmp_path), seed=1,
                               pool_mix=Mix(size=2, production=0.0, boundary=0.0)))
    judged = []

    class Workers:
        def submit(self, cases):
            pass

        def wait(self, case, timeout, index=None):
            time.sleep(timeout)                             # the workers are behind: every wait runs to its end
            return False

        def ready(self):
            return True

    fuzzer.schedule.compiler = Workers()
    fuzzer.judge = lambda case, choice, target=None: judged.append((case, choice)) and False
    fuzzer.budget.start()
    assert fuzzer.schedule.representatives(fuzzer.pool.keys, fuzzer.judge) is False
    assert judged == []
    assert 0.15 < fuzzer.report.compile_wait_s < 5.0         # the one wait: the budget's 0.2 s


def test_the_keys_of_the_next_rotations_are_compiled_ahead(tmp_path, device):
    """Natively the workers are given the keys of the next COMPILE_AHEAD_ROUNDS rotations before the search starts,
    and after each rotation the one then planned that far ahead: a key arriving at round r was queued by round
    r - COMPILE_AHEAD_ROUNDS, and none twice."""
    from ssdiff.campaign.schedule import COMPILE_AHEAD_ROUNDS

    fuzzer = Fuzzer(FuzzConfig(impl="ssdiff.triton", device=device, entry="chunk_scan", max_examples=None,
                               max_time=60, pool=True, compile_ahead=False, autotune=0, pass_="forward",
                               dtypes=("float32",), report_dir=None, out_dir=str(tmp_path), seed=2,
                               pool_mix=Mix(size=3, production=0.0, boundary=0.0)))
    queued, arrived = {}, []                         # key -> the round it was queued at; (round, key) arriving

    class Workers:
        def submit(self, cases):
            for case in cases:
                key = next(k for k in [*fuzzer.pool.keys, *fuzzer.pool.ahead(COMPILE_AHEAD_ROUNDS)]
                           if case == k.case(backward=case.backward))
                assert key not in queued or queued[key] == fuzzer.pool.round, f"{key.describe()} queued twice"
                queued.setdefault(key, fuzzer.pool.round)

        def wait(self, case, timeout, index=None):
            return True

        def ready(self):
            return True

        def close(self):
            pass

    fuzzer.schedule.compiler = Workers()
    fuzzer.judge = lambda case, choice, target=None: False          # nothing judged: five idle rounds end it
    rotate = fuzzer.pool.rotate

    def recording_rotate():
        arrived.append((fuzzer.pool.round + 1, fuzzer.pool.upcoming))
        return rotate()

    fuzzer.pool.rotate = recording_rotate
    fuzzer.run()
    assert len(arrived) >= COMPILE_AHEAD_ROUNDS + 1
    for round_, key in arrived:
        assert queued[key] <= max(0, round_ - COMPILE_AHEAD_ROUNDS), (round_, queued[key], key.describe())
    assert all(queued[k] == 0 for k in fuzzer.pool.keys if k not in dict(arrived).values())


def test_each_compile_key_gets_its_share_of_a_rounds_cases(tmp_path, device):
    """A pooled round is one search per key, so each key gets an equal share of the round's examples, in the
    targeted round too, where the small keys' cases score higher (a search that picks each case's key gives the
    keys unequal shares); a huge key gets HUGE_CASES_PERCENT."""
    from ssdiff.campaign.results import at_production_shape
    from ssdiff.campaign.schedule import HUGE_CASES_PERCENT, ROUND_EXAMPLES, round_shares

    fuzzer = Fuzzer(FuzzConfig(impl="ssdiff.triton", device=device, entry="chunk_scan", max_examples=210,
                               pool=True, compile_ahead=False, autotune=0, pass_="mixed", dtypes=("float32",),
                               report_dir=None, out_dir=str(tmp_path), seed=3,
                               pool_mix=Mix(size=4, production=0.25, boundary=0.25)))
    assert sorted(k.kind for k in fuzzer.pool.keys) == ["boundary", "production", "small", "small"]
    searched = []

    def judge(case, choice, target=None):
        fuzzer.report.tried += 1
        if target is not None:                  # a searched case, not a key's representative
            production = at_production_shape(case)
            searched.append(production)
            target(0.0 if production else 1.0, label="log10 ratio to budget")
        return False

    fuzzer.judge = judge
    fuzzer.run()
    # 8 representatives, round 0 (100 cases), the new key's 2 representatives, round 1 (targeted: 100 cases)
    assert len(searched) == 2 * ROUND_EXAMPLES
    assert sum(searched) == 2 * ROUND_EXAMPLES // 4

    keys = [dataclasses.replace(k, kind="huge") if k.kind == "production" else k for k in fuzzer.pool.keys]
    for round_ in range(4):
        shares = round_shares(keys, ROUND_EXAMPLES, round_)
        assert [slot for slot, _, _ in shares] == [(round_ + i) % 4 for i in range(4)]
        assert sorted(n for _, key, n in shares if key.kind == "huge") == [ROUND_EXAMPLES * HUGE_CASES_PERCENT // 100]
        assert sum(n for _, _, n in shares) == ROUND_EXAMPLES
    assert [n for _, _, n in round_shares(fuzzer.pool.keys, 6, 1)] == [2, 2, 1, 1]
