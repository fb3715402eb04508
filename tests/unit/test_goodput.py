"""The goodput model (pure, seeded): fixed costs, hand-computed failures, a brute-force reference, scaling."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from p2p_diloco.sim.goodput import (
    Breakdown, Calibration, DPParams, Failures, GoodputError, P2PParams, Timelines, simulate_dp, simulate_p2p,
    unit_timelines,
)
from p2p_diloco.sim.calibration import calibration_from_results

ROOT = Path(__file__).resolve().parents[2]
# Round numbers for hand computation: boundaries every 20 s (period 40 s, 2 fragments), rounds of 3 s,
# a unit's own restart 8 + 2 = 10 s.
CAL = Calibration(step_s=3.0, round_period_s=40.0, fragments=2, round_s=3.0, startup_s=8.0, state_download_s=2.0,
                  detect_s=5.0, reconfigure_s=2.0)
# Roughly this machine's calibration, for the scaling tests.
REAL = Calibration(step_s=1.27, round_period_s=30.9, fragments=4, round_s=2.9, startup_s=27.2, state_download_s=3.4,
                   detect_s=5.0, reconfigure_s=2.9, blocked_share=0.003)


def _sums_to_allocated(b: Breakdown) -> None:
    total = b.useful_s + b.down_s + b.restart_s + b.lost_s + b.stalled_s + b.blocked_s
    assert total == pytest.approx(b.allocated_s, rel=1e-9)
    assert min(b.useful_s, b.down_s, b.restart_s, b.lost_s, b.stalled_s, b.blocked_s) >= 0


def test_without_failures_goodput_is_one_less_the_fixed_costs() -> None:
    tl = unit_timelines(5, Failures(mtbf_s=math.inf, repair_s=60.0), horizon_s=1000.0, seed=0)
    assert tl.failures == 0 and tl.unit.size == 5
    blocked = Calibration(**{**CAL.__dict__, "blocked_share": 0.01})
    assert simulate_p2p(tl, blocked).goodput == pytest.approx(0.99)
    assert simulate_dp(tl, CAL, DPParams("in-memory")).goodput == pytest.approx(1.0)
    # Checkpoints every 90 s of training, 10 s of stall each: saves end at 100, 200, ..., 1000.
    dp = simulate_dp(tl, CAL, DPParams("restart", checkpoint_interval_s=90.0, checkpoint_save_s=10.0))
    assert dp.goodput == pytest.approx(0.9) and dp.stalled_s == pytest.approx(5 * 10 * 10.0)
    for b in (simulate_p2p(tl, blocked), dp):
        _sums_to_allocated(b)


def test_one_failure_costs_exactly_what_the_model_says() -> None:
    # Unit 0 dies at 100 s, is repaired at 150 s; unit 1 never fails; 1000 s.
    tl = Timelines.from_intervals(2, 1000.0, [(0, 0.0, 100.0), (0, 150.0, math.inf), (1, 0.0, math.inf)])
    ours = simulate_p2p(tl, CAL)
    # Down 50; restart 10 (training again at 160); lost: fragment 0 last committed at 80 (boundaries 40, 80),
    # fragment 1 at 60 (20, 60; the one at 100 is not before the failure): (20 + 40) / 2 = 30.
    # Unit 1 alone from 100 to 160 loses nothing: its rounds wait for a group (min 2) and go out later.
    assert (ours.down_s, ours.restart_s, ours.lost_s, ours.stalled_s) == pytest.approx((50.0, 10.0, 30.0, 0.0))
    assert ours.goodput == pytest.approx(1910 / 2000)
    # Pending at 1000 s, per unit: fragment 1 since 980, fragment 0 since 960: (20 + 40) / 2.
    assert ours.pending_s == pytest.approx(60.0)

    restart = simulate_dp(tl, CAL, DPParams("restart", checkpoint_interval_s=30.0))
    # Checkpoints at 30, 60, 90; the failure rolls back 2 units x 10 s; unit 1 stalls 5 + 10 s (until 115);
    # unit 0's process is up at 158, then both stall 10 s for the rejoin's restart (to 168).
    assert (restart.down_s, restart.restart_s, restart.lost_s, restart.stalled_s) == pytest.approx((50.0, 8.0, 20.0, 35.0))
    assert restart.goodput == pytest.approx(1887 / 2000) and restart.reconfigurations == 2

    memory = simulate_dp(tl, CAL, DPParams("in-memory"))
    # The step in flight (100 mod 3 = 1 s) of both units is lost; unit 1 stalls 5 + 2 s; unit 0 is ready at
    # 160 (own restart 10 s), then both stall 2 s.
    assert (memory.down_s, memory.restart_s, memory.lost_s, memory.stalled_s) == pytest.approx((50.0, 10.0, 2.0, 11.0))
    assert memory.goodput == pytest.approx(1927 / 2000)
    for b in (ours, restart, memory):
        _sums_to_allocated(b)


def test_a_member_dying_mid_round_discards_the_round_but_survivors_lose_nothing() -> None:
    # Unit 2 dies at 41 s, inside fragment 0's round at 40 s (3 s long): that round is discarded for all.
    tl = Timelines.from_intervals(3, 200.0, [(0, 0.0, math.inf), (1, 0.0, math.inf), (2, 0.0, 41.0)])
    b = simulate_p2p(tl, CAL)
    # Unit 2 committed fragment 1 at 20, fragment 0 never (the round at 40 died with it): (21 + 41) / 2.
    assert b.lost_s == pytest.approx(31.0)
    assert b.useful_s == pytest.approx(200 + 200 + 41 - 31)
    assert 0 < b.discarded_share < 1


def test_a_unit_failing_before_its_restart_completes_trains_nothing() -> None:
    tl = Timelines.from_intervals(2, 500.0, [(0, 0.0, 100.0), (0, 150.0, 155.0), (0, 200.0, math.inf),
                                             (1, 0.0, math.inf)])
    b = simulate_p2p(tl, CAL)
    assert b.restart_s == pytest.approx(5.0 + 10.0) and b.down_s == pytest.approx(50.0 + 45.0)
    assert b.lost_s == pytest.approx(30.0)  # only the first failure loses work
    _sums_to_allocated(b)


def _reference_p2p(tl: Timelines, cal: Calibration, min_group: int) -> tuple[float, float]:
    """Boundary by boundary, one group of every live unit: (lost, pending) in unit-seconds."""
    T, F, dB = tl.horizon_s, cal.fragments, cal.boundary_s
    rows = []
    for _u, up, fail, first in zip(tl.unit, tl.up_s, tl.fail_s, tl.first):
        start = up if first else min(up + cal.rejoin_s, fail, T)
        if start < min(fail, T):
            rows.append([float(start), float(fail), [float(start)] * F])
    m = 1
    while m * dB < T:
        b = m * dB
        members = [r for r in rows if r[0] <= b < r[1]]
        ok = len(members) >= min_group and not any(b < r[1] <= b + cal.round_s and r[1] < T for r in members)
        if ok:
            for r in members:
                r[2][m % F] = b
        m += 1
    lost = sum((r[1] - c) / F for r in rows if r[1] < T for c in r[2])
    pending = sum((T - c) / F for r in rows if r[1] >= T for c in r[2])
    return lost, pending


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_model_matches_a_boundary_by_boundary_reference(seed: int) -> None:
    cal = Calibration(**{**CAL.__dict__, "fragments": 4, "round_s": 12.0})  # a round spans the next boundary (10 s)
    tl = unit_timelines(6, Failures(mtbf_s=300.0, repair_s=40.0, repair="exponential"), horizon_s=3000.0, seed=seed)
    assert tl.failures > 20
    for min_group in (1, 2, 4):
        b = simulate_p2p(tl, cal, P2PParams(min_group_size=min_group))
        lost, pending = _reference_p2p(tl, cal, min_group)
        assert b.lost_s == pytest.approx(lost) and b.pending_s == pytest.approx(pending)
        _sums_to_allocated(b)


def test_seeded_and_deterministic() -> None:
    f = Failures(mtbf_s=600.0, repair_s=60.0, repair="exponential")
    a, b, c = (unit_timelines(20, f, 20_000.0, s) for s in (7, 7, 8))
    assert np.array_equal(a.fail_s, b.fail_s) and not np.array_equal(a.fail_s[:20], c.fail_s[:20])
    capped = P2PParams(group_size=4)
    assert simulate_p2p(a, REAL, capped, seed=1) == simulate_p2p(b, REAL, capped, seed=1)
    assert simulate_dp(a, REAL, DPParams("restart")) == simulate_dp(b, REAL, DPParams("restart"))
    assert simulate_dp(a, REAL, DPParams("restart")) != simulate_dp(c, REAL, DPParams("restart"))


def test_data_parallel_degrades_with_units_ours_does_not_collapse() -> None:
    f = Failures(mtbf_s=3600.0, repair_s=300.0)
    ours, restart, memory = {}, {}, {}
    for n in (2, 16, 128):
        tl = unit_timelines(n, f, 12 * 3600.0, seed=0)
        ours[n] = simulate_p2p(tl, REAL).goodput
        restart[n] = simulate_dp(tl, REAL, DPParams("restart")).goodput
        memory[n] = simulate_dp(tl, REAL, DPParams("in-memory")).goodput
    assert restart[2] > restart[16] > restart[128] and memory[2] > memory[16] > memory[128]
    up_share = f.mtbf_s / (f.mtbf_s + f.repair_s)  # 92.3%: the ceiling for any protocol
    assert all(g > up_share - 0.03 for g in ours.values())
    assert ours[128] > memory[128] + 0.2 and ours[128] > restart[128] + 0.5


def test_smaller_groups_discard_fewer_rounds_at_scale() -> None:
    tl = unit_timelines(300, Failures(mtbf_s=1800.0, repair_s=300.0), 4 * 3600.0, seed=3)
    one, capped = simulate_p2p(tl, REAL), simulate_p2p(tl, REAL, P2PParams(group_size=8), seed=0)
    assert capped.discarded_share < one.discarded_share / 5
    assert capped.lost_s < one.lost_s


@pytest.mark.parametrize("make, name", [
    (lambda: Failures(mtbf_s=0.0, repair_s=1.0), "mtbf_s"),
    (lambda: Failures(mtbf_s=1.0, repair_s=1.0, repair="weibull"), "repair"),
    (lambda: Calibration(**{**CAL.__dict__, "fragments": 0}), "fragments"),
    (lambda: Calibration(**{**CAL.__dict__, "round_s": math.nan}), "round_s"),
    (lambda: DPParams(variant="sync"), "variant"),
    (lambda: P2PParams(group_size=1), "group_size"),
    (lambda: unit_timelines(0, Failures(1.0, 1.0), 10.0, 0), "units"),
])
def test_bad_parameters_fail_naming_the_field(make: Callable[[], object], name: str) -> None:
    with pytest.raises(GoodputError, match=f"^{name}: "):
        make()


def test_calibration_reads_the_results_and_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(GoodputError, match="missing result files .*learners.json"):
        calibration_from_results(tmp_path, ROOT / "configs" / "demo.toml")
    final = {"train_s": 100.0, "steps": 80, "sync_period_s": 31.0, "blocked_share": 0.004, "window_s": 1.5}
    files = {
        "learners/learners.json": {"swarm": {"finals": {"a": final, "b": {**final, "steps": 100}}}},
        "chaos/chaos.json": {"chaos": {"events": [{"event": "up", "startup_s": s} for s in (20.0, 30.0, 40.0)]}},
        "rejoin/rejoin.json": {"newcomers": [{"downloads": [{"duration_s": 1.0}, {"duration_s": 2.0}]}]},
    }
    for rel, payload in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(payload))
    cal, sources = calibration_from_results(tmp_path, ROOT / "configs" / "demo.toml")
    assert cal.step_s == pytest.approx(1.125) and cal.round_period_s == 31.0 and cal.fragments == 4
    assert cal.startup_s == 30.0 and cal.state_download_s == 3.0 and cal.blocked_share == 0.004
    assert cal.round_s == 3.0 and "no round logs" in sources["round_s"]  # 2 x the median window
    assert cal.detect_s == 5.0 and set(sources) == set(cal.__dict__)
