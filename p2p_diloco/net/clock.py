"""The swarm's sync clock: when each fragment is due, in DHT time, the same instants for every learner.

With a step-count schedule a fast and a slow learner are due at different moments and rarely meet
(on a shared machine even "equal" learners drift apart by seconds). On the clock schedule fragment
``f``'s round boundaries fall at ``origin + (k + f / F) * period`` of DHT time (k >= 1), so everyone
alive meets at the same instant and a slower learner simply brings fewer tokens.

The period is either fixed by the config (``averaging.sync_period_s``, origin 0) or *derived*: H
(``outer.sync_every``) times the median step time of the live learners, read from their peer
records. A derived clock is chosen by one learner -- the live learner with the smallest peer id --
and published in the DHT under :func:`clock_key`; everyone adopts the newest published clock
(highest ``epoch``). The leader re-derives it as the swarm changes and publishes a new one only when
the period is off by more than :data:`RETUNE_TOLERANCE`, at most every :data:`RETUNE_EVERY_PERIODS`
periods; a new clock (:func:`retune`) starts at the old clock's next boundary (of any fragment) that
is still far enough ahead for everyone to have read it, so a retune delays the next round by at most
one fragment spacing plus a few seconds. Until then the old clock's boundaries still hold (:attr:`SyncClock.previous`):
a learner that has adopted the new clock keeps meeting, at the old instants, those who have not read it yet. (The
leader used to skip them: on a 2 Mbit/s, 100 ms link the others then committed a round without it after each
retune, and versions drifted apart.) If the leader leaves, the next smallest peer id takes over, starting from the
clock already in the DHT.

Everything here is pure except :func:`publish_clock` (a hivemind DHT).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

RETUNE_TOLERANCE = 0.25
"""The leader publishes a new period only when the derived one differs from the current by more than this. 0.1 was
tried: on loopback it changed nothing measurable against the simulator (``results/learners``: +3.1%, +2.6% before),
and on a 2 Mbit/s, 100 ms link the clock was retuned three times in two minutes and rounds stopped meeting after
the retunes (``results/wan-rtt100``: 61% committed; the earlier run with one clock, 97%)."""
STEP_TIME_WINDOW_S = 60.0
"""The step time a learner publishes (and the clock is derived from) is measured over this much recent wall time:
the mean since the start kept the slow first steps in it for the whole run."""
RETUNE_EVERY_PERIODS = 3.0
"""... and at most once per this many periods (step times are noisy; each retune shifts the rhythm)."""
LENGTHEN_EVERY_PERIODS = 1.0
"""... but a longer period, once per this many: rounds that do not fit the period pile up on the link and fail,
and each period lost so loses a sync of every fragment (at 1 Mbit/s, 1 s queues, the retunes from 9.8 s to 13.6 s
and on to 30.8 s came 31 s and 45 s late, and members fell behind meanwhile)."""
CLOCK_TTL_S = 600.0
"""Lifetime of a published clock in the DHT; the leader re-stores it well before."""
MAX_PERIOD_S = 24 * 3600.0
LINK_PERIOD_SAFETY = 1.0 + RETUNE_TOLERANCE
"""A derived period is at least this many times the slowest live learner's link time of one sync of every fragment
(its published ``sync_link_s``): the fragments' rounds share the link, and a period shorter than their transfers
piles rounds up until none finds its group (4 learners at 0.25 Mbit/s: 22 s of link per sync of the demo config
against a 16 s period). 1 + :data:`RETUNE_TOLERANCE`: a period the leader leaves alone (within the tolerance of the
derived one) still holds a sync. It was 1.5 while a sync also held every round's coordination, not one's
(:func:`~p2p_diloco.averaging.linktime.sync_link_s`)."""


def clock_key(run_id: str) -> str:
    return f"{run_id}_sync_clock"


@dataclass(frozen=True)
class SyncClock:
    """Round boundaries of fragment ``f``: ``origin + (k + f / F) * period_s`` of DHT time, ``k >= 1``."""

    period_s: float
    origin: float = 0.0
    epoch: int = 0
    """How many times the period was retuned: the highest epoch is the current clock."""
    previous: SyncClock | None = field(default=None, compare=False, repr=False)
    """The clock this one replaced, whose boundaries still hold before :attr:`start` (local: never published)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and 0 < self.period_s <= MAX_PERIOD_S):
            raise ValueError(f"sync clock period must be in (0, {MAX_PERIOD_S:g}] s, got {self.period_s!r}")
        if not (math.isfinite(self.origin) and self.origin >= 0):
            raise ValueError(f"sync clock origin must be a finite DHT time >= 0, got {self.origin!r}")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"sync clock epoch must be an int >= 0, got {self.epoch!r}")

    @property
    def start(self) -> float:
        """This clock's first boundary (fragment 0's); before it, :attr:`previous`'s boundaries hold."""
        return self.origin + self.period_s

    def after(self, previous: SyncClock | None, now_s: float) -> SyncClock:
        """This clock, adopted at ``now_s`` in place of ``previous`` (whose boundaries before :attr:`start` still
        hold; the chain is cut where it no longer matters)."""
        if previous is None or previous is self or now_s >= self.start:
            return replace(self, previous=None)
        if previous.previous is not None and now_s >= previous.start:
            previous = replace(previous, previous=None)
        return replace(self, previous=previous)

    def _before_start(self, t: float) -> SyncClock | None:
        """The clock that rules at ``t``, if it is the previous one (``t`` before our first boundary)."""
        return self.previous if self.previous is not None and t < self.start else None

    def _index(self, t: float, fragment: int, num_fragments: int) -> int:
        """Number of boundaries of ``fragment`` at or before ``t`` (0 before the first)."""
        shift = self.origin + fragment / num_fragments * self.period_s
        return max(0, math.floor((t - shift) / self.period_s))

    def round_index(self, t: float, fragment: int, num_fragments: int) -> int:
        """The number of ``fragment``'s boundaries at or before ``t``: the round a boundary starts (grid groups
        take their axis from it); the previous clock's before our start."""
        old = self._before_start(t)
        return old.round_index(t, fragment, num_fragments) if old is not None else self._index(t, fragment, num_fragments)

    def due(self, previous_s: float, now_s: float, num_fragments: int) -> list[int]:
        """Fragments with a boundary in ``(previous_s, now_s]``."""
        if now_s <= previous_s:
            return []
        old = self._before_start(previous_s)
        if old is None:
            return [f for f in range(num_fragments)
                    if self._index(now_s, f, num_fragments) > self._index(previous_s, f, num_fragments)]
        # the previous clock's boundaries before our start, then ours (none of which lies before it)
        cut = math.nextafter(self.start, -math.inf)
        ours = [f for f in range(num_fragments) if self._index(now_s, f, num_fragments) > 0]
        return sorted({*old.due(previous_s, min(now_s, cut), num_fragments), *ours})

    def boundary(self, now_s: float, fragment: int, num_fragments: int) -> float:
        """The latest boundary of ``fragment`` at or before ``now_s`` (the first one if none has passed yet)."""
        k = self._index(now_s, fragment, num_fragments)
        if k == 0 and self.previous is not None:  # none of ours yet: the previous clock's, before our start
            return self.previous.boundary(min(now_s, math.nextafter(self.start, -math.inf)), fragment, num_fragments)
        return self.origin + (max(1, k) + fragment / num_fragments) * self.period_s

    def newer_than(self, other: SyncClock | None) -> bool:
        """Does this clock replace ``other``? The highest epoch wins, then origin, then period: every peer
        that has seen the same clocks adopts the same one."""
        return other is None or (self.epoch, self.origin, self.period_s) > (other.epoch, other.origin, other.period_s)

    def next_any_boundary(self, t: float, num_fragments: int) -> float:
        """The first boundary of any fragment at or after ``t``."""
        old = self._before_start(t)
        if old is not None:
            return min(old.next_any_boundary(t, num_fragments), self.start)

        def first_at_or_after(f: int) -> float:
            shift = self.origin + f / num_fragments * self.period_s
            return shift + max(1, math.ceil((t - shift) / self.period_s)) * self.period_s
        return min(first_at_or_after(f) for f in range(num_fragments))

    def to_wire(self) -> dict[str, float | int]:
        return {"period_s": float(self.period_s), "origin": float(self.origin), "epoch": int(self.epoch)}

    @classmethod
    def from_wire(cls, value: Any) -> SyncClock:
        """Strict parse of a published clock; ``ValueError`` with a one-line reason."""
        if not isinstance(value, Mapping) or set(value) != {"period_s", "origin", "epoch"}:
            raise ValueError(f"a sync clock must be {{'period_s', 'origin', 'epoch'}}, got {value!r}"[:200])
        for k in ("period_s", "origin"):
            if isinstance(value[k], bool) or not isinstance(value[k], (int, float)):
                raise ValueError(f"sync clock {k} must be a number, got {value[k]!r}"[:200])
        return cls(float(value["period_s"]), float(value["origin"]), value["epoch"])


def retune(current: SyncClock | None, period_s: float, now_s: float, margin_s: float, num_fragments: int,
           first_within_s: float = math.inf) -> SyncClock:
    """The clock that replaces ``current`` with ``period_s``. Its first boundary (fragment 0's; the others
    follow at the new spacing) is the old clock's next boundary of *any* fragment at least ``margin_s``
    ahead, by when everyone has read the new clock; the new clock has no boundary before it. So a retune
    delays the swarm's next round by at most one old fragment spacing (``period / F``) plus ``margin_s``.
    (Aligning on the old clock's next fragment-0 boundary instead paused every round for up to a whole
    old period: 40 s in a chaos run.) A first clock starts ``margin_s`` from now, its first boundary one
    period later; a retune never starts later than that either (a first clock derived from a slow leader's
    own steps had its first boundary 18 s ahead, and the 5 s clock that replaced it kept that start). Nor later than
    ``first_within_s`` after the margin: an :func:`unmeasured clock <unmeasured_period_s>`'s first boundary is one
    work period away, not its whole (longer) period."""
    ahead_s = margin_s + min(period_s, first_within_s)
    if current is None:
        return SyncClock(period_s, max(0.0, now_s + ahead_s - period_s), 0)
    first = min(current.next_any_boundary(now_s + margin_s, num_fragments), now_s + ahead_s)
    return SyncClock(period_s, max(0.0, first - period_s), current.epoch + 1).after(current, now_s)


def unmeasured_period_s(period_s: float, num_fragments: int) -> float:
    """The period of a clock derived before any learner's link is measured: ``num_fragments`` x the work's
    ``period_s``, so that its boundaries -- one fragment's every ``period_s`` -- are a whole work period apart and the
    first rounds go one at a time whatever the link. With the work's period the fragments' first rounds came a
    quarter period apart: at 0.25 Mbit/s, 1 s queues, a 13.2 s period and 8 s rounds, each learner declined the
    boundaries its link was still busy at, and which it was busy at turned on tenths of a second: groups went on
    without members, learners split across fragments and versions, and a run committed 57% of its rounds. The leader
    replaces this clock as soon as a link time is in (:meth:`ClockTender.tend
    <p2p_diloco.engine.clocktender.ClockTender.tend>`), at one of its boundaries (:func:`retune`): a loopback swarm's
    fragments other than the first sync a work period later than they would have, once."""
    return min(MAX_PERIOD_S, num_fragments * period_s)


def min_period_s(window_max_s: float, commit_timeout_s: float, clock_groups: bool = False) -> float:
    """The shortest derived period. With groups from the clock (``clock_groups``) none: a round costs its
    bytes and two round trips (the offers, the verdicts), so the period is the work's -- H x the median step, or the
    link's time for one sync (:func:`derive_period`) -- and a round that does not fit skips a boundary. With
    matchmaking: one round's matching (at most ``averaging.window_max_s``) and verdicts (at
    most ``averaging.commit_timeout_s``) fit in it. It was twice the window's bound (20 s by default): learners
    at 0.46 s a step then synced every 43 steps instead of H = 28 and ended 2.9% behind the simulator at the
    same steps (``results/learners``). A round that does not fit anyway (a slow all-reduce) is skipped, not
    broken: the fragment's progress waits for the next boundary."""
    return 0.0 if clock_groups else window_max_s + commit_timeout_s


def derive_period(step_times_s: Iterable[float], sync_every: int, min_period_s: float,
                  sync_link_s: Iterable[float] = ()) -> float | None:
    """H x the median step time of the live learners (None without any), at least ``min_period_s`` and at least
    :data:`LINK_PERIOD_SAFETY` x the longest of their ``sync_link_s`` (link seconds of one sync of every fragment;
    0 or non-finite: not measured): on a slow link the period grows to fit the rounds, not the steps."""
    times = [t for t in step_times_s if math.isfinite(t) and t > 0]
    if not times:
        return None
    links = [t for t in sync_link_s if math.isfinite(t) and t > 0]
    floor_s = max(min_period_s, LINK_PERIOD_SAFETY * max(links, default=0.0))
    return min(MAX_PERIOD_S, max(floor_s, sync_every * statistics.median(times)))


def recent_step_time_s(samples: Sequence[tuple[float, int]], window_s: float, min_steps: int) -> float:
    """Seconds per step over the last ``window_s`` of ``samples`` ((monotonic time, step count), oldest first):
    from the newest sample at least ``window_s`` old (the oldest if none is) to the newest; 0 while fewer than
    ``min_steps`` steps lie between them (too few to time)."""
    if len(samples) < 2:
        return 0.0
    t_end, step_end = samples[-1]
    first = 0
    for i, (t, _) in enumerate(samples[:-1]):
        if t_end - t >= window_s:
            first = i
    t0, step0 = samples[first]
    steps = step_end - step0
    if steps < max(1, min_steps) or t_end <= t0:
        return 0.0
    return (t_end - t0) / steps


def needs_retune(current: SyncClock | None, period_s: float, tolerance: float = RETUNE_TOLERANCE) -> bool:
    """Publish a new clock? Yes if there is none, or if its period is off by more than ``tolerance``."""
    return current is None or abs(period_s / current.period_s - 1) > tolerance


def awaits_links(current: SyncClock | None, own_link_s: float, others_link_s: Iterable[float],
                 since_own_link_s: float) -> bool:
    """Should the leader hold its retunes until the other training learners' link times (``others_link_s``, their
    published ``sync_link_s``; 0: not measured yet) are in? Yes once ours (``own_link_s``) is measured and some are
    not, for at most one ``current`` period after ours was (``since_own_link_s``): the first rounds measure every
    member's link at once, but each publishes its own at its next heartbeat, and the slowest decides the period. A
    leader that retuned on each as it came lengthened the period twice within seconds (0.25 Mbit/s: 18.9 -> 32.9 s
    from its own link, 45.2 s from the slowest's 7 s later), and each retune cost the round at the boundary it
    moved. Not without a clock (the first one is published at once)."""
    if current is None or not own_link_s > 0:
        return False
    return any(not t > 0 for t in others_link_s) and since_own_link_s < current.period_s


def retune_allowed(current: SyncClock | None, since_retune_s: float, known: int, known_at_retune: int,
                   longer: bool = False) -> bool:
    """May the leader retune now? Always without a clock, and as soon as more is ``known`` -- live learners' step
    times and measured sync link times, counted together -- than the current period was derived from
    (``known_at_retune``); a ``longer`` period (the rounds do not fit the current one) after
    :data:`LENGTHEN_EVERY_PERIODS` periods; a shorter one after :data:`RETUNE_EVERY_PERIODS`. A first clock derived
    from the leader's own steps alone (the others' are not read yet) is so replaced at the next probe that reads
    them, not three periods later: a 3x slower leader set an 18 s period where the swarm's median step made 5 s, and
    a 20 s run held one or two rounds. So is a clock derived before any round measured the link: at 1 Mbit/s, 1 s
    queues, the first period (7.0 s, from steps) held half a sync's rounds."""
    if current is None or known > known_at_retune:
        return True
    return since_retune_s >= (LENGTHEN_EVERY_PERIODS if longer else RETUNE_EVERY_PERIODS) * current.period_s


def clock_leader(peer_ids: Iterable[str]) -> str | None:
    """Who derives and publishes the clock: the smallest peer id among the live learners."""
    return min(peer_ids, default=None)


def defers_to_publisher(own_id: str, publisher: tuple[str, float] | None, now_s: float, fresh_s: float) -> bool:
    """Should a learner whose view makes it the clock leader leave the clock alone? Yes while the newest published
    clock's ``publisher`` -- (peer id, DHT time it stored it) -- is a smaller peer id than ours that stored it within
    ``fresh_s``: that learner is alive and leads, and our view lacks it (a partial read; a view gone stale while we
    were stopped). At 0.5 Mbit/s a learner SIGSTOPped 60 s published a 17.8 s period from three learners' steps, two
    seconds after the leader's 31.9 s; its clock won, the leader's came back, and the period flapped 20.6 -> 31.9 ->
    17.8 -> 32.2 s while the rounds at each boundary failed. A leader that died is so replaced ``fresh_s`` later;
    meanwhile its clock's boundaries hold."""
    if publisher is None:
        return False
    peer, stored_at = publisher
    return peer < own_id and now_s - stored_at < fresh_s


def leads_clock(own_id: str, training_ids: Iterable[str], publisher: tuple[str, float] | None, now_s: float,
                fresh_s: float) -> bool:
    """Do we derive and publish the clock? We are the :func:`clock_leader` among ourselves and the training learners
    our view holds, and do not :func:`defer <defers_to_publisher>` to the newest clock's publisher."""
    return (clock_leader([own_id, *training_ids]) == own_id
            and not defers_to_publisher(own_id, publisher, now_s, fresh_s))


def clock_publisher(found: Any) -> tuple[str, float] | None:
    """Who stored the newest clock (:func:`clock_in`) in a ``dht.get(clock_key(run_id), latest=True)`` result, and when
    (DHT time: its expiration less :data:`CLOCK_TTL_S`); None without a clock, or one not under an owner-signed subkey."""
    from p2p_diloco.net.membership import owner_peer_id

    newest = clock_in(found)
    for subkey, item in found.value.items() if newest is not None else ():
        if newest_clock([item.value]) == newest:
            peer = owner_peer_id(subkey)
            return None if peer is None else (peer, item.expiration_time - CLOCK_TTL_S)
    return None


def newest_clock(values: Iterable[Any]) -> SyncClock | None:
    """The clock everyone adopts: the valid published clock of the highest epoch (then origin, then period;
    malformed ones skipped)."""
    best: SyncClock | None = None
    for value in values:
        try:
            clock = SyncClock.from_wire(value)
        except ValueError:
            continue
        if clock.newer_than(best):
            best = clock
    return best


def clock_in(found: Any) -> SyncClock | None:
    """The newest clock in a ``dht.get(clock_key(run_id), latest=True)`` result (None if none)."""
    if found is None or not isinstance(found.value, dict):
        return None
    return newest_clock(item.value for item in found.value.values())


def read_clock(dht: Any, run_id: str) -> SyncClock | None:
    """The newest clock published for ``run_id`` (None if none); raises what the DHT read raises."""
    from p2p_diloco.net.membership import read_many

    key = clock_key(run_id)
    return clock_in(read_many(dht, [key]).get(key))


def publish_clock(dht: Any, run_id: str, clock: SyncClock, subkey: bytes, now: float) -> bool:
    """Store ``clock`` under our signed subkey; True if some DHT node accepted it."""
    from p2p_diloco.net.membership import store

    return bool(store(dht, clock_key(run_id), clock.to_wire(), now + CLOCK_TTL_S, subkey=subkey))
