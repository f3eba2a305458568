"""transformers' Mamba2Mixer (transformers/models/mamba2/modeling_mamba2.py) as a layer (layer entry):

    transformers.mamba2_mixer   Mamba2Mixer.forward without a cache: in_proj, the causal conv1d, the chunked
                                scan, MambaRMSNormGated, out_proj — each a function that transformers takes from
                                the Hugging Face kernel hub where the `kernels` package is installed and fetches
                                them, and otherwise runs in plain torch (its fallbacks: what runs here)

Built from a Mamba2Config with the case's configuration (num_heads, head_dim, hidden_size = d_model, state_size,
expand, n_groups, conv_kernel, use_conv_bias, use_bias, chunk_size, time_step_limit, layer_norm_epsilon) and
driven with the case's weights (harness/impls/layer_loading.py). What the mixer cannot express: a per-channel D,
the SwiGLU branch, seq_idx, a layer without its gated RMSNorm, the norm before the gate (it always gates
first). transformers 5 has no cuda_kernels_forward any more: its GPU path is the hub kernels, which need network
access and the `kernels` package; ssdiff does not fetch them.
"""

from __future__ import annotations

import importlib
from typing import Optional

from harness.case import Case
from harness.features import NEEDS_SEQ_IDX
from harness.impls import register
from harness.impls.base import Capabilities, limit
from harness.impls.layer_loading import Construction, LayerImplementation

MODULE = "transformers.models.mamba2.modeling_mamba2"

always_normed = limit(lambda c: not c.rmsnorm, "Mamba2Mixer always applies its gated RMSNorm (rmsnorm must be on)")
gate_first = limit(lambda c: c.norm_before_gate,
                   "Mamba2Mixer always gates before its RMSNorm (norm_before_gate must be false)")


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "unknown"


class Mamba2Mixer(LayerImplementation):
    name = "transformers.mamba2_mixer"
    description = ("transformers Mamba2Mixer.forward (no cache): its torch fallbacks where no hub kernel is "
                   "installed; fwd + bwd")
    capabilities = Capabilities(entries=frozenset({"layer"}),
                                unsupported=NEEDS_SEQ_IDX | {"d_nonssm", "D_channel", "layer_steps"},
                                limits=(always_normed, gate_first), stages=("in_proj", "normed"))

    def unavailable(self) -> Optional[str]:
        if importlib.util.find_spec("transformers") is None:
            return "package transformers is not installed"
        try:
            importlib.import_module(MODULE)
        except Exception as err:
            return f"{MODULE} does not import here ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        return None

    def construction(self, case: Case) -> Construction:
        return Construction(MODULE, "Mamba2Mixer", dict(layer_idx=0), config_class="Mamba2Config", config=dict(
            num_heads=case.nheads, head_dim=case.headdim, hidden_size=case.d_model, state_size=case.dstate,
            expand=case.expand, n_groups=case.ngroups, conv_kernel=case.conv_width, use_conv_bias=case.conv_bias,
            use_bias=case.bias, chunk_size=case.chunk_size, time_step_limit=case.dt_limit_or_default,
            layer_norm_epsilon=case.rmsnorm_eps, hidden_act="silu", num_hidden_layers=1))

    def notes(self) -> list:
        return [f"transformers {_version()} (torch fallbacks: no hub kernel installed)"]


register(Mamba2Mixer())
