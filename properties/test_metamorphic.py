"""Metamorphic properties (harness/investigate/metamorphic.py): what one call cannot show, compared with no oracle in the
comparison. A prefill split in two with the first part's final state carried equals one prefill; a prefill of
T - k tokens then k decode steps equals a prefill of T; a batch row's output does not depend on the other rows
(bit for bit under one config); the sequences of a packed row equal each sequence run alone. Each has teeth: a
double with the matching planted violation fails it."""

import re
import traceback
from importlib import metadata

import pytest
from hypothesis import assume, currently_in_test_context, given, note, settings
from hypothesis import strategies as st

from ssdiff.sides import doubles
from ssdiff.registry import known
from ssdiff.investigate import metamorphic
from ssdiff import runtime
from ssdiff.model.case import Case, Regime
from ssdiff.examine import Examiner
from ssdiff.sides.registry import get
from ssdiff.inputs import materialize
from ssdiff.model.bounds import Bounds
from ssdiff.model.strategies import lengths_summing_to
from ssdiff.testing import cases_here, runnable_by

SCANS = ["mamba_ssm.chunk_scan_combined", "ssdiff.triton", "vllm.chunk_scan_combined_varlen"]
STEPS = [("mamba_ssm.chunk_scan_combined", "mamba_ssm.selective_state_update"),
         ("vllm.chunk_scan_combined_varlen", "vllm.selective_state_update")]
SMALL = Bounds(max_batch=3, max_seqlen=24, max_nheads=4, max_headdim=4, max_dstate=4, chunk_sizes=(4, 8))
# Every example runs the implementation several times: a tenth of the profile's examples (at least three).
FEW = settings(max_examples=max(3, settings().max_examples // 10))


def usable(name: str, device: str):
    impl = get(name)
    why = impl.unavailable()
    if why:
        pytest.skip(f"{name}: {why}")
    return impl


def dtypes_of(impl) -> tuple:
    return tuple(d for d in runtime.runnable_dtypes() if d in impl.capabilities.dtypes)


def defects_own(defect, err: BaseException) -> bool:
    """Whether ``err`` is ``defect``'s own failure: an exception of a type its record's statement names, raised in
    the code of the record's package — the innermost frame of that package's or of ssdiff's own in the traceback is
    the package's (an exception raised inside ssdiff, a stand-in's included, is a bug of ssdiff's, not the defect)."""
    if not re.search(rf"\b{re.escape(type(err).__name__)}\b", defect.statement):
        return False
    name = lambda dist: re.sub(r"[-_.]+", "-", dist).lower()                # noqa: E731 - PEP 503's normal form
    tops = {top for top, dists in metadata.packages_distributions().items()
            if name(defect.package) in map(name, dists)}
    modules = [frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(err.__traceback__)]
    own = [m.split(".")[0] for m in modules if m.split(".")[0] in tops | {"ssdiff"}]
    return bool(own) and own[-1] in tops


def holds(relation_fn, *args, known_defect=None, **kw):
    """The relation holds, or the case is outside what it (or an implementation) takes: Hypothesis moves on.
    Where a known defect's predicate covers a part of the relation (``known_defect``, a harness/registry/known.py
    record), the relation must break — by the relation, or by the defect's own exception (`defects_own`) — the
    defect reproduced, reported as known, and the search goes on. Any other exception is raised."""
    try:
        relation = relation_fn(*args, **kw)
    except metamorphic.NotApplicable:
        assume(False)
    except Exception as err:
        if known_defect is None or not defects_own(known_defect, err):
            raise
        if currently_in_test_context():
            note(f"known defect {known_defect.id} reproduced: {type(err).__name__}: {err}")
        return None
    if known_defect is not None:
        assert not relation.ok, (f"{known_defect.id}'s predicate covers this case, yet the relation holds: "
                                 f"{relation.message()}")
        note(f"known defect {known_defect.id} reproduced: {relation.message()}")
        return relation
    assert relation.ok, relation.message()
    return relation


def drawn(data, impl, entry: str, bounds: Bounds, where, dtypes=None) -> Case:
    """A forward ``entry`` case that ``impl`` runs, in the dtypes it runs here (or ``dtypes``); natively under the
    gpu and nightly profiles, from the run's compile keys (ssdiff.testing `cases_here`), each fitted to ``where(case)``
    so that no key holds only cases a property assumes away."""
    runs = runnable_by(impl)
    fit = lambda case: case if runs(case) is not None and where(case) else None      # noqa: E731
    return data.draw(cases_here(impl.name, (entry,), dtypes or dtypes_of(impl), False, bounds, fit=fit))


def scan_case(data, impl, dtypes=None) -> Case:
    """A forward chunk_scan case in the dtypes ``impl`` runs here (or ``dtypes``). The keys of every scan property
    here are the same, with what each relation needs: two tokens and two rows at least."""
    return drawn(data, impl, "chunk_scan", SMALL, lambda case: case.seqlen >= 2 and case.batch >= 2, dtypes)


def unsegmented(case: Case) -> Case:
    return case.replace(segments=None, padding=None, gaps=None, seq_idx_start=0, varlen_states=False,
                        return_final_states=True)


# ---- the properties ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCANS)
@FEW
@given(data=st.data())
def test_a_prefill_split_in_two_with_the_state_carried_equals_one(name, device, data):
    impl = usable(name, device)
    case = unsegmented(scan_case(data, impl))
    assume(case.seqlen >= 2)
    cut = data.draw(st.integers(1, case.seqlen - 1), label="cut")
    with Examiner([name], device) as examiner:
        holds(metamorphic.split_prefill, examiner, impl, case, cut)


@pytest.mark.parametrize("scan, step", STEPS)
@FEW
@given(data=st.data())
def test_a_prefill_then_decode_steps_equals_one_prefill(scan, step, device, data):
    impl, stepper = usable(scan, device), usable(step, device)
    dtypes = tuple(d for d in dtypes_of(impl) if d in stepper.capabilities.dtypes)
    case = unsegmented(scan_case(data, impl, dtypes))
    steps = data.draw(st.integers(1, min(case.seqlen, 4)), label="steps")
    defect = known.matching(step, metamorphic.decode_case(case, steps))
    with Examiner([scan], device) as examiner:
        holds(metamorphic.prefill_then_steps, examiner, impl, stepper, case, steps, known_defect=defect)


@pytest.mark.parametrize("name", SCANS)
@FEW
@given(data=st.data())
def test_a_batch_row_does_not_depend_on_the_other_rows(name, device, data):
    case = scan_case(data, usable(name, device))
    assume(case.batch >= 2 and not case.varlen_states)
    holds(metamorphic.rows_alone, get(name), case, device)


@pytest.mark.parametrize("name", SCANS)
@FEW
@given(data=st.data())
def test_the_sequences_of_a_packed_row_equal_each_run_alone(name, device, data):
    case = scan_case(data, usable(name, device))
    lengths = data.draw(lengths_summing_to(case.seqlen), label="lengths")
    assume(len(lengths) >= 2)
    with Examiner([name], device) as examiner:
        holds(metamorphic.packed_alone, examiner, get(name),
              case.replace(batch=1, segments=(lengths,), padding=None, gaps=None, varlen_states=False))


# Layers that decode (layer_steps), each as its adapter drives its cache.
DECODING_LAYERS = ["mamba_ssm.mamba2_no_mem_eff", "fla.mamba2_triton", "fla.mamba2_torch", "transformers.mamba2_mixer"]
LAYER_SMALL = Bounds(max_batch=2, max_seqlen=12, max_nheads=4, max_headdim=4, max_dstate=4, chunk_sizes=(4, 8))


def undecoded(case: Case) -> Case:
    return case.replace(segments=None, padding=None, gaps=None, seq_idx_start=0, layer_steps=0)


def decodable(name: str, case: Case) -> bool:
    """Whether ``case`` has a token to decode, in no known defect's domain decoded or not: a case in one says
    nothing here (one of the whole-sequence run is in both runs, in different measure; the decoding ones, dt_limit
    ignored, break the relation only where the clamp moves a decoded output past the budget). The registry test
    pins each with its example."""
    return (case.seqlen >= 2 and known.matching(name, case) is None
            and known.matching(name, case.replace(layer_steps=1)) is None)


@pytest.mark.parametrize("name", DECODING_LAYERS)
@FEW
@given(data=st.data())
def test_a_layer_decoding_its_last_tokens_equals_one_prefill(name, device, data):
    impl = usable(name, device)
    case = undecoded(drawn(data, impl, "layer", LAYER_SMALL, lambda case: decodable(name, undecoded(case))))
    assume(case.seqlen >= 2)
    steps = data.draw(st.integers(1, min(3, case.seqlen - 1)), label="steps")
    decoded = case.replace(layer_steps=steps)
    assume(known.matching(name, case) is None and known.matching(name, decoded) is None)       # see `decodable`
    with Examiner([name], device) as examiner:
        holds(metamorphic.layer_decoded, examiner, impl, case, steps)


# ---- teeth: a planted violation fails each -----------------------------------------------------------------

TOOTH = Case(batch=2, seqlen=12, nheads=2, headdim=3, dstate=4, chunk_size=4, initial_states=True,
             regime=Regime(decay="mild"), seed=5)


def test_split_prefill_fails_where_initial_states_are_ignored(device):
    with Examiner(["ssdiff.sides.doubles:healthy"], device) as examiner:
        assert metamorphic.split_prefill(examiner, doubles.healthy, TOOTH, 5).ok
        broken = metamorphic.split_prefill(examiner, doubles.initial_states_bug, TOOTH, 5)
    assert not broken.ok and broken.ratios["y"] > 1, broken.message()


def test_prefill_then_steps_fails_where_the_step_does_not_decay(device):
    with Examiner(["ssdiff.sides.doubles:healthy"], device) as examiner:
        assert metamorphic.prefill_then_steps(examiner, doubles.healthy, doubles.step, TOOTH, 3).ok
        broken = metamorphic.prefill_then_steps(examiner, doubles.healthy, doubles.step_no_decay_bug, TOOTH, 3)
    assert not broken.ok and broken.ratios["final_states"] > 1, broken.message()


def test_rows_alone_fails_where_rows_leak_into_each_other(device):
    assert metamorphic.rows_alone(doubles.healthy, TOOTH, device).ok
    broken = metamorphic.rows_alone(doubles.row_leak_bug, TOOTH, device)
    assert not broken.ok and broken.ratios["y"] > 0 and broken.ratios["final_states"] == 0, broken.message()


def test_packed_alone_fails_where_the_state_is_not_reset_between_sequences(device):
    packed = TOOTH.replace(batch=1, segments=((5, 7),), initial_states=False)
    with Examiner(["ssdiff.sides.doubles:healthy"], device) as examiner:
        assert metamorphic.packed_alone(examiner, doubles.healthy, packed).ok
        broken = metamorphic.packed_alone(examiner, doubles.reset_bug, packed)
    assert not broken.ok and broken.ratios["y"] > 1, broken.message()


def test_layer_decoded_fails_where_the_decoded_tokens_drop_the_skip(device):
    case = Case(entry="layer", batch=2, seqlen=7, nheads=2, headdim=3, dstate=4, chunk_size=4, d_model=6,
                return_final_states=False, rmsnorm_eps=1e-5, seed=5)
    with Examiner(["ssdiff.sides.doubles:layer"], device) as examiner:
        assert metamorphic.layer_decoded(examiner, doubles.layer, case, 3).ok
        broken = metamorphic.layer_decoded(examiner, doubles.layer_decode_bug, case, 3)
    assert not broken.ok and broken.ratios["y"] > 1, broken.message()


def test_only_the_defects_own_failure_counts_as_the_defect_reproduced(device):
    """`holds` counts an exception as a known defect reproduced only where it is the defect's own: raised in its
    package's code, of a type its record names. One raised inside ssdiff (here metamorphic.split_prefill given no
    examiner: an AttributeError, a type the record names) is raised, as a bug of ssdiff's own."""
    defect = known.BY_ID["mamba-state-update-dt-bias-none"]
    assert re.search(r"\bAttributeError\b", defect.statement)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'device'"):
        holds(metamorphic.split_prefill, None, doubles.healthy, TOOTH, 5, known_defect=defect)
    step = get("mamba_ssm.selective_state_update")
    if step.unavailable() or not defect.affects(known.installed_version(defect.package)):
        return
    case = defect.example                   # selective_state_update without dt_bias raises in mamba_ssm's code
    assert holds(step.run, case, materialize(case, device), known_defect=defect) is None


def test_a_case_outside_a_relation_is_refused_with_the_reason(device):
    with Examiner(["ssdiff.sides.doubles:healthy"], device) as examiner:
        with pytest.raises(metamorphic.NotApplicable, match="without seq_idx"):
            metamorphic.split_prefill(examiner, doubles.healthy, TOOTH.replace(segments=((6, 6), (12,))), 3)
    with pytest.raises(metamorphic.NotApplicable, match="two rows"):
        metamorphic.rows_alone(doubles.healthy, TOOTH.replace(batch=1), device)
