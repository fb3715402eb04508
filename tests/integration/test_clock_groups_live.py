"""Groups from the clock over hivemind (``averaging.matchmaking = "clock"``, docs/design.md "Rounds that cost their
bytes"): three learners on 127.0.0.1 meet in the group that the clock's round and their records name -- no
matchmaking, no window: the members fetch each other's offers over their own connections and run the all-reduce on
exactly that group. The same guarantees as the in-process tests (tests/unit/test_clock_groups.py), once over real
processes and sockets:

- rounds of three commit on every fragment, every member of a round holding the same anchor after it;
- a member killed with kill -9 does not show: the survivors' next rounds that name it fail for both alike ("incomplete
  group: 2 of 3 members showed"), none half-applied, until its record expires; then the two commit as a pair;
- the survivors end with identical anchors.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from procs import ProcGroup, start_bootstrap
from test_learner_swarm import START_ALLOWANCE_S, TINY, events, final_summary, print_discards, start_learner, \
    write_profile

from p2p_diloco.averaging.decisions import MISSING, NO_GROUP
from p2p_diloco.core.waiting import poll_until

pytestmark = pytest.mark.integration

TTL_S = 9.0
"""The records' lifetime (republished every third of it): a killed member leaves the others' views this long
after its last heartbeat."""
CLOCK = ("--set", "averaging.schedule=clock", "--set", "averaging.matchmaking=clock", "--set",
         "averaging.sync_period_s=4.0", "--set", "averaging.window_s=1.5", "--set", "averaging.window_max_s=2.0",
         "--set", f"averaging.record_ttl_s={TTL_S:g}", "--set", "inner.total_steps=300")
"""Tiny learners, a round of each fragment every 4 s (2 s apart), groups from the clock."""
TRAIN_S = 45.0
"""Seconds each learner trains: rounds of three, the kill, the rounds that fail until the record expires, pairs."""
FIRST_ROUNDS_DEADLINE_S = 120.0
"""Start-up, the wait for peers and two committed rounds of three for every learner, on a loaded machine."""


def committed(path: Path) -> list[dict[str, Any]]:
    return [e for e in events(path) if e["event"] == "round" and e["outcome"] == "committed"] if path.exists() else []


def test_groups_from_the_clock_commit_over_hivemind_and_a_killed_member_fails_them_alike(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, "paced")
    names = ("a", "b", "victim")
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY, *CLOCK)
        learners = {n: start_learner(procs, peers, n, tmp_path, "--profile", str(profile), "--shard", str(i),
                                     "--num-shards", "3", "--wait-peers", "3", "--linger", "10", "--steps", "100000",
                                     "--max-time", str(TRAIN_S + START_ALLOWANCE_S), *CLOCK, config=("--config", TINY))
                    for i, n in enumerate(names)}
        poll_until(lambda: all(sum(e["group_size"] == 3 for e in committed(tmp_path / f"{n}.jsonl")) >= 2
                               for n in names), FIRST_ROUNDS_DEADLINE_S, "two committed rounds of three each",
                   detail=learners["victim"].output)
        learners["victim"].kill_group(signal.SIGKILL)
        assert learners["victim"].wait_exit(30) == -signal.SIGKILL
        killed_at = time.time()  # DHT time, as the events' (loopback: the same clock)
        finals = {n: final_summary(learners[n]) for n in ("a", "b")}
        for n in ("a", "b"):
            assert learners[n].wait_exit(60) == 0, learners[n].output()

    victim_id = next(p for e in committed(tmp_path / "a.jsonl") for p in e["peers"]
                     if p not in (finals["a"]["peer_id"], finals["b"]["peer_id"]))
    reached = {f: max((e["version_after"] for e in committed(tmp_path / "victim.jsonl") if e["fragment"] == f),
                      default=0) for f in (0, 1)}
    for n, s in finals.items():
        log = events(tmp_path / f"{n}.jsonl")
        rounds = [e for e in log if e["event"] == "round"]
        print(f"\n{n}: committed {s['committed']} discarded {s['discarded']} resynced {s['resynced']} versions "
              f"{s['versions']}")
        print_discards(tmp_path / f"{n}.jsonl")
        assert not [e for e in rounds if e["reason"].startswith(NO_GROUP)], "a round looked for a group"
        three = [e for e in rounds if e["outcome"] == "committed" and e["group_size"] == 3]
        assert {e["fragment"] for e in three} == {0, 1}, three
        after = [e for e in rounds if e["time"] > killed_at]
        # the member that did not show failed the rounds that named it, for both survivors alike
        missing = [e for e in after if e["reason"] == f"{MISSING}: 2 of 3 members showed"]
        assert missing, [(e["fragment"], e["version"], e["reason"]) for e in after]  # the fault fired
        # no round with it was committed past what it applied before it died: nothing half-applied
        assert not [e for e in rounds if e["outcome"] == "committed" and victim_id in e["peers"]
                    and e["version"] >= reached[e["fragment"]]], (reached, rounds)
        pairs = [e for e in after if e["outcome"] == "committed" and e["group_size"] == 2]
        assert {e["fragment"] for e in pairs} == {0, 1}, [(e["fragment"], e["reason"]) for e in after]
    a, b = finals["a"], finals["b"]
    assert a["versions"] == b["versions"] and a["anchor_hashes"] == b["anchor_hashes"], (a, b)
    # the same round failed for both (never committed by one, discarded by the other)
    for e in committed(tmp_path / "a.jsonl"):
        if e["time"] > killed_at:
            assert (e["fragment"], e["version"]) in {(x["fragment"], x["version"]) for x in
                                                     committed(tmp_path / "b.jsonl")}, e


def test_a_member_whose_verdicts_do_not_arrive_commits_the_round_late(tmp_path: Path) -> None:
    """Verdicts inside the group: b drops the verdicts a sends it for a while (``blind@reading-verdicts``, b's
    averager), so a commits a round of fragment 0 with b's "ok" while b, silent-only at its deadline, withdraws and
    keeps the result; b then commits that round late -- a holds exactly its result -- with no download, and both end
    identical."""
    # a few rounds in, blind past the 3 s commit timeout but not into the next round (4 s later): a blind spell across
    # two rounds leaves b a version behind that no second peer vouched for -- in a swarm of two it stays behind
    spec = "blind@reading-verdicts:fragment=0:at=4:seconds=3.5"
    common = ("--profile", str(write_profile(tmp_path, "paced")), "--wait-peers", "2", "--linger", "10", "--steps",
              "100000", "--max-time", str(30 + START_ALLOWANCE_S), *CLOCK)
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY, *CLOCK)
        a = start_learner(procs, peers, "a", tmp_path, "--shard", "0", "--num-shards", "2", *common,
                          config=("--config", TINY))
        b = start_learner(procs, peers, "b", tmp_path, "--shard", "1", "--num-shards", "2", *common, "--fault", spec,
                          config=("--config", TINY))
        finals = {n: final_summary(p) for n, p in (("a", a), ("b", b))}
        for p in (a, b):
            assert p.wait_exit(60) == 0, p.output()
    assert any(f"FAULT fired: {spec}" in line for _, line in b.stderr), b.output()
    b_log = events(tmp_path / "b.jsonl")
    late = [e for e in b_log if e["event"] == "late_commit"]
    print(f"\nb's late commits: {late}")
    print_discards(tmp_path / "b.jsonl")
    assert late and all(e["fragment"] == 0 and e["version_after"] == e["version"] + 1 for e in late), late
    a_commits = {(e["version"], e["anchor_hash"]) for e in committed(tmp_path / "a.jsonl") if e["fragment"] == 0}
    assert {(e["version"], e["anchor_hash"]) for e in late} <= a_commits, (late, a_commits)
    assert finals["b"]["resynced"][0] == 0, finals["b"]  # committed late: no download
    assert finals["a"]["versions"] == finals["b"]["versions"], finals
    assert finals["a"]["anchor_hashes"] == finals["b"]["anchor_hashes"], finals
