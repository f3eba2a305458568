"""`ssdiff fuzz --jobs N`: a campaign split over processes reads as one (harness/campaign/jobs.py)."""

from __future__ import annotations

import argparse
import json

from ssdiff import exits as status
from ssdiff import store
from ssdiff.campaign import jobs
from ssdiff.cli import main


def test_each_job_gets_its_own_seed_output_and_share_of_the_examples():
    argv = ["--impl", "x", "--seed=3", "--jobs", "4", "--out", "o", "--max-examples", "10", "--keep-going"]
    assert jobs.job_argv(argv, 7, "o/job-1", 3) == ["--impl", "x", "--keep-going", "--seed", "7", "--out", "o/job-1",
                                                    "--no-report", "--max-examples", "3"]
    assert jobs.shares(10, 4) == [3, 3, 2, 2] and sum(jobs.shares(7, 3)) == 7
    assert jobs.shares(None, 2) == [None, None]


def _job(tmp_path, i, signature_ratio, divergences, known_count, tf32_explained=()):
    d = tmp_path / f"job-{i}"
    items = []
    for n, sig in enumerate(divergences, 1):
        folder = d / f"divergence-{n:03d}"
        folder.mkdir(parents=True)
        (folder / store.MESSAGE).write_text(f"job {i} {sig}")
        items.append({"number": n, "path": str(folder), "signature": sig, "repeats": 1, "found_after_s": 1.0,
                      "case": "c", "summary": sig})
    store.write_summary(d, {
        "impl": "x", "cases_tried": 10 + i, "cases_skipped": 1, "skip_reasons": {"why": 1}, "stopped": "time",
        "largest_ratio_by_dtype": {"float32": {"ratio": signature_ratio, "side": "x", "tensor": "y", "case": "c"}},
        "largest_ratio_by_side": {}, "divergences": items, "tf32_explained": list(tf32_explained),
        "first_divergence_after_s": 1.0 + i,
        "required_factor_by_side": {"x float32": {"outputs": {"verdicts": 3 + i, "median": 0.5, "p99": 0.9,
                                                              "max": signature_ratio * 4}}},
        "known": [{"id": "k", "reproduced": known_count, "matched_not_reproduced": 0, "first_example": {"a": i},
                   "first_after_s": 5.0 - i, "first_case": f"case {i}"}],
        "throughput": {"judged": 10 + i, "search_s": 30.0 + i, "setup_s": 2.0, "first_judged_after_s": 3.0 + i,
                       "production_shape_cases": 1, "per_case": {"other": {"cases": 10, "examine_s": 0.1,
                                                                           "kernels_s": 0.05}}}})
    return d


def test_merged_summary_sums_the_jobs_and_keeps_one_folder_per_signature(tmp_path):
    tf32 = {"number": 3, "path": str(tmp_path / "job-1" / "tf32-003"), "signature": "t", "repeats": 0,
            "found_after_s": 2.0, "case": "c", "replay": "within budget"}
    dirs = [_job(tmp_path, 0, 0.2, ["a", "b"], 2), _job(tmp_path, 1, 0.7, ["b", "c"], 3, [tf32])]
    merged = jobs.merge(tmp_path, dirs, 11, 40.0, [1, 1])
    assert merged["tf32_explained"] == [dict(tf32, job=1)]          # listed apart, its folder left with its job
    assert merged["cases_tried"] == 21 and merged["cases_skipped"] == 2 and merged["skip_reasons"] == {"why": 2}
    assert [d["signature"] for d in merged["divergences"]] == ["a", "b", "c"]
    assert [d["repeats"] for d in merged["divergences"]] == [1, 3, 1]          # b: 1 + job 1's (1 + 1 repeat)
    for number, d in enumerate(merged["divergences"], 1):
        assert d["path"] == str(tmp_path / f"divergence-{number:03d}")
        assert (tmp_path / f"divergence-{number:03d}" / store.MESSAGE).is_file()
    assert (tmp_path / "job-1" / "divergence-001").is_dir()                   # b again: stays with its job
    assert merged["largest_ratio_by_dtype"]["float32"]["ratio"] == 0.7
    assert merged["known"][0]["reproduced"] == 5 and merged["known"][0]["first_case"] == "case 1"
    # counts add up and maxima compare; a median or a percentile does not merge: each job's stays with the job
    assert merged["required_factor_by_side"] == {"x float32": {"outputs": {"verdicts": 7, "median": None,
                                                                           "p99": None, "max": 2.8}}}
    assert [j["required_factor_by_side"]["x float32"]["outputs"]["median"] for j in merged["jobs"]] == [0.5, 0.5]
    t = merged["throughput"]
    assert t["judged"] == 21 and t["search_s"] == 31.0 and t["judged_per_minute"] == round(21 / (31 / 60), 1)
    assert t["first_judged_after_s"] == 3.0 and t["per_case"]["other"] == {"cases": 20, "examine_s": 0.1,
                                                                            "kernels_s": 0.05}
    assert [j["seed"] for j in merged["jobs"]] == [11, 11 + jobs.SEED_STRIDE]


def test_jobs_find_a_planted_bug_stop_each_other_and_write_one_run(tmp_path, device, capsys):
    out = tmp_path / "run"
    assert main(["fuzz", "--impl", "ssdiff.sides.doubles:mask_bug", "--max-examples", "400", "--pass", "forward",
                 "--dtype", "float32", "--seed", "4", "--device", device, "--out", str(out), "--jobs", "2",
                 "--no-minimize", "--no-report"]) == 1
    summary = json.loads((out / store.SUMMARY).read_text())
    parts = [json.loads((out / f"job-{i}" / store.SUMMARY).read_text()) for i in range(2)]
    assert summary["cases_tried"] == sum(p["cases_tried"] for p in parts)
    assert len(summary["divergences"]) >= 1 and (out / "divergence-001" / "case.json").is_file()
    assert "divergence found" in {p["stopped"] for p in parts}
    assert all(p["stopped"] in ("divergence found", "interrupted") or "budget" in p["stopped"] for p in parts)
    assert "divergence 1 (job" in capsys.readouterr().out


class _Shard:
    """A stand-in for a job (jobs.Job's interface): ``hangs`` never ends until killed, else it ends at once with
    status 0 (its summary written by the test)."""

    def __init__(self, index, folder, hangs):
        self.index, self.folder, self.hangs = index, folder, hangs
        self.name, self.where, self.fault = f"job {index}", {}, None
        self.code, self.ended, self.signals = None, False, []
        self.state = {"tried": 2, "skipped": 0, "elapsed": 1.0, "worst": {}, "divergences": 0, "last": f"case {index}"}

    def update(self):
        if not self.hangs:
            self.code, self.ended = 0, True

    def stop(self):
        self.signals.append("SIGINT")

    def kill(self):
        self.signals.append("SIGKILL")
        self.code, self.ended = -9, True

    def finish(self):
        pass


def test_a_silent_job_is_hung_interrupted_twice_then_killed_and_costs_only_its_shard(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jobs, "HANG_GRACE_S", 0.5)
    monkeypatch.setattr(jobs, "STOP_GRACE_S", 0.3)
    shards = [_Shard(0, _job(tmp_path, 0, 0.2, [], 0), False), _Shard(1, tmp_path / "job-1", True)]
    (tmp_path / "job-1").mkdir()
    args = argparse.Namespace(keep_going=False, max_time=1.0, post_time=0.1, no_report=True, impl="x")
    from rich.console import Console

    code = jobs.drive(shards, args, tmp_path, 3, Console(), Console(stderr=True))
    assert code == status.JOB_DIED
    assert shards[1].signals == ["SIGINT", "SIGINT", "SIGKILL"] and shards[0].signals == []
    summary = json.loads((tmp_path / store.SUMMARY).read_text())
    assert summary["cases_tried"] == 10                      # job 0's, all of them
    assert summary["jobs"][1]["fault"].startswith("hung") and summary["jobs"][1]["last_case"] == "case 1"
    assert "fault" not in summary["jobs"][0]
    assert "job 1 hung" in capsys.readouterr().err


def test_job_folders_left_by_a_lost_driver_merge_afterwards(tmp_path):
    (tmp_path / "job-0").mkdir()                           # a job killed with its driver: no summary
    d = _job(tmp_path, 1, 0.7, ["a", "b"], 0)
    store.write_summary(d, dict(json.loads((d / store.SUMMARY).read_text()), seed=8 + jobs.SEED_STRIDE))
    merged = jobs.merge_afterwards(tmp_path)
    assert json.loads((tmp_path / store.SUMMARY).read_text())["cases_tried"] == merged["cases_tried"] == 11
    assert merged["seed"] == 8 and [j["seed"] for j in merged["jobs"]] == [8, 8 + jobs.SEED_STRIDE]
    assert [d["signature"] for d in merged["divergences"]] == ["a", "b"]
    assert store.read_run(tmp_path)["divergences"][1]["message"] == "job 1 b"


def test_a_folder_written_elsewhere_merges_from_its_job_folder(tmp_path):
    d = _job(tmp_path, 0, 0.2, ["a"], 0)
    summary = json.loads((d / store.SUMMARY).read_text())
    summary["divergences"][0]["path"] = "/elsewhere/job-0/divergence-001"     # where a cluster worker wrote it
    store.write_summary(d, summary)
    merged = jobs.merge(tmp_path, [d], 1, 1.0, [0])
    assert merged["divergences"][0]["path"] == str(tmp_path / "divergence-001")
    assert (tmp_path / "divergence-001" / store.MESSAGE).read_text() == "job 0 a"


def test_a_cluster_worker_gets_its_device_not_the_drivers():
    argv = ["--impl", "x", "--device", "cuda", "--cluster", "auto", "--example-db", "db"]
    assert jobs.job_argv(argv, 1, None, None, drop={"--device": 1}) == ["--impl", "x", "--example-db", "db", "--seed",
                                                                       "1", "--no-report"]
