"""Fragments: strided by depth, size-balanced extras, staggered schedule."""

from __future__ import annotations

import pytest

from p2p_diloco import fragments
from p2p_diloco.config import ModelConfig
from p2p_diloco.model import build_model

SIZES = {
    "wte.weight": 300,
    "wpe.weight": 100,
    **{f"blocks.{b}.{p}": 50 for b in range(6) for p in ("attn.weight", "fc.weight")},
    "ln_f.weight": 10,
}


def test_blocks_are_strided_across_depth() -> None:
    groups = fragments.partition(SIZES, 3)
    blocks_of = [sorted({fragments.block_index(n) for n in g if fragments.block_index(n) is not None}) for g in groups]
    assert blocks_of == [[0, 3], [1, 4], [2, 5]]


def test_extras_are_bin_packed_largest_first() -> None:
    groups = fragments.partition(SIZES, 3)
    # every fragment has 200 of block weights; wte (300) -> fragment 0, wpe (100) -> 1, ln_f (10) -> 2
    assert "wte.weight" in groups[0] and "wpe.weight" in groups[1] and "ln_f.weight" in groups[2]
    loads = [sum(SIZES[n] for n in g) for g in groups]
    assert loads == [500, 300, 210]
    assert sorted(n for g in groups for n in g) == sorted(SIZES)  # a partition: each name exactly once


def test_more_fragments_than_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 6 blocks into 7 fragments"):
        fragments.partition(SIZES, 7)


def test_staggered_schedule() -> None:
    sched = fragments.SyncSchedule(num_fragments=3, sync_every=30)
    due = {s: sched.due(s) for s in range(1, 91)}
    assert [s for s, d in due.items() if d] == [30, 40, 50, 60, 70, 80, 90]
    assert due[30] == [0] and due[40] == [1] and due[50] == [2] and due[60] == [0]
    # before H steps nothing is due: every fragment has at least H steps of local progress
    assert all(not due[s] for s in range(1, 30))
    four = fragments.SyncSchedule(num_fragments=4, sync_every=25)
    assert [s for s in range(1, 51) if four.due(s)] == [25, 32, 38, 44, 50]  # offsets 6.25 apart, rounded up


def test_ramped_schedule_syncs_early_and_then_every_h() -> None:
    sched = fragments.SyncSchedule(num_fragments=1, sync_every=32, start_every=2, ramp_steps=300)
    steps = [s for s in range(1, 1201) if sched.due(s)]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert steps[0] <= 3 and gaps[0] <= 3  # H starts at 2 (rounded up as it grows) ...
    assert all(g == 32 for g in gaps[-20:])  # ... and ends at 32
    assert all(b >= a for a, b in zip(gaps, gaps[1:]))  # never shrinks
    # phase closed form = the sum of 1/H(s)
    exact = sum(1 / sched.period(s) for s in range(300))
    assert abs(sched.phase(300) - exact) / exact < 0.02
    assert len(steps) == int(sched.phase(1200) + 1e-9)


def test_schedule_rejects_bad_ramps() -> None:
    with pytest.raises(ValueError):
        fragments.SyncSchedule(num_fragments=2, sync_every=10, start_every=20)


def test_real_model_partition_covers_every_parameter() -> None:
    model = build_model(ModelConfig(), seed=0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    frs = fragments.make_fragments(sizes, 4)
    assert sum(f.numel for f in frs) == sum(sizes.values())
    assert max(f.numel for f in frs) / min(f.numel for f in frs) < 1.25
