"""Materialize the tensors of a Case, deterministically.

Every value is drawn in float64 from ``case.seed``, rounded once to the dtype it is handed to implementations in,
and kept in float64 after that rounding. The oracle therefore sees exactly the numbers every implementation
sees. The numbers do not depend on the device. The drawing itself is `draw` (harness/inputs/drawing.py,
self-contained so that repro.py inlines it); this module builds a case's `Inputs` around it.

Dtypes follow how Mamba-2 is used: activations (x, dt, B, C, z, zxbcdt, the layer's input u) and the mixer's
and layer's weights in the case's dtype; A (the layer's A_log), D, dt_bias and initial_states in float32.

The layer entry draws its weights once, here, so every implementation is loaded with the same numbers: u (b, L,
d_model), in_proj (zxbcdt width, d_model) and its bias, the conv1d (and its bias), dt_bias, A_log = log(-A), D,
the norm's weight, out_proj (d_model, d_inner) and its bias. dt reaches the scan as in_proj's dt rows applied to
u, plus dt_bias: the rows are scaled so the pre-softplus dt sits where the regime wants it, as in the scan.

The mamba3_layer entry draws the Mamba3 module's weights likewise (harness/truth/README.md, "The Mamba3 module"): u,
in_proj (its rows z, x, B, C, dd_dt, dd_A, trap, angles), dt_bias, the B/C norms' weights, q_bias and k_bias, D,
the output norm's weight and out_proj.

The decode entry draws the chunk scan's values over the whole sequence; its step kernel starts from ``state``,
the state after the prefill (the float64 chunked oracle's final state over the first ``seqlen - decode_steps``
tokens, rounded once to ``case.state_dtype``: the prefill's rounding is no step kernel's error), and maps rows
to state slots through ``state_indices`` (a permutation drawn from the seed) when the case asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ssdiff.inputs.drawing import draw
from ssdiff.model.case import Case
from ssdiff.model.dtypes import TORCH_DTYPES

CHUNK_SCAN_DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
SPLIT_CONV1D_DIFFERENTIABLE = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "rmsnorm_weight",
                               "outproj_weight", "outproj_bias", "initial_states")
# The layer's input and every one of its parameters (A enters as A_log, A = -exp(A_log), as every layer holds it).
LAYER_DIFFERENTIABLE = ("u", "in_proj_weight", "in_proj_bias", "conv1d_weight", "conv1d_bias", "dt_bias", "A_log",
                        "D", "rmsnorm_weight", "outproj_weight", "outproj_bias")

# The Mamba3 module's input and every one of its parameters (harness/truth/mamba3_layer.py).
MAMBA3_LAYER_DIFFERENTIABLE = ("u", "in_proj_weight", "dt_bias", "k_norm_weight", "q_norm_weight", "k_bias", "q_bias",
                               "D", "rmsnorm_weight", "outproj_weight")
# The Mamba-3 scan's inputs (harness/truth/README.md, "Mamba-3"), each a leaf: the four input states too.
MAMBA3_DIFFERENTIABLE = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z", "init_angle",
                         "initial_states", "init_k", "init_v")


def differentiable_names(case: Case) -> tuple:
    """The inputs of ``case``'s entry point that have gradients."""
    if case.entry == "mamba3":
        return MAMBA3_DIFFERENTIABLE
    if case.entry == "mamba3_layer":
        return MAMBA3_LAYER_DIFFERENTIABLE
    if case.entry == "layer":
        return LAYER_DIFFERENTIABLE
    return CHUNK_SCAN_DIFFERENTIABLE if case.entry == "chunk_scan" else SPLIT_CONV1D_DIFFERENTIABLE


def seq_idx_rows(case: Case) -> Optional[torch.Tensor]:
    """seq_idx (b, L) int32 from the case's segments, gaps, padding and start, or None: sequence i of a row is
    numbered seq_idx_start + i (an empty one's number marks no token), a gap's and the padding's tokens -1."""
    if case.segments is None:
        return None
    padding = case.padding or (0,) * case.batch
    rows = []
    for row, (lengths, pad) in enumerate(zip(case.segments, padding)):
        gaps = (0, *case.gaps[row]) if case.gaps is not None else (0,) * len(lengths)
        ids = [t for i, (n, gap) in enumerate(zip(lengths, gaps)) for t in [-1] * gap + [case.seq_idx_start + i] * n]
        rows.append(ids + [-1] * pad)
    return torch.tensor(rows, dtype=torch.int32)


def cu_seqlens(case: Case) -> Optional[torch.Tensor]:
    """cu_seqlens (nseq + 1,) int32 for batch 1 (padding tokens belong to no sequence; an empty sequence repeats
    an offset)."""
    if case.segments is None or case.batch != 1:
        return None
    bounds = [0]
    for n in case.segments[0]:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32)


@dataclass
class Inputs:
    """The tensors of one Case.

    ``values``: name -> float64 tensor on ``device`` holding exactly the numbers implementations get
    (already rounded through their dtype). ``dtypes``: name -> the dtype implementations get it in.
    ``grad_outputs``: "y" and, when asked, "final_states" -> float64 cotangents (rounded like y / fp32).
    ``seq_idx`` / ``cu_seqlens`` are int32 (or None).
    """

    case: Case
    device: torch.device
    values: dict
    dtypes: dict
    grad_outputs: dict
    seq_idx: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    wide_order: tuple = field(default=())
    state_indices: Optional[torch.Tensor] = None       # decode: (b,) int32 state slot of each row, or None

    @property
    def differentiable(self) -> tuple:
        return tuple(n for n in differentiable_names(self.case) if n in self.values)

    def leaves(self, dtype: torch.dtype, requires_grad: bool = False) -> dict:
        """Fresh contiguous leaves of every value in ``dtype`` (the differentiable ones requiring grad when
        asked): what the oracles (float64) and the float32 model kernels compute on."""
        out = {}
        for name, value in self.values.items():
            t = value.to(dtype, copy=True)
            if requires_grad and name in self.differentiable:
                t.requires_grad_(True)
            out[name] = t
        return out

    def float64(self, requires_grad: bool = False) -> dict:
        """Fresh float64 leaves, optionally requiring grad, for the oracle."""
        return self.leaves(torch.float64, requires_grad)

    def native(self, requires_grad: bool = False, dtypes: Optional[dict] = None) -> dict:
        """Tensors in the dtypes implementations get, in the case's layout, on the device.

        With the "strided" layout x, B, C, dt, z are views of one wide tensor; differentiate with
        ``torch.autograd.grad(outputs, [tensors[n] for n in names])``, which works for views too.
        ``dtypes`` overrides the dtype of some inputs.
        """
        want = dict(self.dtypes, **(dtypes or {}))
        tensors = {}
        if self.wide_order:
            # One wide (b, L, W) tensor, sliced: the non-contiguous layout real mixers hand to the scan.
            case = self.case
            parts = [self.values[n].reshape(case.batch, case.seqlen, -1) for n in self.wide_order]
            wide = torch.cat(parts, dim=-1).to(want[self.wide_order[0]])
            if requires_grad:
                wide.requires_grad_(True)
            offset = 0
            for name, part in zip(self.wide_order, parts):
                width, rest = part.shape[-1], self.values[name].shape[2:]
                piece = wide[..., offset:offset + width]
                tensors[name] = piece.unflatten(-1, rest) if len(rest) > 1 else piece
                offset += width
        for name, value in self.values.items():
            if name in tensors:
                continue
            t = value.to(want[name])
            if requires_grad and name in self.differentiable:
                t.requires_grad_(True)
            tensors[name] = t
        return tensors


def materialize(case: Case, device: str | torch.device) -> Inputs:
    """Build the inputs of ``case`` on ``device`` (no default: where tensors live is the caller's choice,
    runtime.default_device() or a test's ``device`` fixture). Deterministic in (case, device)."""
    device = torch.device(device)
    vals, dtypes, grad_outputs = draw(case, device)
    r = case.regime

    state_indices = None
    if case.entry == "decode":
        # on the CPU, whatever the device: the state's numbers must not depend on where the oracle ran
        vals["state"] = prefill_state(case, {k: v.cpu() for k, v in vals.items()})
        dtypes["state"] = TORCH_DTYPES[case.state_dtype]
        if case.state_batch_indices:
            gen = torch.Generator().manual_seed(case.seed + 1)
            state_indices = torch.randperm(case.batch, generator=gen).to(torch.int32)

    wide_order = ()
    if r.layout == "strided" and case.entry in ("chunk_scan", "decode"):
        wide_order = tuple(name for name in ("z", "x", "B", "C", "dt") if name in vals)

    seq_idx = seq_idx_rows(case)
    cu = cu_seqlens(case) if case.varlen_states or case.entry in ("mamba3", "mamba3_layer") else None
    return Inputs(
        case=case,
        device=device,
        values={k: v.to(device) for k, v in vals.items()},
        dtypes=dtypes,
        grad_outputs={k: v.to(device) for k, v in grad_outputs.items()},
        seq_idx=seq_idx.to(device) if seq_idx is not None else None,
        cu_seqlens=cu.to(device) if cu is not None else None,
        wide_order=wide_order,
        state_indices=state_indices.to(device) if state_indices is not None else None,
    )


def prefill_state(case: Case, vals: dict) -> torch.Tensor:
    """The state (b, h, p, n) after the decode case's prefill (tokens [0, seqlen - decode_steps)) in float64,
    rounded once through ``case.state_dtype``: the float64 chunked oracle's final state (initial_states or zeros
    when the prefill is empty)."""
    from ssdiff.truth import chunked

    b, h, p, n = case.batch, case.nheads, case.headdim, case.dstate
    P = case.prefill_len
    h0 = vals.get("initial_states")
    if P == 0:
        state = h0 if h0 is not None else torch.zeros(b, h, p, n, dtype=torch.float64)
    else:
        cut = lambda name: vals[name][:, :P] if name in vals else None
        state = chunked.scan(cut("x"), cut("dt"), vals["A"], cut("B"), cut("C"), chunk_size=case.chunk_size,
                             dt_bias=vals.get("dt_bias"), dt_softplus=case.dt_softplus,
                             dt_limit=case.dt_limit_or_default, initial_states=h0).outputs["final_states"]
    return state.to(TORCH_DTYPES[case.state_dtype]).to(torch.float64)
