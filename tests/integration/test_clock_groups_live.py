"""Groups from the clock over hivemind (``averaging.matchmaking = "clock"``, docs/design.md "Rounds that cost their
bytes"): three learners on 127.0.0.1 meet in the group that the clock's round and their records name -- no
matchmaking, no window: the members fetch each other's offers over their own connections and run the all-reduce on
exactly that group. The same guarantees as the in-process tests (tests/unit/test_clock_groups.py), once over real
processes and sockets:

- rounds of three commit on every fragment, every member of a round holding the same anchor after it;
- a member killed with kill -9 does not show: the survivors' next rounds that name it go on without it (two of three
  are more than half: one more exchange of offers) and commit as a pair, the same round for both, none half-applied;
  once its record expires their groups no longer name it;
- the survivors end with identical anchors;
- (two averagers) a member whose verdicts do not arrive withdraws its "ok" and keeps the round's result, which the
  others committed.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from procs import HEAVY, ProcGroup, start_bootstrap
from test_learner_swarm import START_ALLOWANCE_S, TINY, events, final_summary, print_discards, start_learner, \
    write_profile

from p2p_diloco.averaging.decisions import MISSING, NO_GROUP
from p2p_diloco.core.config import load_config
from p2p_diloco.core.waiting import poll_until

pytestmark = pytest.mark.integration

TTL_S = 9.0
"""The records' lifetime (republished every third of it): a killed member leaves the others' views this long
after its last heartbeat."""
CLOCK = ("--set", "averaging.schedule=clock", "--set", "averaging.matchmaking=clock", "--set",
         "averaging.sync_period_s=4.0", "--set", "averaging.window_s=1.5", "--set", "averaging.window_max_s=2.0",
         "--set", f"averaging.record_ttl_s={TTL_S:g}", "--set", "inner.total_steps=300")
"""Tiny learners, a round of each fragment every 4 s (2 s apart), groups from the clock."""
TRAIN_S = 30.0
"""Seconds each learner trains: rounds of three, the kill, pairs without the victim until its record expires, pairs."""
FIRST_ROUNDS_DEADLINE_S = 120.0
"""Start-up, the wait for peers and two committed rounds of three for every learner, on a loaded machine."""


def committed(path: Path) -> list[dict[str, Any]]:
    return [e for e in events(path) if e["event"] == "round" and e["outcome"] == "committed"] if path.exists() else []


@HEAVY
def test_groups_from_the_clock_commit_over_hivemind_and_go_on_without_a_killed_member(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, "paced")
    names = ("a", "b", "victim")
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY, *CLOCK)
        learners = {n: start_learner(procs, peers, n, tmp_path, "--profile", str(profile), "--shard", str(i),
                                     "--num-shards", "3", "--wait-peers", "3", "--linger", "10", "--steps", "100000",
                                     "--max-time", str(TRAIN_S + START_ALLOWANCE_S), *CLOCK, config=("--config", TINY))
                    for i, n in enumerate(names)}
        # a round of three committed on each fragment (what is asserted below: one fragment's first round may fail
        # and commit at its next boundary; CI on a01153b killed the member after two rounds of fragment 1)
        poll_until(lambda: all({e["fragment"] for e in committed(tmp_path / f"{n}.jsonl") if e["group_size"] == 3}
                               == {0, 1} for n in names), FIRST_ROUNDS_DEADLINE_S,
                   "a committed round of three on each fragment", detail=learners["victim"].output)
        killed_at = time.time()  # DHT time, as the events' (loopback: the same clock); before the kill: CI on 8de87f9
        learners["victim"].kill_group(signal.SIGKILL)  # recorded it after the wait for the exit, by when the rounds
        assert learners["victim"].wait_exit(30) == -signal.SIGKILL  # that went on without it had ended
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
        # each member's wait for the group's last hand-off is part of its round, at most the arrival spread
        assert all(0 <= e["waited_s"] <= min(e["arrival_spread_s"], e["duration_s"]) + 1e-3 for e in three), three
        # ... and its parts are timed: the setup before the step, the verdicts after the all-reduce
        assert all(0 <= e["setup_s"] and 0 <= e["verdicts_s"] and e["setup_s"] + e["allreduce_s"] + e["verdicts_s"]
                   <= e["duration_s"] + 1e-3 for e in three), three
        after = [e for e in rounds if e["time"] > killed_at]
        # the rounds that named the member that did not show went on without it
        without = [e for e in after if e["outcome"] == "committed" and e["absent"] == 1 and e["group_size"] == 2]
        assert without, [(e["fragment"], e["version"], e["reason"], e["absent"]) for e in after]  # the fault fired
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


VERDICT_NAMES = tuple(f"blocks.{i}.fc.weight" for i in range(4))
VERDICT_SHAPES = {n: torch.Size([32, 16]) for n in VERDICT_NAMES}
VERDICT_CFG = load_config(None, ["run.run_id=verdicts", "model.n_layer=2", "outer.fragments=2", "outer.merge=\"mean\"",
                                 "outer.codec=\"fp32\"", "averaging.window_s=1.5", "averaging.commit_timeout_s=3.0",
                                 "averaging.next_chunk_timeout_s=20.0", "averaging.allreduce_timeout_s=60.0"])
BLIND_S = 4.0
"""How long b's averager drops the verdicts sent to it: past its 3 s commit timeout."""
SENDER_TIMEOUT_S = 20.0
"""VERDICT_CFG's: how long a reducer waits for a silent sender's parts (a round that waits for it takes this long)."""


def test_a_member_whose_verdicts_or_offer_do_not_arrive(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Verdicts inside the group, on two real averagers (DHTs and averager processes on 127.0.0.1): b's averager
    drops the verdicts sent to it (``blind@reading-verdicts``), so a commits the round with b's "ok" while b, silent
    only at its deadline, withdraws its "ok" and keeps the round's result -- exactly a's -- as its pending round;
    the next round commits on both. (That the engine then commits the kept result late, with no download, is
    tests/unit/test_clock_groups.py's, on the same host outcome.) a leads every round here (the group ids are
    chosen so). Then b's offer does not reach a (``blind@serving-offers``): a decides that 1 of 2 members showed,
    and b fails the round on that decision -- both alike, well within the sender timeout -- and the round after
    commits on both. Then b skips a boundary and says so (``decline_round``): a's round there fails as "1 of 2
    members showed (1 declined)" -- told, not timed out -- and the round after commits on both."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.averaging.faulty import FaultyAveragerHost
    from p2p_diloco.averaging.fixed_groups import FixedGroup
    from p2p_diloco.averaging.group_leader import leader_of
    from p2p_diloco.averaging.host import FragmentAveragerHost, decline_round, leave_rounds
    from p2p_diloco.averaging.plans import RoundPlan
    from p2p_diloco.core import faults
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.net.keys import load_or_create_identity
    from p2p_diloco.net.membership import SwarmOptions, start_dht, visible_addresses
    from p2p_diloco.sync.fragment import Contribution

    fault = faults.parse_fault(f"blind@reading-verdicts:fragment=0:at=1:seconds={BLIND_S:g}")
    offers = faults.parse_fault("blind@serving-offers:fragment=0:at=3:seconds=0.5")  # a asks once a round: the 3rd
    faults.arm([fault, offers])  # before b's averager is forked: it inherits the armed faults
    dhts: list[Any] = []
    hosts: list[Any] = []
    try:
        for i, host_class in enumerate((FragmentAveragerHost, FaultyAveragerHost)):
            identity = load_or_create_identity(tmp_path / f"peer{i}.id")
            initial = parse_initial_peers(visible_addresses(dhts[0])[:1]) if dhts else ()
            dhts.append(start_dht(SwarmOptions(initial_peers=initial, identity=identity, check_identity_free=False),
                                  VERDICT_CFG.run.run_id, private_key=identity.private_key()))
            hosts.append(host_class(VERDICT_CFG, 0, VERDICT_NAMES, VERDICT_SHAPES, dhts[-1], identity.private_key()))
        members = tuple(sorted(d.peer_id.to_base58() for d in dhts))
        a_id = dhts[0].peer_id.to_base58()

        def led_by_a(name: str) -> str:  # a group id whose leader is a: b serves one offer request a round
            return next(f"{name}.{k}" for k in range(1000)
                        if leader_of(FixedGroup(f"{name}.{k}".encode(), members, 0.0, 1.0)) == a_id)

        def round_of(name: str, a_late_s: float = 0.0) -> list[Any]:
            """The round of group ``name`` on both; a's step meets it ``a_late_s`` after b's."""
            group_id = led_by_a(name)
            start = get_dht_time() + VERDICT_CFG.averaging.window_s
            futures: dict[int, Any] = {}
            for i in (1, 0):
                time.sleep(a_late_s if i == 0 else 0.0)
                futures[i] = hosts[i].start_round(
                    Contribution(fragment=0, version=0, anchor_hash="0" * 16, tokens=100 * (i + 1), steps=10,
                                 weight=100.0 * (i + 1), norms={},
                                 tensors={n: torch.full(VERDICT_SHAPES[n], float(i)) for n in VERDICT_NAMES}),
                    RoundPlan(start, VERDICT_CFG.averaging.window_s, due=get_dht_time(), group_id=group_id,
                              members=members))
            return [futures[i].result(timeout=60) for i in (0, 1)]

        a, b = round_of("verdicts-1")
        print(f"\nround 1: a {a.reason!r}, b {b.reason!r}")
        assert a.committed and a.merged is not None, a.reason
        assert not b.committed and "no verdict from 1 of 2 members within" in b.reason, b.reason
        assert b.pending is not None and all(torch.equal(b.pending[n], a.merged[n]) for n in VERDICT_NAMES)
        time.sleep(BLIND_S)  # the blind spell ends
        # b's request for a's decision comes before a's own step meets the group (a races that way on a busy machine)
        again = round_of("verdicts-2", a_late_s=0.5)
        assert all(o.committed for o in again), [o.reason for o in again]
        # each member's verdict went out from its averager process as the all-reduce ended, and was the host's --
        # the leader's too, whose decision was started by b's request (the group it names carries no verdict rule)
        assert [h.averager.early_verdicts.value for h in hosts] == [2, 2], [h.averager.early_verdicts.value for h in hosts]
        a, b = round_of("offers-3")
        print(f"round 3: a {a.reason!r} in {a.duration_s:.1f} s, b {b.reason!r} in {b.duration_s:.1f} s")
        assert a.reason == b.reason == f"{MISSING}: 1 of 2 members showed", (a.reason, b.reason)  # one decision
        assert b.duration_s < SENDER_TIMEOUT_S / 2, (b.reason, b.duration_s)
        time.sleep(1.0)  # the blind spell ends
        assert all(o.committed for o in round_of("offers-4")), "the round after did not commit"
        # b skips the next boundary and says so: a hears it at once, instead of waiting out b's offer
        boundary_ms = round((get_dht_time() + 1.0) * 1000)
        decline_round(hosts[1], boundary_ms)
        start = get_dht_time() + VERDICT_CFG.averaging.window_s
        c = Contribution(fragment=0, version=0, anchor_hash="0" * 16, tokens=100, steps=10, weight=100.0, norms={},
                         tensors={n: torch.zeros(VERDICT_SHAPES[n]) for n in VERDICT_NAMES})
        alone = hosts[0].start_round(c, RoundPlan(start, VERDICT_CFG.averaging.window_s, due=get_dht_time(),
                                                  group_id=led_by_a("declined-5"), members=members,
                                                  boundary_ms=boundary_ms))
        a = alone.result(timeout=60)
        print(f"round 5: a {a.reason!r} in {a.duration_s:.1f} s")
        assert a.reason == f"{MISSING}: 1 of 2 members showed (1 declined)", a.reason
        assert all(o.committed for o in round_of("offers-6")), "the round after the declined one did not commit"
        # b is done for good (its final rounds are over): a hears so at once, and b leaves the majority too -- of a
        # pair, a alone stays, too few to go on (tests/unit/test_group_leader.py has a pair that goes on)
        leave_rounds(hosts[1])
        start = get_dht_time() + VERDICT_CFG.averaging.window_s
        gone = hosts[0].start_round(c, RoundPlan(start, VERDICT_CFG.averaging.window_s, due=get_dht_time(),
                                                 group_id=led_by_a("left-7"), members=members,
                                                 boundary_ms=round((get_dht_time() + 1.0) * 1000)))
        a = gone.result(timeout=60)
        print(f"round 7: a {a.reason!r} in {a.duration_s:.1f} s")
        assert a.reason == f"{MISSING}: 1 of 2 members showed (1 left)", a.reason
        assert a.duration_s < SENDER_TIMEOUT_S / 2, a.duration_s  # told, not timed out
    finally:
        faults.arm([])
        for h in hosts:
            h.shutdown()
        for d in dhts:
            d.shutdown()
    err = capfd.readouterr().err
    assert f"FAULT fired: {fault.spec}" in err and f"FAULT fired: {offers.spec}" in err  # from b's averager process
