"""Running a whole Mamba-2 layer (an upstream ``nn.Module``) on a case's weights: the common ground of the layer
adapters (harness/sides/adapters/mamba_ssm_layer.py, fla_layer.py, transformers_layer.py).

The weights are the case's (harness/inputs/ draws them once); each adapter only says how its module is built
from the case's configuration and which method runs it (`construction`, data that repro.py writes out too) and
which parameter holds which of the case's tensors (`parameters`). The module's own parameters are never used:
``torch.func.functional_call`` runs the method with the case's tensors in their place, so every implementation
computes with the same numbers and the gradients land on the case's leaves (every parameter's, and the input's).

Stages a module exposes without being changed: ``in_proj`` (its in_proj's output, zxbcdt) and ``normed`` (what
reaches its out_proj: the gated RMSNorm's output with the SwiGLU branch in front) where the layer calls those
submodules; adapters add what their kernels expose.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.model.bounds import Bounds
from ssdiff.sides.base import UPSTREAM, Domain, Implementation, Pinned, Testing
from ssdiff.inputs import Inputs


@dataclass(frozen=True)
class Construction:
    """How a layer module is built and called, as data (repro.py writes the same call out): ``module``.``factory``
    (**kwargs), or with ``config`` ``factory(config_class(**config), **kwargs)``; then ``method`` in training mode
    when ``train``, passed seq_idx when ``seq_idx``, cu_seqlens when ``cu_seqlens``."""

    module: str
    factory: str
    kwargs: dict
    method: str = "forward"
    train: bool = False
    config_class: Optional[str] = None
    config: dict = field(default_factory=dict)
    seq_idx: bool = False
    cu_seqlens: bool = False

    def build(self) -> nn.Module:
        module = importlib.import_module(self.module)
        factory = getattr(module, self.factory)
        if self.config_class:
            return factory(getattr(module, self.config_class)(**self.config), **self.kwargs)
        return factory(**self.kwargs)


class _Calling(nn.Module):
    """``run(module, *args)`` as a module's forward, so functional_call can swap the parameters in."""

    def __init__(self, module: nn.Module, run):
        super().__init__()
        self.inner = module
        self.run = run

    def forward(self, *args, **kwargs):
        return self.run(self.inner, *args, **kwargs)


def layer_config_key(case: Case) -> tuple:
    """What a layer module is built from (its weights aside): equal keys build interchangeable modules."""
    return (case.d_model, case.nheads, case.headdim, case.ngroups, case.dstate, case.conv_width, case.chunk_size,
            case.d_nonssm, case.D, case.rmsnorm, case.norm_before_gate, case.rmsnorm_eps, case.dt_limit, case.bias,
            case.conv_bias, case.entry, case.rope_fraction)


# The layer entry's own cases: a layer runs in_proj, the conv, five SSD kernels, the norm and out_proj, so small
# shapes under the interpreter; one example per pass and dtype, config 0, besides what UPSTREAM draws.
LAYER = Domain(interpreted=Bounds(max_batch=2, max_seqlen=20, max_nheads=4, max_headdim=6, max_dstate=6,
                                  chunk_sizes=(4, 8, 16)),
               native=Bounds(max_batch=2, max_seqlen=256, max_nheads=16, max_headdim=64, max_dstate=64),
               entries=("layer",), examples=(1, 1), native_examples=(1, 1), configs=(1, 1), program_budget=None)
_LAYER = dict(entry="layer", return_final_states=False, rmsnorm_eps=1e-5, norm_before_gate=False)
LAYER_PINNED = (
    Pinned(Case(**_LAYER, batch=2, seqlen=9, nheads=4, ngroups=1, headdim=4, dstate=4, chunk_size=4, d_model=8,
                rmsnorm=True, bias=True, pass_="backward")),
    Pinned(Case(**_LAYER, batch=2, seqlen=7, nheads=2, ngroups=2, headdim=4, dstate=4, chunk_size=4, d_model=4,
                d_nonssm=8, rmsnorm=True, layer_steps=3), last_dtype=True),
    # one token through a norm over one group: y is x scaled, the norm undoes the scale, and the gradient of D is
    # the eps term alone (1e-4) — within budget only because the model stores the scan output the norm reads
    Pinned(Case(**_LAYER, seqlen=1, nheads=1, headdim=6, dstate=1, chunk_size=4, conv_width=1, d_model=1,
                conv_bias=False, rmsnorm=True, pass_="backward"), last_dtype=True),
)
# A layer whose kernels are Triton: the upstream adapters' cases and the layer's own.
LAYER_TESTING = Testing(domains=(UPSTREAM, LAYER), pinned=LAYER_PINNED)


class LayerImplementation(Implementation):
    """A Mamba-2 layer module driven with the case's weights. Subclasses write `construction` (and may change
    `parameters`, `kernel_stages`)."""

    testing = LAYER_TESTING

    def __init__(self):
        self._modules: dict = {}

    def construction(self, case: Case) -> Construction:
        """How the module configured like ``case`` is built and called."""
        raise TypeError(f"{type(self).__name__} must define construction()")

    def build(self, case: Case) -> nn.Module:
        """A fresh module configured like ``case`` (on the CPU; its parameters are replaced at every call)."""
        return self.construction(case).build()

    def parameters(self, case: Case, t: dict) -> dict:
        """The module's parameter names -> the case's tensors (views allowed: gradients reach the leaves)."""
        return common_parameters(case, t)

    def invoke(self, case: Case, how: Construction, layer: nn.Module, u: torch.Tensor, **kwargs):
        """Run ``layer`` (its parameters already the case's) on u: its ``how.method``; adapters that decode
        (``case.layer_steps``) run the prefill and the steps here."""
        return getattr(layer, how.method)(u, **kwargs)

    def kernel_stages(self, case: Case, zxbcdt: torch.Tensor, t: dict, inputs: Inputs) -> dict:
        """Stages of the layer's kernels, computed from its own in_proj output (oracle layouts); none here."""
        return {}

    def module(self, case: Case) -> nn.Module:
        key = layer_config_key(case)
        if key not in self._modules:
            if len(self._modules) > 32:
                self._modules.clear()
            self._modules[key] = self.build(case)
        return self._modules[key]

    def forward(self, case: Case, tensors: dict, inputs: Inputs, want_stages: bool) -> Evaluation:
        module = self.module(case)
        how = self.construction(case)
        module.train(how.train)
        wrapper = _Calling(module, lambda layer, u, **kw: self.invoke(case, how, layer, u, **kw))
        params = {f"inner.{name}": value for name, value in self.parameters(case, tensors).items()}
        missing = sorted({f"inner.{n}" for n, _ in module.named_parameters()} - set(params))
        if missing:
            raise RuntimeError(f"{self.name}: no case tensor for the module's parameters {missing}")
        recorded: dict = {}
        hooks = []
        want_stages = want_stages and not case.layer_steps    # a decoded layer's steps expose no stages
        if want_stages:
            hooks.append(module.in_proj.register_forward_hook(
                lambda mod, args, out: recorded.__setitem__("in_proj", out.detach())))
            if case.rmsnorm or case.d_nonssm:
                hooks.append(module.out_proj.register_forward_pre_hook(
                    lambda mod, args: recorded.__setitem__("normed", args[0].detach())))
        try:
            kwargs = dict(seq_idx=inputs.seq_idx) if how.seq_idx else {}
            if how.cu_seqlens and inputs.cu_seqlens is not None:
                kwargs["cu_seqlens"] = inputs.cu_seqlens
            y = torch.func.functional_call(wrapper, params, (tensors["u"],), kwargs)
            y = y[0] if isinstance(y, tuple) else y
        finally:
            for hook in hooks:
                hook.remove()
        stages = {}
        if want_stages and "in_proj" in recorded:
            stages["in_proj"] = recorded["in_proj"]
            stages.update(self.kernel_stages(case, recorded["in_proj"], tensors, inputs))
            if "normed" in recorded:
                stages["normed"] = recorded["normed"]
        return Evaluation(outputs={"y": y}, stages=stages, notes=self.notes())

    def notes(self) -> list:
        return []


# The parameter names the three layers share -> the case's tensor each holds.
PARAMETER_SOURCES = (("in_proj.weight", "in_proj_weight"), ("in_proj.bias", "in_proj_bias"),
                     ("conv1d.weight", "conv1d_weight"), ("conv1d.bias", "conv1d_bias"), ("dt_bias", "dt_bias"),
                     ("A_log", "A_log"), ("D", "D"), ("norm.weight", "rmsnorm_weight"),
                     ("out_proj.weight", "outproj_weight"), ("out_proj.bias", "outproj_bias"))
# How a case tensor is viewed as the layer parameter: (tensor method, argument). conv1d's weight is (channels, 1,
# width) in an nn.Conv1d; D is flat ((h,), or D_has_hdim's (h * p,)).
PARAMETER_VIEWS = {"conv1d_weight": ("unsqueeze", 1), "D": ("reshape", -1)}


def parameter_view(key: str, tensor: torch.Tensor) -> torch.Tensor:
    if key not in PARAMETER_VIEWS:
        return tensor
    method, arg = PARAMETER_VIEWS[key]
    return getattr(tensor, method)(arg)


def common_parameters(case: Case, t: dict) -> dict:
    """The layer's parameter names (PARAMETER_SOURCES) -> views of the case's tensors (PARAMETER_VIEWS)."""
    return {name: parameter_view(key, t[key]) for name, key in PARAMETER_SOURCES if key in t}


__all__ = ["Construction", "LayerImplementation", "common_parameters", "layer_config_key", "PARAMETER_SOURCES",
           "PARAMETER_VIEWS"]
