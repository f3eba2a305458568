"""The checks behind the oracle properties, as plain functions of a Case (so the teeth tests can run the very
same checks against deliberately broken oracles)."""

from __future__ import annotations

import dataclasses

import torch

from ssdiff.model.case import Case
from ssdiff.inputs import materialize
from ssdiff.truth import ORACLES, call, evaluate
from ssdiff.tools.selfcheck import ATOL, RTOL, excess, relative

# Outputs and stages: rtol 1e-10 (float64 orders agree to ~1e-15). Gradients of A and dt_bias are sums over
# every token of terms that cancel (decay-free heads with dt > 20 give dL/dA ~ 20 from terms ~ 1e3), so they
# get rtol 1e-8: measured worst 3e-9 over 1,500 generated cases.
GRAD_RTOL = 1e-8


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, case: Case):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    over = excess(actual, expected, rtol, ATOL)
    assert over <= 1.0, (f"{name}: relative difference {relative(actual, expected):.3e}, {over:.3g}x the allowed "
                         f"(rtol {rtol:g}, atol {ATOL:g}) on {case.describe()}")


def oracles_agree(case: Case, device: str, inputs=None):
    """Every oracle matches ref.recurrent on every output, gradient and stage (on ``inputs``, else the case's
    own)."""
    inputs = materialize(case, device) if inputs is None else inputs
    base = evaluate(case, inputs, "ref.recurrent")
    for name in ORACLES:
        if name == "ref.recurrent":
            continue
        other = evaluate(case, inputs, name)
        assert set(other.outputs) == set(base.outputs), f"{name}: outputs {set(other.outputs)} != {set(base.outputs)}"
        for key, value in base.outputs.items():
            assert_close(f"{name} output {key}", other.outputs[key], value, RTOL, case)
        for key, value in base.stages.items():
            assert_close(f"{name} stage {key}", other.stages[key], value, RTOL, case)
        for key, value in base.grads.items():
            assert_close(f"{name} grad {key}", other.grads[key], value, GRAD_RTOL, case)


def dt_on_its_bounds(case: Case, device: str):
    """The case's inputs with some dt exactly on each bound of dt_limit (several chunks, every head), and the mask
    of those tokens: where a clamp's gradient convention shows (torch.clamp passes the gradient on a bound,
    torch.minimum / torch.maximum halve it). ``case`` has dt_limit, no dt_bias and no softplus, so that dt is
    the clamp's input."""
    assert case.dt_limit is not None and not case.has_dt_bias and not case.dt_softplus, case.describe()
    inputs = materialize(case, device)
    dt = inputs.values["dt"].clone()
    low, high = case.dt_limit
    dt[:, 3::5], dt[:, 2::7] = high, low
    values = dict(inputs.values, dt=dt)
    return dataclasses.replace(inputs, values=values), (dt == high) | (dt == low)


def run_on(name: str, case: Case, tensors: dict, seq_idx=None):
    """Oracle ``name`` on explicit float64 tensors (for laws that edit inputs)."""
    return call(name, case, tensors, seq_idx)


# ---- metamorphic laws: each holds for every oracle ---------------------------------------------------------

TOKEN_TENSORS = {"chunk_scan": ("x", "dt", "B", "C", "z"), "split_conv1d": ("zxbcdt",)}


def forward_only(case: Case, **changes) -> Case:
    return case.replace(pass_="forward", final_state_grad=False, **changes)


def slice_tokens(case: Case, tensors: dict, row: int, start: int, end: int, keep_initial: bool) -> dict:
    """The inputs of batch row ``row``, tokens [start, end), as a batch-1 problem."""
    out = {}
    for name, t in tensors.items():
        if name in TOKEN_TENSORS[case.entry]:
            out[name] = t[row:row + 1, start:end]
        elif name == "initial_states":
            if keep_initial:
                out[name] = t[row:row + 1]
        else:
            out[name] = t
    return out


def chunk_size_invariance(case: Case, device: str, other_chunk_size: int):
    """Outputs and gradients do not depend on the chunk size."""
    inputs = materialize(case, device)
    other = case.replace(chunk_size=other_chunk_size)
    for name in ORACLES:
        a, b = evaluate(case, inputs, name), evaluate(other, inputs, name)
        for key in a.outputs:
            assert_close(f"{name} {key} at chunk_size {other_chunk_size}", b.outputs[key], a.outputs[key], RTOL, case)
        for key in a.grads:
            assert_close(f"{name} grad {key} at chunk_size {other_chunk_size}", b.grads[key], a.grads[key],
                         GRAD_RTOL, case)


def packed_equals_separate(case: Case, device: str):
    """Sequences packed with seq_idx give the outputs (and end states) of each sequence run alone."""
    case = forward_only(case)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    padding = case.padding or (0,) * case.batch
    for name in ORACLES:
        packed = call(name, case, tensors, inputs.seq_idx)
        ends = []
        for row, lengths in enumerate(case.segments):
            start = 0
            for k, n in enumerate(lengths):
                first = k == 0 and case.seq_idx_start == 0 and case.initial_states
                alone_case = case.replace(batch=1, seqlen=n, segments=None, padding=None, seq_idx_start=0,
                                          varlen_states=False, initial_states=first)
                alone = call(name, alone_case, slice_tokens(case, tensors, row, start, start + n, first), None)
                assert_close(f"{name} y of row {row} sequence {k} (tokens {start}:{start + n}) packed vs alone",
                             packed.y[row:row + 1, start:start + n], alone.y, RTOL, case)
                ends.append(alone.final_states[0])
                start += n
            if padding[row] == 0:
                assert_close(f"{name} final state of row {row} packed vs its last sequence alone",
                             packed.final_states[row], ends[-1], RTOL, case)
        if case.batch == 1 and packed.varlen_states is not None:
            assert_close(f"{name} varlen states vs each sequence alone", packed.varlen_states, torch.stack(ends),
                         RTOL, case)


def state_continuation(case: Case, device: str, split: int):
    """Running [0, split) then [split, L) from the first part's final state equals one run (chunk_scan)."""
    case = forward_only(case, return_final_states=True)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    first_case = case.replace(seqlen=split)
    second_case = case.replace(seqlen=case.seqlen - split, initial_states=True)
    for name in ORACLES:
        whole = call(name, case, tensors, None)
        first_part = {k: (v[:, :split] if k in TOKEN_TENSORS["chunk_scan"] else v) for k, v in tensors.items()}
        second_part = {k: (v[:, split:] if k in TOKEN_TENSORS["chunk_scan"] else v) for k, v in tensors.items()}
        first = call(name, first_case, first_part, None)
        second_part["initial_states"] = first.final_states
        second = call(name, second_case, second_part, None)
        assert_close(f"{name} y split at {split}", torch.cat([first.y, second.y], dim=1), whole.y, RTOL, case)
        assert_close(f"{name} final state split at {split}", second.final_states, whole.final_states, RTOL, case)


def group_broadcast(case: Case, device: str):
    """ngroups = g equals ngroups = nheads with B and C repeat-interleaved to every head (chunk_scan)."""
    case = forward_only(case)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    per_head = dict(tensors)
    for key in ("B", "C"):
        per_head[key] = tensors[key].repeat_interleave(case.heads_per_group, dim=2)
    for name in ORACLES:
        grouped = call(name, case, tensors, inputs.seq_idx)
        expanded = call(name, case.replace(ngroups=case.nheads), per_head, inputs.seq_idx)
        assert_close(f"{name} y with ngroups={case.ngroups} vs expanded", expanded.y, grouped.y, RTOL, case)
        assert_close(f"{name} final states with ngroups={case.ngroups} vs expanded", expanded.final_states,
                     grouped.final_states, RTOL, case)


def batch_independence(case: Case, device: str):
    """Each batch row computed alone equals its row of the batched run."""
    case = forward_only(case, varlen_states=False)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    for name in ORACLES:
        batched = call(name, case, tensors, inputs.seq_idx)
        for row in range(case.batch):
            row_case = case.replace(batch=1, segments=None if case.segments is None else (case.segments[row],),
                                    padding=None if case.padding is None else (case.padding[row],))
            alone = call(name, row_case, slice_tokens(case, tensors, row, 0, case.seqlen, case.initial_states),
                         None if inputs.seq_idx is None else inputs.seq_idx[row:row + 1])
            assert_close(f"{name} row {row} alone vs batched", alone.y, batched.y[row:row + 1], RTOL, case)
            assert_close(f"{name} final state of row {row} alone vs batched", alone.final_states,
                         batched.final_states[row:row + 1], RTOL, case)


def d_broadcast(case: Case, device: str):
    """D of shape (h,) equals D of shape (h, p) holding the same value on every channel."""
    case = forward_only(case, D="head")
    inputs = materialize(case, device)
    tensors = inputs.float64()
    per_channel = dict(tensors, D=tensors["D"][:, None].expand(case.nheads, case.headdim).contiguous())
    for name in ORACLES:
        a = call(name, case, tensors, inputs.seq_idx)
        b = call(name, case.replace(D="channel"), per_channel, inputs.seq_idx)
        assert_close(f"{name} y with D (h,) vs D (h, p)", b.y, a.y, RTOL, case)


def padding_is_inert(case: Case, device: str, noise_seed: int):
    """Changing the inputs of padding tokens (seq_idx = -1) changes nothing but their own outputs."""
    case = forward_only(case)
    inputs = materialize(case, device)
    tensors = inputs.float64()
    pad_mask = (inputs.seq_idx < 0)                                   # (b, L)
    gen = torch.Generator().manual_seed(noise_seed)
    noisy = dict(tensors)
    for key in TOKEN_TENSORS[case.entry]:
        if key in tensors:
            t = tensors[key]
            noise = torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) * 3   # same on any device
            m = pad_mask.reshape(pad_mask.shape + (1,) * (t.dim() - 2))
            noisy[key] = torch.where(m, t + noise, t)
    keep = ~pad_mask
    for name in ORACLES:
        a = call(name, case, tensors, inputs.seq_idx)
        b = call(name, case, noisy, inputs.seq_idx)
        assert_close(f"{name} y of real tokens after changing padding tokens", b.y[keep], a.y[keep], RTOL, case)
        assert_close(f"{name} final states after changing padding tokens", b.final_states, a.final_states, RTOL, case)
        if a.varlen_states is not None:
            assert_close(f"{name} varlen states after changing padding tokens", b.varlen_states, a.varlen_states,
                         RTOL, case)
