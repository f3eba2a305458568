"""ssdiff's own Triton SSD kernels (kernels/ssd) against the float64 oracle.

- every forward stage function run ON ITS OWN, fed the oracle's previous stages, against the oracle's stage;
- (the whole forward, with its stages, and forward+backward, every input's gradient with and without a final-state
  gradient, of ``ssdiff.triton`` over generated cases spanning every feature, both entry points, several tiles
  inside a chunk, every autotune configuration: the generic property, test_implementations.py, through its testing
  record in harness/sides/adapters/ssdiff_triton.py)
- a rising decay, dt on a bound of its limit, and nothing read past the last token;
- backward determinism (bitwise identical gradients on a rerun, under every autotune configuration);
- the int64 in-chunk address path, forced, is bitwise the int32 one;
- teeth: a corrupted result is caught.

Every example of the stage property runs under one autotune configuration index, drawn (``runtime.autotune(index)``:
config ``index % n`` of each kernel), so the configurations of every kernel are swept over the examples.

Judging: ssdiff.verdict.judge (the error budget is a multiple of what a same-precision model kernel,
harness/budget/, naturally gets wrong on the same case — the largest error over its rounding samples —
plus a rounding floor; ratio <= 1 passes). No
per-test tolerance is tuned here. fp32 in the interpreter is exact-dot, so its budgets are tight; on a GPU the
baseline models TF32 for fp32.

Cost: the example counts are sized for CI on 2 CPU cores under the Triton interpreter; the gpu/nightly profiles
(``--hypothesis-profile`` or SSDIFF_PROFILE) multiply them by 5 / 20.
"""

from __future__ import annotations

import dataclasses

import pytest

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ssdiff.budget.samples import evaluate_samples
from ssdiff import truth
from ssdiff import runtime
from ssdiff.model.case import Case, Regime
from ssdiff.sides.registry import get
from ssdiff.sides.adapters.ssdiff_triton import chunk_major_to_tokens
from ssdiff.inputs import materialize
from ssdiff.model.bounds import Bounds
from ssdiff.verdict.judge import judge, judge_tensor
from ssdiff.testing import cases_here, dt_on_its_bounds, runnable_by

runtime.configure()

from ssdiff.kernels.ssd import configs  # noqa: E402
from ssdiff.kernels.ssd.bmm import ssd_bmm_fwd  # noqa: E402
from ssdiff.kernels.ssd.chunk_scan import ssd_chunk_scan_fwd  # noqa: E402
from ssdiff.kernels.ssd.chunk_state import ssd_chunk_state_fwd, ssd_varlen_states_fwd  # noqa: E402
from ssdiff.kernels.ssd.cumsum import ssd_cumsum_fwd  # noqa: E402
from ssdiff.kernels.ssd.state_passing import ssd_state_passing_fwd  # noqa: E402

IMPL = "ssdiff.triton"
_SCALE = {"gpu": 5, "nightly": 20}.get(settings._current_profile, 1)      # the profile conftest.py loaded
DTYPES = tuple(d for d in ("float32", "float16", "bfloat16") if d in runtime.runnable_dtypes())
SMALL = Bounds(max_batch=2, max_seqlen=24, max_nheads=4, max_headdim=6, max_dstate=6, chunk_sizes=(4, 8, 16))
CONFIG_INDEX = st.integers(0, configs.max_configs() - 1)


def kernel_cases(entry: str, bounds: Bounds, backward=None):
    """Cases of ``entry`` within ``bounds`` that the kernels run here (natively under the gpu and nightly
    profiles, from the run's compile keys: ssdiff.testing `cases_here`)."""
    return cases_here(IMPL, (entry,), DTYPES, backward, bounds, fit=runnable_by(get(IMPL)))


def _settings(n):
    return settings(max_examples=n * _SCALE, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def _assert_ok(verdict):
    assert verdict.ok, verdict.message()


# ---- each stage alone -----------------------------------------------------------------------------------

def _chunk_major(t_tokens: torch.Tensor, Q: int, fill_last: bool) -> torch.Tensor:
    """(b, L, h) -> (b, h, c, Q) float32, positions past L filled with 0 (dt) or the last value (cumsum)."""
    b, L, h = t_tokens.shape
    c = -(-L // Q)
    pad = c * Q - L
    if pad:
        tail = t_tokens[:, -1:].expand(b, pad, h) if fill_last else t_tokens.new_zeros(b, pad, h)
        t_tokens = torch.cat([t_tokens, tail], dim=1)
    return t_tokens.reshape(b, c, Q, h).permute(0, 3, 1, 2).contiguous().float()


@_settings(12)
@given(case=kernel_cases("chunk_scan", SMALL, backward=False), index=CONFIG_INDEX)
@example(case=Case(batch=1, seqlen=40, nheads=4, ngroups=2, headdim=20, dstate=18, chunk_size=16, D="channel",
                   has_z=True, initial_states=True, segments=((5, 16, 17),), padding=(2,), varlen_states=True,
                   regime=Regime(decay="mild", layout="strided")), index=1)
@example(case=Case(batch=2, seqlen=18, nheads=4, headdim=6, ngroups=2, dstate=1, chunk_size=4,
                   return_final_states=False, regime=Regime(decay="strong", values="integer"), seed=1850), index=0)
def test_each_stage_alone_matches_the_oracle_stage(case, index, device):
    """Each stage kernel, fed upstream stages that do not come from the kernels, matches the oracle stage.

    The upstream stages fed are the same-precision baseline's (harness/budget/: float32 values, what a
    correct kernel hands on): a stage then starts from exactly the inputs the baseline's own stage started
    from, so the budget (a multiple of the baseline's error) measures this stage alone. (Fed the float64
    oracle's stages rounded to float32 instead, a stage would inherit a rounding of dA_cumsum the budget does
    not model: under strong decay exp(cs_i - cs_j) carries eps * |cs| of relative error.)"""
    inputs = materialize(case, device)
    exact = truth.evaluate(case, inputs)
    bases = evaluate_samples(case, inputs, exact, truth.evaluate)
    t = inputs.native()
    st_ = exact.stages
    up = bases[0].stages                               # what is fed in: the round-to-nearest sample
    Q, L = case.chunk_size, case.seqlen
    seq_idx = inputs.seq_idx
    results = []

    def check(name, actual, kind="stage", key=None):
        key = key or name
        pool_t = exact.outputs if kind == "output" else st_
        samples = [(b.outputs if kind == "output" else b.stages)[key] for b in bases]
        results.append(judge_tensor(f"{kind}.{name}" if kind == "stage" else name, kind, actual, pool_t[key],
                                    samples, case, inputs))

    with runtime.autotune(index):
        dt_out, dA_cs = ssd_cumsum_fwd(t["dt"], t["A"], Q, dt_bias=t.get("dt_bias"),
                                       dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default)
        check("dt", chunk_major_to_tokens(dt_out, L))
        check("dA_cumsum", chunk_major_to_tokens(dA_cs, L))
        check("CB", ssd_bmm_fwd(t["C"], t["B"], Q))
        o_dt = _chunk_major(up["dt"], Q, fill_last=False)
        o_cs = _chunk_major(up["dA_cumsum"], Q, fill_last=True)
        check("chunk_states", ssd_chunk_state_fwd(t["x"], t["B"], o_dt, o_cs, seq_idx=seq_idx))
        passed, final = ssd_state_passing_fwd(up["chunk_states"].float().contiguous(), o_cs, seq_idx=seq_idx,
                                              initial_states=t.get("initial_states"))
        check("passed_states", passed)
        if case.return_final_states:
            check("final_states", final, kind="output")
        o_passed = up["passed_states"].float().contiguous()
        out, scan, pregate = ssd_chunk_scan_fwd(
            t["x"], t["C"], up["CB"].float().contiguous(), o_dt, o_cs, o_passed, seq_idx=seq_idx, D=t.get("D"),
            z=t.get("z"), return_scan=True, return_pregate=True, pregate_dtype=torch.float32)
        check("scan", scan)
        if "skip" in st_:
            check("skip", pregate)
        if "gated" in st_:
            check("gated", out)
        check("y", out, kind="output")
        if case.varlen_states:
            check("varlen_states", ssd_varlen_states_fwd(t["x"], t["B"], o_dt, o_cs, o_passed, seq_idx,
                                                         inputs.cu_seqlens), kind="output")
    bad = [r.message(IMPL) for r in results if not r.ok]
    assert not bad, "\n".join(bad)


# ---- what generated cases do not reach ----------------------------------------------------------------

@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_a_rising_decay_is_computed_exactly(pass_, device):
    """A > 0 on one head: the state grows inside the chunk, exp(cs_i - cs_j) > 1. Generated cases always decay
    (A < 0), so this is where a kernel that assumes decay (clamps the exponent at 0 as mamba_ssm's does, or
    takes exp(cs_i - cs_j) apart into factors it expects to be <= 1) is caught, with several tiles per chunk."""
    case = Case(batch=1, seqlen=64, nheads=2, ngroups=1, headdim=3, dstate=4, chunk_size=64, D="none",
                regime=Regime(decay="mild"), pass_=pass_)
    inputs = materialize(case, device)
    values = dict(inputs.values)
    A = values["A"].clone()
    A[0] = A[0].abs() * 0.2                          # cs rises by at most ~15 over the chunk: no overflow
    values["A"] = A
    inputs = dataclasses.replace(inputs, values=values)
    impl = get(IMPL)
    exact = truth.evaluate(case, inputs)
    base = evaluate_samples(case, inputs, exact, truth.evaluate)
    assert exact.stages["dA_cumsum"][0, -1, 0] > exact.stages["dA_cumsum"][0, 0, 0]      # it does rise
    with runtime.autotune(1):                        # small tiles: several per chunk
        out = impl.run(case, inputs)
    _assert_ok(judge(IMPL, case, inputs, out, exact, base))


def test_dt_on_a_bound_of_its_limit_passes_its_gradient(device):
    """dt exactly on a bound of dt_limit: the clamp passes the gradient there, as torch.clamp (the oracle's) and
    mamba_ssm's chunk-cumsum backward do (zero only strictly outside). Drawn float32 values never land on a bound;
    bfloat16 ones often do (1.0 is a bf16 value, and its neighbours are 2**-8 apart)."""
    case = Case(batch=1, seqlen=24, nheads=2, ngroups=1, headdim=3, dstate=4, chunk_size=8, D="none",
                has_dt_bias=False, dt_softplus=False, dt_limit=(0.25, 1.0), regime=Regime(decay="mild"),
                pass_="backward")
    inputs, on_bound = dt_on_its_bounds(case, device)
    exact = truth.evaluate(case, inputs)
    assert exact.grads["dt"][on_bound].abs().min() > 0      # the oracle's gradient passes the bound
    base = evaluate_samples(case, inputs, exact, truth.evaluate)
    _assert_ok(judge(IMPL, case, inputs, get(IMPL).run(case, inputs), exact, base))


@pytest.mark.parametrize("entry", ["chunk_scan", "split_conv1d"])
def test_nothing_reads_the_dA_cumsum_past_the_last_token(entry, device, monkeypatch):
    """In a chunk the sequence ends inside, the dA cumsum past the last token adds only the fill's zeros; a
    kernel that reads the chunk's total there (at Q - 1, as mamba_ssm's chunk-state kernel does: its defect
    mamba-ragged-chunk-final-state-decay) meets tl.cumsum's different rounding of that position on a GPU. With
    the cumsum past every sequence's end shifted by 0.5, the outputs and gradients are bitwise the same."""
    import ssdiff.kernels.ssd.combined as combined

    case = Case(entry=entry, batch=2, seqlen=21, nheads=4, ngroups=2, headdim=5, dstate=6, chunk_size=16, D="head",
                initial_states=True, return_final_states=True, regime=Regime(decay="strong"), pass_="backward",
                final_state_grad=True, **({"conv_width": 2} if entry == "split_conv1d" else {}))
    impl = get(IMPL)
    inputs = materialize(case, device)
    plain = impl.run(case, inputs)
    cumsum = combined.ssd_cumsum_fwd

    def shifted_past_the_end(dt, *args, **kwargs):
        dt_out, dA_cs = cumsum(dt, *args, **kwargs)
        past = torch.arange(dA_cs.shape[2] * dA_cs.shape[3], device=dA_cs.device) >= dt.shape[1]
        return dt_out, dA_cs + 0.5 * past.reshape(dA_cs.shape[2:])

    monkeypatch.setattr(combined, "ssd_cumsum_fwd", shifted_past_the_end)
    shifted = impl.run(case, inputs)
    for name in plain.outputs:
        assert torch.equal(plain.outputs[name], shifted.outputs[name]), name
    for name in plain.grads:
        assert torch.equal(plain.grads[name], shifted.grads[name]), f"grad.{name}"


# ---- determinism ----------------------------------------------------------------------------------------

def test_backward_is_deterministic(device):
    """Two runs give bitwise identical gradients, under every configuration index (no atomics anywhere)."""
    case = Case(batch=2, seqlen=21, nheads=4, ngroups=2, headdim=5, dstate=6, chunk_size=16, D="channel",
                has_z=True, initial_states=True, segments=((7, 10, 2), (21,)), padding=(2, 0),
                pass_="backward", final_state_grad=True)
    impl = get(IMPL)
    inputs = materialize(case, device)

    def grads(index):
        with runtime.autotune(index):
            return impl.run(case, inputs).grads

    for index in range(configs.max_configs()):
        first, second = grads(index), grads(index)
        for name in first:
            assert torch.equal(first[name], second[name]), f"grad.{name} differs between two runs (config {index})"


def test_wide_in_chunk_offsets_give_the_same_result(device, monkeypatch):
    """The chunk-state and chunk-scan loops address tokens inside a chunk with int32 offsets from the chunk's
    first token; only when a chunk's span of a token stride could pass int32 (``idx64``: 2 * chunk_size *
    stride >= 2**31, a tensor too big to build here) do they widen them to int64. That path, forced, gives bitwise
    the same outputs and gradients as the int32 one."""
    import ssdiff.kernels.ssd.chunk_scan as chunk_scan
    import ssdiff.kernels.ssd.chunk_state as chunk_state
    from ssdiff.kernels.ssd.common import idx64
    assert not idx64(256, 2 ** 22 - 1) and idx64(256, 2 ** 22) and idx64(256, 1, -(2 ** 22))
    case = Case(batch=2, seqlen=21, nheads=4, ngroups=2, headdim=5, dstate=6, chunk_size=16, D="channel",
                has_z=True, initial_states=True, segments=((7, 10, 2), (21,)), padding=(2, 0),
                pass_="backward", final_state_grad=True)
    impl = get(IMPL)
    inputs = materialize(case, device)
    narrow = impl.run(case, inputs)
    widened = []
    for module in (chunk_scan, chunk_state):
        monkeypatch.setattr(module, "idx64", lambda *a: widened.append(a) or True)
    wide = impl.run(case, inputs)
    assert widened, "no kernel asked whether to widen its offsets"
    for name in narrow.outputs:
        assert torch.equal(narrow.outputs[name], wide.outputs[name]), name
    for name in narrow.grads:
        assert torch.equal(narrow.grads[name], wide.grads[name]), f"grad.{name}"


# ---- teeth -----------------------------------------------------------------------------------------------

def test_a_wrong_group_is_caught(device):
    """The judge that passes the kernels fails them when one head reads another group's B (a classic bug)."""
    case = Case(batch=1, seqlen=12, nheads=4, ngroups=2, headdim=3, dstate=4, chunk_size=4)
    inputs = materialize(case, device)
    exact = truth.evaluate(case, inputs)
    base = evaluate_samples(case, inputs, exact, truth.evaluate)
    impl = get(IMPL)
    _assert_ok(judge(IMPL, case, inputs, impl.run(case, inputs), exact, base))
    wrong = inputs.native()
    B = wrong["B"].clone()
    B[:, :, 1] = B[:, :, 0]                      # heads of group 1 read group 0's B
    from ssdiff.kernels.ssd.combined import ssd_chunk_scan_combined
    y, final = ssd_chunk_scan_combined(wrong["x"], wrong["dt"], wrong["A"], B, wrong["C"], case.chunk_size,
                                       D=wrong.get("D"), dt_bias=wrong.get("dt_bias"), dt_softplus=True,
                                       return_final_states=True)
    from ssdiff.model.evaluation import Evaluation
    assert not judge(IMPL, case, inputs, Evaluation({"y": y, "final_states": final}), exact, base).ok
