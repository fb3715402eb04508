"""Groups from the clock (``averaging.matchmaking = "clock"``, issue 48): a round's group is a pure function of the
clock's round and the live records every member holds (:func:`p2p_diloco.core.groups.clock_group`), not found by
matchmaking. Pinned here on the in-process network, with real :class:`~p2p_diloco.DiLoCo` engines in threads
(:mod:`p2p_diloco.transport.inprocess`): rounds start as soon as the group is in and commit with identical anchors; a
member that does not show is left out by the others when they are more than half of the group, else fails the round
for all alike; members whose views of the group differ never commit the same version twice (no fork); a member whose
verdicts do not arrive discards, keeps the result and commits it late, with no download."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from test_inprocess import RUN_DEADLINE_S, STEP_S, Loop, wait_for

from p2p_diloco.core.config import Config, ConfigError, load_config
from p2p_diloco.core.groups import clock_group, without_absent
from p2p_diloco.core.identity import config_hash
from p2p_diloco.averaging.host import step_failure
from p2p_diloco.averaging.plans import RoundOutcome
from p2p_diloco.averaging.linktime import estimate_link
from p2p_diloco.averaging.decisions import MISSING
from p2p_diloco.averaging.decisions import NO_GROUP
from p2p_diloco.transport.inprocess import VERDICTS_LOST, Hub
from p2p_diloco.transport.network import RoundContext
from p2p_diloco.transport.planning import LastGroup, with_last_group

CLOCK = ["outer.sync_every=8", "outer.fragments=2", "inner.batch_size=4", "averaging.schedule=clock",
         "averaging.sync_period_s=1.6", "averaging.matchmaking=clock", "averaging.window_s=0.8",
         "averaging.window_min_s=0.6", "averaging.window_max_s=1.2"]
"""Each fragment due every 1.6 s (every 32 paced steps), the two staggered by 0.8 s; a member named that is not in
within the window (0.8 s) fails the round."""

A, B, C = (1, "aa"), (1, "bb"), (2, "aa")


@pytest.fixture
def cfg() -> Config:
    return load_config("llama-tiny", CLOCK)


# ------------------------------------------------------------------ the pure function


def test_members_that_hold_the_same_records_derive_the_same_group() -> None:
    views = {"p1": {"p2": A, "p3": A, "p4": B}, "p2": {"p1": A, "p3": A, "p4": B}, "p3": {"p2": A, "p1": A, "p4": B}}
    groups = {own: clock_group("run/f0", 0, A, 7, own, peers) for own, peers in views.items()}
    assert len(set(groups.values())) == 1
    group_id, members = groups["p1"]
    assert members == ("p1", "p2", "p3")  # the peer at another anchor is not in it; sorted by peer id
    assert len(group_id) == 16


def test_a_group_id_changes_with_anything_that_decides_the_group() -> None:
    base = clock_group("run/f0", 0, A, 7, "p1", {"p2": A})
    assert clock_group("run/f0", 0, A, 7, "p2", {"p1": A}) == base  # the other member's view of it
    others = [clock_group("run/f0", 0, A, 7, "p1", {"p2": A, "p3": A}),  # a view with one more member
              clock_group("run/f0", 0, A, 8, "p1", {"p2": A}),  # the next round
              clock_group("run/f0", 1, A, 7, "p1", {"p2": A}),  # another fragment
              clock_group("run/f0", 0, C, 7, "p1", {"p2": C}),  # another version
              clock_group("run/f0", 0, B, 7, "p1", {"p2": B}),  # another anchor
              clock_group("other/f0", 0, A, 7, "p1", {"p2": A})]  # another run
    assert len({g[0] for g in [base, *others]}) == 1 + len(others)
    assert clock_group("run/f0", 0, A, 7, "p1", {"p2": B})[1] == ("p1",)  # nobody at our rank: alone


def test_more_than_half_of_a_group_goes_on_without_the_members_that_did_not_show() -> None:
    group_id, members = clock_group("run/f0", 0, A, 7, "p1", {"p2": A, "p3": A, "p4": A})
    rest_id, rest = without_absent(group_id, members, {"p4"})
    assert rest == ("p1", "p2", "p3") and rest_id not in ("", group_id)
    assert without_absent(group_id, members, ["p4"]) == (rest_id, rest)  # every member that saw the same derives it
    assert without_absent(group_id, members, {"p3"})[0] not in ("", rest_id)  # another member absent: another group
    assert without_absent(group_id, members, {"p3", "p4"}) == ("", ())  # two of four: not more than half
    assert without_absent(group_id, members, set()) == ("", ())  # nobody absent: the group itself, not another
    three = clock_group("run/f0", 0, A, 7, "p1", {"p2": A, "p3": A})
    assert without_absent(*three, {"p3"})[1] == ("p1", "p2")  # two of three
    assert without_absent(*clock_group("run/f0", 0, A, 7, "p1", {"p2": A}), {"p2"}) == ("", ())  # alone


def test_members_that_declined_count_as_members_that_did_not_show() -> None:
    """A member that skips the boundary says so, and the round fails at once instead of at its deadline; but it still
    counts in the group: only more than half of all members go on. (With the members that declined counted out, two
    disjoint parts of one group could commit the same version at two boundaries -- see below.)"""
    group_id, members = clock_group("run/f0", 0, A, 7, "p1", {"p2": A, "p3": A, "p4": A})
    assert without_absent(group_id, members, (), {"p3", "p4"}) == ("", ())  # two of four: no group
    three_id, three = without_absent(group_id, members, (), {"p4"})
    assert three == ("p1", "p2", "p3")  # three of four go on, whether p4 declined or did not show: the same group
    assert (three_id, three) == without_absent(group_id, members, {"p4"})
    # five members: at one boundary p3, p4, p5 decline (their link is busy) and p1, p2 are in; at the next, p1 and
    # p2's round is still in flight (they do not show or decline) and p3, p4, p5 are in. Were the declines counted
    # out, both parts would go on with the same version: a fork
    group_id, members = clock_group("run/f0", 0, A, 7, "p1", {f"p{k}": A for k in range(2, 6)})
    first = without_absent(group_id, members, (), {"p3", "p4", "p5"})[1]
    second = without_absent(group_id, members, {"p1", "p2"}, ())[1]
    assert not (first and second), (first, second)
    assert second == ("p3", "p4", "p5") and not first
    for absent in ({"p1", "p2"}, {"p3"}, {"p1"}):  # whichever part saw which: two disjoint parts never both go on
        rest = set(members) - absent - {"p4"}
        parts = [without_absent(group_id, members, absent, {"p4"})[1], without_absent(group_id, members, rest, {"p4"})[1]]
        assert not all(parts), parts


def test_members_that_left_leave_the_group_and_its_majority() -> None:
    """A member done with rounds for good (its final rounds are over) says so, and the group goes on without it, its
    majority counted among the members that stay: the two that train on go on when the other two have left, though
    two of four that did not show (or declined) fail; a member that left meets no group again, so no other part of the
    group can commit beside them."""
    group_id, members = clock_group("run/f0", 0, A, 7, "p1", {"p2": A, "p3": A, "p4": A})
    two_id, two = without_absent(group_id, members, (), (), {"p3", "p4"})
    assert two == ("p1", "p2") and two_id not in ("", group_id)
    assert (two_id, two) == without_absent(group_id, members, {"p3", "p4"}, (), {"p3", "p4"})  # however worded
    assert without_absent(group_id, members, {"p4"}, (), {"p3"})[1] == ("p1", "p2")  # two of the three that stay
    assert without_absent(group_id, members, {"p2", "p4"}, (), {"p3"}) == ("", ())  # one of three: fails
    assert without_absent(group_id, members, (), (), {"p2", "p3", "p4"}) == ("", ())  # alone: no group
    assert without_absent(group_id, members, (), {"p4"}, {"p3"})[1] == ("p1", "p2")  # one left, one declined


def test_a_retuned_clocks_rounds_never_name_a_group_of_the_old_one(cfg: Config) -> None:
    """A retuned clock counts its rounds from its new origin: a fragment that stayed at its version through the retune
    would plan a group of the same id as a round before it, were the id made from the round's index (its leader then
    answered with that old round's decision). The boundary's instant names it instead."""
    from p2p_diloco.net.clock import SyncClock
    from p2p_diloco.transport.planning import planned_group

    old, new = SyncClock(10.0, origin=1000.0, epoch=0), SyncClock(20.0, origin=1050.0, epoch=1)
    assert old.round_index(1035.0, 0, 2) == new.round_index(1115.0, 0, 2)  # the same index in both clocks

    def context(clock: SyncClock, due: float) -> RoundContext:
        return RoundContext(due=due, window_s=1.0, link=estimate_link([], []), clock=clock, fragments=2, own_id="p1",
                            roster=("p1", "p2"), peers=(("p2", (3, "aa")),), live_ranks=lambda: ())

    before = planned_group((3, "aa"), 0, context(old, 1035.0), cfg, "run/f0")
    after = planned_group((3, "aa"), 0, context(new, 1115.0), cfg, "run/f0")
    assert before[1] == after[1] == ("p1", "p2") and before[0] != after[0]


def test_the_last_groups_members_count_at_our_rank_until_their_records_catch_up() -> None:
    """Records are republished on a heartbeat, not at every commit: right after a round, each member of it still
    shows the version before in the others' views. Planning counts the last group's members at our rank meanwhile,
    so that every member of a group names the same next group (over hivemind, the records lag by seconds)."""
    context = RoundContext(due=0.0, window_s=1.0, link=estimate_link([], []), clock=None, fragments=2, own_id="p1",
                           roster=("p1", "p2", "p3", "p4"), peers=(("p2", (1, "old")), ("p3", (1, "old")),
                                                                     ("p4", (3, "new"))), live_ranks=lambda: ())
    ours = (2, "aa")  # our version and anchor
    raised = with_last_group(context, ours, (2, ("p1", "p2", "p4")))
    assert raised.peers == (("p2", (2, "aa")), ("p3", (1, "old")), ("p4", (3, "new")))  # p4's record is ahead: kept
    assert with_last_group(context, ours, (3, ("p1", "p2"))) is context  # we are not where that round led
    assert with_last_group(context, ours, (-1, ())) is context
    memory = LastGroup()
    committed: Future[RoundOutcome] = Future()
    assert memory.watch(committed) is committed and memory.get() == (-1, ())
    committed.set_result(RoundOutcome(fragment=0, version=4, committed=True, reason="ok", peers=("p1", "p3")))
    assert memory.get() == (5, ("p1", "p3"))
    discarded: Future[RoundOutcome] = Future()
    memory.watch(discarded).set_result(RoundOutcome(fragment=0, version=5, committed=False, reason="x"))
    assert memory.get() == (5, ("p1", "p3"))  # a discarded round names nobody


def test_a_step_that_a_missing_member_failed_is_worded_as_on_every_transport() -> None:
    assert step_failure(RuntimeError(f"{MISSING}: 2 of 3 members showed")) == f"{MISSING}: 2 of 3 members showed"
    assert step_failure(TimeoutError("x\nlast line")) == "TimeoutError: last line"
    assert step_failure(RuntimeError("")) == "RuntimeError: the averager cancelled the step"


def test_the_switch_is_checked_and_leaves_earlier_hashes_alone() -> None:
    on_clock = ["averaging.schedule=clock"]
    default = load_config("tiny", on_clock)
    assert default.averaging.matchmaking == "auto" and default.averaging.clock_groups  # the clock's schedule, healing
    assert config_hash(default) == config_hash(load_config("tiny", [*on_clock, "averaging.matchmaking=clock"]))
    matchmaking = load_config("tiny", [*on_clock, "averaging.matchmaking=dht"])
    assert not matchmaking.averaging.clock_groups and config_hash(matchmaking) != config_hash(default)
    # 'auto' on the step schedule (tiny's) is hivemind's matchmaking, hashed as before groups from the clock existed
    steps = load_config("tiny")
    assert steps.averaging.schedule == "steps" and not steps.averaging.clock_groups
    assert config_hash(steps) == config_hash(load_config("tiny", ["averaging.matchmaking=dht"]))
    grid = load_config("tiny", [*on_clock, "averaging.groups=grid", "averaging.target_group_size=2", "outer.codec=fp32"])
    assert not grid.averaging.clock_groups
    with pytest.raises(ConfigError, match="averaging.matchmaking"):
        load_config("tiny", ["averaging.matchmaking=gossip"])
    with pytest.raises(ConfigError, match="averaging.matchmaking"):
        load_config("tiny", ["averaging.matchmaking=clock"])  # tiny's step schedule
    # a fixed period under 'window_max_s' is only refused where a matchmaking window must fit in it
    assert load_config("tiny", [*on_clock, "averaging.sync_period_s=2"]).averaging.sync_period_s == 2
    with pytest.raises(ConfigError, match="averaging.sync_period_s"):
        load_config("tiny", [*on_clock, "averaging.sync_period_s=2", "averaging.matchmaking=dht"])


# ------------------------------------------------------------------ engines on the in-process network


def start(hub: Hub, cfg: Config, names: str, steps: int = 160, fewer: dict[str, int] | None = None) -> dict[str, Loop]:
    """A loop per name, started (``fewer``: name -> its steps, where not ``steps``)."""
    torch.set_num_threads(1)
    loops = {n: Loop(hub, cfg, n, seed, steps=(fewer or {}).get(n, steps), pace_s=STEP_S, wait_peers=len(names))
             for seed, n in enumerate(names, start=1)}
    for loop in loops.values():
        loop.thread.start()
    return loops


def finish(loops: dict[str, Loop]) -> None:
    for name, loop in loops.items():
        loop.thread.join(timeout=RUN_DEADLINE_S)
        assert not loop.thread.is_alive(), f"{name} did not end"
        assert loop.error is None, f"{name}: {loop.error!r}"
    for loop in loops.values():
        print(f"{loop.name}: versions {loop.diloco.versions} anchors {loop.diloco.anchor_hashes}; "
              f"{len(loop.rounds('committed'))} committed, {len(loop.rounds('discarded'))} discarded, "
              f"{len(loop.resyncs())} downloads")
    assert len({tuple(loop.diloco.versions) for loop in loops.values()}) == 1
    assert len({tuple(loop.diloco.anchor_hashes) for loop in loops.values()}) == 1


def test_rounds_start_when_the_group_is_in_and_commit_identical(cfg: Config) -> None:
    hub = Hub(cfg)
    loops = start(hub, cfg, "abcd")
    finish(loops)
    committed = [r for r in hub.rounds if r.committed]
    assert len(committed) >= 6, hub.rounds
    # no window waited out: a round starts once all four are in, or goes on without one late past the scheduled time
    assert all((r.complete and len(r.members) == 4) or (r.absent and len(r.members) >= 3) for r in committed), committed
    assert all(v >= 3 for v in loops["a"].diloco.versions), loops["a"].diloco.versions
    lost = [r for r in hub.rounds if not r.committed]
    print(f"{len(committed)} committed; not committed: {[(r.members, r.reason) for r in lost]}")
    # every member alive: a round is lost only when members' hand-offs came later than the window after the first
    # (a loaded machine) and too few were in, and then for all alike; how many is a benchmark's figure, not this test's
    assert all(r.reason == NO_GROUP or r.reason.startswith(MISSING) for r in lost), lost


def test_a_member_that_does_not_show_is_left_out_and_the_others_commit(cfg: Config) -> None:
    hub = Hub(cfg)
    loops = start(hub, cfg, "abc")
    loops["c"].pauses[60] = 2.0  # its record still shows it live at its rank: the others' groups name it
    finish(loops)
    print([(r.fragment, r.version, r.members, r.reason, r.absent) for r in hub.rounds])
    without = [r for r in hub.rounds if r.absent]
    assert without, "no round missed a member (the fault did not fire)"
    # a and b, more than half of the group, went on without c: their round committed, the same for both
    assert any(r.committed and set(r.members) == {"a", "b"} and r.absent == 1 for r in without), without
    assert not [r for r in hub.rounds if r.committed and r.absent >= len(r.members)], hub.rounds  # never a minority
    assert_no_fork(hub)


def test_half_of_a_group_does_not_go_on_without_the_other_half(cfg: Config) -> None:
    hub = Hub(cfg)
    loops = start(hub, cfg, "abcd")
    for name in "cd":  # both miss the same boundaries: a and b are two of four, not more than half (twice: the two
        loops[name].pauses.update({60: 2.0, 110: 2.0})  # may come apart at the first, their steps being no lockstep)
    finish(loops)
    print([(r.fragment, r.version, r.members, r.reason, r.absent) for r in hub.rounds])
    # two of a group of four in, the other two silent (once they thaw they may skip a boundary and say so: the same
    # failure, named "(2 declined)", test_members_whose_round_is_still_in_flight_decline_and_the_round_fails_at_once)
    # (two that trained on after the other two had left go on: test_the_learners_that_train_on_go_on_as_a_pair_once_...)
    halves = [r for r in hub.rounds if r.absent == 2 and len(r.members) == 2 and not r.left]
    assert [r for r in halves if not r.declined], "no round missed two members (the fault did not fire)"
    assert all(not r.committed and r.reason.startswith(f"{MISSING}: 2 of 4 members showed") for r in halves), halves
    assert_no_fork(hub)


def test_members_whose_round_is_still_in_flight_decline_and_the_round_fails_at_once(cfg: Config) -> None:
    """Two of four members' round ends late (a slow link's tail: still in flight at the fragment's next boundary, 1.6 s
    on): they skip that boundary and say so, and the two others' round fails at once -- "2 of 4 members showed (2
    declined)" -- instead of after waiting out the scheduled time; two of four never commit (a fork: see
    test_members_that_declined_count_as_members_that_did_not_show). The four end on one model."""
    hub = Hub(cfg)
    loops = start(hub, cfg, "abcd")
    a = loops["a"]
    wait_for(lambda: len(a.rounds("committed")) >= 2 or a.error is not None, RUN_DEADLINE_S, "a's first rounds")
    before = len(hub.rounds)
    for name in "cd":
        hub.delay(name, 2.5)
    finish(loops)
    after = hub.rounds[before:]
    print([(r.fragment, r.version, r.members, r.reason, r.absent, r.complete) for r in after])
    declined = [r for r in after if r.declined]
    assert declined, "nobody declined a boundary (the fault did not fire)"
    pairs = [r for r in declined if set(r.members) == {"a", "b"} and r.declined == 2]
    assert pairs, declined
    assert all(not r.committed and r.complete and r.reason == f"{MISSING}: 2 of 4 members showed (2 declined)"
               for r in pairs), pairs  # failed, and at once: nobody waited for them
    assert_no_fork(hub)


def test_the_learners_that_train_on_go_on_as_a_pair_once_the_others_have_left(cfg: Config) -> None:
    """c and d end their runs early and linger (their records still name them live at their rank, so the groups of a
    and b still count them): once their final rounds are over they leave every group, and a and b's rounds go on as a
    pair -- in the main job two learners that finished a few seconds early failed the others' last round ("2 of 4
    members showed"). The four end on one model (c and d catch up while they linger)."""
    hub = Hub(cfg)
    loops = start(hub, cfg, "abcd", fewer={"c": 90, "d": 90})
    finish(loops)
    print([(r.fragment, r.version, r.members, r.reason, r.absent, r.left) for r in hub.rounds])
    after = [r for r in hub.rounds if r.left]
    assert after, "no round named a member that had left (the fault did not fire)"
    assert any(r.committed and set(r.members) == {"a", "b"} and r.left == 2 for r in after), after
    assert not [r for r in hub.rounds if not r.committed and r.reason.startswith(f"{MISSING}: 2 of 4")], hub.rounds
    assert_no_fork(hub)


def assert_no_fork(hub: Hub) -> None:
    """Every version of a fragment was committed by one group (its members, the same whoever reports it)."""
    groups: dict[tuple[int, int], set[tuple[str, ...]]] = {}
    for r in hub.rounds:
        if r.committed:
            groups.setdefault((r.fragment, r.version), set()).add(tuple(sorted(r.members)))
    assert all(len(g) == 1 for g in groups.values()), {k: g for k, g in groups.items() if len(g) > 1}


def test_members_whose_views_differ_never_fork(cfg: Config) -> None:
    hub = Hub(cfg)
    loops = start(hub, cfg, "abcd")
    a = loops["a"]
    wait_for(lambda: len(a.rounds("committed")) >= 2 or a.error is not None, RUN_DEADLINE_S, "a's first rounds")
    split_at = len(hub.rounds)
    hub.blind("a", "d")  # a's records of d lag: a names {a, b, c}, the others {a, b, c, d}
    wait_for(lambda: any(r.members == ("a",) for r in hub.rounds[split_at:])
             and any(r.absent and r.committed for r in hub.rounds[split_at:]), RUN_DEADLINE_S, "rounds of the two views")
    blind_until = len(hub.rounds)
    hub.unblind("a")
    finish(loops)
    during = hub.rounds[split_at:blind_until]
    print([(r.fragment, r.version, r.members, r.reason) for r in during])
    # a named {a, b, c} and was alone under that id; b, c and d named {a, b, c, d}, a never came under theirs, and
    # the three went on without it: one group committed each version, a's failed alike
    assert any(r.members == ("a",) and r.reason == f"{MISSING}: 1 of 3 members showed" for r in during), during
    assert any(set(r.members) == {"b", "c", "d"} and r.absent == 1 and r.committed for r in during), during
    assert not any(r.committed and "a" in r.members for r in during), during
    assert_no_fork(hub)
    assert any(r.committed and "a" in r.members for r in hub.rounds[blind_until:]), "a did not average again"


def test_a_member_whose_verdicts_are_lost_commits_the_round_late(cfg: Config) -> None:
    hub = Hub(cfg)
    loops = start(hub, cfg, "abc")
    b = loops["b"]
    wait_for(lambda: len(b.rounds("committed")) >= 2 or b.error is not None, RUN_DEADLINE_S, "b's first rounds")
    downloads_before = len(b.resyncs())
    hub.lose_verdicts("b")
    finish(loops)
    lost = [e for e in b.rounds("discarded") if e.reason == VERDICTS_LOST]
    late = [e for e in b.heard if type(e).__name__ == "LateCommitEvent"]
    print(f"b: lost {[(e.fragment, e.version) for e in lost]}, late commits {late}")
    assert len(lost) == 1, b.rounds("discarded")  # the fault fired once
    assert any(e.fragment == lost[0].fragment and e.version == lost[0].version for e in late), late
    late_at = next(e.time for e in late if e.fragment == lost[0].fragment and e.version == lost[0].version)
    # committed late: no download up to then (one at the very end, when the others' final rounds went on without b
    # after it stopped, is another matter)
    assert not [r for r in b.resyncs()[downloads_before:] if r.time <= late_at], b.resyncs()


def test_a_straggler_is_in_the_groups_and_ends_on_the_one_model(cfg: Config) -> None:
    """A learner 8x slower than the others hands each fragment off up to one of its steps (0.4 s) after the
    boundary: within the window, so the groups that name it wait for it and commit with it (when a loaded machine
    makes it later than that, the others go on without it)."""
    torch.set_num_threads(1)
    hub = Hub(cfg)
    loops = {n: Loop(hub, cfg, n, seed, steps=steps, pace_s=pace, wait_peers=4)
             for seed, (n, steps, pace) in enumerate((("a", 160, STEP_S), ("b", 160, STEP_S), ("c", 160, STEP_S),
                                                       ("slow", 20, 8 * STEP_S)), start=1)}
    for loop in loops.values():
        loop.thread.start()
    finish(loops)
    print([(r.fragment, r.version, r.members, r.reason) for r in hub.rounds])
    with_slow = [r for r in hub.rounds if r.committed and "slow" in r.members]
    assert with_slow, "the straggler never averaged"
    # every committed round started with everyone it named, or went on without those not in by the scheduled time
    assert all(r.complete or r.absent for r in hub.rounds if r.committed), hub.rounds


def test_a_partition_forks_under_groups_from_the_clock_and_heals(cfg: Config) -> None:
    """Split 2 | 2: each side's records show two live learners, so each names a group of two and commits (a
    quorum of what it sees): a fork, as with matchmaking; when the network heals, the losing side downloads the
    winner's anchors and everyone ends on them."""
    hub = Hub(cfg)
    loops = start(hub, cfg, "abcd", steps=200)
    a = loops["a"]
    wait_for(lambda: len(a.rounds("committed")) >= 2 or a.error is not None, RUN_DEADLINE_S, "the first rounds")
    split_at = len(hub.rounds)
    hub.partition(("a", "b"), ("c", "d"))
    before = {n: len(loop.rounds("committed")) for n, loop in loops.items()}
    wait_for(lambda: all(len(loop.rounds("committed")) >= before[n] + 2 for n, loop in loops.items())
             or any(loop.error is not None for loop in loops.values()), RUN_DEADLINE_S, "rounds on both sides")
    hub.heal()
    finish(loops)
    during = [r for r in hub.rounds[split_at:] if r.committed]
    assert any(set(r.members) == {"a", "b"} for r in during) and any(set(r.members) == {"c", "d"} for r in during)
    assert any(e.outcome == "fork healed" for loop in loops.values() for e in loop.resyncs()), "no fork healed"


def test_a_plan_carries_our_measured_link_for_the_parts_and_none_before_a_round_committed(cfg: Config) -> None:
    """The plan's ``link_Bps`` goes into our round metadata, whose slowest member sizes the all-reduce's parts
    (``hivemind_ext.compression.link_part_bytes``): the prior is not a measure (0.0: pipelined parts)."""
    from p2p_diloco.sync.fragment import Contribution
    from p2p_diloco.transport.planning import plan_round

    contribution = Contribution(fragment=0, version=3, anchor_hash="aa", tokens=256, steps=2, weight=256.0,
                                tensors={"w": torch.zeros(1000)}, norms={})

    def plan(link: object) -> float:
        context = RoundContext(due=0.0, window_s=1.0, link=link, clock=None, fragments=2,  # type: ignore[arg-type]
                               own_id="p1", roster=("p1", "p2"), peers=(("p2", (3, "aa")),), live_ranks=lambda: ())
        return plan_round(contribution, context, cfg, "run/f0").link_Bps

    assert plan(estimate_link([], [])) == 0.0
    measured = estimate_link([200_000.0, 250_000.0, 300_000.0], [0.01])
    assert measured.throughput_samples == 3 and plan(measured) == measured.throughput_Bps > 0
