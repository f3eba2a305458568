"""The recurrent oracle's gradients are exact: torch.autograd.gradcheck on tiny cases of both entry points
(every differentiable input at once, against central finite differences in float64), on the Mamba-3 scan and on
the Mamba3 module."""

import dataclasses

import torch
from hypothesis import example, given, settings

from ssdiff.inputs import materialize
from ssdiff.model.case import Case, Regime
from ssdiff.testing import examples
from ssdiff.truth import call
from ssdiff.truth.mamba3 import STATE_OUTPUTS
from ssdiff.model.bounds import Bounds
from ssdiff.model.strategies import cases

TINY = Bounds(max_batch=2, max_seqlen=6, max_nheads=2, max_headdim=2, max_dstate=2, chunk_sizes=(2, 4), max_width=2)


@given(cases(backward=True, bounds=TINY, layouts=("contiguous",)))
def test_recurrent_oracle_gradients_pass_gradcheck(device, case):
    # RMSNorm of a group that is ~0 (integer inputs give z = 0 exactly) has curvature radius sqrt(eps): with
    # eps = 1e-6 that is 1e-3, too close to the finite-difference step for central differences to be accurate
    # (measured: d/dv = 3195.54 analytical vs 3195.48 numerical). eps = 1e-2 keeps every case smooth at the
    # step's scale; the analytical gradient is the same code either way.
    if case.rmsnorm:
        case = case.replace(rmsnorm_eps=1e-2)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    names = inputs.differentiable

    def f(*leaves):
        res = call("ref.recurrent", case, dict(tensors, **dict(zip(names, leaves))), inputs.seq_idx)
        return res.outputs["y"], res.outputs["final_states"]

    leaves = tuple(tensors[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, leaves, eps=EPS, atol=finite_difference_floor(f(*leaves)), rtol=1e-5,
                                    raise_exception=True)


@settings(max_examples=examples(4, 4))
@given(cases(entry="mamba3", backward=True, bounds=dataclasses.replace(TINY, max_dstate=4)))
@example(Case(entry="mamba3", batch=1, seqlen=5, nheads=2, ngroups=1, headdim=2, dstate=4, chunk_size=2,
              has_dt_bias=False, dt_softplus=False, rope_fraction=1.0, has_z=True, initial_states=True,
              segments=((2, 3),), pass_="backward", final_state_grad=True, regime=Regime(decay="strong"), seed=3))
def test_recurrent_oracle_gradients_pass_gradcheck_on_mamba3(device, case):
    """Every input of the Mamba-3 scan (the four input states too) against y and the four final states. In
    gradcheck's fast mode (the analytical and numerical Jacobians each contracted with the same random vectors): its
    fifteen inputs, elementwise, are a few thousand forward evaluations of a Python token loop per case."""
    inputs = materialize(case, device)
    tensors = inputs.float64()
    names = inputs.differentiable
    wanted = ("y",) + (STATE_OUTPUTS if case.return_final_states else ())

    def f(*leaves):
        res = call("ref.recurrent", case, dict(tensors, **dict(zip(names, leaves))), inputs.seq_idx)
        return tuple(res.outputs[name] for name in wanted)

    leaves = tuple(tensors[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, leaves, eps=EPS, atol=finite_difference_floor(f(*leaves)), rtol=1e-5,
                                    raise_exception=True, fast_mode=True)


@settings(max_examples=examples(3, 3))
@given(cases(entry="mamba3_layer", backward=True, bounds=dataclasses.replace(TINY, max_dstate=4)))
@example(Case(entry="mamba3_layer", seqlen=5, nheads=2, ngroups=2, headdim=2, dstate=4, chunk_size=2, d_model=2,
              rmsnorm=True, rmsnorm_eps=1e-5, return_final_states=False, rope_fraction=1.0, segments=((2, 3),),
              pass_="backward", seed=3))
def test_recurrent_oracle_gradients_pass_gradcheck_on_the_mamba3_module(device, case):
    """u and every parameter of the Mamba3 module against y, in fast mode (as the scan's). The norms' eps at 1e-2
    for the reason the Mamba-2 property gives (integer inputs make a B/C head exactly zero)."""
    case = case.replace(rmsnorm_eps=1e-2)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    names = inputs.differentiable

    def f(*leaves):
        return call("ref.recurrent", case, dict(tensors, **dict(zip(names, leaves))), inputs.seq_idx).outputs["y"]

    leaves = tuple(tensors[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, leaves, eps=EPS, atol=finite_difference_floor((f(*leaves),)), rtol=1e-5,
                                    raise_exception=True, fast_mode=True)


EPS = 1e-6


def finite_difference_floor(outputs) -> float:
    """The absolute error of gradcheck's central differences themselves: f(v +- eps) are rounded to float64, so
    (f(v + eps) - f(v - eps)) / (2 eps) is only known to about ulp(|f|) / eps (measured on an H200: a case with
    |y| ~ 1700 whose d y / d A of 1.68e-7 came out as 0 numerically, one float64 ulp of y per 1.1e-7). Four ulps
    of the largest output over eps, and never below the 1e-7 the check asks of small outputs."""
    largest = max(float(o.detach().abs().max()) for o in outputs if o.numel())
    return max(1e-7, 4 * largest * 2.0 ** -52 / EPS)
