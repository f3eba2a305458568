"""The feature table: each feature a case has can be switched off, the result is a valid Case without it and
with nothing new, and everything that names features (capabilities, stages) names the table's."""

from hypothesis import given
from hypothesis import strategies as st

from ssdiff.model.case import ENTRY_POINTS
from ssdiff.model.features import FEATURES, KEYS, present, switch_off, without
from ssdiff.sides.registry import all_implementations
from ssdiff.model.stages import STAGE_ORDER
from ssdiff.model.strategies import cases

ANY_CASE = st.one_of(cases(dtypes=("float32", "float16", "bfloat16")),
                     st.sampled_from(ENTRY_POINTS).flatmap(lambda e: cases(entry=e, dtypes=("float32", "bfloat16"))))


def cannot_go_alone(case, key) -> bool:
    """The one switch-off that may have no valid result: final states while varlen states are on."""
    return key == "final_states" and case.varlen_states


@given(ANY_CASE)
def test_every_feature_a_case_has_switches_off_to_a_valid_case_without_it_and_nothing_new(case):
    had = present(case)
    for key in had:
        off = switch_off(case, key)
        if off is None:
            assert cannot_go_alone(case, key), f"{key} could not be switched off in {case.describe()}"
            continue
        assert key not in present(off), f"{key} is still present after switching it off: {off.describe()}"
        assert present(off) <= had - {key}, f"switching {key} off added {sorted(present(off) - had)}"
    for key in set(KEYS) - had:
        assert switch_off(case, key) is None


@given(ANY_CASE, st.sets(st.sampled_from(KEYS)))
def test_without_leaves_on_only_what_cannot_be_switched_off(case, keys):
    narrowed = without(case, keys)
    assert present(narrowed) <= present(case)
    for key in keys & present(narrowed):
        assert switch_off(narrowed, key) is None, f"without() left {key} on in {narrowed.describe()}"


def test_capabilities_and_stages_name_the_tables_keys():
    for impl in all_implementations():
        unknown = impl.capabilities.unsupported - set(KEYS)
        assert not unknown, f"{impl.name}: unsupported names no feature: {sorted(unknown)}"
    for f in FEATURES:
        assert f.stage is None or f.stage in STAGE_ORDER, f"{f.key}: stage {f.stage!r} is not a pipeline stage"
    assert len(KEYS) == len(FEATURES)


def test_the_ablation_switches_off_what_only_observes_last():
    """Until the end, a feature that only observes shows a divergence the other switch-offs may hide elsewhere."""
    observes = [f.key for f in FEATURES if f.observes]
    assert observes == [f.key for f in FEATURES[-len(observes):]], [f.key for f in FEATURES]


@given(ANY_CASE)
def test_whole_chunks_keep_every_token_in_its_place_and_sequence(case):
    """Switching the ragged last chunk off adds tokens: to a row's padding where it has some, else to its last
    sequence; a state passed between chunks, and the padding tokens' inputs, stay as they were."""
    off = switch_off(case, "ragged")
    if off is None:
        return
    assert off.seqlen % off.chunk_size == 0 and case.seqlen < off.seqlen < case.seqlen + case.chunk_size
    if case.segments is not None:
        pads, new_pads = case.padding or (0,) * case.batch, off.padding or (0,) * off.batch
        for row, new_row, pad, new_pad in zip(case.segments, off.segments, pads, new_pads):
            grown = [i for i, (n, m) in enumerate(zip(row, new_row)) if n != m]
            assert (new_row == row and new_pad > pad) if pad else (new_pad == 0 and len(grown) == 1), off.describe()
