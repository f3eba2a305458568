"""What the compile-ahead workers are given (harness/campaign/precompile.py): one job per autotune config index of each
side's own autotuned kernels, a benchmarking job only for a side that has some, and none for a job the cache's
record says was done. Campaigns compile ahead natively only; the Compiler itself runs anywhere (under the
interpreter a job runs its case and compiles nothing)."""

from __future__ import annotations

from ssdiff.sides import tiling
from ssdiff.sides.registry import get
from ssdiff.campaign.precompile import Compiler
from ssdiff.testing import usable

COMBINED, REF = "mamba_ssm.split_conv1d_combined", "mamba_ssm.split_conv1d_ref"


def test_each_side_gets_the_config_indices_of_its_own_autotuned_kernels(device):
    combined, ref = (usable(name, "float32", False, device) for name in (COMBINED, REF))
    most = max(len(t.configs) for _, t in tiling.autotuned(combined.kernel_modules()))
    compiler = Compiler({COMBINED: combined, REF: ref}, device, "tuned", workers=1)
    # the reference launches one Triton kernel family, the gated RMSNorm's, which is not autotuned: one job
    assert [m.__name__.rsplit(".", 1)[-1] for m in ref.kernel_modules()] == ["layernorm_gated"]
    assert list(compiler.indices[REF]) == [0] and list(compiler.indices[COMBINED]) == list(range(most)) and most > 1
    assert compiler.tuned == {COMBINED}
    assert list(Compiler({COMBINED: combined}, device, 2, workers=1).indices[COMBINED]) == [2]


def test_a_job_done_on_this_cache_is_not_queued_again(tmp_path, monkeypatch, device):
    from ssdiff.model.case import Case

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    side = "ssdiff.triton"
    case = Case(batch=1, seqlen=4, nheads=1, headdim=2, dstate=2, chunk_size=4, seed=1)
    compiler = Compiler({side: get(side)}, device, 0, workers=1)
    try:
        jobs = compiler.submit([case])
        assert len(jobs) == 1 and compiler.wait(case, 500) and jobs[0].result()[1] == "", jobs[0].result()
    finally:
        compiler.close()
    again = Compiler({side: get(side)}, device, 0, workers=1)
    try:
        assert again.submit([case]) == [] and again.wait(case, 0)      # recorded: nothing to run, nothing to wait for
        assert len(again.submit([case.replace(seqlen=5)])) == 1         # another case is another job
    finally:
        again.close()
    assert len((tmp_path / "triton" / "ssdiff-compiled-ahead.txt").read_text().split()) == 1


def test_every_cases_config_0_is_queued_before_any_other_config_and_the_benchmarks_last(device):
    """submit queues by config index first (what a representative still compiling is judged under meanwhile is on
    disk early), the tuned benchmarking jobs after every per-config one; wait(..., index) waits for one index, and
    ready() says whether the workers are up."""
    from concurrent.futures import Future

    from ssdiff.model.case import Case

    combined, ref = (usable(name, "float32", False, device) for name in (COMBINED, REF))
    compiler = Compiler({COMBINED: combined, REF: ref}, device, "tuned", workers=1)
    order = []

    class Queue:
        def submit(self, fn, spec, case_json, choice, where):
            order.append((spec, Case.from_json(case_json).seed, choice))
            return Future()

    compiler._executor, compiler.done = Queue(), set()
    cases = [Case(entry="split_conv1d", seqlen=8, nheads=2, ngroups=2, seed=s) for s in (1, 2)]
    compiler.submit(cases)
    most = len(compiler.indices[COMBINED])
    assert order[:3] == [(COMBINED, 1, 0), (REF, 1, 0), (COMBINED, 2, 0)] and order[3] == (REF, 2, 0)
    assert [c for _, _, c in order[4:-2]] == [i for i in range(1, most) for _ in cases]
    assert order[-2:] == [(COMBINED, 1, "tuned"), (COMBINED, 2, "tuned")]
    assert not compiler.wait(cases[0], 0, index=0) and compiler.wait(cases[0], 0, index=most + 5)
    # ready: the workers are up once a job has finished (taken up is not enough: the executor marks a job running
    # as it queues it for a worker still starting)
    first = compiler._jobs[cases[0].to_json()][0][0]
    first.set_running_or_notify_cancel()
    assert not compiler.ready()
    first.set_result((1.0, ""))
    assert compiler.ready() and Compiler({COMBINED: combined}, device, "tuned", workers=1).ready()


def test_a_side_whose_kernels_are_a_namespace_is_stamped_with_their_files(device):
    """A test double's kernel_modules() is a namespace of kernels, not a module: its stamp names the file they are
    defined in (harness/sides/doubles.py), so a campaign with such a side compiles ahead like any other."""
    from ssdiff.sides import doubles

    compiler = Compiler({"ssdiff.sides.doubles:tiling_bug": doubles.tiling_bug}, device, "tuned", workers=1)
    assert "sides/doubles.py:" in compiler._stamps["ssdiff.sides.doubles:tiling_bug"]
