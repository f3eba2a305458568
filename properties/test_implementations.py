"""Every implementation against the float64 oracle: one property, driven by each implementation's capabilities and
testing record (harness/sides/base.py `Testing`), in the manner of PyTorch's OpInfo.

Parametrized over every registered implementation (harness/sides/registry.py; not the float64 oracles ``ref.*``,
which are the truth; plus ``--impl module:function`` / SSDIFF_IMPL targets), each pass and each dtype. It skips with
the implementation's own reason where it cannot run here (unavailable, device, dtype, a refused pass, a whole pass
a known defect explains), and otherwise draws cases of every entry point its capabilities list — forward,
backward, decode, layers, serving — from each domain of its record, in the numbers the record gives for this
runtime, under the record's autotune configs, after its pinned regression cases. Features it cannot express are
switched off when a case is drawn (never reshaped at run time); cases a known defect of the installed release
explains are left out (harness/registry/known.py: test_upstream.py's registry test pins each), but a record that
bounds its error keeps its cases judged, and a divergence it accounts for passes.

Judged by ssdiff.examine.Examiner (harness/verdict/judge.py: the budget is a multiple of a same-precision
baseline's error), with the stage intermediates of forward cases where the record says so. A float32 case out of
budget on a GPU under TF32 and within it replayed with exact float32 dots (harness/investigate/tf32.py) is TF32's
loss: the property goes on, and ends as an expected failure that names those cases. Natively under the gpu and
nightly profiles cases come from the run's compile keys (ssdiff.testing `cases_here`).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis.errors import Unsatisfiable

from ssdiff import runtime

runtime.configure()                     # before any kernel module is imported

from ssdiff.examine import Examiner  # noqa: E402
from ssdiff.investigate import tf32  # noqa: E402
from ssdiff.testing import (DTYPES, SETTINGS, agrees_with_oracle, drawn_for, implementations_under_test,  # noqa: E402
                            pinned_cases, usable, whole_pass_known)


def pytest_generate_tests(metafunc):
    if "implementation" in metafunc.fixturenames:
        metafunc.parametrize("implementation", implementations_under_test(metafunc.config))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_every_implementation_agrees_with_the_oracle(implementation, pass_, dtype, device):
    backward = pass_ == "backward"
    impl = usable(implementation, dtype, backward, device)
    whole = whole_pass_known(impl.name, backward, dtype)
    if whole:
        pytest.skip(f"every case of this pass is known defect {whole} (harness/registry/known.py; pinned by "
                    f"test_known_defect_reproduces)")
    stages = impl.testing.stages and not backward
    explained: dict = {}                    # known defect id (None: none) -> cases drawn within its capabilities
    n, drawn = drawn_for(impl, dtype, backward, device, explained)
    pinned = pinned_cases(impl, dtype, backward, device)
    if drawn is None and not pinned:
        pytest.skip(f"{impl.name}'s testing record draws no {pass_} cases here")
    examiner = Examiner([impl.name], device)
    tf32_cases = {}                         # case JSON -> what its replay with exact float32 dots said

    def judged(case, config):
        try:
            agrees_with_oracle(examiner, case, config, stages=stages)
        except AssertionError as diverged:
            said = tf32.replay(impl.name, case, config, device)
            if said is None:
                raise
            tf32_cases[case.to_json(indent=None)] = f"{str(diverged).splitlines()[0]} Replayed under " \
                                                    f"TRITON_F32_DEFAULT=ieee: {said}"

    if drawn is None:
        for case, config in pinned:
            judged(case, config)
    else:
        @settings(max_examples=n, **SETTINGS)
        @given(drawn=drawn)
        def agrees(drawn):
            judged(*drawn)

        for case, config in pinned:
            agrees = example(drawn=(case, config))(agrees)
        try:
            agrees()
        except Unsatisfiable:
            defects = sorted(d for d in explained if d is not None)
            if explained.get(None) or not defects:
                raise
            pytest.skip(f"every case of this pass drawn within its capabilities is known defect "
                        f"{', '.join(defects)} (harness/registry/known.py; pinned by test_known_defect_reproduces), "
                        f"whose record declares no whole_pass")
    if tf32_cases:
        case, said = next(iter(tf32_cases.items()))
        pytest.xfail(f"{len(tf32_cases)} float32 case(s) out of budget under TF32 and within it with exact float32 "
                     f"dots ({tf32.LIMIT}); the first: {said} case: {case}")
