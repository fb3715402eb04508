"""The sync clock as one learner holds it: adopted from what the status thread reads in the DHT, and -- while this
learner leads it -- derived from the swarm's step and link times and published (:mod:`p2p_diloco.net.clock` holds
the pure rules; :class:`~p2p_diloco.engine.view.SwarmView` owns one and calls it from its status thread)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import TYPE_CHECKING, Any, Protocol

from p2p_diloco.core import events
from p2p_diloco.engine.options import CLOCK_LEADER_FRESH_S, CLOCK_READ_EVERY, CLOCK_REPUBLISH_S, CLOCK_START_MARGIN_S
from p2p_diloco.net.clock import (
    SyncClock,
    awaits_links,
    clock_in,
    clock_publisher,
    derive_period,
    leads_clock,
    min_period_s,
    needs_retune,
    publish_clock,
    retune,
    retune_allowed,
    unmeasured_period_s,
)

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config
    from p2p_diloco.engine.options import SyncOptions
    from p2p_diloco.engine.rounds import Rounds
    from p2p_diloco.net.joined import Joined
    from p2p_diloco.net.records import LocalRun
    from p2p_diloco.sync.slot import FragmentSlot

logger = logging.getLogger("p2p_diloco.engine.view")


class Owner(Protocol):
    """What the clock reads of its engine (a part of :class:`~p2p_diloco.engine.view.Owner`)."""

    cfg: Config
    opts: SyncOptions
    joined: Joined
    local: LocalRun
    slots: list[FragmentSlot]
    rounds: Rounds

    def dht_time(self) -> float: ...
    def log_event(self, event: events.Event) -> None: ...


class ClockTender:
    """One learner's sync clock: a fixed one from the config, or the newest derived one published (``auto``)."""

    def __init__(self, learner: Owner) -> None:
        self.learner = learner
        a = learner.cfg.averaging
        self.auto = a.schedule == "clock" and a.sync_period_s == 0
        """The period is derived by the swarm's clock leader (``averaging.sync_period_s`` = 0)."""
        self.clock: SyncClock | None = SyncClock(a.sync_period_s) if a.schedule == "clock" and not self.auto else None
        self.published_at = self.retuned_at = -math.inf
        """When (monotonic) we last stored the clock, and last retuned it, as its leader."""
        self.known = 0
        """How many step times and link times the current period was derived from."""
        self.untimed = False
        """We lead the clock and a training learner's step time, or link time once ours is measured, is not known yet."""
        self.own_link_at = math.inf
        """When (monotonic) our own sync link time was first measured (:func:`awaits_links`)."""
        self.leading = False
        """We derive the clock (the smallest peer id among the training learners, at our last look)."""
        self.publisher: tuple[str, float] | None = None
        """Who stored the newest clock we read, and when."""
        self.read = False
        """Did the last head probe read the sync clock (:data:`CLOCK_READ_EVERY`)?"""
        self.unmeasured = False
        """We published the current clock before any link time was in (:func:`unmeasured_period_s`)."""

    def adopt(self, published: SyncClock | None) -> None:
        """Adopt ``published`` (the newest clock a probe found) if it is newer than ours."""
        if published is not None and published.newer_than(self.clock):
            if self.clock is None or published.period_s != self.clock.period_s:
                logger.info("sync clock: period %.2f s from DHT time %.1f", published.period_s, published.origin)
            self.clock = published.after(self.clock, self.learner.dht_time())

    def found(self, value: Any) -> None:
        """What a probe found under the clock's key: its newest clock adopted, its publisher noted."""
        self.adopt(clock_in(value))
        self.publisher = clock_publisher(value)

    def tend(self, own_step_time_s: float, others: list[Any]) -> None:
        """(status thread, after a probe adopted the newest published sync clock) If we are the clock leader (smallest
        peer id among the training learners ``others``, the last full read's records), derive the period from
        everyone's step time and publish it when it is off (or missing), and keep it alive in the DHT."""
        from p2p_diloco.net.membership import owner_subkey

        me = self.learner
        training = [r for r in others if r.state in ("joining", "training", "averaging")]
        now, wall = me.dht_time(), time.monotonic()
        leading = self.leading = leads_clock(me.joined.peer_id, [r.peer_id for r in training], self.publisher, now,
                                             CLOCK_LEADER_FRESH_S)
        own_link, others_links = me.rounds.sync_link_s(), [r.sync_link_s for r in training]
        if own_link > 0:
            self.own_link_at = min(self.own_link_at, wall)
        clock = self.clock
        holding = awaits_links(clock, own_link, others_links, wall - self.own_link_at)
        # the leader reads the swarm every view period until it has every learner's step time (its first clock
        # may come from a few learners' alone; a full read is 30 s or more away otherwise), and their link times
        self.untimed = leading and (any(r.step_time_s <= 0 for r in training) or holding)
        times = [t for t in (own_step_time_s, *(r.step_time_s for r in training)) if t > 0]
        if not leading or not times:  # a slow leader need not wait for its own step time: the others' do
            return
        a, h = me.cfg.averaging, me.cfg.outer.sync_every
        links = [own_link, *others_links]
        work = derive_period(times, h, min_period_s=min_period_s(a.window_max_s, a.commit_timeout_s, a.clock_groups),
                             sync_link_s=links)
        measured = any(t > 0 for t in links)
        period = work if work is None or measured else unmeasured_period_s(work, len(me.slots))
        known = len(times) + sum(1 for t in links if t > 0)
        settled = period is not None and not holding and retune_allowed(
            clock, wall - self.retuned_at, known, self.known, longer=clock is not None and period > clock.period_s)
        # an unmeasured clock goes once a link time is in, even within the tolerance (its spacing is a whole period's)
        off = clock is None or (self.unmeasured and measured and period != clock.period_s)
        if work is not None and period is not None and settled and (off or needs_retune(clock, period)):
            clock = retune(clock, period, now, CLOCK_START_MARGIN_S + CLOCK_READ_EVERY * me.opts.view_period_s,
                           len(me.slots), first_within_s=work)
            self.retuned_at, self.known, self.unmeasured = wall, known, not measured
            logger.info("sync clock leader: period %.2f s (H %d x median step %.3f s of %d learners; a sync's link "
                        "time at most %.1f s%s), from DHT time %.1f", period, h, statistics.median(times), len(times),
                        max(links), "" if measured else f"; none measured yet: {len(me.slots)} x {work:.2f} s",
                        clock.origin)
            me.log_event(events.ClockEvent(period_s=period, origin=clock.origin, learners=len(times)))
        elif clock is None or wall - self.published_at < CLOCK_REPUBLISH_S:
            return
        self.clock = clock  # the leader runs on its retuned clock even if this publish is refused (republished next period)
        if publish_clock(me.joined.dht, me.local.run_id, clock, owner_subkey(me.joined.private_key), now):
            self.published_at = wall
        else:
            logger.warning("publishing the sync clock was not accepted by any DHT node; retrying next period")
