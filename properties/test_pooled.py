"""ssdiff.testing's compile keys: under a profile that searches afresh, a property's cases natively come from the
run's few compile keys, which its implementation can run; the keys are fixed for the run's seed and change with
it. Checked here on the drawn Case objects (nothing is run), so on every platform."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdiff.sides.registry import get
from ssdiff.campaign.pool import flags_of
from ssdiff import testing
from ssdiff.testing import bounds_here, cases_for, narrowed

BOUNDS = bounds_here()


def key_of(case, keys):
    """The key among ``keys`` whose compile-relevant fields ``case`` has, else None."""
    for key in keys:
        fixed = all(getattr(case, name) == value for name, value in key.fixed().items())
        pinned = dict(flags_of(case))
        flags = all(pinned[name] == value for name, value in key.flags
                    if name not in ("varlen_states", "final_state_grad"))
        if fixed and flags and key.fits(case.seqlen) and case.regime.layout == key.layout:
            return key
    return None


def test_the_keys_are_the_runs_and_change_with_its_seed():
    first = testing.keys("t", ("chunk_scan", "split_conv1d"), "float32", None, BOUNDS, seed=1)
    assert first == testing.keys("t", ("chunk_scan", "split_conv1d"), "float32", None, BOUNDS, seed=1)
    assert len(first) == testing.KEYS and {k.entry for k in first} <= {"chunk_scan", "split_conv1d"}
    assert {k.dtype for k in first} == {"float32"} and {k.kind for k in first} == {"small"}
    others = [testing.keys("t", ("chunk_scan", "split_conv1d"), "float32", None, BOUNDS, seed=s) for s in (2, 3, 4)]
    assert any(o != first for o in others)


@settings(max_examples=40)
@given(data=st.data())
def test_every_drawn_case_is_one_of_the_keys(data):
    case = data.draw(testing.cases_from_keys("layers", ("layer",), ("float32", "float16"), None, BOUNDS, seed=5))
    keys = testing.keys("layers", ("layer",), case.dtype, None, BOUNDS, seed=5)
    assert key_of(case, keys) is not None, f"{case.describe()} is none of {[k.describe() for k in keys]}"


@pytest.mark.parametrize("forced", ["1", "0"])
def test_cases_here_come_from_the_keys_exactly_where_properties_are_pooled(forced, monkeypatch):
    monkeypatch.setenv("SSDIFF_POOLED", forced)
    keys = testing.keys("here", ("chunk_scan",), "float32", False, BOUNDS)
    of_a_key = []

    @settings(max_examples=30, database=None)
    @given(case=testing.cases_here("here", ("chunk_scan",), ("float32",), False, BOUNDS))
    def drawn(case):
        assert case.entry == "chunk_scan" and case.dtype == "float32" and not case.backward
        of_a_key.append(key_of(case, keys) is not None)

    drawn()
    assert all(of_a_key) if forced == "1" else not all(of_a_key)


def test_a_pooled_property_draws_what_its_implementation_can_run_from_its_keys(device, monkeypatch):
    monkeypatch.setenv("SSDIFF_POOLED", "1")
    impl = get("mamba_ssm.split_conv1d_ref")
    if impl.unavailable():
        pytest.skip(f"{impl.name} unavailable: {impl.unavailable()}")
    keys = testing.keys(impl.name, sorted(impl.capabilities.entries), "float32", True, BOUNDS,
                       fit=lambda c: narrowed(impl, c, device))
    seen = set()

    @settings(max_examples=30)
    @given(case=cases_for(impl, "float32", True, device))
    def drawn(case):
        assert narrowed(impl, case, device) == case and case.backward
        key = key_of(case, keys)
        assert key is not None, f"{case.describe()} is none of {[k.describe() for k in keys]}"
        seen.add(key)

    drawn()
    assert len(seen) > 1
