"""ssdiff's own Triton SSD kernels (kernels/ssd) as an implementation: both entry points, every feature,
forward and backward, and every stage intermediate (so fuzz can localize inside it).

    ssdiff.triton   chunk_scan: ssdiff.kernels.ssd.combined.ssd_chunk_scan_combined
                    split_conv1d: ssdiff.kernels.ssd.mixer.ssd_split_conv1d_scan_combined (conv1d, gated RMSNorm and
                    out_proj in torch; the scan in Triton)
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from ssdiff import runtime
from ssdiff.model.case import Case, Regime
from ssdiff.sides.registry import register
from ssdiff.model.evaluation import Evaluation
from ssdiff.model.bounds import Bounds
from ssdiff.sides.base import Capabilities, Domain, Implementation, Pinned, Testing, limit
from ssdiff.inputs import Inputs
from ssdiff.kernels.ssd import configs as kernel_configs

SCAN_STAGES = ("dt", "dA_cumsum", "chunk_states", "passed_states", "CB", "scan", "skip", "gated")


def _domain(bounds: Bounds, entry: str, examples: tuple, native: tuple) -> Domain:
    """The same shapes in either runtime; every configuration of every kernel drawn (config i % n of each); the
    gpu and nightly profiles multiply the counts (base.PROFILE_GROWTH)."""
    n = kernel_configs.max_configs()
    return Domain(interpreted=bounds, native=bounds, entries=(entry,), examples=examples, native_examples=native,
                  grows_with_profile=True, configs=(n, n), program_budget=None)


unnumbered = limit(lambda c: c.varlen_states and c.initial_states and c.seq_idx_start > 0 and not any(c.segments[0]),
                   "varlen states of empty sequences alone: an all -1 seq_idx does not number them, so the kernel "
                   "numbers cu_seqlens' sequences from 0")


TESTING = Testing(
    domains=(
        _domain(Bounds(max_batch=2, max_seqlen=24, max_nheads=4, max_headdim=6, max_dstate=6, chunk_sizes=(4, 8, 16)),
                "chunk_scan", (10, 8), (7, 5)),
        # Chunks of 32 and 64 tokens: several row and column tiles inside one chunk, so the tile-to-tile paths run
        # (tiles wholly below the diagonal, tiles that straddle it, the running row prefix of the dA gradient). The
        # small chunks above fit in one tile of every configuration.
        _domain(Bounds(max_batch=1, max_seqlen=80, max_nheads=2, max_headdim=4, max_dstate=4, chunk_sizes=(32, 64)),
                "chunk_scan", (1, 1), (1, 1)),
        _domain(Bounds(max_batch=2, max_seqlen=16, max_nheads=4, max_headdim=4, max_dstate=4, chunk_sizes=(4, 8)),
                "split_conv1d", (2, 2), (1, 1)),
    ),
    pinned=(
        Pinned(Case(batch=2, seqlen=21, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=4,
                    segments=((5, 8, 8), (3, 10, 6)), padding=(0, 2), initial_states=True, seq_idx_start=1,
                    regime=Regime(decay="strong")), config=2),
        Pinned(Case(batch=2, seqlen=21, nheads=4, ngroups=2, headdim=3, dstate=5, chunk_size=4,
                    segments=((5, 8, 8), (3, 10, 6)), padding=(0, 2), initial_states=True,
                    regime=Regime(decay="strong"), pass_="backward", final_state_grad=True), config=0),
        Pinned(Case(batch=1, seqlen=40, nheads=4, ngroups=2, headdim=20, dstate=18, chunk_size=16, D="channel",
                    has_z=True, initial_states=True, dt_limit=(0.01, 0.2), dtype="float16",
                    regime=Regime(layout="strided"), pass_="backward", final_state_grad=True), config=1),
        Pinned(Case(batch=2, seqlen=22, nheads=2, headdim=1, ngroups=2, dstate=1, chunk_size=8, dtype="float16",
                    has_z=True, dt_softplus=False, return_final_states=False,
                    regime=Regime(scale=4.0, layout="strided"), pass_="backward", seed=190), config=0),
        Pinned(Case(batch=1, seqlen=70, nheads=2, ngroups=1, headdim=3, dstate=4, chunk_size=64, D="channel",
                    segments=((20, 30, 20),), initial_states=True, regime=Regime(decay="mild"), pass_="backward",
                    final_state_grad=True), config=1),
        Pinned(Case(batch=1, seqlen=80, nheads=2, ngroups=2, headdim=4, dstate=3, chunk_size=64, dtype="float16",
                    regime=Regime(decay="strong")), config=1),
        # once failed: the conv1d accumulated in fp16 (grad.A 1.06x its budget)
        Pinned(Case(entry="split_conv1d", batch=2, seqlen=12, nheads=3, headdim=3, ngroups=3, dstate=3, chunk_size=4,
                    dtype="float16", dt_limit=(0.0, 1.0), conv_width=2, activation="identity", out_dim=6,
                    outproj_bias=True, return_final_states=False, pass_="backward", seed=2920,
                    regime=Regime(dt_large=True, values="integer", scale=0.25, layout="strided")), config=1),
        # once failed: ds rounded to fp16 in the ddA product (grad.A 1.21x its budget)
        Pinned(Case(entry="split_conv1d", seqlen=6, nheads=2, headdim=1, dstate=1, chunk_size=8, dtype="float16",
                    dt_limit=(0.0, 0.05), segments=((1, 5),), return_final_states=False, conv_width=1,
                    regime=Regime(dt_large=True), pass_="backward", seed=36743), config=0),
        Pinned(Case(entry="split_conv1d", batch=2, seqlen=13, nheads=4, ngroups=2, headdim=4, dstate=4, chunk_size=4,
                    rmsnorm=True, norm_before_gate=False, d_nonssm=3, out_dim=5, outproj_bias=True,
                    initial_states=True, segments=((6, 7), (13,)), pass_="backward", final_state_grad=True),
                    config=2),
        # once failed: an empty sequence's varlen state read at the token before it (its predecessor's state)
        Pinned(Case(seqlen=10, segments=((0, 4, 0, 6),), initial_states=True, varlen_states=True), config=0),
        # padding between sequences, an empty sequence and a row of empty sequences only, through the backward
        Pinned(Case(batch=2, seqlen=12, chunk_size=4, segments=((3, 0, 5), (0, 0)), gaps=((1, 3), (0,)),
                    padding=(0, 12), initial_states=True, pass_="backward"), config=1),
    ),
    stages=True,
)


class SsdiffTriton(Implementation):
    name = "ssdiff.triton"
    description = "ssdiff's own Triton SSD kernels (kernels/ssd): every feature, fwd+bwd, native groups"
    testing = TESTING

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(entries=frozenset({"chunk_scan", "split_conv1d"}),
                            dtypes=frozenset(runtime.runnable_dtypes()),
                            devices=runtime.kernel_devices() or frozenset({"cuda"}),
                            backward=True, stages=("conv",) + SCAN_STAGES + ("normed", "y"), limits=(unnumbered,))

    def unavailable(self) -> Optional[str]:
        return runtime.no_triton_reason()

    def kernel_modules(self) -> tuple:
        import ssdiff.kernels.ssd.combined  # noqa: F401 - these two define every kernel
        import ssdiff.kernels.ssd.mixer  # noqa: F401

        return tuple(m for name, m in sorted(sys.modules.items()) if name.startswith("ssdiff.kernels.ssd."))

    def skip_reason(self, case: Case, device: str) -> Optional[str]:
        why = runtime.dtype_skip_reason(case.dtype)
        if why:
            return f"{self.name}: {why}"
        return super().skip_reason(case, device)

    def forward(self, case: Case, tensors: dict, inputs: Inputs, want_stages: bool) -> Evaluation:
        runtime.configure()
        if case.entry == "chunk_scan":
            return self._chunk_scan(case, tensors, inputs, want_stages)
        return self._mixer(case, tensors, inputs, want_stages)

    def _chunk_scan(self, case, t, inputs, want_stages):
        from ssdiff.kernels.ssd.combined import ssd_chunk_scan_combined

        res = ssd_chunk_scan_combined(
            t["x"], t["dt"], t["A"], t["B"], t["C"], case.chunk_size, D=t.get("D"), z=t.get("z"),
            dt_bias=t.get("dt_bias"), initial_states=t.get("initial_states"), seq_idx=inputs.seq_idx,
            cu_seqlens=inputs.cu_seqlens, dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
            return_final_states=case.return_final_states, return_varlen_states=case.varlen_states)
        res = res if isinstance(res, tuple) else (res,)
        outputs = {"y": res[0]}
        if case.return_final_states:
            outputs["final_states"] = res[1]
        if case.varlen_states:
            outputs["varlen_states"] = res[-1]
        stages = {}
        if want_stages:
            stages = scan_stages(case, t["x"], t["dt"], t["A"], t["B"], t["C"], t.get("D"), t.get("z"),
                                 t.get("dt_bias"), t.get("initial_states"), inputs.seq_idx)
            stages["y"] = outputs["y"]
        return Evaluation(outputs=outputs, stages=stages)

    def _mixer(self, case, t, inputs, want_stages):
        from ssdiff.kernels.ssd.mixer import ssd_split_conv1d_scan_combined

        out, extra, scan_in = ssd_split_conv1d_scan_combined(
            t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], case.chunk_size,
            initial_states=t.get("initial_states"), seq_idx=inputs.seq_idx, dt_limit=case.dt_limit_or_default,
            return_final_states=case.return_final_states, activation=case.activation,
            rmsnorm_weight=t.get("rmsnorm_weight"), rmsnorm_eps=case.rmsnorm_eps,
            outproj_weight=t.get("outproj_weight"), outproj_bias=t.get("outproj_bias"), headdim=case.headdim,
            ngroups=case.ngroups, norm_before_gate=case.norm_before_gate, return_stages=True)
        y, final = out if case.return_final_states else (out, None)
        outputs = {"y": y}
        if case.return_final_states:
            outputs["final_states"] = final
        stages = {}
        if want_stages:
            x, dt, B, C, z = scan_in
            stages = dict(extra)
            stages.update(scan_stages(case, x, dt, t["A"], B, C, t["D"], z, t["dt_bias"], t.get("initial_states"),
                                      inputs.seq_idx, dt_softplus=True))
            stages["y"] = y
        return Evaluation(outputs=outputs, stages=stages, notes=[
            "ssdiff.triton split_conv1d: conv1d, gated RMSNorm and out_proj run in torch; the scan in Triton"])


def scan_stages(case, x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                dt_softplus=None) -> dict:
    """Each forward stage kernel run on its own, in order, converted to the oracle's layouts."""
    runtime.configure()
    from ssdiff.kernels.ssd.combined import ssd_combined_fwd

    with torch.no_grad():
        res = ssd_combined_fwd(x.detach(), dt.detach(), A.detach(), B.detach(), C.detach(), case.chunk_size,
                               D=D.detach() if D is not None else None, z=z.detach() if z is not None else None,
                               dt_bias=dt_bias.detach() if dt_bias is not None else None,
                               initial_states=initial_states.detach() if initial_states is not None else None,
                               seq_idx=seq_idx, dt_softplus=case.dt_softplus if dt_softplus is None else dt_softplus,
                               dt_limit=case.dt_limit_or_default, stages=True)
    return oracle_stages(res, case.seqlen, D is not None, z is not None)


def chunk_major_to_tokens(t: torch.Tensor, seqlen: int) -> torch.Tensor:
    """A chunk-major kernel intermediate (b, h, c, Q) in the oracle's token layout (b, L, h)."""
    b, h, c, Q = t.shape
    return t.reshape(b, h, c * Q)[:, :, :seqlen].permute(0, 2, 1)


def oracle_stages(res, seqlen: int, has_D: bool, has_z: bool) -> dict:
    """The stage intermediates of a ``ssdiff.kernels.ssd.combined.ForwardResult`` in the oracle's layouts and names
    (harness/model/stages.py); C.B^T zeroed at positions past ``seqlen``."""
    L = seqlen
    Q = res.CB.shape[-1]
    valid = torch.arange(res.CB.shape[1] * Q, device=res.CB.device) < L
    valid = valid.reshape(res.CB.shape[1], Q)
    CB = res.CB * valid[None, :, None, :, None] * valid[None, :, None, None, :]
    st = {
        "dt": chunk_major_to_tokens(res.dt_out, L),
        "dA_cumsum": chunk_major_to_tokens(res.dA_cumsum, L),
        "chunk_states": res.chunk_states,
        "passed_states": res.passed_states,
        "CB": CB,
    }
    if res.scan is not None:
        st["scan"] = res.scan
    if has_D and res.pregate is not None:
        st["skip"] = res.pregate
    if has_z:
        st["gated"] = res.out
    return st


register(SsdiffTriton())
