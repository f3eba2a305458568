"""Running an implementation on one case: in this process, or in a child process that may die.

A kernel that aborts, segfaults or corrupts the CUDA context takes its process with it; one that loops
forever holds it. `IsolatedRunner` keeps a child process (multiprocessing "spawn": a fresh interpreter, safe
with CUDA) that materializes the case's inputs itself (they are deterministic in (case, device)), runs the
implementation and sends back its results on CPU. `InProcessRunner` runs on the inputs it is handed (the
examiner builds them once per case). When the child dies the run is a ``crash`` (with the
signal or exit code), when it does not answer within the timeout it is killed and the run is a ``hang``;
either way the next run starts a new child and fuzzing goes on. An exception inside the implementation is an
``error`` in both runners.

Implementations are named by spec: a registry name (``mamba_ssm.chunk_scan_combined``) or ``module:attr`` for
an Implementation object (or class) defined at module level (``ssdiff.sides.doubles:aborts``); anything else with a
colon is handed to the registry (the generic adapter for callables with mamba's signature).
"""

from __future__ import annotations

import importlib
import multiprocessing
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch

from ssdiff.inputs import huge
from ssdiff.model.case import Case

STARTUP_TIMEOUT = 300.0


@dataclass
class RunResult:
    """status: "ok" (``outputs`` holds the results), "error", "crash" or "hang" (``detail`` says what
    happened), or "oom": the device had no memory for the run, twice (not a verdict: `runtime.retry_on_oom`).
    launches: the autotuned launches the run made (runtime.Launch records)."""

    status: str
    outputs: Optional[object] = None
    detail: str = ""
    seconds: float = 0.0
    launches: list = field(default_factory=list)


def resolve(spec: str):
    """The Implementation named ``spec`` (see the module docstring)."""
    from ssdiff.sides.registry import Implementation, get

    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        obj = getattr(module, attr, None) if module is not None else None
        if isinstance(obj, Implementation):
            return obj
        if isinstance(obj, type) and issubclass(obj, Implementation):
            return obj()
    return get(spec)


def short_error(err: BaseException) -> str:
    """``Type: message`` plus the innermost frame, on a few lines."""
    tb = traceback.extract_tb(err.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    text = f"{type(err).__name__}: {err}".strip()
    if len(text) > 600:
        text = text[:600] + " ..."
    return text + where


def _run_here(impl, case: Case, inputs, want_stages: bool, choice) -> RunResult:
    from ssdiff import runtime

    start = time.perf_counter()
    try:
        with runtime.autotune(choice):
            out = runtime.retry_on_oom(lambda: impl.run(case, inputs, want_stages), impl.name)
            launches = runtime.launches()
    except runtime.DeviceOutOfMemory as err:        # the machine's limit, not the implementation's verdict
        return RunResult("oom", detail=str(err), seconds=time.perf_counter() - start)
    except Exception as err:            # the implementation raised: a verdict, not our crash
        return RunResult("error", detail=short_error(err), seconds=time.perf_counter() - start)
    if inputs.device.type == "cuda":
        torch.cuda.synchronize()
    if huge.is_huge(case):                  # judged on its slice: the whole outputs need not outlive the run
        _, row, heads = huge.judged_slice(case)
        out = huge.slice_outputs(out, case, row, heads)
    return RunResult("ok", outputs=out, seconds=time.perf_counter() - start, launches=launches)


class InProcessRunner:
    """Runs implementations in this process on the inputs it is given: fast; an abort or a hang takes the
    whole run with it."""

    isolated = False

    def __init__(self, device: str):
        self.device = device
        self._impls: dict = {}

    def run(self, spec: str, case: Case, inputs, want_stages: bool = False, choice="tuned") -> RunResult:
        impl = self._impls.get(spec) or self._impls.setdefault(spec, resolve(spec))
        return _run_here(impl, case, inputs, want_stages, choice)

    def close(self):
        pass


def _child(conn, device: str):
    """The child's loop: receive (spec, case json, want_stages, choice), answer with a RunResult."""
    from ssdiff import runtime

    runtime.configure()
    import ssdiff.sides.registry  # noqa: F401 - the registry and torch, before the parent starts the clock
    from ssdiff.inputs import materialize

    conn.send("ready")
    impls: dict = {}
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        spec, case_json, want_stages, choice = request
        try:
            impl = impls.get(spec) or impls.setdefault(spec, resolve(spec))
            case = Case.from_json(case_json)
            result = _run_here(impl, case, materialize(case, device), want_stages, choice)
        except Exception as err:
            result = RunResult("error", detail=short_error(err))
        if result.outputs is not None:
            result.outputs = result.outputs.to("cpu")
        conn.send(result)


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "the process did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (abort)" if -code == signal.SIGABRT else
                                      " (segmentation fault)" if -code == signal.SIGSEGV else "")
    return f"exited with status {code}"


class IsolatedRunner:
    """Runs implementations in a child process; a crash or a hang becomes a RunResult and a new child is
    started for the next run. ``timeout``: seconds one run may take (inputs included)."""

    isolated = True

    def __init__(self, device: str, timeout: float = 300.0):
        self.device = device
        self.timeout = timeout
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self.restarts = 0

    def _start(self):
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_child, args=(child, self.device), daemon=True,
                                       name="ssdiff-isolated")
        self._proc.start()
        child.close()
        self._conn = parent
        # Start-up (a fresh interpreter importing torch and triton) does not count against a run's timeout.
        try:
            ready = parent.poll(STARTUP_TIMEOUT) and parent.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = self._proc.exitcode
            self._stop(kill=True)
            raise RuntimeError(f"the isolated worker did not start within {STARTUP_TIMEOUT:g} s "
                               f"({describe_exit(code)})")

    def _stop(self, kill: bool):
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            try:
                if not kill:
                    conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            conn.close()
        if proc is not None:
            if kill and proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def run(self, spec: str, case: Case, inputs=None, want_stages: bool = False, choice="tuned") -> RunResult:
        """Run ``spec`` on ``case`` in the child, which materializes the inputs itself (``inputs`` is not sent:
        they are deterministic in (case, device))."""
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self._stop(kill=True)
                self.restarts += 1
            self._start()
        start = time.perf_counter()
        try:
            self._conn.send((spec, case.to_json(indent=None), want_stages, choice))
            ready = self._conn.poll(self.timeout)
            if not ready:
                self._stop(kill=True)
                return RunResult("hang", detail=f"no result within the {self.timeout:g} s timeout (killed)",
                                 seconds=time.perf_counter() - start)
            result = self._conn.recv()
            if result.status == "error" and "CUDA" in result.detail:
                # An asynchronous CUDA error poisons the context: the next run gets a fresh process.
                self._stop(kill=True)
        except (EOFError, OSError, BrokenPipeError):
            proc = self._proc
            if proc is not None:
                proc.join(timeout=5)
            code = proc.exitcode if proc is not None else None
            self._stop(kill=True)
            return RunResult("crash", detail=f"the implementation's process died: {describe_exit(code)}",
                             seconds=time.perf_counter() - start)
        return result

    def close(self):
        self._stop(kill=False)
