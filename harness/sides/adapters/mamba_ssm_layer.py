"""mamba_ssm's Mamba2 layer (mamba_ssm/modules/mamba2.py), both of its prefill paths (layer entry):

    mamba_ssm.mamba2_mem_eff     use_mem_eff_path=True: in_proj, then mamba_split_conv1d_scan_combined (conv1d,
                                 SSD, gated RMSNorm and out_proj fused)
    mamba_ssm.mamba2_no_mem_eff  use_mem_eff_path=False: in_proj, causal_conv1d_fn, mamba_chunk_scan_combined,
                                 the Triton gated RMSNorm (RMSNormGated), the SwiGLU branch in torch, out_proj;
                                 with layer_steps, generation's path: that prefill with an inference cache, then
                                 step() per token (the conv update in torch where causal_conv1d is absent,
                                 selective_state_update)

Built with the case's configuration (d_model, d_state, d_conv, expand, headdim, d_ssm, ngroups, D_has_hdim,
rmsnorm, norm_before_gate, dt_limit, bias, conv_bias, chunk_size) and driven with the case's weights
(harness/sides/adapters/layer_loading.py); seq_idx goes to forward(). The module imports causal_conv1d (absent on a
CPU): the float64-checked stand-in of harness/sides/standins.py takes its place and the verdict says so.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from ssdiff.sides import upstream
from ssdiff.model.case import Case
from ssdiff.sides.registry import register
from ssdiff.sides.base import Capabilities, limit
from ssdiff.sides.adapters.layer_loading import Construction, LayerImplementation
from ssdiff.sides.adapters.mamba_ssm import SCAN_STAGES, MambaImplementation, conv_channels_8, mixer_stages, padding_limits

MODULE = "mamba_ssm.modules.mamba2"

# Mamba2 builds its RMSNormGated with eps=1e-5 and takes no argument for it.
fixed_eps = limit(lambda c: c.rmsnorm and c.rmsnorm_eps != 1e-5,
                  "Mamba2 fixes the gated RMSNorm's eps at 1e-5 (no argument for it)")


def mamba2_module():
    """mamba_ssm.modules.mamba2, with the stand-ins in place of an absent causal_conv1d."""
    upstream.mamba_ssm()
    module = importlib.import_module(MODULE)
    upstream._install_conv_standins(module)
    return module


class InferenceCache:
    """What Mamba2.forward reads of mamba_ssm.utils.generation.InferenceParams (that module imports transformers'
    generation utilities; the layer needs only these two attributes)."""

    def __init__(self):
        self.seqlen_offset = 0
        self.key_value_memory_dict = {}


def decode_with_cache(layer, u: torch.Tensor, prefill: int) -> torch.Tensor:
    """Mamba2 as generation drives it: forward over the first ``prefill`` tokens with an inference cache (conv
    and SSM states filled), then one token per call, forward taking its step() path once seqlen_offset > 0.
    Returns the outputs of every token, (b, L, d_model)."""
    cache = InferenceCache()
    outs = [layer(u[:, :prefill], inference_params=cache)]
    cache.seqlen_offset = prefill
    for t in range(prefill, u.shape[1]):
        outs.append(layer(u[:, t:t + 1], inference_params=cache))
        cache.seqlen_offset += 1
    return torch.cat(outs, dim=1)


class MambaLayer(MambaImplementation, LayerImplementation):
    mem_eff = True
    uses = ("causal_conv1d",)

    def __init__(self):
        MambaImplementation.__init__(self)
        LayerImplementation.__init__(self)

    def unavailable(self) -> Optional[str]:
        problem = super().unavailable()
        if problem:
            return problem
        try:
            mamba2_module()
        except Exception as err:          # the module imports huggingface_hub and the distributed helpers
            return f"{self.release.label}: {MODULE} does not import here ({upstream.one_line(err)})"
        return None

    def detect(self, rel) -> Capabilities:
        stages = ("in_proj", "conv") + SCAN_STAGES[:-2] + ("skip",) + (() if self.mem_eff else ("normed",))
        # with an inference cache Mamba2 never takes its mem-eff path: decoding is the other adapter's
        return self.declared(entries=frozenset({"layer"}), limits=(conv_channels_8, fixed_eps) + padding_limits(rel),
                             stages=stages, unsupported=frozenset({"layer_steps"} if self.mem_eff else ()),
                             backward=True)

    def declared(self, **overrides) -> Capabilities:
        overrides.setdefault("entries", frozenset({"layer"}))
        return super().declared(**overrides)

    def construction(self, case: Case) -> Construction:
        return Construction(MODULE, "Mamba2", dict(
            d_model=case.d_model, d_state=case.dstate, d_conv=case.conv_width, expand=case.expand,
            headdim=case.headdim, d_ssm=case.dim, ngroups=case.ngroups, D_has_hdim=case.D == "channel",
            rmsnorm=case.rmsnorm, norm_before_gate=case.norm_before_gate, dt_limit=case.dt_limit_or_default,
            bias=case.bias, conv_bias=case.conv_bias, chunk_size=case.chunk_size, use_mem_eff_path=self.mem_eff,
            layer_idx=0),
            seq_idx=True)

    def build(self, case: Case):
        mamba2_module()
        return super().build(case)

    def invoke(self, case, how, layer, u, **kwargs):
        if not case.layer_steps:
            return layer(u, **kwargs)
        return decode_with_cache(layer, u, case.seqlen - case.layer_steps)

    def kernel_stages(self, case, zxbcdt, t, inputs) -> dict:
        weights = dict(zxbcdt=zxbcdt, conv1d_weight=t["conv1d_weight"], conv1d_bias=t.get("conv1d_bias"),
                       A=-torch.exp(t["A_log"].detach().float()), D=t["D"], dt_bias=t["dt_bias"])
        return mixer_stages(self.release, case, weights, inputs)


class MambaLayerMemEff(MambaLayer):
    name = "mamba_ssm.mamba2_mem_eff"
    description = ("mamba_ssm Mamba2 layer, use_mem_eff_path=True (in_proj + mamba_split_conv1d_scan_combined; "
                   "fwd + bwd)")
    mem_eff = True


class MambaLayerNoMemEff(MambaLayer):
    name = "mamba_ssm.mamba2_no_mem_eff"
    description = ("mamba_ssm Mamba2 layer, use_mem_eff_path=False (causal_conv1d, mamba_chunk_scan_combined, "
                   "RMSNormGated, out_proj; fwd + bwd)")
    mem_eff = False


for _impl in (MambaLayerMemEff(), MambaLayerNoMemEff()):
    register(_impl)
