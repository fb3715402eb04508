"""The glue between the learner's fragments and the network: rounds through the fragment averagers,
catching up from donors, and what the learner logs about them.

Each fragment's state machine is a :class:`~p2p_diloco.sync.fragment.FragmentSync` (the same one the
simulator drives); its transport here is a :class:`FragmentLink` to the fragment's
:class:`~p2p_diloco.transport.network.Host` (the hivemind one: :mod:`p2p_diloco.transport.hivemind`), the only way
the engine reaches its network. :class:`Rounds` adds what only a networked learner knows: the other learners' records (a round nobody can join is not started; a fragment a peer
is ahead on is downloaded), the swarm clock's boundaries, the adaptive matchmaking window, events.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from p2p_diloco.averaging.decisions import (
    adapt_window,
    anchor_hash,
    anchor_order,
    is_ahead,
    round_is_doomed,
)
from p2p_diloco.averaging.linktime import (
    LinkHistory,
    LinkMeter,
    allreduce_bytes,
    expected_group_size,
    link_window_s,
    payload_bytes,
    sync_link_s,
)
from p2p_diloco.core import events
from p2p_diloco.core.groups import group_of, mixing_rounds, needs_download
from p2p_diloco.core.replay import KeptRound
from p2p_diloco.engine.catchup import apply_download, fetch_order
from p2p_diloco.core.config import Config
from p2p_diloco.engine.options import ROUND_POLL_S
from p2p_diloco.sync.fragment import BUSY, DROPPED, FETCH, ROUND, STARTED, Contribution, FragmentSync, Replica
from p2p_diloco.sync.slot import FragmentSlot
from p2p_diloco.transport.network import RoundContext, fragment_peers, fragment_ranks

if TYPE_CHECKING:
    from p2p_diloco.averaging.host import Download
    from p2p_diloco.averaging.plans import RoundOutcome
    from p2p_diloco.transport.network import Host, View

logger = logging.getLogger(__name__)

FETCH_RETRY_S = 2.0
"""Seconds between two download attempts of the same fragment (a failed one is retried after this)."""

DRAIN_SLICE_S = 0.2
"""Seconds :meth:`Rounds.drain` waits on one future before it applies what has finished."""

SHOW_STEPS = 2.0
"""Groups from the clock: a member's offer is awaited at least this many of the slowest live learner's steps past the
boundary (it hands off at its first step end past it). The window from the arrival spreads alone (1 s at least) was
shorter than one step of a half-speed learner under load: the main job lost 2 of 104 rounds of its 4 learners as "2
of 4 members showed". Waiting longer costs only when a member is really missing (one that skips the boundary says
so)."""

LINK_WAIT_SHARE = 0.5
"""A round due while our link is busy waits for it at most this share of its window past the boundary
(:func:`waits_for_link`): what is left of the window is the offer's way to the group's leader."""

Event = Callable[[events.Event], None]
"""Logs an event: the learner fills its envelope (``Learner._event``)."""


class FragmentLink:
    """A fragment's transport as its state machine sees it (:class:`~p2p_diloco.sync.fragment.Transport`): its
    :class:`~p2p_diloco.transport.network.Host`, given with each contribution the engine's snapshot at the hand-off
    (:meth:`context`: the host plans the round from it) and with each download our link estimate. Called on the
    training thread only."""

    def __init__(self, host: Host, rounds: Rounds, fragment: int) -> None:
        self.host, self.rounds, self.fragment = host, rounds, fragment

    def start_round(self, contribution: Contribution) -> Future[Any]:
        return self.host.start_round(contribution, self.context(contribution.fragment))

    def context(self, fragment: int) -> RoundContext:
        """What a round of ``fragment`` handed off now is planned from: the time, our matchmaking window and link
        estimate, and the view's clock, roster and ranks; the round's doomed check polls the view's ranks
        (:func:`~p2p_diloco.transport.network.fragment_ranks`), never the engine's state."""
        r = self.rounds
        return RoundContext(due=r.dht_time(), window_s=r.window_s, link=r.link.estimate(), clock=r.view.clock,
                            fragments=len(r.syncs), own_id=r.own_id, roster=tuple(r.roster()),
                            peers=tuple(fragment_peers(r.view, fragment)),
                            live_ranks=functools.partial(fragment_ranks, r.view, fragment))

    def decline(self, fragment: int) -> None:
        """We skip ``fragment``'s round due now: its group hears so (:meth:`~p2p_diloco.transport.network.Host.decline`)."""
        self.host.decline(self.context(fragment))

    def leave(self) -> None:
        """We are done with the fragment's rounds for good: the groups that still count on us hear so
        (:meth:`~p2p_diloco.transport.network.Host.leave`)."""
        self.host.leave()

    def fetch_state(self, ours: tuple[int, str]) -> Future[Any]:
        """Download a state ahead of ``ours`` from the other live learners our view holds, ranked by what it saw them
        hold (the download tries the best first and checks what it gets)."""
        donors = dict(fragment_peers(self.rounds.view, self.fragment))
        r = self.rounds
        replay = r.cfg.averaging.kept_rounds > 0 and ours != r.syncs[self.fragment].slot.no_replay_from
        return self.host.fetch_state(ours, donors, self.rounds.link.estimate(), replay=replay)

    def anchor_changed(self, version: int, anchor_hash: str) -> None:
        """Our anchor moved (a commit, a checked download, the start or a verified restore): vouch for it -- what a
        peer downloading it from another donor checks. Version 0 is everyone's seeded start: nobody downloads it."""
        if version > 0:
            self.host.vouch(version, anchor_hash)


def _round_event(outcome: RoundOutcome, slot: FragmentSlot, tokens_sent: int, steps_sent: int) -> events.RoundEvent:
    """The ``round`` event of ``outcome`` (:meth:`RoundOutcome.event`'s fields), applied to ``slot``."""
    o, finite = outcome, events.finite_or_none
    return events.RoundEvent(
        fragment=o.fragment, version=o.version, reason=o.reason, group_size=o.group_size, peers=tuple(o.peers),
        absent=o.absent,
        own_share=o.own_share, weights=tuple(o.weights), bytes_sent=o.bytes_sent, bytes_received=o.bytes_received,
        duration_s=o.duration_s, arrival_spread_s=finite(o.arrival_spread_s),
        waited_s=finite(o.waited_s), setup_s=finite(o.setup_s), verdicts_s=finite(o.verdicts_s),
        meet_s=finite(o.meet_s), handback_s=finite(o.handback_s), allreduce_end=finite(o.allreduce_end),
        window_s=o.window_s,
        allreduce_s=finite(o.allreduce_s), part_bytes=o.part_bytes, rtt_s=finite(o.rtt_s),
        timeouts=o.timeouts.event() if o.timeouts is not None else None, version_after=slot.version,
        group_distance=finite(o.group_distance), outcome="committed" if o.committed else "discarded",
        anchor_hash=slot.anchor_hash, tokens_sent=tokens_sent, steps_sent=steps_sent)


class Rounds:
    """Every fragment's rounds and downloads on a networked learner (called from the training thread)."""

    def __init__(self, cfg: Config, slots: Sequence[FragmentSlot], replica: Replica, hosts: Sequence[Host],
                 view: View, config_hash: str, started_at: float, event: Event,
                 dht_time: Callable[[], float], own_id: str) -> None:
        self.cfg, self.view, self.config_hash, self.started_at = cfg, view, config_hash, started_at
        self.event, self.dht_time = event, dht_time
        self.own_id = own_id
        """Our peer id."""
        self.hosts = list(hosts)
        self.links = [FragmentLink(h, self, f) for f, h in enumerate(hosts)]
        self.syncs = [FragmentSync(s, replica, cfg.outer, link, hash_anchor=anchor_hash)
                      for s, link in zip(slots, self.links)]
        self.spread_window_s = cfg.averaging.window_s
        """The matchmaking window the members' arrival spreads call for (:func:`adapt_window`)."""
        self.grid = cfg.averaging.groups == "grid"
        self.spreads: list[float] = []
        self.deferred: dict[int, float] = {}
        """Fragments due whose round waits for the link (:func:`waits_for_link`) -> until when, DHT time."""
        self.link = LinkHistory()
        """Throughput and round trips seen in our rounds: every round's timeouts are derived from them."""
        self.meter = LinkMeter()
        """Our averagers' byte counters as we step: what the link carried while a round ran (:meth:`apply_round`)."""
        self.last_sync_time = 0.0
        """DHT time of our last committed round (0.0: none yet); published, ``status`` shows its age."""
        self.first_contribution_s: float | None = None
        self.advertise()

    @property
    def slots(self) -> list[FragmentSlot]:
        return [s.slot for s in self.syncs]

    @property
    def window_s(self) -> float:
        """The next round's matchmaking window: what the arrival spreads call for, and at least what the link
        needs for a join request (:func:`link_window_s`); with groups from the clock, at least :data:`SHOW_STEPS` of
        the slowest live learner's steps."""
        return self._window_for(*self.one_sync())

    def _window_for(self, payloads: list[float], group: int) -> float:
        moved = max((allreduce_bytes(p, group) for p in payloads), default=0.0)
        steps = [s for _, _, s in self.view.peer_steps if s > 0] if self.cfg.averaging.clock_groups else []
        return max(self.spread_window_s, link_window_s(self.link.measured(), self.cfg.averaging, moved),
                   SHOW_STEPS * max(steps, default=0.0))

    def sync_link_s(self) -> float:
        """Seconds one sync of every fragment takes us (each one's window, if any, and link time), from what our rounds
        measured (0.0 before any round ended; :meth:`LinkHistory.measured`: a link too slow for any round to commit
        still gets a longer period). Not from the prior before that: a first period planned for the prior's 1 Mbit/s
        delayed the main job's first contributions (61 s after start, not 40 s); a slow link's first rounds go one at
        a time instead (:func:`link_busy`)."""
        if not self.link.throughputs and not self.link.failures:
            return 0.0
        payloads, group = self.one_sync()  # groups from the clock wait out no window: they start once all are in
        return sync_link_s(payloads, group, self.link.measured(),
                           0.0 if self.cfg.averaging.clock_groups else self._window_for(payloads, group),
                           overhead_s=self.link.round_overhead_s())

    def final_rounds_in_turn(self) -> bool:
        """Should the final rounds (every fragment's, at once at the end) go one after another? Yes where our
        measured link would take longer than a sender may be silent (``averaging.next_chunk_timeout_s``) to move
        all of them: each round's deadlines assume the link to itself (at 0.5 Mbit/s the four final rounds at
        once ended as partial all-reduces). Not before a round was measured."""
        if not self.link.throughputs:
            return False
        return sync_link_s(*self.one_sync(), self.link.measured()) > self.cfg.averaging.next_chunk_timeout_s

    def one_sync(self) -> tuple[list[float], int]:
        """One sync of every fragment: each round's wire payload (bytes) and the group it will likely have."""
        tensors_per_name = 3 if self.grid else 1  # grid rounds average the anchor and momentum too
        payloads = [payload_bytes(tensors_per_name * sum(s.anchor[n].numel() for n in s.names), self.cfg.outer.codec)
                    for s in self.slots]
        group = expected_group_size(max((len(self.peer_ranks(s)) for s in self.slots), default=0), self.cfg.averaging)
        return payloads, group

    def advertise(self) -> None:
        """Advertise every fragment's anchor as donor priority and vouch for it (at the start, after a verified
        restore: a restarted peer renews the vouches of the anchors it committed)."""
        for sync, link in zip(self.syncs, self.links):
            link.anchor_changed(*sync.slot.rank)

    # ------------------------------------------------------------ hand off

    def hand_off(self, sync: FragmentSync, step: int, final: bool = False) -> None:
        """Start a background round with this fragment's pseudo-gradient (never waits for it), unless we have
        not seen the swarm yet, a live peer is ahead of us (round_is_doomed), or (but for ``final`` rounds) the link is
        taken."""
        slot = sync.slot
        self.deferred.pop(slot.index, None)
        if self.view.swarm_reads == 0:  # a newcomer that has not seen the swarm yet may be behind: fetch first
            logger.info("fragment %d due at step %d before our first look at the swarm; its progress waits for the "
                        "next round", slot.index, step)
            return
        if self.grid and not grid_round_possible(self, sync, step):
            return
        busy = "" if final else link_busy(self, slot)
        if (busy or (not final and transfer_on_link(self, slot))) and waits_for_link(self, slot):
            return
        if busy:
            logger.info("fragment %d due at step %d: %s; its progress waits for the next round", slot.index, step, busy)
            self.links[slot.index].decline(slot.index)
            return
        if not self.grid and slot.inflight is None and round_is_doomed(slot.rank, self.peer_ranks(slot)):
            slot.behind_skips += 1  # catch_up downloads the fragment; our progress goes into its next round
            best = self._best_peer_rank(slot)
            logger.info("fragment %d due at step %d at v%d but a live peer is at v%d (%s): we catch up instead of a "
                        "round that would fork or find nobody; its progress waits for the next round", slot.index,
                        step, slot.version, best[0], best[1])
            return
        what = slot.inflight_kind
        handed = sync.hand_off(step)
        if handed.status == STARTED:
            slot.inflight_since = slot.last_round_at = self.dht_time()
        if handed.status == BUSY:
            logger.info("fragment %d due at step %d but its last %s is still in flight; its progress waits for the "
                        "next round", slot.index, step, what)
            self.links[slot.index].decline(slot.index)
        elif handed.status == DROPPED:  # never sent: the fragment restarts from its anchor, fresh AdamW moments
            self.event(events.LocalDropEvent(fragment=slot.index, version=slot.version, reason=handed.reason))
            logger.warning("fragment %d at step %d: %s; dropped, fragment re-anchored", slot.index, step,
                           handed.reason)

    def roster(self) -> list[str]:
        """The live learners we know of, us included: the cells of the grid groups."""
        return sorted({self.own_id, *self.view.peer_ids})

    # ------------------------------------------------------------ collect and apply

    def collect(self, step: int, min_age_steps: int) -> None:
        """Apply finished rounds at least ``min_age_steps`` after they were sent, and finished downloads (first marking
        our averagers' byte counters for the link meter: a round applied now ended before this mark)."""
        self.meter.mark(time.monotonic(), self.bytes_total)
        for sync in self.syncs:
            done = sync.finished(step, min_age_steps)
            if done is None:
                continue
            if done.kind == ROUND:
                self.apply_round(sync, done.future.result())
                continue
            try:
                download: Download = done.future.result()
            except Exception as e:  # a failed download changes nothing; we retry later
                self.event(events.ResyncEvent(fragment=sync.index, outcome="failed",
                                              reason=f"{type(e).__name__}: {e}"[:300]))
                logger.warning("fragment %d: state download failed: %s: %s", sync.index, type(e).__name__, e)
                continue
            apply_download(sync, download, self.event, self.hosts[sync.index].keep_round)

    def wait_rounds(self, stop: threading.Event, step: int) -> None:
        """Blocking mode: wait until every round in flight has ended (its own timeouts bound this), then apply."""
        for slot in self.slots:
            while slot.inflight is not None and slot.inflight_kind == ROUND and not stop.is_set():
                if wait_futures([slot.inflight], timeout=ROUND_POLL_S).done:
                    break
        self.collect(step, min_age_steps=0)

    def drain(self, step: int) -> None:
        """Wait for everything in flight and apply it (only at the end: training has stopped)."""
        while any(s.inflight is not None for s in self.slots):
            for s in self.slots:
                if s.inflight is not None:  # wait in slices; collect() below applies it, or logs why it failed
                    wait_futures([s.inflight], timeout=DRAIN_SLICE_S)  # (a download cut by our leaving raises)
            self.collect(step, min_age_steps=0)

    def apply_round(self, sync: FragmentSync, outcome: RoundOutcome) -> None:
        """Commit: outer Nesterov step on the anchor, alpha-mix into the weights. Discard: nothing changes."""
        slot = sync.slot
        sent_tokens, sent_steps, base = slot.sent_tokens, slot.sent_steps, slot.rank
        sync.apply_round(outcome)
        if outcome.committed:
            if not self.grid and outcome.merged is not None:  # served to peers that missed it (core.replay)
                self.hosts[slot.index].keep_round(KeptRound(*base, slot.anchor_hash, dict(outcome.merged)))
            if self.grid and math.isfinite(outcome.group_distance):
                slot.consensus_distance = outcome.group_distance
            self.last_sync_time = self.dht_time()
            if self.first_contribution_s is None:  # when the round committed, not when we got to applying it
                ended = outcome.finished_at if math.isfinite(outcome.finished_at) else time.monotonic()
                self.first_contribution_s = ended - self.started_at
                self.event(events.FirstContributionEvent(fragment=slot.index,
                                                         seconds_since_start=round(self.first_contribution_s, 3)))
                logger.info("first contribution: fragment %d committed %.1f s after this learner started",
                            slot.index, self.first_contribution_s)
            if math.isfinite(outcome.arrival_spread_s):
                self.spreads.append(outcome.arrival_spread_s)
                self.spread_window_s = adapt_window(self.spreads, self.cfg.averaging)
        self.link.observe(committed=outcome.committed, bytes_moved=max(outcome.bytes_sent, outcome.bytes_received),
                          allreduce_s=outcome.allreduce_s, rtt_s=outcome.rtt_s, duration_s=outcome.duration_s,
                          link_Bps=self._link_during(outcome))
        self.event(_round_event(outcome, slot, sent_tokens, sent_steps))
        logger.info("round f%d v%d %s: group %d, share %.2f, %d B out / %d B in, %.2f s; %s", outcome.fragment,
                    outcome.version, "committed" if outcome.committed else "discarded", outcome.group_size,
                    outcome.own_share, outcome.bytes_sent, outcome.bytes_received, outcome.duration_s, outcome.reason)

    def _link_during(self, outcome: RoundOutcome) -> float | None:
        """What the link carried while ``outcome``'s all-reduce ran, every round of ours together (None if not known):
        it ended before the verdicts."""
        if not (outcome.committed and math.isfinite(outcome.finished_at) and math.isfinite(outcome.allreduce_s)):
            return None
        end = outcome.finished_at - (outcome.verdicts_s if math.isfinite(outcome.verdicts_s) else 0.0)
        return self.meter.rate(end - outcome.allreduce_s, end)

    # ------------------------------------------------------------ catching up

    def catch_up(self) -> None:
        """Download fragments on which a live peer's record is ahead of us: a newer version, or the same
        version with a winning anchor (a fork; see :func:`~p2p_diloco.averaging.decisions.anchor_order`)."""
        now = time.monotonic()
        for sync in (self.syncs[i] for i in fetch_order(self.slots)):
            slot = sync.slot
            if slot.pending is not None and self._adopt_pending(sync):
                continue
            best = self._best_peer_rank(slot)
            if slot.inflight is not None or not is_ahead(best, slot.rank) or now - slot.last_fetch_try < FETCH_RETRY_S:
                continue
            if self.grid and not needs_download(slot.version, best[0], self.max_lag_rounds()):
                continue  # grid groups: a small lag is averaged away in our next rounds
            fetching = [s.index for s in self.slots if s.inflight is not None and s.inflight_kind == FETCH]
            if fetching and downloads_in_turn(self):
                continue  # after fragment fetching[0]'s: together they would not fit the link
            slot.last_fetch_try = now
            what = "a fork: its anchor wins" if best[0] == slot.version else "fetching its anchor"
            logger.info("fragment %d: we are at v%d (%s), a peer is at v%d (%s): %s", slot.index, slot.version,
                        slot.anchor_hash, best[0], best[1], what)
            sync.start_fetch()
            slot.inflight_since = self.dht_time()

    def _adopt_pending(self, sync: FragmentSync) -> bool:
        """A round we discarded for want of verdicts, if a live peer holds exactly its result: that member read
        every "ok" and committed it, so we commit it too (:meth:`FragmentSync.adopt_pending`). In a swarm of two
        this is the only way back: nobody else could vouch for a download of that version. True if adopted."""
        slot = sync.slot
        pending = slot.pending
        assert pending is not None
        if pending.base != slot.rank:  # we moved on (a commit or a download): its base is gone
            slot.pending = None
            return False
        if slot.inflight is not None or pending.rank not in self.peer_ranks(slot):
            return False
        old, old_hash = slot.rank
        sync.adopt_pending()
        self.last_sync_time = self.dht_time()
        self.event(events.LateCommitEvent(fragment=slot.index, version=old, version_after=slot.version,
                                          anchor_hash_before=old_hash, anchor_hash=slot.anchor_hash))
        logger.info("fragment %d: a peer committed the round we discarded for want of its verdict; committed it too: "
                    "v%d (%s) -> v%d (%s)", slot.index, old, old_hash, slot.version, slot.anchor_hash)
        return True

    def max_lag_rounds(self) -> int:
        """Grid groups: how many versions a learner may lag the newest live one and catch up by averaging
        (:func:`~p2p_diloco.core.groups.mixing_rounds`); past it, it downloads."""
        return mixing_rounds(len(self.roster()), self.cfg.averaging.target_group_size)

    def peer_ranks(self, slot: FragmentSlot) -> list[tuple[int, str]]:
        """This fragment's (version, anchor hash) in the other live learners' records."""
        return fragment_ranks(self.view, slot.index)

    def _best_peer_rank(self, slot: FragmentSlot) -> tuple[int, str]:
        """The most advanced (version, anchor hash) of this fragment among the live learners' records (ours if
        none is known)."""
        return max(self.peer_ranks(slot), key=lambda r: anchor_order(*r), default=slot.rank)

    def peers_settled(self) -> bool:
        """Every other live learner is leaving, at our versions and anchors (grid groups: anchors converge, they are
        not the same; leaving is enough)."""
        ours = [s.rank for s in self.slots]
        return all(state == "leaving" for state in self.view.peer_states) and (self.grid or all(
            list(v) == ours for v in self.view.peer_anchors))

    # ------------------------------------------------------------ the averagers

    def cancel(self) -> None:
        """Leaving: every round and download in flight ends at once, discarded (each one's worker looks every
        ``CANCEL_POLL_S``), and none starts; the log names each one. Waits for none of them."""
        for slot in self.slots:
            if slot.inflight is not None and not slot.inflight.done():
                what = "round" if slot.inflight_kind == ROUND else "state download"
                logger.info("leaving: cancelled the %s in flight of fragment %d (v%d): discarded",
                            what, slot.index, slot.version)
        for h in self.hosts:
            h.cancel()

    def bytes_total(self) -> tuple[int, int]:
        """(sent, received) bytes of every fragment's averager."""
        totals = [h.bytes_total() for h in self.hosts]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    def shutdown(self) -> None:
        """Stop every fragment's host; what is still in flight is cancelled first (:meth:`Host.shutdown`)."""
        for h in self.hosts:
            h.cancel()  # all at once: each averager's stop takes a while
        for h in self.hosts:
            h.shutdown()


def grid_round_possible(rounds: Rounds, sync: FragmentSync, step: int) -> bool:
    """Grid groups: a round needs the clock (its boundary names the group) and a group of two or more."""
    clock, slot = rounds.view.clock, sync.slot
    if clock is None:
        logger.info("fragment %d due at step %d before the sync clock is known; its progress waits for the next "
                    "round", slot.index, step)
        return False
    now = rounds.dht_time()
    group = group_of(rounds.own_id, rounds.roster(), clock.round_index(now, slot.index, len(rounds.syncs)),
                     rounds.cfg.averaging.target_group_size, rounds.hosts[slot.index].prefix)
    if len(group) < max(2, rounds.cfg.averaging.min_group_size):
        slot.behind_skips += 1
        logger.info("fragment %d due at step %d: our grid group this round is %d learner(s); its progress waits "
                    "for the next round", slot.index, step, len(group))
        return False
    return True


def link_busy(rounds: Rounds, slot: FragmentSlot) -> str:
    """Why ``slot``'s round must not start now: another fragment of ours still has a round or a download on the link,
    and either no round of ours has measured the link yet or the measured link needs longer for a sync's rounds
    than the clock's period leaves (their transfers back to back and a round's measured overhead,
    :func:`~p2p_diloco.averaging.linktime.sync_link_s`; no window: a round from the clock has none; not the period's
    safety factor, which is the leader's margin: a period within it is one the leader leaves alone, and declining
    there lost rounds the link could carry). Two transfers share a link that carries one and both miss their
    deadlines: at
    0.5 Mbit/s with 1 s queues the four fragments' first rounds overlapped (the first period is derived before
    anything is measured), ran 30-45 s each and failed, then the period grew to 200 s. One waits instead and its
    progress goes into the next round. Empty: it may start (on a link that carries a sync per period: loopback once
    a round ended, where a first round takes a fraction of the fragments' spacing anyway)."""
    clock = rounds.view.clock
    others = on_link(rounds, slot)
    if clock is None or not others:
        return ""
    if not rounds.link.throughputs:
        return f"fragment {others[0].index} is still on the link, which no round of ours has measured yet"
    payloads, group = rounds.one_sync()
    need_s = sync_link_s(payloads, group, rounds.link.measured(), overhead_s=rounds.link.round_overhead_s())
    if need_s <= clock.period_s:
        return ""
    return (f"fragment {others[0].index} is still on the link, whose transfers of a sync need {need_s:.1f} s of a period of "
            f"{clock.period_s:.1f} s")


def transfer_on_link(rounds: Rounds, slot: FragmentSlot) -> str:
    """Why ``slot``'s round, on a link that carries a sync per period (:func:`link_busy` is empty), should wait a
    little: another fragment's round or download started less than its data's link time ago (:func:`transfer_s`, at
    the measured throughput). Rounds pipeline past each other's coordination, not their data. It only waits
    (:func:`waits_for_link`), and then starts: rounds that came due together -- deferred ones, or boundaries at a
    retune -- ran together at 0.25 Mbit/s for 22-26 s and one failed, but declining them instead lost more (a member
    that declines fails its group's round where half of it is left; at 0.5 Mbit/s 85% of rounds committed against
    93% without the rule, one run each). Empty where nothing of ours is on the link or it was never measured."""
    others = on_link(rounds, slot)
    if not others or not rounds.link.throughputs:
        return ""
    payloads, group = rounds.one_sync()
    rate, now = rounds.link.measured().throughput_Bps, rounds.dht_time()
    for other in others:
        data_s = transfer_s(other, payloads[other.index], group, rate)
        if now - other.inflight_since < data_s:
            return (f"fragment {other.index}'s transfer is still on the link ({now - other.inflight_since:.1f} s of "
                    f"about {data_s:.1f} s)")
    return ""


def on_link(rounds: Rounds, slot: FragmentSlot) -> list[FragmentSlot]:
    """Our other fragments with a round or download in flight."""
    return [s for s in rounds.slots if s is not slot and s.inflight is not None]


def transfer_s(slot: FragmentSlot, payload: float, group: int, throughput_Bps: float) -> float:
    """Seconds the data of ``slot``'s round (wire ``payload`` bytes among ``group``) or download (its fp32 anchor and
    momentum, an upper bound: a replay is smaller) holds the link at ``throughput_Bps``."""
    moved = allreduce_bytes(payload, group) if slot.inflight_kind == ROUND else state_bytes(slot)
    return moved / throughput_Bps


def state_bytes(slot: FragmentSlot) -> int:
    """A download's bytes of ``slot``: its anchor and momentum in fp32."""
    return sum(2 * 4 * slot.anchor[n].numel() for n in slot.names)


def downloads_in_turn(rounds: Rounds) -> bool:
    """Should state downloads go one at a time? Yes where the link -- as measured, the prior's 1 Mbit/s before
    any round -- would take longer than a sender may be silent (``averaging.next_chunk_timeout_s``) to move every
    fragment's state (anchor and momentum, fp32) at once: at 0.5 Mbit/s with 1 s queues a learner behind on three
    fragments downloaded them together, 1.7 MB each from donors whose uplinks carried their own rounds, and every
    donor went silent for 10 s on every try for two minutes. On a fast link they go together."""
    every = sum(state_bytes(s) for s in rounds.slots)
    return every / rounds.link.measured().throughput_Bps > rounds.cfg.averaging.next_chunk_timeout_s


def waits_for_link(rounds: Rounds, slot: FragmentSlot) -> bool:
    """Groups from the clock: should ``slot``'s round, due while the link is busy (:func:`link_busy`), wait for it
    rather than be declined? Yes until :data:`LINK_WAIT_SHARE` of the round's window past its boundary -- its group's
    leader awaits our offer until the window's end -- and the caller hands it off again each step
    (:attr:`Rounds.deferred`). A round of another fragment that ran a little past its spacing made this learner alone
    decline a boundary the others met: the group went on without it and it fell a version behind (at 1 Mbit/s with 1 s
    queues, then a 1.85 MB download on a link the others' rounds needed)."""
    clock = rounds.view.clock
    if not rounds.cfg.averaging.clock_groups or clock is None:
        return False
    now = rounds.dht_time()
    until = clock.boundary(now, slot.index, len(rounds.syncs)) + LINK_WAIT_SHARE * rounds.window_s
    if now >= until:
        return False
    rounds.deferred[slot.index] = until
    return True


FINAL_WAIT_LOOK_S = 1.0
"""A final round's wait for its boundary looks at the clock again this often (the status thread adopts a retune)."""


def final_rounds(rounds: Rounds, step: int, stop: threading.Event, wait_until: float = math.inf) -> None:
    """Leaving: every fragment with unsynced progress hands its last round off (one after another where together they
    would not fit the link, :meth:`Rounds.final_rounds_in_turn`), and they are waited for. With groups from the clock
    each waits for its fragment's next boundary first: its group is the one the clock names there, with the learners
    still training or leaving at the same time (a round handed off between boundaries names a group nobody else
    does); a boundary just passed still takes it while its group is open (within the window), unless we were in that
    boundary's round already: at 0.25 Mbit/s a learner whose time ran out just after its round at a boundary handed
    its final round off to that boundary again, alone ("1 of 4 members showed"), and left before the others' final
    round of the fragment at the next one (it ended a version behind them). A fragment whose boundary comes after
    ``wait_until`` (monotonic; :attr:`~p2p_diloco.engine.options.SyncOptions.final_wait_s` after training ended)
    skips its final round: its last round was then less than a period before it, and waiting for it on a slow link's
    long period held a learner a whole period past its time limit (at 0.25 Mbit/s, 46 s periods: its final line 71 s
    after it). Returns early on ``stop``."""
    in_turn = rounds.final_rounds_in_turn()

    def boundary_in(sync: FragmentSync) -> float:
        """Seconds from now to the boundary ``sync``'s final round goes to (a passed one whose group is open: <= 0;
        without a clock, matchmaking finds the group at once: -inf)."""
        clock = rounds.view.clock if rounds.cfg.averaging.clock_groups else None  # as it is now: a retune moves it
        if clock is None:
            return -math.inf
        now, f, fragments = rounds.dht_time(), sync.slot.index, len(rounds.syncs)
        passed = clock.boundary(now, f, fragments)
        if 0.0 <= now - passed <= rounds.window_s and sync.slot.last_round_at < passed:  # its group is still open
            return passed - now
        return clock.boundary(now + clock.period_s, f, fragments) - now

    for sync in sorted((s for s in rounds.syncs if s.slot.since_steps > 0), key=boundary_in):
        # looked at again each second: the clock may be retuned meanwhile
        while (left_s := boundary_in(sync)) > 0 and time.monotonic() + left_s <= wait_until:
            if stop.wait(min(left_s, FINAL_WAIT_LOOK_S)):
                return
        if time.monotonic() + left_s > wait_until:  # the boundary comes (or, an earlier round in turn, came) too late
            logger.info("final round of fragment %d skipped: its boundary is %.0f s past the wait for final rounds; "
                        "its last %d steps stay unsynced", sync.slot.index, time.monotonic() + left_s - wait_until,
                        sync.slot.since_steps)
            continue
        rounds.hand_off(sync, step, final=True)
        if in_turn:
            rounds.drain(step)
    rounds.drain(step)
