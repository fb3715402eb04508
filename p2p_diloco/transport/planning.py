"""How a transport plans a round of a :class:`~p2p_diloco.sync.fragment.Contribution`: pure functions of the
contribution and the engine's snapshot at its hand-off (:class:`~p2p_diloco.transport.network.RoundContext`).

A round is scheduled on the swarm clock's boundary (everyone due at it starts at the same instant) or one matchmaking
window from now; its timeouts are derived from what it must move and what the link did in earlier rounds
(:mod:`~p2p_diloco.averaging.linktime`); a grid round meets under its grid group's key; a round at a rank no live peer
holds any more is abandoned while it still matches (:func:`~p2p_diloco.averaging.decisions.round_is_doomed`, polled
on the round's worker thread through the view's read-only ranks, never the engine's state).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

from p2p_diloco.averaging.decisions import grid_group_bits, peers_at_rank, round_is_doomed
from p2p_diloco.averaging.plans import RoundOutcome, RoundPlan
from p2p_diloco.averaging.linktime import allreduce_bytes, expected_group_size, payload_bytes, round_timeouts
from p2p_diloco.core.config import Config
from p2p_diloco.core.groups import clock_group, group_of
from p2p_diloco.sync.fragment import Contribution
from p2p_diloco.transport.network import Rank, RoundContext


def grid_group(context: RoundContext, round_index: int, target_group_size: int, prefix: str) -> tuple[str, ...]:
    """Grid groups: our group of this round among the live learners the engine knew of
    (:func:`~p2p_diloco.core.groups.group_of`, salted with the fragment's key ``prefix``)."""
    return group_of(context.own_id, context.roster, round_index, target_group_size, prefix)


class LastGroup:
    """Groups from the clock: the members of a fragment's last committed round and the version it committed to.
    They hold what we hold after it (a group's anchors are identical) until they move on; their records say so only
    at their next heartbeat -- seconds, several rounds on fast steps --, so planning counts them at our rank
    meanwhile (:func:`with_last_group`), as each of them counts us: the members of a group name the same next one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[int, tuple[str, ...]] = (-1, ())

    def watch(self, round_: Future[RoundOutcome]) -> Future[RoundOutcome]:
        """Remember ``round_``'s group once it ends committed; returns it."""
        round_.add_done_callback(self._ended)
        return round_

    def _ended(self, round_: Future[RoundOutcome]) -> None:
        if round_.cancelled() or round_.exception() is not None:
            return
        outcome = round_.result()
        if outcome.committed:
            with self._lock:
                self._last = (outcome.version + 1, outcome.peers)

    def get(self) -> tuple[int, tuple[str, ...]]:
        """(the version the last committed round led to, its members' peer ids); (-1, ()) before one."""
        with self._lock:
            return self._last


def with_us(last: tuple[int, tuple[str, ...]], version: int) -> tuple[str, ...]:
    """The members of our last committed round (``last``: :meth:`LastGroup.get`) if it led to ``version``, the one we
    hold: they hold it too until they move on, whatever their records say; else ()."""
    led_to, members = last
    return members if led_to == version else ()


def with_last_group(context: RoundContext, ours: Rank, last: tuple[int, tuple[str, ...]]) -> RoundContext:
    """``context`` with the members of our last committed round (``last``: :meth:`LastGroup.get`) at our rank where
    their records still show an older version, when ``ours`` (the version and anchor our round starts from) is where
    that round led."""
    members = with_us(last, ours[0])
    if not members:
        return context
    return replace(context, peers=tuple((p, ours if p in members and r[0] < ours[0] else r) for p, r in context.peers))


def clock_boundary_ms(fragment: int, context: RoundContext, cfg: Config) -> int:
    """Groups from the clock: the boundary of ``fragment`` a hand-off now falls in, in DHT milliseconds -- the clock's
    round, named so that a retuned clock's rounds never share a name with the old one's; -1 under matchmaking or
    before the clock is known (matchmaking finds the group)."""
    clock = context.clock
    if not cfg.averaging.clock_groups or clock is None:
        return -1
    return round(clock.boundary(context.due, fragment, context.fragments) * 1000)


def planned_group(ours: Rank, fragment: int, context: RoundContext, cfg: Config, prefix: str,
                  last_group: tuple[int, tuple[str, ...]] = (-1, ())) -> tuple[str, tuple[str, ...]]:
    """Groups from the clock: ``(group id, members)`` of our round of ``fragment`` at ``ours`` handed off now
    (:func:`~p2p_diloco.core.groups.clock_group` of the clock's round and the ranks the snapshot holds, the members of
    our last committed round counted at our rank: :func:`with_last_group`); ``("", ())`` under matchmaking or before
    the clock is known."""
    clock = context.clock
    if not cfg.averaging.clock_groups or clock is None:
        return "", ()
    context = with_last_group(context, ours, last_group)
    # the round is named by its boundary's instant, not by the clock's round index: a retuned clock counts its rounds
    # from its new origin, and a fragment that stayed at its version through the retune then planned a group of the
    # same id as a round before it (its leader answered with that round's decision: "our own metadata is not among
    # the gathered", on slow links whose period was retuned)
    return clock_group(prefix, fragment, ours, clock_boundary_ms(fragment, context, cfg), context.own_id,
                       dict(context.peers))


def plan_round(contribution: Contribution, context: RoundContext, cfg: Config, prefix: str,
               last_group: tuple[int, tuple[str, ...]] = (-1, ())) -> RoundPlan:
    """The plan of a round of ``contribution`` (its ``tensors`` are what the round moves): scheduled on the clock's
    boundary when there is a clock (at least a join request's time from now), else one window from now; timeouts from
    the bytes it moves and the engine's link estimate; with grid groups, the group key of our grid group at the
    boundary (raises ``ValueError`` without a clock: the engine starts no grid round then); otherwise the doomed check
    and the quorum's count of live learners at our rank; and our link's measured throughput, which the group sizes its
    all-reduce's parts by."""
    a, c, now = cfg.averaging, contribution, context.due
    ours = (c.version, c.anchor_hash)
    group_id, members = planned_group(ours, c.fragment, context, cfg, prefix, last_group)
    if a.clock_groups:  # under matchmaking, the quorum counts what the records show (as it always did)
        context = with_last_group(context, ours, last_group)
    clock = context.clock
    boundary = clock.boundary(now, c.fragment, context.fragments) if clock is not None else None
    bits, grid = "", a.groups == "grid"
    if grid:
        if clock is None or boundary is None:
            raise ValueError(f"fragment {c.fragment}: a grid round needs the sync clock (its boundary names the group)")
        group = grid_group(context, clock.round_index(now, c.fragment, context.fragments), a.target_group_size, prefix)
        bits = grid_group_bits(round(boundary * 1000), group[0])
    window_s = context.window_s
    if boundary is not None:
        scheduled = max((boundary if boundary <= now else now) + window_s, now + a.request_timeout_s)
    else:
        scheduled = now + window_s
    payload = payload_bytes(sum(t.numel() for t in c.tensors.values()), cfg.outer.codec)
    group_size = expected_group_size(len(context.peer_ranks), a)
    timeouts = round_timeouts(allreduce_bytes(payload, group_size), context.link, a, window_s)
    doomed = None if grid else doomed_check(ours, context.live_ranks)
    # a group from the clock has its own rule: more than half of the members it names (core.groups.without_absent)
    at_rank = 0 if grid or members else peers_at_rank(ours, context.peer_ranks)
    link_Bps = context.link.throughput_Bps if context.link.throughput_samples else 0.0  # the prior is no measure
    return RoundPlan(scheduled, window_s, due=now, doomed=doomed, timeouts=timeouts, group_bits=bits, at_rank=at_rank,
                     group_id=group_id, members=members, boundary_ms=clock_boundary_ms(c.fragment, context, cfg),
                     link_Bps=link_Bps)


def doomed_check(ours: Rank, live_ranks: Callable[[], Sequence[Rank]]) -> Callable[[], bool]:
    """The round's doomed check (:attr:`RoundPlan.doomed`): :func:`round_is_doomed` of ``ours`` against the ranks the
    view holds when it is polled (a read-only look, from the round's worker thread)."""
    return lambda: round_is_doomed(ours, live_ranks())
