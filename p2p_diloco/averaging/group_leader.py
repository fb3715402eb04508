"""One decision per group from the clock: its leader decides who is in, and every member runs on that decision.

Before, each member of a group from the clock asked every other member for its offer and decided alone who showed.
Under load (four learners on two slow cores writing checkpoints) a member whose answer came late was seen by some
members and not by others: some went on without it, others ran the whole group, and the round was lost on every
member, each failing differently, with every member alive (docs/design.md, "Under chaos, the members' decisions
part"). Now one member decides:

- The group's **leader** is one of its members, picked by a hash of the group's id (:func:`leaders_of`: a member
  that died comes first in only its share of the rounds that still name it, and a member that cannot reach it asks
  the next -- two deciders' groups share a member, so at most one commits). It asks every other member for its offer
  (:meth:`~p2p_diloco.averaging.fixed_groups.FixedGroupMeeting.rpc_group_offer`, answered once that member meets the
  group, at once when it declines the boundary), until the group's ``show_by`` plus a request's round trip, and
  decides (:func:`decide`): every member, the members that showed if more than half of the group did
  (:func:`~p2p_diloco.core.groups.without_absent`), or failure.
- Every other member posts its offer and asks the leader for the decision (:meth:`GroupLeading.rpc_group_decision`,
  answered once it is made); it checks the decision against the group it planned (:func:`read_decision`: the same
  members, or the group without the absent ones as it would derive it itself) and runs the all-reduce on it, or
  fails the round with the leader's reason. A member the decision leaves out fails the round as missing.
- A leader that does not answer by ``show_by`` plus two round trips fails the round for every member alike (each
  times out on it; one out of reach is passed over at once); a leader that skips the boundary still leads (its own
  offer counts as declined), and so does one whose own view put it in another group: the request names the group.

One message delay more than each member asking every other (two round trips from the last offer to the all-reduce),
and ``2 (n - 1)`` requests a round instead of ``n (n - 1)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Collection, Mapping

import msgpack
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.averaging.decisions import MISSING, missing_reason
from p2p_diloco.averaging.fixed_groups import (
    MAX_OFFER_BYTES,
    MAX_OFFER_WAITS,
    OFFER_KEEP_S,
    Declined,
    FixedGroup,
    FixedGroupMeeting,
    Left,
)
from p2p_diloco.core.groups import group_leaders
from p2p_diloco.core.rejects import PeerDataError, Reason
from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # builds hivemind's protobuf messages and registers a handler on its servicer

logger = logging.getLogger(__name__)

MAX_GROUP_MEMBERS = 1024
"""The most members a group named in a decision request may have (a larger one is refused)."""
MAX_REASON_CHARS = 300
"""The longest failure reason a leader's decision carries (cut to this)."""
MAX_REQUEST_TIMEOUT_S = 600.0
"""The longest request timeout a decision request may name (a longer one is refused: it would hold our wait)."""


def leaders_of(group: FixedGroup) -> list[str]:
    """The members that may decide ``group``'s round, in the order they are asked
    (:func:`~p2p_diloco.core.groups.group_leaders`)."""
    return group_leaders(group.group_id, group.peer_ids)


def leader_of(group: FixedGroup) -> str:
    """The member that decides ``group``'s round while it lives: the first of :func:`leaders_of`."""
    return leaders_of(group)[0]


@dataclass(frozen=True)
class Decision:
    """A leader's decision on a group's round: the group that runs and its members' offers in its order, or why the
    round fails for every member."""

    group: FixedGroup | None
    """The planned group, the group without its absent members (:meth:`FixedGroup.without`), or None: it fails."""
    offers: tuple[bytes, ...] = ()
    """The offers of ``group``'s members, in its order."""
    reason: str = ""
    """Why the round fails (``group`` None)."""
    left: frozenset[str] = frozenset()
    """The planned group's members that said they left for good (``group`` goes on without them, its majority
    counted without them)."""


def decide(group: FixedGroup, offers: Mapping[str, bytes], declined: Collection[str],
           left: Collection[str] = ()) -> Decision:
    """The leader's decision on ``group``, given the ``offers`` in by its deadline (peer id -> offer), the members
    that ``declined`` the boundary and those that ``left`` for good: the whole group, the group without the others if
    more than half of the members that stay showed, or failure (:func:`~p2p_diloco.core.groups.without_absent`)."""
    if all(p in offers for p in group.peer_ids):
        return Decision(group, tuple(offers[p] for p in group.peer_ids))
    left = set(left) - set(offers)
    declined = set(declined) - set(offers) - left
    rest = group.without(set(group.peer_ids) - set(offers) - declined - left, declined, left)
    if rest is None:
        return Decision(None, reason=missing_reason(sum(p in offers for p in group.peer_ids), len(group.peer_ids),
                                                    len(declined), len(left)))
    return Decision(rest, tuple(offers[p] for p in rest.peer_ids), left=frozenset(left))


def decision_request(group: FixedGroup, index: int) -> averaging_pb2.JoinRequest:
    """A member's request for the decision on ``group`` to the leader at ``index`` of :func:`leaders_of` (the ones
    before it were out of reach): it names the whole group, so that a leader that has not met it (it skips the
    boundary, or its own view put it elsewhere) can still lead it."""
    return averaging_pb2.JoinRequest(group_key=f"{group.group_id.hex()}@{group.boundary_ms}", expiration=group.show_by,
                                     gather=msgpack.packb([list(group.peer_ids), group.request_timeout_s, index]))


def read_decision_request(request: averaging_pb2.JoinRequest) -> tuple[FixedGroup, int]:
    """The group a decision request names and the index of the leader it asks (raises ``ValueError`` naming what is
    wrong with it)."""
    key, _, at = request.group_key.partition("@")
    group_id, boundary_ms = bytes.fromhex(key), int(at)
    try:
        peers, request_timeout_s, index = msgpack.unpackb(request.gather[:MAX_GROUP_MEMBERS * 64])
    except Exception as e:  # msgpack's errors have no common base: any is a malformed request
        raise ValueError(f"malformed group: {type(e).__name__}: {e}") from None
    if not (isinstance(peers, list) and 2 <= len(peers) <= MAX_GROUP_MEMBERS and all(isinstance(p, str) for p in peers)
            and len(set(peers)) == len(peers)):
        raise ValueError("the group's members must be 2 to 1024 distinct peer ids")
    if not (isinstance(request_timeout_s, (int, float)) and 0 < request_timeout_s <= MAX_REQUEST_TIMEOUT_S
            and math.isfinite(request.expiration)):
        raise ValueError(f"bad request timeout {request_timeout_s!r} or show-by time {request.expiration!r}")
    if not (isinstance(index, int) and 0 <= index < len(peers)):
        raise ValueError(f"bad leader index {index!r}")
    group = FixedGroup(group_id, tuple(peers), request.expiration, float(request_timeout_s), boundary_ms=boundary_ms)
    return group, index


MEMBER_INDEX_BYTES = 2
"""A decision names its members by their index in the planned group, big-endian in this many bytes (up to
:data:`MAX_GROUP_MEMBERS`): 4 bytes a member on the wire where a base58 peer id took about 55, and the request already
named them all."""


def decision_reply(decision: Decision, planned: FixedGroup) -> averaging_pb2.MessageFromLeader:
    """The leader's answer carrying ``decision`` on ``planned``: its members as indices in ``planned`` (raises
    ``ValueError`` for a member ``planned`` does not name: a decision is on the planned group or part of it)."""
    if decision.group is None:
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_DISBANDED, group_id=planned.group_id,
                                               gathered=[decision.reason[:MAX_REASON_CHARS].encode()])
    return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED, group_id=decision.group.group_id,
                                           ordered_peer_ids=[planned.peer_ids.index(p).to_bytes(MEMBER_INDEX_BYTES, "big")
                                                             for p in decision.group.peer_ids],
                                           gathered=list(decision.offers),
                                           # the members that left, by index too: the majority is counted without them
                                           suggested_leader=b"".join(
                                               planned.peer_ids.index(p).to_bytes(MEMBER_INDEX_BYTES, "big")
                                               for p in sorted(decision.left, key=planned.peer_ids.index)))


def read_decision(reply: averaging_pb2.MessageFromLeader, planned: FixedGroup) -> Decision:
    """The decision in the leader's ``reply`` on ``planned``, checked: the planned group itself, or the group without
    some of its members exactly as :meth:`FixedGroup.without` derives it (more than half of it); one offer per member.
    Raises ``MatchmakingException`` when the leader answered that it has none, ``PeerDataError`` when the reply breaks
    these rules."""
    if reply.code == averaging_pb2.GROUP_DISBANDED and reply.group_id == planned.group_id and len(reply.gathered) == 1:
        reason = bytes(reply.gathered[0][:4 * MAX_REASON_CHARS]).decode(errors="replace")[:MAX_REASON_CHARS]
        return Decision(None, reason=" ".join(reason.split()) or "the leader failed the round")
    if reply.code != averaging_pb2.ACCEPTED:
        raise MatchmakingException(f"no decision from the group's leader: {averaging_pb2.MessageCode.Name(reply.code)}")
    indices = [int.from_bytes(i, "big") for i in reply.ordered_peer_ids if len(i) == MEMBER_INDEX_BYTES]
    if (len(indices) != len(reply.ordered_peer_ids) or any(b <= a for a, b in zip(indices, indices[1:]))
            or any(i >= len(planned.peer_ids) for i in indices)):
        raise PeerDataError(Reason.MALFORMED, f"a decision on group {planned.group_id.hex()} naming its members by "
                                              "indices that are not increasing indices into it")
    peers = tuple(planned.peer_ids[i] for i in indices)
    gone = bytes(reply.suggested_leader)
    left_at = [int.from_bytes(gone[k:k + MEMBER_INDEX_BYTES], "big") for k in range(0, len(gone), MEMBER_INDEX_BYTES)]
    if len(gone) % MEMBER_INDEX_BYTES or any(i >= len(planned.peer_ids) for i in left_at):
        raise PeerDataError(Reason.MALFORMED, f"a decision on group {planned.group_id.hex()} naming members that left "
                                              "by bad indices")
    left = {planned.peer_ids[i] for i in left_at}
    group = planned if peers == planned.peer_ids else planned.without(set(planned.peer_ids) - set(peers) - left,
                                                                      left=left)
    if group is None or group.peer_ids != peers or group.group_id != reply.group_id:
        raise PeerDataError(Reason.MALFORMED, f"a decision on group {planned.group_id.hex()} naming {len(peers)} "
                                              "members that is not that group, nor more than half of it")
    if len(reply.gathered) != len(peers):
        raise PeerDataError(Reason.MALFORMED, f"{len(reply.gathered)} offers for {len(peers)} members")
    if any(len(offer) > MAX_OFFER_BYTES for offer in reply.gathered):
        raise PeerDataError(Reason.OVERSIZE, f"an offer over {MAX_OFFER_BYTES} bytes")
    return Decision(group, tuple(bytes(offer) for offer in reply.gathered), left=frozenset(left))


class GroupLeading(FixedGroupMeeting):
    """The leader's side of groups from the clock, and a member's wait for the decision (mixed into the averager
    process class; it reads the state of :class:`~p2p_diloco.averaging.fixed_groups.FixedGroupMeeting`, whose
    declarations of what the averager provides it shares)."""

    def init_group_leading(self) -> None:
        """(host, before the averager process starts) Empty state."""
        self._decisions: dict[bytes, tuple[FixedGroup, asyncio.Future[Decision], asyncio.Task[None], float]] = {}
        """(averager process) Group id -> (the group we lead, our decision on it, the task making it, when it
        started)."""

    async def _decision(self, group: FixedGroup) -> Decision:
        """The decision on ``group`` (our offer to it posted): ours if we lead it, else the leader's answer (within
        ``show_by`` plus two round trips). A leader out of reach (its process is gone: the connection fails at once)
        is passed over for the next of :func:`leaders_of`. Raises when no leader answers in time, or one answers out
        of the rules."""
        deadline = time.monotonic() + max(0.0, group.show_by - get_dht_time()) + 2 * group.request_timeout_s
        own = self.peer_id.to_base58()
        gone: list[str] = []
        for index, leader in enumerate(leaders_of(group)):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            try:
                if leader == own:
                    return await asyncio.wait_for(asyncio.shield(self._lead(group)), left_s)
                stub = self.get_stub(self._p2p, PeerID.from_base58(leader), namespace=self.prefix)
                reply = await stub.rpc_group_decision(decision_request(group, index), timeout=left_s)
            except (ConnectionError, OSError, P2PDaemonError) as e:  # out of reach: the next leader decides
                logger.debug("fragment %s: group %s: leader %s out of reach (%s: %s)", self.fragment,
                             group.group_id.hex(), leader, type(e).__name__, e)
                gone.append(leader[-8:])
                continue
            except (asyncio.TimeoutError, P2PHandlerError) as e:
                raise MatchmakingException(f"{MISSING}: no decision from the group's leader {leader[-8:]} "
                                           f"({type(e).__name__})") from None
            try:
                return read_decision(reply, group)
            except PeerDataError as e:
                raise MatchmakingException(f"the group's leader {leader[-8:]} sent a bad decision: {e}") from None
        raise MatchmakingException(f"{MISSING}: no decision in time (leaders out of reach: {', '.join(gone) or 'none'})")

    def _lead(self, group: FixedGroup) -> asyncio.Future[Decision]:
        """The decision we make on ``group``, started once per group (by our own step or the first member that
        asks); older decisions are forgotten past :data:`OFFER_KEEP_S`, the oldest beyond :data:`MAX_OFFER_WAITS`."""
        kept = self._decisions.get(group.group_id)
        if kept is not None:
            return kept[1]
        now = time.monotonic()
        for old in [g for g, (_, _, _, since) in self._decisions.items() if now - since > OFFER_KEEP_S]:
            self._forget_decision(old)
        while len(self._decisions) >= MAX_OFFER_WAITS:
            self._forget_decision(next(iter(self._decisions)))
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._make_decision(group, future))
        self._decisions[group.group_id] = (group, future, task, now)
        return future

    def _forget_decision(self, group_id: bytes) -> None:
        _, future, task, _ = self._decisions.pop(group_id)
        task.cancel()
        if not future.done():
            future.cancel()

    def stop_leading(self) -> None:
        """(averager process, at shutdown) Cancel the decisions still being made."""
        for group_id in list(self._decisions):
            self._forget_decision(group_id)

    async def _make_decision(self, group: FixedGroup, future: asyncio.Future[Decision]) -> None:
        try:
            offers, declined, left = await self._gather_offers(group)
            decision = decide(group, offers, declined, left)
        except Exception as e:  # a bug of ours: every member fails the round, with its reason
            logger.warning("fragment %s: group %s: no decision (%s: %s)", self.fragment, group.group_id.hex(),
                           type(e).__name__, e)
            decision = Decision(None, reason=f"the group's leader failed: {type(e).__name__}: {e}")
        if not future.done():
            future.set_result(decision)
        if decision.group is None:
            logger.debug("fragment %s: group %s fails: %s", self.fragment, group.group_id.hex(), decision.reason)
        elif decision.group is not group:
            logger.debug("fragment %s: group %s goes on as %s of %d members", self.fragment, group.group_id.hex(),
                         decision.group.group_id.hex(), len(decision.group.peer_ids))

    async def _gather_offers(self, group: FixedGroup) -> tuple[dict[str, bytes], set[str], set[str]]:
        """Every member's offer to ``group`` in by its ``show_by`` plus a round trip (ours: posted by our own step),
        the members that declined its boundary and those that left (we may be one: :meth:`leave`)."""
        own = self.peer_id.to_base58()
        timeout_s = max(0.0, group.show_by - get_dht_time()) + group.request_timeout_s
        others = [p for p in group.peer_ids if p != own]

        async def our_offer() -> bytes | None:
            event = None if self._left else self._offer_wait(group.group_id, group.boundary_ms)
            if event is not None and group.group_id not in self._offers:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout_s)
            kept = self._offers.get(group.group_id)
            return kept[1] if kept is not None else None

        ours, *answers = await asyncio.gather(our_offer(), *(self._ask_offer(p, group, timeout_s) for p in others),
                                              return_exceptions=True)
        offers: dict[str, bytes] = {}
        declined: set[str] = set()
        left: set[str] = set()
        if isinstance(ours, bytes):
            offers[own] = ours
        elif self._left:
            left.add(own)
        elif group.boundary_ms in self._declined:
            declined.add(own)
        for p, answer in zip(others, answers):
            if isinstance(answer, bytes):
                offers[p] = answer
            elif isinstance(answer, Left):
                left.add(p)
            elif isinstance(answer, Declined):
                declined.add(p)
            else:
                logger.debug("fragment %s: group %s: no offer from %s (%s: %s)", self.fragment, group.group_id.hex(),
                             p, type(answer).__name__, answer)
        return offers, declined, left

    async def rpc_group_decision(self, request: averaging_pb2.JoinRequest,
                                 context: P2PContext) -> averaging_pb2.MessageFromLeader:
        """A member of a group we lead asks for our decision on it: answered once it is made (at most ``show_by``
        plus two of the group's round trips), only to the group's members."""
        if await self._refuse(context, "a group decision request"):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        try:
            group, index = read_decision_request(request)
        except ValueError as e:
            logger.debug("fragment %s: a decision request from %s refused: %s", self.fragment, context.remote_id, e)
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        if context.remote_id.to_base58() not in group.peer_ids or leaders_of(group)[index] != self.peer_id.to_base58():
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        kept = self._decisions.get(group.group_id)
        if kept is not None and kept[0].peer_ids != group.peer_ids:  # another member list under the same id
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        if kept is None and group.group_id in self._offers:  # our own step met it: its deadlines are ours
            group = self._offers[group.group_id][0]
        future = self._lead(group)
        wait_s = min(max(0.0, group.show_by - get_dht_time()) + 2 * group.request_timeout_s, OFFER_KEEP_S)
        try:
            decision = await asyncio.wait_for(asyncio.shield(future), wait_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):  # not decided in time, or forgotten meanwhile
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        return decision_reply(decision, group)
