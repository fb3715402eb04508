"""``scripts/wan/slowlink_metrics.py``: the slow-link bench's cases and figures, as pure functions of its inputs."""

from __future__ import annotations

import math
from typing import Any

import pytest

from scripts_loader import load_script

metrics = load_script("wan/slowlink_metrics.py", "slowlink_metrics")


def test_cases_parse_with_and_without_a_round_trip() -> None:
    cases = metrics.parse_cases("0.25:1000, 0.5:100:100")
    assert cases == [metrics.Case(0.25, 1000.0), metrics.Case(0.5, 100.0, 100.0)]
    assert [c.label for c in cases] == ["0.25mbit-q1000", "0.5mbit-q100-rtt100"]


@pytest.mark.parametrize("text", ["", "0.5", "0:100", "0.5:0", "0.5:100:-1", "a:b", "0.5:1:2:3"])
def test_a_bad_case_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="--cases"):
        metrics.parse_cases(text)


def test_pause_parses_and_is_bounded_by_the_hosts() -> None:
    assert metrics.parse_pause("3:40:60", hosts=4) == metrics.Pause(3, 40.0, 60.0)
    for bad in ("4:40:60", "1:40", "1:-1:60", "1:40:0", "x:1:1"):
        with pytest.raises(ValueError, match="--pause"):
            metrics.parse_pause(bad, hosts=4)


def test_comm_compute_is_link_time_over_the_period() -> None:
    one = metrics.comm_compute(1_000_000, "int4", 4, 0.5, 10.0)
    assert one > 0
    assert metrics.comm_compute(1_000_000, "int4", 4, 1.0, 10.0) == pytest.approx(one / 2)  # twice the rate
    assert metrics.comm_compute(1_000_000, "int4", 4, 0.5, 20.0) == pytest.approx(one / 2)  # twice the period
    assert math.isnan(metrics.comm_compute(1_000_000, "int4", 4, 0.5, 0.0))


def _final(committed: list[int], discarded: list[int], hashes: list[str], eval_loss: float = 3.0) -> dict[str, Any]:
    return {"committed": committed, "discarded": discarded, "anchor_hashes": hashes, "versions": committed,
            "sync_period_s": 12.0, "first_contribution_s": 15.0, "steps": 100, "tokens": 1000, "train_s": 20.0,
            "eval_loss_end": eval_loss}


def test_a_case_counts_rounds_anchors_downloads_and_replays() -> None:
    finals = [_final([3, 3], [1, 0], ["a", "b"], 3.0), _final([3, 2], [0, 0], ["a", "c"], 3.5)]
    events = [
        [{"event": "round", "outcome": "committed", "allreduce_s": 2.0, "time": 1.0}],
        [{"event": "resync", "outcome": "applied", "version_after": 3, "bytes": 500, "time": 50.0,
          "donor_failures": ["p1: timed out after 15 s", "p2: refused"]},
         {"event": "replay", "rounds": 2, "bytes": 100, "time": 60.0},
         {"event": "round", "outcome": "committed", "allreduce_s": 4.0, "time": 70.0}],
    ]
    pause = metrics.Pause(1, 10.0, 30.0)
    row = metrics.case_metrics(metrics.Case(0.5, 1000.0), "configs/demo.toml", [], finals, events, [10, 20],
                               pause, {"stopped": 20.0, "continued": 55.0})
    assert (row["committed"], row["discarded"], row["rounds"]) == (11, 1, 12)
    assert row["committed_share"] == pytest.approx(11 / 12)
    assert not row["anchors_identical"] and row["fragments_identical"] == 1
    assert (row["downloads"], row["downloads_applied"], row["download_timeouts"]) == (1, 1, 1)
    assert (row["replayed_rounds"], row["replay_bytes"], row["download_bytes"]) == (2, 100, 500)
    assert row["median_allreduce_s"] == 3.0 and row["sync_period_s"] == 12.0
    assert row["comm_compute"] > 0
    # the bound: 1.5 x max(H x 0.2 s a step, one sync at 0.5 Mbit/s), and the period against it
    link_s = row["comm_compute"] * 12.0
    assert row["sync_link_s"] == pytest.approx(link_s)
    assert row["period_bound_s"] == pytest.approx(1.5 * max(row["sync_every"] * 0.2, link_s))
    assert row["period_over_bound"] == pytest.approx(12.0 / row["period_bound_s"])
    assert row["eval_loss_end"] == [3.0, 3.5]
    # only what came after the pause ended counts for the paused learner: the resync at 50 s was before
    assert row["pause"]["replayed_rounds"] == 2 and row["pause"]["downloads"] == 0
    assert row["pause"]["full_state_bytes"] == 8 * row["numel"]
    row["discard_reasons"] = {"could not find a group": 1}
    row["end_after_limit_s"] = [12.4, 47.6]
    page = metrics.table({"cases": [row], "code": None})
    assert f"| {12.0 / row['period_bound_s']:.2f} |" in page and "| 3.250 | 48 |" in page
    fast = {**row, "rate_mbit": 1000.0, "eval_loss_end": [2.5, 2.5]}
    assert "(1000 Mbit/s, 2.500): 0.5 Mbit/s +30.0%" in metrics.table({"cases": [row, fast], "code": None})
    assert "11/12 (92%)" in page and "differ (1/2)" in page and "1 × could not find a group" in page
