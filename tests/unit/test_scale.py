"""The 1,000-learner simulation of bounded groups (p2p_diloco/sim/scale.py) and scripts/bench_scale.py --quick."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.sim.goodput import Failures
from p2p_diloco.sim.scale import ScaleParams, simulate

ROOT = Path(__file__).resolve().parents[2]
HEAVY = Failures(mtbf_s=3600.0, repair_s=300.0)


def test_one_group_of_everyone_keeps_anchors_identical_and_every_contribution() -> None:
    r = simulate(ScaleParams(learners=64, group_size=0, rounds=30), None)
    assert r["distance_noise_max"] < 1e-9 and r["global_error"] < 1e-9
    assert r["reach_weight"] == pytest.approx(1.0) and r["reach_kept"] == pytest.approx(1.0)


def test_without_failures_groups_lose_nothing_and_stay_within_the_bound_on_a_full_grid() -> None:
    # 256 = 16 x 16: a full grid; every round commits, so the sum of the anchors keeps every update.
    r = simulate(ScaleParams(learners=256, group_size=16, rounds=40), None)
    assert r["sides"] == [16, 16] and r["discarded_groups"] == 0.0
    assert r["reach_weight"] == pytest.approx(1.0) and r["reach_kept"] == pytest.approx(1.0)
    assert r["global_error"] < 1e-9  # the mean anchor is exactly one group's result
    assert 0.5 < r["distance_over_bound_max"] <= 1.03  # the bound is on the expectation: one draw fluctuates
    assert r["mix_rounds_p95"] <= r["mixing_rounds_bound"]


def test_without_noise_a_full_grid_reaches_consensus() -> None:
    # Equal updates everywhere: nothing makes anchors differ, the distance stays at rounding.
    r = simulate(ScaleParams(learners=64, group_size=8, rounds=20, noise=0.0), None)
    assert r["distance_rel_max"] < 1e-12


def test_heavy_failures_keep_every_committed_contribution_present() -> None:
    r = simulate(ScaleParams(learners=200, group_size=16, rounds=60), HEAVY)
    assert r["learner_failures"] > 0 and r["lost_with_failures"] > 0
    assert r["present"] == 1.0
    assert 0.98 < r["reach_kept"] <= 1.0 and 0.97 < r["reach_weight"] < 1.03
    plain = simulate(ScaleParams(learners=200, group_size=16, rounds=60, heirs=False), HEAVY)
    assert plain["reach_kept"] < r["reach_kept"]  # heirs keep what a dying holder took with it


def test_seeded_runs_repeat() -> None:
    a = simulate(ScaleParams(learners=100, group_size=8, rounds=15), HEAVY)
    b = simulate(ScaleParams(learners=100, group_size=8, rounds=15), HEAVY)
    assert a == b


def test_bench_scale_quick_writes_its_results(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    payload = json.loads((tmp_path / "scale.json").read_text())
    for key in ("command", "quick", "learners", "rounds", "seeds", "failures", "summary", "acceptance", "runs"):
        assert key in payload, key
    assert payload["quick"] is True and payload["learners"] == 200
    for g in (8, 16, 32):
        s = payload["summary"][f"{g}/heavy"]
        for key in ("reach_weight", "reach_kept", "distance_rel_max", "bound_noise_max", "mix_rounds_median"):
            assert key in s, key
    assert set(payload["acceptance"]) >= {"reach_weight_ok", "reach_kept_ok", "bound_ok"}
    assert "| G | failures |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "scale.png").stat().st_size > 0
