"""Groups from the clock over hivemind: a round's group is known before it starts
(:func:`~p2p_diloco.core.groups.clock_group`), so there is no matchmaking. Each member posts its offer -- what
hivemind's matchmaking would have gathered from it: its bandwidth, mode and round metadata -- and the group's leader
fetches every member's over their own connections (:meth:`FixedGroupMeeting.rpc_group_offer`, answered once that
member meets the same group) and decides who is in (:mod:`~p2p_diloco.averaging.group_leader`); the all-reduce then
runs on exactly that ``GroupInfo``, the same on every member. A member whose offer is not in by the group's
``show_by`` (plus a request's round trip) is left out: the members that showed, if more than half of the group, go
on as the group without it (:func:`~p2p_diloco.core.groups.without_absent`: its own id); else the round fails for
all alike (:data:`~p2p_diloco.averaging.decisions.MISSING`), before any tensor moves. A member that skips the
boundary says so (:meth:`FixedGroupMeeting.decline`): the leader hears it at once instead of at the deadline, and
counts it as a member that did not show.

A mixin of :class:`~p2p_diloco.averaging.process.FragmentAveragerProcess`: hivemind's averager steps through
``self._matchmaking.look_for_group``, which :meth:`FixedGroupMeeting.set_next_group` wraps once (in the averager
process) so that a step with a group set meets it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time

from p2p_diloco.averaging.decisions import MISSING, VerdictRule
from p2p_diloco.core.groups import without_absent
from p2p_diloco.core.rejects import PeerDataError, Reason
from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # wraps hivemind's matchmaking entry point and builds its GroupInfo

logger = logging.getLogger(__name__)

OFFER_KEEP_S = 120.0
"""How long an averager keeps its offer for a group it met, and a wait for a group it has not met yet (a member
that asks late still gets our offer; a request for a group we never meet is forgotten)."""
MAX_OFFER_WAITS = 64
"""Groups an averager holds offers or waits for at once (beyond: a request for another group is answered at once,
not kept waiting: a member cannot make us hold unbounded state)."""
MAX_OFFER_BYTES = 1 << 20
"""The most bytes a member's offer (hivemind's gathered data: its bandwidth, mode and round metadata) may take."""


class Declined(MatchmakingException):
    """A member said it will not meet the group (it skips the boundary): it is missing, and counts as a member that
    did not show when the others decide whether to go on without it (:func:`~p2p_diloco.core.groups.without_absent`)."""


class Left(MatchmakingException):
    """A member said it is done (it trains no more and meets no group again): the group goes on without it, and the
    majority counts the members that stay (:func:`~p2p_diloco.core.groups.without_absent`)."""


@dataclass(frozen=True)
class FixedGroup:
    """A round's group known before it starts (groups from the clock, :func:`~p2p_diloco.core.groups.clock_group`):
    no matchmaking; its members exchange their offers -- what hivemind's matchmaking gathers from each -- over their
    own connections, and run the all-reduce on exactly this group."""

    group_id: bytes
    peer_ids: tuple[str, ...]
    """Base58 peer ids, in the group's order (every member derives the same)."""
    show_by: float
    """DHT time by which every member's offer must be in; a member silent past it (plus a request's round trip)
    fails the round for all alike (:data:`~p2p_diloco.averaging.decisions.MISSING`)."""
    request_timeout_s: float
    """Seconds an offer request may take past ``show_by`` (a round trip on a slow link)."""
    planned_id: bytes = b""
    """The group the clock named, when this one goes on without its absent members (:meth:`without`); empty: this is
    that group. The round's verdicts go under the planned id: it is the one every member's host knows."""
    boundary_ms: int = -1
    """The clock's boundary the group meets at, DHT ms (a member that skips it declines every group of it)."""
    rule: VerdictRule | None = field(default=None, compare=False)
    """What our verdict on the round checks (the host's, on the group it plans; None on the others): the averager
    process sends that verdict the moment the all-reduce ends
    (:meth:`~p2p_diloco.averaging.verdicts.GroupVerdicts.early_verdict`)."""

    @property
    def verdict_id(self) -> bytes:
        """The id the round's verdicts are exchanged under (the planned group's)."""
        return self.planned_id or self.group_id

    def without(self, absent: Collection[str], declined: Collection[str] = (),
                left: Collection[str] = ()) -> FixedGroup | None:
        """The group that goes on without ``absent``, ``declined`` and ``left`` members (:func:`~p2p_diloco.core.groups.
        without_absent`), as the leader decides it and every member checks it; None when the round must fail
        instead."""
        group_id, showed = without_absent(self.group_id.hex(), self.peer_ids, absent, declined, left)
        if not showed:
            return None
        return FixedGroup(group_id.encode(), showed, self.show_by + self.request_timeout_s, self.request_timeout_s,
                          planned_id=self.verdict_id, boundary_ms=self.boundary_ms)


class FixedGroupMeeting:
    """The averager's side of groups from the clock (mixed into the averager process class)."""

    # what the averager (hivemind's DecentralizedAverager, our subclass) provides
    _outer_pipe: Any
    _matchmaking: Any
    _p2p: Any
    _pending_groups_registered: asyncio.Event
    last_meet_s: Any  # a multiprocessing.Value: how long the last step took to meet its group
    peer_id: Any
    prefix: str
    fragment: int | None
    get_stub: Callable[..., Any]
    _refuse: Callable[..., Any]
    _decision: Callable[[FixedGroup], Any]  # GroupLeading's: the leader's decision on a group we posted our offer to

    def init_fixed_groups(self) -> None:
        """(host, before the averager process starts) Empty state."""
        self._next_group: FixedGroup | None = None
        """(averager process) The group the next step meets instead of matchmaking (:meth:`set_next_group`)."""
        self._offers: dict[bytes, tuple[FixedGroup, bytes]] = {}
        """(averager process) Group id -> (the group, our offer to it): what :meth:`rpc_group_offer` answers."""
        self._offer_waits: dict[bytes, tuple[asyncio.Event, float, int]] = {}
        """(averager process) Group id -> (set once our offer is in or we decline its round, when the first wait or
        offer came, the boundary it meets at in DHT ms)."""
        self._left = False
        """(averager process) We are done (:meth:`leave`): every request for an offer hears so at once."""
        self._declined: dict[int, float] = {}
        """(averager process) The boundaries we skip, DHT ms (:meth:`decline`) -> when we said so:
        :meth:`rpc_group_offer` answers CANCELLED at once for any group at them, and no step of ours meets one."""

    def set_next_group(self, group: FixedGroup) -> MPFuture:
        """(host) Meet ``group`` at the next step instead of matchmaking (sent on the control pipe before the step,
        so applied before it)."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_next_group", [], dict(future=future, group=group)))
        return future

    async def _set_next_group(self, future: MPFuture, group: FixedGroup) -> None:
        try:
            self._next_group = group
            matchmaking = self._matchmaking  # built in this process by hivemind's run(): wrapped once
            if not getattr(matchmaking.look_for_group, "fixed_groups", False):
                matchmaking.look_for_group = self._fixed_or_matched(matchmaking.look_for_group)
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def decline(self, boundary_ms: int) -> MPFuture:
        """(host) We skip our fragment's boundary ``boundary_ms`` (DHT ms): members of a group that counts on us there
        asking for our offer hear so at once (CANCELLED) instead of waiting out our offer (we count as a member that
        did not show: :func:`~p2p_diloco.core.groups.without_absent`), and no step of ours meets a group of that round
        later."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_decline", [], dict(future=future, boundary_ms=boundary_ms)))
        return future

    async def _decline(self, future: MPFuture, boundary_ms: int) -> None:
        try:
            now = time.monotonic()
            for old in [r for r, since in self._declined.items() if now - since > OFFER_KEEP_S]:
                del self._declined[old]
            while len(self._declined) >= MAX_OFFER_WAITS:
                del self._declined[next(iter(self._declined))]
            self._declined[boundary_ms] = now
            for event, _, at_ms in self._offer_waits.values():
                if at_ms == boundary_ms:  # requests that came before: answered now
                    event.set()
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def leave(self) -> MPFuture:
        """(host) We are done with rounds for good (the learner's final rounds are over: it lingers, then exits):
        every request for our offer to a group from the clock -- waiting or to come -- hears so at once, and the group
        goes on without us, its majority counted without us (:class:`Left`)."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_leave", [], dict(future=future)))
        return future

    async def _leave(self, future: MPFuture) -> None:
        self._left = True
        for event, _, _ in self._offer_waits.values():  # requests that came before: answered now
            event.set()
        future.set_result(None)

    def _fixed_or_matched(self, look_for_group: Callable[[StepControl], Any]) -> Callable[[StepControl], Any]:
        """hivemind's matchmaking for a step, unless a group was set for it (:meth:`set_next_group`)."""

        async def look(step: StepControl) -> GroupInfo | None:
            group, self._next_group = self._next_group, None
            t0 = time.monotonic()
            found = await look_for_group(step) if group is None else await self._meet(group, step)
            self.last_meet_s.value = time.monotonic() - t0
            return found

        look.fixed_groups = True  # type: ignore[attr-defined]
        return look

    def _offer_wait(self, group_id: bytes, boundary_ms: int) -> asyncio.Event | None:
        """The event set once our offer to ``group_id`` (a group of the boundary ``boundary_ms``) is in or we
        decline that boundary; None when :data:`MAX_OFFER_WAITS` groups are held already. Forgets the groups older than
        :data:`OFFER_KEEP_S` first."""
        now = time.monotonic()
        for old in [g for g, (_, since, _) in self._offer_waits.items() if now - since > OFFER_KEEP_S]:
            del self._offer_waits[old]
            self._offers.pop(old, None)
        if group_id not in self._offer_waits:
            if len(self._offer_waits) >= MAX_OFFER_WAITS:
                return None
            self._offer_waits[group_id] = (asyncio.Event(), now, boundary_ms)
        return self._offer_waits[group_id][0]

    async def _meet(self, group: FixedGroup, step: StepControl) -> GroupInfo:
        """Post our offer to ``group`` and wait for its leader's decision (:mod:`~p2p_diloco.averaging.group_leader`):
        the group's :class:`GroupInfo`, the same on every member -- the whole group, or the members that showed if
        more than half of it did (:meth:`FixedGroup.without`); else the round fails (raised)."""
        own = self.peer_id.to_base58()
        if own not in group.peer_ids:
            raise MatchmakingException(f"we are not a member of group {group.group_id.hex()}")
        if group.boundary_ms in self._declined:
            raise MatchmakingException(f"we declined the round at {group.boundary_ms} ms: its groups go on without us")
        if self._left:
            raise MatchmakingException("we left: no more rounds")
        offer = step.data_for_gather
        self._post_offer(group, offer)
        decision = await self._decision(group)
        if decision.group is None or own not in decision.group.peer_ids:
            # a stream of a member that runs a group with us waits for us to register it (hivemind's race guard):
            # we never will, so release it now (BAD_GROUP_ID) instead of at its sender timeout. Only then: a release
            # while we are about to register the group we run refuses its members' streams that came first
            self._pending_groups_registered.set()
            raise MatchmakingException(decision.reason if decision.group is None else (
                f"{MISSING}: the group went on without us ({len(decision.group.peer_ids)} of {len(group.peer_ids)} "
                "members showed by its leader's deadline)"))
        if decision.group.group_id != group.group_id:  # the same id is the same group; we keep ours, which carries
            # our verdict rule (the leader's decision names the group a member's request brought, if that came first)
            logger.debug("fragment %s: group %s goes on as %s without %d member(s)", self.fragment,
                         group.group_id.hex(), decision.group.group_id.hex(),
                         len(group.peer_ids) - len(decision.group.peer_ids))
            self._offers[decision.group.group_id] = (decision.group, offer)  # its verdicts and vetoes check members
        return GroupInfo(decision.group.group_id, tuple(PeerID.from_base58(p) for p in decision.group.peer_ids),
                         decision.offers)

    def _post_offer(self, group: FixedGroup, offer: bytes) -> None:
        """Hold our ``offer`` to ``group`` for its leader's request (:meth:`rpc_group_offer`)."""
        event = self._offer_wait(group.group_id, group.boundary_ms)
        if event is None:  # every slot held by others' requests: make room for our own group
            oldest = next(iter(self._offer_waits))
            del self._offer_waits[oldest]
            self._offers.pop(oldest, None)
            event = self._offer_wait(group.group_id, group.boundary_ms)
            assert event is not None
        self._offers[group.group_id] = (group, offer)
        event.set()

    async def _ask_offer(self, peer: str, group: FixedGroup, timeout_s: float) -> bytes:
        """``peer``'s offer to ``group`` (raises when it has none for it in time, refuses, or sends too much)."""
        stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
        request = averaging_pb2.JoinRequest(group_key=f"{group.group_id.hex()}@{group.boundary_ms}",
                                            expiration=group.show_by)
        reply = await stub.rpc_group_offer(request, timeout=timeout_s)
        if reply.code == averaging_pb2.CANCELLED and reply.group_id == group.group_id:
            raise Declined(f"{peer} declined group {group.group_id.hex()}")
        if reply.code == averaging_pb2.GROUP_DISBANDED and reply.group_id == group.group_id:
            raise Left(f"{peer} left")
        if reply.code != averaging_pb2.ACCEPTED or reply.group_id != group.group_id or len(reply.gathered) != 1:
            raise MatchmakingException(f"no offer: {averaging_pb2.MessageCode.Name(reply.code)}")
        if len(reply.gathered[0]) > MAX_OFFER_BYTES:
            raise PeerDataError(Reason.OVERSIZE, f"an offer of {len(reply.gathered[0])} bytes")
        return bytes(reply.gathered[0])

    async def rpc_group_offer(self, request: averaging_pb2.JoinRequest,
                              context: P2PContext) -> averaging_pb2.MessageFromLeader:
        """The leader of a group from the clock asks for our offer to it: answered once we meet that group ourselves
        (waiting until the asker's ``show_by`` at most), only to the group's members."""
        if await self._refuse(context, "a group offer request"):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        try:  # "<group id, hex>@<its boundary, DHT ms>"
            key, _, at = request.group_key.partition("@")
            group_id, boundary_ms = bytes.fromhex(key), int(at)
        except ValueError:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        if group_id not in self._offers and boundary_ms not in self._declined and not self._left:
            event = self._offer_wait(group_id, boundary_ms)
            if event is None:
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            wait_s = min(max(0.0, request.expiration - get_dht_time()), OFFER_KEEP_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), wait_s)
        if boundary_ms in self._declined and group_id not in self._offers:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.CANCELLED, group_id=group_id)
        if self._left and group_id not in self._offers:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_DISBANDED, group_id=group_id)
        kept = self._offers.get(group_id)
        if kept is None:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        group, offer = kept
        if context.remote_id.to_base58() not in group.peer_ids:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED, group_id=group_id, gathered=[offer])

    def fixed_group(self, group_id: bytes) -> FixedGroup | None:
        """(averager process) The group from the clock ``group_id`` if we met it as one, else None."""
        kept = self._offers.get(group_id)
        return kept[0] if kept is not None else None

