"""Block-size boundaries (harness/sides/tiling.py) and the compile pool (harness/campaign/pool.py): the search crosses the block
sizes of the configs that run, and natively draws every round from a few compile keys.

The planted bug (ssdiff.sides.doubles:tiling_bug) adds the D skip with an autotuned Triton kernel whose grid assumes
64-wide tiles: right with its first config (BLOCK_P = 64), wrong with the second (32) once headdim > 32 —
a size the CPU bounds (headdim <= 8) never reach but for the boundary draws.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ssdiff.sides import doubles
from ssdiff.sides import tiling
from ssdiff.model.case import Case
from ssdiff.examine import Examiner
from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer
from ssdiff.sides.registry import get
from ssdiff.campaign.pool import FLAGS, KINDS, CompileKey, Mix, Pool, Production, flags_of, seqlen_class
from ssdiff.model.bounds import Bounds
from ssdiff.model.strategies import cases, maybe_boundary

TILING_BUG = "ssdiff.sides.doubles:tiling_bug"


def test_boundaries_are_read_from_the_configs_and_the_dimension_their_blocks_tile(device):
    found = tiling.boundaries(doubles.tiling_bug, device)
    assert {b.dim for b in found} == {"headdim"}                 # BLOCK_P tiles headdim only (declared)
    by_value = {(b.value, b.block): b.config for b in found}
    assert by_value[(33, 32)] == 1 and by_value[(65, 32)] == 1   # the small-block config, past its block
    assert by_value[(64, 64)] == 0 and by_value[(65, 64)] == 0
    assert max(b.value for b in found) <= tiling.CAPS["cuda" if device.startswith("cuda") else "cpu"]["headdim"]
    # ssdiff's own tuners declare what each block tiles: a block over chunk positions gives no boundary.
    triton = get("ssdiff.triton")
    for name, tuner in tiling.autotuned(triton.kernel_modules()):
        for b in tiling.boundaries(triton, device):
            if b.kernel == name:
                assert any(tiling.DECLARED[tuner.tiles[k]] and b.dim in tiling.DECLARED[tuner.tiles[k]]
                           for k in tuner.tiles), (name, b)


@settings(max_examples=40)
@given(data=st.data())
def test_a_boundary_case_has_its_dimension_at_the_boundary(device, data):
    found = tiling.boundaries(get("mamba_ssm.chunk_scan_combined"), device)
    b = data.draw(st.sampled_from(found))
    case = data.draw(cases(entry="chunk_scan", boundary=b))
    assert getattr(case, b.dim) == b.value and case.nheads % case.ngroups == 0
    assert data.draw(maybe_boundary(found, 0.0)) is None


def test_a_tiling_bug_past_a_small_block_is_found_and_run_with_that_config(tmp_path, device):
    """Interpreted, one case in two straddles a boundary; natively, three compile keys of four are boundary
    keys. Either way the finding is a headdim past 32 run with the 32-wide config."""
    config = FuzzConfig(impl=TILING_BUG, device=device, max_time=None, max_examples=300, seed=3,
                        pass_="forward", dtypes=("float32",), minimize=False, localize=False, report_dir=None,
                        out_dir=str(tmp_path), bounds=Bounds(boundary_rate=0.5),
                        pool_mix=Mix(size=4, production=0.0, boundary=0.75))
    report = Fuzzer(config).run()
    assert report.exit_code == 1, f"not found in {report.tried} cases ({report.stopped})"
    outcome = report.findings[0].outcome
    assert outcome.case.headdim > 32 and outcome.choice == 1, (outcome.case.describe(), outcome.choice)


def test_the_same_search_without_boundaries_misses_it(tmp_path, device):
    """The teeth of the test above: with no boundary draw (and the tuned config) the bug never shows."""
    config = FuzzConfig(impl=TILING_BUG, device=device, max_time=None, max_examples=60, seed=3,
                        pass_="forward", dtypes=("float32",), minimize=False, localize=False, report_dir=None,
                        out_dir=str(tmp_path), bounds=Bounds(boundary_rate=0.0),
                        pool_mix=Mix(size=2, production=0.0, boundary=0.0))
    assert Fuzzer(config).run().exit_code == 0


# ---- the compile pool ------------------------------------------------------------------------------------------

def small_pool(seed=0, **kw) -> Pool:
    """A pool as a GPU campaign builds it (its keys are plain data: drawing them needs no GPU)."""
    return Pool(("chunk_scan", "split_conv1d"), ("float32", "bfloat16"), Bounds(max_seqlen=300, max_headdim=64,
                                                                                 max_dstate=64, max_nheads=12),
                tiling.boundaries(get("mamba_ssm.chunk_scan_combined"), "cuda"), seed=seed, **kw)


def test_a_key_fixes_the_shape_and_the_variant_flags_and_keeps_seqlen_in_its_class():
    pool = small_pool(seed=1)
    for key in pool.keys:
        variants = {b: flags_of(key.case(backward=b)) for b in (False, True)}

        @settings(max_examples=15)
        @given(cases(key=key, backward=None))
        def drawn(case):
            fixed = key.fixed()
            assert {k: getattr(case, k) for k in fixed} == fixed and case.regime.layout == key.layout
            assert key.fits(case.seqlen), (key.describe(), case.seqlen)
            assert flags_of(case) == variants[case.backward], (key.describe(), case.describe())
        drawn()


def test_keys_pin_every_variant_flag_and_vary_them_across_keys():
    """Across a campaign's keys each flag takes both values (rotation is what varies them)."""
    pool = small_pool(seed=4)
    keys = [pool.draw("small") for _ in range(40)]
    for entry in ("chunk_scan", "split_conv1d"):
        mine = [k for k in keys if k.entry == entry]
        assert mine and all(tuple(n for n, _ in k.flags) == FLAGS[entry] for k in mine)
        for name in ("initial_states", "seq_idx", "return_final_states"):
            assert {k.pinned[name] for k in mine} == {False, True}, (entry, name)


def test_a_key_is_what_fitting_its_representative_leaves():
    """An implementation that cannot express a flag (here: no initial states) gets keys without it."""
    def fit(case):
        return case.replace(initial_states=False) if case.initial_states else case
    pool = small_pool(seed=6, fit=fit)
    assert all(not pool.draw("small").pinned["initial_states"] for _ in range(20))


def test_keys_come_in_the_mix_and_rotate_one_at_a_time():
    pool = small_pool(seed=2, mix=Mix(size=4, production=0.25, boundary=0.25))
    assert sorted(k.kind for k in pool.keys) == ["boundary", "production", "small", "small"]
    boundary = next(k for k in pool.keys if k.kind == "boundary")
    assert getattr(boundary, boundary.boundary.dim) == boundary.boundary.value
    before = list(pool.keys)
    after = pool.rotate()
    assert sum(a != b for a, b in zip(before, after)) <= 1 and [k.kind for k in after] == [k.kind for k in before]


def test_production_keys_reach_model_shapes_within_their_element_budget():
    prod = Production()
    pool = small_pool(seed=5, mix=Mix(size=8, production=1.0, boundary=0.0))
    keys = [k for k in pool.keys if k.kind == "production"]
    assert len(keys) == 7
    for key in keys:
        assert key.seqlen >= 2048 and key.dstate >= 128 and key.headdim in prod.headdims
        assert key.batch * key.seqlen_max * key.nheads * key.headdim <= prod.max_elements
        assert key.nheads % key.ngroups == 0


def test_snap_finds_the_nearest_seqlen_of_the_class():
    key = CompileKey(kind="small", dtype="float32", entry="chunk_scan", batch=1, nheads=2, ngroups=1, headdim=4,
                     dstate=4, chunk_size=16, layout="contiguous", seqlen=40, seqlen_min=1, seqlen_max=300)
    assert seqlen_class(40, 16) == seqlen_class(key.snap(41), 16)
    assert key.snap(40) == 40 and key.snap(1) != 1
    assert Case(seqlen=key.snap(299)).seqlen <= 300


# ---- the compile pool: the layer entry -------------------------------------------------------------------------

LAYER_BOUNDS = Bounds(max_seqlen=300, max_headdim=64, max_dstate=64, max_nheads=12)


def layer_pool(device, seed=0, **kw) -> Pool:
    """A pool as a layer campaign on ``device`` builds it, with GPU bounds."""
    return Pool(("layer",), ("float32", "bfloat16"), LAYER_BOUNDS,
                tiling.boundaries(get("mamba_ssm.mamba2_no_mem_eff"), device), seed=seed, **kw)


def layer_keys(pool: Pool, count: int = 8) -> list:
    return [pool.draw(kind) for _ in range(count) for kind in KINDS]


def test_a_layer_key_fixes_the_widths_and_the_flags_and_keeps_seqlen_in_its_class(device):
    keys = layer_keys(layer_pool(device, seed=1), 4)
    assert {k.steps > 0 for k in keys} == {False, True}       # decoded keys and others among them
    for key in keys:
        assert tuple(n for n, _ in key.flags) == FLAGS["layer"] and flags_of(key.case()) == key.flags

        @settings(max_examples=15)
        @given(cases(key=key, backward=None))
        def drawn(case):
            fixed = key.fixed()
            assert {"d_model", "d_nonssm", "conv_width"} <= set(fixed)
            assert {k: getattr(case, k) for k in fixed} == fixed and case.regime.layout == key.layout
            assert key.fits(case.seqlen), (key.describe(), case.seqlen)
            assert flags_of(case) == key.flags, (key.describe(), case.describe())   # every layer flag, either pass
        drawn()


def test_a_decoded_layer_key_yields_forward_cases_without_segments(device):
    """Decoding is forward only, one sequence per row: a key with layer_steps > 0 draws only such cases, and its
    representative is the same for both passes (the fuzzer judges it once)."""
    decoded = [k for k in layer_keys(layer_pool(device, seed=2), 8) if k.steps]
    assert decoded
    for key in decoded:
        assert not key.pinned["seq_idx"] and key.seqlen_min > key.steps
        assert key.case(backward=True) == key.case() and not key.case().backward

        @settings(max_examples=15)
        @given(cases(key=key, backward=None), cases(key=key, backward=True))
        def drawn(mixed, backward):
            for case in (mixed, backward):
                assert not case.backward and case.segments is None and case.layer_steps == key.steps
                # the prefill (what the chunked kernels see) keeps the key's class
                prefill = case.seqlen - case.layer_steps
                assert prefill >= 1 and seqlen_class(prefill, key.chunk_size) == \
                    seqlen_class(key.seqlen - key.steps, key.chunk_size)
        drawn()
    # a backward-only campaign draws no decoded key
    assert not any(k.steps for k in layer_keys(layer_pool(device, seed=2, backward=True), 8))


def test_a_layer_campaigns_production_slots_take_small_keys(device):
    pool = layer_pool(device, seed=3, mix=Mix(size=4, production=0.5, boundary=0.25))
    assert sorted(pool.kinds) == ["boundary", "production", "production", "small"]
    for _ in range(6):
        keys = pool.rotate()
        assert sorted(k.kind for k in keys) == ["boundary", "small", "small", "small"]
        assert all(k.nheads <= LAYER_BOUNDS.max_nheads and k.seqlen_max <= LAYER_BOUNDS.max_seqlen
                   for k in keys if k.kind == "small")


def test_a_layer_key_is_what_the_examiners_fit_leaves(device):
    """mamba_ssm's Mamba2 (conv channels % 8) against fla's fused path (no SwiGLU branch, no seq_idx, no
    decoding): each key's representative is a valid Case that fitting leaves as it is, and cases drawn from the
    key keep its widths and flags once fitted."""
    with Examiner(["mamba_ssm.mamba2_no_mem_eff", "fla.mamba2_fused"], device) as examiner:
        pool = layer_pool(device, seed=4, fit=examiner.fit)
        for key in layer_keys(pool, 3):
            rep = key.case()
            assert Case.from_json(rep.to_json()) == rep and examiner.fit(rep) == rep, key.describe()
            assert key.d_nonssm == 0 and not key.pinned["seq_idx"] and key.steps == 0
            assert rep.conv_channels % 8 == 0, key.describe()

            @settings(max_examples=5)
            @given(cases(key=key, backward=None))
            def drawn(case):
                fitted = examiner.fit(case)
                assert fitted is not None and flags_of(fitted) == key.flags, (key.describe(), case.describe())
                assert {k: getattr(fitted, k) for k in key.fixed()} == key.fixed()
            drawn()


def test_a_layer_campaign_pools_only_where_a_side_has_kernels(tmp_path, device):
    """A layer with Triton kernels gets compile keys (fla's torch path too: its swish and gated RMSNorm are Triton
    kernels); a torch-only layer (no kernel to compile) draws freely."""
    def fuzzer(impl):
        return Fuzzer(FuzzConfig(impl=impl, device=device, entry="layer", max_examples=1, pool=True,
                                 compile_ahead=False, dtypes=("float32",), report_dir=None, out_dir=str(tmp_path)))
    pooled = fuzzer("mamba_ssm.mamba2_no_mem_eff").pool
    assert pooled is not None and {k.entry for k in pooled.keys} == {"layer"}
    assert fuzzer("fla.mamba2_torch").pool is not None
    assert fuzzer("transformers.mamba2_mixer").pool is None
