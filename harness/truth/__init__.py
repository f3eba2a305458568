"""The float64 truth: three independent evaluation orders of the SSD map, for both entry points.

    ref.recurrent   token by token (the definition)           harness/truth/recurrent.py
    ref.quadratic   masked C.B^T over the whole sequence      harness/truth/quadratic.py
    ref.chunked     chunks + passed states (fast, vectorized) harness/truth/chunked.py

They share no code with any kernel they judge, nor with each other's scan. `evaluate` runs one on a Case.

The mamba3 entry: harness/truth/mamba3.py, the Mamba-3 SISO scan in the same three orders; the mamba3_layer entry:
harness/truth/mamba3_layer.py, the Mamba3 module around it.

The layer entry: harness/truth/layer.py puts in_proj (and A = -exp(A_log)) in front of the mixer.

The decode entry: each order runs the decoded tokens [seqlen - decode_steps, seqlen) from the prefill's state
(``inputs.values["state"]``, harness/inputs/: the chunked order's state after the prefill, rounded to the
state dtype): y at each decoded token (b, decode_steps, h, p) and the state after the last step.
"""

from __future__ import annotations

from typing import Optional

import torch

from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation, evaluate_graph
from ssdiff.truth import chunked, layer, mamba3, mamba3_layer, mixer, quadratic, recurrent
from ssdiff.model.stages import STAGE_ORDER

SCANS = {"ref.recurrent": recurrent.scan, "ref.quadratic": quadratic.scan, "ref.chunked": chunked.scan}
MIXER_STYLE = {"ref.recurrent": "loop", "ref.quadratic": "vectorized", "ref.chunked": "vectorized"}
ORACLES = tuple(SCANS)
DEFAULT_ORACLE = "ref.chunked"


def call(name: str, case: Case, tensors: dict, seq_idx: Optional[torch.Tensor]) -> Evaluation:
    """Run oracle ``name`` on float64 ``tensors`` (as made by Inputs.float64) for ``case``: every output it
    computes ("y", "final_states", "varlen_states" — None where the case has none) and the stages."""
    scan = SCANS[name]
    if case.entry == "mamba3":
        return mamba3.call(name, case, tensors)
    if case.entry == "mamba3_layer":
        return mamba3_layer.call(name, case, tensors)
    if case.entry == "decode":
        return decode(scan, case, tensors)
    if case.entry == "layer":
        t = tensors
        return layer.layer(
            scan, MIXER_STYLE[name], t["u"], t["in_proj_weight"], t.get("in_proj_bias"), t["conv1d_weight"],
            t.get("conv1d_bias"), t["dt_bias"], t["A_log"], t["D"], t.get("rmsnorm_weight"), t["outproj_weight"],
            t.get("outproj_bias"), chunk_size=case.chunk_size, nheads=case.nheads, headdim=case.headdim,
            ngroups=case.ngroups, dstate=case.dstate, d_nonssm=case.d_nonssm, seq_idx=seq_idx,
            dt_limit=case.dt_limit_or_default, rmsnorm_eps=case.rmsnorm_eps, norm_before_gate=case.norm_before_gate)
    if case.entry == "chunk_scan":
        res = scan(tensors["x"], tensors["dt"], tensors["A"], tensors["B"], tensors["C"],
                   chunk_size=case.chunk_size, D=tensors.get("D"), z=tensors.get("z"),
                   dt_bias=tensors.get("dt_bias"), dt_softplus=case.dt_softplus,
                   dt_limit=case.dt_limit_or_default, initial_states=tensors.get("initial_states"),
                   seq_idx=seq_idx)
        if case.segments is not None and case.batch == 1 and 0 in case.segments[0]:
            h0 = tensors.get("initial_states")
            zeros = torch.zeros(case.nheads, case.headdim, case.dstate, dtype=torch.float64, device=tensors["A"].device)
            res.outputs["varlen_states"] = with_empty_sequences(case, res.outputs["varlen_states"],
                                                                None if h0 is None else h0[0], zeros)
        return res
    return mixer.mixer(
        scan, MIXER_STYLE[name], tensors["zxbcdt"], tensors["conv1d_weight"], tensors["conv1d_bias"],
        tensors["dt_bias"], tensors["A"], tensors["D"], chunk_size=case.chunk_size, nheads=case.nheads,
        headdim=case.headdim, ngroups=case.ngroups, dstate=case.dstate, d_nonssm=case.d_nonssm,
        initial_states=tensors.get("initial_states"), seq_idx=seq_idx, dt_limit=case.dt_limit_or_default,
        activation=case.activation, rmsnorm_weight=tensors.get("rmsnorm_weight"), rmsnorm_eps=case.rmsnorm_eps,
        outproj_weight=tensors.get("outproj_weight"), outproj_bias=tensors.get("outproj_bias"),
        norm_before_gate=case.norm_before_gate)


def with_empty_sequences(case: Case, ends: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                         zeros: torch.Tensor) -> torch.Tensor:
    """The varlen states of every sequence of ``case``'s row, empty ones included (harness/truth/README.md,
    "Sequence boundaries"): ``ends`` (..., k, h, p, n), the states after the last token of each non-empty
    sequence in order (None when there is none), with each empty sequence's state put in its place, the state
    it starts from: ``initial_state`` (..., h, p, n) for the sequence numbered 0 when there is one, ``zeros``
    (..., h, p, n) otherwise."""
    found = iter(ends.unbind(-4) if ends is not None else ())
    first = lambda i: initial_state is not None and case.seq_idx_start + i == 0
    return torch.stack([next(found) if length else (initial_state if first(i) else zeros)
                        for i, length in enumerate(case.segments[0])], dim=-4)


def decode(scan, case: Case, tensors: dict) -> Evaluation:
    """The decoded tokens of a decode case by ``scan``, from the prefill's state: y (b, decode_steps, h, p) and
    the final state. No stages (a step kernel has none to compare)."""
    P = case.prefill_len
    cut = lambda name: tensors[name][:, P:] if name in tensors else None
    res = scan(cut("x"), cut("dt"), tensors["A"], cut("B"), cut("C"), chunk_size=case.chunk_size, D=tensors.get("D"),
               z=cut("z"), dt_bias=tensors.get("dt_bias"), dt_softplus=case.dt_softplus,
               dt_limit=case.dt_limit_or_default, initial_states=tensors["state"])
    return Evaluation({"y": res.outputs["y"], "final_states": res.outputs["final_states"]})


def evaluate(case: Case, inputs, name: str = DEFAULT_ORACLE) -> Evaluation:
    """Evaluate oracle ``name`` on ``case``: outputs, stages, and (backward cases) input gradients."""
    tensors = inputs.float64(requires_grad=case.backward)

    def forward() -> Evaluation:
        res = call(name, case, tensors, inputs.seq_idx)
        return Evaluation(asked_outputs(case, res), stages=ordered_stages(res))

    return evaluate_graph(case, inputs, tensors, forward)


def asked_outputs(case: Case, res: Evaluation) -> dict:
    """The outputs of ``res`` that ``case`` asks for: y, and final / varlen states when it returns them."""
    outputs = {"y": res.outputs["y"]}
    if case.return_final_states:
        outputs["final_states"] = res.outputs["final_states"]
    if case.varlen_states:
        outputs["varlen_states"] = res.outputs["varlen_states"]
    if case.entry == "mamba3" and case.return_final_states:
        outputs.update({name: res.outputs[name] for name in mamba3.STATE_OUTPUTS})
    return outputs


def ordered_stages(res: Evaluation) -> dict:
    """``res``'s stages and y, in STAGE_ORDER."""
    if not res.stages:
        return {}
    stages = {**res.stages, "y": res.outputs["y"]}
    return {k: stages[k] for k in STAGE_ORDER if k in stages}


__all__ = ["ORACLES", "DEFAULT_ORACLE", "Evaluation", "evaluate", "call", "asked_outputs", "ordered_stages",
           "STAGE_ORDER", "with_empty_sequences"]
