"""Known upstream defects: one record each, the data behind the "known" verdict, `ssdiff known` and FINDINGS.md.

A defect is not a capability. An adapter's capabilities say only what its call can express (signature,
layout, dtypes, devices); a case that hits a known defect is still run and judged. When it diverges on the
affected side of an affected release it is reported as that defect (counted under its id, not stopping the
campaign); when the predicate matches and it does not diverge, that is recorded too ("matched, not
reproduced": the predicate is wider than the defect, or the release fixed it). A divergence no record
matches is a new finding.

Each record: ``id``; ``implementations`` (registry names); ``package`` and ``affected`` — the releases, as
``(first, fixed)`` versions, ``fixed`` None while no release fixes it; ``applies(case)`` — the predicate;
``statement`` (one line); ``status`` (found by ssdiff / reported upstream / fixed in a release / by design);
``test`` (the property that pins it); ``example`` (a case it diverges on, minimized).

Most records explain every divergence of a case in their domain. A numerical defect whose error can be bounded
per element says so instead (``error``): it explains a divergence only where every tensor out of budget is one it
corrupts and lies within its budget plus that error (`explains`), so that any other divergence of the same case,
or a larger one of the same tensor, is still a new finding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ssdiff.model.case import Case, Regime
from ssdiff.inputs.drawing import draw

KNOWN_POLICIES = ("report", "skip", "ignore")

# The fixed scale of severities, the worst first.
DEFAULT_WRONG = "wrong outputs in a default configuration"
DEFAULT_CRASH = "crash with a default argument"
NON_DEFAULT = "wrong outputs or crash in a non-default configuration"
EDGE_CASE = "numerical edge case"
BY_DESIGN = "by design / numerical limitation of the algorithm"
SEVERITIES = (DEFAULT_WRONG, DEFAULT_CRASH, NON_DEFAULT, EDGE_CASE, BY_DESIGN)

# A record's status: one of these, "fixed upstream in" followed by the first fixed release (`affected`).
UNREPORTED = "found by ssdiff, unreported"
REPORTED = "reported upstream (open)"
FIXED = "fixed upstream in"
DESIGNED = "by design"
STATUSES = (UNREPORTED, REPORTED, FIXED, DESIGNED)


@dataclass(frozen=True)
class Reference:
    """An upstream issue or pull request about a record's defect, its title as the tracker gives it."""

    repo: str                  # "state-spaces/mamba"
    kind: str                  # "issue" or "PR"
    number: int
    title: str
    note: str = ""             # what it is to the record ("fixes it", "vLLM's copy", ...)

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/{'pull' if self.kind == 'PR' else 'issues'}/{self.number}"

    def describe(self) -> str:
        return f"{self.repo} {self.kind} #{self.number} \"{self.title}\"" + (f" ({self.note})" if self.note else "")

# ln(float32 max): exp of a larger segment sum overflows.
EXP_OVERFLOW_F32 = 88.72


@dataclass(frozen=True)
class KnownDefect:
    id: str
    implementations: tuple
    package: str
    affected: tuple                       # (first affected release, first fixed release or None)
    applies: Callable[[Case], bool]
    statement: str
    status: str
    test: str
    example: Case
    # The predicate covers every case of a pass and dtype: (backward, dtype) -> bool. Properties that draw cases
    # for that pass say so instead of drawing (nothing is left to draw).
    whole_pass: Callable[[bool, str], bool] = lambda backward, dtype: False
    # Device types where the example is measured to diverge, when not every one: a numerical defect whose size
    # depends on the device's order of operations can fall within budget elsewhere at the same inputs.
    example_devices: tuple = ()
    # The severity (SEVERITIES), the upstream issues and pull requests (References), and when none is known the date
    # the trackers were searched; whether ssdiff found it (or took it from upstream's own account).
    severity: str = ""
    references: tuple = ()
    searched: str = ""
    found_by_ssdiff: bool = True
    # The autotune config index the example is measured under (harness/runtime.py, `autotune`), where the defect
    # follows the config: "tuned" otherwise (the benchmark picks, and may pick a config without the defect).
    example_choice: object = "tuned"
    # A numerical defect's own error: (case, inputs) -> {tensor name ("grad.A", ...): float64 error per element}.
    # None: the record explains any divergence of a case in its domain.
    error: Optional[Callable] = None
    # Where in its domain ``error`` holds (a case -> bool): elsewhere the record explains any divergence.
    bounded: Callable[[Case], bool] = lambda case: True

    def bounds(self, case: Case) -> bool:
        """Whether the record bounds its error on ``case`` (`explains` only a divergence within it: the case is
        judged) rather than explaining any divergence of it."""
        return self.error is not None and self.bounded(case)

    def replay_command(self) -> str:
        """The shell command that judges the example again with the first implementation."""
        device = f" --device {self.example_devices[0]}" if self.example_devices else ""
        config = f" --autotune {self.example_choice}" if self.example_choice != "tuned" else ""
        return (f"ssdiff known --case {self.id} > case.json && ssdiff replay case.json --impl "
                f"{self.implementations[0]}{device}{config}")

    def affects(self, version: Optional[str]) -> bool:
        """Is release ``version`` of the package affected (None: not installed)?"""
        if version is None:
            return False
        from packaging.version import Version

        first, fixed = self.affected
        return Version(version) >= Version(first) and (fixed is None or Version(version) < Version(fixed))

    @property
    def upstream(self) -> str:
        """The references, one string; or when there are none, the search that found none."""
        if self.references:
            return "; ".join(r.describe() for r in self.references)
        return f"none found, searched {self.searched}" if self.searched else ""

    @property
    def releases(self) -> str:
        first, fixed = self.affected
        return f"{self.package} >= {first}" + (f", fixed in {fixed}" if fixed else " (no fixed release)")


@functools.lru_cache(maxsize=512)
def row_decay(case: Case) -> float:
    """The largest sum over a batch row of |dt' A| (dt' after bias and softplus), per head, from the case's own
    inputs (drawn deterministically from its seed; cached: asked for the same case while drawing and judging)."""
    values = draw(case, decay_only=True)[0]
    return float((_dt_prime(case, values) * values["A"]).abs().sum(1).max())


def _dt_prime(case: Case, values: dict) -> torch.Tensor:
    """dt after the bias and the softplus, as the scan takes it (no clamp), from drawn ``values``."""
    dt = values["dt"] + (values["dt_bias"] if "dt_bias" in values else 0.0)
    return torch.nn.functional.softplus(dt) if case.dt_softplus else dt


@functools.lru_cache(maxsize=512)
def ragged_end_decay(case: Case) -> float:
    """The largest |sum of dt' A| over the tokens of a chunk that a sequence ends inside (its end not on a
    chunk_size boundary of the row), from the sequence's start or the chunk's, whichever is later: the within-chunk
    cumsum a chunked kernel reads there (0 when every sequence ends on a boundary)."""
    values = draw(case, decay_only=True)[0]
    dt = _dt_prime(case, values)
    if case.dt_limit is not None:
        dt = dt.clamp(*case.dt_limit)
    dA = (dt * values["A"]).abs()                                            # (b, L, h)
    Q, worst = case.chunk_size, 0.0
    for row in range(case.batch):
        lengths = case.segments[row] if case.segments is not None else (case.seqlen,)
        start = 0
        for length in lengths:
            end = start + length
            if length and end % Q:
                first = max(start, (end - 1) // Q * Q)
                worst = max(worst, float(dA[row, first:end].sum(0).max()))
            start = end
    return worst


# Where a ragged chunk's within-chunk dA cumsum passes 2^14, one of its float32 ulps (2^-9) is a 0.2% error of a
# decay factor exp(cumsum difference).
RAGGED_DECAY_ULP_MATTERS = 2.0 ** 14


def _padded(case: Case) -> bool:
    return bool(case.padding and any(case.padding))


def _decays_fast(case: Case) -> bool:
    """Typical or strong decay, or dt above 20: where ssd_minimal's half-precision sums of A*dt corrupt every
    output (mamba-ssd-minimal-half-precision-chunk-sum explains any divergence there)."""
    return case.regime.decay in ("typical", "strong") or case.regime.dt_large


# The weight of the backward's accumulation in `decay_sum_error`: its worst case, L_abs * T, adds up coherently only
# rarely (measured: harness/README.md, the two records that take it).
BACKWARD_SUM_WEIGHT = 1.0 / 16


def decay_sum_error(sums_dtype: Optional[str] = None) -> Callable:
    """A record's error for an implementation that sums a = A*dt (cumsums, segment sums, and their backward) in
    ``sums_dtype`` (None: the case's dtype), which its decays are taken from: for the gradient of A, per head,
    u * (S * M + BACKWARD_SUM_WEIGHT * L_abs * T), with u that dtype's unit roundoff; S a row's sum of |a| (the
    largest over the batch), which bounds a sum's rounding relative to u; M the gradient of A of the problem with
    |x|, |B|, |C|, |z|, |D|, |h0| and |dy|, every decay term's contribution added rather than cancelled; L_abs that
    problem's sum of |dy| * y, what the sums' backward accumulates; T a row's sum of dt (the largest over the
    batch); M and L_abs from the float64 oracle. (For cases without final_states.)"""
    def error(case: Case, inputs) -> dict:
        from ssdiff import truth
        from ssdiff.model.dtypes import UNIT_ROUNDOFF

        t = inputs.float64()
        A = t["A"].detach().clone().requires_grad_(True)
        magnitudes = {n: t[n].abs() for n in ("x", "B", "C", "z", "D", "initial_states") if n in t}
        y = truth.call("ref.chunked", case, {**t, **magnitudes, "A": A}, inputs.seq_idx).outputs["y"]
        dy = inputs.grad_outputs["y"].abs()
        M = torch.autograd.grad(y, A, dy)[0].abs()                                          # (h,)
        L_abs = (y.detach() * dy).sum((0, 1, 3))
        dt = t["dt"].detach()
        S = (t["A"].detach() * dt).abs().sum(1).max(0).values
        T = dt.sum(1).max(0).values
        u = UNIT_ROUNDOFF[getattr(torch, sums_dtype or case.dtype)]
        return {"grad.A": u * (S * M + BACKWARD_SUM_WEIGHT * L_abs * T)}
    return error


UPSTREAM_TESTS = "properties/test_upstream.py::test_known_defect_reproduces"

# Upstream references (titles as the trackers give them; searched 2026-12-07).
MAMBA = "state-spaces/mamba"
GROUPED_NORM_REFS = (
    Reference(MAMBA, "PR", 547,
              "Fix Consider group_size in layer_norm_bwd", "the fix"),
)
EXP_CLAMP_REFS = (
    Reference(MAMBA, "issue", 352,
              "Loss NaN in Mamba2"),
    Reference(MAMBA, "issue", 558,
              "I found this line of code causes NaN of `dx`"),
    Reference(MAMBA, "PR", 746,
              "Fix _chunk_state_bwd_db_kernel: an exp got drop during a previous PR",
              "restores an exp the clamping PR it names, #713, dropped"),
)
REF_NORM_REFS = (
    Reference(MAMBA, "issue", 647,
              "`mamba_split_conv1d_scan_combined` and `mamba_split_conv1d_scan_ref` exhibit large numerical "
              "differences when `ngroups > 1`"),
)
STRIDES_REFS = (
    Reference(MAMBA, "PR", 796,
              "Fix stride handling for optional dt_bias and D"),
    Reference("vllm-project/vllm", "PR", 21532,
              "[Bugfix] Handle None case for dt_bias and D in selective_state_update", "vLLM's copy; closed"),
)
TRANSFORMERS_GROUPS_REFS = (
    Reference("huggingface/transformers", "PR", 40861,
              "Support n_groups>1 for mamba2"),
)
STEP_D_REFS = (
    Reference(MAMBA, "issue", 887,
              "`Mamba2.step()` handles `D` incorrectly when `D_has_dim=True`"),
    Reference(MAMBA, "issue", 888,
              "Mamba2 `step()` works silently but when D_has_hdim=True and selective_state_update=None but is"),
    Reference(MAMBA, "PR", 932,
              "Fix Mamba2.step() mishandling D when D_has_hdim=True", "closed unmerged"),
)


DEFECTS = (
    KnownDefect(
        id="mamba-varlen-states-drop-initial-states",
        implementations=("mamba_ssm.chunk_scan_combined",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: (c.varlen_states and c.initial_states and c.seq_idx_start == 0
                           and c.segments[0][0] <= c.chunk_size),
        statement="mamba_chunk_scan_combined's varlen_states leave out initial_states when the first sequence ends "
                  "inside the first chunk (chunk_state_varlen adds the passed-in state only to sequences begun in an "
                  "earlier chunk), while y and final_states use them",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(seqlen=19, nheads=3, ngroups=3, headdim=4, dstate=5, chunk_size=8, initial_states=True,
                     segments=((4, 8, 7),), varlen_states=True, regime=Regime(decay="mild"), seed=12)),
    KnownDefect(
        id="mamba-final-state-gradient-into-padding",
        implementations=("mamba_ssm.chunk_scan_combined", "mamba_ssm.split_conv1d_combined"), package="mamba-ssm",
        affected=("2.2.6.post3", None),
        applies=lambda c: c.final_state_grad and _padded(c),
        statement="with seq_idx = -1 padding ending a row, final_states is 0 (the forward skips padding since "
                  "PR #792) but the backward sends d(final_states) into that row's tokens",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(seqlen=16, nheads=2, headdim=3, dstate=4, chunk_size=8, segments=((6, 7),), padding=(3,),
                     pass_="backward", final_state_grad=True, seed=3)),
    KnownDefect(
        id="mamba-swiglu-backward-without-out-proj",
        # mamba_ssm's Mamba2 layer reaches it on its mem-eff path (always with out_proj; d_ssm < d_inner, no rmsnorm)
        implementations=("mamba_ssm.split_conv1d_combined", "mamba_ssm.mamba2_mem_eff"), package="mamba-ssm",
        affected=("2.1.0", None),
        applies=lambda c: c.backward and c.d_nonssm > 0 and ((c.out_dim is None and c.entry != "layer")
                                                            or not c.rmsnorm),
        statement="mamba_split_conv1d_scan_combined's backward raises with d_nonssm > 0 unless both rmsnorm and "
                  "out_proj are given (no out_proj: UnboundLocalError on out0_recompute; out_proj without rmsnorm: "
                  "RuntimeError, autograd rejects d(outproj_weight), which lacks the SwiGLU columns: shape "
                  "(out, dim) for (out, dim + d_nonssm)); Mamba2 with use_mem_eff_path, d_ssm < d_inner and "
                  "rmsnorm=False inherits it",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(entry="split_conv1d", seqlen=8, nheads=2, headdim=4, dstate=4, chunk_size=8, d_nonssm=2,
                     pass_="backward")),
    KnownDefect(
        id="mamba-grouped-norm-backward",
        implementations=("mamba_ssm.split_conv1d_combined",), package="mamba-ssm", affected=("2.1.0", "2.2.3.post2"),
        applies=lambda c: c.backward and c.rmsnorm and c.ngroups > 1,
        statement="mamba_split_conv1d_scan_combined's backward normalizes the gated RMSNorm over all of dim (it "
                  "does not pass group_size; its forward does): gradients with ngroups > 1 are wrong",
        status=f"{FIXED} 2.2.3.post2", severity=NON_DEFAULT, references=GROUPED_NORM_REFS,
        test=UPSTREAM_TESTS,
        example=Case(entry="split_conv1d", seqlen=8, nheads=2, ngroups=2, headdim=4, dstate=4, chunk_size=8,
                     rmsnorm=True, out_dim=4, pass_="backward", seed=5)),
    KnownDefect(
        id="mamba-softplus-backward-nan-above-20",
        # the layers whose training path is this kernel (mamba_ssm's Mamba2 mem-eff path, fla's fused path) inherit it
        implementations=("mamba_ssm.split_conv1d_combined", "mamba_ssm.mamba2_mem_eff", "fla.mamba2_fused"),
        package="mamba-ssm", affected=("2.1.0", "2.2.5"),
        applies=lambda c: c.backward and c.dt_softplus and c.regime.dt_large and c.regime.decay in ("typical", "strong"),
        statement="mamba_split_conv1d_scan_combined's backward returns NaN gradients of dt (zxbcdt's dt channels), "
                  "dt_bias and A with dt above 20 under typical or strong decay: its chunk kernels exponentiate "
                  "differences of the dA cumsum unclamped (exp(dA_cs_m - dA_cs_k)), which overflow to inf at the "
                  "masked-out positions, where the mask then makes inf * 0 = NaN (the softplus is not the cause: "
                  "it already passes dt through above 20)",
        status=f"{FIXED} 2.2.5", severity=EDGE_CASE, references=EXP_CLAMP_REFS,
        test=UPSTREAM_TESTS,
        example=Case(entry="split_conv1d", batch=1, seqlen=4, nheads=1, headdim=2, ngroups=1, dstate=11,
                     chunk_size=4, D="head", return_final_states=False, conv_width=1,
                     regime=Regime(decay="typical", dt_large=True),
                     pass_="backward", seed=0)),
    KnownDefect(
        id="mamba-ref-norm-over-whole-dim",
        implementations=("mamba_ssm.split_conv1d_ref",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: c.rmsnorm and c.ngroups > 1,
        statement="mamba_split_conv1d_scan_ref normalizes the gated RMSNorm over the whole dim instead of per group "
                  "(dim // ngroups) when ngroups > 1; the fused mamba_split_conv1d_scan_combined is right",
        status=REPORTED, severity=NON_DEFAULT, references=REF_NORM_REFS, found_by_ssdiff=False,
        test=UPSTREAM_TESTS,
        example=Case(entry="split_conv1d", batch=1, seqlen=16, nheads=4, ngroups=2, headdim=4, dstate=4,
                     chunk_size=8, rmsnorm=True, return_final_states=False, regime=Regime(decay="typical"))),
    KnownDefect(
        id="mamba-ref-norm-one-channel",
        # measured: every seqlen > 1 fails, and seqlen 1 in batch 1 (in batch 2 the norm input has stride 1)
        implementations=("mamba_ssm.split_conv1d_ref",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: c.rmsnorm and c.nheads * c.headdim == 1 and (c.batch == 1 or c.seqlen > 1),
        statement="mamba_split_conv1d_scan_ref raises AssertionError in the gated RMSNorm when nheads * headdim "
                  "== 1: the scan output it normalizes reaches rmsnorm_fn with a last dimension of 1 and a stride "
                  "other than 1, which LayerNormFn's x.contiguous() leaves as it is (a size-1 dimension is "
                  "contiguous at any stride) and _layer_norm_fwd rejects",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(entry="split_conv1d", batch=1, seqlen=8, nheads=1, headdim=1, dstate=4, chunk_size=4,
                     rmsnorm=True, return_final_states=False)),
    KnownDefect(
        id="mamba-chunk-scan-unstable-ddA",
        implementations=("mamba_ssm.chunk_scan",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: c.backward,
        statement="mamba_chunk_scan's backward takes d(dA_cumsum) from einsum(out, dout) - ddt * dt, a difference "
                  "its authors call numerically unstable: its gradients carry rounding noise of the size of the "
                  "outputs under strong decay, and at any decay in the gradient of A (2.8x its budget in float32, "
                  "8.5x in float16 at typical decay, L=8, h=p=n=1; mamba_chunk_scan_combined agrees there)",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07", found_by_ssdiff=False,
        test=UPSTREAM_TESTS,
        example=Case(seqlen=16, nheads=4, headdim=5, ngroups=4, dstate=4, chunk_size=16, dtype="float16",
                     D="channel", return_final_states=False, pass_="backward", seed=49443,
                     regime=Regime(decay="typical", dt_large=True, values="integer", scale=0.25, layout="strided")),
        whole_pass=lambda backward, dtype: backward),
    KnownDefect(
        id="mamba-chunk-scan-ref-nan-gradients",
        implementations=("mamba_ssm.chunk_scan_ref",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: c.backward and (c.regime.decay == "strong" or c.regime.dt_large
                                          or (c.entry == "chunk_scan" and row_decay(c) > EXP_OVERFLOW_F32)),
        statement="ssd_chunk_scan_combined_ref takes exp of every segment sum, masked-out positive ones included: "
                  "once a row's total decay sum|dt A| passes 88.72 they overflow and the gradient is inf * 0 = NaN",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07", found_by_ssdiff=False,
        test=UPSTREAM_TESTS,
        example=Case(seqlen=8, nheads=2, headdim=1, dstate=1, chunk_size=8, return_final_states=False,
                     regime=Regime(decay="strong"), pass_="backward")),
    KnownDefect(
        id="mamba-chunk-scan-ref-float32-decay-sums",
        implementations=("mamba_ssm.chunk_scan_ref",), package="mamba-ssm", affected=("2.0.0", None),
        # below the overflow (mamba-chunk-scan-ref-nan-gradients, listed first, takes the rest)
        applies=lambda c: c.backward and c.dtype == "float32" and not c.return_final_states,
        error=decay_sum_error("float32"),
        statement="ssd_chunk_scan_combined_ref sums dt*A in float32 and takes its decays from that cumsum (the "
                  "state passing, which its authors call much less numerically stable, as differences of a "
                  "row-long cumsum), and autograd sums the cumsum's cancelling gradients back in float32: its "
                  "gradient of A now and then errs beyond the budget (2.25x at typical decay, L=36 Q=4)",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07", found_by_ssdiff=False,
        test=UPSTREAM_TESTS,
        example=Case(seqlen=36, nheads=1, headdim=8, ngroups=1, dstate=6, chunk_size=4, D="none", has_z=False,
                     has_dt_bias=False, dt_softplus=False, return_final_states=False,
                     regime=Regime(decay="typical", scale=0.25), pass_="backward", seed=2198),
        example_devices=("cpu",)),
    KnownDefect(
        id="mamba-ssd-minimal-half-precision-chunk-sum",
        implementations=("mamba_ssm.ssd_minimal",), package="mamba-ssm", affected=("2.0.0", None),
        # (with final_states returned, mamba-ssd-minimal-final-states-dtype explains a slowly decaying case whole)
        applies=lambda c: c.dtype != "float32" and (_decays_fast(c) or (c.backward and not c.return_final_states)),
        bounded=lambda c: not _decays_fast(c), error=decay_sum_error(),
        statement="ssd_minimal_discrete sums A*dt over each chunk in its input dtype: in float16/bfloat16 with "
                  "typical decay every decay factor is off by ~1%, and larger sums lose more or overflow fp16; "
                  "with mild or no decay the gradient of A, which the sums' backward also accumulates in that "
                  "dtype, now and then errs beyond the budget (1.67x, b=2 L=12 Q=4, float16, mild decay)",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07", found_by_ssdiff=False,
        test=UPSTREAM_TESTS,
        example=Case(seqlen=64, nheads=1, headdim=1, ngroups=1, dstate=1, chunk_size=64, dtype="float16", D="none",
                     has_dt_bias=False, dt_softplus=False, return_final_states=True, seed=0,
                     regime=Regime(decay="strong", dt_large=True), pass_="backward")),
)

# Where a release returns a tensor in another dtype than the interface ssdiff judges (y in the input dtype,
# final and varlen states in float32): a mismatch verdict whatever the values (found by ssdiff; upstream's choice).

DEFECTS += (
    KnownDefect(
        id="mamba-ssd-minimal-final-states-dtype",
        implementations=("mamba_ssm.ssd_minimal",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: c.dtype != "float32" and c.return_final_states,
        statement="ssd_minimal_discrete returns final_states in its input dtype (float16/bfloat16), not float32",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(seqlen=16, nheads=2, headdim=6, ngroups=2, dstate=2, chunk_size=16, dtype="float16", D="none",
                     has_dt_bias=False, dt_softplus=False, initial_states=True, seed=6, regime=Regime(decay="mild"))),
    KnownDefect(
        id="mamba-ssd-minimal-grad-A-strong-decay",
        implementations=("mamba_ssm.ssd_minimal",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: (c.backward and c.dtype == "float32" and c.final_state_grad
                           and (c.regime.decay == "strong" or (c.regime.dt_large and c.regime.decay != "none"))),
        statement="ssd_minimal_discrete's gradient of A through final_states under strong decay per step (strong A, "
                  "or dt above 20) in float32 (31x its budget at L=8, h=p=n=1 with strong A; 2.5e5x with dt above "
                  "20): autograd through differences of the A*dt cumsum, which the final state's decay is taken "
                  "from. Without a final-state gradient it agreed in 346 of 346 such cases, so does "
                  "mamba_chunk_scan_combined",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07", found_by_ssdiff=False,
        test=UPSTREAM_TESTS,
        example=Case(seqlen=8, nheads=1, headdim=1, ngroups=1, dstate=1, chunk_size=8, D="none", has_dt_bias=False,
                     dt_softplus=False, final_state_grad=True, regime=Regime(decay="strong"), pass_="backward",
                     seed=1),
        # On an H200 (torch 2.11, 2026-12-02) this example's gradient of A was within budget.
        example_devices=("cpu",)),
    KnownDefect(
        id="mamba-chunk-scan-ref-y-dtype",
        implementations=("mamba_ssm.chunk_scan_ref",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: c.dtype != "float32",
        statement="ssd_chunk_scan_combined_ref returns y in float32 for float16/bfloat16 inputs, not in the input "
                  "dtype",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(seqlen=16, nheads=3, headdim=4, ngroups=3, dstate=5, chunk_size=8, dtype="float16",
                     return_final_states=False, regime=Regime(decay="mild"), seed=12),
        whole_pass=lambda backward, dtype: dtype != "float32"),
    KnownDefect(
        id="mamba-varlen-states-dtype",
        implementations=("mamba_ssm.chunk_scan_combined",), package="mamba-ssm", affected=("2.0.0", None),
        applies=lambda c: c.varlen_states and c.dtype != "float32",
        statement="mamba_chunk_scan_combined returns varlen_states in its input dtype (float16/bfloat16) while its "
                  "final_states are float32",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(seqlen=16, nheads=2, headdim=4, dstate=4, chunk_size=8, dtype="float16", segments=((5, 11),),
                     varlen_states=True, regime=Regime(decay="mild"), seed=12)),
)

# selective_state_update (read in 2.3.2.post1; bisected: every release from 2.0.3 on, 2.0.0-2.0.2 do not load) passes
# optional tensors' strides to the kernel as
# ``*(D.stride(0), D.stride(1)) if D is not None else 0``, which Python reads as ``*(... if ... else 0)``: with D None
# it unpacks the int 0 (TypeError). dt_bias None fails the same way, and on Mamba-2's tie_hdim layout even earlier,
# in ``dt_bias.stride(-1) == 0`` (AttributeError). The signature offers D=None and dt_bias=None.

DEFECTS += (
    KnownDefect(
        id="mamba-state-update-D-none",
        implementations=("mamba_ssm.selective_state_update",), package="mamba-ssm", affected=("2.0.3", None),
        applies=lambda c: c.entry == "decode" and c.D == "none",
        statement="selective_state_update raises TypeError when D is None (the signature's default): its launch "
                  "unpacks `*(D.stride(0), D.stride(1)) if D is not None else 0`, i.e. `*0`",
        status=REPORTED, severity=DEFAULT_CRASH, references=STRIDES_REFS,
        test=UPSTREAM_TESTS,
        example=Case(entry="decode", seqlen=1, nheads=1, headdim=1, dstate=1, D="none")),
    KnownDefect(
        id="mamba-state-update-dt-bias-none",
        implementations=("mamba_ssm.selective_state_update",), package="mamba-ssm", affected=("2.0.3", None),
        applies=lambda c: c.entry == "decode" and not c.has_dt_bias,
        statement="selective_state_update raises when dt_bias is None (the signature's default): AttributeError in "
                  "`dt_bias.stride(-1)` on Mamba-2's tie_hdim layout, else TypeError from `*(dt_bias.stride(0), "
                  "dt_bias.stride(1)) if dt_bias is not None else 0`",
        status=REPORTED, severity=DEFAULT_CRASH, references=STRIDES_REFS,
        test=UPSTREAM_TESTS,
        example=Case(entry="decode", seqlen=1, nheads=1, headdim=1, dstate=1, has_dt_bias=False)),
)

# The layer entry (read in flash-linear-attention 0.6.0 and transformers 5.20.2; the half-precision dt also measured
# in transformers 5.17.0, on an H200; the norm's grouping bisected over 5.16.0-5.25.0: 5.18.0 to 5.22.2, while 5.16
# and 5.17 do not import beside huggingface-hub 2, so the range here starts at 5.18.0): each layer's plain-torch path
# groups heads differently from mamba_ssm's Mamba2 and kernels.
LAYER = dict(entry="layer", return_final_states=False, rmsnorm_eps=1e-5, norm_before_gate=False)

DEFECTS += (
    KnownDefect(
        id="fla-mamba2-torch-forward-tiles-groups",
        implementations=("fla.mamba2_torch",), package="flash-linear-attention", affected=("0.6.0", None),
        applies=lambda c: c.entry == "layer" and 1 < c.ngroups < c.nheads,
        statement="fla's Mamba2.torch_forward (what forward() runs off a GPU) expands B and C from n_groups to "
                  "num_heads with `repeat`, which tiles the groups (head h reads group h % n_groups), instead of "
                  "`repeat_interleave` (head h reads group h // (num_heads // n_groups), as mamba_chunk_scan_combined "
                  "on its kernel path does): its output is wrong whenever 1 < n_groups < num_heads",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(**LAYER, seqlen=4, nheads=4, ngroups=2, headdim=2, dstate=2, chunk_size=4, d_model=8)),
    KnownDefect(
        id="transformers-mamba2-norm-ignores-groups",
        implementations=("transformers.mamba2_mixer",), package="transformers", affected=("5.18.0", "5.23.0"),
        applies=lambda c: c.entry == "layer" and c.ngroups > 1 and c.rmsnorm,
        statement="transformers' Mamba2Mixer without hub kernels normalizes its gated RMSNorm (MambaRMSNormGated) "
                  "over all intermediate_size channels instead of per group of intermediate_size // n_groups, as "
                  "mamba_ssm's Mamba2 does and as the fused kernel the same mixer calls on its kernel path "
                  "(ngroups=n_groups) does: its output is wrong whenever n_groups > 1",
        status=f"{FIXED} 5.23.0", severity=NON_DEFAULT, references=TRANSFORMERS_GROUPS_REFS,
        test=UPSTREAM_TESTS,
        example=Case(**LAYER, seqlen=4, nheads=2, ngroups=2, headdim=2, dstate=2, chunk_size=4, d_model=4,
                     rmsnorm=True)),
    KnownDefect(
        id="transformers-mamba2-dt-in-half-precision",
        # 5.17.0 has the same dt lines (read in its wheel); an H200 campaign with it met the defect in bfloat16,
        # the gradient of A_log 1.6x its budget (L=11 h=2 p=1 n=45, rmsnorm, strong decay)
        implementations=("transformers.mamba2_mixer",), package="transformers", affected=("5.17.0", None),
        applies=lambda c: c.entry == "layer" and c.dtype in ("float16", "bfloat16"),
        statement="transformers' Mamba2Mixer without hub kernels computes dt in the activations' half precision: "
                  "its mamba2_chunk_scan casts the float32 dt_bias down (`dt + dt_bias.to(dt.dtype)`) and applies "
                  "softplus and dt_limit in float16 / bfloat16 (the kernels compute dt in float32): its gradients, "
                  "dt_bias's first, err beyond the same-precision budget (11x in float16 with dt_limit (0, 0.05), "
                  "0.14x once dt is computed in float32)",
        status=UNREPORTED, severity=EDGE_CASE, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(**LAYER, batch=2, seqlen=14, nheads=2, headdim=8, dstate=3,
                     chunk_size=1, d_model=1, conv_width=1, conv_bias=False, rmsnorm=True, dtype="float16",
                     dt_limit=(0.0, 0.05), pass_="backward", seed=3),
        whole_pass=lambda backward, dtype: dtype in ("float16", "bfloat16")),
)

# Mamba2.step (read in mamba-ssm 2.3.2.post1; D_has_hdim bisected: every release from 2.1.0 on, earlier ones do not
# run here): decoding through the inference cache.
def _dt_limit_active(c: Case) -> bool:
    return c.dt_limit is not None and (c.dt_limit[0] > 0 or c.dt_limit[1] != float("inf"))


@functools.lru_cache(maxsize=512)
def _decoded_dt_outside_limit(c: Case) -> bool:
    """Does a decoded token of layer case ``c`` have a dt (softplus of in_proj's dt rows plus dt_bias) outside
    dt_limit, so that clamping it matters? From the case's own inputs (drawn from its seed)."""
    values = draw(c)[0]
    rows = slice(-c.nheads, None)                       # zxbcdt ends with the dt channels
    dt = values["u"][:, c.seqlen - c.layer_steps:] @ values["in_proj_weight"][rows].T
    if "in_proj_bias" in values:
        dt = dt + values["in_proj_bias"][rows]
    dt = torch.nn.functional.softplus(dt + values["dt_bias"])
    lo, hi = c.dt_limit
    return bool(((dt < lo) | (dt > hi)).any())


def _decoded_dt_clamped(c: Case) -> bool:
    """A decoded layer whose dt_limit clamps the dt of a decoded token."""
    return (c.entry == "layer" and c.layer_steps > 0 and _dt_limit_active(c)
            and _decoded_dt_outside_limit(c))


DEFECTS += (
    KnownDefect(
        id="mamba-mamba2-step-D-has-hdim",
        implementations=("mamba_ssm.mamba2_no_mem_eff",), package="mamba-ssm", affected=("2.1.0", None),
        # with headdim 1 a per-channel D is a per-head one, and its broadcast is right
        applies=lambda c: c.entry == "layer" and c.layer_steps > 0 and c.D == "channel" and c.headdim > 1,
        statement="Mamba2.step (decoding with an inference cache) fails with D_has_hdim=True: it broadcasts D as if "
                  "it were per head, `repeat(self.D, \"h -> h p\", p=self.headdim)`, a (d_ssm, headdim) tensor that "
                  "selective_state_update rejects (AssertionError); the prefill through forward() takes the same D",
        status=REPORTED, severity=NON_DEFAULT, references=STEP_D_REFS,
        test=UPSTREAM_TESTS,
        example=Case(**LAYER, seqlen=3, nheads=2, headdim=2, dstate=2, chunk_size=4, d_model=4, D="channel",
                     layer_steps=1)),
    KnownDefect(
        id="mamba-mamba2-step-ignores-dt-limit",
        implementations=("mamba_ssm.mamba2_no_mem_eff",), package="mamba-ssm", affected=("2.3.2.post1", None),
        applies=_decoded_dt_clamped,
        statement="Mamba2.step ignores dt_limit: the prefill clamps dt to it (mamba_chunk_scan_combined's dt_limit) "
                  "but no decoded token does (its selective_state_update call has no limit), so a model with a "
                  "dt_limit decodes other outputs than its forward() gives for the same tokens",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(**LAYER, seqlen=3, nheads=2, headdim=2, dstate=2, chunk_size=4, d_model=4, dt_limit=(0.0, 0.01),
                     layer_steps=1)),
)

# The chunk-state kernel of mamba_ssm (read in 2.3.2.post1) and of vLLM's copy (0.33.0) scale token t's share of its
# chunk's state by exp(min(dA_cumsum[chunk_size - 1] - dA_cumsum[t], 0)) and read the chunk's total at chunk_size - 1
# in a chunk the sequence ends inside too. Past the end dt is 0, so the cumsum there should equal its value at the
# last token; on an H200 (triton 3.6) _chunk_cumsum_fwd_kernel's tl.cumsum rounds the two differently by 1-2 ulps
# under most configs (BLOCK_SIZE_H >= 4 in the cases measured; the interpreter's cumsum is sequential and exact
# there). Found by an H200 campaign of vLLM's prefill (b=2 L=2686 h=8 p=64 g=8 n=128, 1.95x); reduced on the H200 by
# a directed search (each step kept while both diverged under config index 3: batch 1, one group, no D, z or
# seq_idx, contiguous, scale 1, h 8 -> 4, p 64 -> 4, n 128 -> 8); shorter sequences (126 to 254 tokens) and no
# dt_bias stayed within budget over 7 seeds each. Under config index 0 both are within budget (0.118x).
RAGGED = dict(seqlen=2686, nheads=4, headdim=4, ngroups=1, dstate=8, chunk_size=128, D="none", has_dt_bias=True,
              dt_softplus=False, return_final_states=True, regime=Regime(decay="strong", dt_large=True), seed=5)


def _ends_inside_a_chunk(c: Case) -> bool:
    rows = c.segments if c.segments is not None else ((c.seqlen,),)
    return any(sum(row[:i + 1]) % c.chunk_size for row in rows for i in range(len(row)))


def _ragged_final_state(c: Case) -> bool:
    # the cheap conditions first: the decay sum needs the case's inputs drawn (only large dt or strong decay reach
    # 2^14 within one chunk)
    return (c.entry == "chunk_scan" and (c.return_final_states or c.varlen_states) and _ends_inside_a_chunk(c)
            and (c.regime.dt_large or c.regime.decay == "strong")
            and ragged_end_decay(c) >= RAGGED_DECAY_ULP_MATTERS)


RAGGED_STATEMENT = ("{fn}'s chunk-state kernel reads a chunk's dA cumsum total at chunk_size - 1 even in a chunk the "
                    "sequence ends inside, where the cumsum past the end should equal its value at the last token; "
                    "the cumsum kernel's tl.cumsum rounds the two differently under most autotune configs (1-2 ulps: "
                    "0.008-0.016 at |dA_cumsum| ~ 1e5, dt above 20 with strong decay), so the final state's last "
                    "tokens are scaled by exp(-0.016): 1.6% off in float32, 1.8x the budget")

DEFECTS += (
    KnownDefect(
        id="mamba-ragged-chunk-final-state-decay",
        implementations=("mamba_ssm.chunk_scan_combined",), package="mamba-ssm", affected=("2.3.2.post1", None),
        applies=_ragged_final_state,
        statement=RAGGED_STATEMENT.format(fn="mamba_chunk_scan_combined"),
        status=UNREPORTED, severity=EDGE_CASE, searched="2026-12-07",
        test=UPSTREAM_TESTS, example=Case(**RAGGED), example_devices=("cuda",),
        example_choice=3),
    KnownDefect(
        id="vllm-ragged-chunk-final-state-decay",
        implementations=("vllm.chunk_scan_combined_varlen",), package="vllm", affected=("0.33.0", None),
        applies=_ragged_final_state,
        statement=RAGGED_STATEMENT.format(fn="mamba_chunk_scan_combined_varlen"),
        status=UNREPORTED, severity=EDGE_CASE, searched="2026-12-07",
        test=UPSTREAM_TESTS, example=Case(**RAGGED), example_devices=("cuda",),
        example_choice=3),
)

# vLLM's varlen prefill and an empty request (read in vllm 0.33.0): the model runner's chunk metadata gives a request
# without new tokens no chunk of its own, so its last_chunk_indices entry names its predecessor's last chunk (-1 at
# the front of the pack), and the final state the call returns for it is that chunk's end state.
DEFECTS += (
    KnownDefect(
        id="vllm-varlen-empty-sequence-state",
        implementations=("vllm.chunk_scan_combined_varlen", "vllm.chunked_prefill"), package="vllm",
        affected=("0.33.0", None),
        applies=lambda c: c.varlen_states and any(n == 0 for n in c.segments[0]),
        statement="mamba_chunk_scan_combined_varlen returns, for a sequence with no tokens in the pack (a repeated "
                  "cu_seqlens offset), the end state of the chunk its last_chunk_indices entry names: the previous "
                  "sequence's final state (or the last chunk's, at the front of the pack) instead of the state it "
                  "starts from (with the chunk metadata vLLM's builder makes for it; whether its model runner packs a "
                  "request without new tokens was not checked)",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS, example=Case(seqlen=10, segments=((4, 0, 6),), varlen_states=True)),
)

# fla's Mamba2 decoding (read in flash-linear-attention 0.6.0): cuda_kernels_forward's single-token path calls
# mamba_ssm's selective_state_update with dt_softplus but no dt_limit, while its prefill passes dt_limit to
# mamba_chunk_scan_combined (its torch path clamps both).
DEFECTS += (
    KnownDefect(
        id="fla-mamba2-step-ignores-dt-limit",
        implementations=("fla.mamba2_triton",), package="flash-linear-attention", affected=("0.6.0", None),
        applies=_decoded_dt_clamped,
        statement="fla's Mamba2 decoding on its kernel path (cuda_kernels_forward with a cache) ignores dt_limit: "
                  "the prefill clamps dt to it (mamba_chunk_scan_combined's dt_limit) but no decoded token does "
                  "(its selective_state_update call has no limit; torch_forward clamps both), so a model with a "
                  "dt_limit decodes other outputs than its prefill gives for the same tokens",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(**LAYER, seqlen=3, nheads=2, headdim=2, dstate=2, chunk_size=4, d_model=4, dt_limit=(0.0, 0.01),
                     layer_steps=1)),
)

# fla 0.6.0's torch_forward without rmsnorm: `scan_output = y * self.act(gate)`, y the float32 scan output, gate
# (and self.act(gate)) in the activations' dtype. Found by an H200 campaign (fla.mamba2_torch, float16 backward,
# dt > 20 with no decay, input scale 4: the gradient of u Inf at 64 of 271 elements, expected up to 34014),
# reproduced and minimized on the CPU; with rmsnorm (the norm kernel takes the gate in registers) or in bfloat16
# (float32's range) the same inputs are within budget. The example is one where the pre-gate output stays inside
# float16's range at the failing token (44,846 at token 8, where fla's gradient of u is NaN): where it does not,
# every float16 implementation that saves it overflows and the model does too (harness/budget/, `Rounding.gate`).
DEFECTS += (
    KnownDefect(
        id="fla-mamba2-torch-gate-gradient-overflow",
        implementations=("fla.mamba2_torch",), package="flash-linear-attention", affected=("0.6.0", None),
        applies=lambda c: c.entry == "layer" and c.dtype == "float16" and c.backward and not c.rmsnorm,
        statement="fla's Mamba2.torch_forward without rmsnorm gates the float32 scan output with the float16 "
                  "silu(gate) (`y * self.act(gate)`): autograd hands that product's gradient to silu(gate) in "
                  "float16, where it overflows to Inf past 65504 although the gate's own gradient (after silu') "
                  "and the layer input's are finite (the kernels form dz in float32): in_proj's and the input's "
                  "gradients come back Inf or NaN",
        status=UNREPORTED, severity=EDGE_CASE, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(**dict(LAYER, norm_before_gate=True), seqlen=13, nheads=1, headdim=12, dstate=46, chunk_size=1,
                     d_model=3, dtype="float16", D="head", has_dt_bias=True, dt_softplus=True, conv_width=1,
                     conv_bias=False, regime=Regime(decay="none", dt_large=True, scale=4.0), pass_="backward",
                     seed=11)),
)

# fla's fused recurrent backward (read in 0.6.0, fla/ops/common/fused_recurrent.py): the gate's gradient is a running
# sum over a sequence's tokens from its end of q.dq - k.dk, started at the final state's h.dh, in float32.
# Measured on the CPU over 134 of its float32 divergences in grad A, dt and dt_bias, in 350 drawn backward cases
# (strong, mild and typical decay, dt > 20, one token): each within its budget plus 4 * k * u * M (M below) for k
# at most 5.4.
RUNNING_SUM_ROUNDINGS = 8.0


def running_gate_sum_error(case: Case, inputs) -> dict:
    """The error a float32 reverse running sum of q.dq - k.dk (from h_T.dh_T) can carry into the gradients of A,
    dt and dt_bias, per element: RUNNING_SUM_ROUNDINGS * u * M, with u float32's unit roundoff and M a token's
    magnitude of the sum from it to its sequence's end, sum |q| |dq| + |k| |dk| (+ |h_T| |dh_T|), from the float64
    oracle with the groups' B and C taken per head (fla's q and k); carried into dt' A as the gradient is."""
    from ssdiff import truth
    from ssdiff.truth.chunked import process_dt

    t = inputs.float64(requires_grad=True)
    per_head = case.nheads // case.ngroups
    q_k = {n: t[n].detach().repeat_interleave(per_head, 2).requires_grad_(True) for n in ("B", "C")}
    wide = case.replace(ngroups=case.nheads)
    res = truth.call("ref.chunked", wide, {**t, **q_k}, inputs.seq_idx)
    roots, cotangents = [res.outputs["y"]], [inputs.grad_outputs["y"]]
    if case.final_state_grad:
        roots.append(res.outputs["final_states"])
        cotangents.append(inputs.grad_outputs["final_states"])
    grads = torch.autograd.grad(roots, [q_k["B"], q_k["C"]], cotangents)
    terms = sum((q_k[n].detach().abs() * g.abs()).sum(-1) for n, g in zip(("B", "C"), grads))     # (b, L, h)
    b, L, h = terms.shape
    # the sum from each token to the end of its sequence: a row's runs of one seq_idx value (padding one of them)
    sid = inputs.seq_idx.long() if inputs.seq_idx is not None else torch.zeros(b, L, dtype=torch.long,
                                                                                device=terms.device)
    place = torch.arange(L, device=terms.device).expand(b, L)
    ends = torch.cat([sid[:, 1:] != sid[:, :-1], torch.ones_like(sid[:, :1], dtype=torch.bool)], 1)
    run_end = torch.where(ends, place, L).flip(1).cummin(1).values.flip(1)                    # (b, L)
    from_end = torch.cat([terms.flip(1).cumsum(1).flip(1), terms.new_zeros(b, 1, h)], 1)
    M = from_end[:, :L] - from_end.gather(1, (run_end + 1)[..., None].expand(b, L, h))
    if case.final_state_grad:
        last = (run_end == L - 1)[..., None]
        state = (res.outputs["final_states"].detach().abs() * inputs.grad_outputs["final_states"].abs()).sum((-1, -2))
        M = M + torch.where(last, state[:, None, :], M.new_zeros(()))
    dt = t["dt"].detach().requires_grad_(True)
    bias = t["dt_bias"].detach() if "dt_bias" in t else None
    dt_prime = process_dt(dt, bias, case.dt_softplus, case.dt_limit_or_default)
    slope = torch.autograd.grad(dt_prime.sum(), dt)[0]
    scale = RUNNING_SUM_ROUNDINGS * 2.0 ** -24
    per_token = scale * t["A"].detach().abs() * M * slope                                    # (b, L, h)
    error = {"grad.A": scale * (dt_prime.detach() * M).sum((0, 1)), "grad.dt": per_token}
    if bias is not None:
        error["grad.dt_bias"] = per_token.sum((0, 1))
    return error


DEFECTS += (
    KnownDefect(
        id="fla-fused-recurrent-gate-gradient-cancellation",
        implementations=("fla.fused_recurrent_simple_gla",), package="flash-linear-attention",
        affected=("0.6.0", None),
        applies=lambda c: c.backward,
        error=running_gate_sum_error,
        statement="fused_recurrent_simple_gla's backward takes the gate's gradient from a running sum of "
                  "q.dq - k.dk, a difference of terms the size of the outputs' gradients: where the true gradient "
                  "is far smaller (strong decay, dt > 20, or zero: one token without an initial state; at any "
                  "decay now and then) the gradients of the gate, so of A and dt, carry float32 rounding noise of "
                  "those terms (grad A -3.76e-3 for -1.40e-6 under strong decay)",
        status=DESIGNED, severity=BY_DESIGN, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(seqlen=14, nheads=6, headdim=8, ngroups=6, dstate=6, chunk_size=4, D="head", has_z=True,
                     has_dt_bias=False, dt_limit=(0.0, 1.0), initial_states=True, return_final_states=True,
                     final_state_grad=True, regime=Regime(decay="strong", scale=4.0), pass_="backward", seed=152)),
)

# transformers' Mamba2Mixer decoding (read in 5.20.2 and 5.17.0; measured with 5.20.2): the single-token path
# calls mamba2_selective_state_update with dt_softplus but no dt_limit, while the chunked path passes
# dt_limit=self.time_step_limit.
DEFECTS += (
    KnownDefect(
        id="transformers-mamba2-decode-ignores-dt-limit",
        implementations=("transformers.mamba2_mixer",), package="transformers", affected=("5.17.0", None),
        applies=_decoded_dt_clamped,
        statement="transformers' Mamba2Mixer decoding with a cache ignores time_step_limit: the prefill's chunked "
                  "scan clamps dt to it but the single-token path (selective_state_update, with dt_softplus and no "
                  "dt_limit) does not, so generate() decodes other outputs than forward() gives for the same tokens",
        status=UNREPORTED, severity=NON_DEFAULT, searched="2026-12-07",
        test=UPSTREAM_TESTS,
        example=Case(**LAYER, seqlen=3, nheads=2, headdim=2, dstate=2, chunk_size=4, d_model=4, rmsnorm=True,
                     dt_limit=(0.0, 0.01), layer_steps=1)),
)

BY_ID = {d.id: d for d in DEFECTS}


def record_problems(defect: KnownDefect) -> list:
    """What ``defect`` lacks of what every record carries, one line each ([] when nothing): a severity of the
    fixed scale, a status of the fixed scale (a fixed one naming the record's first fixed release, and only then),
    and upstream references (each an issue or PR with a number and a title) or the date of a search that found
    none."""
    import re

    out = []
    if defect.severity not in SEVERITIES:
        out.append(f"severity {defect.severity!r} is not one of {SEVERITIES}")
    fixed = defect.affected[1]
    want = f"{FIXED} {fixed}" if fixed else None
    if fixed and defect.status != want:
        out.append(f"status {defect.status!r}: a record with a fixed release says {want!r}")
    if not fixed and defect.status not in (UNREPORTED, REPORTED, DESIGNED):
        out.append(f"status {defect.status!r} is not one of {(UNREPORTED, REPORTED, DESIGNED)}")
    if defect.status == REPORTED and not defect.references:
        out.append("reported upstream, yet no reference names where")
    if not defect.references and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", defect.searched):
        out.append("no upstream reference and no date of a search that found none")
    for ref in defect.references:
        if not (isinstance(ref, Reference) and ref.kind in ("issue", "PR") and ref.number > 0 and ref.title
                and re.fullmatch(r"[\w.-]+/[\w.-]+", ref.repo)):
            out.append(f"reference {ref!r} is not an issue or PR of an owner/name repository with a number and title")
    return out


def whole_pass(impl: str, backward: bool, dtype: str) -> Optional[KnownDefect]:
    """A defect of ``impl``'s installed release that explains every case of this pass and dtype, or None."""
    return next((d for d in affecting(impl) if d.whole_pass(backward, dtype)), None)


def installed_version(package: str) -> Optional[str]:
    """The release of ``package`` the harness runs (None when it is not usable here)."""
    from ssdiff.sides import upstream

    if package == "mamba-ssm":
        return upstream.mamba_ssm().version if upstream.mamba_ssm_problem() is None else None
    if package == "fla-core":
        return upstream.fla().version if upstream.fla_problem() is None else None
    if package == "vllm":                 # its SSD ops as ssdiff.sides.upstream_vllm loads them (a wheel, or files)
        from ssdiff.sides import upstream_vllm
        return upstream_vllm.vllm().version if upstream_vllm.vllm_problem() is None else None
    from importlib import metadata
    try:                                  # the layers' packages: their installed distribution
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def affecting(impl: str) -> list:
    """The defects of implementation ``impl`` in the installed release."""
    return [d for d in DEFECTS if impl in d.implementations and d.affects(installed_version(d.package))]


def matching(impl: str, case: Case) -> Optional[KnownDefect]:
    """The known defect of ``impl``'s installed release whose predicate ``case`` satisfies, or None."""
    return next((d for d in affecting(impl) if d.applies(case)), None)


def explanation(side: str, outcome, factor: Optional[float] = None) -> Optional[KnownDefect]:
    """The one rule for "a known defect explains this divergence": the defect of ``side``'s installed release whose
    predicate ``outcome``'s case satisfies (`matching`) and that accounts for ``side``'s divergence (`explains`), or
    None — no divergence, no record for the case, or a divergence beyond what the record accounts for (a finding
    of its own)."""
    verdict = outcome.verdicts[side]
    defect = None if verdict.ok else matching(side, outcome.case)
    return defect if defect is not None and explains(defect, side, outcome, factor) else None


def known_lines(outcome, factor: Optional[float] = None) -> list:
    """What the registry says of each diverging side of ``outcome`` (ssdiff.examine.Outcome), one line each: the
    defect of the installed release that explains the divergence, or the one whose domain the case lies in while
    the divergence is more than it accounts for (a new finding, as `ssdiff fuzz` would report it)."""
    lines = []
    for side, verdict in outcome.verdicts.items():
        defect = None if verdict.ok else matching(side, outcome.case)
        if defect is None:
            continue
        if explains(defect, side, outcome, factor):
            lines.append(f"{side}: known defect {defect.id} ({defect.releases}; {defect.status}): {defect.statement}")
        else:
            lines.append(f"{side}: the case lies in known defect {defect.id}'s domain, but the divergence is more "
                         f"than it accounts for: a new finding")
    return lines


def explains(defect: KnownDefect, side: str, outcome, factor: Optional[float] = None) -> bool:
    """Whether ``defect`` (one `matching` names for ``side`` and the outcome's case) accounts for the divergence of
    ``side``'s verdict in ``outcome`` (ssdiff.examine.Outcome): any divergence, or where it bounds its error
    (`KnownDefect.bounds`) only one whose every tensor out of budget is one the defect corrupts and within its
    budget plus that error (both ``factor`` times; default the verdict's)."""
    from ssdiff.examine import failing_tensors
    from ssdiff.verdict.judge import FACTOR, judge_named

    verdict = outcome.verdicts[side]
    if verdict.ok or not defect.bounds(outcome.case):
        return not verdict.ok
    if verdict.status != "diverged" or side not in outcome.outputs:
        return False        # a run failure, a non-finite or a mismatched tensor is more than a bounded rounding error
    failing = failing_tensors(verdict)
    error = defect.error(outcome.case, outcome.inputs)
    if not failing <= error.keys():
        return False
    return all(judge_named(name, outcome.case, outcome.inputs, outcome.outputs[side], outcome.truth,
                           outcome.baseline, factor or FACTOR, allowance=error[name]).ok for name in failing)


__all__ = ["KnownDefect", "Reference", "record_problems", "SEVERITIES", "STATUSES", "DEFECTS", "BY_ID",
           "KNOWN_POLICIES", "affecting", "matching", "explains", "explanation", "known_lines", "whole_pass",
           "installed_version", "running_gate_sum_error", "decay_sum_error", "row_decay", "ragged_end_decay",
           "EXP_OVERFLOW_F32"]
