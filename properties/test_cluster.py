"""`ssdiff fuzz --cluster`: a campaign's shards as Ray workers read as one run, a lost worker costs only its shard,
and a shared example database makes every later campaign replay a divergence first (harness/campaign/cluster.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest

from ssdiff import exits, store
from ssdiff.campaign import cluster, jobs
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer
from ssdiff.cli import main
from ssdiff.examine import UsageError
from ssdiff.model.case import Case

BUG = "ssdiff.sides.doubles:group_bug"
QUICK = ["--pass", "forward", "--dtype", "float32", "--no-localize", "--no-minimize", "--no-report"]


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def test_without_ray_cluster_says_so_in_one_line_with_status_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)           # import ray fails, as where it is not installed
    assert main(["fuzz", "--impl", BUG, "--max-examples", "2", "--cluster", "local:2"]) == exits.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cluster" in err[0] and cluster.INSTALL in err[0], err


def test_cluster_values():
    assert cluster.parse("local") == ("local", None, None) and cluster.parse("local:3") == ("local", None, 3)
    assert cluster.parse("auto") == ("auto", "auto", None)
    assert cluster.parse("ray://head:10001") == ("address", "ray://head:10001", None)
    for bad in ("local:0", "local:x", "", "a b"):
        with pytest.raises(UsageError, match="--cluster"):
            cluster.parse(bad)


def test_stored_divergent_cases_are_judged_before_any_new_case(tmp_path, device):
    """The Fuzzer's part (harness/campaign/fuzz.py): a new divergence's case is saved; a later campaign of the same
    sides, another seed, judges it first."""
    db = tmp_path / "db"

    def campaign(seed, examples):
        return Fuzzer(FuzzConfig(impl=BUG, max_time=None, max_examples=examples, pass_="forward", dtypes=("float32",),
                                 device=device, out_dir=str(tmp_path / f"run-{seed}"), seed=seed, localize=False,
                                 minimize=False, report_dir=None, example_db=str(db))).run()

    first = campaign(1, 300)
    assert first.findings and first.findings[0].cases_before > 0
    stored = cluster.SharedCases(db, BUG, None, FuzzConfig(impl=BUG).oracle).cases()
    assert [case for case, _ in stored] == [first.findings[0].outcome.case]
    later = campaign(2, 1)
    assert later.tried == 1 and later.findings[0].cases_before == 0
    assert later.findings[0].outcome.case == first.findings[0].outcome.case


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster of two CPUs for the module's campaigns (their driver joins it: `--cluster local:2`)."""
    ray = pytest.importorskip("ray", reason="the [cluster] extra is not installed")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=cluster.LOCAL_OBJECT_STORE,
             log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _two_workers_fit(ray, device):
    if device.startswith("cuda") and ray.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("two workers of one GPU each need two GPUs")


def test_a_killed_worker_costs_only_its_shard_and_is_named_with_its_last_case(ray_cluster, tmp_path, device, capsys):
    _two_workers_fit(ray_cluster, device)
    out = tmp_path / "run"
    killed = {}

    def kill_worker_1():
        """Once worker 1 has judged a few cases: SIGKILL to its campaign."""
        give_up = time.monotonic() + 120
        while time.monotonic() < give_up and not killed:
            where, progress = _read(out / "job-1" / "worker.json"), _read(out / "job-1" / store.PROGRESS)
            if where and progress.get("tried", 0) >= 3:
                os.kill(where["pid"], signal.SIGKILL)
                killed.update(where=where, progress=progress)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_worker_1, daemon=True)
    killer.start()
    code = main(["fuzz", "--impl", "ssdiff.sides.doubles:healthy", "--max-time", "8", "--seed", "5", "--device", device,
                 "--out", str(out), "--cluster", "local:2", *QUICK])
    killer.join()
    assert killed, "worker 1 never judged three cases"
    assert code == exits.JOB_DIED                           # as for a dead --jobs job: nothing diverged
    summary, other = _read(out / store.SUMMARY), _read(out / "job-0" / store.SUMMARY)
    assert other["stopped"].startswith("time budget") and other["cases_tried"] > 0
    assert summary["cases_tried"] == other["cases_tried"] and not (out / "job-1" / store.SUMMARY).exists()
    assert summary["throughput"]["judged"] == other["cases_tried"]
    dead = summary["jobs"][1]
    assert dead["fault"] == "died" and dead["exit"] == -signal.SIGKILL and dead["pid"] == killed["where"]["pid"]
    assert dead["cases_when_lost"] >= killed["progress"]["tried"] and dead["last_case"]
    said = capsys.readouterr().err
    assert f"worker 1 ({killed['where']['node']}" in said and f"pid {killed['where']['pid']}) died" in said
    assert dead["last_case"] in said and "fault" not in summary["jobs"][0]


def test_a_divergence_one_worker_found_is_replayed_first_by_every_worker_of_a_later_campaign(
        ray_cluster, tmp_path, device, monkeypatch, capsys):
    _two_workers_fit(ray_cluster, device)
    # the workers write on "their node's" disk and send their folders, as workers of other hosts do
    monkeypatch.setattr(cluster, "SHIP_RESULTS", True)
    monkeypatch.setenv("SSDIFF_CLUSTER_DIR", str(tmp_path / "nodes"))
    db, first, later = tmp_path / "db", tmp_path / "first", tmp_path / "later"
    fuzz = ["fuzz", "--impl", BUG, "--device", device, "--cluster", "local:2", "--example-db", str(db), *QUICK]
    assert main([*fuzz, "--seed", "1", "--max-examples", "300", "--out", str(first)]) == exits.DIVERGENCE
    run = store.read_run(first)                             # one run: it reads, and replays, as a local one
    assert run["divergences"] and run["summary"]["cases_tried"] == sum(
        _read(first / f"job-{i}" / store.SUMMARY)["cases_tried"] for i in range(2))
    assert not list((tmp_path / "nodes").rglob("summary.json"))          # brought home, the nodes' copies gone
    assert main(["replay", str(first / "divergence-001" / store.CASE), "--device", device]) == exits.DIVERGENCE
    stored = {case.describe() for case, _ in cluster.SharedCases(db, BUG, None, FuzzConfig(impl=BUG).oracle).cases()}
    assert Case.load(first / "divergence-001" / store.CASE).describe() in stored
    capsys.readouterr()
    # a later campaign, another seed, an example each: every worker's first case is a stored one, and diverges
    assert main([*fuzz, "--seed", "2", "--max-examples", "2", "--out", str(later)]) == exits.DIVERGENCE
    for i in range(2):
        shard = _read(later / f"job-{i}" / store.SUMMARY)
        assert shard["cases_tried"] == 1 and shard["divergences"][0]["cases_before"] == 0, shard
        assert shard["divergences"][0]["case"] in stored


def test_a_campaign_outlives_its_worker_so_the_drivers_loss_leaves_its_results(ray_cluster, tmp_path, device):
    """Ray ends a worker's own children with the worker (as when the driver is lost): the campaign, under its keeper,
    runs on to its budget, writes its summary, and the folder merges afterwards (`python -m ssdiff.campaign.jobs`)."""
    worker = ray_cluster.remote(cluster.Worker).options(
        num_cpus=1, num_gpus=1 if device.startswith("cuda") else 0).remote(0, {})
    node = ray_cluster.get_runtime_context().get_node_id()
    where = ray_cluster.get(worker.start.remote(["--impl", "ssdiff.sides.doubles:healthy", "--max-time", "3", "--seed",
                                                 "1", "--device", device, *QUICK], node, str(tmp_path / "job-0"),
                                                "run", str(tmp_path)))
    ray_cluster.wait([worker.__ray_terminate__.remote()], timeout=30)     # it ends, as the driver's loss ends it
    give_up = time.monotonic() + 60
    while not (tmp_path / "job-0" / store.SUMMARY).is_file() and time.monotonic() < give_up:
        time.sleep(0.2)
    assert _read(tmp_path / "job-0" / store.SUMMARY)["stopped"].startswith("time budget"), where
    assert jobs.merge_afterwards(tmp_path)["cases_tried"] > 0
