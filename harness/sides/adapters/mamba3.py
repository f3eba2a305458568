"""Adapters for mamba_ssm's Mamba-3 SISO kernels (the mamba3 entry; harness/truth/README.md, "Mamba-3").

    mamba_ssm.mamba3_siso_combined   mamba3_siso_combined: the chunked forward and its backward, final states,
                                     initial states, cu_seqlens
    mamba_ssm.mamba3_siso_step       prefill-then-decode: mamba3_siso_combined over the first L - k tokens
                                     (returning its four final states), then mamba3_siso_step once per token
                                     from them (``mamba3_steps`` k >= 1; forward only)

Both run on a GPU only: their kernels use inline PTX (tl.inline_asm_elementwise for the cos, sin and tanh
approximations) and the combined forward TMA tensor descriptors with a CUDA allocator, which the Triton interpreter
cannot run (`unavailable` says so in one line). mamba3_siso_combined casts q, k, v, trap, angles and z to bfloat16
whatever it is given, so the adapters take bfloat16 cases; headdim and dstate must be powers of two of at least 8
(the TMA block shapes, 16 bytes at least), the rope angles even (its assertion), chunk_size at least 16 (tl.dot's
smallest block). The Mamba3 module
(its in_proj, B/C norms and MIMO path) is not adapted yet.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from ssdiff import runtime
from ssdiff.model.bounds import Bounds
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.sides import upstream
from ssdiff.sides.base import Capabilities, Domain, Implementation, Testing, limit
from ssdiff.sides.registry import register
from ssdiff.truth.mamba3 import STATE_INPUTS, STATE_OUTPUTS

MODULES = {"combined": "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined",
           "step": "mamba_ssm.ops.triton.mamba3.mamba3_siso_step"}
INTERPRETER = ("needs a GPU: its Triton kernels use inline PTX (tl.inline_asm_elementwise: cos/sin/tanh "
               "approximations){}, which the Triton interpreter cannot run")


def _power_of_two(v: int) -> bool:
    return v & (v - 1) == 0


LIMITS = (
    limit(lambda c: not (_power_of_two(c.headdim) and _power_of_two(c.dstate)),
          "needs headdim (headdim_v) and dstate (headdim_qk) powers of two (its TMA block shapes)"),
    limit(lambda c: c.rope_angles % 2, "needs an even number of rope angles (its assertion headdim_angles % 2 == 0)"),
    limit(lambda c: c.chunk_size < 16, "needs chunk_size >= 16 (tl.dot's smallest block)"),
    limit(lambda c: min(c.headdim, c.dstate) < 8,
          "needs headdim and dstate >= 8 (a TMA block's last dimension holds at least 16 bytes; below that Triton's "
          "compiler raises 'Descriptor block shape must have at least 16 bytes')"),
)
# On a GPU: headdim below, at and above 64, dstate up to 128, the chunk sizes the kernels are tuned for.
NATIVE = Domain(interpreted=Bounds(max_batch=1, max_seqlen=8, max_nheads=1, max_headdim=4, max_dstate=4,
                                   chunk_sizes=(16,)),
                native=Bounds(max_batch=2, max_seqlen=300, max_nheads=8, max_headdim=128, max_dstate=128,
                              chunk_sizes=(16, 32, 64)),
                entries=("mamba3",), native_examples=(8, 8))


class Mamba3Siso(Implementation):
    """mamba3_siso_combined (``steps`` False) or its prefill followed by mamba3_siso_step (``steps`` True)."""

    def __init__(self, steps: bool):
        self.steps = steps
        self.name = "mamba_ssm.mamba3_siso_step" if steps else "mamba_ssm.mamba3_siso_combined"
        self.description = ("mamba_ssm mamba3_siso_combined prefill, then mamba3_siso_step per token (Triton; "
                            "forward only)" if steps else "mamba_ssm mamba3_siso_combined (Triton; SISO Mamba-3)")
        needs_steps = (limit(lambda c: c.mamba3_steps == 0, "decodes the last mamba3_steps >= 1 tokens"),)
        self.capabilities = Capabilities(
            entries=frozenset({"mamba3"}), dtypes=frozenset({"bfloat16"}), devices=frozenset({"cuda"}),
            backward=not steps, unsupported=frozenset() if steps else frozenset({"mamba3_steps"}),
            limits=LIMITS + (needs_steps if steps else ()))
        self.testing = Testing(domains=(NATIVE,), pinned=())

    def functions(self):
        upstream.mamba_ssm()                # the bare package, so that the submodules import
        combined = importlib.import_module(MODULES["combined"]).mamba3_siso_combined
        step = importlib.import_module(MODULES["step"]).mamba3_siso_step if self.steps else None
        return combined, step

    def unavailable(self) -> Optional[str]:
        problem = upstream.mamba_ssm_problem()
        if problem:
            return problem
        try:
            self.functions()
        except Exception as err:
            return f"{upstream.mamba_ssm().label} has no usable Mamba-3 SISO kernels: {upstream.one_line(err)}"
        if runtime.interpreted():
            return INTERPRETER.format("" if self.steps else " and TMA tensor descriptors")
        return runtime.no_triton_reason()

    def kernel_modules(self) -> tuple:
        if self.unavailable():
            return ()
        import sys

        self.functions()
        return tuple(sys.modules[MODULES[k]] for k in (("combined", "step") if self.steps else ("combined",)))

    def forward(self, case: Case, tensors: dict, inputs, want_stages: bool):
        combined, step = self.functions()
        t = tensors
        by_head = lambda name, lo, hi: t[name][:, lo:hi].transpose(1, 2).contiguous()     # (b, h, T)  # noqa: E731
        L = case.seqlen
        P = L - case.mamba3_steps
        states = tuple(t[name] for name in STATE_INPUTS) if case.initial_states else None
        outputs, finals = {}, None
        ys = []
        if P > 0:
            res = combined(t["q"][:, :P], t["k"][:, :P], t["v"][:, :P], by_head("adt", 0, P), by_head("dt", 0, P),
                           by_head("trap", 0, P), t["q_bias"], t["k_bias"], t["angles"][:, :P], D=t.get("D"),
                           Z=t["z"][:, :P] if "z" in t else None, Input_States=states, chunk_size=case.chunk_size,
                           return_final_states=case.return_final_states or bool(case.mamba3_steps),
                           cu_seqlens=inputs.cu_seqlens)
            if isinstance(res, tuple):
                ys.append(res[0])
                finals = tuple(res[1:])
            else:
                ys.append(res)
        if case.mamba3_steps:
            b, h, p, n, a = case.batch, case.nheads, case.headdim, case.dstate, case.rope_angles
            if finals is None:
                finals = states if states is not None else tuple(
                    torch.zeros(shape, device=t["v"].device, dtype=dtype) for shape, dtype in (
                        ((b, h, a), torch.float32), ((b, h, p, n), torch.float32), ((b, h, n), torch.float32),
                        ((b, h, p), t["v"].dtype)))
            for i in range(P, L):
                out, finals = step(t["q"][:, i], t["k"][:, i], t["v"][:, i], t["adt"][:, i], t["dt"][:, i],
                                   t["trap"][:, i], t["q_bias"], t["k_bias"], t["angles"][:, i], D=t.get("D"),
                                   Z=t["z"][:, i] if "z" in t else None, Input_States=tuple(finals))
                ys.append(out[:, None])
        outputs["y"] = torch.cat(ys, dim=1)
        if case.return_final_states:
            outputs.update(zip(STATE_OUTPUTS, finals))
        return Evaluation(outputs)


register(Mamba3Siso(steps=False))
register(Mamba3Siso(steps=True))
