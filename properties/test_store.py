"""The saved-run format (harness/store.py): what is written reads back, first-format runs still read, and a run
from a newer format is refused with one line naming both versions."""

from __future__ import annotations

import json

import pytest

from ssdiff import store
from ssdiff.model.case import Case
from ssdiff.report import render
from ssdiff.verdict.judge import failed_run


def _saved_run(root, device):
    case = Case(seqlen=8, seed=3)
    verdicts = {"impl": failed_run("impl", "error", "planted failure")}
    folder = store.write_divergence(store.divergence_folder(root, 1), case, verdicts, "impl raised", {"text": "t"},
                                    device=device)
    store.write_summary(root, {"impl": "impl", "cases_tried": 1, "divergences": [{"number": 1, "path": str(folder)}]})
    store.write_minimized(folder, case.replace(seqlen=4), {"verdicts": {s: v.to_dict() for s, v in verdicts.items()}})
    return case, folder


def test_a_saved_run_reads_back_as_written(tmp_path, device):
    case, folder = _saved_run(tmp_path, device)
    run = store.read_run(tmp_path)
    item = run["divergences"][0]
    assert Case.from_dict(item["case"]) == case and item["message"] == "impl raised\n"
    assert item["verdict"]["format"] == store.FORMAT and item["verdict"]["device"] == device
    assert Case.from_dict(item["minimized"]) == case.replace(seqlen=4)
    assert store.recorded_sides(folder / store.CASE) == ["impl"]
    assert store.stored_verdicts(folder / store.MINIMIZED)["impl"]["status"] == "error"
    assert render.render_run(tmp_path, tmp_path / "reports").is_file()


def test_a_first_format_run_still_reads(tmp_path, device):
    _, folder = _saved_run(tmp_path, device)
    for path in (tmp_path / store.SUMMARY, folder / store.VERDICT):
        record = json.loads(path.read_text())
        del record["format"]
        path.write_text(json.dumps(record))
    assert store.read_run(tmp_path)["divergences"][0]["verdict"]["verdicts"]["impl"]["status"] == "error"


def test_a_newer_format_is_refused_in_one_line(tmp_path, device):
    _, folder = _saved_run(tmp_path, device)
    record = json.loads((folder / store.VERDICT).read_text())
    record["format"] = store.FORMAT + 1
    (folder / store.VERDICT).write_text(json.dumps(record))
    with pytest.raises(store.RunError) as err:
        store.read_run(tmp_path)
    text = str(err.value)
    assert "\n" not in text and f"format {store.FORMAT + 1}" in text and f"up to {store.FORMAT}" in text
