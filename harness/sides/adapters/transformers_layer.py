"""transformers' Mamba2Mixer (transformers/models/mamba2/modeling_mamba2.py) as a layer (layer entry):

    transformers.mamba2_mixer   Mamba2Mixer.forward: in_proj, the causal conv1d, the chunked scan,
                                MambaRMSNormGated, out_proj, with transformers' torch fallbacks for the conv and
                                the scan; decoding (layer_steps) through a DynamicCache, as generate() does

transformers picks each of those functions when its module is imported: a Hugging Face hub kernel where the
`kernels` package is asked for one, else the original package's (causal_conv1d, mamba_ssm) where it imports,
else its torch fallback. Which one would run here then depends on whether mamba_ssm was importable when
modeling_mamba2 was first imported (ssdiff.sides.upstream makes it so on a CPU). The adapter runs the torch fallbacks
whatever the import order (the functions transformers wrapped, `__wrapped__`, in place of its module's names for
the call): the path of every install without mamba-ssm and causal-conv1d. With mamba-ssm the mixer calls
mamba_ssm's kernels, which the mamba_ssm adapters judge already.

Built from a Mamba2Config with the case's configuration (num_heads, head_dim, hidden_size = d_model, state_size,
expand, n_groups, conv_kernel, use_conv_bias, use_bias, chunk_size, time_step_limit, layer_norm_epsilon) and
driven with the case's weights (harness/sides/adapters/layer_loading.py). What the mixer cannot express: a per-channel D,
the SwiGLU branch, seq_idx, a layer without its gated RMSNorm, the norm before the gate (it always gates
first). transformers 5 has no cuda_kernels_forward any more: its GPU path is the hub kernels, which need network
access and the `kernels` package; ssdiff does not fetch them.
"""

from __future__ import annotations

import dataclasses
import importlib
import contextlib
from typing import Optional

import torch

from ssdiff.model.case import Case
from ssdiff.model.features import NEEDS_SEQ_IDX
from ssdiff.sides.registry import register
from ssdiff.sides.base import Capabilities, Testing, limit
from ssdiff.sides.adapters.layer_loading import LAYER, LAYER_PINNED, Construction, LayerImplementation

MODULE = "transformers.models.mamba2.modeling_mamba2"

# The module's names for the functions transformers picks at import (hub kernel, original package or torch).
PICKED = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_split_conv1d_scan_combined",
          "mamba2_selective_state_update", "mamba2_chunk_scan")


@contextlib.contextmanager
def torch_fallbacks():
    """modeling_mamba2's picked functions replaced by the torch functions they wrap, for the duration."""
    module = importlib.import_module(MODULE)
    saved = {name: getattr(module, name) for name in PICKED}
    for name, picked in saved.items():
        setattr(module, name, getattr(picked, "__wrapped__", picked))
    try:
        yield
    finally:
        for name, picked in saved.items():
            setattr(module, name, picked)


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
    description = ("transformers Mamba2Mixer.forward with its torch fallbacks; fwd + bwd; decoding through a "
                   "DynamicCache")
    capabilities = Capabilities(entries=frozenset({"layer"}),
                                unsupported=NEEDS_SEQ_IDX | {"d_nonssm", "D_channel"},
                                limits=(always_normed, gate_first), stages=("in_proj", "normed"))
    # the layer's own cases alone (torch, fast anywhere), two per pass and dtype: a property's first example is
    # hypothesis's simplest case
    testing = Testing(domains=(dataclasses.replace(LAYER, examples=(2, 2), native_examples=(2, 2)),),
                      pinned=LAYER_PINNED)

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

    def invoke(self, case, how, layer, u, **kwargs):
        """The mixer on u; decoding (``case.layer_steps``) as generate() drives it: a DynamicCache built from
        the layer's config, the prefill through forward() with it (it stores the conv and SSM states), then one
        token per call (the mixer's single-token path: causal_conv1d_update, selective_state_update)."""
        with torch_fallbacks():
            if not case.layer_steps:
                return layer(u, **kwargs)
            from transformers import DynamicCache

            module = importlib.import_module(MODULE)
            cache = DynamicCache(config=getattr(module, how.config_class)(**how.config))
            prefill = case.seqlen - case.layer_steps
            outs = [layer(u[:, :prefill], cache_params=cache)]
            for t in range(prefill, case.seqlen):
                outs.append(layer(u[:, t:t + 1], cache_params=cache))
            return torch.cat(outs, dim=1)

    def notes(self) -> list:
        return [f"transformers {_version()}: its torch fallbacks for the conv and the scan"]


register(Mamba2Mixer())
