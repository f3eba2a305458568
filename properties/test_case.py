"""The Case record: JSON round-trips exactly, invalid input is refused with one line naming the field, and
inputs materialize deterministically (float64 first, then cast) in either layout."""

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssdiff.model.case import ENTRY_POINTS, Case, CaseError, Regime
from ssdiff.inputs import materialize
from ssdiff.model.strategies import cases

VALID = Case(batch=2, seqlen=12, nheads=8, ngroups=2).to_dict()
# cases of every entry point (cases() alone draws chunk_scan and split_conv1d)
EVERY_ENTRY = st.sampled_from(ENTRY_POINTS).flatmap(lambda e: cases(entry=e, dtypes=("float32", "float16", "bfloat16")))


@given(st.one_of(cases(dtypes=("float32", "float16", "bfloat16")), EVERY_ENTRY))
def test_json_round_trips_exactly(case):
    text = case.to_json()
    again = Case.from_json(text)
    assert again == case
    assert again.to_json() == text


@given(st.one_of(cases(), EVERY_ENTRY))
def test_description_is_one_line(case):
    text = case.describe()
    assert "\n" not in text and case.entry in text and f"seed={case.seed}" in text


@pytest.mark.parametrize("change, message", [
    ({"ngroups": 3}, "ngroups=3 must divide nheads=8"),
    ({"seqlen": -1}, "seqlen=-1 must be at least 1"),
    ({"nheads": "8"}, "nheads: expected an integer, got '8'"),
    ({"dtype": "float64"}, "dtype: expected one of float32, float16, bfloat16, got 'float64'"),
    ({"chunk_size": 6}, "chunk_size=6 must be a power of two"),
    ({"segments": [[5, 5], [12]]}, "segments[0]=[5, 5] plus padding 0 sum to 10, must equal seqlen=12"),
    ({"varlen_states": True}, "varlen_states=true needs segments"),
    ({"regime": {"decay": "huge"}}, "regime.decay: expected one of none, mild, typical, strong, got 'huge'"),
    ({"colour": "red"}, "colour: unknown field"),
    ({"rmsnorm": True}, "rmsnorm=True is only meaningful for entry 'split_conv1d'"),
], ids=["ngroups", "negative-seqlen", "wrong-type", "dtype", "chunk", "segments", "varlen", "regime", "unknown",
        "entry-feature"])
def test_invalid_case_is_refused_naming_the_field(change, message):
    data = dict(VALID, **change)
    with pytest.raises(CaseError) as info:
        Case.from_dict(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_field_is_named():
    data = dict(VALID)
    del data["ngroups"]
    with pytest.raises(CaseError, match="^ngroups: missing field$"):
        Case.from_dict(data)


@pytest.mark.parametrize("text, message", [
    ("{not json", "case: not valid JSON"),
    ("[1, 2]", "case: expected a JSON object, got list"),
    (json.dumps(dict(VALID, ngroups=3)), "ngroups=3 must divide nheads=8"),
    (json.dumps(dict(VALID, seqlen=-5)), "seqlen=-5 must be at least 1"),
])
def test_cli_refuses_bad_case_files_with_one_line(tmp_path, text, message):
    path = tmp_path / "case.json"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "ssdiff.cli", "case", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"ssdiff case: {path}: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@given(st.one_of(cases(dtypes=("float32", "float16", "bfloat16")), EVERY_ENTRY))
def test_inputs_are_deterministic_and_rounded_once(device, case):
    a, b = materialize(case, device), materialize(case, device)
    assert a.values.keys() == b.values.keys()
    for name, value in a.values.items():
        assert value.dtype == torch.float64
        assert torch.equal(value, b.values[name])
        # the float64 values are exactly representable in the dtype implementations get them in
        assert torch.equal(value.to(a.dtypes[name]).to(torch.float64), value)
    native = a.native()
    for name, value in native.items():
        assert value.dtype == a.dtypes[name]
        assert torch.equal(value.to(torch.float64), a.values[name])
    if case.regime.layout == "strided" and case.entry == "chunk_scan":
        bases = {t.untyped_storage().data_ptr() for n, t in native.items() if n in a.wide_order}
        assert len(bases) == 1, "strided inputs must be views of one wide tensor"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_case_past_the_draw_block_draws_the_same_numbers_on_the_device_as_on_the_cpu(device, dtype):
    """Every value and cotangent of a case with tensors past _DRAW_BLOCK (drawn by counter_variates where the case
    lives, rounded to its dtype there) is bitwise the same drawn on ``device`` as on the CPU, and the same drawn
    twice."""
    from ssdiff.inputs.drawing import _DRAW_BLOCK, draw

    case = Case(seqlen=257, nheads=16, headdim=64, dstate=2, chunk_size=64, has_z=True, pass_="backward",
                dtype=dtype, regime=Regime(dt_large=True))
    here, cpu = draw(case, device), draw(case, "cpu")
    assert here[0]["x"].numel() > _DRAW_BLOCK and here[0]["x"].device.type == torch.device(device).type
    for ours, theirs in zip(here, cpu):
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name].cpu(), theirs[name]) if torch.is_tensor(ours[name]) else \
                ours[name] == theirs[name], name
    assert torch.equal(draw(case, device)[0]["x"], here[0]["x"])


def _on_meta(case) -> bool:
    from ssdiff.inputs.drawing import draw

    values, _, grads = draw(case, "meta")
    return all(t.device.type == "meta" for t in [*values.values(), *grads.values()])


@given(EVERY_ENTRY)
def test_every_drawn_tensor_lands_on_the_device_asked_for(case):
    """Drawn for the meta device (whose tensors, like a GPU's, refuse to meet the CPU's in one operation), every
    value and cotangent lands there: a device mix in draw fails here, on a machine without a GPU too."""
    assert _on_meta(case)


@pytest.mark.parametrize("entry", ["chunk_scan", "split_conv1d", "decode"])
@pytest.mark.parametrize("regime", [Regime(dt_large=True), Regime(values="integer")], ids=["dt_large", "integer"])
def test_a_production_size_case_lands_on_the_device_asked_for(entry, regime):
    """The same with tensors past _DRAW_BLOCK (counter_variates on the device), every feature that mixes them
    with small ones on."""
    extra = {"decode_steps": 2, "pass_": "forward"} if entry == "decode" else {"pass_": "backward"}
    case = Case(entry=entry, seqlen=2048, nheads=16, headdim=64, dstate=128, ngroups=16, chunk_size=256,
                has_z=entry != "split_conv1d", initial_states=True, regime=regime, **extra)
    assert _on_meta(case)


# counter_variates' first values for fixed keys (float64 bits): any device, any torch, must give these.
PINNED = {"normal": ((1, 2, 3, 4), [0.8167438431872991, 0.9028352562992186, 0.9575262949559313,
                                    1.5940552658080147, -0.6747622710545207, 1.284090550047002]),
          "uniform": ((5, 6, 7, 8), [0.8083001826545856, 0.38303260644912074, 0.1601052075862388]),
          "integer": ((9, 10, 11, 12), [1.0, 2.0, -2.0, -1.0, 0.0, 0.0, -1.0, -1.0])}


@pytest.mark.parametrize("kind", sorted(PINNED))
def test_counter_variates_are_pinned_bits_on_every_device(kind, device):
    from ssdiff.inputs.drawing import counter_variates

    key, first = PINNED[kind]
    assert counter_variates(kind, len(first), key, device).cpu().tolist() == first


@pytest.mark.parametrize("kind", sorted(PINNED))
def test_counter_variates_in_slabs_are_the_variates_at_once(kind, device, monkeypatch):
    """Computed a slab at a time (a huge case's 2**31 variates), element i is still a function of i alone."""
    from ssdiff.inputs import drawing

    key = PINNED[kind][0]
    whole = drawing.counter_variates(kind, 1000, key, device)
    monkeypatch.setattr(drawing, "_VARIATE_SLAB", 64)       # 16 slabs of the 1000
    assert torch.equal(drawing.counter_variates(kind, 1000, key, device), whole)


def test_counter_normals_are_distinct_and_normal(device):
    """2**20 normals of one key: no value twice, and the normal's mean, variance and tail shares (the inverse CDF
    is cut at the outermost quantile, 4.32)."""
    from ssdiff.inputs.drawing import counter_variates

    n = 2 ** 20
    x = counter_variates("normal", n, (7, 11, 13, 17), device).cpu()
    assert x.unique().numel() == n
    se = n ** -0.5
    assert abs(x.mean().item()) < 5 * se and abs(x.var().item() - 1.0) < 5 * 2 ** 0.5 * se
    for k, share in ((1, 0.31731), (2, 0.04550), (3, 0.00270)):
        seen = (x.abs() > k).double().mean().item()
        assert abs(seen - share) < 5 * (share * (1 - share) / n) ** 0.5, (k, seen, share)
    assert 4.3 < x.abs().max().item() < 4.33


@given(cases(entry="chunk_scan"))
def test_the_decay_inputs_alone_are_those_of_the_whole_draw(case):
    from ssdiff.inputs.drawing import draw

    alone, whole = draw(case, decay_only=True)[0], draw(case)[0]
    assert alone.keys() <= whole.keys() and {"A", "dt"} <= alone.keys()
    for name, value in alone.items():
        assert torch.equal(value, whole[name]), name
