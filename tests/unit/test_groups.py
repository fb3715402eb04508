"""The pure rules of bounded groups (p2p_diloco/core/groups.py): grid groups, mixing, merges, the bound."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from p2p_diloco.core.groups import (
    assign_groups, consensus_bound, grid_rank, grid_sides, group_of, heir, live_groups, merged_version, mean_in_peer_order,
    mixing_rounds, needs_download, round_axis, swarm_distance_estimate, weighted_merge,
)

PEERS = [f"peer{i:04d}" for i in range(1000)]


@pytest.mark.parametrize("n", [1, 2, 7, 16, 17, 100, 255, 256, 257, 1000])
@pytest.mark.parametrize("cap", [0, 2, 4, 8, 16, 32])
def test_every_peer_is_in_exactly_one_group_of_at_most_the_cap(n: int, cap: int) -> None:
    peers = PEERS[:n]
    sides = grid_sides(n, cap)
    assert math.prod(sides) >= n and (cap == 0 or max(sides) <= cap)
    for r in range(2 * len(sides) + 1):
        groups = assign_groups(peers, r, cap)
        members = [p for g in groups for p in g]
        assert sorted(members) == sorted(peers)
        assert cap == 0 or max(len(g) for g in groups) <= cap
        assert cap != 0 or len(groups) == 1


def test_sides_are_as_few_and_as_equal_as_the_cap_allows() -> None:
    assert grid_sides(1000, 16) == (10, 10, 10)
    assert grid_sides(1000, 32) == (32, 32)
    assert grid_sides(1000, 8) == (6, 6, 6, 5)
    assert grid_sides(256, 16) == (16, 16)
    assert grid_sides(12, 16) == (12,)
    assert grid_sides(12, 0) == (12,)
    with pytest.raises(ValueError):
        grid_sides(0, 16)
    with pytest.raises(ValueError):
        grid_sides(10, 1)


def test_groups_change_every_round_and_repeat_after_one_cycle() -> None:
    peers = PEERS[:1000]
    d = len(grid_sides(1000, 16))
    rounds = [set(assign_groups(peers, r, 16, "run/f0")) for r in range(2 * d)]
    for a, b in itertools.pairwise(rounds):
        assert not a & b  # no group of one round is a group of the next
    assert rounds[0] == rounds[d] and round_axis(d, grid_sides(1000, 16)) == 0
    # The salt (run, fragment) gives an unrelated grid.
    assert set(assign_groups(peers, 0, 16, "run/f1")) != rounds[0]


def _mixing(groups: list[tuple[str, ...]], index: dict[str, int]) -> np.ndarray:
    m = np.zeros((len(index), len(index)))
    for g in groups:
        ids = [index[p] for p in g]
        m[np.ix_(ids, ids)] = 1.0 / len(ids)
    return m


@pytest.mark.parametrize("n,cap", [(1000, 16), (1000, 32), (300, 8), (256, 16), (97, 4), (64, 4)])
def test_a_change_reaches_everyone_within_the_mixing_rounds(n: int, cap: int) -> None:
    """Composed mixing over ``mixing_rounds`` consecutive rounds (from any start) has no zero: every peer's
    change is in every anchor; on a full grid it is the exact mean."""
    peers = PEERS[:n]
    index = {p: i for i, p in enumerate(peers)}
    k = mixing_rounds(n, cap)
    d = len(grid_sides(n, cap))
    for start in range(d):
        total = np.eye(n)
        for r in range(start, start + k):
            total = _mixing(assign_groups(peers, r, cap), index) @ total
        assert total.min() > 0, (start, k)
        assert np.allclose(total.sum(axis=0), 1.0) and np.allclose(total.sum(axis=1), 1.0)  # the mean is kept
        if math.prod(grid_sides(n, cap)) == n:
            assert np.allclose(total, 1.0 / n)


def test_live_groups_keep_cells_when_peers_die() -> None:
    roster = PEERS[:1000]
    rng = random.Random(1)
    live = set(rng.sample(roster, 900))
    full = assign_groups(roster, 5, 16)
    kept = live_groups(roster, live, 5, 16)
    assert kept == [tuple(p for p in g if p in live) for g in full if any(p in live for p in g)]
    assert sorted(p for g in kept for p in g) == sorted(live)
    assert group_of(roster[3], roster, 5, 16) in full


def test_grid_rank_is_a_function_of_the_ids_only() -> None:
    shuffled = PEERS[:50]
    random.Random(0).shuffle(shuffled)
    assert grid_rank(shuffled, "s") == grid_rank(sorted(shuffled), "s")
    with pytest.raises(ValueError):
        grid_rank(["a", "a"])


def test_merge_is_deterministic_and_order_independent() -> None:
    rng = np.random.default_rng(0)
    values = {f"p{i}": rng.standard_normal(64).astype(np.float32) * 10.0 ** rng.integers(-3, 3) for i in range(16)}
    ref = mean_in_peer_order(values)
    for seed in range(5):
        keys = list(values)
        random.Random(seed).shuffle(keys)
        again = mean_in_peer_order({k: values[k] for k in keys})
        assert again.tobytes() == ref.tobytes()  # bit-identical, whatever order the values arrived in
    assert np.allclose(ref, np.mean(np.stack(list(values.values())), axis=0), rtol=1e-5, atol=1e-6)
    assert merged_version([3, 7, 7], 7) == 8 and merged_version([0], 0) == 1
    with pytest.raises(ValueError):
        merged_version([9], 7)  # a member from a later round is not on this clock
    with pytest.raises(ValueError):
        merged_version([], 3)


def test_catching_up_downloads_only_past_the_mixing_time() -> None:
    assert not needs_download(10, 12, 3)
    assert not needs_download(10, 13, 3)
    assert needs_download(10, 14, 3)


def test_consensus_bound_matches_its_formula_and_holds_on_a_full_grid() -> None:
    assert consensus_bound((10, 10, 10), 1.0) == pytest.approx(1 / math.sqrt(10) + 1 / 10)
    assert consensus_bound((1000,), 1.0) == 0.0
    assert consensus_bound((32, 32), 2.0) == pytest.approx(2 / math.sqrt(32))
    # Steady state of a full 8x8x8 grid, every round committed: each peer adds independent noise (spread 1).
    n, cap, dim = 512, 8, 32
    sides = grid_sides(n, cap)
    assert math.prod(sides) == n
    peers = PEERS[:n]
    index = {p: i for i, p in enumerate(peers)}
    rng = np.random.default_rng(0)
    x = np.zeros((n, dim))
    worst = 0.0
    for r in range(30):
        u = rng.standard_normal((n, dim)) / math.sqrt(dim)
        spread = math.sqrt(np.mean(np.sum((u - u.mean(axis=0)) ** 2, axis=1)))
        x = _mixing(assign_groups(peers, r, cap), index) @ (x + u)
        dist = math.sqrt(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))
        worst = max(worst, dist / consensus_bound(sides, spread))
    assert 0.5 < worst <= 1.0


def test_swarm_distance_estimate_bounds_the_true_distance_on_a_full_grid() -> None:
    n, cap = 256, 16
    peers = PEERS[:n]
    index = {p: i for i, p in enumerate(peers)}
    x = np.random.default_rng(1).standard_normal((n, 8))
    true = math.sqrt(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))
    per_axis = []
    for r in range(len(grid_sides(n, cap))):
        means = _mixing(assign_groups(peers, r, cap), index) @ x
        per_axis.append(math.sqrt(np.mean(np.sum((x - means) ** 2, axis=1))))
    assert true <= swarm_distance_estimate(per_axis) <= true * math.sqrt(len(per_axis)) + 1e-12


def test_the_heir_is_the_smallest_live_group_mate() -> None:
    assert heir("c", ["d", "c", "b", "a"], {"b", "d"}) == "b"
    assert heir("c", ["c", "a"], {"c"}) is None  # nobody left: the weight is lost
    assert heir("a", ["a", "b"], {"a", "b"}) == "b"  # never itself


def test_weighted_merge_keeps_the_weighted_sum_and_adds_every_update() -> None:
    rng = np.random.default_rng(3)
    ids = [f"p{i}" for i in range(7)]
    anchors = {p: rng.standard_normal(16) for p in ids}
    weights = {p: float(w) for p, w in zip(ids, rng.uniform(0.2, 2.0, len(ids)))}
    updates = {p: rng.standard_normal(16) * 1e-3 for p in ids}
    anchor, each = weighted_merge(anchors, weights, updates)
    before = sum(weights[p] * anchors[p] for p in ids)
    after = each * len(ids) * anchor
    assert each * len(ids) == pytest.approx(sum(weights.values()))
    assert np.allclose(after, before + sum(updates.values()))
    shuffled = list(reversed(ids))
    again, _ = weighted_merge({p: anchors[p] for p in shuffled}, {p: weights[p] for p in shuffled},
                              {p: updates[p] for p in shuffled})
    assert again.tobytes() == anchor.tobytes()
    with pytest.raises(ValueError):
        weighted_merge(anchors, {**weights, "x": 1.0}, updates)
