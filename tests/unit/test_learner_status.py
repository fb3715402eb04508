"""When a learner's status thread publishes its record (pure decision, no DHT)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from p2p_diloco.engine.options import published_key, publish_due, read_period_s, view_due
from p2p_diloco.engine.view import (
    OWN_VERSION_READ_REPLICAS,
    SwarmView,
    known_past,
    probed_heads,
    settled,
    unknown_vouchers,
    vouched_heads,
    with_heads,
)

KEY = ("training", (3, 2, 2, 1), ("a", "b", "c", "d"))


def test_first_publish_is_due() -> None:
    assert publish_due(0.0, -math.inf, 3.3, KEY, None)


def test_unchanged_record_waits_for_its_refresh() -> None:
    assert not publish_due(101.0, 100.0, 3.3, KEY, KEY)
    assert not publish_due(103.2, 100.0, 3.3, KEY, KEY)
    assert publish_due(103.4, 100.0, 3.3, KEY, KEY)


def test_what_peers_act_on_goes_out_at_once() -> None:
    moved_on = ("training", (4, 2, 2, 1), ("e", "b", "c", "d"))  # a round committed: peers check if they are behind
    leaving = ("leaving", KEY[1], KEY[2])
    assert publish_due(100.5, 100.0, 3.3, moved_on, KEY)
    assert publish_due(100.5, 100.0, 3.3, leaving, KEY)


def test_view_is_read_every_period_while_training() -> None:
    assert view_due(0.0, -math.inf, 3.0, training=True)
    assert not view_due(102.9, 100.0, 3.0, training=True)
    assert view_due(103.0, 100.0, 3.0, training=True)


def test_view_is_read_at_every_tick_when_not_training() -> None:
    # waiting for peers and lingering until they agree end on what the view says
    assert view_due(100.1, 100.0, 3.0, training=False)


def test_waiting_for_peers_counts_inside_max_time() -> None:
    from p2p_diloco.engine.options import wait_verdict, waiting_line

    # started at t=100, began waiting at t=110 (start-up took 10 s); --max-time 60, --wait-peers gives up after 120 s
    assert wait_verdict(130.0, 110.0, 100.0, 60.0, 120.0) == "wait"
    assert wait_verdict(160.0, 110.0, 100.0, 60.0, 120.0) == "max-time"  # 60 s after the start, not after the wait
    assert wait_verdict(229.0, 110.0, 100.0, 0.0, 120.0) == "wait"  # no --max-time: only the wait's own timeout
    assert wait_verdict(230.0, 110.0, 100.0, 0.0, 120.0) == "timeout"
    assert wait_verdict(230.0, 110.0, 100.0, 500.0, 120.0) == "timeout"
    assert waiting_line(1, 3, 12.4) == "waiting for peers: 1 of 3 live (12 s)"


def test_while_training_only_a_state_change_publishes_at_once() -> None:
    """Versions travel as vouches while training (the head probe); lingering peers still need them in records."""
    a = published_key("training", (3, 2), ("a" * 16, "b" * 16), training=True)
    assert a == published_key("training", (4, 2), ("c" * 16, "b" * 16), training=True)
    assert a != published_key("averaging", (3, 2), ("a" * 16, "b" * 16), training=True)
    assert published_key("syncing", (3, 2), ("a" * 16, "b" * 16), training=False) != published_key(
        "syncing", (4, 2), ("c" * 16, "b" * 16), training=False)


def test_full_reads_stretch_with_the_swarm_so_read_bytes_per_second_stay_flat() -> None:
    assert read_period_s(3.0, 1) == read_period_s(3.0, 4) == read_period_s(3.0, 40) == 30.0
    assert read_period_s(3.0, 64) == 48.0
    for n in (40, 64, 256):  # records read per second: n records every read_period_s, flat past 40
        assert math.isclose(n / read_period_s(3.0, n), 4 / 3.0)


def test_a_probed_head_raises_a_record_only_if_seen_after_it_was_published() -> None:
    ranks = [(3, "a" * 16), (2, "b" * 16)]
    heads = {0: ((4, "c" * 16), 110.0)}
    assert with_heads(ranks, 100.0, heads) == [(4, "c" * 16), (2, "b" * 16)]
    assert with_heads(ranks, 120.0, heads) == ranks  # the record is newer than the probe: it wins
    assert with_heads(ranks, 100.0, {0: ((2, "f" * 16), 110.0)}) == ranks  # never lowered
    assert with_heads(ranks, 100.0, {5: ((9, "c" * 16), 110.0)}) == ranks  # no such fragment
    assert ranks == [(3, "a" * 16), (2, "b" * 16)]  # not changed in place


def test_vouched_heads_are_live_peers_other_than_us_with_a_well_formed_hash() -> None:
    signed = {"A": "a" * 16, "B": "b" * 16, "C": "c" * 16, "D": "not-a-hash", "E": 7, "ME": "e" * 16}
    live = {"A", "B", "D", "E", "ME"}
    assert vouched_heads(signed, 5, live, "ME") == {"A": (5, "a" * 16), "B": (5, "b" * 16)}  # C: dead
    assert vouched_heads({}, 5, live, "ME") == {}


def test_a_peer_that_vouches_for_our_version_and_the_next_one_in_one_probe_is_at_the_next() -> None:
    """A probe reads our version's vouchers (a live peer is behind us) and the next version's (nobody is known past us)
    of the same fragment: a peer found in both holds the next one -- its vouch of ours stays in the DHT. Whatever the
    order the keys were read in, it is raised to the next, and so we know we are behind and download. (The last key
    read won: a rejoiner stayed a version behind on a fragment for half a minute, its every round failing.)"""
    a, b = "a" * 16, "b" * 16
    old = {"A": {1: ((3, "c" * 16), 10.0)}, "B": {0: ((2, b), 10.0)}}
    for read in ({(1, 5): {"A": (5, a)}, (1, 4): {"A": (4, b), "C": (4, b)}},
                 {(1, 4): {"A": (4, b), "C": (4, b)}, (1, 5): {"A": (5, a)}}):
        heads = probed_heads(old, read, 20.0)
        assert heads == {"A": {1: ((5, a), 20.0)}, "B": {0: ((2, b), 10.0)}, "C": {1: ((4, b), 20.0)}}, heads
        ranks = with_heads([(2, b), (4, b)], 15.0, heads["A"])
        assert ranks == [(2, b), (5, a)] and known_past([ranks], 1, 4)
    assert old == {"A": {1: ((3, "c" * 16), 10.0)}, "B": {0: ((2, b), 10.0)}}  # not changed in place
    assert probed_heads(old, {}, 20.0) == old


def test_a_learner_we_do_not_know_that_vouches_for_our_version_makes_us_read_the_swarm_once() -> None:
    """Groups from the clock name only the learners our view holds: a rejoiner that downloaded our version vouches for
    it, and the next head probe reads the swarm for its record, instead of leaving it out of our groups (and failing
    its groups, which name us) until the next full read. A dead peer's vouches stay: read again only after a while."""
    from types import SimpleNamespace

    from p2p_diloco.core.config import load_config

    signed = {"A": "a" * 16, "NEW": "b" * 16, "BAD": "nope", "ME": "c" * 16}
    assert unknown_vouchers(signed, 5, {"A"}, "ME") == {"NEW"}
    assert unknown_vouchers(signed, 5, {"A", "NEW"}, "ME") == set()
    owner = SimpleNamespace(cfg=load_config(None, ["averaging.matchmaking=clock"]), slots=[],
                            joined=SimpleNamespace(peer_id="ME"))
    view = SwarmView(owner)  # type: ignore[arg-type]
    reads: list[int] = []
    view.read = lambda snapshot=None: reads.append(1)  # type: ignore[method-assign, assignment, return-value]
    view._records = {"A": ([(5, "a" * 16)], 0.0)}
    view._read_unknown_vouchers({(0, 5): signed, (1, 3): {"A": "a" * 16}})
    assert reads == [1]
    view._read_unknown_vouchers({(0, 5): signed})  # the same voucher at the next probe: not read again yet
    assert reads == [1]
    view._read_unknown_vouchers({(1, 3): {"NEW": "d" * 16}})  # it vouches for another of our fragments
    assert reads == [1, 1]
    view._unknown_read = {k: at - 60.0 for k, at in view._unknown_read.items()}  # a while later: read again
    view._read_unknown_vouchers({(0, 5): signed})
    assert reads == [1, 1, 1]


def test_a_fragment_known_to_be_behind_is_not_probed_again_until_we_catch_up() -> None:
    anchors = [[(3, "a" * 16), (2, "b" * 16)], [(4, "c" * 16), (2, "b" * 16)]]
    assert known_past(anchors, 0, 3)  # a peer holds v4: the download is what helps now
    assert not known_past(anchors, 0, 4) and not known_past(anchors, 1, 2)
    assert not known_past(anchors, 2, 0) and not known_past([], 0, 0)


def test_a_fragment_that_advanced_since_its_boundary_is_not_probed_until_the_next_one() -> None:
    assert settled(105.0, 100.0, 110.0) and settled(100.0, 100.0, 110.0)
    assert not settled(99.0, 100.0, 110.0) and not settled(-math.inf, 100.0, 110.0)
    assert settled(-math.inf, 120.0, 110.0)  # the fragment's first boundary is still ahead: nobody can be past us


def test_the_view_probes_a_fragment_from_its_boundary_until_it_advances() -> None:
    from types import SimpleNamespace

    from p2p_diloco.core.config import load_config
    from p2p_diloco.net.clock import SyncClock

    slots = [SimpleNamespace(index=f, version=0) for f in range(2)]
    view = SwarmView(SimpleNamespace(cfg=load_config(None, ["averaging.sync_period_s=20.0"]), slots=slots))  # type: ignore[arg-type]
    assert view.clock == SyncClock(20.0)  # fragment 0 due at 20, 40, ...; fragment 1 at 30, 50, ...
    f0, f1 = slots
    assert not view._settled(f0, 24.0) and not view._settled(f1, 24.0)  # never probed: probe
    view._advanced = {0: (0, 24.0), 1: (0, 24.0)}  # what a probe at 24 that read both next versions leaves
    assert view._settled(f0, 25.0) and view._settled(f0, 39.9)  # nobody can be past us before the next boundary
    assert not view._settled(f0, 40.0) and not view._settled(f1, 30.0)
    assert view._settled(f1, 29.9)  # fragment 1's first boundary is still ahead: nobody can be past us yet
    f0.version = 1  # our round of fragment 0 committed
    assert view._settled(f0, 26.0) and view._settled(f0, 39.9)  # advanced after its boundary at 20
    assert not view._settled(f0, 40.0)  # the next round: probed until it advances again
    assert not view._settled(f1, 39.0)  # fragment 1 did not advance since its boundary at 30: probed
    f1.version = 1
    assert view._settled(f1, 39.5) and not view._settled(f1, 50.0)
    view.clock = None  # the step schedule: no shared instants, every fragment probed
    assert not view._settled(f0, 26.0)


def test_a_learner_waiting_for_peers_joins_a_swarm_that_already_trains() -> None:
    """A learner killed while the others waited at the start barrier, replaced by one that joined the running swarm
    (no start proposal): the waiting ones start when a live learner trains, instead of waiting out --max-time."""
    from p2p_diloco.engine.options import swarm_started

    assert not swarm_started([])
    assert not swarm_started(["joining", "joining"])
    assert not swarm_started(["leaving"])  # a swarm that ended is no swarm to join
    assert swarm_started(["joining", "training"])
    assert swarm_started(["averaging"]) and swarm_started(["syncing"])


def test_a_download_tries_the_live_learners_our_view_ranks_and_never_one_that_left() -> None:
    """No averager declares itself a donor in the DHT: a fragment's download is handed the other live learners of
    the view, each with the rank the view holds for it (its record, raised by the head probes). A learner that left
    (its tombstone) is none of them, as a record of another shape is not."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from p2p_diloco.core.config import load_config
    from p2p_diloco.engine.rounds import FragmentLink
    from p2p_diloco.net.records import PeerRecord

    def record(peer: str, state: str, versions: tuple[int, ...]) -> Any:
        return SimpleNamespace(peer_id=peer, record=PeerRecord(
            run_id="r", protocol_version=1, config_hash="h", software_version="s", peer_id=peer, name=peer, state=state,
            fragment_versions=versions, anchor_hashes=tuple(f"{peer.lower()}{v}".ljust(16, "0") for v in versions)))

    slots = [SimpleNamespace(index=f, version=0) for f in range(2)]
    owner = SimpleNamespace(cfg=load_config(None), slots=slots, joined=SimpleNamespace(peer_id="ME"))
    view = SwarmView(owner)  # type: ignore[arg-type]
    snapshot = SimpleNamespace(live=lambda: [record("A", "training", (5, 4)), record("B", "leaving", (5, 3)),
                                             record("GONE", "left", (6, 6)), record("ODD", "training", (9,)),
                                             record("ME", "training", (5, 4))])
    assert view.read(snapshot) is not None
    view._heads = {"B": {1: ((4, "b4".ljust(16, "0")), math.inf)}}  # a head probe saw B vouch for v4 of fragment 1
    view._merge()
    asked: list[tuple[Any, ...]] = []

    def fetch_state(ours: Any, donors: Any, link: Any = None, replay: bool = True) -> Future[Any]:
        asked.append((ours, donors))
        return Future()

    rounds: Any = SimpleNamespace(view=view, link=SimpleNamespace(estimate=lambda: None), cfg=load_config(None),
                                  syncs=[SimpleNamespace(slot=SimpleNamespace(no_replay_from=None))] * 2)
    FragmentLink(SimpleNamespace(fetch_state=fetch_state), rounds, 1).fetch_state((0, "0" * 16))  # type: ignore[arg-type]
    assert asked == [((0, "0" * 16), {"A": (4, "a4".ljust(16, "0")), "B": (4, "b4".ljust(16, "0"))})]


def test_a_probe_that_read_a_next_version_settles_the_fragment_until_its_next_boundary(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its first commit a fragment was probed at every probe (it counted as advanced long ago): at N = 4 the
    reads of all four next versions were a learner's largest control-plane item. A probe that read a fragment's next
    version and found nobody past us settles it until its next boundary; one that failed settles nothing."""
    from types import SimpleNamespace

    from p2p_diloco.core.config import load_config
    from p2p_diloco.net import membership

    clock_now = [34.0]  # fragment 0's boundaries at 20, 40, ...; fragment 1's at 30, 50, ...
    slots = [SimpleNamespace(index=f, version=3) for f in range(2)]
    # hivemind's matchmaking: no own-version reads (every third probe under groups from the clock) to count in
    owner = SimpleNamespace(cfg=load_config(None, ["averaging.sync_period_s=20.0", "averaging.matchmaking=dht"]),
                            slots=slots, local=SimpleNamespace(run_id="r"), joined=SimpleNamespace(peer_id="ME", dht=None),
                            dht_time=lambda: clock_now[0])
    view = SwarmView(owner)  # type: ignore[arg-type]
    read: list[list[str]] = []

    def failing(dht: object, keys: list[str], **_kw: object) -> dict[str, object]:
        read.append(list(keys))
        raise TimeoutError("no answer")

    monkeypatch.setattr(membership, "read_many", failing)
    assert not view.probe_heads() and len(read[0]) == 2  # both next versions asked; the read failed
    assert view._advanced == {}  # nothing settled
    monkeypatch.setattr(membership, "read_many", lambda dht, keys, **_kw: read.append(list(keys)) or {})
    assert view.probe_heads() and len(read[1]) == 2  # nobody vouches for v4 of either
    clock_now[0] = 37.0
    assert view.probe_heads() and len(read) == 2  # both settled (their boundaries 20 and 30 are past): nothing read
    clock_now[0] = 40.0
    assert view.probe_heads() and read[2] == read[1][:1]  # fragment 0's boundary at 40: it alone is probed again


def test_a_followers_probes_read_the_clock_once_in_three_and_its_leaders_at_every_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The derived clock changes only at a retune, which starts CLOCK_READ_EVERY view periods ahead: a follower reads
    it alone once in CLOCK_READ_EVERY probes (and with any other key a probe reads), the leader and a learner without
    a clock at every probe."""
    from types import SimpleNamespace

    from p2p_diloco.core.config import load_config
    from p2p_diloco.engine.options import CLOCK_READ_EVERY
    from p2p_diloco.net import membership
    from p2p_diloco.net.clock import SyncClock, clock_key

    slots = [SimpleNamespace(index=f, version=3) for f in range(2)]
    owner = SimpleNamespace(cfg=load_config(None, ["averaging.matchmaking=dht"]), slots=slots,
                            local=SimpleNamespace(run_id="r"), joined=SimpleNamespace(peer_id="ME", dht=None),
                            dht_time=lambda: 100.0)
    view = SwarmView(owner)  # type: ignore[arg-type]
    assert view.clocks.auto and view.clock is None
    read: list[list[str]] = []
    monkeypatch.setattr(membership, "read_many", lambda dht, keys, **_kw: read.append(list(keys)) or {})
    assert view.probe_heads() and view.clocks.read and clock_key("r") in read[0] and len(read[0]) == 3  # no clock yet
    view.clock = SyncClock(20.0, origin=95.0)  # adopted; both fragments were read at 100: settled until 115 and 125
    read.clear()
    probes = 3 * CLOCK_READ_EVERY
    for _ in range(probes):
        assert view.probe_heads()
    assert read == [[clock_key("r")]] * (probes // CLOCK_READ_EVERY)  # the clock alone, once in CLOCK_READ_EVERY
    view.clocks.leading = True
    read.clear()
    for _ in range(probes):
        assert view.probe_heads()
    assert read == [[clock_key("r")]] * probes


def test_a_peer_behind_us_outside_our_last_group_makes_the_probe_read_who_vouches_for_our_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups from the clock name a learner only once our view shows it at our version. A learner that fell behind
    (stopped, restarted) catches up by a download and vouches for it; its record says so only at its heartbeat, read
    at our next full read. So while a live peer is behind us on a fragment -- and was not in our last committed round
    of it, whose members hold our version whatever their records say -- every probe reads that fragment's vouchers of
    our version, and a peer that vouches is raised to it."""
    from types import SimpleNamespace

    from p2p_diloco.averaging.decisions import averager_prefix, vouch_key
    from p2p_diloco.core.config import load_config
    from p2p_diloco.engine.view import behind_us
    from p2p_diloco.net import membership
    from p2p_diloco.transport.planning import with_us

    anchors = {"A": [(2, "a" * 16), (2, "a" * 16)], "B": [(3, "b" * 16), (2, "b" * 16)]}
    last_groups = [(3, ("A", "B")), (-1, ())]  # each fragment host's last committed round: (led to, members)
    assert with_us(last_groups[0], 3) == ("A", "B") and with_us(last_groups[0], 4) == ()
    assert with_us(last_groups[1], 3) == ()
    assert not behind_us(anchors, 0, 3, ("A", "B"))  # A's record is stale: it was in our round that led to v3
    assert behind_us(anchors, 0, 3, ()) and behind_us(anchors, 1, 3, ()) and not behind_us(anchors, 1, 2, ())

    slots = [SimpleNamespace(index=f, version=3) for f in range(2)]
    owner = SimpleNamespace(cfg=load_config(None, ["averaging.sync_period_s=20.0"]), slots=slots,
                            local=SimpleNamespace(run_id="r"), joined=SimpleNamespace(peer_id="ME", dht=None),
                            dht_time=lambda: 100.0, rounds=SimpleNamespace(hosts=[
                                SimpleNamespace(last_group=lambda g=g: g) for g in last_groups]))
    view = SwarmView(owner)  # type: ignore[arg-type]
    assert owner.cfg.averaging.clock_groups
    view._records = {p: (ranks, 0.0) for p, ranks in anchors.items()}
    view._merge()
    f1_ours = vouch_key(averager_prefix("r", 1), 3)
    read: list[list[str]] = []

    def found(dht: object, keys: list[str], replicas_of: dict[str, int]) -> dict[str, object]:
        read.append(list(keys))
        assert replicas_of == {k: OWN_VERSION_READ_REPLICAS for k in keys if k.endswith("_v3")} and replicas_of, keys
        return {f1_ours: SimpleNamespace(value={"A": SimpleNamespace(value="c" * 16)})} if f1_ours in keys else {}

    monkeypatch.setattr(membership, "owned_values", lambda item: (
        {} if item is None else {p: v.value for p, v in item.value.items()}))
    monkeypatch.setattr(membership, "read_many", found)
    assert view.probe_heads()
    assert f1_ours in read[0] and vouch_key(averager_prefix("r", 0), 3) not in read[0]  # fragment 1 only
    assert view._anchors["A"][1] == (3, "c" * 16) and view._anchors["B"][1] == (2, "b" * 16)  # A caught up
    assert view.probe_heads() and f1_ours in read[1]  # B is still behind on fragment 1


def test_a_learner_that_would_lead_by_its_view_leaves_a_living_leaders_clock_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Our view makes us the smallest training peer id (it lacks the leader: a partial read, or one gone stale while we
    were stopped), but the newest clock was stored by a smaller id 50 s ago: we publish nothing. Once that clock is
    older than the freshness bound (its leader stopped re-storing it), we lead and publish."""
    from types import SimpleNamespace

    from p2p_diloco.core.config import load_config
    from p2p_diloco.engine import clocktender
    from p2p_diloco.engine.options import CLOCK_LEADER_FRESH_S
    from p2p_diloco.net import membership

    logged: list[object] = []
    owner = SimpleNamespace(cfg=load_config(None), slots=[SimpleNamespace(index=f, version=3) for f in range(2)],
                            local=SimpleNamespace(run_id="r"),
                            joined=SimpleNamespace(peer_id="QmB", dht=None, private_key=None),
                            dht_time=lambda: 1050.0, rounds=SimpleNamespace(sync_link_s=lambda: 0.0),
                            log_event=logged.append, opts=SimpleNamespace(view_period_s=5.0))
    view = SwarmView(owner)  # type: ignore[arg-type]
    published: list[object] = []
    monkeypatch.setattr(clocktender, "publish_clock", lambda dht, run_id, clock, subkey, now: published.append(clock) or True)
    monkeypatch.setattr(membership, "owner_subkey", lambda key: b"[owner]")
    others = [SimpleNamespace(peer_id="QmC", state="training", step_time_s=0.5, sync_link_s=0.0)]
    view.clocks.publisher = ("QmA", 1000.0)  # the leader, whom our view lacks, stored its clock 50 s ago
    view.clocks.tend(0.5, others)
    assert not view.clocks.leading and published == [] and logged == []
    view.clocks.publisher = ("QmA", 1050.0 - CLOCK_LEADER_FRESH_S - 1.0)  # it stopped re-storing: gone
    view.clocks.tend(0.5, others)
    assert view.clocks.leading and len(published) == 1 and len(logged) == 1, (published, logged)


def test_a_clock_derived_before_any_link_is_measured_spaces_its_rounds_a_work_period_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's first clock, with no link time in: F x H x the median step, its first boundary one work period
    (H x the step) past the margin, so the fragments' first rounds come a work period apart. Once a link time is in, it
    retunes to the work's period at once -- even where the link's period (here 3.6 F x the step's) lies within the
    tolerance of the unmeasured one -- and later reads leave that clock alone."""
    from types import SimpleNamespace

    from p2p_diloco.core.config import load_config
    from p2p_diloco.engine import clocktender
    from p2p_diloco.net import membership
    from p2p_diloco.net.clock import LINK_PERIOD_SAFETY

    now, link = [1000.0], [0.0]
    cfg = load_config(None)
    owner = SimpleNamespace(cfg=cfg, slots=[SimpleNamespace(index=f, version=0) for f in range(4)],
                            local=SimpleNamespace(run_id="r"),
                            joined=SimpleNamespace(peer_id="QmA", dht=None, private_key=None),
                            dht_time=lambda: now[0], rounds=SimpleNamespace(sync_link_s=lambda: link[0]),
                            log_event=lambda event: None, opts=SimpleNamespace(view_period_s=1.0))
    view = SwarmView(owner)  # type: ignore[arg-type]
    published: list[Any] = []
    monkeypatch.setattr(clocktender, "publish_clock", lambda dht, run_id, clock, subkey, now: published.append(clock) or True)
    monkeypatch.setattr(membership, "owner_subkey", lambda key: b"[owner]")
    work = cfg.outer.sync_every * 0.5
    others = [SimpleNamespace(peer_id=f"Qm{c}", state="training", step_time_s=0.5, sync_link_s=0.0) for c in "BCD"]
    view.clocks.tend(0.5, others)
    first = published[-1]
    assert first.period_s == pytest.approx(4 * work) and view.clocks.unmeasured
    assert first.start - now[0] == pytest.approx(view.clocks.learner.opts.view_period_s * 3 + 2.0 + work)
    assert [round(first.next_any_boundary(first.start + k * work - 1e-6, 4) - first.start, 6) for k in range(4)] == [
        round(k * work, 6) for k in range(4)]  # one fragment's boundary per work period
    now[0] += work  # the first round measured every link: 0.9 x the unmeasured period needs a longer one
    link[0] = 4 * 0.9 * work / LINK_PERIOD_SAFETY
    for o in others:
        o.sync_link_s = link[0]
    view.clocks.tend(0.5, others)
    second = published[-1]
    assert second is not first and second.epoch == 1 and not view.clocks.unmeasured
    assert second.period_s == pytest.approx(4 * 0.9 * work)
    count = len(published)
    now[0] += work
    view.clocks.tend(0.5, others)
    assert len(published) == count and view.clocks.clock is second  # measured: the usual rules hold
