"""The exit-status contract (harness/exits.py) at the edge: every bad input is one line and status 2, a failure
inside ssdiff is one line and status 5 with its traceback in a file, and a campaign that judged too little never
says 0.

- a table of bad inputs (flags, case files, devices, saved runs, names), each fed to its command in a child process
  as a user types it: status 2, one line on stderr naming what was wrong, no traceback;
- an exception inside a command: status 5, one line naming the file that holds the traceback;
- a campaign whose every drawn case is skipped, or fails inside ssdiff: status 4, and the console says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ssdiff import exits
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer
from ssdiff.model.case import Case
from ssdiff.sides.base import Capabilities, limit
from ssdiff.sides.doubles import ToyKernel
from ssdiff.sides.registry import register


def _files(folder) -> dict:
    """Inputs the table's rows name: a case file with a bad field, a saved case without sides beside it, a case of
    another entry point, a folder that is not a saved run."""
    bad = folder / "bad.json"
    bad.write_text(json.dumps({**Case().to_dict(), "ngroups": 3}))
    lone = folder / "lone" / "case.json"
    lone.parent.mkdir()
    lone.write_text(Case().to_json())
    mixer = folder / "mixer.json"
    mixer.write_text(Case(entry="split_conv1d", nheads=2, headdim=4, dstate=4).to_json())
    (folder / "empty").mkdir()
    return {"bad": str(bad), "lone": str(lone), "mixer": str(mixer), "empty": str(folder / "empty"),
            "missing": str(folder / "missing.json")}


# (command line, words the one line must hold); {name} is a path of _files
BAD = [
    ("fuzz --impl ssdiff.triton --device cuda:9", "device 'cuda:9'"),
    ("fuzz --impl ssdiff.triton --device tpu", "device 'tpu'"),
    ("fuzz --impl ssdiff.triton --max-time nan", "--max-time"),
    ("fuzz --impl ssdiff.triton --max-time inf", "--max-time"),
    ("fuzz --impl ssdiff.triton --max-time 0", "--max-time"),
    ("fuzz --impl ssdiff.triton --max-time -3", "--max-time"),
    ("demo --max-time -3", "--max-time"),
    ("fuzz --impl ssdiff.triton --max-examples 0", "--max-examples"),
    ("fuzz --impl ssdiff.triton --max-examples -5", "--max-examples"),
    ("fuzz --impl ssdiff.triton --chunk-sizes a,b", "--chunk-sizes"),
    ("fuzz --impl ssdiff.triton --chunk-sizes 4,6", "--chunk-sizes"),
    ("fuzz --impl ssdiff.triton --max-seqlen -1", "--max-seqlen"),
    ("fuzz --impl ssdiff.triton --timeout nan", "--timeout"),
    ("fuzz --impl ssdiff.triton --post-time -1", "--post-time"),
    ("fuzz --impl ssdiff.triton --huge 2", "--huge"),
    ("fuzz --impl ssdiff.triton --jobs 0", "--jobs"),
    ("fuzz --impl ssdiff.triton --dtype float64", "float64"),
    ("fuzz --impl ssdiff.triton --autotune fastest", "--autotune"),
    ("fuzz --impl ssdiff.triton --entry nope", "--entry"),
    ("fuzz --impl nope", "unknown implementation 'nope'"),
    ("fuzz --impl no_such_module:fn", "no_such_module"),
    ("replay {lone} --worst -2", "--worst"),
    ("replay {lone}", "give --impl"),
    ("replay {missing} --impl ssdiff.triton", "missing.json"),
    ("replay {mixer} --impl mamba_ssm.chunk_scan_ref", "not one every side takes"),
    ("minimize {bad} --impl ssdiff.triton", "ngroups=3"),
    ("selfcheck --device cuda:9", "device 'cuda:9'"),
    ("known --impl nope", "unknown implementation 'nope'"),
    ("known --case nope", "nope"),
    ("known --repro nope", "nope"),
    ("list --impl nope", "unknown implementation 'nope'"),
    ("case {missing}", "missing.json"),
    ("case {bad}", "bad.json: ngroups=3"),
    ("report {empty}", "empty"),
    ("nope", "invalid choice"),
]


# Runs each command line of stdin's JSON list through the CLI's main as `ssdiff ...` would, in this one child
# process (a fresh interpreter: the table's rows cost one import of torch, not one each), and prints, per row, its
# exit status, what it wrote, and whether an exception escaped (a traceback a user would see).
DRIVER = """
import contextlib, io, json, sys, traceback
from ssdiff import cli
results = []
for argv in json.load(sys.stdin):
    out, err, escaped = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as stop:
            status = stop.code
        except BaseException:
            status, escaped = None, traceback.format_exc()
    results.append({"status": status, "out": out.getvalue(), "err": err.getvalue(), "escaped": escaped})
print(json.dumps(results))
"""


def test_every_bad_input_is_one_line_and_status_2(tmp_path):
    """Each row as a user types it, through the CLI's main in a child process: status 2, one line on stderr holding
    the row's words, no traceback, nothing judged."""
    files = _files(tmp_path)
    rows = [(line.format(**files).split(), words) for line, words in BAD]
    run = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps([argv for argv, _ in rows]),
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr[-3000:]
    problems = []
    for (argv, words), result in zip(rows, json.loads(run.stdout.splitlines()[-1])):
        said = result["err"].strip()
        if result["status"] != exits.USAGE or len(said.splitlines()) != 1 or words not in said \
                or result["escaped"] or "Traceback" in result["out"] + result["err"]:
            problems.append(f"ssdiff {' '.join(argv)}: status {result['status']}, said {said[-600:]!r}"
                            + (f"\n{result['escaped']}" if result["escaped"] else ""))
    assert not problems, "\n".join(problems)


def test_an_error_inside_ssdiff_is_one_line_status_5_and_its_traceback_in_a_file(tmp_path, monkeypatch, capsys):
    from ssdiff import cli

    def broken(args):
        raise ZeroDivisionError("a bug of ssdiff's own")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "cmd_selfcheck", broken)
    assert cli.main(["selfcheck", "--device", "cpu"]) == exits.INTERNAL
    said = capsys.readouterr().err.strip()
    assert len(said.splitlines()) == 1 and "internal error (ZeroDivisionError: a bug of ssdiff's own)" in said, said
    path = said.split("its traceback is in ", 1)[1].split(": please report", 1)[0]
    text = (tmp_path / path).read_text() if not os.path.isabs(path) else open(path).read()
    assert "Traceback" in text and "ZeroDivisionError" in text and "ssdiff" in text.splitlines()[0]


class Refuses(ToyKernel):
    """Takes no case at all (a limit every case meets)."""

    def __init__(self):
        super().__init__()
        self.name = "planted.refuses_every_case"
        self.capabilities = Capabilities(entries=frozenset({"chunk_scan"}), dtypes=frozenset({"float32"}),
                                         limits=(limit(lambda case: True, "refuses every case"),))


def test_a_campaign_with_every_case_skipped_says_so_and_exits_4(tmp_path, device, capsys):
    from ssdiff import cli

    refuses = register(Refuses())
    status = cli.main(["fuzz", "--impl", refuses.name, "--max-examples", "20", "--device", device, "--no-report",
                       "--out", str(tmp_path / "run"), "--seed", "1"])
    said = capsys.readouterr()
    assert status == exits.TOO_LITTLE, (status, said.out[-2000:], said.err[-2000:])
    assert "judged too little to mean anything: no case was judged" in said.out
    assert "were skipped, not judged; the most common reasons: refuses every case" in " ".join(said.err.split())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["cases_tried"] == 0 and summary["judged_too_little"] == "no case was judged"


def test_a_campaign_whose_cases_fail_inside_ssdiff_never_exits_0(tmp_path, device, monkeypatch):
    fuzzer = Fuzzer(FuzzConfig(impl="ssdiff.sides.doubles:healthy", device=device, max_time=None, max_examples=6,
                               out_dir=str(tmp_path), report_dir=None, seed=2, entry="chunk_scan"))

    def broken(case, choice="tuned", stages=False, sides=None):
        raise RuntimeError("the oracle broke")

    monkeypatch.setattr(fuzzer.examiner, "examine", broken)
    report = fuzzer.run()
    assert report.tried == 0 and report.harness_errors and report.exit_code == exits.TOO_LITTLE


def test_a_campaign_that_judged_cases_and_found_nothing_exits_0(tmp_path, device):
    report = Fuzzer(FuzzConfig(impl="ssdiff.sides.doubles:healthy", device=device, max_time=None, max_examples=3,
                               out_dir=str(tmp_path), report_dir=None, seed=2)).run()
    assert report.tried == 3 and report.exit_code == exits.OK
