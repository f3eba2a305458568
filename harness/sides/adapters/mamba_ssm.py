"""Adapters for every SSD entry point of the installed mamba_ssm release (2.0.0 - 2.3.2.post1).

    mamba_ssm.chunk_scan_combined   mamba_chunk_scan_combined: every feature, forward and backward, stage
                                    intermediates from the sub-kernels (chunk cumsum, chunk state, state
                                    passing, bmm, chunk scan)
    mamba_ssm.chunk_scan            mamba_chunk_scan: the staged Triton path (no seq_idx / h0 / dt_limit /
                                    final states; no ragged last chunk: it needs L % chunk_size == 0)
    mamba_ssm.chunk_scan_ref        ssd_chunk_scan_combined_ref: pure torch, same limits
    mamba_ssm.ssd_minimal           ssd_minimal_discrete (the paper's listing): X = x*dt, A*dt, per-head B/C
    mamba_ssm.split_conv1d_combined mamba_split_conv1d_scan_combined: the fused Mamba-2 mixer
    mamba_ssm.split_conv1d_ref      mamba_split_conv1d_scan_ref: its reference (no seq_idx / h0 / d_nonssm)
    mamba_ssm.selective_state_update  selective_state_update: the decode step kernel (decode entry; forward
                                    only; no dt_limit)

mamba_ssm is loaded without its package __init__ by ssdiff.sides.upstream (2.0.0 and 2.0.1 are broken as shipped and
reported unavailable); where causal_conv1d or selective_scan_cuda is missing a float64-checked torch stand-in
runs in its place and `Evaluation.notes` says so. What a release can express is detected from it (signatures,
source, release number for seq_idx = -1 padding), and a case outside that is skipped with the reason. Nothing is
reshaped to fit: an adapter only maps the Case's tensors onto the upstream call's arguments.

Capabilities say only what a call can express. Upstream defects are records of harness/registry/known.py: a case that
hits one is run and judged like any other, and reported as that defect when it diverges.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch

from ssdiff import runtime
from ssdiff.sides import upstream
from ssdiff.model.case import Case, Regime
from ssdiff.model.features import NEEDS_SEQ_IDX
from ssdiff.sides.registry import register
from ssdiff.model.evaluation import Evaluation
from ssdiff.model.bounds import Bounds
from ssdiff.sides.base import (PURE_TORCH, UPSTREAM, Capabilities, Domain, Implementation, Pinned, Testing,
                               limit)

ALL_DTYPES = frozenset({"float32", "float16", "bfloat16"})
SCAN_STAGES = ("dt", "dA_cumsum", "chunk_states", "passed_states", "CB", "scan", "skip", "gated")

# mamba_chunk_scan and ssd_chunk_scan_combined_ref add dt_bias in torch and never clamp; the SSD map (and
# mamba_chunk_scan_combined's kernel) clamps dt' at dt_limit's default low end 0. Only dt_bias without softplus
# can make dt' negative, so that combination is outside what they express.
unclamped_dt = limit(lambda c: c.has_dt_bias and not c.dt_softplus,
                     "cannot express dt_bias without softplus: it does not clamp dt + dt_bias at 0 (the SSD map and "
                     "mamba_chunk_scan_combined do), and dt + dt_bias can be negative")
conv_channels_8 = limit(lambda c: c.conv_channels % 8 != 0,
                        "needs conv channels (dim + 2*ngroups*dstate) % 8 == 0 (causal_conv1d's channel-last "
                        "layout)")


def padding_limits(rel: upstream.MambaRelease) -> tuple:
    """A release before seq_idx = -1 padding cannot express padded rows."""
    why = rel.padding_reason()
    return (limit(lambda c: c.padded, why),) if why else ()


class MambaImplementation(Implementation):
    """Common ground: the release, availability, dtype gating, capabilities built once from the release."""

    function_name = ""            # the attribute of ssd_combined this adapter drives
    pure_torch = False            # no Triton kernel: any dtype, any device
    uses: tuple = ()              # CUDA extensions it reaches (stand-in notes)
    needs: tuple = ()             # keys of MambaRelease.missing that make it unavailable

    def __init__(self):
        self._capabilities = None

    @property
    def release(self) -> upstream.MambaRelease:
        return upstream.mamba_ssm()

    def unavailable(self) -> Optional[str]:
        problem = upstream.mamba_ssm_problem()
        if problem:
            return problem
        rel = self.release
        for key in self.needs:
            if key in rel.missing:
                return rel.missing[key]
        if self.function_name and not hasattr(rel.ssd_combined, self.function_name):
            return f"{rel.label} has no {self.function_name}"
        return None if self.pure_torch else runtime.no_triton_reason()

    @property
    def capabilities(self) -> Capabilities:
        if self._capabilities is None:
            if upstream.mamba_ssm_problem():
                return self.declared()
            self._capabilities = self.detect(self.release)
        return self._capabilities

    def declared(self, **overrides) -> Capabilities:
        """The capabilities before looking at a release (what `ssdiff list` shows when it is missing)."""
        devices = frozenset({"cpu", "cuda"}) if self.pure_torch else (runtime.kernel_devices()
                                                                      or frozenset({"cuda"}))
        dtypes = ALL_DTYPES if self.pure_torch else frozenset(runtime.runnable_dtypes())
        fields = dict(dtypes=dtypes, devices=devices)
        fields.update(overrides)
        return Capabilities(**fields)

    def detect(self, rel: upstream.MambaRelease) -> Capabilities:
        return self.declared()

    def skip_reason(self, case: Case, device: str) -> Optional[str]:
        if not self.pure_torch and self.unavailable() is None:
            why = runtime.dtype_skip_reason(case.dtype)
            if why:
                return f"{self.name}: {why}"
        return super().skip_reason(case, device)

    def notes(self) -> list:
        return self.release.notes(self.uses)

    def kernel_modules(self) -> tuple:
        if self.pure_torch or self.unavailable():
            return ()
        self.release                   # loads the Triton ops
        return tuple(m for name, m in sorted(sys.modules.items()) if name.startswith("mamba_ssm.ops.triton."))


# ---- mamba_chunk_scan_combined ---------------------------------------------------------------------------

def _time_major(t: torch.Tensor, seqlen: int) -> torch.Tensor:
    """(b, h, c, Q) chunk-major -> (b, L, h), cropped to seqlen."""
    b, h, c, q = t.shape
    return t.permute(0, 2, 3, 1).reshape(b, c * q, h)[:, :seqlen]


def scan_stages(rel: upstream.MambaRelease, case: Case, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                initial_states=None, seq_idx=None) -> dict:
    """Run the sub-kernels one by one (as _mamba_chunk_scan_combined_fwd does) and return the stage
    intermediates in the oracle's layouts (harness/model/stages.py)."""
    Q, L = case.chunk_size, case.seqlen
    b, _, h, p = x.shape
    n = B.shape[-1]
    with torch.no_grad():
        if B.stride(-1) != 1:
            B = B.contiguous()
        if C.stride(-1) != 1:
            C = C.contiguous()
        if x.stride(-1) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        if z is not None and z.stride(-1) != 1 and z.stride(1) != 1:
            z = z.contiguous()
        dA_cumsum, dt_out = rel.call("_chunk_cumsum_fwd", dt, A, Q, dt_bias=dt_bias, dt_softplus=case.dt_softplus,
                                     dt_limit=case.dt_limit_or_default)
        states = rel.call("_chunk_state_fwd", B, x, dt_out, dA_cumsum, seq_idx=seq_idx, states_in_fp32=True)
        h0 = initial_states.reshape(b, h, p * n) if initial_states is not None else None
        passed, _ = rel.call("_state_passing_fwd", states.reshape(*states.shape[:3], p * n), dA_cumsum[:, :, :, -1],
                             initial_states=h0, seq_idx=seq_idx, chunk_size=Q, out_dtype=C.dtype)
        passed = passed.reshape(*passed.shape[:3], p, n)
        # The CB stage is C.B^T unmasked (the oracle's definition); the scan gets the masked one it always gets.
        CB = rel.call("_bmm_chunk_fwd", C, B, Q, output_dtype=torch.float32)
        CB_masked = rel.call("_bmm_chunk_fwd", C, B, Q, seq_idx=seq_idx, output_dtype=torch.float32) \
            if seq_idx is not None else CB
        scan, _ = rel.call("_chunk_scan_fwd", CB_masked, x, dt_out, dA_cumsum, C, passed, seq_idx=seq_idx)
        stages = {"dt": _time_major(dt_out, L), "dA_cumsum": _time_major(dA_cumsum, L), "chunk_states": states,
                  "passed_states": passed, "CB": CB, "scan": scan}
        if D is not None or z is not None:
            out, out_x = rel.call("_chunk_scan_fwd", CB_masked, x, dt_out, dA_cumsum, C, passed, D=D, z=z,
                                  seq_idx=seq_idx)
            if D is not None:
                stages["skip"] = out_x if z is not None else out
            if z is not None:
                stages["gated"] = out
    return stages


class ChunkScanCombined(MambaImplementation):
    name = "mamba_ssm.chunk_scan_combined"
    description = "mamba_ssm mamba_chunk_scan_combined (Triton, fused; every feature; fwd + bwd)"
    function_name = "mamba_chunk_scan_combined"

    def detect(self, rel):
        unsupported = set() if rel.varlen_states else {"varlen_states"}
        return self.declared(unsupported=frozenset(unsupported), limits=padding_limits(rel), stages=SCAN_STAGES)

    def forward(self, case, tensors, inputs, want_stages):
        rel = self.release
        fn = rel.ssd_combined.mamba_chunk_scan_combined
        t = tensors
        kwargs = dict(D=t.get("D"), z=t.get("z"), dt_bias=t.get("dt_bias"), initial_states=t.get("initial_states"),
                      seq_idx=inputs.seq_idx, dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
                      return_final_states=case.return_final_states)
        if case.varlen_states:
            kwargs.update(cu_seqlens=inputs.cu_seqlens, return_varlen_states=True)
        result = fn(t["x"], t["dt"], t["A"], t["B"], t["C"], case.chunk_size, **kwargs)
        result = result if isinstance(result, tuple) else (result,)
        outputs = {"y": result[0]}
        rest = list(result[1:])
        if case.return_final_states:
            outputs["final_states"] = rest.pop(0)
        if case.varlen_states:
            outputs["varlen_states"] = rest.pop(0)
        stages = {}
        if want_stages:
            stages = scan_stages(rel, case, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t.get("D"), z=t.get("z"),
                                 dt_bias=t.get("dt_bias"), initial_states=t.get("initial_states"),
                                 seq_idx=inputs.seq_idx)
        return Evaluation(outputs=outputs, stages=stages, notes=self.notes())


# ---- mamba_chunk_scan and ssd_chunk_scan_combined_ref ----------------------------------------------------

class ChunkScan(MambaImplementation):
    name = "mamba_ssm.chunk_scan"
    description = "mamba_ssm mamba_chunk_scan (Triton, staged autograd functions; fwd + bwd)"
    function_name = "mamba_chunk_scan"

    def detect(self, rel):
        return self.declared(unsupported=NEEDS_SEQ_IDX | {"dt_limit", "initial_states", "final_states",
                                                          "final_state_grad", "ragged"},
                             limits=(unclamped_dt,))

    def forward(self, case, tensors, inputs, want_stages):
        fn = getattr(self.release.ssd_combined, self.function_name)
        t = tensors
        y = fn(t["x"], t["dt"], t["A"], t["B"], t["C"], case.chunk_size, D=t.get("D"), z=t.get("z"),
               dt_bias=t.get("dt_bias"), dt_softplus=case.dt_softplus)
        return Evaluation(outputs={"y": y}, notes=self.notes())


class ChunkScanRef(ChunkScan):
    name = "mamba_ssm.chunk_scan_ref"
    description = "mamba_ssm ssd_chunk_scan_combined_ref (pure torch; not a gradient oracle: NaN under strong decay)"
    function_name = "ssd_chunk_scan_combined_ref"
    pure_torch = True
    testing = Testing(domains=(PURE_TORCH,))

    def detect(self, rel):
        return self.declared(unsupported=NEEDS_SEQ_IDX | {"dt_limit", "initial_states", "final_states",
                                                          "final_state_grad", "ragged"},
                             limits=(unclamped_dt,))


# ---- ssd_minimal_discrete --------------------------------------------------------------------------------

class SsdMinimal(MambaImplementation):
    name = "mamba_ssm.ssd_minimal"
    description = "mamba_ssm ssd_minimal_discrete (pure torch, the paper's listing; X = x*dt, A*dt, B/C per head)"
    pure_torch = True
    needs = ("ssd_minimal",)
    testing = Testing(domains=(PURE_TORCH,))

    def detect(self, rel):
        return self.declared(unsupported=NEEDS_SEQ_IDX | {"D", "z", "dt_bias", "dt_softplus", "dt_limit",
                                                          "ragged"})

    def forward(self, case, tensors, inputs, want_stages):
        fn = self.release.ssd_minimal.ssd_minimal_discrete
        t = tensors
        dtype = t["x"].dtype
        dt = t["dt"].float()
        # All four inputs in one dtype (it asserts so): the products are formed in fp32, rounded once.
        X = (t["x"].float() * dt[..., None]).to(dtype)
        A = (t["A"].float() * dt).to(dtype)
        heads = case.heads_per_group
        B = t["B"].repeat_interleave(heads, dim=2)
        C = t["C"].repeat_interleave(heads, dim=2)
        h0 = t.get("initial_states")
        if h0 is not None:
            h0 = h0.to(dtype)[:, None]
        y, final = fn(X, A, B, C, case.chunk_size, initial_states=h0)
        outputs = {"y": y}
        if case.return_final_states:
            outputs["final_states"] = final
        return Evaluation(outputs=outputs, notes=self.notes())


# ---- the fused mixer: mamba_split_conv1d_scan_combined and _ref -------------------------------------------

def _activation(case: Case):
    return "silu" if case.activation == "silu" else None


class SplitConv1dCombined(MambaImplementation):
    name = "mamba_ssm.split_conv1d_combined"
    description = "mamba_ssm mamba_split_conv1d_scan_combined (the fused Mamba-2 mixer; fwd + bwd)"
    function_name = "mamba_split_conv1d_scan_combined"
    uses = ("causal_conv1d",)

    def detect(self, rel):
        return self.declared(entries=frozenset({"split_conv1d"}), limits=(conv_channels_8,) + padding_limits(rel),
                             stages=("conv",) + SCAN_STAGES[:-2] + ("skip",))

    def forward(self, case, tensors, inputs, want_stages):
        rel = self.release
        fn = rel.ssd_combined.mamba_split_conv1d_scan_combined
        t = tensors
        result = fn(t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"],
                    case.chunk_size, initial_states=t.get("initial_states"), seq_idx=inputs.seq_idx,
                    dt_limit=case.dt_limit_or_default, return_final_states=case.return_final_states,
                    activation=_activation(case), rmsnorm_weight=t.get("rmsnorm_weight"),
                    rmsnorm_eps=case.rmsnorm_eps, outproj_weight=t.get("outproj_weight"),
                    outproj_bias=t.get("outproj_bias"), headdim=case.headdim, ngroups=case.ngroups,
                    norm_before_gate=case.norm_before_gate)
        outputs = {"y": result[0], "final_states": result[1]} if case.return_final_states else {"y": result}
        stages = self._stages(rel, case, t, inputs) if want_stages else {}
        return Evaluation(outputs=outputs, stages=stages, notes=self.notes())

    def _stages(self, rel, case, t, inputs):
        return mixer_stages(rel, case, t, inputs)


def mixer_stages(rel: upstream.MambaRelease, case: Case, t: dict, inputs) -> dict:
    """conv (through the causal_conv1d call the fused mixer makes) and the scan stages on its x, B, C, from
    zxbcdt and the mixer's weights in ``t`` (conv1d_bias may be absent). Also the layer adapters' stages."""
    dim, g, n, h = case.dim, case.ngroups, case.dstate, case.nheads
    with torch.no_grad():
        zxbcdt = t["zxbcdt"].detach()
        _, _, xBC, dt = torch.split(zxbcdt, [2 * case.d_nonssm, dim, case.conv_channels, h], dim=-1)
        conv_fwd = getattr(rel.ssd_combined, "causal_conv1d_fwd_function", None)
        if conv_fwd is None:
            conv_fwd = rel.ssd_combined.causal_conv1d_cuda.causal_conv1d_fwd
        seq_idx = inputs.seq_idx.contiguous() if inputs.seq_idx is not None else None
        conv = conv_fwd(xBC.contiguous().transpose(1, 2), t["conv1d_weight"], t.get("conv1d_bias"), seq_idx, None,
                        None, case.activation == "silu").transpose(1, 2)
        x, B, C = torch.split(conv, [dim, g * n, g * n], dim=-1)
        stages = scan_stages(rel, case, x.unflatten(-1, (h, case.headdim)), dt, t["A"],
                             B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)), D=t["D"],
                             dt_bias=t["dt_bias"], initial_states=t.get("initial_states"), seq_idx=seq_idx)
    stages.pop("gated", None)
    return {"conv": conv, **stages}


class SplitConv1dRef(MambaImplementation):
    name = "mamba_ssm.split_conv1d_ref"
    description = ("mamba_ssm mamba_split_conv1d_scan_ref (torch + selective_scan + Triton rmsnorm; known bug: "
                   "normalizes over all of dim when ngroups > 1, state-spaces/mamba #647)")
    function_name = "mamba_split_conv1d_scan_ref"
    uses = ("causal_conv1d", "selective_scan_cuda")
    needs = ("selective_scan",)

    def detect(self, rel):
        return self.declared(entries=frozenset({"split_conv1d"}),
                             unsupported=NEEDS_SEQ_IDX | {"initial_states", "final_states", "final_state_grad",
                                                          "d_nonssm"})

    def kernel_modules(self) -> tuple:
        # the one Triton kernel family its call launches is the gated RMSNorm's (not autotuned): the conv and the
        # scan are causal_conv1d and selective_scan (compiled extensions, or their torch stand-ins)
        return tuple(m for m in super().kernel_modules() if m.__name__.endswith(".layernorm_gated"))

    def forward(self, case, tensors, inputs, want_stages):
        module = self.release.ssd_combined
        fn = module.mamba_split_conv1d_scan_ref
        t = tensors
        stages = {}
        with _recording(module, stages, case) if want_stages else contextlib.nullcontext():
            y = fn(t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], case.chunk_size,
                   dt_limit=case.dt_limit_or_default, activation=_activation(case),
                   rmsnorm_weight=t.get("rmsnorm_weight"), rmsnorm_eps=case.rmsnorm_eps,
                   outproj_weight=t.get("outproj_weight"), outproj_bias=t.get("outproj_bias"), headdim=case.headdim,
                   ngroups=case.ngroups, norm_before_gate=case.norm_before_gate)
        return Evaluation(outputs={"y": y}, stages=stages, notes=self.notes())


@contextlib.contextmanager
def _recording(module, stages: dict, case: Case):
    """Record the ref's own intermediates as stages by wrapping the three functions it calls through its
    module's globals: causal_conv1d_fn (conv), ssd_selective_scan (skip, or gated when z gates inside the
    scan) and rmsnorm_fn (normed). The wrapped functions compute exactly what they did; only the outputs are
    kept."""
    saved = {name: getattr(module, name) for name in ("causal_conv1d_fn", "ssd_selective_scan", "rmsnorm_fn")}

    def wrap(name, stage, to_stage):
        def recorded(*args, **kwargs):
            out = saved[name](*args, **kwargs)
            stages[stage] = to_stage(out).detach()
            return out
        return recorded

    module.causal_conv1d_fn = wrap("causal_conv1d_fn", "conv", lambda out: out.transpose(1, 2))
    module.ssd_selective_scan = wrap("ssd_selective_scan", "skip" if case.rmsnorm else "gated", lambda out: out)
    module.rmsnorm_fn = wrap("rmsnorm_fn", "normed", lambda out: out)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


# ---- the decode step: selective_state_update ----------------------------------------------------------------

STEP_MODULE = "mamba_ssm.ops.triton.selective_state_update"


def state_dtype_runs(case: Case) -> Optional[str]:
    """The state is loaded and stored by the kernel: its dtype must run on this runtime like the case's."""
    why = runtime.dtype_skip_reason(case.state_dtype) if case.entry == "decode" else None
    return f"state dtype {case.state_dtype}: {why}" if why else None


# The decode entry's own cases: each decode step is one kernel launch (batch * nheads programs under the
# interpreter), so small shapes there and no budget of programs per chunk; config 0. As many as a property at the ci
# profile draws (50) over the two dtypes the interpreter runs; natively 13 a dtype, the gpu profile's 200 over three.
DECODE = Domain(interpreted=Bounds(max_batch=2, max_seqlen=12, max_nheads=4, max_headdim=6, max_dstate=8),
                native=Bounds(max_batch=4, max_seqlen=64, max_nheads=16, max_headdim=64, max_dstate=128),
                examples=(25, 0), native_examples=(13, 0), grows_with_profile=True, configs=(1, 1),
                program_budget=None)


class SelectiveStateUpdate(MambaImplementation):
    """The decode entry by the step kernel, as Mamba-2's step() calls it: A, dt, dt_bias and a per-head D
    broadcast over headdim with stride 0 (the kernel's tie_hdim path), one call per decoded token, the state
    updated in place (a cache of one slot per row, in the case's state dtype; with state_batch_indices, row i
    lives in slot state_indices[i])."""

    name = "mamba_ssm.selective_state_update"
    description = "mamba_ssm selective_state_update (Triton; the decode step kernel; forward only)"
    testing = Testing(domains=(UPSTREAM, DECODE), pinned=(
        Pinned(Case(entry="decode", batch=2, seqlen=9, nheads=4, ngroups=2, headdim=3, dstate=5, decode_steps=3,
                    D="channel", has_z=True, initial_states=True, state_batch_indices=True)),
        Pinned(Case(entry="decode", batch=1, seqlen=4, nheads=3, ngroups=3, headdim=6, dstate=7, decode_steps=4,
                    dtype="float16", state_dtype="float16", regime=Regime(decay="strong", dt_large=True))),
    ))

    def unavailable(self) -> Optional[str]:
        problem = upstream.mamba_ssm_problem()
        if problem:
            return problem
        try:
            self.step_function()
        except ImportError as err:
            return f"{self.release.label} has no usable {STEP_MODULE}: {upstream.one_line(err)}"
        return runtime.no_triton_reason()

    def step_function(self):
        self.release                   # the bare package, so that the submodule imports
        import importlib

        return importlib.import_module(STEP_MODULE).selective_state_update

    def kernel_modules(self) -> tuple:
        if self.unavailable():
            return ()
        self.step_function()
        return (sys.modules[STEP_MODULE],)

    def declared(self, **overrides) -> Capabilities:
        fields = dict(entries=frozenset({"decode"}), backward=False, unsupported=frozenset({"dt_limit"}),
                      limits=(unclamped_dt, state_dtype_runs))
        fields.update(overrides)
        return super().declared(**fields)

    def detect(self, rel):
        unsupported = {"dt_limit"}
        if "state_batch_indices" not in rel.params(self.step_function()):
            unsupported.add("state_batch_indices")
        return self.declared(unsupported=frozenset(unsupported))

    def forward(self, case, tensors, inputs, want_stages):
        fn = self.step_function()
        t = tensors
        b, h, p, n = case.batch, case.nheads, case.headdim, case.dstate
        P = case.prefill_len
        index = inputs.state_indices
        rows = t["state"]
        if index is not None:
            cache = torch.empty_like(rows)
            cache[index.long()] = rows
        else:
            cache = rows.clone()
        A = t["A"][:, None, None].expand(h, p, n)
        dt_bias = t["dt_bias"][:, None].expand(h, p) if "dt_bias" in t else None
        D = t.get("D")
        if D is not None and D.dim() == 1:
            D = D[:, None].expand(h, p)
        kwargs = dict(state_batch_indices=index) if index is not None else {}
        ys = []
        for k in range(case.decode_steps):
            token = P + k
            z = t["z"][:, token] if "z" in t else None
            ys.append(fn(cache, t["x"][:, token], t["dt"][:, token][..., None].expand(b, h, p), A, t["B"][:, token],
                         t["C"][:, token], D=D, z=z, dt_bias=dt_bias, dt_softplus=case.dt_softplus, **kwargs))
        outputs = {"y": torch.stack(ys, dim=1)}
        if case.return_final_states:
            outputs["final_states"] = cache[index.long()] if index is not None else cache
        return Evaluation(outputs=outputs, notes=self.notes())


IMPLEMENTATIONS = (ChunkScanCombined(), ChunkScan(), ChunkScanRef(), SsdMinimal(), SplitConv1dCombined(),
                   SplitConv1dRef(), SelectiveStateUpdate())
for _impl in IMPLEMENTATIONS:
    register(_impl)
