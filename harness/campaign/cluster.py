"""A campaign past one machine: `ssdiff fuzz --cluster ADDRESS|auto|local[:N]` on Ray, and the shared example
database (`--example-db`) its workers, and any campaign, replay first.

The shards are those of `--jobs` (harness/campaign/jobs.py): each an independent `ssdiff fuzz` process with a seed of
its own (seed + 100000 i), a share of the example budget and the whole time budget. Here each runs under a Ray actor
(`Worker`), one GPU each (num_gpus=1) where the cluster has GPUs, else one CPU each under the Triton interpreter;
spread over the nodes. `local:N` starts a cluster of this machine in-process (N workers; `local`: one per GPU, else
per core), `auto` joins the running one, an ADDRESS that one (`--jobs N` then says how many workers: default one per
GPU, else per CPU). The driver runs jobs.drive: the joint progress line (cases per minute over the cluster, each
worker's state), the stop at the first divergence without --keep-going, the hang rule, the merge into ONE saved run
(DIR/summary.json, DIR/divergence-NNN/) and the exit status of `--jobs`.

Where a worker writes: on the driver's node straight into DIR/job-<i>/; on another node into
$SSDIFF_CLUSTER_DIR (default ~/.cache/ssdiff/cluster)/<run>-<seed>/job-<i>/ on its local disk, sent to DIR/job-<i>/
when it ends. Each worker keeps its own Triton cache on its node's disk ($TRITON_CACHE_DIR or ~/.triton/cache, then
ssdiff-worker-<i>: worker i searches the same compile keys in every run with the same seed). Faults: a worker's
campaign that dies or hangs costs only its shard (the run names the worker, its node and pid, and its last case, from
its progress); a worker Ray loses (its node gone) likewise. The campaigns run in sessions of their own, under a keeper
(`KEEPER`): the driver's loss, which ends the workers, leaves them running to their budgets, and
`python -m ssdiff.campaign.jobs DIR` merges their folders afterwards.

The shared example database (`SharedCases`): Hypothesis' ExampleDatabase interface, a directory
(DirectoryBasedExampleDatabase, on shared storage for a cluster) or Redis (`redis://...`: RedisExampleDatabase).
Each new divergence's case (its JSON and autotune choice) is saved under a key of the sides (implementation, other
side or oracle); a campaign sharing it judges those cases first, before any new case, so that every worker of every
later campaign replays what one worker found. (Hypothesis' choice sequences would not replay: a campaign's searches
differ per compile key.) Off unless `--example-db` is given.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from typing import Optional

from ssdiff import store
from ssdiff.campaign import jobs
from ssdiff.examine import UsageError
from ssdiff.model.case import Case, CaseError

INSTALL = "pip install 'ssdiff[cluster]'"
# Every worker writes on its own node's disk and sends its folder at the end, as a worker of another node does,
# even on the driver's node (the tests take that path on one machine).
SHIP_RESULTS = False
# Seconds the driver waits for a finished worker's folder.
COLLECT_S = 300.0
# A local cluster's object store (bytes): it carries progress states and finished workers' folders only.
LOCAL_OBJECT_STORE = 128 * 1024 * 1024
# The keeper between a worker and its campaign: Ray ends a worker's own children when the worker ends (with the
# driver), not theirs, so the campaign runs on to its budget. It writes the campaign's pid to argv[1], passes a SIGINT
# on, and ends as the campaign did (its status, or its signal).
KEEPER = """import os, signal, subprocess, sys
held = []
signal.signal(signal.SIGINT, lambda *_: held and held[0].send_signal(signal.SIGINT))
held.append(subprocess.Popen(sys.argv[2:]))
with open(sys.argv[1], "w") as out:
    out.write(str(held[0].pid))
code = held[0].wait()
if code < 0:
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code if code >= 0 else 128 - code)
"""


def parse(spec: str) -> tuple:
    """(kind, address, workers) of a --cluster value: ("local", None, N or None), ("auto", "auto", None) or
    ("address", ADDRESS, None). UsageError for a malformed one."""
    text = (spec or "").strip()
    if text == "local" or text.startswith("local:"):
        count = text[len("local:"):] if text != "local" else None
        if count is not None and not (count.isdigit() and int(count) >= 1):
            raise UsageError(f"--cluster {spec}: expected local:N with N a positive integer (or local, auto, ADDRESS)")
        return "local", None, int(count) if count is not None else None
    if text == "auto":
        return "auto", "auto", None
    if not text or any(c.isspace() for c in text):
        raise UsageError(f"--cluster: expected a Ray cluster's ADDRESS, auto, local or local:N, got {spec!r}")
    return "address", text, None


# ---- the shared example database ---------------------------------------------------------------------------

def example_database(spec):
    """The Hypothesis ExampleDatabase of an --example-db value: one as is, a redis:// URL (RedisExampleDatabase),
    else a directory (DirectoryBasedExampleDatabase, created). UsageError where it cannot be used."""
    from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

    if isinstance(spec, ExampleDatabase):
        return spec
    text = str(spec)
    if text.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError:
            raise UsageError(f"--example-db {text}: a Redis database needs the redis package (pip install redis)") \
                from None
        client = redis.Redis.from_url(text)
        try:
            client.ping()
        except redis.RedisError as err:
            raise UsageError(f"--example-db {text}: cannot reach it ({err})") from None
        return RedisExampleDatabase(client)
    path = pathlib.Path(text).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--example-db {text}: expected a directory it can write, cannot create it "
                         f"({err.strerror})") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--example-db {text}: expected a directory it can write, it is read-only")
    return DirectoryBasedExampleDatabase(str(path))


class SharedCases:
    """The divergent cases of one pair of sides in a shared example database (module docstring)."""

    def __init__(self, spec, impl: str, against: Optional[str], oracle: str):
        self.db = example_database(spec)
        self.key = f"ssdiff divergent cases: {impl} against {against or 'the oracle ' + oracle}".encode()

    def save(self, case: Case, choice) -> None:
        self.db.save(self.key, json.dumps({"case": case.to_dict(), "autotune": choice}, sort_keys=True).encode())

    def cases(self) -> list:
        """(case, autotune choice) of each stored case, in one order; unreadable records (another version's) are
        passed over."""
        found = []
        for value in sorted(self.db.fetch(self.key)):
            try:
                record = json.loads(value.decode())
                found.append((Case.from_dict(record["case"]), record.get("autotune", "tuned")))
            except (ValueError, KeyError, TypeError, CaseError):
                continue
        return found

    def replay(self, plan, budget, judge) -> bool:
        """Judge each stored case this campaign's plan takes (its entries, dtypes and pass) with ``judge`` (the
        Fuzzer's: fitted, skipped or judged and recorded); True when ``judge`` says stop (a divergence)."""
        for case, choice in self.cases():
            if case.entry not in plan.entries or case.dtype not in plan.dtypes or (
                    plan.backward is not None and case.backward != plan.backward):
                continue
            if budget.spent():
                return False
            if judge(case, choice):
                return True
        return False


# ---- the workers -----------------------------------------------------------------------------------------------

def _progress(folder: pathlib.Path) -> dict:
    try:
        return json.loads((folder / store.PROGRESS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


class Worker:
    """A Ray actor (ray.remote(Worker)) that runs one shard: a `ssdiff fuzz` process of its node, in a session of
    its own (module docstring: where it writes, its Triton cache). ``env``: the driver's SSDIFF_* variables and
    what the shard's device needs."""

    def __init__(self, index: int, env: dict):
        self.index, self.env = index, env
        self.proc: Optional[subprocess.Popen] = None
        self.folder: Optional[pathlib.Path] = None
        self.local = True
        self._log = None

    def start(self, argv: list, driver_node: Optional[str], driver_folder: str, run_name: str, cwd: str) -> dict:
        import ray

        node = ray.get_runtime_context().get_node_id()
        self.local = driver_node is not None and node == driver_node
        base = self.env.get("SSDIFF_CLUSTER_DIR") or os.environ.get("SSDIFF_CLUSTER_DIR") or \
            os.path.join(os.path.expanduser("~"), ".cache", "ssdiff", "cluster")
        self.folder = pathlib.Path(driver_folder) if self.local else pathlib.Path(base) / run_name / f"job-{self.index}"
        self.folder.mkdir(parents=True, exist_ok=True)
        gpus = [str(g) for g in ray.get_gpu_ids()]
        env = dict(os.environ, **self.env)
        cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
        env["TRITON_CACHE_DIR"] = os.path.join(cache, f"ssdiff-worker-{self.index}")
        if "SSDIFF_COMPILE_WORKERS" not in self.env:        # the node's cores shared by its GPU workers
            on_node = next((n["Resources"].get("GPU", 1) for n in ray.nodes() if n.get("NodeID") == node), 1)
            env["SSDIFF_COMPILE_WORKERS"] = str(max(1, ((os.cpu_count() or 2) - 1) // int(max(1, on_node)))
                                                if gpus else 1)
        self._log = open(self.folder / "log.txt", "w", encoding="utf-8")
        pid_file = self.folder / "campaign.pid"
        pid_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", KEEPER, str(pid_file), sys.executable, "-m", "ssdiff.cli",
                                      "fuzz", *argv, "--out", str(self.folder)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     cwd=cwd if os.path.isdir(cwd) else str(self.folder))
        for _ in range(200):                   # the keeper has started the campaign within moments
            if pid_file.is_file() and pid_file.read_text().strip() or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        pid = pid_file.read_text().strip() if pid_file.is_file() else ""
        where = {"node": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                 "pid": int(pid) if pid.isdigit() else None, "keeper_pid": self.proc.pid, "worker_pid": os.getpid(),
                 "gpus": gpus, "folder": str(self.folder)}
        (self.folder / "worker.json").write_text(json.dumps(where) + "\n", encoding="utf-8")
        return where

    def poll(self) -> dict:
        return {"exit": self.proc.poll(), "progress": _progress(self.folder)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)       # its compile workers and children too
            except OSError:
                self.proc.kill()

    def collect(self) -> Optional[bytes]:
        """The shard's folder as a gzipped tar, or None where the driver has it already (its node)."""
        if self._log is not None:
            self._log.close()
        if self.local:
            return None
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.add(str(self.folder), arcname=".")
        return buffer.getvalue()

    def discard(self) -> None:
        """Remove the node's copy once the driver has the folder."""
        if not self.local:
            shutil.rmtree(self.folder, ignore_errors=True)


class RayShard:
    """The driver's side of one worker: what jobs.drive asks a shard (see jobs.Job), over Ray. Never blocks: each
    `update` collects the answer to the previous one's question."""

    def __init__(self, index: int, actor, options: dict, env: dict, argv: list, folder: pathlib.Path,
                 driver_node: Optional[str], run_name: str):
        self.index, self.folder = index, folder
        self.name = f"worker {index}"
        self.where: dict = {}
        self.code: Optional[int] = None
        self.ended = False
        self.state: dict = {}
        self.fault: Optional[str] = None
        self.handle = actor.options(**options).remote(index, env)
        self._started = self.handle.start.remote(argv, driver_node, str(folder.resolve()), run_name, os.getcwd())
        self._asked = None

    def _lost(self, err) -> None:
        self.fault = f"lost: Ray lost its worker ({(str(err).strip().splitlines() or [type(err).__name__])[0][:200]})"
        self.ended = True

    def update(self) -> None:
        import ray
        from ray.exceptions import RayError

        if self.ended:
            return
        try:
            if not self.where:
                if not ray.wait([self._started], timeout=0)[0]:
                    return                      # waiting for room on the cluster, or starting
                self.where = ray.get(self._started)
                gpu = f", GPU {','.join(self.where['gpus'])}" if self.where["gpus"] else ""
                self.name = (f"worker {self.index} ({self.where['node']} {self.where['host']}{gpu}, "
                             f"pid {self.where['pid']})")
            if self._asked is None:
                self._asked = self.handle.poll.remote()
            if not ray.wait([self._asked], timeout=0)[0]:
                return
            answer, self._asked = ray.get(self._asked), None
        except RayError as err:
            self._lost(err)
            return
        self.state = answer["progress"] or self.state
        self.code = answer["exit"]
        self.ended = self.code is not None

    def stop(self) -> None:
        import ray

        if not self.where:                      # never started: the cluster had no room for it
            ray.kill(self.handle)
            self.fault, self.ended = "never started (no room on the cluster)", True
            return
        self.handle.stop.remote()

    def kill(self) -> None:
        self.handle.kill.remote()

    def finish(self) -> None:
        """Bring the shard's folder here (from another node), then end the actor."""
        import ray
        from ray.exceptions import RayError

        if self.where and not (self.fault or "").startswith(("lost", "never")):
            try:
                data = ray.get(self.handle.collect.remote(), timeout=COLLECT_S)
                if data:
                    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                        tar.extractall(self.folder, filter="data")
                    ray.get(self.handle.discard.remote(), timeout=COLLECT_S)
            except RayError as err:
                self.where["results_left_at"] = f"{self.where.get('host')}:{self.where.get('folder')}"
                self.fault = self.fault or f"lost: its folder could not be brought here ({type(err).__name__})"
        ray.kill(self.handle)


def _states(shards: list) -> str:
    """Each worker's state, for the progress line."""
    parts = []
    for s in shards:
        if s.fault:
            what = s.fault.split(" ")[0].rstrip(":")
        elif s.ended:
            what = "done" if s.code in (0, 1, 4) else f"died ({s.code})"
        else:
            what = "running" if s.where else "starting"
        parts.append(f"w{s.index}{'@' + s.where['node'] if s.where else ''} {what} {s.state.get('tried', 0)}")
    return ", ".join(parts)


def _absolute_db(argv: list) -> list:
    """``argv`` with --example-db's directory made absolute (the workers run elsewhere)."""
    out, after = [], False
    for arg in argv:
        if after or arg.startswith("--example-db="):
            value = arg.split("=", 1)[1] if not after else arg
            if "://" not in value:
                value = str(pathlib.Path(value).expanduser().resolve())
            out.append(value if after else f"--example-db={value}")
        else:
            out.append(arg)
        after = arg == "--example-db"
    return out


def run(args, argv: list, console, err_console) -> int:
    """`ssdiff fuzz --cluster SPEC` (module docstring): join or start the cluster, run the shards as workers, merge."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--cluster needs Ray, an optional extra: {INSTALL}") from None
    kind, address, count = parse(args.cluster)
    if count is not None and args.jobs > 1 and args.jobs != count:
        raise UsageError(f"--cluster {args.cluster} with --jobs {args.jobs}: give the number of workers once")
    started = False
    if not ray.is_initialized():
        try:
            if kind == "local":
                ray.init(address="local", num_cpus=max(count or 0, os.cpu_count() or 1), include_dashboard=False,
                         object_store_memory=LOCAL_OBJECT_STORE, log_to_driver=False, logging_level="ERROR")
            else:
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except Exception as err:            # no cluster there, or Ray cannot start here: the environment's
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise UsageError(f"--cluster {args.cluster}: no Ray cluster to run on ({first})") from None
        started = True
    try:
        return _run(ray, args, argv, count, console, err_console)
    finally:
        if started:
            ray.shutdown()


def _run(ray, args, argv, count, console, err_console) -> int:
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    device = args.device or ("cuda" if gpus else "cpu")
    on_gpu = device.startswith("cuda")
    capacity = gpus if on_gpu else cpus
    n = count or (args.jobs if args.jobs > 1 else capacity)
    if n < 1 or n > capacity:
        raise UsageError(f"--cluster {args.cluster}: {n} worker(s) of one {'GPU' if on_gpu else 'CPU'} each, but the "
                         f"cluster has {capacity}")
    n = min(n, args.max_examples) if args.max_examples else n          # no worker without an example
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    out = jobs.output_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("SSDIFF_")}
    if not on_gpu:                          # the interpreter, whatever the node has
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    options = {"num_cpus": 1, "num_gpus": 1 if on_gpu else 0, "max_restarts": 0, "scheduling_strategy": "SPREAD"}
    actor = ray.remote(Worker)
    import ray.util.client

    driver_node = None if SHIP_RESULTS or ray.util.client.ray.is_connected() else \
        ray.get_runtime_context().get_node_id()
    argv = _absolute_db(argv)
    shards = []
    for i, examples in enumerate(jobs.shares(args.max_examples, n)):
        folder = out / f"job-{i}"
        folder.mkdir(exist_ok=True)
        shard_argv = jobs.job_argv(argv, seed + i * jobs.SEED_STRIDE, None, examples, drop={"--device": 1})
        shards.append(RayShard(i, actor, options, env, shard_argv + ["--device", device], folder, driver_node,
                               f"{out.name}-{seed}"))
    each = "GPU" if on_gpu else "CPU under the Triton interpreter"
    err_console.print(f"fuzz {args.impl} on a Ray cluster ({args.cluster}: {n} workers of one {each} each, of {gpus} "
                      f"GPUs and {cpus} CPUs; seeds {seed} + {jobs.SEED_STRIDE} i) -> {out}", highlight=False,
                      soft_wrap=True)
    extra = {"cluster": {"spec": args.cluster, "workers": n, "device": device, "gpus": gpus, "cpus": cpus}}
    return jobs.drive(shards, args, out, seed, console, err_console, what="workers", extra=extra, states_text=_states)


__all__ = ["run", "parse", "example_database", "SharedCases", "Worker", "RayShard", "INSTALL"]
