"""The oracle properties have teeth: with a deliberately broken oracle swapped in, the same checks fail.

Each broken variant is a classic real bug:
- group index head % ngroups instead of head // (nheads // ngroups);
- a state that does not reset where seq_idx changes;
- dt_limit clamped before softplus instead of after;
- Mamba-3: the recurrent order rotating by minus the angle; the vectorized orders' trapezoid weight taken from the
  token itself instead of the next one.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from ssdiff.truth import chunked, mamba3, recurrent
from ssdiff.model.strategies import cases
from ssdiff import testing

SEARCH = settings(max_examples=200, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))


def caught(check, strategy, device: str) -> str:
    """Run ``check(case, device)`` over ``strategy``; return the failure message (the test fails if none is
    found)."""
    @SEARCH
    @given(strategy)
    def search(case):
        check(case, device)

    with pytest.raises(AssertionError) as info:
        search()
    return str(info.value)


def group_by_modulo(nheads, ngroups):
    return [head % ngroups for head in range(nheads)]


def never_reset(seq_idx, t):
    return torch.full((seq_idx.shape[0],), t == 0, dtype=torch.bool, device=seq_idx.device)


def clamp_then_softplus(dt_t, dt_bias, dt_softplus, dt_limit):
    if dt_bias is not None:
        dt_t = dt_t + dt_bias
    lo, hi = dt_limit
    dt_t = torch.clamp(dt_t, min=lo, max=None if hi == math.inf else hi)
    if dt_softplus:
        dt_t = torch.where(dt_t <= 20.0, torch.log1p(torch.exp(torch.clamp(dt_t, max=20.0))), dt_t)
    return dt_t


def test_group_index_bug_is_caught(monkeypatch, device):
    monkeypatch.setattr(recurrent, "group_of_head", group_by_modulo)
    message = caught(testing.oracles_agree, cases(entry="chunk_scan", backward=False), device)
    assert "ref.quadratic" in message or "ref.chunked" in message


def test_missing_state_reset_is_caught_by_agreement(monkeypatch, device):
    monkeypatch.setattr(recurrent, "starts_new_sequence", never_reset)
    caught(testing.oracles_agree, cases(backward=False), device)


def test_missing_state_reset_is_caught_by_packed_vs_separate(monkeypatch, device):
    monkeypatch.setattr(recurrent, "starts_new_sequence", never_reset)
    message = caught(testing.packed_equals_separate,
                     cases(backward=False).filter(lambda c: c.segments is not None), device)
    assert "ref.recurrent" in message


def test_dt_limit_before_softplus_is_caught(monkeypatch, device):
    monkeypatch.setattr(recurrent, "process_dt", clamp_then_softplus)
    caught(testing.oracles_agree, cases(backward=False), device)


def test_dt_limit_before_softplus_in_the_chunked_oracle_is_caught(monkeypatch, device):
    def broken(dt, dt_bias, dt_softplus, dt_limit):
        return clamp_then_softplus(dt, dt_bias, dt_softplus, dt_limit)

    monkeypatch.setattr(chunked, "process_dt", broken)
    message = caught(testing.oracles_agree, cases(backward=False), device)
    assert "ref.chunked" in message


def test_a_mamba3_rotation_by_minus_the_angle_is_caught(monkeypatch, device):
    real = mamba3.rotate
    monkeypatch.setattr(mamba3, "rotate", lambda x, theta: real(x, -theta))
    message = caught(testing.oracles_agree, cases(entry="mamba3", backward=False), device)
    assert "ref.quadratic" in message or "ref.chunked" in message


def test_a_mamba3_trapezoid_weight_from_the_wrong_token_is_caught(monkeypatch, device):
    def own_token(t, row, lo, hi, v0, k0):
        dt, trap = t["dt"][row, lo:hi], torch.sigmoid(t["trap"][row, lo:hi])
        gamma = dt * trap
        carried = (dt[0] * (1 - trap[0]))[:, None, None] * v0[:, :, None] * k0[:, None, :]
        return gamma, gamma + dt * (1 - trap), carried

    monkeypatch.setattr(mamba3, "_weights", own_token)
    caught(testing.oracles_agree, cases(entry="mamba3", backward=False), device)
