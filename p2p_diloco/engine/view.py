"""The learner's status thread: our record published, the other learners' read, the sync clock tended,
and the start barrier of learners that start together. DHT calls happen here, never in the inner loop."""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, Collection, Iterable, Mapping, Protocol

from p2p_diloco.averaging.decisions import anchor_order, averager_prefix, vouch_key
from p2p_diloco.core.logs import log_handled
from p2p_diloco.engine.options import (
    CLOCK_READ_EVERY,
    CLOCK_SKIP_STEPS,
    CLOCK_WARMUP_STEPS,
    JOIN_VIEW_FRESH_S,
    LEARNER_STATES,
    ROUND_POLL_S,
    SPEED_WINDOW_S,
    START_MARGIN_S,
    publish_due,
    published_key,
    read_period_s,
    view_due,
    swarm_started,
    wait_verdict,
    waiting_line,
)
from p2p_diloco.net.records import STEPPING_STATES
from p2p_diloco.transport.planning import with_us
from p2p_diloco.engine.clocktender import ClockTender
from p2p_diloco.engine.clocktender import Owner as ClockOwner
from p2p_diloco.net.clock import (
    STEP_TIME_WINDOW_S,
    SyncClock,
    clock_key,
    read_clock,
    recent_step_time_s,
)

if TYPE_CHECKING:
    from p2p_diloco.sync.slot import FragmentSlot

logger = logging.getLogger(__name__)

START_BARRIER_POLL_S = 0.1
"""Seconds between two looks at the live learners and the start proposals while waiting for peers."""
OWN_VERSION_PROBE_EVERY = 3
"""Groups from the clock: every this many head probes, one fragment's own-version vouchers are read (in turn), to
find a rejoiner that vouches for our version (:func:`unknown_vouchers`)."""
OWN_VERSION_READ_REPLICAS = 1
"""How many of the nodes that hold a vouch key the own-version read asks (the next version's are read from two, see
:data:`~p2p_diloco.net.nearest.READ_REPLICAS`): it looks for learners we do not know yet, every swarm's vouchers of a
version (16 learners: about 3 KB from each node asked), and one missed is found at the next probe or full read."""
UNKNOWN_VOUCHER_REREAD_S = 10.0
"""Seconds before an unknown learner that vouches for our version (:func:`unknown_vouchers`) makes the head probe
read the swarm again: a dead peer's vouches stay, a rejoiner's record may come a moment after its vouch."""
STATUS_JOIN_TIMEOUT_S = 5.0
"""Seconds :meth:`SwarmView.stop` waits for the status thread (it is between two DHT calls at most)."""
ANCHOR_HASH_RE = re.compile(r"^[0-9a-f]{16}$")
"""A vouched anchor hash (:attr:`FragmentSlot.anchor_hash`); any other value under a vouch key is ignored."""

Rank = tuple[int, str]
"""(version, anchor hash) of one fragment."""


def with_heads(ranks: list[Rank], published_at: float, heads: dict[int, tuple[Rank, float]]) -> list[Rank]:
    """One peer's per-fragment ranks from its record (published at DHT time ``published_at``), each raised to
    what a head probe saw it vouch for (``heads``: fragment -> (rank, DHT time of the probe)) after the record
    was published: records are republished only on a heartbeat while training, vouches at every commit."""
    out = list(ranks)
    for f, (rank, seen_at) in heads.items():
        if f < len(out) and seen_at > published_at and anchor_order(*rank) > anchor_order(*out[f]):
            out[f] = rank
    return out


def known_past(anchors: Iterable[list[Rank]], fragment: int, version: int) -> bool:
    """A live peer is already known to be past ``version`` on ``fragment`` (``anchors``: each peer's ranks):
    probing the next version again would only fetch the same vouchers -- a whole group's signed values, every
    view period -- until we have caught up."""
    return any(len(ranks) > fragment and ranks[fragment][0] > version for ranks in anchors)


def behind_us(anchors: Mapping[str, list[Rank]], fragment: int, version: int, mates: Collection[str]) -> bool:
    """A live peer other than ``mates`` (the members of our last committed round of ``fragment``, which led to
    ``version``: they hold it too, whatever their records say) is behind ``version`` in our view (``anchors``: each
    peer's ranks). It may catch up (a download, or its own round) at any moment, and our groups from the clock name
    it only once our view shows it at our version: its record is republished on a heartbeat and read at a full read,
    so a head probe reads who vouches for our version meanwhile. (A learner resumed after a stop chased the swarm a
    version behind for a minute, every one of its rounds naming a group the others did not.)"""
    return any(peer not in mates and len(ranks) > fragment and ranks[fragment][0] < version
               for peer, ranks in anchors.items())


def settled(advanced_at: float, boundary: float, now: float) -> bool:
    """Our fragment advanced (a commit of ours, a download, or a probe that read its next version and so knows who
    was past us then) at DHT time ``advanced_at``, at or after its latest round boundary ``boundary`` (at ``now``;
    a boundary still ahead is the fragment's first: none has passed to be past us at): nobody can be past it before
    the next boundary, so a head probe need not ask. Versions only grow by rounds, and a fragment's rounds start at
    its boundaries; a round that another group committed at the same version (a fork) is the full read's to find,
    as before. Until it advances (its round is matching, or failed, or we missed it), the fragment is probed: who
    got ahead is what we need then. (A first boundary ahead and a fragment only read counted as unsettled: every
    fragment was probed at every probe until more than a period after the clock was first published, a learner's
    largest control-plane item at N = 4.)"""
    return boundary > now or advanced_at >= boundary


def vouchers(signed: dict[str, Any], own: str) -> dict[str, str]:
    """One vouch key's signed values (peer id -> anchor hash): the peers other than us that vouch, and for which
    anchor; a malformed value is skipped."""
    return {peer: value for peer, value in signed.items()
            if peer != own and isinstance(value, str) and ANCHOR_HASH_RE.match(value)}


def vouched_heads(signed: dict[str, Any], version: int, live: set[str], own: str) -> dict[str, Rank]:
    """From one vouch key's signed values of ``version``: the live peers other than us that hold that version, and
    their anchor. Dead peers' vouches stay in the DHT for a day; a malformed value is skipped."""
    return {peer: (version, value) for peer, value in vouchers(signed, own).items() if peer in live}


def probed_heads(heads: Mapping[str, dict[int, tuple[Rank, float]]], read: Mapping[tuple[int, int], Mapping[str, Rank]],
                 seen_at: float) -> dict[str, dict[int, tuple[Rank, float]]]:
    """``heads`` (peer -> fragment -> (rank, DHT time of the probe that saw it)) after a head probe at ``seen_at``
    read ``read`` ((fragment, version) -> the live peers that vouch for it: :func:`vouched_heads`). A peer that
    vouches for several versions of a fragment in one probe -- ours and the next: it holds the next one now, and its
    vouch of ours is still in the DHT -- is at the highest. (The last key read won: a learner that downloaded a
    fragment's version just before a boundary read the next one's vouchers at every probe and stayed at its own
    for half a minute, its groups naming peers a version behind where they were.)"""
    out = {peer: dict(fragments) for peer, fragments in heads.items()}
    for (fragment, _), vouched in sorted(read.items(), key=lambda item: item[0][1]):  # lowest version first
        for peer, rank in vouched.items():
            out.setdefault(peer, {})[fragment] = (rank, seen_at)
    return out


def unknown_vouchers(signed: dict[str, Any], version: int, live: set[str], own: str) -> set[str]:
    """From one vouch key's signed values of ``version`` (our own version of a fragment): the peers that vouch for it
    and are not among the live learners we know -- a newcomer or a rejoiner that downloaded it (its record is not in
    our last full read yet), or a dead peer (its vouches stay in the DHT for a day)."""
    return set(vouchers(signed, own)) - live


class Owner(ClockOwner, Protocol):
    """What the status thread reads of its engine (:class:`~p2p_diloco.engine.engine.DiLoCo` is one; a protocol,
    because the engine builds its view: it imports this module, not the other way round): what its clock reads, and
    its progress."""

    training: bool
    inner_step: int
    tokens: int
    start_step: int
    start_tokens: int
    t_start: float

    def latest_loss(self) -> float | None: ...


class SwarmView:
    """What this learner knows of the swarm, kept fresh by the ``learner-status`` thread: the other live
    learners' anchors, states and steps, and the sync clock (tended by its leader when it is derived)."""

    def __init__(self, learner: Owner) -> None:
        self.learner = learner
        self._anchors: dict[str, list[Rank]] = {}
        """Other live learners' (version, anchor hash) per fragment, by peer id: from their records, raised by
        the head probes. Rebound whole, never changed in place (the training thread reads it)."""
        self._records: dict[str, tuple[list[Rank], float]] = {}  # peer id -> ranks in its record, published at
        self._heads: dict[str, dict[int, tuple[Rank, float]]] = {}  # peer id -> fragment -> (probed rank, when)
        self._advanced: dict[int, tuple[int, float]] = {}
        """Our fragments' versions and the DHT time a probe first saw each (see :meth:`_settled`); absent: unprobed."""
        self._probes = 0
        """Head probes so far (the fragment whose own version a probe reads turns with it)."""
        self._unknown_read: dict[tuple[str, int, int], float] = {}
        """(peer, fragment, version) of an unknown voucher -> when read (monotonic): once per the reread period."""
        self._others: list[Any] = []  # the other live learners' records at the last full read
        self.peer_states: list[str] = []
        self.peer_steps: list[tuple[int, float, float]] = []
        """(inner step, DHT time published, step time) of the other live learners that train."""
        self.peer_tokens: list[tuple[int, float, float]] = []
        """(tokens, DHT time published, tokens/s while training) of the other live learners."""
        self.swarm_reads = 0  # successful reads of the swarm by the status thread (0: we may be behind, unknown)
        self.live_learners = 1
        self.clocks = ClockTender(learner)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._status_loop, name="learner-status", daemon=True)

    @property
    def clock(self) -> SyncClock | None:
        """The sync clock we hold (:class:`ClockTender`); None: none known yet, or the step schedule."""
        return self.clocks.clock

    @clock.setter
    def clock(self, clock: SyncClock | None) -> None:
        self.clocks.clock = clock

    @property
    def peer_anchors(self) -> list[list[Rank]]:
        """(version, anchor hash) per fragment of each other live learner."""
        return list(self._anchors.values())

    @property
    def peer_ids(self) -> list[str]:  # the other live learners'
        return list(self._anchors)

    def start(self) -> None:  # the swarm's record keep-alive leaves the heartbeat to the status thread while it runs
        self.learner.joined.publisher.hand_over(self._thread)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # not started if run() failed early: close() must not hide that error
            self._thread.join(timeout=STATUS_JOIN_TIMEOUT_S)

    def read(self, snapshot: Any = None) -> list[Any] | None:
        """Read the swarm once (or take ``snapshot``, a fresh read) and update our view of the other live
        learners (their anchors, states, how many); returns their records, or None if the read failed
        (logged in one line, whole with -v; the last view is kept)."""
        from p2p_diloco.net.membership import read_swarm
        from p2p_diloco.net.records import PeerRecord

        joined, fragments = self.learner.joined, len(self.learner.slots)
        if snapshot is None:
            try:
                snapshot = read_swarm(joined.dht, self.learner.local, index=False)
            except Exception:  # a DHT hiccup: keep the last view, try again next period
                log_handled(logger, "reading the swarm failed")
                return None
        others = [v.record for v in snapshot.live()
                  if isinstance(v.record, PeerRecord) and v.peer_id != joined.peer_id
                  and v.record.state in LEARNER_STATES and len(v.record.fragment_versions) == fragments]
        self._records = {r.peer_id: (list(zip(r.fragment_versions, r.anchor_hashes)), r.time) for r in others
                         if len(r.anchor_hashes) == len(r.fragment_versions)}
        self._heads = {p: h for p, h in self._heads.items() if p in self._records}
        self._merge()
        self.peer_states = [r.state for r in others]
        self.peer_steps = [(r.inner_step, r.time, r.step_time_s) for r in others if r.state in STEPPING_STATES]
        self.peer_tokens = [(r.tokens, r.time, r.tokens_per_s if r.state in STEPPING_STATES else 0.0) for r in others]
        self.live_learners = 1 + len(others)
        self._others = others
        self.swarm_reads += 1
        return others

    def _merge(self) -> None:
        self._anchors = {p: with_heads(ranks, at, self._heads.get(p, {})) for p, (ranks, at) in self._records.items()}

    def probe_heads(self) -> bool:
        """The fast path, every ``view_period_s`` while training: one batched DHT search for the vouches of
        each fragment's next version (who among the live learners is past us, and on which anchor) and for
        the sync clock. Its size does not grow with the swarm (the next version's vouchers are one group at
        most, and only while we are behind), unlike a full read. On the sync clock a fragment that advanced
        since its latest boundary is left out (:func:`settled`): with rounds that commit, most probes read
        nothing, or the clock alone (:data:`CLOCK_READ_EVERY`). False if the search failed (logged in one line,
        whole with -v; the last view is kept)."""
        from p2p_diloco.net.membership import owned_values, read_many

        me = self.learner
        run_id, own = me.local.run_id, me.joined.peer_id
        now = me.dht_time()
        wanted = {vouch_key(averager_prefix(run_id, s.index), s.version + 1): (s.index, s.version + 1) for s in me.slots
                  if not known_past(self._anchors.values(), s.index, s.version) and not self._settled(s, now)}
        # groups from the clock name only the learners our view holds at our rank: who else vouches for our version
        # (a learner that just downloaded it) must be in it soon, not at the next full read. One fragment every
        # OWN_VERSION_PROBE_EVERY probes, in turn (each key read costs bytes: all four at every probe doubled a
        # learner's, 7,752 B/s against 3,999), and every fragment a live peer is behind us on (behind_us) at each
        self._probes += 1
        turn = (me.slots[(self._probes // OWN_VERSION_PROBE_EVERY) % len(me.slots)]
                if me.slots and self._probes % OWN_VERSION_PROBE_EVERY == 0 else None)
        ours = ({vouch_key(averager_prefix(run_id, s.index), s.version): (s.index, s.version) for s in me.slots
                 if s.version > 0 and (s is turn or behind_us(self._anchors, s.index, s.version,
                                                              with_us(me.rounds.hosts[s.index].last_group(), s.version)))}
                if me.cfg.averaging.clock_groups else {})
        # the clock, which changes only at a retune (announced CLOCK_READ_EVERY view periods ahead): in every search
        # that goes out anyway, and once in CLOCK_READ_EVERY probes alone; its leader, and a learner without one, always
        clocks = self.clocks
        clocks.read = clocks.auto and bool(wanted or ours or self.clock is None or clocks.leading
                                           or self._probes % CLOCK_READ_EVERY == 0)
        keys = list(wanted) + list(ours) + ([clock_key(run_id)] if clocks.read else [])
        if not keys:
            return True
        try:
            # our own version's vouchers from one node (a missed one waits for the next probe of it), the rest from two
            found = read_many(me.joined.dht, keys, replicas_of=dict.fromkeys(ours, OWN_VERSION_READ_REPLICAS))
        except Exception:  # a DHT hiccup: keep the last view, try again next period
            log_handled(logger, "probing the fragments' next versions failed")
            clocks.read = False
            return False
        for f, version in wanted.values():  # read at the probe's start: see _settled
            self._advanced.setdefault(f, (version - 1, now))
        signed = {key: owned_values(found.get(key)) for key in wanted | ours}
        if ours:
            self._read_unknown_vouchers({rank: signed[key] for key, rank in ours.items()})
        live = set(self._records)  # after _read_unknown_vouchers, which may have read the swarm
        read = {rank: vouched_heads(signed[key], rank[1], live, own) for key, rank in (wanted | ours).items()}
        self._heads = probed_heads(self._heads, read, me.dht_time())
        self._merge()
        if clocks.read:
            clocks.found(found.get(clock_key(run_id)))
        return True

    def _read_unknown_vouchers(self, signed: dict[tuple[int, int], dict[str, Any]]) -> None:
        """Read the swarm now if a peer we do not know vouches for our version of a fragment (``signed``: (fragment,
        our version) -> the vouch key's signed values): a newcomer or a rejoiner, whose record we would otherwise read
        only at the next full read, up to :func:`read_period_s` away -- meanwhile our groups from the clock leave it
        out and its own groups, naming us, fail. Each unknown voucher once per :data:`UNKNOWN_VOUCHER_REREAD_S`."""
        me, now = self.learner, time.monotonic()
        self._unknown_read = {k: at for k, at in self._unknown_read.items() if now - at < UNKNOWN_VOUCHER_REREAD_S}
        unknown = {(peer, f, version) for (f, version), values in signed.items()
                   for peer in unknown_vouchers(values, version, set(self._records), me.joined.peer_id)}
        fresh = unknown - set(self._unknown_read)
        if fresh:
            logger.debug("%d learner(s) we do not know vouch for our version: reading the swarm now", len(fresh))
            self._unknown_read.update(dict.fromkeys(fresh, now))
            self.read()

    def _settled(self, slot: FragmentSlot, now: float) -> bool:
        """:func:`settled` for one of our fragments on the sync clock (never without one: the step schedule's
        rounds have no shared instants, so every fragment is probed), nor before a probe read it. When the fragment
        advanced is when a probe first saw its new version (within one view period of the commit)."""
        seen = self._advanced.get(slot.index)
        if seen is not None and seen[0] != slot.version:
            seen = self._advanced[slot.index] = (slot.version, now)
        return seen is not None and self.clock is not None and settled(
            seen[1], self.clock.boundary(now, slot.index, len(self.learner.slots)), now)

    def look_before_training(self, stop: threading.Event) -> None:
        """Joining a running swarm: read it now, before the first step, adopt its sync clock and download
        the fragments we are behind on, instead of waiting for the status thread's first period; then
        train from the swarm's anchors. The downloads are waited for (at most ``averaging.state_timeout_s``;
        those still running then land during training): a first step beside them took 3-6 s on a busy
        machine instead of 0.5 s and slowed them down, and its progress from our random start would only
        be rebased. A failed read changes nothing: the status thread reads again."""
        me = self.learner
        t0 = time.monotonic()
        joined = me.joined.snapshot  # what we saw when joining, if it is recent
        others = self.read(joined if me.dht_time() - joined.now < JOIN_VIEW_FRESH_S else None)
        if others is None:
            return
        self.probe_heads()
        me.rounds.catch_up()
        fetching = [s for s in me.slots if s.inflight is not None]
        logger.info("looked at the swarm before training (%.2f s): %d other learners, sync clock %s, fetching "
                    "fragments %s", time.monotonic() - t0, len(others),
                    f"{self.clock.period_s:.2f} s" if self.clock else "not known yet",
                    [s.index for s in fetching] or "none")
        if not fetching:
            return
        t1 = time.monotonic()
        deadline = t1 + me.cfg.averaging.state_timeout_s
        pending = [s.inflight for s in fetching if s.inflight is not None]
        while pending and not stop.is_set() and time.monotonic() < deadline:
            pending = list(wait_futures(pending, timeout=min(ROUND_POLL_S, max(0.0, deadline - time.monotonic()))).not_done)
        me.rounds.collect(me.inner_step, min_age_steps=0)
        logger.info("downloads before the first step: %.2f s, fragments at versions %s%s", time.monotonic() - t1,
                    [s.version for s in me.slots], f"; {len(pending)} still running" if pending else "")

    def _status_loop(self) -> None:
        """Publish our record and read the others' every ``status_period_s`` (DHT calls never block the loop)."""
        me = self.learner
        publisher = me.joined.publisher
        seen: list[tuple[float, int]] = [(time.monotonic(), 0)]  # (time, tokens) over the last SPEED_WINDOW_S
        stepped: list[tuple[float, int]] = []  # (time, steps) over the last STEP_TIME_WINDOW_S, while training
        was_training = False
        refresh_s = publisher.period_s  # a third of the record's TTL, as a heartbeat
        published: tuple[float, tuple[Any, ...] | None] = (-math.inf, None)  # (when, what peers act on)
        viewed_at = probed_at = -math.inf
        while not self._stop.wait(me.opts.status_period_s):
            now = time.monotonic()
            if me.training and not was_training:  # waiting for peers is no step time
                seen = [(me.t_start, me.start_tokens)]
                stepped = []  # its first CLOCK_SKIP_STEPS steps are left out (see there)
            was_training = me.training
            seen.append((now, me.tokens))
            while len(seen) > 2 and now - seen[1][0] >= SPEED_WINDOW_S:
                seen.pop(0)
            tokens_per_s = max(0.0, (seen[-1][1] - seen[0][1]) / max(1e-6, seen[-1][0] - seen[0][0]))
            sent, received = me.rounds.bytes_total()
            if me.training and me.inner_step >= me.start_step + CLOCK_SKIP_STEPS:
                stepped.append((now, me.inner_step))
                while len(stepped) > 2 and now - stepped[1][0] >= STEP_TIME_WINDOW_S:
                    stepped.pop(0)
            step_time_s = recent_step_time_s(stepped, STEP_TIME_WINDOW_S, CLOCK_WARMUP_STEPS) if me.training else 0.0
            slots = me.slots
            publisher.update(inner_step=me.inner_step, tokens=me.tokens, tokens_per_s=tokens_per_s, step_time_s=step_time_s,
                             sync_link_s=me.rounds.sync_link_s(),
                             fragment_versions=tuple(s.version for s in slots),
                             anchor_hashes=tuple(s.anchor_hash for s in slots),
                             consensus_distance=tuple(s.consensus_distance for s in slots),
                             last_sync_time=me.rounds.last_sync_time, bytes_sent=sent,
                             bytes_received=received, loss=me.latest_loss())
            record = publisher.record
            # ... and once our step time, and our link's time for a sync, are first measured: the clock leader derives
            # the period from them, and holds its retune until every training learner's link time is in (at 0.25
            # Mbit/s a heartbeat's wait for them kept the period derived before any link was measured 20 s longer,
            # and its boundaries, too close for the link, lost rounds)
            key = (*published_key(record.state, record.fragment_versions, record.anchor_hashes, me.training),
                   step_time_s > 0, record.sync_link_s > 0)
            if publish_due(now, published[0], refresh_s, key, published[1]):
                publisher.beat()
                published = (now, key)
            read_s = (me.opts.view_period_s if self.clocks.untimed
                      else read_period_s(me.opts.view_period_s, self.live_learners))
            if view_due(now, viewed_at, read_s, me.training):
                viewed_at = probed_at = now
                if self.read() is None or not me.training:
                    if record.state == "syncing":  # its final rounds wait on the clock: a retune must reach them
                        self.clocks.adopt(final_clock(me))
                    continue
            elif now - probed_at >= me.opts.view_period_s:
                probed_at = now
            else:
                continue
            # the clock leader tends the clock at every probe that read it (from the last full read's step times): a
            # derived clock must not wait for a full read, which may be 30 s or more away
            if self.probe_heads() and self.clocks.read and me.training:  # the probe adopted the newest clock
                self.clocks.tend(step_time_s, self._others)

    def wait_for_peers(self, stop: threading.Event) -> None:
        """Start together with ``wait_peers`` learners (:func:`start_together`)."""
        start_together(self, stop)


def final_clock(me: Owner) -> SyncClock | None:
    """The published sync clock, read alone, for a learner in its final rounds (None if the read failed: logged). It
    no longer probes, and a retune it missed put them at boundaries its peers had left: at 0.25 Mbit/s two learners
    that stopped training as the leader retuned ran their final rounds on the old clock, two on the new, and every
    one of them failed."""
    try:
        return read_clock(me.joined.dht, me.local.run_id)
    except Exception:  # a DHT hiccup: keep our clock, try again at the next status tick
        log_handled(logger, "reading the sync clock failed")
        return None


def start_together(view: SwarmView, stop: threading.Event) -> None:
    """Start together: wait until ``wait_peers`` learners (us included) are live, then agree on a start
    instant. Each learner proposes ``now + START_MARGIN_S`` (DHT time, signed subkey) and all start at
    the latest of the first ``wait_peers`` proposals -- the same instant for everyone, which keeps
    step-count schedules in phase (seeing the records at different moments would not)."""
    from p2p_diloco.averaging.decisions import start_instant
    from p2p_diloco.net.membership import owned_values, owner_subkey, store

    me = view.learner
    opts, dht = me.opts, me.joined.dht
    n = opts.wait_peers
    if n <= 1:
        return
    waited_from = last_report = time.monotonic()

    def keep_waiting(what: str) -> bool:
        """False: stop waiting and train no step (a signal, or --max-time ran out); raises on the timeout."""
        nonlocal last_report
        now = time.monotonic()
        verdict = wait_verdict(now, waited_from, opts.started_at, opts.max_time_s, opts.wait_peers_timeout_s)
        if verdict == "timeout":
            raise ValueError(f"{what} within {opts.wait_peers_timeout_s:.0f} s (--wait-peers {n})")
        if verdict == "max-time":
            logger.warning("--max-time %g s ran out while waiting for peers (%s); leaving without training",
                           opts.max_time_s, what)
            return False
        if now - last_report >= opts.wait_peers_report_s:
            last_report = now
            logger.info("%s", waiting_line(view.live_learners, n, now - waited_from))
        return not stop.is_set()

    def started_without_us() -> bool:
        if swarm_started(view.peer_states):
            logger.info("a live learner already trains: starting now, without waiting for %d peers", n)
            return True
        return False

    while view.live_learners < n:
        if not keep_waiting(f"only {view.live_learners} of {n} learners came up") or started_without_us():
            return
        time.sleep(START_BARRIER_POLL_S)
    key = f"{me.local.run_id}_start_barrier"
    now = me.dht_time()
    store(dht, key, now + START_MARGIN_S, now + 10 * START_MARGIN_S + 60, subkey=owner_subkey(me.joined.private_key))
    while True:
        proposals = {p: float(v) for p, v in owned_values(dht.get(key, latest=True)).items()
                     if isinstance(v, (int, float)) and math.isfinite(v)}
        start = start_instant(proposals, n)
        if start is not None:
            break
        if not keep_waiting(f"only {len(proposals)} of {n} learners proposed a start") or started_without_us():
            return
        time.sleep(START_BARRIER_POLL_S)
    wait_s = start - me.dht_time()
    logger.info("%d learners ready; starting together in %.2f s", n, wait_s)
    if wait_s > 0:
        stop.wait(wait_s)
