"""fla's Mamba2 layer (flash-linear-attention, fla/layers/mamba2.py), each of its prefill paths (layer entry):

    fla.mamba2_triton  cuda_kernels_forward in eval mode: fla's Triton causal conv1d (the "triton" conv backend,
                       used wherever causal_conv1d is absent), mamba_ssm's mamba_chunk_scan_combined, fla's gated
                       RMSNorm, out_proj
    fla.mamba2_fused   cuda_kernels_forward in training mode: mamba_ssm's mamba_split_conv1d_scan_combined
    fla.mamba2_torch   torch_forward: the layer in torch around fla's Triton swish and gated RMSNorm (what
                       forward() runs off a GPU or without mamba_ssm)

Built with the case's configuration (num_heads, head_dim, hidden_size = d_model, state_size, expand, n_groups,
conv_kernel, use_conv_bias, D_has_hdim, rmsnorm, norm_before_gate, dt_limit, use_bias, norm_eps, chunk_size)
and driven with the case's weights (harness/sides/adapters/layer_loading.py). The layer has no SwiGLU branch (d_inner is
d_ssm) and no seq_idx. Its Triton paths reach mamba_ssm's kernels, which fla imports when its module loads:
mamba_ssm is loaded first (ssdiff.sides.upstream), with the causal_conv1d stand-in.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from typing import Optional

import torch

from ssdiff import runtime
from ssdiff.sides import upstream
from ssdiff.model.case import Case
from ssdiff.model.features import NEEDS_SEQ_IDX
from ssdiff.sides.registry import register
from ssdiff.sides.base import UPSTREAM, Capabilities, Testing
from ssdiff.sides.adapters.layer_loading import LAYER, LAYER_PINNED, Construction, LayerImplementation
from ssdiff.sides.adapters.mamba_ssm import conv_channels_8, mixer_stages

MODULE = "fla.layers.mamba2"
ALL_DTYPES = frozenset({"float32", "float16", "bfloat16"})
# fla's own Triton kernels, launched by every path (torch_forward too): the activation (ACT2FN["silu"], fla's
# swish, autotuned over 30 configs per width) and the gated RMSNorm. Natively they compile per conv width and
# norm group size, so the campaign draws from the compile pool and compiles them ahead (harness/campaign/pool.py).
FLA_KERNELS = ("fla.modules.activations.", "fla.modules.norm.layernorm_gated")


# What fla.layers.mamba2 imports from mamba_ssm when its module loads (inside try/except ImportError).
FROM_MAMBA = (("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
              ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
              ("mamba_ssm.ops.triton.ssd_combined", "mamba_split_conv1d_scan_combined"))


def fla_mamba2_module():
    """fla.layers.mamba2 with its kernel path: mamba_ssm's Triton ops. fla imports them when the module loads
    (`import fla` loads every layer); where that happened before ssdiff.sides.upstream made mamba_ssm importable (its
    package __init__ fails on a CPU), the names its import left None are filled from the loaded release."""
    mamba = upstream.mamba_ssm_problem() is None
    if mamba:
        upstream.mamba_ssm()
    runtime.configure()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(MODULE)
    # the layer logs "does not recommend using Triton's conv1d backend" at every construction, i.e. every case
    # (the adapters choose that backend on purpose), drowning a campaign's progress
    logging.getLogger(MODULE).setLevel(logging.ERROR)
    if mamba and module.mamba_chunk_scan_combined is None:
        for source, name in FROM_MAMBA:
            setattr(module, name, getattr(importlib.import_module(source), name))
        module.is_fast_path_available = True
    return module


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("flash-linear-attention")
    except metadata.PackageNotFoundError:
        return "unknown"


class FlaLayer(LayerImplementation):
    path = "torch"          # torch | triton | fused

    def __init__(self):
        super().__init__()
        self._caps = None

    def unavailable(self) -> Optional[str]:
        if importlib.util.find_spec("fla") is None or importlib.util.find_spec("fla.layers") is None:
            return "package flash-linear-attention (fla.layers) is not installed"
        try:
            module = fla_mamba2_module()
        except Exception as err:
            return f"{MODULE} does not import here ({upstream.one_line(err)})"
        if self.path != "torch":
            if module.mamba_chunk_scan_combined is None:
                return (f"{MODULE}'s kernel path needs mamba_ssm's Triton ops "
                        f"({upstream.mamba_ssm_problem() or 'they did not import'})")
            return runtime.no_triton_reason()
        return None

    @property
    def capabilities(self) -> Capabilities:
        if self._caps is None:
            kernels = self.path != "torch"
            self._caps = Capabilities(
                entries=frozenset({"layer"}),
                dtypes=frozenset(runtime.runnable_dtypes()) if kernels else ALL_DTYPES,
                devices=(runtime.kernel_devices() or frozenset({"cuda"})) if kernels else frozenset({"cpu", "cuda"}),
                # decoding: the cached prefill runs the eval path's code (no fused kernel under use_cache)
                unsupported=NEEDS_SEQ_IDX | {"d_nonssm"} | ({"layer_steps"} if self.path == "fused" else set()),
                limits=(conv_channels_8,) if self.path == "fused" else (),
                stages=("in_proj",) + (("conv", "dt", "dA_cumsum", "chunk_states", "passed_states", "CB", "scan",
                                        "skip") if self.path == "fused" else ())
                + (("normed",) if self.path != "fused" else ()))
        return self._caps

    def skip_reason(self, case: Case, device: str) -> Optional[str]:
        if self.path != "torch" and self.unavailable() is None:
            why = runtime.dtype_skip_reason(case.dtype)
            if why:
                return f"{self.name}: {why}"
        return super().skip_reason(case, device)

    def kernel_modules(self) -> tuple:
        if self.unavailable():
            return ()
        import sys
        prefixes = FLA_KERNELS + (("mamba_ssm.ops.triton.", "fla.modules.conv") if self.path != "torch" else ())
        return tuple(m for name, m in sorted(sys.modules.items()) if name.startswith(prefixes))

    def construction(self, case: Case) -> Construction:
        return Construction(MODULE, "Mamba2", dict(
            num_heads=case.nheads, head_dim=case.headdim, hidden_size=case.d_model, state_size=case.dstate,
            expand=case.expand, n_groups=case.ngroups, conv_kernel=case.conv_width, use_conv_bias=case.conv_bias,
            hidden_act="silu", D_has_hdim=case.D == "channel", rmsnorm=case.rmsnorm,
            norm_before_gate=case.norm_before_gate, dt_limit=case.dt_limit_or_default, use_bias=case.bias,
            norm_eps=case.rmsnorm_eps, chunk_size=case.chunk_size, backend="triton"),
            method=self.method, train=self.path == "fused")

    def build(self, case: Case):
        fla_mamba2_module()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return super().build(case)

    def invoke(self, case, how, layer, u, **kwargs):
        """Decoding (``case.layer_steps``) as fla's forward() drives it with a cache: the prefill with
        ``use_cache`` returns the conv and SSM states, then each token goes through the same method with them as
        ``last_state`` (the layer's single-token path: causal_conv1d_update and selective_state_update on the
        kernel path, their torch forms on the torch path)."""
        if not case.layer_steps:
            return super().invoke(case, how, layer, u, **kwargs)
        method = getattr(layer, how.method)
        prefill = case.seqlen - case.layer_steps
        out, conv_state, ssm_state = method(u[:, :prefill], None, True)
        outs = [out]
        for t in range(prefill, case.seqlen):
            out, conv_state, ssm_state = method(u[:, t:t + 1], {"conv_state": conv_state,
                                                                 "recurrent_state": ssm_state}, True)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def kernel_stages(self, case, zxbcdt, t, inputs) -> dict:
        if self.path != "fused":
            return {}
        weights = dict(zxbcdt=zxbcdt, conv1d_weight=t["conv1d_weight"], conv1d_bias=t.get("conv1d_bias"),
                       A=-torch.exp(t["A_log"].detach().float()), D=t["D"], dt_bias=t["dt_bias"])
        return mixer_stages(upstream.mamba_ssm(), case, weights, inputs)

    def notes(self) -> list:
        notes = [f"flash-linear-attention {_version()}"]
        if self.path == "fused":
            notes += upstream.mamba_ssm().notes(("causal_conv1d",))
        return notes


class FlaLayerTriton(FlaLayer):
    name = "fla.mamba2_triton"
    description = ("fla Mamba2 layer, cuda_kernels_forward (eval): fla's Triton conv1d, mamba_chunk_scan_combined, "
                   "fla's gated RMSNorm; fwd + bwd")
    path = "triton"
    method = "cuda_kernels_forward"


class FlaLayerFused(FlaLayer):
    name = "fla.mamba2_fused"
    description = "fla Mamba2 layer, cuda_kernels_forward (training): mamba_split_conv1d_scan_combined; fwd + bwd"
    path = "fused"
    method = "cuda_kernels_forward"


class FlaLayerTorch(FlaLayer):
    name = "fla.mamba2_torch"
    description = ("fla Mamba2 layer, torch_forward (torch around fla's Triton swish and gated RMSNorm; what forward() runs "
                   "off a GPU or without mamba_ssm); fwd + bwd")
    path = "torch"
    method = "torch_forward"
    # torch around a few Triton kernels that run on any device it does: no program budget
    testing = Testing(domains=(dataclasses.replace(UPSTREAM, program_budget=None), LAYER), pinned=LAYER_PINNED)


for _impl in (FlaLayerTriton(), FlaLayerFused(), FlaLayerTorch()):
    register(_impl)
