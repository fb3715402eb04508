"""A learner on the step schedule that joins a training swarm numbers its steps like the swarm (issue 17,
item 8): the wiring from the peers' records to ``due_fragments``, on a stand-in (no model, no processes)."""

from __future__ import annotations

from types import SimpleNamespace

from p2p_diloco.core import fragments
from p2p_diloco.engine.engine import DiLoCo


def stand_in(peer_steps: list[tuple[int, float, float]], now: float) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(averaging=SimpleNamespace(schedule="steps")),
                           schedule=fragments.SyncSchedule(num_fragments=2, sync_every=100),
                           inner_step=0, schedule_offset=0, view=SimpleNamespace(peer_steps=peer_steps),
                           dht_time=lambda: now)


def test_a_newcomer_falls_due_at_the_swarms_steps() -> None:
    # the incumbents published steps 365 and 352 (0.1 s per step), 0.8 and 2.1 s before we start training
    learner = stand_in([(365, 36.5, 0.1), (352, 35.2, 0.1)], now=37.3)
    DiLoCo._align_schedule(learner)
    assert learner.schedule_offset == 373
    due = {}
    for step in range(1, 101):
        learner.inner_step = step
        if due_now := DiLoCo.due_fragments(learner):
            due[step] = due_now
    # the swarm's fragment 1 falls due at its step 450, fragment 0 at 400 and 500: so do ours, 27 and 77 steps
    # from now (counting from our own step 0 it would be our steps 50 and 100, seconds away from theirs)
    assert due == {27: [0], 77: [1]}


def test_learners_that_start_together_keep_their_own_count() -> None:
    # starting together, the others have no measured step time yet (fewer than 3 steps): nothing to align to
    learner = stand_in([(1, 10.0, 0.0), (2, 10.1, 0.0)], now=10.2)
    DiLoCo._align_schedule(learner)
    assert learner.schedule_offset == 0
    learner.inner_step = 100
    assert DiLoCo.due_fragments(learner) == [0]  # our step 100: fragment 0's first round
