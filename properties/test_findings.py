"""FINDINGS.md and reports/findings/: every finding's repro.py, written from its committed case.json and
finding.json as `ssdiff known --repro ID` writes it, fails on a release the registry says is affected and passes on
the release that fixed it; it is the same bytes however often it is written, and what the findings' own
computation writes; FINDINGS.md is what `python -m ssdiff.registry.findings --render` writes from the registry and
reports/findings/ (harness/registry/findings.py).

Each repro runs as a stranger would run it (ssdiff.reproduce.repro.run): a child process with nothing of this
checkout on its path, mamba_ssm the installed one or a release installed beside it (SSDIFF_MAMBA_RELEASES, else
.venv/mamba-releases/<version>/; see properties/test_upstream.py::test_release_runs_its_properties).
"""

import dataclasses
import json
import os
import subprocess
import sys
import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from ssdiff import exits
from ssdiff.cli import main
from ssdiff.registry import findings
from ssdiff.reproduce import repro
from ssdiff.registry.known import BY_ID, DEFECTS, UNREPORTED, installed_version, record_problems

FINDINGS = [d for d in DEFECTS if findings.is_finding(d)]

# Implementations harness/reproduce/repro.py writes through ssdiff's registry (no standalone writer for them yet): their
# repro.py needs ssdiff installed.
THROUGH_THE_REGISTRY = ("vllm.",)


def _releases() -> list:
    """(label, directory or None for the installed release, version) of every mamba-ssm release at hand."""
    here = installed_version("mamba-ssm")
    out = [(f"installed-{here}", None, here)] if here else []
    for where in findings.release_dirs():
        version = findings.release_version(where)
        if version and version != here:
            out.append((version, where, version))
    return out


def _repro_params() -> list:
    params = []
    for defect in FINDINGS:
        if defect.package != "mamba-ssm":        # the layers' packages: the installed release only
            version = installed_version(defect.package)
            if version:
                params.append(pytest.param(defect.id, None, version, id=f"{defect.id}-installed-{version}"))
            continue
        for label, where, version in _releases():
            params.append(pytest.param(defect.id, where, version, id=f"{defect.id}-{label}"))
    return params


def _ssdiff_installed(tmp_path) -> bool:
    """Whether a stranger's environment (ssdiff.reproduce.repro.run: nothing of this checkout on the path) imports ssdiff:
    an installed ssdiff (``pip install -e .``, as ./dev setup does) is what a repro through the registry needs."""
    probe = tmp_path / "probe.py"
    probe.write_text("import ssdiff.sides.registry\n")
    return repro.run(probe, timeout=120).returncode == 0


@pytest.mark.parametrize("defect_id, where, version", _repro_params())
def test_repro_fails_where_the_release_is_affected_and_passes_where_fixed(defect_id, where, version,
                                                                         tmp_path):
    defect = BY_ID[defect_id]
    found = findings.read_finding(defect_id)
    assert found is not None, f"no reports/findings/{defect_id}/: run `python -m ssdiff.registry.findings`"
    first, fixed = defect.affected
    if defect.affects(version):
        expected = 1
    elif fixed is not None and Version(version) >= Version(fixed):
        expected = 0
    else:
        pytest.skip(f"{defect.package} {version} predates the defect's first affected release {first}: its repro's case "
                    f"need not mean the same there")
    device = found.get("device", "cpu")
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip(f"its repro.py was written for {device} (the example diverges there only)")
    if found["has_repro"] and found["implementation"].startswith(THROUGH_THE_REGISTRY) \
            and not _ssdiff_installed(tmp_path):
        pytest.skip("its repro.py reaches the implementation through ssdiff's registry, and ssdiff is not installed "
                    "here (a stranger's environment cannot import it; `pip install -e .` or ./dev setup installs it)")
    if not found["has_repro"]:
        if where is None and expected == 1:
            pytest.fail(f"the registry says the installed {defect.package} {version} is affected, yet the example does "
                        f"not diverge with it: {found['why']}")
        pytest.skip(f"no repro: {found['why']}")
    run = findings.run_repro(findings.write_repro(defect_id, tmp_path / "repro.py"), release=where)
    said = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == expected, f"{defect.package} {version}: exit {run.returncode}, expected {expected}\n{said}"
    if expected == 0:
        assert run.stdout.rstrip().endswith("no divergence: fixed"), said
    elif found["raised"]:                     # the side raised: the repro dies of that exception, not another
        assert run.stderr.rstrip().splitlines()[-1] == found["raised"], said
    else:
        assert run.stdout.rstrip().endswith("DIVERGES"), said


def test_findings_md_is_what_the_registry_and_reports_render():
    diff = findings.stale()
    assert diff is None, f"FINDINGS.md is stale: run `python -m ssdiff.registry.findings --render`\n{diff[:4000]}"


@pytest.mark.parametrize("defect_id", [d.id for d in FINDINGS])
def test_each_finding_is_computed_from_the_registrys_example_and_still_matches_it(defect_id):
    defect = BY_ID[defect_id]
    found = findings.read_finding(defect_id)
    assert found is not None, f"no reports/findings/{defect_id}/: run `python -m ssdiff.registry.findings --only {defect_id}`"
    assert found["example"] == defect.example.to_dict(), (
        f"the registry's example changed since reports/findings/{defect_id}/ was computed: run "
        f"`python -m ssdiff.registry.findings --only {defect_id}`")
    assert defect.applies(found["case"]), "the minimized case is no longer one the registry's predicate names"
    if found["has_repro"]:
        text = findings.repro_text(found)
        needs_ssdiff = bool(re.search(r"^\s*(from|import) (ssdiff|harness)", text, re.M))
        assert needs_ssdiff == found["implementation"].startswith(THROUGH_THE_REGISTRY), \
            "repro.py must not need ssdiff (but for the implementations it reaches through ssdiff's registry)"
        assert found["case"].describe() in text


MACHINE = re.compile(r"/(work|home|root)/\w|/[^\s\"'`]*/site-packages/")


@pytest.mark.parametrize("defect_id", [d.id for d in FINDINGS])
def test_a_findings_repro_is_written_from_its_committed_files_alone_the_same_every_time(defect_id, tmp_path, capsys):
    """`ssdiff known --repro ID` writes the repro from case.json and finding.json (no kernel run): twice the same
    bytes, those of `findings.write_repro`, with no date, no path of a machine, and the measurements finding.json
    holds (the budgets ssdiff allowed, the elements it watched) as they were measured."""
    found = findings.read_finding(defect_id)
    if not found["has_repro"]:
        pytest.skip(f"no repro: {found['why']}")
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    for out in (first, second):
        assert main(["known", "--repro", defect_id, "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == str(out)
    text = first.read_text()
    assert second.read_text() == text == findings.write_repro(defect_id, tmp_path / "third.py").read_text()
    assert not re.search(r"\d{4}-\d{2}-\d{2}", text.split('"""', 2)[1]), "the repro's docstring carries a date"
    assert not [line for line in text.splitlines() if MACHINE.search(line)], "a path of this machine"
    assert f"ALLOWED = {json.dumps(found['repro']['allowed'], sort_keys=True)}" in text
    assert f"WATCHED = {json.dumps(found['repro']['watched'], sort_keys=True)}" in text


@pytest.mark.parametrize("defect_id", [d.id for d in FINDINGS])
def test_a_repro_where_it_cannot_run_says_why_in_one_line_and_exits_2(defect_id, tmp_path):
    """Run without its packages (python -S: no site-packages, so no torch either) a repro says, in one line, what
    it lacks and exits 2, the exit-status contract's "cannot run here" (neither 0, fixed, nor 1, diverging); so
    does a repro measured on a GPU where torch sees none (tested where there is none)."""
    found = findings.read_finding(defect_id)
    if not found["has_repro"]:
        pytest.skip(f"no repro: {found['why']}")
    path = findings.write_repro(defect_id, tmp_path / "repro.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-S", str(path)], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert run.returncode == exits.USAGE, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.strip().startswith("repro.py cannot run here: it needs "), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not run.stdout, run.stderr
    if found["repro"]["device"].startswith("cuda") and not torch.cuda.is_available():
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == exits.USAGE and "sees no CUDA device" in run.stderr, run.stderr[-2000:]
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_ssdiff_known_repro_names_the_id_it_has_no_repro_for(tmp_path, capsys):
    not_a_finding = next(d.id for d in DEFECTS if not findings.is_finding(d))
    for defect_id in ("no-such-defect", not_a_finding):
        assert main(["known", "--repro", defect_id, "--out", str(tmp_path / "repro.py")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and defect_id in err, err
    assert not (tmp_path / "repro.py").exists()


def test_the_findings_computation_writes_the_repro_its_files_render(tmp_path):
    """compute_here (minimize the registry's example, measure, write case.json, finding.json and repro.py) on the
    cheapest finding: the repro.py it writes and runs is the one `write_repro` renders from the files it wrote."""
    defect = BY_ID["mamba-state-update-D-none"]
    if not defect.affects(installed_version(defect.package)):
        pytest.skip(f"{defect.package} {installed_version(defect.package)} is not affected by {defect.id}")
    record = findings.compute_here(defect, root=tmp_path, max_runs=4)
    assert record["reproduces"] and record["repro_exit"] == 1, record
    written = (findings.finding_dir(defect.id, tmp_path) / findings.REPRO_FILE).read_text()
    again = findings.write_repro(defect.id, tmp_path / "again.py", root=tmp_path).read_text()
    assert again == written
    assert findings.read_finding(defect.id, tmp_path)["repro"] == record["repro"]


def test_render_names_a_finding_not_computed_and_refuses_one_without_a_draft(tmp_path, monkeypatch):
    text = findings.render(root=tmp_path)
    for defect in FINDINGS:
        assert f"## {defect.id}\n" in text
    assert text.count("Not computed yet: run `python -m ssdiff.registry.findings`.") == len(FINDINGS)
    monkeypatch.delitem(findings.DRAFTS, FINDINGS[0].id)
    with pytest.raises(KeyError, match=FINDINGS[0].id):
        findings.render(root=tmp_path)


@pytest.mark.parametrize("defect", DEFECTS, ids=lambda d: d.id)
def test_every_record_carries_a_severity_a_status_and_upstream_references(defect):
    assert record_problems(defect) == [], f"{defect.id}: " + "; ".join(record_problems(defect))


def test_a_record_without_a_severity_status_or_reference_is_named():
    record = BY_ID["mamba-state-update-D-none"]
    for change, named in ((dict(severity=""), "severity"), (dict(severity="minor"), "severity"),
                          (dict(status="found by ssdiff"), "status"), (dict(references=()), "reported upstream"),
                          (dict(status=UNREPORTED, references=(), searched=""), "no upstream reference"),
                          (dict(affected=("2.0.0", "2.3.0")), "fixed release")):
        problems = record_problems(dataclasses.replace(record, **change))
        assert any(named in p for p in problems), (change, problems)


def test_findings_md_opens_with_one_table_of_every_record_and_drafts_only_unreported_findings():
    text = Path(findings.CATALOGUE).read_text()
    head = text.split("\n## ", 1)[0]
    rows = [line for line in head.splitlines() if line.startswith("| [")]
    assert head.count("| id | project | severity | status | affected releases | upstream |") == 1
    assert len(rows) == len(DEFECTS)
    for defect, row in zip(DEFECTS, rows):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[:5] == [f"[{defect.id}](#{defect.id})", defect.package, defect.severity, defect.status,
                             defect.releases], row
        assert cells[5] == findings.upstream_link(defect).replace("|", "\\|")
    sections = {part.split("\n", 1)[0]: part for part in text.split("\n## ")[1:]}
    assert set(sections) == {d.id for d in DEFECTS}
    for defect in DEFECTS:
        assert ("### Draft upstream report" in sections[defect.id]) == (
            findings.has_draft(defect) and findings.read_finding(defect.id)["reproduces"]), defect.id
        assert text.count(defect.statement) <= 2, f"{defect.id}'s statement is written more than twice"
