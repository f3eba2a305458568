"""Compiling a campaign's kernels ahead, in parallel on the host's cores (natively only).

Triton compiles in the process that launches, one kernel variant after another (about 0.6 s each on an H200
host: LLVM, ptxas, the launcher stub); a tuned first case of mamba_chunk_scan_combined forward+backward needs
over a hundred variants — every config of every kernel. `Compiler` runs each compile key's representative case
(harness/pool.py, `CompileKey.case`) in worker processes, one job per autotune config index the campaign's
policy will launch ("tuned" benchmarks them all), so the variants land in Triton's on-disk cache
(TRITON_CACHE_DIR, ~/.triton/cache) and the campaign's own process loads them instead of compiling; under
"tuned" one more job per case benchmarks the configs, so that the autotune results are on disk too. A job
that fails is reported and otherwise ignored: the campaign's own run of that case is what is judged.
Workers are spawned processes: a script that runs a campaign at import time needs the usual
``if __name__ == "__main__":`` guard (the CLI and pytest have it).

    compiler = Compiler(sides, device, autotune)
    compiler.submit(cases)          # returns at once; the workers compile in the background
    compiler.wait(case, timeout)    # before judging a case compiled ahead: its configs' jobs done
    compiler.progress()             # (done, queued), for the progress line

A case compiled ahead is judged once its per-config jobs are done (`wait`): judged earlier, this process would
compile every variant itself, one after another, while the workers compile the same ones in parallel — fla's
activation kernels autotune 30 configs per width, a minute of compiling inline for one case.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

from harness import tiling


def config_indices(impls, autotune) -> range:
    """The config indices the campaign's policy launches: every one for "tuned" (benchmarked) and "sweep", the
    drawn ones for "random" (0..7), the one asked for otherwise."""
    if isinstance(autotune, int) and not isinstance(autotune, bool):
        return range(autotune, autotune + 1)
    most = max([len(t.configs) for i in impls for _, t in tiling.autotuned(i.kernel_modules())] or [1])
    return range(min(most, 8) if autotune == "random" else most)


def _compile_case(spec: str, case_json: str, choice, device: str) -> tuple:
    """In a worker: run one side on one case under one config index. Returns (seconds, error or "")."""
    from harness import runtime

    runtime.configure()
    from harness.case import Case
    from harness.isolate import resolve
    from harness.inputs import materialize

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


class Compiler:
    """A pool of worker processes compiling representative cases ahead (see the module docstring)."""

    def __init__(self, sides: dict, device: str, autotune, workers: Optional[int] = None):
        self.sides, self.device = sides, device
        self.indices = config_indices(sides.values(), autotune)
        self.tune = autotune == "tuned"
        self.workers = workers or default_workers()
        self._executor = None
        self.futures: list = []
        self._jobs: dict = {}           # case JSON -> its per-config jobs (not the benchmarking one)

    def submit(self, cases) -> list:
        """Queue every (side with kernels, case, config index); returns the jobs (futures)."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(max_workers=self.workers,
                                                 mp_context=multiprocessing.get_context("spawn"))
        queued = []
        for case in cases:
            for spec, impl in self.sides.items():
                if not impl.kernel_modules():
                    continue
                jobs = [self._executor.submit(_compile_case, spec, case.to_json(), index, self.device)
                        for index in self.indices]
                self._jobs.setdefault(case.to_json(), []).extend(jobs)
                queued += jobs
                if self.tune:
                    # last: by the time a worker takes it most configs are on disk, and its benchmark results
                    # go there too (TRITON_CACHE_AUTOTUNING), so the campaign loads them instead of tuning
                    queued.append(self._executor.submit(_compile_case, spec, case.to_json(), "tuned", self.device))
        self.futures += queued
        return queued

    def wait(self, case, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``case``'s per-config jobs; True when none is left running."""
        from concurrent.futures import wait

        jobs = self._jobs.get(case.to_json(), [])
        return not wait(jobs, timeout=max(0.0, timeout)).not_done if jobs else True

    def errors(self) -> list:
        """The one-line errors of the jobs done so far."""
        return [f.result()[1] for f in self.futures if f.done() and not f.cancelled() and f.result()[1]]

    def progress(self) -> tuple:
        """(jobs done, jobs queued)."""
        return sum(f.done() for f in self.futures), len(self.futures)

    def close(self) -> None:
        """Cancel what is queued and stop the workers (a compile in flight is abandoned)."""
        if self._executor is not None:
            processes = list(getattr(self._executor, "_processes", {}).values())
            self._executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            self._executor = None
