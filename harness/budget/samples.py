"""The budget's samples: the model kernel (ssdiff.budget.model) evaluated on a case at round-to-nearest and with
perturbed roundings, and at neighbouring inputs, as float64 Evaluations in the oracle's layouts and stage names.

`evaluate(case, inputs)` is one sample; `evaluate_samples` gets every sample the verdict needs from one
evaluation (`evaluate_folded`: the samples folded into the batch rows), plus the neighbours' (`neighbours_of`:
the inputs moved by one unit in the last place, each measured against the oracle at those inputs).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ssdiff.budget import mamba3
from ssdiff.budget.model import layer, mixer, scan, step_scan
from ssdiff.budget.rounding import COMPUTE, LOW_PRECISION, Rounding, Signs, dot_precision, linear_precision
from ssdiff.inputs import Inputs, widen
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation, evaluate_graph
from ssdiff.model.stages import STAGE_ORDER
from ssdiff.truth import with_empty_sequences


# The oracle at other inputs: (case, inputs) -> Evaluation (e.g. ssdiff.truth.evaluate).
OracleAt = Callable[[Case, Inputs], Evaluation]


SAMPLES = 3


# Inputs without a batch axis: a folded evaluation stacks them on a leading axis of folds (the others are
# concatenated along the batch rows).
PARAMETERS = frozenset({"A", "A_log", "D", "dt_bias", "conv1d_weight", "conv1d_bias", "rmsnorm_weight", "outproj_weight",
                        "outproj_bias", "in_proj_weight", "in_proj_bias", "q_bias", "k_bias", "q_norm_weight",
                        "k_norm_weight"})


# The model in the token order (a token-recurrent side's budget, harness/examine.py) keeps every token's state,
# (b, L, h, p, n) in float32, for each of its folded samples, forward and backward (about three copies). Past this,
# a case is not judged for such a side rather than judged by the chunked order's budget alone: a production shape
# (L=16K, h=128, p=64, n=128) would need about 1 TiB.
TOKEN_MODEL_BYTES = 8 << 30


def token_model_too_large(case: Case) -> Optional[str]:
    """Why the model in the token order cannot budget ``case`` (TOKEN_MODEL_BYTES), or None."""
    need = case.batch * case.seqlen * case.nheads * case.headdim * case.dstate * 4 * (SAMPLES + NEIGHBOURS) * 3
    if need <= TOKEN_MODEL_BYTES:
        return None
    return (f"the baseline of a token-by-token evaluation (the model in the token order) would hold more than "
            f"{TOKEN_MODEL_BYTES >> 30} GiB of states")


def evaluate(case: Case, inputs: Inputs, device: Optional[str] = None, sample: int = 0) -> Evaluation:
    """The model kernel on ``case``: outputs, stages and (backward cases) gradients, as float64 tensors.
    ``device`` decides the dot precision (TF32 on a CUDA GPU for fp32); default: the inputs' device.
    ``sample`` 0 rounds to nearest; k >= 1 draws a perturbed sample (see `Rounding`)."""
    return evaluate_folded(case, [inputs], (sample,), device)[0]


def _fold(inputs: list) -> Inputs:
    """Several Inputs of one case as one: batch rows concatenated (fold i's rows i*b .. (i+1)*b - 1), PARAMETERS
    stacked on a leading axis, the cotangents and seq_idx repeated."""
    first, n = inputs[0], len(inputs)
    values = {name: (torch.stack if name in PARAMETERS else torch.cat)([i.values[name] for i in inputs])
              for name in first.values}
    repeat = lambda t: torch.cat([t] * n) if t is not None else None
    return dataclasses.replace(first, values=values, grad_outputs={k: repeat(v) for k, v in first.grad_outputs.items()},
                               seq_idx=repeat(first.seq_idx))


def evaluate_folded(case: Case, inputs: list, samples: tuple, device: Optional[str] = None,
                    order: str = "chunked") -> list:
    """`evaluate` of sample ``samples[i]`` at ``inputs[i]`` for every i, in one evaluation (``order``: `scan`'s, the
    chunk_scan entry's only): the inputs folded into the batch rows (`_fold`; a case's rows are independent, its
    parameters carried per fold), every rounding point
    drawing each fold's signs from that sample's own generator (`FoldedSigns`). One evaluation of a few small
    tensors launches as many kernels as one of a large tensor, and on a GPU the launches are what an evaluation
    costs. Returns one Evaluation per fold, each what that sample evaluated alone gives (up to the order of the
    larger products' sums)."""
    if order != "chunked" and case.entry != "chunk_scan":
        raise ValueError(f"the {order} order is modelled for the chunk_scan entry only, not {case.entry}")
    folds = len(inputs)
    first = inputs[0]
    device = device if device is not None else first.device
    rounding = Rounding(dot_precision(case, device), case.dtype if case.dtype in LOW_PRECISION else None, tuple(samples),
                        linear_precision(case, device))
    folded = _fold(inputs) if folds > 1 else first
    n = folds if folds > 1 else 0                 # the model's folds argument: 0 when not folded
    leaves = folded.leaves(COMPUTE, requires_grad=case.backward)

    def forward() -> Evaluation:
        if case.entry == "mamba3_layer":
            return Evaluation({"y": rounding.store(mamba3.layer(leaves, case, rounding, n))})
        if case.entry == "mamba3":
            y, finals = mamba3.scan(leaves, case, rounding, n)
            return Evaluation({"y": y, **(finals if case.return_final_states else {})})
        if case.entry == "decode":
            P = case.prefill_len
            cut = lambda name: leaves[name][:, P:] if name in leaves else None
            y, final = step_scan(cut("x"), cut("dt"), leaves["A"], cut("B"), cut("C"), leaves["state"],
                                 rounding=rounding, state_precision=case.state_dtype, D=leaves.get("D"), z=cut("z"),
                                 dt_bias=leaves.get("dt_bias"), dt_softplus=case.dt_softplus,
                                 dt_limit=case.dt_limit_or_default, folds=n)
            outputs = {"y": rounding.store(y)}
            if case.return_final_states:
                outputs["final_states"] = final
            return Evaluation(outputs)
        if case.entry == "chunk_scan":
            y, final, varlen, stages = scan(
                leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size=case.chunk_size,
                rounding=rounding, D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
                dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
                initial_states=leaves.get("initial_states"), seq_idx=folded.seq_idx, want_varlen=case.varlen_states,
                folds=n, order=order)
        else:
            model = layer if case.entry == "layer" else mixer
            y, final, stages = model(leaves, case, folded.seq_idx, rounding, n)
            varlen = None
        y = rounding.store(y)
        outputs = {"y": y}
        if case.return_final_states:
            outputs["final_states"] = rounding.keep(final)
        if case.varlen_states and 0 in case.segments[0]:
            # the empty sequences' states, each the state it starts from (harness/truth/README.md)
            lead = (n,) if n else ()
            h0 = leaves.get("initial_states")
            zeros = torch.zeros(lead + (case.nheads, case.headdim, case.dstate), dtype=torch.float32,
                                device=leaves["x"].device)
            varlen = with_empty_sequences(case, varlen, None if h0 is None else (h0 if n else h0[0]).float(), zeros)
        if case.varlen_states and varlen is not None:
            outputs["varlen_states"] = varlen
        stages["y"] = y
        return Evaluation(outputs, stages={k: stages[k] for k in STAGE_ORDER if k in stages})

    result = evaluate_graph(case, folded, leaves, forward)

    def by_fold(name, t, kind):
        """The folds of a result along a leading axis: its rows regrouped, or (parameters' gradients,
        varlen_states) its fold axis as it is."""
        if folds == 1:
            return t[None]
        if (kind == "grads" and name in PARAMETERS) or name == "varlen_states":
            return t
        return t.reshape((folds, t.shape[0] // folds) + t.shape[1:])

    # each result converted once for every fold, then unbound into the folds' views
    split = lambda d, kind, cast=lambda k, t: t: {
        k: cast(k, by_fold(k, v, kind)).to(torch.float64).unbind(0) for k, v in d.items()}
    outputs, stages = split(result.outputs, "outputs"), split(result.stages, "stages")
    grads = split(result.grads, "grads", lambda k, t: t.to(first.dtypes[k]))
    at = lambda d, i: {k: v[i] for k, v in d.items()}
    return [Evaluation(outputs=at(outputs, i), stages=at(stages, i), grads=at(grads, i)) for i in range(folds)]


# Neighbour samples: the model kernel at inputs one unit roundoff away (each input element moved by +-2u of its
# dtype, then rounded to it), its error measured against the oracle at those same inputs. The perturbed samples
# above move the model's rounding points; these move the point the rounding happens at. Needed because a
# gradient summed over every token with cancellation (the gradient of A) can be exact by chance at one input:
# a 10-minute fuzz met a case where all three samples erred by 1e-9 to 2e-9 while inputs 1e-5 away gave the
# same model ~2e-8 — and mamba_chunk_scan_combined's (healthy, sign-varying) 4.85e-8 became a "divergence".
NEIGHBOURS = 2


def neighbour(inputs: Inputs, k: int) -> Inputs:
    """``inputs`` with every floating value moved by one random +-2u step of its dtype and rounded to it (the
    signs drawn where the values are, as a sample's)."""
    signs = Signs(104729 * k)
    values = {}
    for name, value in inputs.values.items():
        dtype = inputs.dtypes.get(name, torch.float64)
        if not value.is_floating_point():
            values[name] = value
            continue
        sign = signs.like(value)
        u = torch.finfo(dtype).eps / 2
        values[name] = (value * (1 + 2 * u * sign)).to(dtype).to(value.dtype)
    return dataclasses.replace(inputs, values=values)


def _shifted(base: Evaluation, truth: Evaluation, models: list, exacts: list) -> list:
    """For each neighbour (a model evaluation and the oracle's at its inputs): truth + (model - exact), key by key
    (``base``'s keys; ``base``'s value where a term is missing or not finite): a sample whose error against
    ``truth`` is the model's error at the neighbouring inputs. The neighbours of a key are computed together."""
    shifted = [{"outputs": {}, "grads": {}, "stages": {}} for _ in models]
    for field in ("outputs", "grads", "stages"):
        for key, fallback in getattr(base, field).items():
            t = getattr(truth, field).get(key)
            ms = [getattr(m, field).get(key) for m in models]
            es = [getattr(e, field).get(key) for e in exacts]
            if t is None or any(x is None or x.shape != t.shape for x in ms + es):
                for out in shifted:
                    out[field][key] = fallback
                continue
            v = t + (torch.stack(ms) - torch.stack(es))
            for out, value in zip(shifted, torch.where(torch.isfinite(v), v, fallback).unbind(0)):
                out[field][key] = value
    return [Evaluation(**parts) for parts in shifted]


def neighbours_of(inputs: Inputs, count: int = NEIGHBOURS) -> list:
    """The inputs of the neighbour samples: `neighbour` k = 1 .. ``count``."""
    return [neighbour(inputs, k) for k in range(1, count + 1)]


def evaluate_samples(case: Case, inputs: Inputs, truth: Evaluation, oracle: Optional[OracleAt] = None,
                     device: Optional[str] = None, samples: int = SAMPLES, neighbours: int = NEIGHBOURS,
                     at_neighbours: Optional[tuple] = None, order: str = "chunked") -> list:
    """``samples`` evaluations (round-to-nearest first, then perturbed ones), then ``neighbours`` samples at
    neighbouring inputs (see NEIGHBOURS). ``truth`` is the oracle at ``inputs``. ``at_neighbours``: (the
    neighbour inputs, `neighbours_of`; the oracle at each) where the caller has them, else ``oracle(case,
    inputs)`` evaluates them (side by side where the entry allows: harness/inputs/widen.py). The verdict's noise level
    at an element is the largest error among the samples. The model's evaluations are one folded evaluation
    (`evaluate_folded`, in ``order``)."""
    if at_neighbours is not None:
        near, exact = at_neighbours
    else:
        near = neighbours_of(inputs, neighbours)
        if near and oracle is None:
            raise ValueError("evaluate_samples: neighbour samples need the oracle (pass oracle=...)")
        exact = widen.evaluate(oracle, case, near) if near else []
    models = evaluate_folded(case, [inputs] * samples + near, tuple(range(samples)) + (0,) * len(near), device,
                             order)
    return models[:samples] + (_shifted(models[0], truth, models[samples:], exact) if near else [])


__all__ = ["OracleAt", "SAMPLES", "PARAMETERS", "TOKEN_MODEL_BYTES", "token_model_too_large", "evaluate", "evaluate_folded", "NEIGHBOURS", "neighbour", "neighbours_of", "evaluate_samples"]
