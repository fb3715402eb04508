"""The mixed-hardware benchmark's analysis (pure): the swarm's eval curve, and the comparison at equal tokens."""

from __future__ import annotations

from typing import Any

import pytest
from scripts_loader import load_script

bench_hetero = load_script("bench_hetero.py", "bench_hetero")


def _final(tokens: int, utilization: float, end: float, blocked: float = 0.001) -> dict[str, Any]:
    return {"steps": tokens // 2048, "tokens": tokens, "train_s": 300.0, "utilization": utilization,
            "blocked_share": blocked, "committed": [5, 5], "discarded": [1, 0], "eval_loss_start": 5.3,
            "eval_loss_end": end, "anchor_hashes": ["a", "b"]}


def _run(profiles: tuple[str, ...], tokens: list[int], utilization: list[float], end: float,
         evals: list[tuple[float, float]]) -> dict[str, Any]:
    finals = {f"l{i}": _final(t, u, end) for i, (t, u) in enumerate(zip(tokens, utilization))}
    events = [{"event": "eval", "train_s": s, "eval_loss": loss} for s, loss in evals]
    return bench_hetero.summarize(profiles, finals, events)


def test_the_swarm_curve_maps_training_time_to_swarm_tokens() -> None:
    homo = _run(("fast",) * 4, [300_000] * 4, [0.99] * 4, 2.2, [(150.0, 2.5), (300.0, 2.21)])
    assert homo["tokens"] == 1_200_000
    assert homo["curve"] == [(0.0, 5.3), (600_000.0, 2.5), (1_200_000.0, 2.2)]  # the whole-set final eval at the end
    assert homo["anchors_identical"]


def test_mixed_is_compared_with_the_homogeneous_swarm_at_the_mixed_swarms_tokens() -> None:
    homo = _run(("fast",) * 4, [300_000] * 4, [0.99] * 4, 2.2, [(150.0, 2.6)])
    mixed = _run(bench_hetero.RUNS["mixed"], [300_000, 150_000, 300_000, 150_000], [0.995, 0.5, 0.97, 0.5], 2.44, [])
    c = bench_hetero.compare(homo, mixed)
    assert c["tokens"] == 900_000
    assert c["homogeneous_at_tokens"] == pytest.approx(2.4)  # halfway between 2.6 at 0.6M and 2.2 at 1.2M
    assert c["gap"] == pytest.approx(2.44 / 2.4 - 1)
    # idle counts the fast learners only: a half-speed learner spends half its time waiting by design
    assert c["fast_max_idle_share"] == pytest.approx(0.03)
    md = bench_hetero.markdown({"config": "configs/demo.toml", "minutes": 5, "runs": {"homogeneous": homo,
                                                                                     "mixed": mixed},
                                "comparison": c})
    assert "+1.67%" in md and "3.00%" in md


def test_mixed_beyond_the_homogeneous_curve_is_not_compared() -> None:
    homo = _run(("fast",) * 4, [100_000] * 4, [0.99] * 4, 2.5, [])
    mixed = _run(bench_hetero.RUNS["mixed"], [300_000] * 4, [0.99] * 4, 2.2, [])
    c = bench_hetero.compare(homo, mixed)
    assert c["homogeneous_at_tokens"] is None and c["gap"] is None
    assert "not known" in bench_hetero.markdown({"config": "c.toml", "minutes": 5, "comparison": c,
                                                 "runs": {"homogeneous": homo, "mixed": mixed}})
