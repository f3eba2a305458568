"""Running a whole Mamba-2 layer (an upstream ``nn.Module``) on a case's weights: the common ground of the layer
adapters (harness/impls/mamba_ssm_layer.py, fla_layer.py, transformers_layer.py).

The weights are the case's (harness/inputs.py draws them once); each adapter only says how its module is built
from the case's configuration (`build`), which parameter holds which of the case's tensors (`parameters`) and
which method runs it (`call`). The module's own parameters are never used: ``torch.func.functional_call``
runs the method with the case's tensors in their place, so every implementation computes with the same
numbers and the gradients land on the case's leaves (every parameter's, and the input's).

Stages a module exposes without being changed: ``in_proj`` (its in_proj's output, zxbcdt) and ``normed`` (what
reaches its out_proj: the gated RMSNorm's output with the SwiGLU branch in front) where the layer calls those
submodules; adapters add what their kernels expose.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from harness.case import Case
from harness.evaluation import Evaluation
from harness.impls.base import Implementation
from harness.inputs import Inputs


class _Method(nn.Module):
    """``module.<method>(*args)`` as a module's forward, so functional_call can swap the parameters in."""

    def __init__(self, module: nn.Module, method: str):
        super().__init__()
        self.inner = module
        self.method = method

    def forward(self, *args, **kwargs):
        return getattr(self.inner, self.method)(*args, **kwargs)


def layer_config_key(case: Case) -> tuple:
    """What a layer module is built from (its weights aside): equal keys build interchangeable modules."""
    return (case.d_model, case.nheads, case.headdim, case.ngroups, case.dstate, case.conv_width, case.chunk_size,
            case.d_nonssm, case.D, case.rmsnorm, case.norm_before_gate, case.rmsnorm_eps, case.dt_limit, case.bias,
            case.conv_bias)


class LayerImplementation(Implementation):
    """A Mamba-2 layer module driven with the case's weights. Subclasses write `build`, `parameters`, `call`."""

    method = "forward"

    def __init__(self):
        self._modules: dict = {}

    def build(self, case: Case) -> nn.Module:
        """A fresh module configured like ``case`` (on the CPU; its parameters are replaced at every call)."""
        raise NotImplementedError

    def parameters(self, case: Case, t: dict) -> dict:
        """The module's parameter names -> the case's tensors (views allowed: gradients reach the leaves)."""
        raise NotImplementedError

    def call(self, case: Case, runner, u: torch.Tensor, inputs: Inputs) -> torch.Tensor:
        """Run ``runner`` (the module's method under functional_call) on u; return y (b, L, d_model)."""
        out = runner(u)
        return out[0] if isinstance(out, tuple) else out

    def prepare(self, module: nn.Module, case: Case) -> None:
        """Put ``module`` in the mode this adapter drives (train / eval), before each call."""
        module.eval()

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
        self.prepare(module, case)
        wrapper = _Method(module, self.method)
        params = {f"inner.{name}": value for name, value in self.parameters(case, tensors).items()}
        missing = sorted({f"inner.{n}" for n, _ in module.named_parameters()} - set(params))
        if missing:
            raise RuntimeError(f"{self.name}: no case tensor for the module's parameters {missing}")
        recorded: dict = {}
        hooks = []
        if want_stages:
            hooks.append(module.in_proj.register_forward_hook(
                lambda mod, args, out: recorded.__setitem__("in_proj", out.detach())))
            if case.rmsnorm or case.d_nonssm:
                hooks.append(module.out_proj.register_forward_pre_hook(
                    lambda mod, args: recorded.__setitem__("normed", args[0].detach())))
        try:
            y = self.call(case, lambda *a, **k: torch.func.functional_call(wrapper, params, a, k), tensors["u"], inputs)
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


def common_parameters(case: Case, t: dict, D_flat: bool = True) -> dict:
    """The parameter names the three layers share (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""
    out = {"in_proj.weight": t["in_proj_weight"], "conv1d.weight": t["conv1d_weight"].unsqueeze(1),
           "dt_bias": t["dt_bias"], "A_log": t["A_log"], "D": t["D"].reshape(-1) if D_flat else t["D"],
           "out_proj.weight": t["outproj_weight"]}
    for name, key in (("in_proj.bias", "in_proj_bias"), ("conv1d.bias", "conv1d_bias"), ("norm.weight", "rmsnorm_weight"),
                      ("out_proj.bias", "outproj_bias")):
        if key in t:
            out[name] = t[key]
    return out


__all__ = ["LayerImplementation", "common_parameters", "layer_config_key"]
