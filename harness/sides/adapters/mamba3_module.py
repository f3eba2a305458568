"""mamba_ssm's Mamba3 module (mamba_ssm/modules/mamba3.py; the mamba3_layer entry, harness/truth/mamba3_layer.py):

    mamba_ssm.mamba3_module       Mamba3(is_mimo=False): in_proj, dt and A, the B/C norms, mamba3_siso_combined,
                                  the output norm (is_outproj_norm: the case's rmsnorm), out_proj; backward through
                                  autograd; cu_seqlens from the case's segments. With layer_steps k: forward over
                                  the first L - k tokens with an inference cache (which the forward fills with the
                                  four final states), then step() once per token from them (the CuTe step function)
    mamba_ssm.mamba3_module_mimo  Mamba3(is_mimo=True): not driven (`unavailable` says why)

Built with the case's configuration (d_model, d_state, expand, headdim, ngroups, rope_fraction, is_outproj_norm,
chunk_size) and driven with the case's weights (harness/sides/adapters/layer_loading.py): B_bias and C_bias are
the case's k_bias and q_bias (h, 1, n). GPU only, like the scan's adapters (harness/sides/adapters/mamba3.py):
bfloat16 cases (the kernels cast q, k, v to it), their shape limits, and the module's own: its norms' eps fixed at
1e-5; step() expands the B/C heads to nheads (ngroups 1 or nheads) and needs the CuTe step function
(nvidia-cutlass-dsl), which a limit names where it does not import.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from ssdiff import runtime
from ssdiff.model.bounds import Bounds
from ssdiff.model.case import Case
from ssdiff.sides import upstream
from ssdiff.sides.adapters.layer_loading import Construction, LayerImplementation
from ssdiff.sides.adapters.mamba3 import INTERPRETER, LIMITS
from ssdiff.sides.adapters.mamba_ssm_layer import InferenceCache
from ssdiff.sides.base import Capabilities, Domain, Implementation, Testing, limit
from ssdiff.sides.registry import register

MODULE = "mamba_ssm.modules.mamba3"
MIMO_KERNELS = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo"


def mamba3_module():
    upstream.mamba_ssm()                # the bare package, so that the submodules import
    return importlib.import_module(MODULE)


def module_problem() -> Optional[str]:
    """Why mamba_ssm's Mamba3 module cannot be loaded here, in one line, or None."""
    problem = upstream.mamba_ssm_problem()
    if problem:
        return problem
    try:
        mamba3_module()
    except Exception as err:
        return f"{upstream.mamba_ssm().label}: {MODULE} does not import here ({upstream.one_line(err)})"
    return None


def step_problem() -> Optional[str]:
    """Why Mamba3.step() cannot run here (its CuTe step function did not import), or None."""
    try:
        if mamba3_module().mamba3_step_fn is not None:
            return None
        importlib.import_module("mamba_ssm.ops.cute.mamba3.mamba3_step_fn")
    except Exception as err:
        return upstream.one_line(err)
    return "mamba3_step_fn is None"


MODULE_LIMITS = LIMITS + (
    limit(lambda c: c.rmsnorm_eps != 1e-5, "Mamba3 fixes its norms' eps at 1e-5 (no argument for it)"),
    limit(lambda c: c.layer_steps and c.ngroups not in (1, c.nheads),
          "step() expands the B/C heads to nheads (B.expand): decoding needs ngroups 1 or nheads"),
    lambda c: (f"step() needs the CuTe step function (nvidia-cutlass-dsl, quack-kernels), which does not import "
               f"here: {step_problem()}") if c.layer_steps and step_problem() else None,
)
MODULE_DOMAIN = Domain(interpreted=Bounds(max_batch=1, max_seqlen=8, max_nheads=1, max_headdim=4, max_dstate=4,
                                          chunk_sizes=(16,)),
                       native=Bounds(max_batch=2, max_seqlen=300, max_nheads=8, max_headdim=128, max_dstate=128,
                                     chunk_sizes=(16, 32, 64)),
                       entries=("mamba3_layer",), native_examples=(8, 8), configs=(1, 1), program_budget=None)


class Mamba3Module(LayerImplementation):
    name = "mamba_ssm.mamba3_module"
    description = ("mamba_ssm Mamba3 module, SISO (in_proj, B/C norms, mamba3_siso_combined, out_proj; fwd + bwd; "
                   "step() for layer_steps)")
    capabilities = Capabilities(entries=frozenset({"mamba3_layer"}), dtypes=frozenset({"bfloat16"}),
                                devices=frozenset({"cuda"}), backward=True, limits=MODULE_LIMITS)
    testing = Testing(domains=(MODULE_DOMAIN,), pinned=())

    def unavailable(self) -> Optional[str]:
        problem = module_problem()
        if problem:
            return problem
        if runtime.interpreted():
            return INTERPRETER.format(" and TMA tensor descriptors")
        return runtime.no_triton_reason()

    def kernel_modules(self) -> tuple:
        if self.unavailable():
            return ()
        import sys

        mamba3_module()
        return (sys.modules["mamba_ssm.ops.triton.mamba3.mamba3_siso_combined"],)

    def construction(self, case: Case) -> Construction:
        return Construction(MODULE, "Mamba3", dict(
            d_model=case.d_model, d_state=case.dstate, expand=case.dim // case.d_model, headdim=case.headdim,
            ngroups=case.ngroups, rope_fraction=case.rope_fraction, is_outproj_norm=case.rmsnorm, is_mimo=False,
            chunk_size=case.chunk_size, layer_idx=0), cu_seqlens=True)

    def build(self, case: Case):
        mamba3_module()
        return super().build(case)

    def parameters(self, case: Case, t: dict) -> dict:
        out = {"in_proj.weight": t["in_proj_weight"], "dt_bias": t["dt_bias"], "B_bias": t["k_bias"][:, None],
               "C_bias": t["q_bias"][:, None], "B_norm.weight": t["k_norm_weight"],
               "C_norm.weight": t["q_norm_weight"], "D": t["D"], "out_proj.weight": t["outproj_weight"]}
        if case.rmsnorm:
            out["norm.weight"] = t["rmsnorm_weight"]
        return out

    def invoke(self, case, how, layer, u, **kwargs):
        if not case.layer_steps:
            return layer(u, **kwargs)
        # Mamba3.forward's own step branch hands step() a (b, 1, d_model) token, which step()'s rearranges do not
        # take: the prefill fills the cache through forward, the tokens go to step() as generation's (b, d_model)
        prefill = case.seqlen - case.layer_steps
        cache = InferenceCache()
        outs = [layer(u[:, :prefill], inference_params=cache)]
        states = cache.key_value_memory_dict[layer.layer_idx]
        for t in range(prefill, case.seqlen):
            outs.append(layer.step(u[:, t], *states)[0][:, None])
        return torch.cat(outs, dim=1)


class Mamba3ModuleMimo(Implementation):
    """The MIMO module, recorded so that `ssdiff list` says why it is not driven."""

    name = "mamba_ssm.mamba3_module_mimo"
    description = "mamba_ssm Mamba3 module, MIMO (is_mimo=True: TileLang kernels)"
    capabilities = Capabilities(entries=frozenset({"mamba3_layer"}), dtypes=frozenset({"bfloat16"}),
                                devices=frozenset({"cuda"}))

    def unavailable(self) -> Optional[str]:
        problem = module_problem()
        if problem:
            return problem
        try:
            importlib.import_module(MIMO_KERNELS)
            kernels = ""
        except Exception as err:
            kernels = f"; its TileLang kernels do not import here ({upstream.one_line(err)})"
        return f"not driven: ssdiff's float64 Mamba3 account is SISO only (no mimo_rank > 1 projections){kernels}"


register(Mamba3Module())
register(Mamba3ModuleMimo())
