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
from ssdiff.model.case import Case
from ssdiff.sides.registry import register
from ssdiff.model.evaluation import Evaluation
from ssdiff.sides.base import Capabilities, Implementation
from ssdiff.inputs import Inputs

SCAN_STAGES = ("dt", "dA_cumsum", "chunk_states", "passed_states", "CB", "scan", "skip", "gated")


class SsdiffTriton(Implementation):
    name = "ssdiff.triton"
    description = "ssdiff's own Triton SSD kernels (kernels/ssd): every feature, fwd+bwd, native groups"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(entries=frozenset({"chunk_scan", "split_conv1d"}),
                            dtypes=frozenset(runtime.runnable_dtypes()),
                            devices=runtime.kernel_devices() or frozenset({"cuda"}),
                            backward=True, stages=("conv",) + SCAN_STAGES + ("normed", "y"))

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
