"""The findings catalogue: FINDINGS.md and reports/findings/<id>/, generated from the known-defect registry.

    python -m ssdiff.registry.findings            minimize every finding's example, write its files, render FINDINGS.md
    python -m ssdiff.registry.findings --render   render FINDINGS.md from what reports/findings/ holds (fast)
    python -m ssdiff.registry.findings --check    exit 1 when FINDINGS.md is not what --render would write
    ssdiff known --repro ID                       write finding ID's repro.py from its files (fast)

Two steps, so that the staleness check needs no kernel run. ``compute`` (slow) minimizes a record's example
against the float64 oracle (harness/investigate/minimize.py) with a release the record says is affected — the
installed one, else one installed beside it (``release_dirs``, in a child process: one mamba_ssm per process) —
and writes reports/findings/<id>/: case.json (the minimized case, or the example when no affected release is
installed or the example does not diverge there) and finding.json (where it was minimized, what diverged, the
repro's exit status then, and under "repro" what repro.py says of the run: harness/reproduce/repro.py's
`measure`). Those two are committed; repro.py is not: `write_repro` renders it from them on demand (``compute``
writes it beside them too, ignored by git). ``render`` (pure) writes FINDINGS.md from the registry, those files
and DRAFTS below.

A finding is a record of a defect ssdiff found (not an algorithm's own limitation: severity "by design"), or one
fixed in a release (its repro shows the fix: it fails on an affected release and passes on the fixed one). FINDINGS.md
opens with one table of every record (id, project, severity, status, affected releases, upstream link), then gives
each record its section: statement and fields, and for a finding its case and repro. DRAFTS holds, per finding, what
an upstream report adds to the record: its title, what should happen, and where upstream the defect lives (named
from the release's source, quoting at most a line); the report itself is rendered only for a finding nobody has
reported (status "found by ssdiff, unreported"), the others show the code path alone.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from ssdiff.model.case import Case
from ssdiff.reproduce.repro import checkout
from ssdiff.registry.known import (BY_DESIGN, BY_ID, DEFECTS, UNREPORTED, KnownDefect, explains,
                                   installed_version)

# The checkout the catalogue lives in: the one this package runs from, else the current directory (an installed
# ssdiff run from a checkout).
REPO = checkout() or Path.cwd()
FINDINGS_DIR = REPO / "reports" / "findings"
CATALOGUE = REPO / "FINDINGS.md"
CASE_FILE, RECORD_FILE, REPRO_FILE = "case.json", "finding.json", "repro.py"
MAX_RUNS = 200
REPRO_NEEDS_MAMBA = "torch, triton, einops and mamba-ssm"


@dataclass(frozen=True)
class Draft:
    """What an upstream report adds to a registry record."""

    title: str
    should: str            # what should happen
    code_path: str         # the upstream file and function the defect lives in
    call: str = ""         # what the repro calls, when it is not a mamba_ssm function
    needs: str = REPRO_NEEDS_MAMBA   # what the repro needs installed


DRAFTS = {
    "mamba-varlen-states-drop-initial-states": Draft(
        title="mamba_chunk_scan_combined: return_varlen_states leaves out initial_states when the first sequence "
              "ends in the first chunk",
        should="varlen_states[0] is the state at the end of the first sequence, started from initial_states "
               "exactly as y and final_states are: exp(sum of dt*A over the sequence) * initial_states plus the "
               "sequence's own contribution. With a single sequence it equals final_states.",
        code_path="`mamba_ssm/ops/triton/ssd_chunk_state.py`, `_chunk_state_varlen_kernel` (launched by "
                  "`chunk_state_varlen`, called from `_mamba_chunk_scan_combined_fwd` in `ssd_combined.py` when "
                  "`cu_seqlens` is given). The kernel adds the passed state of the sequence's last chunk — which "
                  "for chunk 0 is `initial_states` — only under `if start_idx < pid_c * chunk_size:`, false for "
                  "a sequence that starts at token 0 and ends in chunk 0, so the initial state is dropped there."),
    "mamba-final-state-gradient-into-padding": Draft(
        title="mamba_chunk_scan_combined backward: d(final_states) leaks into seq_idx = -1 padding tokens",
        should="final_states of a row that ends in padding is 0 whatever the padding tokens hold, so "
               "d(final_states) contributes nothing to the padding tokens' d(x), d(dt) and d(B) (0 in the float64 "
               "reference): the backward gives them no part in final_states, as the forward does.",
        code_path="The backward of the last chunk's state: `mamba_ssm/ops/triton/ssd_combined.py`, "
                  "`_chunk_scan_chunk_state_bwd_dx_kernel` (d(x), d(dt)), and `ssd_chunk_state.py`, "
                  "`_chunk_state_bwd_db_kernel` (d(B)), weight token m by `seq_idx_m == seq_idx_last` only, "
                  "while the forward `_chunk_state_fwd_kernel` (since PR #792) also requires the chunk's last "
                  "token to be a real one: `(seq_idx_last >= 0) & (seq_idx_k == seq_idx_last)`. When the row ends "
                  "in padding, `seq_idx_last` is -1 and every padding token of the chunk receives d(final_states) "
                  "through `_state_passing_bwd_kernel`'s `dfinal_states`."),
    "mamba-swiglu-backward-without-out-proj": Draft(
        title="mamba_split_conv1d_scan_combined backward raises with d_nonssm > 0 unless rmsnorm_weight and "
              "outproj_weight are both given",
        should="The backward runs whenever the forward does and returns the SwiGLU branch's gradients "
               "(d(zxbcdt)'s first 2 * d_nonssm columns and, with out_proj, d(outproj_weight)'s first d_nonssm "
               "columns) for every combination of rmsnorm and out_proj.",
        code_path="`mamba_ssm/ops/triton/ssd_combined.py`, `MambaSplitConv1dScanCombinedFn.backward`: "
                  "`_swiglu_bwd(zx0, dout0, dxy=dzx0, recompute_output=True, out=out0_recompute)` reads "
                  "`out0_recompute`, which is assigned only when `outproj_weight is not None` "
                  "(UnboundLocalError without out_proj); without rmsnorm, `out_for_linear` is the scan's "
                  "recomputed output alone (`rest[0]`, dim columns), so the d(outproj_weight) it returns has dim "
                  "columns where the weight has dim + d_nonssm, and autograd raises (RuntimeError: invalid "
                  "gradient at index 6)."),
    "mamba-ref-norm-one-channel": Draft(
        title="mamba_split_conv1d_scan_ref: AssertionError in the gated RMSNorm when nheads * headdim == 1",
        should="The reference runs for every shape the fused mamba_split_conv1d_scan_combined accepts, one channel "
               "(nheads = headdim = 1) included, and returns the gated RMSNorm of its scan output.",
        code_path="`mamba_ssm/ops/triton/layernorm_gated.py`, `LayerNormFn.forward`: `if x.stride(-1) != 1: x = "
                  "x.contiguous()` is a no-op for a last dimension of size 1 (such a tensor is contiguous whatever "
                  "its stride), and `_layer_norm_fwd` then fails `assert x.stride(-1) == 1`; "
                  "`mamba_split_conv1d_scan_ref` hands it `rearrange(out, \"b s h p -> b s (h p)\")`, the scan "
                  "output transposed from (batch, dim, seqlen): with dim 1 its last dimension keeps a stride other "
                  "than 1 (seqlen; with one token in one batch row, the stride of dt's slice of zxbcdt that the "
                  "extension's `torch::empty_like(delta)` output inherits)."),
    "mamba-softplus-backward-nan-above-20": Draft(
        title="mamba_split_conv1d_scan_combined backward: NaN gradients of dt, dt_bias and A with dt above 20",
        should="Finite gradients: every decay factor exp(dA_cumsum[m] - dA_cumsum[k]) of the causal part is at most "
               "1, and a masked-out one contributes 0.",
        code_path="`mamba_ssm/ops/triton/ssd_chunk_scan.py`, `ssd_chunk_state.py` and `ssd_combined.py` before "
                  "2.2.5: the kernels take `tl.exp(dA_cs_m[:, None] - dA_cs_k[None, :])` (and `dA_cs_last - "
                  "dA_cs_k`) of the difference as it is, positive and large at the masked-out positions; 2.2.5 "
                  "clamps every such exponent, `tl.exp(tl.minimum(..., 0.0))`. The softplus is not where it "
                  "lives: 2.2.2's `ops/triton/softplus.py` already returns dt itself above 20."),
    "mamba-grouped-norm-backward": Draft(
        title="mamba_split_conv1d_scan_combined backward: gated RMSNorm normalized over all of dim when "
              "ngroups > 1",
        should="The backward normalizes per group of dim // ngroups channels, as the forward does.",
        code_path="`mamba_ssm/ops/triton/ssd_combined.py`, `MambaSplitConv1dScanCombinedFn.backward`: its "
                  "`_layer_norm_bwd(...)` call passed no `group_size` (the forward's `_layer_norm_fwd` call passes "
                  "`group_size=dim // ngroups`); the fixed releases pass `group_size=dim//ctx.ngroups`."),
    "mamba-state-update-D-none": Draft(
        title="selective_state_update raises TypeError when D is None",
        should="D is optional in the signature (`D=None`): without it the step computes y = sum(state * C) (times "
               "silu(z)) with no skip term, as selective_state_update_ref does.",
        code_path="`mamba_ssm/ops/triton/selective_state_update.py`, `selective_state_update`: the kernel launch "
                  "passes `*(D.stride(0), D.stride(1)) if D is not None else 0`, which Python parses as "
                  "`*((D.stride(0), D.stride(1)) if D is not None else 0)`: with D None it unpacks the int 0. "
                  "`else (0, 0)` would pass two zero strides."),
    "mamba-state-update-dt-bias-none": Draft(
        title="selective_state_update raises when dt_bias is None",
        should="dt_bias is optional in the signature (`dt_bias=None`): without it dt is used as given (then "
               "softplus when asked), as selective_state_update_ref does.",
        code_path="`mamba_ssm/ops/triton/selective_state_update.py`, `selective_state_update`: `tie_hdim = "
                  "A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias.stride(-1) == 0` "
                  "reads `dt_bias.stride` (AttributeError on Mamba-2's broadcast layout); on another layout the "
                  "launch's `*(dt_bias.stride(0), dt_bias.stride(1)) if dt_bias is not None else 0` unpacks the "
                  "int 0 (TypeError)."),
    "mamba-mamba2-step-D-has-hdim": Draft(
        title="Mamba2.step fails with D_has_hdim=True",
        should="Decoding a D_has_hdim model uses its per-channel D, shape (nheads, headdim), as forward() does "
               "(`rearrange(self.D, \"(h p) -> h p\", p=self.headdim)`), and its outputs equal forward()'s for the "
               "same tokens.",
        code_path="`mamba_ssm/modules/mamba2.py`, `Mamba2.step`, the selective_state_update branch: "
                  "`D = repeat(self.D, \"h -> h p\", p=self.headdim)` reads D as (nheads,) whatever D_has_hdim says.",
        call="mamba_ssm.modules.mamba2.Mamba2.step (through forward() with inference_params)",
        needs="torch, triton, einops, huggingface_hub and mamba-ssm"),
    "mamba-mamba2-step-ignores-dt-limit": Draft(
        title="Mamba2.step ignores dt_limit",
        should="Each decoded token's dt is clamped to dt_limit after the softplus, as the prefill's "
               "mamba_chunk_scan_combined(..., dt_limit=self.dt_limit) clamps it: decoding a model gives the outputs "
               "its forward() gives for the same tokens.",
        code_path="`mamba_ssm/modules/mamba2.py`, `Mamba2.step`: `selective_state_update(ssm_state, x_reshaped, dt, "
                  "A, B, C, D, z=..., dt_bias=dt_bias, dt_softplus=True)` passes no limit (the kernel, "
                  "`mamba_ssm/ops/triton/selective_state_update.py`, has no dt_limit argument), and the torch branch "
                  "`dt = F.softplus(dt + self.dt_bias...)` does not clamp either.",
        call="mamba_ssm.modules.mamba2.Mamba2.step (through forward() with inference_params)",
        needs="torch, triton, einops, huggingface_hub and mamba-ssm"),
    "fla-mamba2-torch-forward-tiles-groups": Draft(
        title="Mamba2.torch_forward reads the wrong group's B and C when 1 < n_groups < num_heads",
        should="Head h uses group h // (num_heads // n_groups) of B and C, as on the kernel path "
               "(mamba_chunk_scan_combined) and in the layer's RMSNormGated groups: `repeat_interleave(num_heads "
               "// n_groups, dim=2)` where torch_forward now tiles with `repeat`. With n_groups 1 or num_heads "
               "the two agree, which is why it stays unseen in single-group models.",
        code_path="`fla/layers/mamba2.py`, `Mamba2.torch_forward`, the prefill branch: `B = B.repeat(1, 1, "
                  "self.num_heads // self.n_groups, 1)` (and the same for C) after reshaping to (batch, seq_len, "
                  "n_groups, state_size); transformers 5.20.2's Mamba2 fallback (`mamba2_chunk_scan`) uses "
                  "`repeat_interleave` at the same place.",
        call="fla.layers.mamba2.Mamba2.torch_forward",
        needs="torch, triton, einops, flash-linear-attention, fla-core and transformers"),
    "transformers-mamba2-dt-in-half-precision": Draft(
        title="Mamba2Mixer's torch path computes dt in float16 / bfloat16",
        should="dt = softplus(dt + dt_bias), clamped to time_step_limit, is computed in float32 (dt_bias is a "
               "float32 parameter; mamba_chunk_scan_combined, the kernel this function stands in for, computes dt "
               "in float32): the layer's outputs and gradients then err no more than the same computation with "
               "float32 dt does.",
        code_path="`transformers/models/mamba2/modeling_mamba2.py`, `mamba2_chunk_scan` (the torch fallback of "
                  "`mamba_chunk_scan_combined`): `dt = dt + dt_bias.to(dt.dtype)`, then `F.softplus(dt)` and "
                  "`torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])` on the half-precision dt; the float32 "
                  "`.float()` comes only after, in `hidden_states * dt[..., None].float()`.",
        call="transformers.models.mamba2.modeling_mamba2.Mamba2Mixer.forward",
        needs="torch and transformers"),
    "transformers-mamba2-norm-ignores-groups": Draft(
        title="Mamba2Mixer's gated RMSNorm ignores n_groups without the hub kernels",
        should="The gated RMSNorm normalizes each group of intermediate_size // n_groups channels on its own, as "
               "mamba_ssm's Mamba2 (RMSNormGated with group_size=d_ssm // ngroups) and the fused "
               "mamba_split_conv1d_scan_combined the mixer calls on its kernel path (ngroups=self.n_groups) do; "
               "checkpoints with n_groups > 1 (Mamba-Codestral has 8) otherwise run a different model off the "
               "kernel path.",
        code_path="`transformers/models/mamba2/modeling_mamba2.py`, `MambaRMSNormGated.forward`: `variance = "
                  "hidden_states.pow(2).mean(-1, keepdim=True)` over the whole last axis; the class takes no group "
                  "size and `Mamba2Mixer.__init__` builds it as `MambaRMSNormGated(self.intermediate_size, "
                  "eps=...)`; from 5.23.0 on `MambaRMSNormGated(hidden_size, group_size, eps)` views its input "
                  "as groups of group_size and normalizes each.",
        call="transformers.models.mamba2.modeling_mamba2.Mamba2Mixer.forward",
        needs="torch and transformers"),
    "mamba-ragged-chunk-final-state-decay": Draft(
        title="mamba_chunk_scan_combined: final_states off by ~1.6% in float32 when the sequence ends inside a "
              "chunk under strong decay (the chunk-state kernel reads dA_cumsum at chunk_size - 1)",
        should="A token's share of the final state is scaled by exp(dA_cumsum[last token] - dA_cumsum[t]): exactly "
               "1 for the last token. The chunk's total should be read at the last valid position "
               "(chunk_size_limit - 1), or the cumsum past the end should be the last token's value bit for bit.",
        code_path="`mamba_ssm/ops/triton/ssd_chunk_state.py`: `_chunk_state_fwd_kernel` loads `dA_cs_last` at "
                  "`(chunk_size - 1) * stride_dA_cs_csize` for every chunk, the last, ragged one too; "
                  "`_chunk_cumsum_fwd_kernel` zeroes dt past `chunk_size_limit` and takes `tl.cumsum(dA, axis=1)` "
                  "over the whole [BLOCK_SIZE_H, BLOCK_SIZE_CHUNK] tile, whose tree association differs between "
                  "position chunk_size - 1 and the last valid one when BLOCK_SIZE_H >= 4 (H200, triton 3.6)",
        needs="torch, triton, einops and mamba-ssm, on a GPU"),
    "vllm-ragged-chunk-final-state-decay": Draft(
        title="mamba_chunk_scan_combined_varlen: a sequence's final state off by ~1.6% in float32 when it ends "
              "inside a chunk under strong decay (the chunk-state kernel reads dA_cumsum at chunk_size - 1)",
        should="A token's share of its sequence's final state is scaled by exp(dA_cumsum[last token] - "
               "dA_cumsum[t]): exactly 1 for the last token. The logical chunk's total should be read at its last "
               "valid position, or the cumsum past it should be the last token's value bit for bit.",
        code_path="`vllm/model_executor/layers/mamba/ops/ssd_chunk_state.py`: `_chunk_state_fwd_kernel` loads "
                  "`dA_cs_last` at `(chunk_size - 1) * stride_dA_cs_csize`; `_chunk_cumsum_fwd_kernel` zeroes dt "
                  "past the logical chunk's end and takes `tl.cumsum` over the whole tile, whose association "
                  "differs between the two positions under most of its configs (BLOCK_SIZE_H >= 4; H200, triton 3.6)",
        call="vllm.model_executor.layers.mamba.ops.ssd_combined.mamba_chunk_scan_combined_varlen",
        needs="torch, triton and vllm's SSD ops (through ssdiff's registry), on a GPU"),
    "vllm-varlen-empty-sequence-state": Draft(
        title="mamba_chunk_scan_combined_varlen: a request with no tokens in the pack gets its predecessor's "
              "final state",
        should="A sequence with no tokens (a repeated cu_seqlens offset) leaves its state as it started: its "
               "initial state where one is given, else zeros. Its entry of the returned states is that state.",
        code_path="The final states are read per request at `last_chunk_indices` "
                  "(`vllm/model_executor/layers/mamba/ops/ssd_combined.py`, `mamba_chunk_scan_combined_varlen`); "
                  "the metadata builder gives a request without new tokens no chunk of its own, so its index names "
                  "the last chunk of the request before it (or -1 at the front of the pack)",
        call="vllm.model_executor.layers.mamba.ops.ssd_combined.mamba_chunk_scan_combined_varlen",
        needs="torch, triton and vllm's SSD ops (through ssdiff's registry)"),
    "fla-mamba2-step-ignores-dt-limit": Draft(
        title="Mamba2 (fla.layers.mamba2): cached decoding on the kernel path ignores dt_limit",
        should="Each decoded token's dt is clamped to dt_limit exactly as the prefill clamps it, so that decoding "
               "token by token gives the outputs forward() gives for the same tokens (torch_forward does so).",
        code_path="`fla/layers/mamba2.py`, `Mamba2.cuda_kernels_forward`: the prefill passes `dt_limit` to "
                  "`mamba_chunk_scan_combined` (`dt_limit_kwargs`); the single-token branch (`last_state is not "
                  "None`) calls `selective_state_update(..., dt_bias=dt_bias, dt_softplus=True)` with no limit.",
        call="fla.layers.mamba2.Mamba2.cuda_kernels_forward",
        needs="torch, triton, einops, flash-linear-attention, fla-core, transformers and mamba-ssm"),
    "fla-mamba2-torch-gate-gradient-overflow": Draft(
        title="Mamba2 (fla.layers.mamba2) torch path, float16, rmsnorm=False: Inf/NaN gradients where the true ones "
              "are finite (the gate's gradient is materialized in float16)",
        should="The gradients of a float16 layer are finite wherever their values fit float16: the gate's gradient "
               "dz = dout * y * silu'(gate) is formed in float32 before it is stored, as mamba_chunk_scan_combined "
               "(z=...) and the layer's own RMSNormGated kernel form it, rather than through a float16 "
               "intermediate d(silu(gate)) = dout * y that can pass 65504 where silu' is small.",
        code_path="`fla/layers/mamba2.py`, `Mamba2.torch_forward`, both branches: `scan_output = y * "
                  "self.act(gate)` with y the float32 scan output and gate in the activations' dtype; the "
                  "multiplication's backward returns the gradient of `self.act(gate)` in that dtype.",
        call="fla.layers.mamba2.Mamba2.torch_forward",
        needs="torch, triton, einops, flash-linear-attention, fla-core and transformers"),
    "transformers-mamba2-decode-ignores-dt-limit": Draft(
        title="Mamba2Mixer: cached decoding ignores time_step_limit (dt is not clamped on the single-token path)",
        should="Each decoded token's dt is clamped to time_step_limit exactly as the chunked path clamps it, so "
               "that generate() gives for each token the output forward() gives over the whole sequence.",
        code_path="`transformers/models/mamba2/modeling_mamba2.py`, `Mamba2Mixer.forward`: the chunk form calls "
                  "`mamba2_chunk_scan(..., dt_limit=self.time_step_limit)`; the recurrent form (`use_precomputed_"
                  "states and seq_len == 1`) calls `mamba2_selective_state_update(..., dt_bias=dt_bias, "
                  "dt_softplus=True, **kwargs)` with no limit.",
        call="transformers.models.mamba2.modeling_mamba2.Mamba2Mixer.forward",
        needs="torch and transformers"),
}


def is_finding(defect: KnownDefect) -> bool:
    """Gets a folder and a repro: a defect ssdiff found (not an algorithm's own limitation), or one a release fixed
    (its repro shows the fix)."""
    return (defect.found_by_ssdiff and defect.severity != BY_DESIGN) or defect.affected[1] is not None


def has_draft(defect: KnownDefect) -> bool:
    """Gets a draft upstream report: a finding nobody has reported."""
    return is_finding(defect) and defect.status == UNREPORTED


def finding_dir(defect_id: str, root: Path = FINDINGS_DIR) -> Path:
    return Path(root) / defect_id


# ---- releases ----------------------------------------------------------------------------------------------

def release_dirs() -> list:
    """Directories holding one more mamba-ssm release each (``pip install --target DIR mamba-ssm==X``): those
    in SSDIFF_MAMBA_RELEASES (os.pathsep-separated), else mamba-releases/*/ of the running virtual environment
    (.venv/mamba-releases/*/ for ./dev's; a worktree runs the main checkout's)."""
    given = os.environ.get("SSDIFF_MAMBA_RELEASES")
    if given:
        return [Path(p) for p in given.split(os.pathsep) if p]
    root = Path(sys.prefix) / "mamba-releases"
    return sorted(p for p in root.glob("*") if (p / "mamba_ssm").is_dir()) if root.is_dir() else []


def release_version(where: Path) -> Optional[str]:
    """The mamba-ssm version installed in directory ``where`` (None when it holds none)."""
    found = next(iter(metadata.distributions(name="mamba-ssm", path=[str(where)])), None)
    return found.version if found is not None else None


def run_repro(path: Path, release: Optional[Path] = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run repro.py as a stranger would (ssdiff.reproduce.repro.run), mamba_ssm from ``release`` when given, else the
    installed one."""
    from ssdiff.reproduce import repro

    return repro.run(path, first=str(release) if release else "", timeout=timeout)


# ---- compute (slow): minimize, write case.json, finding.json, repro.py --------------------------------------

def _local_paths(text: str) -> str:
    """Paths of this machine out of a message: '<prefix>/site-packages/mamba_ssm/x.py' -> 'mamba_ssm/x.py'."""
    text = re.sub(r"/\S*?/(mamba_ssm|torch|triton|fla|transformers|vllm)/", r"\1/", text)
    return re.sub(r"/\S*?/(site|dist)-packages/", "", text)


def symptom(verdict: dict) -> list:
    """What a side's verdict (Verdict.to_dict()) says went wrong, one line per failing tensor or the error."""
    if verdict["status"] != "diverged" or not verdict.get("tensors"):
        return [_local_paths(verdict.get("detail") or verdict.get("message") or verdict["status"])]
    lines = []
    for t in verdict["tensors"]:
        if t["status"] == "ok":
            continue
        w = t["worst"]
        where = ", ".join(f"{k} {v}" for k, v in w["coords"].items())
        lines.append(f"{t['name']}: {t['out_of_budget']} of {t['judged']} elements out of budget; the worst "
                     f"({where}) is {w['actual']:.6g} where the float64 oracle gives {w['expected']:.6g} "
                     f"(error {w['error']:.3g}, allowed {w['budget']:.3g})"
                     + (f"; {t['detail']}" if t.get("detail") else ""))
    return lines


def _json(data) -> str:
    return json.dumps(data, indent=2) + "\n"


def compute_here(defect: KnownDefect, root: Path = FINDINGS_DIR, max_runs: int = MAX_RUNS) -> dict:
    """Minimize ``defect.example`` with the installed release and write its folder; the finding record."""
    import torch
    import triton

    from ssdiff.investigate.minimize import NotDiverging, minimize
    from ssdiff.reproduce import repro
    from ssdiff.verdict.judge import FACTOR

    version = installed_version(defect.package)
    folder = finding_dir(defect.id, root)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"id": defect.id, "example": defect.example.to_dict(), "implementation": defect.implementations[0],
              "release": f"{defect.package} {version}", "torch": torch.__version__,
              "triton": triton.__version__}
    if torch.cuda.is_available() and defect.example_devices and "cpu" not in defect.example_devices:
        record["gpu"] = torch.cuda.get_device_name()
    # where the example is measured to diverge (a numerical defect of a GPU's order of operations: there), under
    # the config it is measured with
    device = defect.example_devices[0] if defect.example_devices else "cpu"
    record.update(device=device, autotune=defect.example_choice)
    with tempfile.TemporaryDirectory(prefix="ssdiff-finding-") as scratch:
        try:
            result = minimize(defect.example, defect.implementations[0], device=device, out_dir=scratch,
                              max_runs=max_runs, accept=lambda case: only_this_defect(defect, case),
                              holds=lambda outcome: all(explains(defect, side, outcome) for side in outcome.failing),
                              choice=defect.example_choice, write_repro=False)
        except NotDiverging as why:
            record.update(reproduces=False, why=_local_paths(str(why)))
            (folder / CASE_FILE).write_text(defect.example.to_json() + "\n", encoding="utf-8")
            (folder / REPRO_FILE).unlink(missing_ok=True)
        else:
            verdict = result.outcome.verdicts[record["implementation"]].to_dict()
            # the last line Python prints for the exception: "Type: message", or "Type" when it has no message
            raised = (_local_paths(verdict["detail"]).rsplit(" (at ", 1)[0].rstrip().removesuffix(":")
                      if verdict["status"] != "diverged" and verdict.get("detail") else None)
            record.update(reproduces=True, runs=result.shrunk.runs, shrunk=result.minimal != defect.example,
                          symptom=symptom(verdict), raised=raised)
            (folder / CASE_FILE).write_text(result.minimal.to_json() + "\n", encoding="utf-8")
            final = result.outcome
            measured = repro.measure(result.minimal, list(final.verdicts), final.inputs, final.truth, final.baseline,
                                     FACTOR, "\n".join(v.message() for v in final.verdicts.values()),
                                     final.choice, outputs=final.outputs)
            measured["message"] = _local_paths(measured["message"])
            (folder / REPRO_FILE).write_text(repro_text({"case": result.minimal, "repro": measured}),
                                             encoding="utf-8")
            record["repro_exit"] = run_repro(folder / REPRO_FILE, release=_release_of_this_process()).returncode
            record["repro"] = measured
    (folder / RECORD_FILE).write_text(_json(record), encoding="utf-8")
    return record


def only_this_defect(defect: KnownDefect, case: Case) -> bool:
    """``case`` is in ``defect``'s domain and in no other known defect's of the same implementation: a finding is
    minimized without trading it for another (selective_state_update raises the same TypeError, on the same
    line, with D None and with dt_bias None)."""
    impl = defect.implementations[0]
    return defect.applies(case) and not any(d.applies(case) for d in DEFECTS
                                            if d is not defect and impl in d.implementations)


def _release_of_this_process() -> Optional[Path]:
    """The release directory this process was started with (compute_elsewhere's child), else None."""
    where = os.environ.get("SSDIFF_FINDINGS_RELEASE")
    return Path(where) if where else None


def compute_elsewhere(defect: KnownDefect, where: Path, root: Path, max_runs: int) -> None:
    """compute_here in a child process whose mamba_ssm is the release installed in ``where``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "SSDIFF_FINDINGS_RELEASE": str(where)}
    subprocess.run([sys.executable, "-m", "ssdiff.registry.findings", "--here", "--no-render", "--only", defect.id,
                    "--root", str(root), "--max-runs", str(max_runs)], env=env, cwd=REPO, check=True)


def compute(defects=None, root: Path = FINDINGS_DIR, max_runs: int = MAX_RUNS, elsewhere: bool = True) -> None:
    """compute_here for each finding, with the installed release when the record says it is affected, else
    (``elsewhere``) with the first affected release of ``release_dirs()``."""
    for defect in defects if defects is not None else [d for d in DEFECTS if is_finding(d)]:
        if not defect.affects(installed_version(defect.package)) and elsewhere:
            where = next((w for w in release_dirs() if defect.affects(release_version(w))), None)
            if where is not None:
                print(f"{defect.id}: with {defect.package} {release_version(where)} from {where}", flush=True)
                compute_elsewhere(defect, where, root, max_runs)
                continue
        record = compute_here(defect, root, max_runs)
        print(f"{defect.id}: {record['release']}: "
              + (f"repro exits {record['repro_exit']}" if record["reproduces"] else record["why"]), flush=True)


# ---- render (fast, pure): FINDINGS.md from the registry and reports/findings/ -------------------------------

def read_finding(defect_id: str, root: Path = FINDINGS_DIR) -> Optional[dict]:
    """finding.json with the case of case.json under "case" (a Case), or None when not computed."""
    folder = finding_dir(defect_id, root)
    if not (folder / RECORD_FILE).is_file():
        return None
    record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    record["case"] = Case.from_json((folder / CASE_FILE).read_text(encoding="utf-8"))
    record["has_repro"] = "repro" in record
    return record


def recorded_sides(case_path) -> list:
    """The implementation a finding's case.json diverges on, from the finding.json beside it, or []."""
    record = Path(case_path).with_name(RECORD_FILE)
    try:
        implementation = json.loads(record.read_text(encoding="utf-8")).get("implementation")
    except (OSError, ValueError, AttributeError):
        return []
    return [implementation] if isinstance(implementation, str) else []


class NoRepro(LookupError):
    """A finding without a repro: no such defect, no files under reports/findings/, or no divergence to show."""


def repro_text(found: dict) -> str:
    """repro.py of a finding (`read_finding`'s record): its case and what finding.json took of the run, rendered
    by harness/reproduce/repro.py; the same bytes every time, no kernel run."""
    from ssdiff.reproduce import repro

    return repro.render(found["case"], found["repro"])


def write_repro(defect_id: str, out: Optional[Path] = None, root: Path = FINDINGS_DIR) -> Path:
    """Write finding ``defect_id``'s repro.py from its case.json and finding.json to ``out`` (default: beside them);
    the path. NoRepro names why there is none."""
    if defect_id not in BY_ID:
        raise NoRepro(f"no defect {defect_id!r}")
    if not is_finding(BY_ID[defect_id]):
        raise NoRepro(f"{defect_id} is no finding (FINDINGS.md lists it among those not found by ssdiff): it has no "
                      f"files under reports/findings/")
    found = read_finding(defect_id, root)
    if found is None:
        raise NoRepro(f"{defect_id} has no files under reports/findings/: run `python -m ssdiff.registry.findings "
                      f"--only {defect_id}`")
    if not found["has_repro"]:
        raise NoRepro(f"{defect_id} has no repro: the example does not diverge with {found['release']}")
    path = Path(out) if out is not None else finding_dir(defect_id, root) / REPRO_FILE
    path.write_text(repro_text(found), encoding="utf-8")
    return path


def _repro_line(defect: KnownDefect, found: dict) -> str:
    needs = DRAFTS[defect.id].needs
    if not found["has_repro"]:
        return f"No repro: the example does not diverge with {found['release']} ({found['why']})."
    exit_text = {1: "exits 1 (the divergence exists)", 0: "exits 0 — it does not show the divergence"}
    interpreter = ("; on a machine without a GPU it runs the Triton kernels under the Triton interpreter"
                   if "triton" in needs else "")
    return (f"`ssdiff known --repro {defect.id}` writes it to `reports/findings/{defect.id}/{REPRO_FILE}` from the "
            f"files there (`--out FILE` elsewhere). Run with `python` (needs {needs}{interpreter}), it exits 1 while "
            f"the defect exists, 0 once it is fixed; "
            f"with {found['release']}, where it was measured, it "
            f"{exit_text.get(found.get('repro_exit'), 'exits ' + str(found.get('repro_exit')))}.")


def _case_block(found: dict) -> list:
    case: Case = found["case"]
    return ["```", case.describe(), "```", "", "<details><summary>case.json</summary>", "", "```json",
            case.to_json(), "```", "", "</details>"]


def _upstream_function(defect: KnownDefect, impl: str) -> str:
    from ssdiff.reproduce.repro import MAMBA_FUNCTIONS

    if DRAFTS[defect.id].call:
        return DRAFTS[defect.id].call
    return MAMBA_FUNCTIONS[impl][0] if impl in MAMBA_FUNCTIONS else impl


def upstream_link(defect: KnownDefect) -> str:
    """The opening table's upstream cell: the first reference as a link (and how many more), or the search that
    found none."""
    if not defect.references:
        return defect.upstream
    first = defect.references[0]
    more = len(defect.references) - 1
    return f"[{first.repo}#{first.number}]({first.url})" + (f" (+{more})" if more else "")


def render_record(defect: KnownDefect, found: Optional[dict]) -> list:
    """The FINDINGS.md section of one record: its statement and fields; a finding's case and repro; a draft upstream
    report only for an unreported one (the others name their code path)."""
    out = [f"## {defect.id}", "", f"**Statement.** {defect.statement}.", "",
           f"- Status: {defect.status}", f"- Severity: {defect.severity}",
           f"- Affected releases: {defect.releases}" + (" (bisected: `ssdiff bisect`, "
                                                          f"reports/findings/{defect.id}/bisect.json)"
                                                          if (finding_dir(defect.id) / "bisect.json").is_file() else ""),
           "- Upstream: " + ("; ".join(f"[{r.repo} {r.kind} #{r.number}]({r.url}) \"{r.title}\""
                                       + (f" ({r.note})" if r.note else "") for r in defect.references)
                             or defect.upstream),
           f"- Implementations: {', '.join(f'`{i}`' for i in defect.implementations)}",
           f"- Pinned by: `{defect.test}`", ""]
    if not is_finding(defect):
        return out
    if found is None:
        return out + ["Not computed yet: run `python -m ssdiff.registry.findings`.", ""]
    draft = DRAFTS[defect.id]
    if found["reproduces"]:
        how = (f"minimized against the float64 oracle with {found['release']} in {found['runs']} runs"
               if found["shrunk"] else f"the registry's example (minimizing did not shrink it; {found['release']})")
        out += [f"### Minimized case ({how})", ""]
    else:
        out += [f"### Case: the registry's example; it does not diverge with {found['release']}, so that "
                f"release is not affected", ""]
    out += _case_block(found) + ["", "### Repro", "", _repro_line(defect, found), ""]
    if not has_draft(defect):
        return out + [f"*Code path.* {draft.code_path}", ""]
    if not found["reproduces"]:
        return out
    out += ["### Draft upstream report", "", f"**{draft.title}**", "",
            f"*What happens.* Calling `{_upstream_function(defect, found['implementation'])}` on the case of the "
            f"repro (`{found['case'].describe()}` in ssdiff's notation), against a float64 token-by-token "
            f"evaluation of the same inputs:", ""]
    out += [f"- {line}" for line in found["symptom"]]
    ready = "" if found.get("repro_exit") == 1 else (
        f" (Not ready to paste: written with {found['release']}, it exits {found.get('repro_exit')}.)")
    out += ["", f"*What should happen.* {draft.should}", "",
            f"*Repro.* The attached `repro.py` (standalone: {draft.needs}) draws the inputs from a fixed seed, "
            f"runs the function and a float64 reference, prints the largest errors against the allowed ones and "
            f"exits 1 while the defect exists.{ready}", "",
            f"*Affected code path.* {draft.code_path}", "",
            f"*Environment.* {found['release']}, torch {found['torch']}, triton {found['triton']}; "
            + ("the kernels under the Triton interpreter on a CPU." if found.get("device", "cpu") == "cpu" else
               f"the kernels natively on {found.get('gpu', 'a GPU')}"
               + (f", every autotuned kernel on config index {found['autotune']} (config index % its count)"
                  if found.get("autotune", "tuned") != "tuned" else "") + "."), ""]
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(root: Path = FINDINGS_DIR) -> str:
    """FINDINGS.md's text (pure: the registry and the files under ``root``)."""
    missing = [d.id for d in DEFECTS if is_finding(d) and d.id not in DRAFTS]
    if missing:
        raise KeyError(f"harness/registry/findings.py DRAFTS has no draft for {', '.join(missing)}")
    out = ["# Findings", "",
           "Every record of the known-defect registry (`harness/registry/known.py`), generated by "
           "`python -m ssdiff.registry.findings` (`--render` rewrites this page from `reports/findings/` alone; "
           "`ssdiff known --repro ID` writes a finding's `repro.py` from its files there; `ssdiff bisect ID` finds "
           "its affected releases; `properties/test_findings.py` runs every repro and checks this page is current). "
           "A defect ssdiff found has its minimized case and a standalone `repro.py`; one nobody has reported also "
           "has a draft upstream report.", "",
           "| id | project | severity | status | affected releases | upstream |",
           "| --- | --- | --- | --- | --- | --- |"]
    for d in DEFECTS:
        out += ["| " + " | ".join(_cell(c) for c in (f"[{d.id}](#{d.id})", d.package, d.severity, d.status,
                                                      d.releases, upstream_link(d))) + " |"]
    out += [""]
    for d in DEFECTS:
        out += render_record(d, read_finding(d.id, root) if is_finding(d) else None)
    return "\n".join(out).rstrip("\n") + "\n"


def stale(root: Path = FINDINGS_DIR, catalogue: Path = CATALOGUE) -> Optional[str]:
    """None when ``catalogue`` is what render writes, else a unified diff."""
    want = render(root)
    have = catalogue.read_text(encoding="utf-8") if catalogue.is_file() else ""
    if want == have:
        return None
    return "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(catalogue), "render"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssdiff.registry.findings", description=__doc__.split("\n\n")[0])
    p.add_argument("--render", action="store_true", help="only render FINDINGS.md from reports/findings/")
    p.add_argument("--check", action="store_true", help="exit 1 when FINDINGS.md is not what --render writes")
    p.add_argument("--only", nargs="+", metavar="ID", help="compute only these findings")
    p.add_argument("--max-runs", type=int, default=MAX_RUNS, help="minimization budget per finding (runs)")
    p.add_argument("--root", type=Path, default=FINDINGS_DIR, help=argparse.SUPPRESS)
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)        # compute_elsewhere's child
    p.add_argument("--no-render", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check:
        diff = stale(args.root)
        print(diff or "FINDINGS.md is current", end="" if diff else "\n")
        return 1 if diff else 0
    if not args.render:
        from ssdiff import runtime

        runtime.configure()
        unknown = [i for i in args.only or () if i not in BY_ID]
        if unknown:
            print(f"python -m ssdiff.registry.findings: no defect {', '.join(unknown)}", file=sys.stderr)
            return 2
        compute([BY_ID[i] for i in args.only] if args.only else None, args.root, args.max_runs,
                elsewhere=not args.here)
    if not args.no_render:
        CATALOGUE.write_text(render(args.root), encoding="utf-8")
        print(f"wrote {CATALOGUE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
