"""The benchmark harness's shared parts beside ``_bench.py``: a swarm's rounds in a window (``_swarm.py``), RPC
tallies by purpose (``_tally.py``), which sizes fit (``bench_control_sizes.py``) and how a run names its code."""

from __future__ import annotations

from typing import Any

import pytest
from scripts_loader import load_script

from p2p_diloco.core.events import RoundEvent

bench = load_script("_bench.py", "_bench")
swarm = load_script("_swarm.py", "_swarm")
tally = load_script("_tally.py", "_tally")
sizes = load_script("bench_control_sizes.py", "bench_control_sizes")


def _round(at: float, step: int, outcome: str, reason: str = "ok", group: int = 3) -> RoundEvent:
    fields: dict[str, Any] = dict(
        fragment=0, version=1, group_size=group, peers=(), own_share=0.5, weights=(), bytes_sent=0, bytes_received=0,
        duration_s=1.0, arrival_spread_s=None, window_s=1.0, allreduce_s=None, rtt_s=None, timeouts=None,
        version_after=2, group_distance=None, anchor_hash="", tokens_sent=0, steps_sent=0)
    return RoundEvent(time=at, step=step, outcome=outcome, reason=reason, **fields)


def test_rounds_in_a_window_count_outcomes_masked_reasons_groups_and_step_time() -> None:
    peer = "QmVTdVdsYwZniit1hWYVQE43Xohu6JWmmC3CsTMKgrM7bB"
    a = [_round(5.0, 1, "committed"), _round(10.0, 10, "committed", group=4),
         _round(20.0, 20, "discarded", f"member {peer} reported 3 of 4")]
    b = [_round(12.0, 5, "discarded", f"member {peer} reported 2 of 4"), _round(30.0, 25, "committed", group=2),
         _round(99.0, 90, "committed")]  # after the window: not counted
    r = swarm.rounds_in([a, b], 10.0, 30.0, reason_chars=70)
    assert (r["committed"], r["discarded"]) == (2, 2)
    assert r["discard_reasons"] == [["member <peer> reported N of N", 2]]
    assert r["median_group_size"] == 3
    assert r["median_step_s"] == pytest.approx(0.95)  # a: 10 steps in 10 s, b: 20 steps in 18 s
    assert swarm.rounds_in([a], 50.0, 60.0, 70) == {"committed": 0, "discarded": 0, "discard_reasons": [],
                                                    "median_group_size": None, "median_step_s": None}


def test_tallies_difference_sum_and_split_vouches_out_of_matchmaking() -> None:
    start = {"call:rpc_store store x_frag0_anchor_v3": [1, 10, 5]}
    end = {"call:rpc_store store x_frag0_anchor_v3": [3, 30, 15], "stream_send AveragingData": [2, 1000, 0]}
    diff = tally.difference(end, start)
    assert diff == {"call:rpc_store store x_frag0_anchor_v3": [2, 20, 10], "stream_send AveragingData": [2, 1000, 0]}
    assert tally.add([diff, diff])["stream_send AveragingData"] == [4, 2000, 0]
    purposes = tally.by_purpose(diff)
    assert purposes[tally.VOUCHES] == {"calls": 2, "bytes": 30}
    assert purposes[tally.PAYLOAD]["bytes"] == 1000
    assert tally.control_bytes(diff) == 30


def test_a_size_that_does_not_fit_is_replaced_by_the_largest_candidate_that_does() -> None:
    mib, gib = 2**20, 2**30
    assert sizes.fits(64, None, gib) is None  # nothing measured yet: try it
    assert sizes.fits(16, 100 * mib, 2 * gib) is None
    assert "needs ~7.8 GiB" in (sizes.fits(64, 100 * mib, 2 * gib) or "")
    assert sizes.replacement(64, 100 * mib, 4 * gib, [4, 16]) == 32
    assert sizes.replacement(64, 100 * mib, 2 * gib, [4, 16]) is None  # 32 does not fit either
    assert sizes.memory_budget(3 * gib) == gib  # the reserve kept free
    assert sizes.memory_budget(100 * gib) == sizes.MEMORY_BUDGET_BYTES


def test_a_runs_code_is_named_by_label_commit_changes_and_digest() -> None:
    ident = bench.code_identity("baseline", timeout_s=30.0)
    assert ident["label"] == "baseline" and len(ident["sources_sha256"]) == 16
    assert ident["sources_sha256"] == bench.sources_digest()
    line = bench.code_line({"label": "x", "commit": "abc1234", "changed": ["a.py"], "sources_sha256": "f" * 16})
    assert line == f"x; commit abc1234 with 1 changed files in p2p_diloco/ (a.py); sources digest {'f' * 16}"
    assert bench.code_line({"sources_sha256": "0" * 16}) == f"sources digest {'0' * 16}"
