"""The inner schedule: warm-up + cosine by steps, and the time-budgeted variant the swarm uses."""

from __future__ import annotations

import math

import pytest

from p2p_diloco.inner import lr_at, schedule_step


def test_lr_warmup_then_cosine_golden() -> None:
    assert lr_at(0, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 100, 10, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 100, 10, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(55, 100, 10, 1.0, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(500, 100, 10, 1.0, 0.1) == pytest.approx(0.1)  # past the end: stays at the floor


def test_schedule_step_without_time_budget_is_the_step() -> None:
    for step in (0, 5, 50, 5000):
        assert schedule_step(step, 1000, 50, elapsed_s=999.0, budget_s=0.0) == step


def test_schedule_step_follows_whichever_budget_runs_out_first() -> None:
    # warm-up is always counted in steps, however much time has passed
    assert schedule_step(10, 1000, 50, elapsed_s=300.0, budget_s=400.0) == 10
    # a slow learner: half its time gone, few steps done -> the schedule is halfway through the decay
    assert schedule_step(100, 1050, 50, elapsed_s=200.0, budget_s=400.0) == 550
    # at the end of its time the decay is complete, whatever its speed
    assert schedule_step(120, 1050, 50, elapsed_s=400.0, budget_s=400.0) == 1050
    assert schedule_step(120, 1050, 50, elapsed_s=900.0, budget_s=400.0) == 1050
    # a fast learner that runs out of steps first keeps the step-based schedule
    assert schedule_step(900, 1050, 50, elapsed_s=100.0, budget_s=400.0) == 900


def test_schedule_step_is_monotone_in_time_and_steps() -> None:
    prev = -1
    for k in range(0, 41):
        at = schedule_step(60, 1000, 50, elapsed_s=10.0 * k, budget_s=400.0)
        assert at >= prev
        prev = at
    assert prev == 1000
