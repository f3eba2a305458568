"""The compile pool's keys (harness/campaign/pool.py): what a round of a native campaign draws its cases from. Keys are
plain data, drawn the same on every machine."""

from __future__ import annotations

from ssdiff.campaign import pool
from ssdiff.campaign.pool import Mix, Pool, feature_pairs
from ssdiff.model.bounds import Bounds

BOUNDS = Bounds(max_batch=2, max_seqlen=300, max_nheads=12, max_headdim=64, max_dstate=64,
                chunk_sizes=(16, 32, 64, 128, 256))


def _rounds(seeds):
    return [Pool(("split_conv1d",), ("float32",), BOUNDS, (), mix=Mix(), seed=seed).keys for seed in seeds]


def test_a_rounds_keys_are_drawn_to_meet_more_features_together(monkeypatch):
    """Each key is the candidate (of SPREAD) adding the most (feature, value) pairs its round lacks: over sixty
    seeds the first rounds hold more pairs, and more of them have a key with ngroups > 1 and the gated RMSNorm
    (the seed bug's conjunction), than single draws give."""
    def measure():
        rounds = _rounds(range(60))
        pairs = sum(len(set().union(*(feature_pairs(k) for k in keys))) for keys in rounds)
        grouped_norm = sum(any(k.ngroups > 1 and dict(k.flags)["rmsnorm"] for k in keys) for keys in rounds)
        return pairs, grouped_norm

    spread = measure()
    monkeypatch.setattr(pool, "SPREAD", 1)
    single = measure()
    assert spread[0] > 1.05 * single[0] and spread[1] > single[1], (spread, single)


def test_a_boundary_keys_candidates_share_its_boundary_and_the_keys_take_the_boundaries_in_turn():
    from itertools import cycle

    from ssdiff.sides.tiling import Boundary

    boundaries = tuple(Boundary("headdim", v, 32, "k", 0) for v in (31, 32, 33, 65, 97))
    p = Pool(("chunk_scan",), ("float32",), BOUNDS, boundaries, mix=Mix(size=2, production=0.0, boundary=0.5),
             seed=3)
    turn = cycle(p._boundary_order)
    assert [k.boundary for k in p.keys if k.boundary] == [next(turn)]
    drawn = 0
    for _ in range(12):
        if p.upcoming.boundary is not None:
            assert p.upcoming.boundary == next(turn) and p.upcoming.headdim == p.upcoming.boundary.value
            drawn += 1
        p.rotate()
    assert drawn >= 3


def test_planning_rotations_ahead_draws_what_rotating_one_round_at_a_time_draws():
    """Pool.ahead plans the next rotations against the keys each round will have: the rounds are those of a pool
    that never looks ahead, and what was planned is what arrives."""
    def pool():
        return Pool(("chunk_scan", "split_conv1d"), ("float32", "bfloat16"), BOUNDS, mix=Mix(size=4), seed=11)

    plain, looking = pool(), pool()
    for round_ in range(10):
        planned = looking.ahead(3)
        assert planned[0] == looking.upcoming
        assert looking.rotate() == plain.rotate(), f"round {round_}"
        assert looking.keys[[k is planned[0] for k in looking.keys].index(True)] is planned[0]
        assert looking.ahead(2) == planned[1:3]
