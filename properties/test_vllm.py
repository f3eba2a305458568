"""vLLM's serving fork of the SSD kernels (installed from its wheel) against the float64 oracle, and the properties
that matter for serving.

What this file checks:
- the chunk-metadata builder (harness/sides/chunk_metadata.py) agrees with vLLM's own on random batches (computed
  tokens and empty requests included) and refuses bad input with one line naming it;
- vllm.chunk_scan_combined_varlen, vllm.chunked_prefill and vllm.selective_state_update agree with the oracle on
  generated cases within their capabilities, under a drawn autotune config (the generic property,
  test_implementations.py, through their testing record: harness/sides/adapters/vllm.py), and on every feature at once;
- chunked prefill with carried states equals one prefill (judged against the oracle of the whole case);
- the intermediate (prefix-cache) states equal the oracle's state at each logical chunk end;
- a sequence's outputs do not depend on its neighbours in the pack, an empty neighbour included (bitwise, under
  one autotune config: harness/sides/adapters/serving.py says why that is the right strength);
- the result does not depend on the autotune config: every config of every kernel is within budget;
- the final states written into slots of a state cache (final_states_out, final_state_indices) are the
  returned ones and touch no other slot; a decode row at the null block is skipped and touches nothing;
- each serving property has teeth: a planted violation (a state not carried, intermediate states off by one
  chunk, an output that reads its neighbours, a config that corrupts an element) fails it;
- how vLLM was loaded (`ssdiff list`, the stand-ins), and the extraction script for offline GPU runners.

Divergence has one definition: harness/verdict/judge.py's `judge` (through ssdiff.examine.Examiner where a Case
describes the call). No tolerance lives here.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

from ssdiff import runtime

runtime.configure()                     # before any kernel module is imported

from ssdiff.sides import upstream_vllm  # noqa: E402
from ssdiff.sides.adapters import serving
from ssdiff.model.case import Case, Regime  # noqa: E402
from ssdiff.sides.chunk_metadata import ChunkMetadataError, chunk_metadata  # noqa: E402
from ssdiff.examine import Examiner  # noqa: E402
from ssdiff.investigate.serving import prefix_state_verdicts  # noqa: E402
from ssdiff.sides.registry import get, register  # noqa: E402
from ssdiff.sides.adapters.vllm import ChunkScanCombinedVarlen, pack, run_varlen  # noqa: E402
from ssdiff.inputs import materialize  # noqa: E402
from ssdiff.model.bounds import Bounds  # noqa: E402
from ssdiff.testing import (CONFIGS, SETTINGS, agrees_with_oracle, cases_for, examples, replay,  # noqa: E402
                            usable)

REPO = Path(__file__).resolve().parents[1]
PREFILL = "vllm.chunk_scan_combined_varlen"
CHUNKED = "vllm.chunked_prefill"
STEP = "vllm.selective_state_update"
DTYPES = tuple(runtime.runnable_dtypes())


def release():
    why = upstream_vllm.vllm_problem()
    if why:
        pytest.skip(f"vllm unavailable: {why}")
    return upstream_vllm.vllm()


# ---- the chunk metadata ----------------------------------------------------------------------------------

@st.composite
def batches(draw):
    chunk_size = 2 ** draw(st.integers(0, 5))
    n = draw(st.integers(0, 6))
    lengths = draw(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 3 * chunk_size + 2)), min_size=n,
                            max_size=n))
    computed = draw(st.lists(st.one_of(st.sampled_from([0, chunk_size, chunk_size - 1, chunk_size + 1]),
                                       st.integers(0, 4 * chunk_size)), min_size=n, max_size=n))
    return lengths, computed, chunk_size


@settings(max_examples=300, deadline=None)
@given(batches())
def test_chunk_metadata_agrees_with_vllms_own_builder(batch):
    lengths, computed, chunk_size = batch
    theirs, how = upstream_vllm.vllm_chunk_metadata_function() if upstream_vllm.vllm_problem() is None else \
        pytest.skip(f"vllm unavailable: {upstream_vllm.vllm_problem()}")
    note(f"vLLM's builder {how}")
    starts = torch.tensor([0, *itertools.accumulate(lengths)])
    cu_chunks, seq_idx, last, _ = theirs(chunk_size, len(lengths), torch.tensor(computed, dtype=torch.long), starts)
    ours = chunk_metadata(lengths, chunk_size, computed)
    assert (list(ours.cu_chunk_seqlens), list(ours.seq_idx), list(ours.last_chunk_indices)) == \
        (list(cu_chunks), list(seq_idx), list(last))
    assert list(ours.cu_seqlens) == starts.tolist()


def test_chunk_metadata_chunks_cross_neither_a_sequence_end_nor_a_chunk_boundary():
    m = chunk_metadata([5, 12, 4], 8, computed=[0, 3, 16])
    # request 1 has 3 tokens computed: 5 finish its first chunk, the other 7 fit in the next
    assert m.cu_chunk_seqlens == (0, 5, 10, 17, 21) and m.seq_idx == (0, 1, 1, 2)
    assert m.last_chunk_indices == (0, 2, 3)


@pytest.mark.parametrize("args, words", [
    (([3, -1], 4), r"lengths\[1\]=-1 must be a non-negative integer"),
    (([3], 0), "chunk_size=0 must be a positive integer"),
    (([3, 2], 4, [0]), "computed has 1 entries for 2 requests"),
    (([3], 4, [-2]), r"computed\[0\]=-2 must be a non-negative integer"),
])
def test_chunk_metadata_refuses_bad_input_with_one_line(args, words):
    with pytest.raises(ChunkMetadataError, match=words):
        chunk_metadata(*args)


# ---- against the oracle ----------------------------------------------------------------------------------

# Every feature the prefill can express at once: three sequences in two rows, a boundary on a chunk boundary,
# initial states, per-channel D, z, dt_limit, strided inputs (the pack is a view of them), a ragged last chunk.
EVERYTHING = Case(batch=2, seqlen=20, nheads=4, ngroups=2, headdim=5, dstate=6, chunk_size=8, D="channel",
                  has_z=True, dt_limit=(0.01, 2.0), initial_states=True, segments=((8, 12), (3, 9, 8)),
                  regime=Regime(decay="mild", layout="strided"), seed=11)


def test_every_feature_at_once_matches_oracle(device):
    usable(PREFILL, "float32", False, device)
    with Examiner([PREFILL, CHUNKED], device) as examiner:
        agrees_with_oracle(examiner, EVERYTHING)
        agrees_with_oracle(examiner, EVERYTHING.replace(batch=1, segments=((5, 9, 6),), varlen_states=True))


def test_backward_and_padding_are_declared_not_expressible(device):
    release()
    impl = get(PREFILL)
    assert not impl.capabilities.backward and "padding" in impl.capabilities.unsupported
    why = impl.skip_reason(Case(pass_="backward"), device)
    assert why and "backward" in why
    padded = Case(seqlen=10, segments=((4, 4),), padding=(2,))
    assert "padding" in (impl.skip_reason(padded, device) or "")


# ---- chunked prefill with carried states equals one prefill -----------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_with_carried_states_equals_one_prefill(dtype, device):
    """Each sequence cut at a drawn token, prefilled in two calls from the carried states: y and the final
    states are the whole case's (the float64 oracle's, within budget) — as one prefill's are."""
    impl = usable(CHUNKED, dtype, False, device)
    with Examiner([PREFILL, CHUNKED], device) as examiner:
        @settings(max_examples=examples(cpu=8, gpu=20), **SETTINGS)
        @given(case=cases_for(impl, dtype, False, device), config=CONFIGS)
        def equal(case, config):
            assume(any(p.length > 1 for p in serving.sequences(case)))
            agrees_with_oracle(examiner, case, config)

        equal()


def test_chunked_prefill_teeth_a_state_not_carried_fails(device):
    usable(CHUNKED, "float32", False, device)
    planted = register(serving.ChunkedPrefill(name="planted.chunked_prefill_without_state", carry=False))
    case = EVERYTHING.replace(regime=Regime(decay="mild"))
    with Examiner([planted.name], device) as examiner:
        verdict = examiner.examine(case).verdicts[planted.name]
    assert verdict.status == "diverged" and {"y", "final_states"} <= {t.name for t in verdict.failing}, \
        verdict.message()


# ---- prefix-cache states ---------------------------------------------------------------------------------

def prefix_verdict_failures(name, case, device, tamper=None):
    inputs = materialize(case, device)
    tensors = inputs.native()
    states, metadata = serving.intermediate_states(release(), case, tensors)
    if tamper is not None:
        states = tamper(states)
    with Examiner([], device) as examiner:
        verdicts = prefix_state_verdicts(examiner, name, case, inputs, states, metadata)
    return [v.message() for v in verdicts if not v.ok]


@st.composite
def batch1_cases(draw, dtype, device):
    impl = get(PREFILL)
    case = draw(cases_for(impl, dtype, False, device, where=lambda c: serving.prefix_case(
        c.replace(batch=1, segments=c.segments[:1] if c.segments else None, padding=None), c.seqlen)))
    return case


@pytest.mark.parametrize("dtype", DTYPES)
def test_intermediate_states_equal_the_oracle_state_at_each_chunk_end(dtype, device):
    usable(PREFILL, dtype, False, device)

    @settings(max_examples=examples(cpu=6, gpu=20), **SETTINGS)
    @given(case=batch1_cases(dtype, device), config=CONFIGS)
    def equal(case, config):
        note(replay(case, config))
        with runtime.autotune(config):
            failures = prefix_verdict_failures("vllm.intermediate_states", case, device)
        assert not failures, "\n".join(failures)

    equal()


def test_intermediate_states_teeth_off_by_one_chunk_fails(device):
    usable(PREFILL, "float32", False, device)
    case = Case(batch=1, seqlen=21, nheads=2, headdim=4, dstate=4, chunk_size=8, initial_states=True,
                segments=((5, 12, 4),), regime=Regime(decay="mild"), seed=3, varlen_states=True)
    assert not prefix_verdict_failures("vllm.intermediate_states", case, device)
    shifted = prefix_verdict_failures("planted.states_one_chunk_late", case, device,
                                      tamper=lambda s: torch.cat([s[:1], s[:-1]]))
    assert len(shifted) >= 2, shifted


# ---- neighbours in the pack ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequences_outputs_do_not_depend_on_its_neighbours(dtype, device):
    usable(PREFILL, dtype, False, device)
    impl = get(PREFILL)

    @settings(max_examples=examples(cpu=6, gpu=20), **SETTINGS)
    @given(case=cases_for(impl, dtype, False, device), config=CONFIGS, empty=st.integers(0, 20))
    def independent(case, config, empty):
        note(replay(case, config))
        tensors = materialize(case, device).native()
        with runtime.autotune(config):
            problems = serving.neighbour_mismatches(release(), case, tensors, empty_computed=empty)
        assert not problems, "\n".join(problems)

    independent()


def leaky_run(rel, case, p, **kwargs):
    """Planted: every output also reads the mean of the whole pack's x (a neighbour's tokens)."""
    y, states = run_varlen(rel, case, p, **kwargs)
    return y + 1e-3 * p.tensors["x"].float().mean().to(y.dtype), states


def test_neighbour_independence_teeth_an_output_that_reads_its_neighbours_fails(device):
    usable(PREFILL, "float32", False, device)
    tensors = materialize(EVERYTHING, device).native()
    assert not serving.neighbour_mismatches(release(), EVERYTHING, tensors, empty_computed=3)
    problems = serving.neighbour_mismatches(release(), EVERYTHING, tensors, empty_computed=3, run=leaky_run)
    assert problems and all("in its pack" in line for line in problems), problems


# ---- the autotune config ---------------------------------------------------------------------------------

SWEEP_CASE = Case(batch=1, seqlen=20, nheads=3, ngroups=1, headdim=5, dstate=6, chunk_size=8, D="head",
                  has_z=True, initial_states=True, segments=((6, 14),), regime=Regime(decay="mild"), seed=5)


def test_the_result_does_not_depend_on_the_autotune_config(device):
    """Every config of every kernel the prefill launches (a config index i runs config i % n of a kernel with
    n): each within budget. vLLM's launch_autotuned would keep the first config it ran; the adapter empties its
    memo before every call, and the launches say which config ran."""
    usable(PREFILL, "float32", False, device)
    with Examiner([PREFILL], device) as examiner:
        failures, sweep, seen = [], runtime.ConfigSweep(), set()
        for index in sweep:
            outcome = examiner.examine(SWEEP_CASE, index)
            if not outcome.verdicts[PREFILL].ok:
                failures.append(f"config #{index}: {outcome.verdicts[PREFILL].message()}")
            launches = outcome.launches[PREFILL]
            seen |= {(launch.kernel, launch.index) for launch in launches}
            sweep.ran(launches)
    assert sweep.needed > 1 and len(seen) > 5, f"the sweep did not run the kernels' configs: {sorted(seen)}"
    assert not failures, "\n".join(failures) + f"\n{replay(SWEEP_CASE)}"


class ConfigSensitive(ChunkScanCombinedVarlen):
    """Planted: config #1 of the autotuned kernels corrupts one element of y."""

    name = "planted.config_sensitive_prefill"

    def forward(self, case, tensors, inputs, want_stages):
        result = super().forward(case, tensors, inputs, want_stages)
        if runtime.current_choice() == 1:
            result.outputs["y"][0, 0, 0, 0] += 1.0
        return result


def test_autotune_sweep_teeth_one_bad_config_fails(device):
    usable(PREFILL, "float32", False, device)
    planted = register(ConfigSensitive())
    with Examiner([planted.name], device) as examiner:
        assert examiner.examine(SWEEP_CASE, 0).verdicts[planted.name].ok
        swept = examiner.examine(SWEEP_CASE, "sweep").verdicts[planted.name]
    assert swept.status == "diverged" and "autotune config index 1" in swept.notes, swept.message()


# ---- the state cache ---------------------------------------------------------------------------------------

def test_final_states_written_into_state_cache_slots_are_the_returned_ones(device):
    rel = release()
    if not {"final_states_out", "final_state_indices"} <= rel.params(rel.varlen):
        pytest.skip(f"{rel.label}'s mamba_chunk_scan_combined_varlen writes no state cache")
    case = EVERYTHING.replace(regime=Regime(decay="mild"))
    tensors = materialize(case, device).native()
    p = pack(case, tensors)
    _, returned = run_varlen(rel, case, p)
    nseq = len(p.rows)
    slots = torch.randperm(nseq + 3, generator=torch.Generator().manual_seed(1))[:nseq].to(device)
    cache = torch.full((nseq + 3, case.nheads, case.headdim, case.dstate), 7.0, device=device)
    _, none = run_varlen(rel, case, p, final_states_out=cache, final_state_indices=slots.to(torch.int32))
    assert none is None
    assert torch.equal(cache[slots], returned)
    untouched = torch.ones(nseq + 3, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert bool((cache[untouched.to(device)] == 7.0).all()), "a slot no sequence owns was written"


def test_a_decode_row_at_the_null_block_is_skipped(device):
    """vLLM marks padded decode rows with state index null_block_id: the kernel must leave every slot and the
    other rows' outputs as they are without the padded row."""
    rel = release()
    if "null_block_id" not in rel.params(rel.step):
        pytest.skip(f"{rel.label}'s selective_state_update takes no null_block_id")
    fn, null = rel.step, int(rel.ops["mamba_ssm"].NULL_BLOCK_ID)
    h, p, n, b = 3, 4, 5, 3
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen).to(device)
    cache = r(b + 2, h, p, n)
    A = -torch.rand(h, generator=gen).to(device)[:, None, None].expand(h, p, n)
    dt_bias = r(h)[:, None].expand(h, p)
    D = r(h)[:, None].expand(h, p)
    x, dt, B, C = r(b + 1, h, p), r(b + 1, h)[..., None].expand(b + 1, h, p), r(b + 1, 1, n), r(b + 1, 1, n)
    slots = torch.tensor([s for s in range(b + 2) if s != null][:b], dtype=torch.int32, device=device)
    padded = torch.cat([slots[:1], torch.tensor([null], dtype=torch.int32, device=device), slots[1:]])
    order = [0, 2, 3]

    def step(rows, indices):
        state = cache.clone()
        out = torch.zeros(len(rows), h, p, device=device)
        fn(state, x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, dt_softplus=True,
           state_batch_indices=indices, null_block_id=null, out=out)
        return state, out

    plain_state, plain_out = step(order, slots)
    padded_state, padded_out = step([0, 1, 2, 3], padded)
    assert torch.equal(padded_state, plain_state), "the padded row changed the state cache"
    assert torch.equal(padded_out[[0, 2, 3]], plain_out)
    assert torch.equal(padded_state[null], cache[null]), "the null block was written"


# ---- how vLLM is loaded ----------------------------------------------------------------------------------

def test_vllm_loads_without_its_init_and_says_what_it_stood_in():
    rel = release()
    assert getattr(sys.modules["vllm"], "ssdiff_without_init", False)
    assert rel.version != "unknown" and rel.label == f"vllm {rel.version}"
    assert set(rel.standins) >= {"vllm.platforms", "vllm._custom_ops", "vllm.triton_utils"}
    notes = " ".join(rel.notes())
    assert all(name in notes for name in rel.standins)
    from vllm.platforms import current_platform
    assert not current_platform.is_cpu(), "the ops would dispatch to vLLM's CPU fallbacks, not the Triton kernels"
    import vllm._custom_ops as ops
    with pytest.raises(upstream_vllm.StandInMissing, match="selective_scan_fwd: the compiled extension is absent"):
        ops.selective_scan_fwd
    assert {m.__name__.rsplit(".", 1)[-1] for m in rel.kernel_modules()} >= {"ssd_chunk_scan", "mamba_ssm"}


def test_block_size_boundaries_come_from_vllms_autotune_configs(device):
    from ssdiff.sides.tiling import autotuned, boundaries

    release()
    kernels = {name for name, _ in autotuned(get(PREFILL).kernel_modules())}
    assert {"_chunk_cumsum_fwd_kernel", "_chunk_state_fwd_kernel", "_state_passing_fwd_kernel",
            "_bmm_chunk_fwd_kernel", "_chunk_scan_fwd_kernel"} <= kernels, kernels
    found = boundaries(get(PREFILL), device)
    assert {"headdim", "dstate", "nheads"} <= {b.dim for b in found}, found


def test_ssdiff_list_shows_the_vllm_implementations_and_the_sglang_line():
    result = subprocess.run([sys.executable, "-m", "ssdiff.cli", "list"], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, COLUMNS="200"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert PREFILL in out and STEP in out and "sglang: not usable here" in out
    if upstream_vllm.vllm_problem() is None:
        assert "vllm: vllm " in out and "stood in: vllm._custom_ops" in out


def test_the_extracted_files_alone_run_the_adapters(tmp_path, device):
    """harness/sides/extract_vllm.py copies only what the adapters import; with nothing else on the path (the installed
    wheel shadowed), both adapters load from the copy and agree with the oracle."""
    rel = release()
    from ssdiff.sides import extract_vllm

    written = extract_vllm.extract(rel.location, tmp_path / "vllm-ops")
    total = sum(f.stat().st_size for f in written)
    assert total < 8 * 2 ** 20, f"{total} bytes extracted"
    script = ("import sys; from ssdiff import runtime; runtime.configure()\n"
              "from ssdiff.sides import upstream_vllm; from ssdiff.examine import Examiner; from ssdiff.model.case import Case\n"
              "rel = upstream_vllm.vllm(); print(rel.location)\n"
              f"ex = Examiner(['{PREFILL}', '{STEP}'], '{device}')\n"
              "assert ex.examine(Case(seqlen=12, segments=((5, 7),))).verdicts['" + PREFILL + "'].ok\n"
              "assert ex.examine(Case(entry='decode', seqlen=4, decode_steps=2)).verdicts['" + STEP + "'].ok\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "vllm-ops"), str(REPO)]))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(tmp_path / "vllm-ops") in result.stdout


def test_sglang_says_in_one_line_why_it_is_not_driven():
    why = upstream_vllm.sglang_problem()
    assert why and "\n" not in why and "sglang" in why
    assert "not installed" in why or "serving stack" in why or "no adapter" in why or "does not import" in why


def test_a_planted_serving_bug_is_found_minimized_and_its_repro_diverges(tmp_path, device):
    """A chunked-prefill runner that forgets the carried state, on vLLM's real kernel: a short campaign finds it,
    the minimizer shrinks it, and the repro (reaching the side through ssdiff) exits non-zero."""
    from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer

    usable(CHUNKED, "float32", False, device)
    spec = "ssdiff.sides.doubles:chunked_prefill_without_state"
    config = FuzzConfig(impl=spec, out_dir=str(tmp_path), device=device, report_dir=None, max_time=None,
                        max_examples=40, seed=3, dtypes=("float32",), entry="chunk_scan",
                        bounds=Bounds(max_batch=2, max_seqlen=16, max_nheads=2, max_headdim=4, max_dstate=4,
                                      chunk_sizes=(4, 8)))
    report = Fuzzer(config).run()
    assert report.exit_code == 1, f"nothing found in {report.tried} cases ({report.stopped})"
    finding = report.findings[0]
    assert {t.name for t in finding.outcome.verdicts[spec].failing} & {"y", "final_states", "varlen_states"}
    minimized = sorted(tmp_path.glob("divergence-*/minimized.json"))
    repro = sorted(tmp_path.glob("divergence-*/repro.py"))
    assert minimized and repro, sorted(p.name for p in tmp_path.rglob("*"))
    small = Case.load(minimized[0])
    assert small.seqlen <= finding.outcome.case.seqlen and small.nheads <= finding.outcome.case.nheads
    # ssdiff's registry from this checkout, ahead of whatever else the caller's path provides (a GPU runner's
    # packages, an extraction of vLLM's ops)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(repro[0])], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=path))
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stdout[-2000:] + result.stderr[-2000:]


# vLLM 0.33.0 and 0.34.0 (a Case's empty sequence: the record vllm-varlen-empty-sequence-state): for a
# request without new tokens whose computed tokens fill whole chunks, the chunk-metadata builder emits no chunk and
# names the last chunk emitted before it as its last; the returned final states (states[last_chunk_indices]) then
# give it its predecessor's state (or, first in the pack, the pack's last chunk's), while the fused state-cache
# write (final_states_out) gives it its own initial state. vLLM's scheduler never sends an empty prefill.
EMPTY_REQUEST_AFFECTED = ("0.33.0", "0.34.0")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_an_empty_request_gets_its_initial_state_back_from_both_output_modes(where, request, device):
    rel = release()
    if not {"final_states_out", "final_state_indices"} <= rel.params(rel.varlen):
        pytest.skip(f"{rel.label}'s mamba_chunk_scan_combined_varlen writes no state cache")
    if rel.version in EMPTY_REQUEST_AFFECTED:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
            f"{rel.label}: an empty request's returned final state is its predecessor's chunk state (the state-"
            f"cache write gives its initial state)")))
    case = Case(batch=1, seqlen=20, nheads=2, headdim=3, dstate=4, chunk_size=8, initial_states=True,
                segments=((8, 12),), regime=Regime(decay="mild"), seed=4)
    tensors = materialize(case, device).native()
    seqs = serving.sequences(case)
    empty = serving.Piece(0, 0, 0, computed=2 * case.chunk_size)     # whole chunks computed, none new
    order = {"first": [empty, *seqs], "middle": [seqs[0], empty, seqs[1]], "last": [*seqs, empty]}[where]
    at = order.index(empty)
    h0 = serving.sequence_initial_states(case, tensors)
    own = torch.full_like(h0[0], 5.0)
    states = torch.stack([own if p is empty else h0[seqs.index(p)] for p in order])
    p = serving.pack_pieces(case, tensors, order, states)
    _, returned = run_varlen(rel, case, p)
    cache = torch.zeros(len(order), *h0.shape[1:], device=device)
    run_varlen(rel, case, p, final_states_out=cache,
               final_state_indices=torch.arange(len(order), dtype=torch.int32, device=device))
    assert torch.equal(cache[at], own), "the state-cache write did not give the empty request its initial state"
    assert torch.equal(returned[at], own), (f"returned final state of the empty request ({where} in the pack, last "
                                            f"chunk index {p.metadata.last_chunk_indices[at]}) is not its initial "
                                            f"state")
