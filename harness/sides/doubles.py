"""Test doubles: implementations with known behaviour, for testing the verdict, localization and fuzz.

They live in the package (not in a test file) because `ssdiff fuzz --isolate` runs implementations in a child
process that must import them. They are not registered: name one as ``ssdiff.sides.doubles:NAME`` (the fuzz CLI
and ssdiff.sides.runner resolve that form), e.g. ``ssdiff fuzz --impl ssdiff.sides.doubles:group_bug``.

- `ToyKernel`: a chunked SSD computed chunk by chunk in float32 (chunk_scan entry; every feature), exposing every
  stage of the pipeline. With ``bug=`` one planted mistake:
    "group_index"   chunk states take B from group ``head % ngroups`` instead of ``head // (nheads/ngroups)``;
    "no_reset"      the state passed between chunks does not reset where seq_idx changes;
    "partial_mask"  in the last, partial chunk the causal mask lets each token see the next one;
    "padding_leak"  padding tokens (seq_idx = -1) are computed as one more sequence: they add to the state and the
                    final state, and their inputs receive gradients (no handling of -1 at all);
    "row_leak"      every row's y but the first gets 2^-10 of the first row's (rows share a buffer);
    "drop_initial_states"  the initial states are ignored (every row starts from zero);
    "offset_wrap"   x's element i past huge.HUGE_ELEMENTS is read from i - HUGE_ELEMENTS (a 32-bit offset that
                    overflows at 2**31; harness/inputs/huge.py, whose threshold a test lowers to a small case's size).
    "strided_offset_wrap"  x read through the strides it is handed, its element offsets b s_b + t s_t + h s_h +
                    p s_p computed in 32 bits: an offset at or past STRIDED_WRAP reads the element STRIDED_WRAP
                    before it in x's storage (for a strided x, the wide tensor it is a view of). It models where
                    an int32 stride product overflows — a view's offsets reach STRIDED_WRAP long before its element
                    count does — not how: a real overflow wraps negative and reads before the tensor, the double
                    stays inside the storage so its reads are defined. Forward values only (gradients as if right).
    "empty_sequence"  empty sequences ignored: seq_idx renumbered densely over the non-empty sequences (so the
                    initial state feeds the first of them even where an empty sequence numbered 0 took it), and a
                    varlen state read at token cu_seqlens[i + 1] - 1 (clamped at 0) whatever sequence holds it (an
                    empty sequence gets its predecessor's state): the mistakes of a kernel that numbers sequences
                    by their tokens and finds a sequence's end as the token before the next one's start.
  A tuple plants several (``group_and_padding_bugs``: two causes in one kernel).
- `Slow`: a toy kernel with a planted bug whose every run first sleeps: a divergence that minimizes slowly.
- `ToyMixer`: the fused mixer around the same scan; ``bug="norm_whole_dim"`` normalizes over all of dim
  instead of per group (the bug of mamba_split_conv1d_scan_ref, seed 000).
- `ToyLayer`: the whole Mamba-2 layer in float32 (layer entry): in_proj, then the toy mixer; ``bug=
  "norm_whole_dim"`` puts its gated RMSNorm over the wrong group size (all of d_ssm instead of d_ssm // ngroups).
- `LowPrecisionOracle`: one of the float64 oracles' math run in float32, results in the dtypes a kernel
  returns them in: a healthy implementation for measuring false alarms.
- `StepKernel`: the decode entry's step recurrence in float32, one token at a time (the state kept in its
  dtype between steps), as a selective-state-update kernel computes it. With ``bug=`` one planted mistake:
    "no_decay"      the state is not decayed before the update (state + dt B x instead of exp(dt A) state + ...);
    "group_heads"   each head reads B and C from group ``head % ngroups`` instead of ``head // (nheads/ngroups)``.
- `Mamba3Kernel`: the Mamba-3 SISO scan in float32 (mamba3 entry): chunks within each sequence with the carried
  state and angle (reduced mod 2 pi between chunks and steps), then the step recurrence for ``mamba3_steps`` tokens from the prefill's four states, as
  mamba3_siso_combined and mamba3_siso_step divide the work. With ``bug=`` one planted mistake:
    "trap_shift"    the trapezoid's second weight taken from the token itself, dt_s (1 - lambda_s), instead of the
                    next one's, dt_s+1 (1 - lambda_s+1) (a weight off by one token);
    "angle_restart" the angle cumsum restarts at each chunk (the carried angle dropped past the first);
    "step_drops_k"  each step forgets the K state it carries (the previous token's rotated k read as zero);
    "angle_state_in_dtype"  the prefill's angle state rounded to the case dtype, returned and stepped from so (as
                    mamba_ssm's combined kernel returns it in bf16).
  Its steps follow the step kernel's order (the state updated, then y = S q~), not the oracle's.
- `Mamba3Layer`: the Mamba3 module (SISO, mamba3_layer entry) in float32 around `Mamba3Kernel`'s scan. With ``bug=``:
    "bc_norm_over_groups"  the B and C norms over all ngroups * d_state channels at once instead of per B/C head;
    "step_drops_k"  the steps of ``layer_steps`` forget the K state (the scan double's bug).
- `DotSensitive`: the toy kernel with y off by 10% unless TRITON_F32_DEFAULT=ieee in its process (what TF32's loss
  looks like to the TF32 replay).
- `Misbehaving`: calls os.abort(), sleeps forever, raises, or runs out of device memory — optionally only when
  ngroups > 1 — to test that crash / hang / error become verdicts under --isolate and the run goes on, and
  that running out of memory is no verdict (the case is skipped and counted).
- `ConfigBug` / `TilingBug`: the toy kernel through an autotuned Triton kernel that is wrong in one config
  always (`config_bug`), or only where headdim crosses that config's block size of 32 (`tiling_bug`).
- `chunked_prefill_without_state`: vLLM's real prefill kernel driven by a chunked-prefill runner that forgets
  the carried state (ssdiff.sides.adapters.serving.ChunkedPrefill with carry=False); made on first use, so that importing
  this module loads nothing of vLLM.
"""

from __future__ import annotations

import math
import os
import time
import types

import torch
import torch.nn.functional as F

from ssdiff import truth
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation, evaluate_graph
from ssdiff.sides.base import Capabilities, Implementation
from ssdiff.inputs import Inputs
from ssdiff.model.dtypes import torch_dtype
from ssdiff.truth import mamba3
from ssdiff.truth.chunked import process_dt
from ssdiff.truth.mixer import conv_vectorized, norm_vectorized

BUGS = (None, "group_index", "no_reset", "partial_mask", "row_leak", "drop_initial_states", "offset_wrap",
        "empty_sequence", "strided_offset_wrap", "padding_leak")
# Where the "strided_offset_wrap" double's 32-bit element offsets overflow: 2**31, as on a GPU; a test lowers it
# to a small case's size (below every contiguous x the CPU search draws, above many strided ones).
STRIDED_WRAP = 2 ** 31
STAGES = ("dt", "dA_cumsum", "chunk_states", "passed_states", "CB", "scan", "skip", "gated", "y")


def toy_scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, bug=None):
    """A chunk-at-a-time SSD scan on float32 tensors. Returns (y, final_states, stages). ``bug``: one of BUGS, or a
    tuple of them (each planted)."""
    bugs = set(bug) if isinstance(bug, tuple) else {bug}
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Q = chunk_size
    c = -(-L // Q)
    r = h // g
    dev = x.device
    head_group = torch.arange(h, device=dev) // r
    state_group = torch.arange(h, device=dev) % g if "group_index" in bugs else head_group
    d = process_dt(dt, dt_bias, dt_softplus, dt_limit)                       # (b, L, h)
    seq = seq_idx.long() if seq_idx is not None else torch.zeros(b, L, dtype=torch.long, device=dev)

    state = initial_states if initial_states is not None else x.new_zeros(b, h, p, n)
    prev_last = torch.zeros(b, dtype=torch.long, device=dev)                 # initial states feed sequence 0
    ys, cs_all, chunk_states, passed, CBs = [], [], [], [], []
    for k in range(c):
        s, e = k * Q, min(L, (k + 1) * Q)
        q = e - s
        dk, xk, sk = d[:, s:e], x[:, s:e], seq[:, s:e]                       # (b, q, h), (b, q, h, p), (b, q)
        Bk, Ck = B[:, s:e], C[:, s:e]                                        # (b, q, g, n)
        cs = torch.cumsum(dk * A, dim=1)                                     # (b, q, h)
        real = (sk >= 0) | ("padding_leak" in bugs)                          # (b, q)
        CB = torch.einsum("bign,bjgn->bgij", Ck, Bk)                        # (b, g, q, q)
        CBs.append(F.pad(CB, (0, Q - q, 0, Q - q)))
        causal = torch.tril(torch.ones(q, q, dtype=torch.bool, device=dev),
                            diagonal=1 if ("partial_mask" in bugs and q < Q) else 0)
        same = (sk[:, :, None] == sk[:, None, :]) & real[:, :, None] & real[:, None, :]
        allowed = (causal & same)[:, None]                                   # (b, 1, i, j)
        # Like Mamba-2: exp(cs_i - cs_j) forward, the gradient through the direct segment sum (stable).
        dA = (dk * A).transpose(1, 2)                                        # (b, h, q)
        later = torch.tril(torch.ones(q, q, dtype=torch.bool, device=dev), diagonal=-1)
        direct = torch.cumsum(torch.where(later, dA[..., :, None], torch.zeros((), dtype=dA.dtype, device=dev)),
                              dim=-2)                                        # (b, h, i, j)
        seg = direct + (cs.transpose(1, 2)[:, :, :, None] - cs.transpose(1, 2)[:, :, None, :] - direct).detach()
        decay = torch.exp(torch.where(allowed, seg, torch.full_like(seg, -math.inf)))
        scores = CB[:, head_group] * decay                                   # (b, h, i, j)
        y_diag = torch.einsum("bhij,bjh,bjhp->bihp", scores, dk, xk)

        last = sk[:, -1]
        own = (sk == last[:, None]) & real                                   # (b, q)
        to_end = torch.exp(seg[:, :, -1, :]).transpose(1, 2) * own[..., None]   # (b, q, h)
        local = torch.einsum("bjh,bjh,bjhp,bjhn->bhpn", to_end, dk, xk, Bk[:, :, state_group])
        chunk_states.append(local)
        passed.append(state)
        reaches = (sk == prev_last[:, None]) & real                          # (b, q)
        y_off = torch.einsum("bihn,bhpn->bihp", Ck[:, :, head_group], state) * \
            (torch.exp(cs) * reaches[..., None])[..., None]
        ys.append(y_diag + y_off)
        cs_all.append(cs)
        survives = (last >= 0) if "no_reset" in bugs else (last == prev_last) & (last >= 0)
        state = (torch.exp(cs[:, -1]) * survives[:, None])[..., None, None] * state + local
        prev_last = last
    y = torch.cat(ys, dim=1)
    stages = {"dt": d, "dA_cumsum": torch.cat(cs_all, dim=1), "chunk_states": torch.stack(chunk_states, dim=1),
              "passed_states": torch.stack(passed, dim=1), "CB": torch.stack(CBs, dim=1), "scan": y}
    if D is not None:
        y = y + (D[:, None] if D.dim() == 1 else D) * x
        stages["skip"] = y
    if z is not None:
        y = y * F.silu(z)
        stages["gated"] = y
    return y, state, stages


class _Float32Implementation(Implementation):
    """Runs ``compute(case, leaves, inputs) -> (outputs, stages)`` in float32 and returns what a kernel would:
    y in the case dtype, states in float32, gradients in their inputs' dtypes."""

    def compute(self, case: Case, t: dict, inputs: Inputs):
        raise TypeError(f"{type(self).__name__} must define compute()")

    def run(self, case: Case, inputs: Inputs, want_stages: bool = False) -> Evaluation:
        leaves = inputs.leaves(torch.float32, requires_grad=case.backward)

        def forward() -> Evaluation:
            outputs, stages = self.compute(case, leaves, inputs)
            outputs["y"] = outputs["y"].to(torch_dtype(case))
            return Evaluation(outputs, stages=stages if want_stages else {})

        result = evaluate_graph(case, inputs, leaves, forward)
        result.grads = {k: v.to(inputs.dtypes[k]) for k, v in result.grads.items()}
        return result


# The scan's inputs whose first axis is the batch row.
_BATCH_LEADING = ("x", "dt", "B", "C", "z", "initial_states")


class ToyKernel(_Float32Implementation):
    def __init__(self, bug=None):
        bugs = bug if isinstance(bug, tuple) else (bug,) if bug else ()
        if any(b not in BUGS[1:] for b in bugs) or (isinstance(bug, tuple) and not bug):
            raise ValueError(f"bug must be one of {BUGS} or a tuple of them, got {bug!r}")
        self.bug, self.bugs = bug, frozenset(bugs)
        self.name = f"double.toy{''.join('.' + b for b in bugs)}"
        self.description = f"toy chunked float32 SSD{' with planted bugs: ' + ', '.join(bugs) if bugs else ''}"
        self.capabilities = Capabilities(dtypes=frozenset({"float32", "float16", "bfloat16"}), stages=STAGES)

    def compute(self, case, t, inputs):
        # Each batch row on its own, as a kernel's programs compute it, so that the double is batch-invariant bit
        # for bit on every device (torch's batched products on a GPU choose their algorithm by the batch size).
        if "offset_wrap" in self.bugs:
            t = dict(t, x=_wrapped(t["x"]))
        if "strided_offset_wrap" in self.bugs:
            t = dict(t, x=_strided_wrapped(t["x"], inputs))
        rows = []
        for r in range(t["x"].shape[0]):
            row = {k: (v[r:r + 1] if k in _BATCH_LEADING and v is not None else v) for k, v in t.items()}
            rows.append(toy_scan(row["x"], row["dt"], row["A"], row["B"], row["C"], chunk_size=case.chunk_size,
                                 D=row.get("D"), z=row.get("z"), dt_bias=row.get("dt_bias"),
                                 dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
                                 initial_states=None if "drop_initial_states" in self.bugs else
                                 row.get("initial_states"),
                                 seq_idx=None if inputs.seq_idx is None else
                                 self._seq_idx(case, inputs.seq_idx[r:r + 1]), bug=self.bug))
        y, final = (torch.cat([row[i] for row in rows]) for i in (0, 1))
        stages = {name: torch.cat([row[2][name] for row in rows]) for name in rows[0][2]}
        if "row_leak" in self.bugs and y.shape[0] > 1:
            y = torch.cat([y[:1], y[1:] + 2.0 ** -10 * y[:1]])
        outputs = {"y": y}
        if case.return_final_states:
            outputs["final_states"] = final
        if case.varlen_states:
            outputs["varlen_states"] = self._varlen_states(case, t, inputs)
        stages["y"] = y
        return outputs, stages

    def _seq_idx(self, case, seq_idx):
        """The row's seq_idx as the scan sees it: as given, or (the planted bug) renumbered densely from
        seq_idx_start, as if built from the row's non-empty sequences alone."""
        if "empty_sequence" not in self.bugs:
            return seq_idx
        numbers = sorted(set(seq_idx[seq_idx >= 0].tolist()))
        dense = {old: case.seq_idx_start + rank for rank, old in enumerate(numbers)}
        return torch.tensor([[dense.get(v, -1) for v in seq_idx[0].tolist()]], dtype=seq_idx.dtype,
                            device=seq_idx.device)

    def _varlen_states(self, case, t, inputs):
        """One state per sequence of the (batch-1) row: the final state of the scan over the tokens up to the
        sequence's last, or for an empty sequence the state it starts from (the planted bug reads token
        cu_seqlens[i + 1] - 1 there too)."""
        cu = inputs.cu_seqlens.tolist()
        h0 = t.get("initial_states")
        out = []
        for i, (start, end) in enumerate(zip(cu, cu[1:])):
            if end == start and "empty_sequence" not in self.bugs:
                first = h0 is not None and case.seq_idx_start + i == 0
                out.append(h0[0] if first else t["x"].new_zeros(case.nheads, case.headdim, case.dstate))
                continue
            last = max(end - 1, 0)                              # a masked load's offset, clamped at the start
            cut = {k: (v[:, :last + 1] if k in _BATCH_LEADING and k != "initial_states" and v is not None else v)
                   for k, v in t.items()}
            _, state, _ = toy_scan(cut["x"], cut["dt"], cut["A"], cut["B"], cut["C"], chunk_size=case.chunk_size,
                                   dt_bias=cut.get("dt_bias"), dt_softplus=case.dt_softplus,
                                   dt_limit=case.dt_limit_or_default, initial_states=h0,
                                   seq_idx=self._seq_idx(case, inputs.seq_idx[:, :last + 1]))
            out.append(state[0])
        return torch.stack(out)


def _strided_wrapped(x: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """x as the "strided_offset_wrap" double reads it (see the module docstring): the case's native x (a view
    of the wide tensor when the layout is strided) indexed through its own strides, offsets past STRIDED_WRAP
    moved back by STRIDED_WRAP."""
    native = inputs.native(dtypes={name: torch.float32 for name in inputs.dtypes})["x"].detach()
    storage = torch.empty(0, dtype=torch.float32, device=native.device).set_(native.untyped_storage())
    offsets = native.storage_offset() + sum(
        torch.arange(size, device=native.device).reshape([-1 if d == i else 1 for d in range(native.dim())]) * stride
        for i, (size, stride) in enumerate(zip(native.shape, native.stride())))
    wrapped = offsets >= STRIDED_WRAP
    if not bool(wrapped.any()):
        return x
    read = storage[torch.where(wrapped, offsets - STRIDED_WRAP, offsets)]
    return x + (read - x).detach()


class Slow(ToyKernel):
    """The toy kernel with ``bug`` whose every run first sleeps ``seconds``: each minimization candidate costs at
    least that, so a campaign's post-processing bound ends its minimization early."""

    def __init__(self, bug="group_index", seconds=0.5):
        super().__init__(bug)
        self.seconds = seconds
        self.name = f"double.slow.{bug}"
        self.description = f"{self.description}, sleeping {seconds:g} s a run"

    def run(self, case: Case, inputs: Inputs, want_stages: bool = False) -> Evaluation:
        time.sleep(self.seconds)
        return super().run(case, inputs, want_stages)


def _wrapped(x: torch.Tensor) -> torch.Tensor:
    """x as a kernel whose element offsets wrap at huge.HUGE_ELEMENTS reads it: element i past that from
    i - HUGE_ELEMENTS (a 32-bit offset's overflow, scaled down where a test lowers the threshold)."""
    from ssdiff.inputs import huge

    flat = x.contiguous().flatten().clone()
    wrap = huge.HUGE_ELEMENTS
    if flat.numel() > wrap:
        flat[wrap:] = flat[:flat.numel() - wrap].clone()
    return flat.reshape(x.shape)


class ToyMixer(_Float32Implementation):
    """The fused mixer in float32 (conv1d -> the toy scan -> gated RMSNorm -> out_proj), computed with none of the
    budget's model (harness/budget/): the oracle's conv and norm, and `toy_scan`, evaluated in float32; judged
    against that budget it measures the budget, not the model against itself."""

    def __init__(self, bug=None):
        if bug not in (None, "norm_whole_dim"):
            raise ValueError(f"bug must be None or 'norm_whole_dim', got {bug!r}")
        self.bug = bug
        self.name = f"double.mixer{'.' + bug if bug else ''}"
        self.description = f"toy float32 fused mixer{' with a planted bug: ' + bug if bug else ''}"
        self.capabilities = Capabilities(entries=frozenset({"split_conv1d"}),
                                         stages=("conv", "dt", "dA_cumsum", "chunk_states", "passed_states", "CB",
                                                 "scan", "skip", "normed", "y"))

    def compute(self, case, t, inputs):
        h, p, g, n, dim = case.nheads, case.headdim, case.ngroups, case.dstate, case.dim
        b, L, _ = t["zxbcdt"].shape
        zx0, z, xBC, dt = torch.split(t["zxbcdt"], [2 * case.d_nonssm, dim, dim + 2 * g * n, h], dim=-1)
        seq = inputs.seq_idx.long() if inputs.seq_idx is not None else torch.zeros(b, L, dtype=torch.long,
                                                                                 device=xBC.device)
        conv = conv_vectorized(xBC, t["conv1d_weight"], t["conv1d_bias"], seq, case.activation)
        x, B, C = torch.split(conv, [dim, g * n, g * n], dim=-1)
        rms = t.get("rmsnorm_weight")
        y, final, stages = toy_scan(
            x.unflatten(-1, (h, p)), dt, t["A"], B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)),
            chunk_size=case.chunk_size, D=t["D"], z=None if rms is not None else z.unflatten(-1, (h, p)),
            dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=case.dt_limit_or_default,
            initial_states=t.get("initial_states"), seq_idx=inputs.seq_idx)
        stages = {"conv": conv, **stages}
        y = y.flatten(-2)
        if rms is not None:
            y = norm_vectorized(y, z, rms, 1 if self.bug == "norm_whole_dim" else g, case.rmsnorm_eps,
                                case.norm_before_gate)
        if case.d_nonssm:
            first, second = zx0.split(case.d_nonssm, dim=-1)
            y = torch.cat([F.silu(first) * second, y], dim=-1)
        if rms is not None or case.d_nonssm:
            stages["normed"] = y
        if "outproj_weight" in t:
            y = F.linear(y, t["outproj_weight"], t.get("outproj_bias"))
        stages["y"] = y
        outputs = {"y": y}
        if case.return_final_states:
            outputs["final_states"] = final
        return outputs, stages


LAYER_BUGS = {"norm_whole_dim": "gated RMSNorm over all of d_ssm",
              "decode_drops_D": "decoded tokens (layer_steps) without the D skip"}


class ToyLayer(_Float32Implementation):
    """The Mamba-2 layer in float32: zxbcdt = in_proj(u), A = -exp(A_log), then `ToyMixer` (its bug too). A layer
    is causal, so it "decodes" (layer_steps) by computing the whole sequence; ``bug="decode_drops_D"`` takes the
    decoded tokens from a run with D = 0."""

    def __init__(self, bug=None):
        if bug is not None and bug not in LAYER_BUGS:
            raise ValueError(f"bug must be None or one of {sorted(LAYER_BUGS)}, got {bug!r}")
        self.mixer = ToyMixer(bug if bug == "norm_whole_dim" else None)
        self.bug = bug
        self.name = f"double.layer{'.' + bug if bug else ''}"
        self.description = f"toy float32 Mamba-2 layer{' with a planted bug: ' + LAYER_BUGS[bug] if bug else ''}"
        self.capabilities = Capabilities(entries=frozenset({"layer"}), stages=("in_proj",) + self.mixer.capabilities.stages)

    def compute(self, case, t, inputs):
        zxbcdt = F.linear(t["u"], t["in_proj_weight"], t.get("in_proj_bias"))
        bias = t.get("conv1d_bias")
        mixer_t = dict(t, zxbcdt=zxbcdt, A=-torch.exp(t["A_log"]),
                       conv1d_bias=bias if bias is not None else zxbcdt.new_zeros(t["conv1d_weight"].shape[0]))
        outputs, stages = self.mixer.compute(case, mixer_t, inputs)
        y = outputs["y"]
        if self.bug == "decode_drops_D" and case.layer_steps:
            without_D, _ = self.mixer.compute(case, dict(mixer_t, D=torch.zeros_like(t["D"])), inputs)
            y = torch.cat([y[:, :case.seqlen - case.layer_steps], without_D["y"][:, case.seqlen - case.layer_steps:]],
                          dim=1)
        return {"y": y}, {"in_proj": zxbcdt, **stages}


class LowPrecisionOracle(_Float32Implementation):
    """A float64 oracle's math evaluated in float32 (healthy; for measuring false alarms)."""

    def __init__(self, oracle_name: str):
        self.oracle_name = oracle_name
        self.name = f"double.{oracle_name.split('.')[-1]}_fp32"
        self.description = f"{oracle_name}'s math computed in float32"
        self.capabilities = Capabilities(entries=frozenset({"chunk_scan", "split_conv1d"}), stages=truth.STAGE_ORDER)

    def compute(self, case, t, inputs):
        res = truth.call(self.oracle_name, case, t, inputs.seq_idx)
        return truth.asked_outputs(case, res), truth.ordered_stages(res)


STEP_BUGS = (None, "no_decay", "group_heads")


class StepKernel(_Float32Implementation):
    """The decode step kernel in float32 (decode entry; forward only)."""

    def __init__(self, bug=None):
        if bug not in STEP_BUGS:
            raise ValueError(f"bug must be one of {STEP_BUGS}, got {bug!r}")
        self.bug = bug
        self.name = f"double.step{'.' + bug if bug else ''}"
        self.description = f"float32 decode step kernel{' with a planted bug: ' + bug if bug else ''}"
        self.capabilities = Capabilities(entries=frozenset({"decode"}), backward=False)

    def compute(self, case, t, inputs):
        h, g = case.nheads, case.ngroups
        P = case.prefill_len
        heads = torch.arange(h, device=t["x"].device)
        group = heads % g if self.bug == "group_heads" else heads // (h // g)
        state_dtype = torch_dtype(case.replace(dtype=case.state_dtype))
        state = t["state"]
        D = t.get("D")
        ys = []
        for token in range(P, case.seqlen):
            d = process_dt(t["dt"][:, token], t.get("dt_bias"), case.dt_softplus, case.dt_limit_or_default)   # (b, h)
            x = t["x"][:, token]                                                     # (b, h, p)
            update = (d[..., None] * x)[..., None] * t["B"][:, token][:, group][:, :, None, :]
            decay = 1.0 if self.bug == "no_decay" else torch.exp(d * t["A"])[..., None, None]
            state = (decay * state + update).to(state_dtype).to(torch.float32)
            y = torch.einsum("bhpn,bhn->bhp", state, t["C"][:, token][:, group])
            if D is not None:
                y = y + (D[:, None] if D.dim() == 1 else D) * x
            if "z" in t:
                y = y * F.silu(t["z"][:, token])
            ys.append(y)
        outputs = {"y": torch.stack(ys, dim=1)}
        if case.return_final_states:
            outputs["final_states"] = state.to(state_dtype)
        return outputs, {}


MAMBA3_BUGS = (None, "trap_shift", "angle_restart", "step_drops_k", "angle_state_in_dtype")


def _turned(x, theta):
    """x (..., n) with pairs (2j, 2j + 1), j < a, turned by theta (..., a), as the kernels write it: even and odd
    lanes apart, cos and sin per pair; the other lanes as they are."""
    a = theta.shape[-1]
    even, odd = x[..., 0:2 * a:2], x[..., 1:2 * a:2]
    c, s = torch.cos(theta), torch.sin(theta)
    out = x.clone()
    out[..., 0:2 * a:2] = even * c - odd * s
    out[..., 1:2 * a:2] = even * s + odd * c
    return out


class Mamba3Kernel(_Float32Implementation):
    """The Mamba-3 SISO scan in float32, chunked, and stepped for the last ``mamba3_steps`` tokens."""

    def __init__(self, bug=None):
        if bug not in MAMBA3_BUGS:
            raise ValueError(f"bug must be one of {MAMBA3_BUGS}, got {bug!r}")
        self.bug = bug
        self.name = f"double.mamba3{'.' + bug if bug else ''}"
        self.description = f"float32 Mamba-3 SISO scan{' with a planted bug: ' + bug if bug else ''}"
        self.capabilities = Capabilities(entries=frozenset({"mamba3"}))

    def compute(self, case, t, inputs):
        b, L, h, p = t["v"].shape
        g, n, a = t["q"].shape[2], t["q"].shape[3], t["angles"].shape[3]
        heads = [i // (h // g) for i in range(h)]
        prefill = L - case.mamba3_steps
        ys, finals = t["v"].new_zeros(b, L, h, p), []
        for s, (row, lo, hi) in enumerate(mamba3.sequences(b, L, mamba3.bounds_of(case))):
            zeros = t["v"].new_zeros
            states = tuple(t[k][s] for k in mamba3.STATE_INPUTS) if case.initial_states else \
                (zeros(h, a), zeros(h, p, n), zeros(h, n), zeros(h, p))
            mid = max(lo, min(hi, prefill))
            for c0 in range(lo, mid, case.chunk_size):
                states = self._chunk(t, row, c0, min(mid, c0 + case.chunk_size), mid, states, heads, ys, c0 == lo)
            if self.bug == "angle_state_in_dtype" and mid > lo:      # the prefill's angle returned in the case dtype
                theta = torch.remainder(states[0], 2 * math.pi)
                states = (theta.to(torch_dtype(case)).to(theta.dtype),) + states[1:]
            for i in range(mid, hi):
                if self.bug == "step_drops_k":
                    states = states[:2] + (torch.zeros_like(states[2]), states[3])
                ys[row, i], states = self._step(t, row, i, states, heads)
                states = (torch.remainder(states[0], 2 * math.pi),) + states[1:]      # as the step kernel keeps it
            finals.append(states)
        y = ys + (t["D"][:, None] * t["v"] if "D" in t else 0.0)
        if "z" in t:
            y = y * F.silu(t["z"])
        outputs = {"y": y}
        if case.return_final_states:
            theta, S, k, v = (torch.stack(parts) for parts in zip(*finals))
            outputs.update(final_angle=torch.remainder(theta, 2 * math.pi), final_states=S, final_k=k,
                           final_v=v.to(torch_dtype(case)))
        return outputs, {}

    @staticmethod
    def _step(t, row, i, states, heads):
        """Token ``i`` of ``row`` as the step kernel takes it: the state updated first, then y = S q~ (the token's
        own term through its rotated k and q): (y before D and z, the four states after it)."""
        theta, S, k_prev, v_prev = states
        dt, lam = t["dt"][row, i], torch.sigmoid(t["trap"][row, i])
        theta = theta + torch.tanh(t["angles"][row, i]) * (math.pi * dt)[:, None]
        q = _turned(t["q"][row, i][heads] + t["q_bias"], theta)
        k = _turned(t["k"][row, i][heads] + t["k_bias"], theta)
        v = t["v"][row, i]
        alpha = torch.exp(t["adt"][row, i])
        carried = (alpha * dt * (1 - lam))[:, None, None] * v_prev[:, :, None] * k_prev[:, None, :]
        S = S * alpha[:, None, None] + carried + (dt * lam)[:, None, None] * v[:, :, None] * k[:, None, :]
        return (S * q[:, None, :]).sum(-1), (theta, S, k, v)

    def _chunk(self, t, row, c0, c1, end, states, heads, ys, first):
        """Tokens [c0, c1) of ``row`` (its sequence's prefill ends at ``end``) into ``ys``; the states after them."""
        theta, S, k_prev, v_prev = states
        dt, lam = t["dt"][row, c0:c1], torch.sigmoid(t["trap"][row, c0:c1])
        nxt = min(c1 + 1, end)
        dt_next, lam_next = t["dt"][row, c0 + 1:nxt], torch.sigmoid(t["trap"][row, c0 + 1:nxt])
        if self.bug == "trap_shift":
            dt_next, lam_next = dt[:nxt - c0 - 1], lam[:nxt - c0 - 1]
        second = torch.cat([dt_next * (1 - lam_next), dt.new_zeros(c1 - c0 - dt_next.shape[0], dt.shape[1])])
        if first:                                   # the first token's carried-in term
            S = S + (dt[0] * (1 - lam[0]))[:, None, None] * v_prev[:, :, None] * k_prev[:, None, :]
        if self.bug == "angle_restart" and not first:
            theta = torch.zeros_like(theta)
        angle = theta + torch.cumsum(math.pi * torch.tanh(t["angles"][row, c0:c1]) * dt[..., None], dim=0)
        qp, kp = t["q"][row, c0:c1][:, heads] + t["q_bias"], t["k"][row, c0:c1][:, heads] + t["k_bias"]
        q, k = _turned(qp, angle), _turned(kp, angle)                                  # (T, h, n)
        v = t["v"][row, c0:c1]
        adt = torch.cumsum(t["adt"][row, c0:c1], dim=0)                                # (T, h)
        T = c1 - c0
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=v.device))
        decay = torch.exp(torch.where(mask[..., None], adt[:, None] - adt[None], torch.full_like(adt[:, None] - adt[None],
                                                                                            -math.inf)))
        # a token's own term from the unrotated q.k (one rotation turns both), as the kernels take it
        weight = torch.where(torch.eye(T, dtype=torch.bool, device=v.device)[..., None], 0.0,
                             decay * (dt * lam + second)[None])                        # (i, j, h)
        ys[row, c0:c1] = torch.einsum("ijh,ihn,jhn,jhp->ihp", weight, q, k, v) \
            + (dt * lam * (qp * kp).sum(-1))[..., None] * v + torch.exp(adt)[..., None] * torch.einsum("hpn,ihn->ihp", S, q)
        to_end = torch.exp(adt[-1] - adt) * (dt * lam + second)                       # (T, h)
        S = torch.exp(adt[-1])[:, None, None] * S + torch.einsum("jh,jhp,jhn->hpn", to_end, v, k)
        # the angle handed on reduced mod 2 pi, as the kernels carry it: unreduced, float32's absolute error grows
        # with it (dt > 20 turns a pair by up to 20 pi a token)
        return torch.remainder(angle[-1], 2 * math.pi), S, k[-1], v[-1]


MAMBA3_LAYER_BUGS = {"bc_norm_over_groups": "the B/C norms over all ngroups * d_state channels at once",
                     "step_drops_k": "each step() forgets the K state it carries"}


class Mamba3Layer(_Float32Implementation):
    """The Mamba3 module (SISO) in float32: in_proj, dt and A, the B/C norms, `Mamba3Kernel`'s scan of the module's
    scan case (its steps for ``layer_steps``), the output norm, out_proj."""

    def __init__(self, bug=None):
        if bug is not None and bug not in MAMBA3_LAYER_BUGS:
            raise ValueError(f"bug must be None or one of {sorted(MAMBA3_LAYER_BUGS)}, got {bug!r}")
        self.bug = bug
        self.scan = Mamba3Kernel("step_drops_k" if bug == "step_drops_k" else None)
        self.name = f"double.mamba3_layer{'.' + bug if bug else ''}"
        self.description = f"float32 Mamba3 module{' with a planted bug: ' + MAMBA3_LAYER_BUGS[bug] if bug else ''}"
        self.capabilities = Capabilities(entries=frozenset({"mamba3_layer"}))

    def compute(self, case, t, inputs):
        h, p, g, n, a, eps = case.nheads, case.headdim, case.ngroups, case.dstate, case.rope_angles, case.rmsnorm_eps
        zx = F.linear(t["u"], t["in_proj_weight"])
        z, x, B, C, dd_dt, dd_A, trap, angles = zx.split([h * p, h * p, g * n, g * n, h, h, h, a], dim=-1)
        width = g * n if self.bug == "bc_norm_over_groups" else n

        def bc_norm(v, weight):
            grouped = v.unflatten(-1, (-1, width))
            normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
            return normed.flatten(-2).unflatten(-1, (g, n)) * weight

        dt = F.softplus(dd_dt + t["dt_bias"])
        A = torch.clamp(-F.softplus(dd_A), max=-1e-4)
        scan_t = dict(q=bc_norm(C, t["q_norm_weight"]), k=bc_norm(B, t["k_norm_weight"]), v=x.unflatten(-1, (h, p)),
                      dt=dt, adt=A * dt, trap=trap, q_bias=t["q_bias"], k_bias=t["k_bias"],
                      angles=angles[:, :, None, :].expand(-1, -1, h, -1), D=t["D"])
        if not case.rmsnorm:
            scan_t["z"] = z.unflatten(-1, (h, p))
        y = self.scan.compute(case.mamba3_scan, scan_t, inputs)[0]["y"].flatten(-2)
        if case.rmsnorm:
            y = norm_vectorized(y, z, t["rmsnorm_weight"], h, eps, True)
        return {"y": F.linear(y, t["outproj_weight"])}, {}


MISBEHAVIOURS = ("abort", "hang", "raise", "oom")


class Misbehaving(Implementation):
    """Aborts the process, sleeps forever, raises, or runs out of device memory (torch's OutOfMemoryError, as
    an allocation past what is free raises it) — always, or only when ngroups > 1 (otherwise it is the healthy
    toy kernel)."""

    def __init__(self, how: str, only_with_groups: bool = False):
        if how not in MISBEHAVIOURS:
            raise ValueError(f"how must be one of {MISBEHAVIOURS}, got {how!r}")
        self.how = how
        self.only_with_groups = only_with_groups
        self.name = f"double.{how}{'_with_groups' if only_with_groups else ''}"
        self.description = "test double that " + {"abort": "aborts", "hang": "hangs", "raise": "raises",
                                                  "oom": "runs out of device memory"}[how]
        self.capabilities = Capabilities(unsupported=frozenset({"varlen_states"}))
        self._healthy = ToyKernel()

    def run(self, case: Case, inputs: Inputs, want_stages: bool = False) -> Evaluation:
        if not self.only_with_groups or case.ngroups > 1:
            if self.how == "abort":
                os.abort()
            if self.how == "hang":
                while True:
                    time.sleep(3600)
            if self.how == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (planted)")
            raise RuntimeError("planted failure: this implementation always raises")
        return self._healthy.run(case, inputs, want_stages)


class DotSensitive(ToyKernel):
    """y off by 10% unless float32 dots are exact (TRITON_F32_DEFAULT=ieee in its process): a kernel whose TF32
    rounding were the whole of its error (harness/investigate/tf32.py's replay tells it from a defect)."""

    def __init__(self):
        super().__init__()
        self.name = "double.dot_sensitive"

    def run(self, case: Case, inputs: Inputs, want_stages: bool = False) -> Evaluation:
        out = super().run(case, inputs, want_stages)
        if os.environ.get("TRITON_F32_DEFAULT", "").lower() != "ieee":
            out.outputs["y"] = out.outputs["y"] * 1.1
        return out


healthy = ToyKernel()
dot_sensitive = DotSensitive()
group_bug = ToyKernel("group_index")
reset_bug = ToyKernel("no_reset")
mask_bug = ToyKernel("partial_mask")
row_leak_bug = ToyKernel("row_leak")
initial_states_bug = ToyKernel("drop_initial_states")
offset_wrap_bug = ToyKernel("offset_wrap")
group_and_padding_bugs = ToyKernel(("group_index", "padding_leak"))
slow_group_bug = Slow()
empty_sequence_bug = ToyKernel("empty_sequence")
strided_offset_wrap_bug = ToyKernel("strided_offset_wrap")
mixer = ToyMixer()
mixer_norm_bug = ToyMixer("norm_whole_dim")
layer = ToyLayer()
layer_norm_bug = ToyLayer("norm_whole_dim")
layer_decode_bug = ToyLayer("decode_drops_D")
chunked_fp32 = LowPrecisionOracle("ref.chunked")
quadratic_fp32 = LowPrecisionOracle("ref.quadratic")
recurrent_fp32 = LowPrecisionOracle("ref.recurrent")
step = StepKernel()
step_no_decay_bug = StepKernel("no_decay")
step_group_bug = StepKernel("group_heads")
mamba3_kernel = Mamba3Kernel()
mamba3_trap_shift_bug = Mamba3Kernel("trap_shift")
mamba3_angle_restart_bug = Mamba3Kernel("angle_restart")
mamba3_step_drops_k_bug = Mamba3Kernel("step_drops_k")
mamba3_angle_state_bug = Mamba3Kernel("angle_state_in_dtype")
mamba3_layer = Mamba3Layer()
mamba3_layer_bc_norm_bug = Mamba3Layer("bc_norm_over_groups")
mamba3_layer_step_drops_k_bug = Mamba3Layer("step_drops_k")
aborts = Misbehaving("abort")
hangs = Misbehaving("hang")
raises = Misbehaving("raise")
aborts_with_groups = Misbehaving("abort", only_with_groups=True)
out_of_memory_with_groups = Misbehaving("oom", only_with_groups=True)


# ---- a bug that lives in one autotune config -----------------------------------------------------------------

_scale_kernel = None


def _autotuned_copy():
    """A Triton copy kernel autotuned over two block sizes; the BLOCK=32 config scales by 1.5 (the planted bug).
    Built on first use so that importing this module does not need Triton."""
    global _scale_kernel
    if _scale_kernel is None:
        import triton
        import triton.language as tl

        @triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])
        @triton.jit
        def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(src + offs, mask=mask, other=0.0)
            if BLOCK == 32:
                v = v * 1.5
            tl.store(dst + offs, v, mask=mask)

        _scale_kernel = copy_kernel
    return _scale_kernel


class ConfigBug(ToyKernel):
    """The healthy toy kernel whose y passes through an autotuned Triton copy; one of its two configs is wrong."""

    def __init__(self):
        super().__init__()
        self.name = "double.config_bug"
        self.description = "toy kernel + an autotuned copy whose second config scales y by 1.5"
        self.capabilities = Capabilities(dtypes=frozenset({"float32"}), backward=False,
                                         unsupported=frozenset({"varlen_states"}), stages=STAGES)

    def run(self, case, inputs, want_stages=False):
        import triton

        out = super().run(case, inputs, want_stages)
        y = out.outputs["y"].contiguous()
        dst = torch.empty_like(y)
        kernel = _autotuned_copy()
        n = y.numel()
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](y, dst, n)
        out.outputs["y"] = dst
        return out


config_bug = ConfigBug()


# ---- a tiling bug that needs a dimension above a small block ---------------------------------------------------

_skip_kernel = None


def _autotuned_skip():
    """y += D x, tiled over headdim by an autotuned Triton kernel with BLOCK_P 64 (listed first: the config the
    interpreter's "tuned" runs) or 32. The planted bug: the grid is sized for 64-wide tiles whatever the config,
    so with BLOCK_P = 32 the channels past 32 of every 64 never get their skip term — only when headdim > 32."""
    global _skip_kernel
    if _skip_kernel is None:
        import triton
        import triton.language as tl

        @triton.autotune(configs=[triton.Config({"BLOCK_P": 64}), triton.Config({"BLOCK_P": 32})], key=["P"])
        @triton.jit
        def skip_kernel(out, y, x, D, P, H, BLOCK_P: tl.constexpr):
            # out-of-place, so that autotune's repeated benchmark runs leave the same result
            row, tile = tl.program_id(0), tl.program_id(1)
            offs = tile * BLOCK_P + tl.arange(0, BLOCK_P)
            mask = offs < P
            d = tl.load(D + (row % H) * P + offs, mask=mask, other=0.0)
            xv = tl.load(x + row * P + offs, mask=mask, other=0.0)
            yv = tl.load(y + row * P + offs, mask=mask, other=0.0)
            tl.store(out + row * P + offs, yv + d * xv, mask=mask)

        skip_kernel.tiles = {"BLOCK_P": "P"}         # what BLOCK_P tiles (harness/sides/tiling.py)
        _skip_kernel = skip_kernel
    return _skip_kernel


class TilingBug(ToyKernel):
    """The healthy toy kernel with its D skip computed by `_autotuned_skip` (right with one config, wrong with
    the other beyond a headdim of 32)."""

    def __init__(self):
        super().__init__()
        self.name = "double.tiling_bug"
        self.description = "toy kernel whose D skip is a Triton kernel whose grid assumes 64-wide tiles"
        self.capabilities = Capabilities(dtypes=frozenset({"float32", "float16", "bfloat16"}), backward=False,
                                         unsupported=frozenset({"varlen_states"}))

    def kernel_modules(self) -> tuple:
        return (types.SimpleNamespace(skip_kernel=_autotuned_skip()),)

    def compute(self, case, t, inputs):
        y, final, _ = toy_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=case.chunk_size,
                               dt_bias=t.get("dt_bias"), dt_softplus=case.dt_softplus,
                               dt_limit=case.dt_limit_or_default, initial_states=t.get("initial_states"),
                               seq_idx=inputs.seq_idx)
        if t.get("D") is not None:
            b, L, h, p = y.shape
            D = t["D"] if t["D"].dim() == 2 else t["D"][:, None].expand(h, p)
            y = y.contiguous()
            out = y.clone()                              # channels no tile reaches keep y without the skip
            _autotuned_skip()[(b * L * h, -(-p // 64))](out, y, t["x"].contiguous(), D.contiguous(), p, h)
            y = out
        if t.get("z") is not None:
            y = y * F.silu(t["z"])
        outputs = {"y": y}
        if case.return_final_states:
            outputs["final_states"] = final
        return outputs, {}


tiling_bug = TilingBug()


_lazy = {}


def __getattr__(name: str):
    if name == "chunked_prefill_without_state":
        if name not in _lazy:
            from ssdiff.sides.adapters import serving

            _lazy[name] = serving.ChunkedPrefill(name=f"ssdiff.sides.doubles:{name}", carry=False)
        return _lazy[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
