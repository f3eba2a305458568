"""harness/tools/bench.py: a campaign's row holds its throughput and what its cases used of their budgets, and a
``module:function`` implementation keeps its colon (NAME[:PASS])."""

from __future__ import annotations

import json

import pytest

from ssdiff.tools import bench


def test_a_target_names_its_pass_after_the_last_colon_only_when_it_is_one():
    assert bench._target("mamba_ssm.chunk_scan_combined") == ("mamba_ssm.chunk_scan_combined", "mixed")
    assert bench._target("fla.chunk_simple_gla:forward") == ("fla.chunk_simple_gla", "forward")
    assert bench._target("ssdiff.sides.doubles:healthy") == ("ssdiff.sides.doubles:healthy", "mixed")
    assert bench._target("ssdiff.sides.doubles:healthy:backward") == ("ssdiff.sides.doubles:healthy", "backward")


def test_a_rows_required_factors_are_its_campaigns_own(tmp_path, device, capsys):
    rows = tmp_path / "rows.json"
    assert bench.main(["--impl", "ssdiff.sides.doubles:healthy:mixed", "--dtype", "float32", "--budget", "4",
                       "--cold-budget", "2", "--cache-root", str(tmp_path), "--json", str(rows), "--",
                       "--device", device, "--max-examples", "25"]) == 0
    warm = json.load(open(rows, encoding="utf-8"))[0]["warm"]
    summary = json.load(open(tmp_path / "ssdiff.sides.doubles_healthy" / "warm" / "summary.json", encoding="utf-8"))
    assert warm["judged"] == summary["throughput"]["judged"] > 0
    assert warm["required_factor"] == {"float32": summary["required_factor_by_side"]["ssdiff.sides.doubles:healthy float32"]}
    groups = warm["required_factor"]["float32"]
    assert groups["outputs"]["verdicts"] >= warm["judged"]
    # the largest required factor is the largest ratio at FACTOR = 4 (no stages are judged in a campaign)
    assert max(g["max"] for g in groups.values() if g["max"] is not None) == \
        pytest.approx(4 * warm["largest_ratio"], abs=1e-4)
    said = capsys.readouterr()
    assert "required factor" in said.out
    # the cold campaign's figures are said before the warm one runs (a run cut during it keeps them)
    lines = [json.loads(line) for line in said.err.splitlines() if line.startswith("{")]
    assert "warm" not in lines[0] and lines[0]["cold"] == json.load(open(rows, encoding="utf-8"))[0]["cold"]


def test_a_rows_divergent_cases_are_replayable_without_the_campaigns_folder(tmp_path, device):
    """A campaign that diverges leaves each divergent case in its row, whole: the case.json, which replays. An
    example budget beside the time budget: one search of 25 cases, the same ones however loaded the machine (the
    time budget alone judges rounds of fresh searches, as many as the machine manages in its time)."""
    import shutil

    from ssdiff.model.case import Case
    from ssdiff.investigate.minimize import replay

    rows = tmp_path / "rows.json"
    assert bench.main(["--impl", "ssdiff.sides.doubles:group_bug:forward", "--dtype", "float32", "--budget", "15",
                       "--cold-budget", "2", "--cache-root", str(tmp_path / "c"), "--json", str(rows), "--",
                       "--device", device, "--max-examples", "25"]) == 0
    shutil.rmtree(tmp_path / "c")
    warm = json.load(open(rows, encoding="utf-8"))[0]["warm"]
    assert warm["divergences"] == len(warm["divergent_cases"]) > 0
    for data in warm["divergent_cases"]:
        case = Case.from_dict(data)
        assert case.ngroups > 1          # the planted bug reads another group's B
        assert replay(case, "ssdiff.sides.doubles:group_bug", device=device).diverged, case.describe()


@pytest.mark.parametrize("flag", ["--budget", "--cold-budget"])
def test_a_budget_that_is_not_positive_is_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--impl", "ssdiff.sides.doubles:healthy", flag, "0"])
    assert stopped.value.code == 2
    assert f"{flag} must be a positive number of seconds, got 0" in capsys.readouterr().err
