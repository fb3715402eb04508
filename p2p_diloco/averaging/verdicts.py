"""Verdicts inside the group, over hivemind: after a group from the clock's all-reduce each member sends every other
member its verdict on the round ("ok", or why not) in one message over the group's own connections, and commits once
it holds every member's "ok" (:func:`~p2p_diloco.averaging.host.agree_in_group` decides at the deadline). No DHT
store or read. Our verdict leaves the averager process the moment the all-reduce ends
(:meth:`GroupVerdicts.early_verdict`: the planned group carries the rule,
:class:`~p2p_diloco.averaging.decisions.VerdictRule`); the host's exchange then only waits for the others'.

A mixin of :class:`~p2p_diloco.averaging.process.FragmentAveragerProcess`, beside
:class:`~p2p_diloco.averaging.fixed_groups.FixedGroupMeeting` (whose groups and offers it reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture

from p2p_diloco.averaging.decisions import RoundMeta, round_verdict, vetoed
from p2p_diloco.averaging.fixed_groups import MAX_OFFER_WAITS, OFFER_KEEP_S, FixedGroupMeeting
from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # a handler of hivemind's averager servicer

logger = logging.getLogger(__name__)

MAX_VERDICT_CHARS = 300
"""The longest verdict kept ("ok", or why not: cut to this)."""


@dataclass(frozen=True)
class Sending:
    """Our verdict on its way to a group's other members (:meth:`GroupVerdicts._start_sending`)."""

    done: asyncio.Task[float]
    """Ends once every send ended: the fastest answer's seconds (inf: nobody answered)."""
    fastest: asyncio.Future[float]
    """Set once the first member took it: the seconds its answer took (never, if nobody did)."""


class GroupVerdicts(FixedGroupMeeting):
    """The averager's side of verdicts inside the group (mixed into the averager process class; it reads the groups
    and offers of :class:`~p2p_diloco.averaging.fixed_groups.FixedGroupMeeting`, whose declarations of what the averager
    provides it shares)."""

    early_verdicts: Any  # the averager's shared counter (multiprocessing.Value) of the verdicts sent early and kept

    def init_group_verdicts(self) -> None:
        """(host, before the averager process starts) Empty state."""
        self._verdicts: dict[bytes, tuple[dict[str, str], asyncio.Event, float]] = {}
        """(averager process) Group id -> (peer id -> its latest verdict, set at each new one, when the first came)."""
        self._early_verdicts: dict[bytes, tuple[str, Sending]] = {}
        """(averager process) Verdict id -> (our verdict sent as the all-reduce ended, its sending), until the host's
        exchange takes it (:meth:`early_verdict`)."""
        self._sendings: set[asyncio.Task[float]] = set()
        """(averager process) Our verdicts' sends still on their way (held: the event loop keeps only weak references
        to its tasks)."""

    def exchange_verdicts(self, group_id: bytes, peers: tuple[str, ...], own: str, timeout_s: float) -> MPFuture:
        """(host) Send our verdict on the round of group ``group_id`` to its other members (``peers``: every
        member's base58 id) and wait until every member's is in, one is not "ok", or ``timeout_s`` passes. The
        future's result is ``(peer id -> verdict, ours included; the fastest member's answer to ours in seconds, NaN
        if none came by then)``."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_exchange_verdicts", [], dict(future=future, group_id=group_id, peers=peers, own=own,
                                                                timeout_s=timeout_s)))
        return future

    async def _exchange_verdicts(self, future: MPFuture, group_id: bytes, peers: tuple[str, ...], own: str,
                                 timeout_s: float) -> None:
        try:
            received, event = self._verdict_box(group_id)
            own = own[:MAX_VERDICT_CHARS]
            received[self.peer_id.to_base58()] = own
            early = self._early_verdicts.pop(group_id, None)
            if early is not None and early[0] == own:  # sent as the all-reduce ended: only the others' to wait for
                sending = early[1]
                with self.early_verdicts.get_lock():
                    self.early_verdicts.value += 1
            else:
                if early is not None:  # the same rule on the same data: never expected; ours now replaces it
                    logger.warning("fragment %s: group %s: the host's verdict %r is not the one sent as the all-reduce "
                                   "ended (%r): sent in its place", self.fragment, group_id.hex(), own, early[0])
                sending = self._start_sending(group_id, peers, own, timeout_s)
            deadline = time.monotonic() + timeout_s
            while not (all(p in received for p in peers) or vetoed(received, peers)):
                event.clear()
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), left_s)
            if not all(p in received for p in peers):  # the host may withdraw our "ok" next: its message must not
                await sending.done  # overtake our verdict on the way to a member, which would then keep the "ok"
            # else our sends go on (the last member to end its all-reduce waited a round trip for answers it
            # needs no more); the round trip is the fastest member's answer if one came by now
            rtt_s = sending.fastest.result() if sending.fastest.done() else math.nan
            future.set_result(({p: received[p] for p in peers if p in received}, rtt_s))
        except BaseException as e:
            future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def early_verdict(self, group_info: GroupInfo, metas: Sequence[RoundMeta],
                      averaged: Sequence[torch.Tensor]) -> None:
        """(averager process, the moment a group from the clock's all-reduce ended well) Send our verdict on the
        round to the other members now -- the planned group's :attr:`FixedGroup.rule` on the gathered ``metas`` and the
        ``averaged`` tensors, what the host's check reaches too -- instead of after the step's result has gone to the
        host and the verdict come back: the main job's verdicts took 0.09 s of a 0.5 s round, mostly those hops on a
        loaded machine. The host's exchange then only waits for the others' (:meth:`exchange_verdicts`). Nothing
        without a rule (matchmaking's groups; a group we did not plan)."""
        fixed = self.fixed_group(group_info.group_id)
        planned = self._offers.get(fixed.verdict_id) if fixed is not None else None
        rule = planned[0].rule if planned is not None else None
        if fixed is None or rule is None:
            return
        own = metas[group_info.peer_ids.index(self.peer_id)]
        decision = round_verdict(rule, own, metas, all(bool(torch.isfinite(t).all()) for t in averaged))
        verdict = ("ok" if decision.ok else decision.reason)[:MAX_VERDICT_CHARS]
        self._verdict_box(fixed.verdict_id)[0][self.peer_id.to_base58()] = verdict
        while len(self._early_verdicts) >= MAX_OFFER_WAITS:  # a host that never asked (it gave up on the round)
            del self._early_verdicts[next(iter(self._early_verdicts))]
        peers = tuple(p.to_base58() for p in group_info.peer_ids)
        self._early_verdicts[fixed.verdict_id] = (verdict, self._start_sending(fixed.verdict_id, peers, verdict,
                                                                                rule.send_timeout_s))

    def send_verdict(self, group_id: bytes, peers: tuple[str, ...], verdict: str, timeout_s: float) -> MPFuture:
        """(host) Send a later verdict (a withdrawn "ok") to the group's other members; it replaces the earlier one
        where it arrives. The future's result is the fastest answer's seconds (inf: nobody answered)."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_send_verdict_later", [], dict(future=future, group_id=group_id, peers=peers,
                                                                 verdict=verdict, timeout_s=timeout_s)))
        return future

    async def _send_verdict_later(self, future: MPFuture, group_id: bytes, peers: tuple[str, ...], verdict: str,
                                  timeout_s: float) -> None:
        try:
            self._verdict_box(group_id)[0][self.peer_id.to_base58()] = verdict[:MAX_VERDICT_CHARS]
            future.set_result(await self._send_verdict(group_id, peers, verdict, timeout_s))
        except BaseException as e:
            future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def _start_sending(self, group_id: bytes, peers: tuple[str, ...], verdict: str, timeout_s: float) -> Sending:
        """:meth:`_send_verdict` in the background."""
        fastest: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        done = asyncio.create_task(self._send_verdict(group_id, peers, verdict, timeout_s, fastest))
        self._sendings.add(done)
        done.add_done_callback(self._sendings.discard)
        return Sending(done, fastest)

    async def _send_verdict(self, group_id: bytes, peers: tuple[str, ...], verdict: str, timeout_s: float,
                            fastest: asyncio.Future[float] | None = None) -> float:
        """Send ``verdict`` to every other member at once (each within ``timeout_s``); the fastest answer's seconds,
        also set on ``fastest`` as it comes. A member that does not take it is silent to us as we are to it: its own
        deadline decides."""
        own = self.peer_id.to_base58()
        request = averaging_pb2.JoinRequest(group_key=group_id.hex(), gather=verdict[:MAX_VERDICT_CHARS].encode())

        async def send(peer: str) -> float:
            t0 = time.monotonic()
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            reply = await stub.rpc_group_verdict(request, timeout=timeout_s)
            if reply.code != averaging_pb2.ACCEPTED:
                raise MatchmakingException(f"verdict refused: {averaging_pb2.MessageCode.Name(reply.code)}")
            took_s = time.monotonic() - t0
            if fastest is not None and not fastest.done():
                fastest.set_result(took_s)
            return took_s

        sent = await asyncio.gather(*(send(p) for p in peers if p != own), return_exceptions=True)
        for peer, result in zip([p for p in peers if p != own], sent):
            if isinstance(result, BaseException):
                logger.debug("fragment %s: group %s: our verdict did not reach %s (%s: %s)", self.fragment,
                             group_id.hex(), peer, type(result).__name__, result)
        return min((r for r in sent if isinstance(r, float)), default=math.inf)

    def _verdict_box(self, group_id: bytes) -> tuple[dict[str, str], asyncio.Event]:
        """The verdicts received for ``group_id`` and the event set at each new one (older groups forgotten)."""
        now = time.monotonic()
        for old in [g for g, (_, _, since) in self._verdicts.items() if now - since > OFFER_KEEP_S]:
            del self._verdicts[old]
        if group_id not in self._verdicts:
            if len(self._verdicts) >= MAX_OFFER_WAITS:  # make room: the oldest group's are the least likely read
                del self._verdicts[next(iter(self._verdicts))]
            self._verdicts[group_id] = ({}, asyncio.Event(), now)
        received, event, _ = self._verdicts[group_id]
        return received, event

    async def rpc_group_verdict(self, request: averaging_pb2.JoinRequest,
                                context: P2PContext) -> averaging_pb2.MessageFromLeader:
        """A member's verdict on a group's round (a later one replaces the earlier: a withdrawn "ok")."""
        if await self._refuse(context, "a verdict"):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        try:
            group_id = bytes.fromhex(request.group_key)
            verdict = request.gather[:4 * MAX_VERDICT_CHARS].decode(errors="replace")[:MAX_VERDICT_CHARS]
        except ValueError:  # not hex
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        kept = self._offers.get(group_id)
        sender = context.remote_id.to_base58()
        if kept is not None and sender not in kept[0].peer_ids:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        received, event = self._verdict_box(group_id)
        received[sender] = verdict
        event.set()
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED, group_id=group_id)
