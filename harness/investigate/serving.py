"""Serving scenarios judged: the intermediate (prefix-cache) states of vLLM's varlen prefill, each against the
evidence of the case cut at its chunk end (ssdiff.sides.adapters.serving builds the scenarios)."""

from __future__ import annotations

import torch

from ssdiff.examine import Examiner
from ssdiff.inputs import Inputs
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.sides.adapters.serving import prefix_case, prefix_inputs
from ssdiff.verdict.judge import judge


def prefix_state_verdicts(examiner: Examiner, name: str, case: Case, inputs: Inputs, states: torch.Tensor,
                          metadata) -> list:
    """One verdict per logical chunk end: the states of the sequences ended so far (their last chunks') and of
    the one in progress (this chunk's) judged as the varlen states of the case cut there, against the evidence
    ``examiner`` assembles for that cut. ``case`` batch 1."""
    if case.batch != 1:
        raise ValueError(f"prefix_state_verdicts needs a batch-1 case, got batch={case.batch}")
    out = []
    last = list(metadata.last_chunk_indices)
    for chunk in range(metadata.nchunks):
        _, end = metadata.chunk_bounds(chunk)
        seq = metadata.seq_idx[chunk]
        sub = prefix_case(case, end)
        sub_inputs = prefix_inputs(inputs, sub)
        evidence = examiner.evidence(sub, sub_inputs)
        states_only = lambda ev: Evaluation(outputs={"varlen_states": ev.outputs["varlen_states"]})
        picked = [last[s] for s in range(seq)] + [chunk]
        actual = Evaluation(outputs={"varlen_states": states[picked]})
        verdict = judge(name, sub, sub_inputs, actual, states_only(evidence.truth),
                        [states_only(e) for e in evidence.baseline])
        verdict.notes.append(f"state at the end of logical chunk {chunk} (token {end}, sequence {seq})")
        out.append(verdict)
    return out


__all__ = ["prefix_state_verdicts"]
