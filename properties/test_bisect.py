"""`ssdiff bisect` (harness/registry/bisect.py): the search finds both transitions of one affected interval wherever
it lies, in few probes; the releases it takes are those of the range; a record's stored bisect result is what its
affected releases say, and what it says of the installed release is what the registry says (which
properties/test_upstream.py::test_known_defect_reproduces checks against a replay). No install runs here.
"""

import json
import math

import pytest

from ssdiff.cli import main
from ssdiff.registry import bisect, findings
from ssdiff.registry.known import DEFECTS, installed_version

RELEASES = [f"2.{minor}.{patch}" for minor in range(4) for patch in range(4)]        # 16 releases


def _interval(first_bad, first_good, na=()):
    """A probe for releases bad on [first_bad, first_good) (indices; None: none bad / no fix), n/a on ``na``;
    it records which it was asked."""
    asked = []

    def probe(release):
        asked.append(release)
        i = RELEASES.index(release)
        if i in na:
            return bisect.Probe(release, bisect.NA)
        bad = first_bad is not None and i >= first_bad and (first_good is None or i < first_good)
        return bisect.Probe(release, bisect.BAD if bad else bisect.GOOD, math.inf if bad else 0.5)
    return probe, asked


def _result(seen):
    return bisect.Bisection("mamba-ssm", RELEASES, seen)


@pytest.mark.parametrize("first_bad, first_good", [(0, None), (0, 7), (5, None), (3, 11), (9, 10), (15, None)])
def test_bisect_finds_both_ends_of_the_affected_interval_in_few_probes(first_bad, first_good):
    probe, asked = _interval(first_bad, first_good)
    hint = RELEASES[first_bad]
    result = _result(bisect.search(RELEASES, probe, hint=hint))
    assert result.first_bad == RELEASES[first_bad]
    assert result.first_good == (RELEASES[first_good] if first_good is not None else None)
    assert len(asked) == len(set(asked)), "a release probed twice"
    assert len(asked) <= 2 + 1 + 2 * math.ceil(math.log2(len(RELEASES))), asked        # no linear scan


def test_without_a_hint_the_search_looks_for_a_bad_release_from_the_middle_out():
    probe, asked = _interval(6, 9)
    result = _result(bisect.search(RELEASES, probe, hint=None))
    assert (result.first_bad, result.first_good) == (RELEASES[6], RELEASES[9])
    probe, asked = _interval(None, None)
    result = _result(bisect.search(RELEASES, probe))
    assert result.first_bad is None and result.first_good is None and len(asked) == len(RELEASES)


def test_releases_that_cannot_run_are_stepped_over():
    probe, asked = _interval(4, 12, na=(0, 7, 8, 11))
    result = _result(bisect.search(RELEASES, probe, hint=RELEASES[5]))
    assert (result.first_bad, result.first_good) == (RELEASES[4], RELEASES[12])


def test_a_short_range_is_probed_whole():
    short = RELEASES[:bisect.LINEAR]
    probe, asked = _interval(1, 3)
    seen = bisect.search(short, probe, hint=None)
    assert sorted(asked) == sorted(short) and bisect.Bisection("x", short, seen).first_good == short[3]


def test_the_range_takes_final_releases_between_its_ends():
    versions = ["2.0.0", "2.2.3.post2", "2.2.4", "2.3.0rc1", "2.3.0", "2.3.2.post1", "3.0.0.dev1", "junk"]
    assert bisect.in_range(versions, "2.2.3..2.3.2.post1") == ["2.2.3.post2", "2.2.4", "2.3.0", "2.3.2.post1"]
    assert bisect.in_range(versions, "..2.2.4") == ["2.0.0", "2.2.3.post2", "2.2.4"]
    assert bisect.in_range(versions, None)[-1] == "2.3.2.post1"
    with pytest.raises(bisect.BisectError):
        bisect.in_range(versions, "2.2.4")


STORED = [d for d in DEFECTS if bisect.stored(d.id) is not None]


def test_records_are_bisected():
    assert {"mamba-softplus-backward-nan-above-20", "mamba-grouped-norm-backward",
            "transformers-mamba2-norm-ignores-groups"} <= {d.id for d in STORED}


@pytest.mark.parametrize("defect", STORED, ids=lambda d: d.id)
def test_a_records_affected_releases_are_its_stored_bisect_and_agree_on_the_installed_release(defect):
    result = bisect.stored(defect.id)
    again = bisect.Bisection(result["package"], bisect.in_range([p["release"] for p in result["probes"]], None),
                             {p["release"]: bisect.Probe(p["release"], p["verdict"], p["ratio"])
                              for p in result["probes"]})
    assert (again.first_bad, again.first_good) == (result["first_bad"], result["first_good"]), \
        "bisect.json's first bad / first good are not what its probes say"
    assert result["package"] == defect.package
    assert defect.affected == (result["first_bad"], result["first_good"]), (
        f"{defect.id}: the record says {defect.affected}, `ssdiff bisect {defect.id} --releases "
        f"{'..'.join(result['range'])}` found {(result['first_bad'], result['first_good'])}")
    version = installed_version(defect.package)
    said = bisect.verdict_at(result, version) if version else None
    if said is not None:
        assert (said == bisect.BAD) == defect.affects(version), (version, said)


def test_bisect_offline_without_cached_releases_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SSDIFF_RELEASES", str(tmp_path))
    assert main(["bisect", "mamba-grouped-norm-backward", "--releases", "2.0.0..2.3.2.post1", "--offline"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no release of mamba-ssm" in err and "--offline" in err, err
    assert main(["bisect", str(tmp_path / "missing.json")]) == 2
    assert "neither a known defect" in capsys.readouterr().err


def test_a_stored_result_round_trips(tmp_path):
    probe, _ = _interval(3, 11)
    result = _result(bisect.search(RELEASES, probe, hint=RELEASES[3]))
    path = bisect.store("some-record", result, root=tmp_path)
    assert json.loads(path.read_text()) == bisect.stored("some-record", root=tmp_path) == result.to_dict()
    stored = result.to_dict()
    assert [bisect.verdict_at(stored, r) for r in ("2.0.2", "2.0.3", "2.2.2", "2.2.3", "9.0.0")] == \
        [bisect.GOOD, bisect.BAD, bisect.BAD, bisect.GOOD, None]
    assert findings.FINDINGS_DIR.name == "findings"


def test_a_run_failure_is_the_defect_only_when_it_raises_what_the_defect_raises():
    assert bisect.classify("ok", "", "TypeError") == bisect.GOOD
    assert bisect.classify("nonfinite", "", "") == bisect.classify("diverged", "", None) == bisect.BAD
    assert bisect.classify("error", "TypeError", "TypeError") == bisect.BAD
    assert bisect.classify("error", "InterpreterError", "TypeError") == bisect.NA      # an old release under new triton
    assert bisect.classify("error", "InterpreterError", "") == bisect.NA               # the defect raises nothing
    assert bisect.classify("error", "InterpreterError", None) == bisect.BAD            # a case file: unknown
