"""repro.py: a standalone script for one divergence, ready to paste into an upstream issue.

It needs torch and the implementation under test, nothing of ssdiff. It inlines, verbatim, ssdiff's drawing code
(harness/inputs/drawing.py: the numbers are the ones ssdiff judged), the Triton-interpreter and autotune patches
ssdiff runs kernels under (harness/runtime.py) and any CPU stand-in (causal_conv1d / selective_scan_cuda
replacements: harness/sides/standins.py), labelled; a token-by-token float64 oracle is written out in a few lines.
It prints both sides and the oracle, the largest errors against the budgets ssdiff allowed, and exits 1 while the
divergence exists, 0 once it is fixed.

Two steps: `measure` takes what only the run knows (where it ran and with what, the verdicts' message, the
budgets, the elements out of theirs) as JSON data; `render` writes the script from a case and that data alone,
the same bytes every time (the findings keep the data in finding.json and render repros on demand). `write` is
the two at once.

Implementations written out natively: mamba_ssm.* entry points, ssdiff.triton, fla's simple_gla kernels on
cases without seq_idx (harness/truth/README.md, "fla's simple_gla"), the layers, and any ``module:function`` with
mamba_chunk_scan_combined's signature. Others (vLLM's ops, fla's simple_gla on packed sequences, test doubles)
are reached through ssdiff's registry, and the script says so.
"""

from __future__ import annotations

import inspect
import math
import os
import pprint
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

import jinja2
import torch

from ssdiff import runtime
from ssdiff.sides import standins
from ssdiff.model.axes import axes_of
from ssdiff.model.case import Case
from ssdiff.inputs import Inputs, cu_seqlens, differentiable_names
from ssdiff.inputs.drawing import draw
from ssdiff.verdict.judge import element_budget, judged_mask, storage_dtype
from ssdiff.model.dtypes import UNIT_ROUNDOFF

TEMPLATE = Path(__file__).parent / "repro.py.j2"

# fla's simple_gla kernels: (module, function, whether the gate is passed as g=).
FLA_FUNCTIONS = {
    "fla.chunk_simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla", True),
    "fla.fused_recurrent_simple_gla": ("fla.ops.simple_gla", "fused_recurrent_simple_gla", True),
    "fla.naive_recurrent_simple_gla": ("fla.ops.simple_gla.naive", "naive_recurrent_simple_gla", False),
}
FLA_SIDE = '''    """{spec}: {module}.{name} with SSD mapped onto simple_gla: q = C and k = B per head, v = x dt',
    g = A dt', the initial state transposed to (n, p); D and the z gate applied to its output."""
    import importlib
    import torch.nn.functional as F
    FN = getattr(importlib.import_module("{module}"), "{name}")
    heads = CASE["nheads"] // CASE["ngroups"]
    dt = t["dt"].float() + (t["dt_bias"].float() if "dt_bias" in t else 0.0)
    dt = F.softplus(dt, threshold=20.0) if CASE["dt_softplus"] else dt
    dt = dt.clamp(min=DT_LIMIT[0]) if DT_LIMIT[1] == math.inf else dt.clamp(min=DT_LIMIT[0], max=DT_LIMIT[1])
    q, k = t["C"].repeat_interleave(heads, dim=2), t["B"].repeat_interleave(heads, dim=2)
    v = (t["x"].float() * dt[..., None]).to(t["x"].dtype)
    h0 = t["initial_states"].float().transpose(-1, -2) if "initial_states" in t else None
    o, final = FN(q, k, v, {gate}dt * t["A"].float(), scale=1.0, initial_state=h0, output_final_state=True)
    y = o.float()
    if "D" in t:
        y = y + (t["D"].float()[:, None] if t["D"].dim() == 1 else t["D"].float()) * t["x"].float()
    if "z" in t:
        y = y * F.silu(t["z"].float())
    out = {{"y": y.to(t["x"].dtype)}}
    if CASE["return_final_states"]:
        out["final_states"] = final.float().transpose(-1, -2)
    return out'''

MAMBA_FUNCTIONS = {
    "mamba_ssm.chunk_scan_combined": ("mamba_chunk_scan_combined", "combined"),
    "mamba_ssm.chunk_scan": ("mamba_chunk_scan", "plain"),
    "mamba_ssm.chunk_scan_ref": ("ssd_chunk_scan_combined_ref", "plain"),
    "mamba_ssm.split_conv1d_combined": ("mamba_split_conv1d_scan_combined", "mixer"),
    "mamba_ssm.split_conv1d_ref": ("mamba_split_conv1d_scan_ref", "mixer_ref"),
}

def _force_config_source(index: int, why: str) -> str:
    """Every autotuned kernel on config ``index``: ssdiff's own autotune patch (harness/runtime.py), verbatim."""
    head = ("# Every autotuned Triton kernel runs config CONFIG_INDEX % (its number of configs, after its own "
            f"pruning): {why}.")
    return "\n".join([head, "# A config that does not fit this device (shared memory, registers) is skipped for the "
                             "next one, as the",
                       "# benchmarking autotuner skips it. ssdiff's own autotune patch (harness/runtime.py), verbatim.",
                       f"CONFIG_INDEX = {index}", "", "", inspect.getsource(runtime._patch_autotuner_choice), "",
                       "_patch_autotuner_choice(lambda: CONFIG_INDEX)", ""])


# What the Triton interpreter needs on the CPU: ssdiff's own patches, installed by _patch_interpreter.
INTERPRETER_PATCHES = (runtime._patch_interpreter, runtime._is_host, runtime._patch_cuda_device,
                       runtime._patch_device_properties, runtime._patch_interpreter_index,
                       runtime._set_overflow_sanitizer)


def _interpreter_source(sm_count: int) -> str:
    """The Triton interpreter's patches as ssdiff installs them (harness/runtime.py), verbatim: ``sm_count`` SMs
    reported to the kernels, as when ssdiff judged the case."""
    return ("# The kernels run on the CPU under TRITON_INTERPRET=1; what they expect of a GPU is faked by ssdiff's own "
            "patches\n# (harness/runtime.py), verbatim.\n"
            + "\n\n".join(inspect.getsource(fn) for fn in INTERPRETER_PATCHES)
            + f"\n\n_patch_interpreter(lambda: {int(sm_count)}, False)\n")


MAMBA_LOADER = '''
def load_mamba_ssm():
    """mamba_ssm's Triton ops without its package __init__ (which imports CUDA extensions)."""
    import importlib
    import importlib.util
    spec = importlib.util.find_spec("mamba_ssm")
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("mamba_ssm", package)
    if importlib.util.find_spec("selective_scan_cuda") is None:      # STAND-IN (see above)
        sys.modules["selective_scan_cuda"] = selective_scan_cuda
    modules = [importlib.import_module("mamba_ssm.ops.triton.ssd_combined")]
    try:
        modules.append(importlib.import_module("mamba_ssm.ops.selective_scan_interface"))
    except ImportError:
        pass
    for module in modules:                                             # STAND-IN where causal_conv1d is absent
        for attr, standin in (("causal_conv1d_fn", causal_conv1d_fn), ("causal_conv1d_fwd_function", causal_conv1d_fwd),
                              ("causal_conv1d_bwd_function", causal_conv1d_bwd),
                              ("causal_conv1d_cuda", causal_conv1d_cuda)):
            if attr in vars(module) and getattr(module, attr) is None:
                setattr(module, attr, standin)
    return modules[0]


ssd_combined = load_mamba_ssm()
'''


def _standins_source() -> str:
    src = inspect.getsource(standins)
    src = src.replace("from __future__ import annotations\n", "")
    return ("# ---- STAND-INS (CPU): causal_conv1d and selective_scan_cuda in torch, ssdiff's harness/sides/standins.py "
            "verbatim ----\n" + src)


def _draw_source() -> str:
    """harness/inputs/drawing.py, whole: the code ssdiff draws every input with."""
    return inspect.getsource(inspect.getmodule(draw)).strip("\n") + "\n"


def _scan_kwargs(case: Case, plain: bool) -> str:
    args = ['D=t.get("D")', 'z=t.get("z")', 'dt_bias=t.get("dt_bias")', f"dt_softplus={case.dt_softplus}"]
    if not plain:
        args += ['initial_states=t.get("initial_states")', "seq_idx=seq"]
        if case.dt_limit is not None:
            args.append("dt_limit=DT_LIMIT")
        args.append(f"return_final_states={case.return_final_states}")
        if case.varlen_states:
            args += ["cu_seqlens=CU_SEQLENS", "return_varlen_states=True"]
    return ", ".join(args)


def _mixer_kwargs(case: Case, ref: bool) -> str:
    args = []
    if not ref:
        args += ['initial_states=t.get("initial_states")', "seq_idx=seq",
                 f"return_final_states={case.return_final_states}"]
    if case.dt_limit is not None:
        args.append("dt_limit=DT_LIMIT")
    args += [f"activation={'silu' if case.activation == 'silu' else None!r}", 'rmsnorm_weight=t.get("rmsnorm_weight")',
             f"rmsnorm_eps={case.rmsnorm_eps!r}", 'outproj_weight=t.get("outproj_weight")',
             'outproj_bias=t.get("outproj_bias")', f"headdim={case.headdim}", f"ngroups={case.ngroups}",
             f"norm_before_gate={case.norm_before_gate}"]
    return ", ".join(args)


RESULT = '''    out = out if isinstance(out, tuple) else (out,)
    result = {"y": out[0]}
    if len(out) > 1 and CASE["return_final_states"]:
        result["final_states"] = out[1]
    if CASE["varlen_states"]:
        result["varlen_states"] = out[-1]
    return result'''


def _is_plain_callable(spec: str) -> bool:
    """module:function naming a function (not an ssdiff Implementation object, like the test doubles)."""
    from ssdiff.sides.base import Implementation
    from ssdiff.sides.runner import resolve

    try:
        target = resolve(spec)
    except Exception:
        return True
    from ssdiff.sides.adapters.generic import CallableImplementation
    return isinstance(target, CallableImplementation) or not isinstance(target, Implementation)


STEP = "mamba_ssm.selective_state_update"
STEP_SIDE = '''    """mamba_ssm.selective_state_update: one call per decoded token, the state updated in place; A, dt, dt_bias
    and a per-head D broadcast over headdim with stride 0, as Mamba-2's step() passes them."""
    import importlib
    step = importlib.import_module("mamba_ssm.ops.triton.selective_state_update").selective_state_update
    b, h, p, n = CASE["batch"], CASE["nheads"], CASE["headdim"], CASE["dstate"]
    index = STATE_INDICES
    cache = t["state"].clone()
    if index is not None:
        cache[index.long()] = t["state"]
    A = t["A"][:, None, None].expand(h, p, n)
    dt_bias = t["dt_bias"][:, None].expand(h, p) if "dt_bias" in t else None
    D = t.get("D")
    if D is not None and D.dim() == 1:
        D = D[:, None].expand(h, p)
    kwargs = {"state_batch_indices": index} if index is not None else {}
    ys = []
    for k in range(CASE["seqlen"] - CASE["decode_steps"], CASE["seqlen"]):
        ys.append(step(cache, t["x"][:, k], t["dt"][:, k][..., None].expand(b, h, p), A, t["B"][:, k], t["C"][:, k],
                       D=D, z=t["z"][:, k] if "z" in t else None, dt_bias=dt_bias, dt_softplus=CASE["dt_softplus"],
                       **kwargs))
    out = {"y": torch.stack(ys, 1)}
    if CASE["return_final_states"]:
        out["final_states"] = cache[index.long()] if index is not None else cache
    return out'''


LAYER_METHOD = '''
class Calling(torch.nn.Module):
    """run(layer, ...) as a module's forward: torch.func.functional_call runs it with the case's weights in place
    of the layer's own parameters, so the gradients reach the case's tensors."""

    def __init__(self, layer, run):
        super().__init__()
        self.inner, self.run = layer, run

    def forward(self, *args, **kwargs):
        return self.run(self.inner, *args, **kwargs)
'''

LAYER_DECODE = '''
class InferenceCache:
    """What Mamba2.forward reads of mamba_ssm.utils.generation.InferenceParams."""

    def __init__(self):
        self.seqlen_offset, self.key_value_memory_dict = 0, {}


def decode_with_cache(layer, u, prefill):
    """forward() over the first `prefill` tokens with an inference cache, then one token per call (step())."""
    cache = InferenceCache()
    outs = [layer(u[:, :prefill], inference_params=cache)]
    cache.seqlen_offset = prefill
    for t in range(prefill, u.shape[1]):
        outs.append(layer(u[:, t:t + 1], inference_params=cache))
        cache.seqlen_offset += 1
    return torch.cat(outs, dim=1)
'''

LAYER_DECODE_FLA = '''
def decode_with_last_state(layer, method, u, prefill):
    """fla's Mamba2 as its forward() drives a cache: the prefill with use_cache returns the conv and SSM states,
    then one token per call with them as last_state."""
    run = getattr(layer, method)
    out, conv_state, ssm_state = run(u[:, :prefill], None, True)
    outs = [out]
    for t in range(prefill, u.shape[1]):
        out, conv_state, ssm_state = run(u[:, t:t + 1], {"conv_state": conv_state, "recurrent_state": ssm_state}, True)
        outs.append(out)
    return torch.cat(outs, dim=1)
'''

LAYER_DECODE_TRANSFORMERS = '''
def decode_with_dynamic_cache(layer, config, u, prefill):
    """Mamba2Mixer as generate() drives it: a DynamicCache, the prefill through forward() with it, then one token
    per call."""
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    outs = [layer(u[:, :prefill], cache_params=cache)]
    for t in range(prefill, u.shape[1]):
        outs.append(layer(u[:, t:t + 1], cache_params=cache))
    return torch.cat(outs, dim=1)
'''

# A package a repro needs -> the name it is imported by (a repro that lacks one says so and exits 2).
IMPORT_NAMES = {"mamba-ssm": "mamba_ssm", "flash-linear-attention": "fla", "fla-core": "fla", "causal-conv1d": "causal_conv1d"}

LAYER_PACKAGES = {"mamba_ssm.": ("mamba-ssm", "einops", "huggingface_hub"),
                  "fla.": ("flash-linear-attention", "fla-core", "transformers"), "transformers.": ("transformers",)}


def _layer_implementation(spec: str):
    """The layer adapter named ``spec`` (harness/sides/adapters/layer_loading.py), or None."""
    from ssdiff.sides.registry import UnknownImplementation, get
    from ssdiff.sides.adapters.layer_loading import LayerImplementation

    if ":" in spec:
        return None
    try:
        impl = get(spec)
    except UnknownImplementation:
        return None
    return impl if isinstance(impl, LayerImplementation) else None


def _layer_side(fn: str, spec: str, impl, case: Case) -> tuple:
    """A layer built as its adapter builds it (its Construction), run with the case's weights."""
    from ssdiff.sides.adapters.layer_loading import PARAMETER_SOURCES, PARAMETER_VIEWS

    how = impl.construction(case)
    view = lambda key: ".{}({})".format(*PARAMETER_VIEWS[key]) if key in PARAMETER_VIEWS else ""
    drawn = draw(case)[0]
    params = ", ".join(f'"inner.{name}": t["{key}"]{view(key)}' for name, key in PARAMETER_SOURCES if key in drawn)
    literal = lambda d: repr(d).replace(", inf)", ", math.inf)")
    if how.config_class:
        build = (f"layer = module.{how.factory}(module.{how.config_class}(**{literal(how.config)}), "
                 f"**{literal(how.kwargs)})")
    else:
        build = f"layer = module.{how.factory}(**{literal(how.kwargs)})"
    lines = [f"def {fn}(t, seq):",
             f'    """{spec}: {impl.description}.\n    Built with the case\'s configuration and run with the case\'s '
             f'weights (its own parameters unused)."""',
             "    import importlib",
             f'    module = importlib.import_module("{how.module}")']
    if spec.startswith("mamba_ssm."):
        lines.append("    if module.causal_conv1d_fn is None:                 # STAND-IN where causal_conv1d is absent")
        lines.append("        module.causal_conv1d_fn = causal_conv1d_fn")
    lines += [f"    {build}", f"    layer.train({how.train})",
              f"    weights = {{{params}}}"]
    if case.layer_steps and spec.startswith("fla."):
        lines.append(f'    run = lambda layer, u: decode_with_last_state(layer, "{how.method}", u, '
                     f'{case.seqlen - case.layer_steps})  # the last {case.layer_steps} token(s) one at a time')
    elif case.layer_steps and spec.startswith("transformers."):
        lines.append(f"    config = module.{how.config_class}(**{literal(how.config)})")
        lines.append(f"    run = lambda layer, u: decode_with_dynamic_cache(layer, config, u, "
                     f"{case.seqlen - case.layer_steps})  # the last {case.layer_steps} token(s) one at a time")
    elif case.layer_steps:
        lines.append(f"    run = lambda layer, u: decode_with_cache(layer, u, {case.seqlen - case.layer_steps})  "
                     f"# the last {case.layer_steps} token(s) through step()")
    else:
        lines.append(f"    run = lambda layer, u, **kw: layer.{how.method}(u, **kw)")
    lines += [f'    y = torch.func.functional_call(Calling(layer, run), weights, (t["u"],)'
              + (', {"seq_idx": seq})' if how.seq_idx and not case.layer_steps else ")"),
              '    return {"y": y[0] if isinstance(y, tuple) else y}']
    needs = next(v for k, v in LAYER_PACKAGES.items() if spec.startswith(k))
    return "\n".join(lines), needs


def _side_code(number: int, spec: str, case: Case) -> tuple:
    """(code defining side_<number>(t, seq), the packages it needs)"""
    fn = f"side_{number}"
    layer = _layer_implementation(spec) if case.entry == "layer" else None
    if layer is not None:
        return _layer_side(fn, spec, layer, case)
    if spec in MAMBA_FUNCTIONS:
        name, kind = MAMBA_FUNCTIONS[spec]
        if kind in ("combined", "plain"):
            call = (f'ssd_combined.{name}(t["x"], t["dt"], t["A"], t["B"], t["C"], {case.chunk_size}, '
                    f"{_scan_kwargs(case, kind == 'plain')})")
        else:
            call = (f'ssd_combined.{name}(t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], '
                    f't["D"], {case.chunk_size}, {_mixer_kwargs(case, kind == "mixer_ref")})')
        return (f'def {fn}(t, seq):\n    """{spec}: mamba_ssm.ops.triton.ssd_combined.{name}"""\n'
                f"    out = {call}\n{RESULT}", ("mamba-ssm", "einops"))
    if spec == STEP:
        return (f'def {fn}(t, seq):\n{STEP_SIDE}', ("mamba-ssm", "einops"))
    if spec in FLA_FUNCTIONS and case.entry == "chunk_scan" and case.segments is None:
        module, name, keyword = FLA_FUNCTIONS[spec]
        side = FLA_SIDE.format(spec=spec, module=module, name=name, gate="g=" if keyword else "")
        return f"def {fn}(t, seq):\n{side}", ("flash-linear-attention", "fla-core", "einops")
    if spec == "ssdiff.triton" or (":" in spec and case.entry == "chunk_scan" and _is_plain_callable(spec)):
        if spec == "ssdiff.triton":
            module, attr = (("ssdiff.kernels.ssd.combined", "ssd_chunk_scan_combined") if case.entry == "chunk_scan"
                            else ("ssdiff.kernels.ssd.mixer", "ssd_split_conv1d_scan_combined"))
            needs = ("ssdiff (its kernels: ssdiff.kernels)",)
        else:
            module, attr = spec.split(":", 1)
            needs = (module.split(".")[0],)
        if case.entry == "chunk_scan":
            call = f'FN(t["x"], t["dt"], t["A"], t["B"], t["C"], {case.chunk_size}, {_scan_kwargs(case, False)})'
        else:
            call = (f'FN(t["zxbcdt"], t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], '
                    f"{case.chunk_size}, {_mixer_kwargs(case, False)})")
        return (f'def {fn}(t, seq):\n    """{spec}"""\n    import importlib\n'
                f'    FN = getattr(importlib.import_module("{module}"), "{attr}")\n    out = {call}\n{RESULT}',
                needs)
    # Reached through ssdiff's adapter (not standalone): the adapter builds its own inputs from the case.
    return (f'def {fn}(t, seq):\n    """{spec}: reached through ssdiff\'s registry (this side needs ssdiff '
            f'installed)."""\n    from ssdiff import runtime\n    runtime.configure()\n'
            f"    from ssdiff.model.case import Case\n    from ssdiff.sides.runner import resolve\n"
            f"    from ssdiff.inputs import materialize\n    case = Case.from_dict(CASE)\n"
            f'    res = resolve("{spec}").run(case, materialize(case, DEVICE))\n'
            f'    out = dict(res.outputs)\n    out.update({{f"grad.{{k}}": v for k, v in res.grads.items()}})\n'
            f"    return out", ("ssdiff",))


# At most this many elements of each tensor are watched one by one (the furthest over their budgets).
WATCHED = 32


def _budgets(case: Case, inputs: Inputs, truth, base, factor: float) -> dict:
    """For each output and gradient ("y", "grad.x", ...): (the verdict's per-element budget, the mask of the
    elements it judges, the truth)."""
    out = {}
    items = [("output", k, k, v) for k, v in truth.outputs.items() if v is not None]
    items += [("grad", f"grad.{k}", k, v) for k, v in truth.grads.items()]
    bases = list(base) if isinstance(base, (list, tuple)) else [base]
    for kind, key, short, t in items:
        samples = [(e.outputs if kind == "output" else e.grads)[short] for e in bases]
        axes = axes_of(kind, short, case)
        mask = judged_mask(kind, short, case, inputs, axes, t.shape)
        judged = torch.ones_like(t, dtype=torch.bool) if mask is None else mask.to(t.device)
        finite = torch.isfinite(t)
        for s in samples:
            finite &= torch.isfinite(s)
        budget = element_budget(t, [s.to(torch.float64) for s in samples], judged & finite, axes, case,
                                UNIT_ROUNDOFF[storage_dtype(kind, short, case, inputs)], factor)[0]
        out[key] = (budget, judged & finite, t)
    return out


def allowed_errors(case: Case, inputs: Inputs, truth, base, factor: float) -> dict:
    """For each output and gradient: the largest per-element budget of the verdict (see harness/verdict/judge.py)."""
    return {key: float(budget[judged].max()) if bool(judged.any()) else 0.0
            for key, (budget, judged, _) in _budgets(case, inputs, truth, base, factor).items()}


def watched_elements(case: Case, inputs: Inputs, truth, base, factor: float, outputs: dict) -> dict:
    """For each output and gradient some side got out of its per-element budget: [[flat index, budget], ...] of
    up to WATCHED elements, the furthest over budget first (non-finite results first of all). ``outputs``: side
    -> its results (an Evaluation). A repro that checked only the largest error against the largest budget
    would miss an error over a small element's budget that is under a large element's."""
    out = {}
    for key, (budget, judged, t) in _budgets(case, inputs, truth, base, factor).items():
        kind, short = ("grad", key[5:]) if key.startswith("grad.") else ("output", key)
        worst = torch.zeros_like(budget)
        for result in outputs.values():
            got = (result.grads if kind == "grad" else result.outputs).get(short)
            if got is None or got.shape != t.shape:
                continue
            err = (got.detach().to(t.device, torch.float64) - t).abs()
            ratio = torch.where(torch.isfinite(err), err / budget.clamp_min(1e-300), torch.full_like(err, math.inf))
            worst = torch.maximum(worst, torch.where(judged & (ratio > 1), ratio, torch.zeros_like(ratio)))
        over = int((worst > 0).sum())
        if over:
            order = torch.argsort(worst.flatten(), descending=True)[:min(over, WATCHED)]
            flat = budget.flatten()
            out[key] = [[int(i), float(flat[i])] for i in order.tolist()]
    return out


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def measure(case: Case, sides: list, inputs: Inputs, truth, base, factor: float, message: str,
            choice: runtime.Choice = "tuned", outputs: Optional[dict] = None) -> dict:
    """What repro.py of ``case`` says that only its run knows, as JSON data: the sides (implementation names),
    where they ran (``inputs.device``) and with what, the verdicts' ``message``, the largest budget of each tensor
    (`allowed_errors`), the elements out of their own (`watched_elements`; ``outputs``: side -> its results, as
    judged) and the config index ``choice`` forced on every autotuned kernel (natively), as when judged."""
    device = str(inputs.device)
    packages = {"torch": torch.__version__, "triton": _version("triton")}
    for prefix, dist in (("mamba_ssm.", "mamba-ssm"), ("fla.", "fla-core"), ("fla.mamba2", "flash-linear-attention"),
                         ("transformers.", "transformers")):
        if any(s.startswith(prefix) for s in sides):
            packages[dist] = _version(dist)
    interpreted = device == "cpu" and runtime.interpreted()
    return {"sides": list(sides), "device": device, "runtime": runtime.describe(), "packages": packages,
            "interpreted": interpreted, "sm_count": runtime.sm_count() if interpreted else None,
            "autotune": choice, "factor": factor, "message": message.strip(),
            "allowed": allowed_errors(case, inputs, truth, base, factor),
            "watched": watched_elements(case, inputs, truth, base, factor, outputs or {}),
            "ssdiff": _version("ssdiff")}


def render(case: Case, measured: dict) -> str:
    """repro.py's text for ``case`` from what `measure` took of its run; nothing else of the machine that renders it
    enters (no date, no path, no installed version), so the same arguments give the same bytes."""
    sides = measured["sides"]
    side_code, needs = [], []
    for number, spec in enumerate(sides):
        code, need = _side_code(number, spec, case)
        side_code.append(code)
        needs += [n for n in need if n not in needs]
    side_code.append("SIDES = {" + ", ".join(f"{spec!r}: side_{i}" for i, spec in enumerate(sides)) + "}")
    uses_triton = any(s.startswith(("mamba_ssm.", "ssdiff.", "fla.", "vllm.")) or ":" in s for s in sides)
    interpreter = measured["interpreted"] and uses_triton
    choice = measured["autotune"]
    preamble = []
    if interpreter:
        preamble.append(_interpreter_source(measured["sm_count"]))
        needs.append("numpy (the Triton interpreter imports it)")
    if uses_triton and choice != "tuned":
        preamble.append(_force_config_source(int(choice), "as ssdiff judged it (the divergence depends on the config "
                                                          "the autotuner picks)"))
    elif interpreter:
        preamble.append(_force_config_source(0, "the interpreter cannot benchmark"))
    layers = [s for s in sides if case.entry == "layer" and _layer_implementation(s) is not None]
    # mamba_ssm's layer, and fla's kernel paths, import mamba_ssm's Triton ops: loadable only through the loader
    needs_mamba = [s for s in sides if s in MAMBA_FUNCTIONS or s == STEP
                   or (s in layers and (s.startswith("mamba_ssm.") or s in ("fla.mamba2_triton", "fla.mamba2_fused")))]
    if needs_mamba:
        preamble.append(_standins_source())
        preamble.append(MAMBA_LOADER)
    if layers:
        preamble.append(LAYER_METHOD)
        if case.layer_steps and any(s.startswith("mamba_ssm.") for s in layers):
            preamble.append(LAYER_DECODE)
        if case.layer_steps and any(s.startswith("fla.") for s in layers):
            preamble.append(LAYER_DECODE_FLA)
        if case.layer_steps and any(s.startswith("transformers.") for s in layers):
            preamble.append(LAYER_DECODE_TRANSFORMERS)
    if case.varlen_states:
        preamble.append(f"CU_SEQLENS = torch.tensor({cu_seqlens(case).tolist()}, dtype=torch.int32, device=DEVICE)")
    modules = {"torch": "torch", **({"triton": "triton"} if uses_triton else {})}
    for need in needs:
        first = need.split()[0]
        modules.setdefault(IMPORT_NAMES.get(first, first.replace("-", "_")), first)
    template = jinja2.Template(TEMPLATE.read_text(encoding="utf-8"), keep_trailing_newline=True,
                               trim_blocks=True, lstrip_blocks=True)
    return template.render(
        title=f"{' vs '.join(sides)} on {case.entry}", case_line=case.describe(), sides=sides, case=case,
        measured=measured, needs_triton=uses_triton, needs=needs, modules=modules, interpreter=interpreter,
        case_json=pprint.pformat(case.to_dict(), width=110, sort_dicts=False), watched_cap=WATCHED,
        draw_source=_draw_source(), preamble="\n\n".join(p.strip("\n") for p in preamble),
        side_code=side_code, differentiable=list(differentiable_names(case)))


def write(path, case: Case, sides: list, inputs: Inputs, truth, base, factor: float, message: str,
          choice: runtime.Choice = "tuned", outputs: Optional[dict] = None) -> Path:
    """Write repro.py for ``case`` judged with ``sides`` (`measure`, then `render`)."""
    path = Path(path)
    path.write_text(render(case, measure(case, sides, inputs, truth, base, factor, message, choice, outputs)),
                    encoding="utf-8")
    return path


def checkout() -> Optional[Path]:
    """The ssdiff checkout this package runs from (the package is its folder harness/, with pyproject.toml beside
    it: an editable install or a run from the checkout), or None for an installed copy."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "harness").is_dir() else None


def run(path, first: str = "", timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a repro.py as a stranger would: nothing of ssdiff importable (neither this checkout nor the cwd), the
    packages it needs where the caller has them (the caller's PYTHONPATH entries but the checkout are kept: a GPU
    runner may provide mamba_ssm there), ``first`` (a release's directory, a fixed package) ahead of them, and the
    rest of the caller's environment as it is (what reaches the device: driver and library paths, the machine's
    required settings)."""
    repo = checkout()
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != repo]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([p for p in [str(first or ""), *kept] if p]))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env,
                          cwd=Path(path).parent, timeout=timeout)


__all__ = ["measure", "render", "write", "allowed_errors", "watched_elements", "WATCHED", "run"]
