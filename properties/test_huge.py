"""Huge cases (harness/inputs/huge.py): past 2**31 elements a case is judged on a slice of the last batch row and the
first and last heads. The threshold is lowered here so that small cases take that path on any device."""

import pytest
import torch

from ssdiff.inputs import huge
from ssdiff.model.case import Case, Regime
from ssdiff.examine import Examiner
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer, UsageError
from ssdiff.inputs import materialize
from ssdiff.truth import evaluate
from ssdiff.campaign.pool import Mix, Pool
from ssdiff.model.bounds import Bounds
from ssdiff.runtime import DeviceOutOfMemory

# every feature of the chunk_scan entry that a slice has to carry: groups, D per channel, z, dt_bias, initial
# states, final states, sequences with padding
WHOLE = Case(entry="chunk_scan", batch=2, seqlen=16, nheads=4, ngroups=2, headdim=4, dstate=4, chunk_size=8,
             D="channel", has_z=True, has_dt_bias=True, dt_softplus=True, initial_states=True,
             return_final_states=True, segments=((9, 7), (5, 9)), padding=(0, 2), regime=Regime(decay="mild"),
             seed=11)


@pytest.fixture
def small_threshold(monkeypatch):
    """x of WHOLE (512 elements) and its chunk states (512) cross a threshold of 256."""
    monkeypatch.setattr(huge, "HUGE_ELEMENTS", 256)
    assert huge.is_huge(WHOLE)


def test_the_slice_is_the_last_row_and_the_first_and_last_heads(small_threshold):
    part, row, heads = huge.judged_slice(WHOLE)
    assert (row, heads) == (1, (0, 3))
    assert (part.batch, part.nheads, part.ngroups, part.segments, part.padding) == (1, 2, 2, ((5, 9),), (2,))
    assert not huge.is_huge(part)
    assert huge.judged_slice(WHOLE.replace(nheads=1, ngroups=1, D="head"))[2] == (0,)
    assert huge.judged_slice(WHOLE.replace(ngroups=1))[0].ngroups == 1


def test_a_huge_case_is_judged_on_a_slice_equal_to_the_whole_cases_truth(small_threshold, device):
    """The slice's inputs are the whole case's at the last row, the two heads and their groups, and the truth the
    slice is judged against is the whole case's truth there (heads are independent in the chunk scan)."""
    with Examiner(["ref.quadratic"], device) as examiner:
        outcome = examiner.examine(WHOLE)
    assert outcome.verdicts["ref.quadratic"].ok, outcome.verdicts["ref.quadratic"].message()
    assert any("judged on batch row 1 of 2, heads 0, 3 of 4" in n for n in outcome.verdicts["ref.quadratic"].notes)
    whole = materialize(WHOLE, device)
    sliced = outcome.inputs.values
    heads, groups = torch.tensor([0, 3], device=device), torch.tensor([0, 1], device=device)
    assert torch.equal(sliced["x"], whole.values["x"][1:, :, heads])
    assert torch.equal(sliced["B"], whole.values["B"][1:, :, groups])
    assert torch.equal(sliced["D"], whole.values["D"][heads])
    assert torch.equal(sliced["initial_states"], whole.values["initial_states"][1:, heads])
    assert torch.equal(outcome.inputs.seq_idx, whole.seq_idx[1:])
    truth = evaluate(WHOLE, whole)
    keep = whole.seq_idx[1:] >= 0
    for name, at in (("y", lambda t: t[1:, :, heads][keep]), ("final_states", lambda t: t[1:, heads])):
        got = outcome.truth.outputs[name]
        got = got[keep] if name == "y" else got
        assert torch.allclose(got, at(truth.outputs[name]), rtol=1e-12, atol=1e-12), name


def test_a_kernel_whose_offsets_wrap_is_found_on_a_huge_case_only(small_threshold, device):
    """A planted 32-bit offset overflow (x read from i - HUGE_ELEMENTS past it) diverges on the slice of a huge
    case, and is no divergence where the case stays below the threshold."""
    case = WHOLE.replace(padding=None, segments=None)
    with Examiner(["ssdiff.sides.doubles:offset_wrap_bug", "ssdiff.sides.doubles:healthy"], device) as examiner:
        outcome = examiner.examine(case)
        assert not outcome.verdicts["ssdiff.sides.doubles:offset_wrap_bug"].ok
        assert outcome.verdicts["ssdiff.sides.doubles:healthy"].ok
        small = case.replace(batch=1, seqlen=8)             # 128 elements of x, 128 of chunk states
        assert not huge.is_huge(small)
        assert examiner.examine(small).verdicts["ssdiff.sides.doubles:offset_wrap_bug"].ok


def test_a_huge_case_without_room_on_the_device_is_no_verdict(small_threshold, device, monkeypatch):
    monkeypatch.setattr(huge, "room", lambda case, dev: "not enough free device memory for a huge case: about "
                                                        "70 GiB needed, 12 GiB free")
    with Examiner(["ref.quadratic"], device) as examiner:
        with pytest.raises(DeviceOutOfMemory, match="70 GiB needed, 12 GiB free"):
            examiner.examine(WHOLE)


def test_bytes_needed_and_room_on_the_device(device):
    big = Case(entry="chunk_scan", batch=1, seqlen=262144, nheads=128, headdim=64, ngroups=8, dstate=128,
               chunk_size=256, dtype="bfloat16", has_z=True)
    assert huge.is_huge(big) and huge.elements(big)["x"] == 2 ** 31
    need = huge.bytes_needed(big)
    assert 60 * 2 ** 30 < need < 100 * 2 ** 30           # float64 x and z, drawn, in bf16, y, chunk states
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        assert (huge.room(big, device) is None) == (free >= need)
    else:
        assert huge.room(big, device) is None               # no device memory to guard on the CPU


@pytest.mark.parametrize("crossing", ["x", "chunk states"])
def test_huge_seqlens_cross_the_threshold_in_what_they_say(crossing):
    shape = huge.Huge()
    for b, h, p, n, q in ((1, 128, 64, 128, 256), (2, 80, 128, 256, 128), (1, 64, 64, 256, 128)):
        lo, hi = shape.seqlens(b, h, p, n, q, crossing)
        assert lo <= hi
        for seqlen in (lo, hi):
            count = huge.elements(Case(entry="chunk_scan", batch=b, seqlen=seqlen, nheads=h, headdim=p, dstate=n,
                                       chunk_size=q))[crossing]
            assert huge.HUGE_ELEMENTS <= count <= shape.margin * huge.HUGE_ELEMENTS + b * h * p * n
        below = Case(entry="chunk_scan", batch=b, seqlen=lo - 1 if crossing == "x" else lo - q, nheads=h,
                     headdim=p, dstate=n, chunk_size=q)
        assert huge.elements(below)[crossing] < huge.HUGE_ELEMENTS
    for n, q in shape.widths(crossing):         # the widths a key of this crossing takes: it crosses first
        lo, _ = shape.seqlens(1, 64, 64, n, q, crossing)
        counts = huge.elements(Case(entry="chunk_scan", seqlen=lo, nheads=64, headdim=64, dstate=n, chunk_size=q))
        assert max(counts, key=counts.get) == crossing or counts["x"] == counts["chunk states"]


def test_a_production_slot_draws_huge_keys_at_the_rate_asked():
    """Mix.huge: production slots draw forward chunk_scan keys past the threshold, contiguous; none in a backward
    campaign or without the chunk_scan entry; none at rate 0."""
    bounds = Bounds()
    pool = Pool(("chunk_scan", "split_conv1d"), ("bfloat16",), bounds, mix=Mix(huge=1.0), seed=3)
    keys = [pool.draw("production") for _ in range(6)]
    assert {k.kind for k in keys} == {"huge"}
    for key in keys:
        assert key.entry == "chunk_scan" and key.layout == "contiguous" and key.forward_only
        assert huge.is_huge(key.case()) and key.case(backward=True) == key.case() and not key.case().backward
    assert {k.kind for k in (Pool(("chunk_scan",), ("bfloat16",), bounds, mix=Mix(huge=1.0), seed=3,
                                  backward=True).draw("production") for _ in range(4))} == {"production"}
    assert {k.kind for k in (Pool(("split_conv1d",), ("bfloat16",), bounds, mix=Mix(huge=1.0), seed=3)
                             .draw("production") for _ in range(4))} == {"production"}
    assert {k.kind for k in (Pool(("chunk_scan",), ("bfloat16",), bounds, seed=3).draw("production")
                             for _ in range(8))} == {"production"}


def test_huge_is_refused_where_there_is_no_pool(tmp_path, device):
    with pytest.raises(UsageError, match="--huge draws production keys of the compile pool"):
        Fuzzer(FuzzConfig(impl="ref.quadratic", device=device, pool=False, huge=0.1, max_examples=1,
                          report_dir=None, out_dir=str(tmp_path)))
    with pytest.raises(UsageError, match="--huge is a chance between 0 and 1"):
        Fuzzer(FuzzConfig(impl="ref.quadratic", device=device, pool=True, huge=2.0, max_examples=1,
                          report_dir=None, out_dir=str(tmp_path)))
