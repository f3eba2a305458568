"""Adapters for fla's simple_gla as an SSD kernel (harness/truth/README.md, "fla's simple_gla").

    fla.chunk_simple_gla            chunk_simple_gla (Triton; GPU only: it does not run under the interpreter)
    fla.fused_recurrent_simple_gla  fused_recurrent_simple_gla (Triton; CPU interpreter and GPU)
    fla.naive_recurrent_simple_gla  naive_recurrent_simple_gla (pure torch, fp32 inside; no cu_seqlens)

The SSD map in simple_gla's terms (the mapping is the adapter's only work; it reshapes nothing):
    dt' = clamp(softplus(dt + dt_bias)) in fp32 (as the mamba kernels do), q = C, k = B, each expanded from
    g groups to h heads (fla has no grouped q/k and is silently wrong if handed them), v = x * dt' (in x's
    dtype), g = dt' * A (fp32 log decay), scale = 1, initial/final state (N, H, K=n, V=p) = the SSD state
    transposed on its last two axes; y = o + D * x, then * silu(z), computed in fp32 and stored in x's dtype.
seq_idx becomes cu_seqlens over the batch rows laid end to end (batch 1 of b*L tokens): one sequence per
segment, initial_states only for a row's sequence numbered 0, and each row's padding tokens (seq_idx = -1) a
sequence of their own with v = 0, so they hold a zero state and add nothing; final_states per row is the
state after its last real sequence (zero when the row ends in padding), varlen_states one per real sequence.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from ssdiff import runtime
from ssdiff.sides import upstream
from ssdiff.model.case import Case
from ssdiff.model.features import NEEDS_SEQ_IDX
from ssdiff.sides.registry import register
from ssdiff.model.evaluation import Evaluation
from ssdiff.sides.base import PURE_TORCH, Capabilities, Implementation, Testing
from ssdiff.inputs import Inputs


def processed_dt(case: Case, dt: torch.Tensor, dt_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """dt' (b, L, h) in fp32: + dt_bias, softplus (identity above 20), clamp to dt_limit (default [0, inf))."""
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if case.dt_softplus:
        d = F.softplus(d, threshold=20.0)
    lo, hi = case.dt_limit_or_default
    # Always clamped, as the SSD map and mamba's kernel do: dt_limit's default low end 0 keeps dt' >= 0.
    return d.clamp(min=lo) if hi == math.inf else d.clamp(min=lo, max=hi)


class SequencePlan:
    """How a case's seq_idx rows map onto fla's cu_seqlens over the rows laid end to end.

    bounds: token offsets (into b*L; an empty sequence repeats one); h0_rows: per sequence, the batch row whose
    initial state it starts from (or None); real: per sequence, False for a padding run (a gap or the trailing
    padding); last_real: per row, index of its last non-empty real sequence (None where it has none);
    padded_rows: rows whose last token is padding."""

    def __init__(self, case: Case):
        L = case.seqlen
        padding = case.padding or (0,) * case.batch
        self.bounds, self.h0_rows, self.real, self.last_real, self.padded_rows = [0], [], [], [], []
        for row, (lengths, pad) in enumerate(zip(case.segments, padding)):
            start, last, ends_in_padding = row * L, None, False
            gaps = (0, *case.gaps[row]) if case.gaps is not None else (0,) * len(lengths)
            for k, (length, gap) in enumerate(zip(lengths, gaps)):
                if gap:
                    self._run(start + gap, None, False)
                    start, ends_in_padding = start + gap, True
                start += length
                self._run(start, row if (k == 0 and case.seq_idx_start == 0) else None, True)
                if length:
                    last, ends_in_padding = len(self.real) - 1, False
            self.last_real.append(last)
            if pad:
                self._run(start + pad, None, False)
                ends_in_padding = True
            if ends_in_padding:
                self.padded_rows.append(row)

    def _run(self, end: int, h0_row: Optional[int], real: bool):
        self.bounds.append(end)
        self.h0_rows.append(h0_row)
        self.real.append(real)

    def cu_seqlens(self, device) -> torch.Tensor:
        return torch.tensor(self.bounds, dtype=torch.long, device=device)


class FlaImplementation(Implementation):
    """Common ground for the three simple_gla adapters."""

    function_name = ""
    pure_torch = False
    gpu_only_reason: Optional[str] = None
    has_cu_seqlens = True

    def __init__(self):
        self._capabilities = None

    def unavailable(self) -> Optional[str]:
        problem = upstream.fla_problem()
        if problem:
            return problem
        if self.gpu_only_reason and not runtime.has_gpu():
            return f"needs a GPU: {self.gpu_only_reason}"
        return None if self.pure_torch else runtime.no_triton_reason()

    def kernel_modules(self) -> tuple:
        if self.pure_torch or self.unavailable():
            return ()
        return tuple(m for name, m in sorted(sys.modules.items())
                     if name.startswith(("fla.ops.simple_gla.", "fla.ops.common.", "fla.ops.utils.")))

    @property
    def capabilities(self) -> Capabilities:
        if self._capabilities is None:
            if self.pure_torch:
                devices, dtypes = frozenset({"cpu", "cuda"}), frozenset({"float32", "float16", "bfloat16"})
            else:
                devices = frozenset({"cuda"}) if self.gpu_only_reason else (runtime.kernel_devices()
                                                                             or frozenset({"cuda"}))
                # A GPU-only kernel runs every dtype there; interpreted ones only what the interpreter judges.
                dtypes = frozenset({"float32", "float16", "bfloat16"}) if self.gpu_only_reason else \
                    frozenset(runtime.runnable_dtypes())
            self._capabilities = Capabilities(dtypes=dtypes, devices=devices,
                                              unsupported=frozenset() if self.has_cu_seqlens else NEEDS_SEQ_IDX)
        return self._capabilities

    def skip_reason(self, case: Case, device: str) -> Optional[str]:
        if not self.pure_torch and self.unavailable() is None:
            why = runtime.dtype_skip_reason(case.dtype)
            if why:
                return f"{self.name}: {why}"
        return super().skip_reason(case, device)

    def call(self, q, k, v, g, initial_state, cu_seqlens):
        """Run the fla function: returns (o (B, T, H, V), final state (N, H, K, V))."""
        raise TypeError(f"{type(self).__name__} must define call()")

    def forward(self, case: Case, tensors: dict, inputs: Inputs, want_stages: bool) -> Evaluation:
        t = tensors
        b, L, h, p = t["x"].shape
        n = t["B"].shape[-1]
        heads = case.heads_per_group
        dt = processed_dt(case, t["dt"], t.get("dt_bias"))                                # (b, L, h) fp32
        q = t["C"].repeat_interleave(heads, dim=2)
        k = t["B"].repeat_interleave(heads, dim=2)
        v_scale = dt
        g = dt * t["A"].float()
        h0 = t.get("initial_states")
        h0 = h0.float().transpose(-1, -2) if h0 is not None else None                      # (b, h, n, p)
        plan = SequencePlan(case) if case.segments is not None else None
        if plan is not None:
            real_token = (inputs.seq_idx >= 0).to(v_scale.dtype)                           # (b, L)
            v_scale = v_scale * real_token[..., None]
        v = (t["x"].float() * v_scale[..., None]).to(t["x"].dtype)

        if plan is None:
            o, final = self.call(q, k, v, g, h0, None)
            final_rows = final
        else:
            flat = [tensor.reshape(1, b * L, *tensor.shape[2:]) for tensor in (q, k, v, g)]
            zeros = q.new_zeros(h, n, p, dtype=torch.float32)
            h0_seq = None
            if h0 is not None:
                h0_seq = torch.stack([h0[row] if row is not None else zeros for row in plan.h0_rows])
            o, final = self.call(*flat, h0_seq, plan.cu_seqlens(q.device))
            o = o.reshape(b, L, h, p)
            final_rows = torch.stack([zeros if row in plan.padded_rows else final[plan.last_real[row]]
                                      for row in range(b)])
        y = o.float()
        D = t.get("D")
        if D is not None:
            y = y + (D.float()[:, None] if D.dim() == 1 else D.float()) * t["x"].float()
        if t.get("z") is not None:
            y = y * F.silu(t["z"].float())
        outputs = {"y": y.to(t["x"].dtype)}
        if case.return_final_states:
            outputs["final_states"] = final_rows.float().transpose(-1, -2)
        if case.varlen_states:
            real = [i for i, is_real in enumerate(plan.real) if is_real]
            outputs["varlen_states"] = final[real].float().transpose(-1, -2)
        rel = upstream.fla()
        return Evaluation(outputs=outputs, notes=[f"{rel.label}: simple_gla with the SSD mapping of harness/truth/README.md"])


def hopper_backward_refused(device: str) -> bool:
    """fla-core 0.6 raises in chunk_simple_gla's backward on sm_90 with Triton in [3.4.0, 3.7.1) unless tilelang
    is installed (measured on an H200 with Triton 3.6.0)."""
    import importlib.util

    import triton

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(torch.device(device))[0] != 9:
        return False
    version = tuple(int(v) for v in triton.__version__.split("+")[0].split(".")[:3] if v.isdigit())
    return (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None


class ChunkSimpleGla(FlaImplementation):
    name = "fla.chunk_simple_gla"
    description = "fla chunk_simple_gla (Triton, chunked; GPU only)"
    gpu_only_reason = "chunk_simple_gla does not run under the Triton interpreter (a loop variable is a Python int)"

    def refuses(self, backward: bool, device: str, dtype: Optional[str] = None) -> Optional[str]:
        if backward and hopper_backward_refused(device):
            return ("fla.chunk_simple_gla: fla refuses the backward on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 "
                    "and no tilelang (its issue #640: incorrect gated chunk_bwd_dqkwg)")
        return None

    def call(self, q, k, v, g, initial_state, cu_seqlens):
        fn = upstream.fla().simple_gla.chunk_simple_gla
        return fn(q, k, v, g=g, scale=1.0, initial_state=initial_state, output_final_state=True,
                  cu_seqlens=cu_seqlens)


class FusedRecurrentSimpleGla(FlaImplementation):
    name = "fla.fused_recurrent_simple_gla"
    description = "fla fused_recurrent_simple_gla (Triton, token by token; CPU interpreter and GPU)"
    evaluation_order = "recurrent"

    def call(self, q, k, v, g, initial_state, cu_seqlens):
        fn = upstream.fla().simple_gla.fused_recurrent_simple_gla
        return fn(q, k, v, g=g, scale=1.0, initial_state=initial_state, output_final_state=True,
                  cu_seqlens=cu_seqlens)


class NaiveRecurrentSimpleGla(FlaImplementation):
    name = "fla.naive_recurrent_simple_gla"
    description = "fla naive_recurrent_simple_gla (pure torch, fp32 inside; no cu_seqlens)"
    pure_torch = True
    evaluation_order = "recurrent"
    has_cu_seqlens = False
    testing = Testing(domains=(PURE_TORCH,))

    def call(self, q, k, v, g, initial_state, cu_seqlens):
        assert cu_seqlens is None
        fn = upstream.fla().naive.naive_recurrent_simple_gla
        return fn(q, k, v, g, scale=1.0, initial_state=initial_state, output_final_state=True)


for _impl in (ChunkSimpleGla(), FusedRecurrentSimpleGla(), NaiveRecurrentSimpleGla()):
    register(_impl)
