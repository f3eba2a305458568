"""The Case record: JSON round-trips exactly, invalid input is refused with one line naming the field, and
inputs materialize deterministically (float64 first, then cast) in either layout."""

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given

from harness.case import Case, CaseError
from harness.inputs import materialize
from harness.strategies import cases

VALID = Case(batch=2, seqlen=12, nheads=8, ngroups=2).to_dict()


@given(cases(dtypes=("float32", "float16", "bfloat16")))
def test_json_round_trips_exactly(case):
    text = case.to_json()
    again = Case.from_json(text)
    assert again == case
    assert again.to_json() == text


@given(cases())
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
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "case", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("ssdiff: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@given(cases(dtypes=("float32", "float16", "bfloat16")))
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


def test_a_tensor_over_the_draw_block_is_drawn_blockwise_deterministically_and_without_repeats():
    """x of just over _DRAW_BLOCK elements (1 x 257 x 16 x 64) comes from one generator per block: the same
    numbers every time, no block a copy of another, normal in the whole and in the last (partial) block."""
    from harness.inputs import _DRAW_BLOCK, draw

    case = Case(seqlen=257, nheads=16, headdim=64, dstate=2, chunk_size=64)
    x = draw(case)[0]["x"].flatten()
    assert x.numel() > _DRAW_BLOCK
    assert torch.equal(x, draw(case)[0]["x"].flatten())
    first, second = x[:_DRAW_BLOCK], x[_DRAW_BLOCK:]
    assert not torch.equal(first[:second.numel()], second)
    for part in (x, second):
        assert abs(part.mean().item()) < 5 / part.numel() ** 0.5
        assert abs(part.std().item() - 1.0) < 0.05
