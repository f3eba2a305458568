"""Metamorphic laws of the SSD map, checked on each of the three oracles."""

from hypothesis import assume, given
from hypothesis import strategies as st

from ssdiff.model.bounds import Bounds
from ssdiff.model.strategies import cases
from ssdiff import testing as laws

CHUNK_SIZES = (4, 8, 16, 32)


@given(cases(), st.sampled_from(CHUNK_SIZES))
def test_chunk_size_invariance(device, case, other):
    assume(other != case.chunk_size)
    laws.chunk_size_invariance(case, device, other)


@given(cases(backward=False).filter(lambda c: c.segments is not None))
def test_packed_sequences_equal_each_run_alone(device, case):
    laws.packed_equals_separate(case, device)


@given(cases(entry="chunk_scan", backward=False, varlen=False).filter(lambda c: c.segments is None and c.seqlen > 1),
       st.data())
def test_state_continuation(device, case, data):
    split = data.draw(st.integers(1, case.seqlen - 1), label="split")
    laws.state_continuation(case, device, split)


@given(cases(entry="chunk_scan", backward=False, bounds=Bounds(max_nheads=8)))
def test_groups_equal_heads_with_repeated_B_C(device, case):
    laws.group_broadcast(case, device)


@given(cases(backward=False))
def test_batch_rows_are_independent(device, case):
    laws.batch_independence(case, device)


@given(cases(backward=False))
def test_D_per_head_equals_D_broadcast_per_channel(device, case):
    laws.d_broadcast(case, device)


@given(cases(backward=False).filter(lambda c: c.padding is not None and any(c.padding)), st.integers(0, 2**16))
def test_padding_tokens_change_only_their_own_outputs(device, case, noise_seed):
    laws.padding_is_inert(case, device, noise_seed)
