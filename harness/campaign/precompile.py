"""Compiling a campaign's kernels ahead, in parallel on the host's cores (natively only).

Triton compiles in the process that launches, one kernel variant after another (about 0.6 s each on an H200
host: LLVM, ptxas, the launcher stub); a tuned first case of mamba_chunk_scan_combined forward+backward needs
over a hundred variants — every config of every kernel. `Compiler` runs each compile key's representative case
(harness/campaign/pool.py, `CompileKey.case`) in worker processes, one job per autotune config index the campaign's
policy will launch ("tuned" benchmarks them all), so the variants land in Triton's on-disk cache
(TRITON_CACHE_DIR, ~/.triton/cache) and the campaign's own process loads them instead of compiling; under
"tuned" one more job per case benchmarks the configs of a side with autotuned kernels, so that the autotune
results are on disk too. Each side gets the config indices of its own autotuned kernels (a reference that
launches one untuned norm kernel: one job). A job that fails is reported and otherwise ignored: the campaign's
own run of that case is what is judged. A job done is recorded beside the cache and not queued again on it
(`Compiler`): a campaign on a warm cache starts judging at once.
Workers are spawned processes: a script that runs a campaign at import time needs the usual
``if __name__ == "__main__":`` guard (the CLI and pytest have it).

    compiler = Compiler(sides, device, autotune)
    compiler.submit(cases)          # returns at once; the workers compile in the background
    compiler.wait(case, timeout)    # before judging a case compiled ahead: its configs' jobs done
    compiler.wait(case, timeout, 0) # ... or those of config 0
    compiler.progress()             # (done, queued), for the progress line

A case compiled ahead is judged tuned once its per-config jobs are done (`wait`): judged earlier, this process
would compile every variant itself, one after another, while the workers compile the same ones in parallel —
fla's activation kernels autotune 30 configs per width, a minute of compiling inline for one case. Jobs are
queued config index first (every case's config 0, then every case's config 1, ...), so a campaign can judge its
first cases under config 0 within seconds while the rest compile (`wait(case, timeout, 0)`).
"""

from __future__ import annotations

import hashlib
import inspect
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

import torch
import triton

from ssdiff import runtime
from ssdiff.sides import tiling


def config_indices(impls, autotune) -> range:
    """The config indices the campaign's policy launches: every one for "tuned" (benchmarked) and "sweep", the
    drawn ones for "random" (0..7), the one asked for otherwise."""
    if isinstance(autotune, int) and not isinstance(autotune, bool):
        return range(autotune, autotune + 1)
    most = max([len(t.configs) for i in impls for _, t in tiling.autotuned(i.kernel_modules())] or [1])
    return range(min(most, 8) if autotune == "random" else most)


def _compile_case(spec: str, case_json: str, choice, device: str) -> tuple:
    """In a worker: run one side on one case under one config index. Returns (seconds, error or "")."""
    runtime.configure()
    from ssdiff.model.case import Case
    from ssdiff.sides.runner import resolve
    from ssdiff.inputs import materialize

    start = time.perf_counter()
    try:
        case = Case.from_json(case_json)
        with runtime.autotune(choice):
            resolve(spec).run(case, materialize(case, device))
        return time.perf_counter() - start, ""
    except Exception as err:                      # a compile or launch failure: the campaign judges it itself
        return time.perf_counter() - start, f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    finally:
        # a worker keeps nothing between jobs: what its allocator cached for a production-size case would
        # otherwise stay taken from the campaign's process on the same device (fifteen workers can hold most of
        # an H200's memory between them)
        runtime.release_memory()


def default_workers() -> int:
    """SSDIFF_COMPILE_WORKERS where set (campaigns run side by side on one host); else the host's cores but one,
    shared among the processes of a pytest-xdist run (PYTEST_XDIST_WORKER_COUNT): eight test workers, each a
    campaign with a worker per core, would put 128 compilers on 16 cores."""
    if os.environ.get("SSDIFF_COMPILE_WORKERS"):
        return max(1, int(os.environ["SSDIFF_COMPILE_WORKERS"]))
    share = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    return max(1, min(16, ((os.cpu_count() or 2) - 1) // share))


RECORD_FILE = "ssdiff-compiled-ahead.txt"


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels (and, with TRITON_CACHE_AUTOTUNING, autotune results)."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def _kernel_files(module) -> list:
    """The files a kernel module compiles from: a module's own file; for a namespace of kernels (a test double's),
    the files its kernels are defined in."""
    path = getattr(module, "__file__", None)
    if path:
        return [path]
    files = set()
    for value in vars(module).values():
        while hasattr(value, "fn"):               # an Autotuner wraps a JITFunction, which wraps the function
            value = value.fn
        try:
            files.add(inspect.getsourcefile(value))
        except TypeError:
            pass
    return sorted(f for f in files if f) or [repr(module)]


def _modules_stamp(impl) -> str:
    """What a side's kernels are compiled from: its kernel modules' files (a new release changes them)."""
    parts = []
    for path in sorted({p for module in impl.kernel_modules() for p in _kernel_files(module)}):
        try:
            st = os.stat(path)
            parts.append(f"{path}:{st.st_size}:{int(st.st_mtime)}")
        except OSError:
            parts.append(path)
    return "|".join(parts)


class Compiler:
    """A pool of worker processes compiling representative cases ahead (see the module docstring).

    A job done is recorded in the Triton cache directory (RECORD_FILE: a hash of the side, the case, the config
    index, the device, torch's and Triton's versions and the side's kernel files), and a job recorded there is
    not queued again: a campaign on a warm cache loads every variant itself, and the workers' runs of the same
    cases would only take the device from it. A variant evicted from the cache since is compiled by the
    campaign's own process when it first needs it."""

    def __init__(self, sides: dict, device: str, autotune, workers: Optional[int] = None):
        self.sides, self.device = sides, device
        self.record = os.path.join(triton_cache_dir(), RECORD_FILE)
        try:
            with open(self.record, encoding="utf-8") as f:
                self.done = set(f.read().split())
        except OSError:
            self.done = set()
        self._record_lock = threading.Lock()
        self._keys: dict = {}           # job -> its record key
        self._stamps = {spec: _modules_stamp(impl) for spec, impl in sides.items()}
        name = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else str(device)
        self._where = f"{name} torch {torch.__version__} triton {triton.__version__} fp32 dot {runtime.fp32_dot()}"
        # per side: a side whose kernels are not autotuned (a reference's one norm kernel) compiles them in one job
        self.indices = {spec: config_indices([impl], autotune) for spec, impl in sides.items()}
        self.tuned = {spec for spec, impl in sides.items() if autotune == "tuned"
                      and tiling.autotuned(impl.kernel_modules())}
        self.workers = workers or default_workers()
        self._executor = None
        self.futures: list = []
        self._jobs: dict = {}           # case JSON -> config index -> its jobs (not the benchmarking one)

    def submit(self, cases) -> list:
        """Queue every (side with kernels, case, config index); returns the jobs (futures)."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(max_workers=self.workers,
                                                 mp_context=multiprocessing.get_context("spawn"))
        queued, sides = [], {spec: impl for spec, impl in self.sides.items() if impl.kernel_modules()}
        # config index first: every case's config 0 is on disk early (what a representative still compiling is
        # judged under meanwhile, harness/campaign/fuzz.py), then every case's config 1, ...
        for index in range(max([len(self.indices[spec]) for spec in sides] or [0])):
            for case in cases:
                for spec in sides:
                    if index < len(self.indices[spec]):
                        choice = self.indices[spec][index]
                        job = self._submit(spec, case, choice)
                        if job:
                            self._jobs.setdefault(case.to_json(), {}).setdefault(choice, []).append(job)
                            queued.append(job)
        # last: by the time a worker takes them most configs are on disk, and their benchmark results go there
        # too (TRITON_CACHE_AUTOTUNING), so the campaign loads them instead of tuning
        queued += filter(None, [self._submit(spec, case, "tuned") for case in cases for spec in sides
                                if spec in self.tuned])
        self.futures += queued
        return queued

    def _key(self, spec: str, case, choice) -> str:
        text = "\n".join([spec, case.to_json(), str(choice), self._where, self._stamps[spec]])
        return hashlib.sha1(text.encode()).hexdigest()

    def _submit(self, spec: str, case, choice):
        """Queue one job, or None where the record says it was done on this cache."""
        key = self._key(spec, case, choice)
        if key in self.done:
            return None
        job = self._executor.submit(_compile_case, spec, case.to_json(), choice, self.device)
        self._keys[job] = key
        job.add_done_callback(self._note_done)
        return job

    def _note_done(self, job) -> None:
        """Record a job that compiled without error (once; from its done callback, or from `close`)."""
        if not job.done() or job.cancelled() or job.exception() is not None or job.result()[1]:
            return
        key = self._keys[job]
        with self._record_lock:
            if key in self.done:
                return
            self.done.add(key)
            try:
                os.makedirs(os.path.dirname(self.record), exist_ok=True)
                with open(self.record, "a", encoding="utf-8") as f:
                    f.write(key + "\n")
            except OSError:
                pass                    # a cache directory we may not write: the jobs just run again next time

    def wait(self, case, timeout: float, index: Optional[int] = None) -> bool:
        """Wait up to ``timeout`` seconds for ``case``'s per-config jobs (those of config ``index`` alone when
        given); True when none is left running."""
        from concurrent.futures import wait

        per_index = self._jobs.get(case.to_json(), {})
        jobs = [job for i, some in per_index.items() if index is None or i == index for job in some]
        return not wait(jobs, timeout=max(0.0, timeout)).not_done if jobs else True

    def ready(self) -> bool:
        """Whether the workers are up: a job has finished (a worker spawned, imported torch, Triton and the sides,
        and compiled), or none was queued. Until then a job waited for takes those seconds of start-up too."""
        return not self.futures or any(job.done() for job in self.futures)

    def errors(self) -> list:
        """The one-line errors of the jobs done so far."""
        return [f.result()[1] for f in self.futures if f.done() and not f.cancelled() and f.result()[1]]

    def progress(self) -> tuple:
        """(jobs done, jobs queued)."""
        return sum(f.done() for f in self.futures), len(self.futures)

    def close(self) -> None:
        """Cancel what is queued and stop the workers (a compile in flight is abandoned). The jobs done are in
        the record by then (a done callback may run after its waiter has woken)."""
        for job in self._keys:
            self._note_done(job)
        if self._executor is not None:
            processes = list(getattr(self._executor, "_processes", {}).values())
            self._executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            self._executor = None
