"""The three float64 oracles (recurrent, quadratic, chunked) agree on every output, gradient and stage, over
generated cases spanning every feature of the Mamba-2 entry points, of the Mamba-3 scan and of the Mamba3 module."""

import torch
from hypothesis import example, given, settings

from ssdiff.model.case import Case, Regime
from ssdiff.model.bounds import Bounds
from ssdiff.model.strategies import cases
from ssdiff.testing import dt_on_its_bounds, examples, oracles_agree


@given(cases(dtypes=("float32", "float16", "bfloat16")))
@example(Case(seqlen=3, nheads=5, headdim=3, dstate=2, chunk_size=4, dtype="float16", D="channel", has_z=True,
              has_dt_bias=False, initial_states=True, segments=((1,),), padding=(2,),
              regime=Regime(decay="strong", dt_large=True, scale=0.25), pass_="backward", seed=20013))
@example(Case(seqlen=1, nheads=2, headdim=1, dstate=7, chunk_size=4, D="none", dt_limit=(0.0, 1.0),
              regime=Regime(decay="mild", values="integer", layout="strided"), seed=1))
def test_three_oracles_agree(device, case):
    oracles_agree(case, device)


@settings(max_examples=examples(8, 8))
@given(cases(entry="mamba3", dtypes=("float32", "bfloat16"), bounds=Bounds(max_seqlen=20, max_nheads=4)))
@example(Case(entry="mamba3", seqlen=9, nheads=2, dstate=4, chunk_size=4, has_dt_bias=False, dt_softplus=False,
              rope_fraction=1.0, has_z=True, initial_states=True, segments=((1, 0, 8),), pass_="backward",
              final_state_grad=True, regime=Regime(dt_large=True, scale=4.0), seed=5))
# one token, dt > 20: y's own term q~.k~ does not depend on the angle, whose gradient is then exactly zero (taken
# from the unrotated q.k in every order; two rotations by ~70 rad left a residue above atol)
@example(Case(entry="mamba3", seqlen=1, nheads=1, headdim=1, dstate=4, chunk_size=4, has_dt_bias=False,
              dt_softplus=False, regime=Regime(decay="strong", dt_large=True), pass_="backward", seed=51466))
def test_three_oracles_agree_on_mamba3(device, case):
    """The Mamba-3 scan's three orders (harness/truth/mamba3.py) agree on y, the four final states and every
    gradient."""
    oracles_agree(case, device)


@settings(max_examples=examples(6, 6))
@given(cases(entry="mamba3_layer", dtypes=("float32", "bfloat16"), bounds=Bounds(max_seqlen=20, max_nheads=4)))
@example(Case(entry="mamba3_layer", seqlen=9, nheads=4, ngroups=2, headdim=2, dstate=4, chunk_size=4, d_model=4,
              rmsnorm=True, rmsnorm_eps=1e-5, return_final_states=False, segments=((3, 0, 6),), pass_="backward",
              regime=Regime(dt_large=True), seed=7))
def test_three_oracles_agree_on_the_mamba3_module(device, case):
    """The Mamba3 module (harness/truth/mamba3_layer.py) around each of the scan's orders: y and the gradients of
    u and every parameter."""
    oracles_agree(case, device)


def test_three_oracles_agree_with_dt_on_a_bound_of_its_limit(device):
    """Their gradients agree where dt lies exactly on a bound of dt_limit (drawn float32 values never do; bf16
    ones often do), where a clamp built of torch.minimum / torch.maximum would halve the gradient (their tie
    rule) and torch.clamp passes it."""
    case = Case(batch=2, seqlen=20, nheads=2, headdim=3, dstate=2, chunk_size=8, has_dt_bias=False,
                dt_softplus=False, dt_limit=(0.25, 1.0), initial_states=True, pass_="backward", final_state_grad=True)
    inputs, _ = dt_on_its_bounds(case, device)
    oracles_agree(case, device, inputs)


def test_the_chunked_oracles_state_passing_is_the_recurrence_with_its_gradient(device):
    """The chunked oracle's states between chunks (one autograd function) against the recurrence S_0 = initial,
    S_k+1 = keep_k S_k + chunk_states_k, and its gradient against torch's numerical one."""
    from ssdiff.truth.chunked import _CarryStates

    g = torch.Generator().manual_seed(0)
    drawn = lambda f, *shape: f(*shape, dtype=torch.float64, generator=g).to(device).requires_grad_(True)
    cs, keep, init = drawn(torch.randn, 2, 5, 1, 3, 4, 2), drawn(torch.rand, 2, 5, 1, 3), drawn(torch.randn, 2, 1, 3, 4, 2)
    state, plain = init, [init]
    for k in range(5):
        state = keep[:, k, ..., None, None] * state + cs[:, k]
        plain.append(state)
    assert torch.allclose(_CarryStates.apply(cs, keep, init), torch.stack(plain, 1), rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradcheck(_CarryStates.apply, (cs, keep, init))
