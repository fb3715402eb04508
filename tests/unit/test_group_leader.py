"""One decision per group from the clock (p2p_diloco/averaging/group_leader.py): the leader's rule and the messages
that carry the group to it and its decision back -- pure, no network (the live protocol: tests/integration/
test_clock_groups_live.py)."""

from __future__ import annotations

import collections

import msgpack
import pytest
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.proto import averaging_pb2

from p2p_diloco.averaging.decisions import MISSING
from p2p_diloco.averaging.fixed_groups import MAX_OFFER_BYTES, FixedGroup
from p2p_diloco.averaging.group_leader import (
    Decision,
    decide,
    decision_reply,
    decision_request,
    leader_of,
    leaders_of,
    read_decision,
    read_decision_request,
)
from p2p_diloco.core.rejects import PeerDataError

MEMBERS = ("peerA", "peerB", "peerC", "peerD")


def group(members: tuple[str, ...] = MEMBERS, gid: bytes = b"0123456789abcdef") -> FixedGroup:
    return FixedGroup(gid, members, show_by=1000.0, request_timeout_s=2.0, boundary_ms=999_000)


def offers(*peers: str) -> dict[str, bytes]:
    return {p: f"offer of {p}".encode() for p in peers}


def test_every_member_names_the_same_leaders_and_the_first_spreads_over_the_members() -> None:
    leaders = collections.Counter(leader_of(group(gid=f"{i:016x}".encode())) for i in range(400))
    assert set(leaders) == set(MEMBERS)
    assert min(leaders.values()) > 60, leaders  # a dead member comes first in about a quarter of the rounds naming it
    g = group()
    assert sorted(leaders_of(g)) == sorted(MEMBERS) and leader_of(g) == leaders_of(g)[0]
    assert leaders_of(g) == leaders_of(FixedGroup(g.group_id, tuple(reversed(MEMBERS)), 5.0, 9.0))  # id + members
    # the order of the others does not depend on one member being there: a group without the first leader asks
    # the rest in the same order
    assert [m for m in leaders_of(g) if m != leader_of(g)] == leaders_of(
        FixedGroup(g.group_id, tuple(m for m in MEMBERS if m != leader_of(g)), 5.0, 9.0))


def test_the_leader_decides_the_whole_group_the_group_without_the_absent_or_failure() -> None:
    g = group()
    whole = decide(g, offers(*MEMBERS), declined=())
    assert whole.group is g and whole.offers == tuple(offers(*MEMBERS).values())
    three = decide(g, offers("peerA", "peerC", "peerD"), declined=())
    assert three.group is not None and three.group.peer_ids == ("peerA", "peerC", "peerD")
    assert three.group.verdict_id == g.group_id and three.group.group_id != g.group_id
    assert three.offers == tuple(offers("peerA", "peerC", "peerD").values())
    # a decline counts as a member that did not show: two of four is not more than half
    two = decide(g, offers("peerA", "peerB"), declined=("peerC",))
    assert two.group is None and two.reason == f"{MISSING}: 2 of 4 members showed (1 declined)", two.reason
    # a member whose offer is in counts as in, whatever else was said of it
    assert decide(g, offers(*MEMBERS), declined=("peerB",)).group is g


def test_members_that_left_leave_the_decision_and_its_majority() -> None:
    """Two of four members left for good (they answered the leader so): the other two go on as a pair, and a member
    takes that decision -- its reply names who left, by index, so that the member derives the same pair; a reply that
    names no such member, or a bad index, is refused."""
    g = group()
    pair = decide(g, offers("peerA", "peerB"), (), left=("peerC", "peerD"))
    assert pair.group is not None and pair.group.peer_ids == ("peerA", "peerB") and pair.left == {"peerC", "peerD"}
    reply = decision_reply(pair, g)
    assert bytes(reply.suggested_leader) == b"\x00\x02\x00\x03"
    assert read_decision(reply, g) == pair
    unsaid = decision_reply(pair, g)
    unsaid.suggested_leader = b""  # the same pair with nobody said to have left: not more than half of four
    with pytest.raises(PeerDataError):
        read_decision(unsaid, g)
    for bad in (b"\x00", b"\x00\x09"):
        reply.suggested_leader = bad
        with pytest.raises(PeerDataError):
            read_decision(reply, g)
    # one left, one silent: two of the three that stay; everyone left but us: no group
    assert decide(g, offers("peerA", "peerB"), (), left=("peerC",)).group is not None
    alone = decide(g, offers("peerA"), ("peerB",), left=("peerC", "peerD"))
    assert alone.group is None and alone.reason == f"{MISSING}: 1 of 4 members showed (1 declined, 2 left)"


def test_a_request_names_the_group_and_a_bad_one_is_refused() -> None:
    g = group()
    assert read_decision_request(decision_request(g, 2)) == (g, 2)
    for gather in (b"\xc1", msgpack.packb([["peerA"], 2.0, 0]), msgpack.packb([["peerA", "peerA"], 2.0, 0]),
                   msgpack.packb([["peerA", 7], 2.0, 0]), msgpack.packb([list(MEMBERS), -1.0, 0]),
                   msgpack.packb([list(MEMBERS), 1e9, 0]), msgpack.packb([list(MEMBERS), "2", 0]),
                   msgpack.packb([list(MEMBERS), 2.0, 4]), msgpack.packb([list(MEMBERS), 2.0, -1]),
                   msgpack.packb([list(MEMBERS), 2.0]), msgpack.packb({"peers": list(MEMBERS)})):
        request = decision_request(g, 0)
        request.gather = gather
        with pytest.raises(ValueError):
            read_decision_request(request)
    for key in ("nothex@5", f"{g.group_id.hex()}@soon"):
        request = decision_request(g, 0)
        request.group_key = key
        with pytest.raises(ValueError):
            read_decision_request(request)


def test_a_member_takes_the_leaders_decision_when_it_follows_the_rules_and_refuses_any_other() -> None:
    g = group()
    for decision in (decide(g, offers(*MEMBERS), ()), decide(g, offers("peerA", "peerB", "peerD"), ())):
        assert read_decision(decision_reply(decision, g), g) == decision
    failed = decide(g, offers("peerA"), ())
    assert read_decision(decision_reply(failed, g), g) == Decision(None, reason=f"{MISSING}: 1 of 4 members showed")
    # a pair of four (not more than half), a member the group does not name, the right members under another id,
    # an offer missing, an offer too large: each refused as the leader's fault
    pair = FixedGroup(b"whatever", ("peerA", "peerB"), 0.0, 1.0)
    three = decide(g, offers("peerA", "peerB", "peerD"), ()).group
    assert three is not None
    def named(*indices: bytes) -> averaging_pb2.MessageFromLeader:
        reply = decision_reply(Decision(three, (b"", b"", b"")), g)
        del reply.ordered_peer_ids[:]
        reply.ordered_peer_ids.extend(indices)
        return reply

    with pytest.raises(ValueError):  # a leader never names a member the planned group does not
        decision_reply(Decision(FixedGroup(three.group_id, ("peerA", "peerB", "peerE"), 0.0, 1.0), (b"", b"", b"")), g)
    assert [bytes(i) for i in decision_reply(Decision(three, (b"", b"", b"")), g).ordered_peer_ids] == [
        b"\x00\x00", b"\x00\x01", b"\x00\x03"]  # peerA, peerB, peerD: indices into the planned group, not names
    forged = [
        decision_reply(Decision(pair, (b"a", b"b")), g),
        named(b"\x00\x00", b"\x00\x01", b"\x00\x04"),  # a member past the planned group
        named(b"\x00\x01", b"\x00\x00", b"\x00\x03"),  # out of order
        named(b"\x00\x00", b"\x00\x00", b"\x00\x03"),  # twice
        named(b"\x00", b"\x00\x01", b"\x00\x03"),  # not two bytes
        named(b"\x00\x00", b"\x00\x01", b"\x00\x02"),  # peerC, who did not show: not the group without the absent
        decision_reply(Decision(FixedGroup(b"another id", three.peer_ids, 0.0, 1.0), (b"", b"", b"")), g),
        decision_reply(Decision(three, (b"", b"")), g),
        decision_reply(Decision(three, (b"", b"x" * (MAX_OFFER_BYTES + 1), b"")), g),
    ]
    for reply in forged:
        with pytest.raises(PeerDataError):
            read_decision(reply, g)
    # no decision (the leader does not know the group, or gave up): the round fails, saying so
    with pytest.raises(MatchmakingException, match="no decision from the group's leader: NOT_LOOKING_FOR_GROUP"):
        read_decision(averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP), g)
    # a failure's reason is one line, cut
    reply = decision_reply(Decision(None, reason="why\nnot " + "x" * 1000), g)
    reason = read_decision(reply, g).reason
    assert reason.startswith("why not x") and len(reason) <= 300 and "\n" not in reason
