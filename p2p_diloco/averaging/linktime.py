"""A round's timeouts from the measured link: bytes to move / observed throughput, plus latency.

Fixed timeouts fail on slow links: at 2 Mbit/s and 100 ms round trips, a sender can legitimately be silent
longer than a fixed ``next_chunk_timeout_s``, and a round that would have completed is discarded as partial.
So each round's hivemind timeouts are derived from what this peer must move in it and what it saw the link do:

* **bytes to move** (:func:`allreduce_bytes`): in hivemind's butterfly all-reduce of a payload of V wire
  bytes among n peers, each peer sends (n-1)/n of V to the other reducers and returns (n-1)/n of V (their
  averaged parts), and receives as much: 2(1 - 1/n) V in each direction (measured 1.004x that).
* **throughput** (:func:`estimate_link`): bytes / seconds of the all-reduces of recent committed rounds (the
  all-reduce alone, timed in the averager process; a committed round moved all its bytes), their
  ``THROUGHPUT_QUANTILE`` (a low quantile: one fast round does not shorten everything), before any round
  ``DEADLINE_PRIOR_THROUGHPUT_BPS`` for the deadlines and ``PRIOR_THROUGHPUT_BPS`` for the plans. A failed round's bytes / seconds measure the failure (a hanging peer), not the
  link, so it is not a sample; instead each failed round whose group had formed halves the throughput
  used, up to ``MAX_BACKOFF_STEPS`` times, until one commits (as TCP backs off its retransmission timeout):
  a link slower than the prior still gets rounds through.
* **latency**: hivemind and libp2p expose no round-trip time, so it is measured where a round already
  waits on one: after an all-reduce every member reads the others' verdicts from the DHT, whose nodes
  nearest the key are the group's peers; the fastest of those reads is the round's RTT sample (a read may
  take more than one hop: an overestimate, which only lengthens timeouts). The median of recent samples,
  ``PRIOR_RTT_S`` before any.

From them, ``transfer_s = bytes / throughput + LATENCY_ROUND_TRIPS x rtt`` (:func:`round_timeouts`), and:

* ``sender_timeout_s`` (also hivemind's ``next_chunk_timeout``) = ``SILENCE_SAFETY x transfer_s``: a
  sender's stream shares its uplink with its others, so one stream can be silent for a good part of the
  whole transfer;
* ``reducer_timeout_s`` = ``REDUCER_OVER_SENDER x`` the sender timeout (hivemind's own ratio: a reducer
  answers a part only once every sender's part is in);
* ``allreduce_timeout_s`` = ``ALLREDUCE_SAFETY x transfer_s``;
* ``request_timeout_s`` (a join request waiting on the leader) = :func:`join_s`: ``JOIN_ROUND_TRIPS x rtt``
  (a first round connects: TCP, Noise, yamux, then the request) plus the time one ``STATE_CHUNK_BYTES`` chunk
  takes at the throughput (on a slow link with a deep queue -- a home router's 1 s -- a control message waits
  behind the bulk data of a concurrent transfer: measured, join requests with the fixed timeout failed nearly
  every round at 0.5 Mbit/s), at most ``REQUEST_WINDOW_SHARE`` of the round's window (hivemind deadlocks when it
  is not below the matchmaking time);
* the **matchmaking window** is at least :func:`link_window_s` = ``join_s / REQUEST_WINDOW_SHARE`` (within
  ``[window_min_s, window_max_s]``), so that the request timeout the link needs fits in it;
* ``matchmaking_slack_s`` = ``JOIN_ROUND_TRIPS x rtt``, added to the host's matchmaking deadline.

A **state download** (:func:`download_timeouts`) moves a fragment's anchor and momentum in fp32 from one donor at a
time. Its deadlines come from the same estimate: a donor is dropped only when it is silent for
``DOWNLOAD_SAFETY x`` the expected time of one streamed chunk (``STATE_CHUNK_BYTES``), so a download that progresses,
however slowly, is never killed; the whole download (every donor tried, each vouched) is bounded by
``DOWNLOAD_SAFETY x`` its expected transfer per donor tried. At 0.5 Mbit/s a demo fragment's 1.7 MB take 27 s:
the fixed 15 s per donor this replaced killed every such download, and the retries filled the donors' uplinks.

Today's config values are the floors (a fast link gets exactly them, :func:`floor_timeouts`), and
``MAX_TIMEOUT_SCALE`` x them the caps: a dead peer is still noticed within bounded time. Both keep
``sender < reducer < allreduce`` (checked at construction: hivemind refuses a reducer timeout that is not
above the sender's).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from p2p_diloco.core.codecs import bits_per_element
from p2p_diloco.core.config import AveragingConfig

PRIOR_THROUGHPUT_BPS = 125_000.0
"""Bytes per second assumed before any round committed: 1 Mbit/s, a slow uplink (conservative: long timeouts)."""
DEADLINE_PRIOR_THROUGHPUT_BPS = 31_250.0
"""... for a round's or download's deadlines (:meth:`LinkHistory.estimate`): 0.25 Mbit/s, the slowest link we measure
on. With the 1 Mbit/s prior a first round at 0.25 Mbit/s timed a sender out after 6.9 s of silence and failed for all
four learners; the swarm then declined and replayed its way through the run (23 of 62 rounds committed). Until a round
commits, a dead peer so stalls a first round longer (16 s instead of 7 s on the demo's first round)."""
PRIOR_RTT_S = 0.25
"""Round-trip time in seconds assumed before any was measured (an intercontinental path)."""
LINK_HISTORY_ROUNDS = 8
"""How many recent rounds' throughput and RTT samples the estimate is taken from."""
THROUGHPUT_QUANTILE = 0.25
"""Which quantile of the recent throughputs a round's deadlines use (low: they fit a slower than typical round)."""
PLANNING_QUANTILE = 0.5
"""Which quantile of the recent throughputs the plans use -- the sync period, the window (:meth:`LinkHistory.
measured`): the typical round. With the deadlines' low quantile the period came out 2-3x one sync's link time on
slow links (0.5 Mbit/s, 1 s queues: 45.7 s where a sync took about 16 s): the slowest committed rounds are those
that shared the link with another round, and the period already leaves room for that (``LINK_PERIOD_SAFETY``)."""
METER_SPACING_S = 0.25
"""The link meter keeps a mark of our averagers' byte counters at most this often (:class:`LinkMeter`)."""
METER_MARKS = 2400
"""... and this many marks (10 minutes at that spacing: longer than any round's all-reduce)."""
LATENCY_ROUND_TRIPS = 8.0
"""Round trips an all-reduce spends beyond its bytes: opening streams (connections, in a run's first round),
TCP slow start, the first part's way to its reducer and the average's way back."""
JOIN_ROUND_TRIPS = 4.0
"""Round trips of a join request in a run's first round: connecting (TCP, Noise, yamux) and the request."""
SILENCE_SAFETY = 2.0
"""Sender timeout / transfer_s: how long a sender may be silent, in whole expected transfers."""
REDUCER_OVER_SENDER = 2.0
"""Reducer timeout / sender timeout (hivemind's default ratio, which ``next_chunk_timeout_s`` documents)."""
ALLREDUCE_SAFETY = 5.0
"""All-reduce timeout / transfer_s; above ``SILENCE_SAFETY x REDUCER_OVER_SENDER`` so that the whole
all-reduce outlasts a reducer's silence."""
REQUEST_WINDOW_SHARE = 0.75
"""The request timeout stays below this share of ``window_min_s`` (hivemind's matchmaking time)."""
MAX_TIMEOUT_SCALE = 10.0
"""Caps: at most this many times the config's value (300 s for the default 30 s all-reduce timeout)."""
BACKOFF_BASE = 2.0
"""Each failed round in a row (its group formed) divides the throughput used by this."""
MAX_BACKOFF_STEPS = 4
"""At most this many halvings (16x): beyond, the caps bind anyway."""

STATE_CHUNK_BYTES = 2**16
"""The size of one streamed part of a state download (hivemind's ``STREAMING_CHUNK_SIZE_BYTES``)."""
DOWNLOAD_SAFETY = 4.0
"""A download's silence bound / the expected time of one chunk, and its budget per donor / the expected transfer: a
donor's uplink also carries its own rounds (for seconds on a slow link), and a newcomer's estimate is the prior."""

assert ALLREDUCE_SAFETY > SILENCE_SAFETY * REDUCER_OVER_SENDER, "the all-reduce must outlast a reducer's silence"


@dataclass(frozen=True)
class RoundTimeouts:
    """One round's hivemind timeouts (seconds) and the link figures they were derived from."""

    request_timeout_s: float
    """hivemind ``request_timeout``: a join request waits this long for the leader's answer."""
    sender_timeout_s: float
    """hivemind ``sender_timeout`` and ``next_chunk_timeout``: a sender silent this long is dropped."""
    reducer_timeout_s: float
    """hivemind ``reducer_timeout``: a reducer silent this long has failed us."""
    allreduce_timeout_s: float
    """hivemind ``allreduce_timeout``: the whole all-reduce, once the group has formed."""
    matchmaking_slack_s: float = 0.0
    """Added to the host's matchmaking deadline (scheduled start + two windows)."""
    bytes_to_move: float = 0.0
    """Bytes this peer sends (and receives) in the round, as estimated (0: not derived)."""
    throughput_Bps: float = math.nan
    """Bytes per second used (after any back-off); NaN: not derived (the config's values)."""
    rtt_s: float = math.nan
    transfer_s: float = math.nan
    """bytes_to_move / throughput + latency: the expected all-reduce time the timeouts scale with."""

    def __post_init__(self) -> None:
        if not 0 < self.sender_timeout_s < self.reducer_timeout_s < self.allreduce_timeout_s:
            raise ValueError(f"timeouts must satisfy 0 < sender ({self.sender_timeout_s}) < reducer "
                             f"({self.reducer_timeout_s}) < all-reduce ({self.allreduce_timeout_s})")
        if not self.request_timeout_s > 0 or not self.matchmaking_slack_s >= 0:
            raise ValueError(f"request timeout {self.request_timeout_s} must be > 0 and matchmaking slack "
                             f"{self.matchmaking_slack_s} >= 0")

    def event(self) -> dict[str, float | None]:
        """The round event's ``timeouts`` record (NaN -> None, rounded)."""
        return {k: (round(v, 3) if math.isfinite(v) else None) for k, v in vars(self).items()}


@dataclass(frozen=True)
class LinkEstimate:
    """What the link is believed to do, and from how many samples (0: the prior)."""

    throughput_Bps: float
    rtt_s: float
    throughput_samples: int = 0
    rtt_samples: int = 0


def payload_bytes(numel: int, codec: str) -> float:
    """Wire bytes of ``numel`` values in ``codec`` (scales included, framing not)."""
    return numel * bits_per_element(codec) / 8


def allreduce_bytes(payload: float, group_size: int) -> float:
    """Bytes one peer sends, and receives, in a butterfly all-reduce of ``payload`` bytes among
    ``group_size`` peers: 2(1 - 1/n) x payload (a group below 2 is taken as 2: one moves nothing)."""
    n = max(2, group_size)
    return 2.0 * (1.0 - 1.0 / n) * payload


def expected_group_size(live_peers: int, cfg: AveragingConfig) -> int:
    """The group a round will likely have: us and the other live peers, within the configured sizes."""
    n = live_peers + 1
    if cfg.target_group_size:
        n = min(n, cfg.target_group_size)
    return max(n, cfg.min_group_size)


def sync_link_s(payloads: Sequence[float], group_size: int, link: LinkEstimate, window_s: float = 0.0,
                overhead_s: float = 0.0) -> float:
    """Seconds of one round of each fragment (wire ``payloads`` in bytes) among ``group_size`` peers, back to back:
    each one's matchmaking ``window_s`` (while it matches, its control messages must not queue behind another round's
    data) and its link time at the measured throughput, and *once* the ``overhead_s`` a round spends beyond its
    all-reduce (:meth:`LinkHistory.round_overhead_s`: the arrivals, the decision, the verdicts). What a sync period
    must leave room for (:func:`~p2p_diloco.net.clock.derive_period`): the fragments' rounds are staggered over it.

    Once, not per round: consecutive rounds pipeline -- one round's verdicts and the next one's arrivals are small
    messages that cross the link while the other round's data does -- so the link carries a sync's data back to back
    and only the last round's coordination is left over. Per round, the period held every round's coordination beside
    its data: on 1 s queues it came out 2.0-2.3x one sync's nominal link time at 0.5-0.25 Mbit/s
    (``results/slowlink-21744f4``: 32.8 s at 0.5 Mbit/s for 4 all-reduces of 3.6 s). Without any overhead it held the
    all-reduces and not the rounds that end them: at 1 Mbit/s, 1 s queues, a 9.8 s period for rounds of 2.0-2.9 s
    whose all-reduces took 1.5-1.9 s (the safety factor was 1.5 then too). No round trips on top: a measured throughput
    is a round's bytes over its whole all-reduce's seconds, which hold them."""
    return sum(window_s + allreduce_bytes(p, group_size) / link.throughput_Bps for p in payloads) + overhead_s


def throughput_sample(bytes_moved: float, seconds: float) -> float | None:
    """Bytes per second of one all-reduce, or None when it says nothing (no bytes, no or non-finite time)."""
    if not (math.isfinite(bytes_moved) and math.isfinite(seconds)) or bytes_moved <= 0 or seconds <= 0:
        return None
    return bytes_moved / seconds


def estimate_link(throughputs: Sequence[float], rtts: Sequence[float], failures: int = 0,
                  quantile: float = THROUGHPUT_QUANTILE, prior_Bps: float = PRIOR_THROUGHPUT_BPS) -> LinkEstimate:
    """The link from recent samples (only the last ``LINK_HISTORY_ROUNDS`` count; non-finite or non-positive
    ones are ignored): throughput at ``quantile`` (lower nearest rank), RTT the median, each its
    prior without samples (``prior_Bps``, :data:`PRIOR_RTT_S`); the throughput divided by ``BACKOFF_BASE`` per
    failed round in a row."""
    rates = sorted(x for x in throughputs[-LINK_HISTORY_ROUNDS:] if math.isfinite(x) and x > 0)
    trips = [x for x in rtts[-LINK_HISTORY_ROUNDS:] if math.isfinite(x) and x > 0]
    rate = rates[int(quantile * (len(rates) - 1))] if rates else prior_Bps
    rate /= BACKOFF_BASE ** min(max(0, failures), MAX_BACKOFF_STEPS)
    rtt = statistics.median(trips) if trips else PRIOR_RTT_S
    return LinkEstimate(rate, rtt, len(rates), len(trips))


def floor_timeouts(cfg: AveragingConfig) -> RoundTimeouts:
    """The config's fixed values: what a round gets on a fast link, and where no link was measured."""
    return RoundTimeouts(request_timeout_s=cfg.request_timeout_s, sender_timeout_s=cfg.next_chunk_timeout_s,
                         reducer_timeout_s=REDUCER_OVER_SENDER * cfg.next_chunk_timeout_s,
                         allreduce_timeout_s=cfg.allreduce_timeout_s)


def join_s(link: LinkEstimate, bytes_to_move: float) -> float:
    """How long a join request may take on ``link``: its round trips, and one streamed chunk of a concurrent
    transfer ahead of it in a queue (see the module docstring) -- no more than the round's own ``bytes_to_move``:
    the concurrent transfers are rounds like it, and on small payloads the throughput measured is mostly latency."""
    return control_message_s(link.rtt_s, link.throughput_Bps, min(STATE_CHUNK_BYTES, bytes_to_move))


def control_message_s(rtt_s: float, throughput_Bps: float, queued_bytes: float) -> float:
    """How long a small control message (a join request, a verdict) may take on a link: its ``JOIN_ROUND_TRIPS``
    round trips, and ``queued_bytes`` of other transfers ahead of it in the link's queue."""
    return JOIN_ROUND_TRIPS * rtt_s + queued_bytes / throughput_Bps


def verdict_wait_s(cfg: AveragingConfig, limits: RoundTimeouts) -> float:
    """How long a member of a group from the clock waits for the others' verdicts after its all-reduce:
    ``commit_timeout_s``, and on a measured link (``limits`` derived from one) what a control message may wait there
    besides -- its round trips and a concurrent round's transfer queued ahead of it: a slow link is kept busy by
    design, the next fragment's all-reduce starting as this one ends, so a verdict may wait behind as many bytes as a
    round sends (``bytes_to_move``, one streamed chunk at least). At 0.5 Mbit/s with 1 s queues the fixed 3 s
    discarded 5 of 88 rounds as "no verdict from 1 of 4 members"; at 0.25 Mbit/s one streamed chunk's allowance (6 s)
    discarded 4 of 74 (two rounds, each split: members with every verdict committed; a verdict's fastest
    acknowledgment took up to 5.8 s there, and a round's sends, 187 kB, take 6 s)."""
    if not (math.isfinite(limits.throughput_Bps) and math.isfinite(limits.rtt_s) and limits.throughput_Bps > 0):
        return cfg.commit_timeout_s
    queued = max(STATE_CHUNK_BYTES, limits.bytes_to_move) if math.isfinite(limits.bytes_to_move) else STATE_CHUNK_BYTES
    return cfg.commit_timeout_s + control_message_s(limits.rtt_s, limits.throughput_Bps, queued)


def link_window_s(link: LinkEstimate, cfg: AveragingConfig, bytes_to_move: float) -> float:
    """The shortest matchmaking window ``link`` allows for rounds moving ``bytes_to_move``: one whose request
    timeout share holds :func:`join_s` (within ``[window_min_s, window_max_s]``)."""
    return min(cfg.window_max_s, max(cfg.window_min_s, join_s(link, bytes_to_move) / REQUEST_WINDOW_SHARE))


def round_timeouts(bytes_to_move: float, link: LinkEstimate, cfg: AveragingConfig,
                   window_s: float = 0.0) -> RoundTimeouts:
    """A round's timeouts for moving ``bytes_to_move`` (each way) over ``link`` in a round whose matchmaking
    window is ``window_s`` (the request timeout stays within its share of it); see the module docstring."""
    if not (math.isfinite(bytes_to_move) and bytes_to_move >= 0):
        raise ValueError(f"bytes_to_move must be a finite number >= 0, got {bytes_to_move}")
    if not (math.isfinite(link.throughput_Bps) and link.throughput_Bps > 0 and math.isfinite(link.rtt_s)
            and link.rtt_s >= 0):
        raise ValueError(f"the link estimate must be finite and positive, got {link}")
    floor = floor_timeouts(cfg)
    transfer_s = bytes_to_move / link.throughput_Bps + LATENCY_ROUND_TRIPS * link.rtt_s

    def bounded(value: float, least: float) -> float:
        return min(max(value, least), MAX_TIMEOUT_SCALE * least)

    sender_s = bounded(SILENCE_SAFETY * transfer_s, floor.sender_timeout_s)
    request_cap_s = max(floor.request_timeout_s, REQUEST_WINDOW_SHARE * max(cfg.window_min_s, window_s))
    return RoundTimeouts(
        request_timeout_s=min(max(join_s(link, bytes_to_move), floor.request_timeout_s), request_cap_s),
        sender_timeout_s=sender_s,
        reducer_timeout_s=REDUCER_OVER_SENDER * sender_s,
        allreduce_timeout_s=bounded(ALLREDUCE_SAFETY * transfer_s, floor.allreduce_timeout_s),
        matchmaking_slack_s=min(JOIN_ROUND_TRIPS * link.rtt_s, cfg.window_max_s),
        bytes_to_move=bytes_to_move, throughput_Bps=link.throughput_Bps, rtt_s=link.rtt_s, transfer_s=transfer_s)


@dataclass(frozen=True)
class DownloadTimeouts:
    """A state download's deadlines (seconds) and what they were derived from."""

    silence_s: float
    """A donor that sends nothing for this long is dropped (the next one is tried)."""
    per_donor_s: float
    """The expected transfer of the whole state from one donor, times ``DOWNLOAD_SAFETY`` (the total's share)."""
    state_bytes: float
    throughput_Bps: float
    rtt_s: float

    def total_s(self, donors: int, per_donor_extra_s: float) -> float:
        """The whole download's bound: ``donors`` each taking ``per_donor_s`` plus ``per_donor_extra_s``."""
        return donors * (self.per_donor_s + per_donor_extra_s)


def download_timeouts(state_bytes: float, link: LinkEstimate, cfg: AveragingConfig) -> DownloadTimeouts:
    """A state download's deadlines for ``state_bytes`` over ``link`` (see the module docstring); the config's
    ``next_chunk_timeout_s`` and ``state_timeout_s`` are the floors, ``MAX_TIMEOUT_SCALE`` x them the caps."""
    if not (math.isfinite(state_bytes) and state_bytes >= 0):
        raise ValueError(f"state_bytes must be a finite number >= 0, got {state_bytes}")
    rate, rtt = link.throughput_Bps, link.rtt_s
    if not (math.isfinite(rate) and rate > 0 and math.isfinite(rtt) and rtt >= 0):
        raise ValueError(f"the link estimate must be finite and positive, got {link}")

    def bounded(value: float, least: float) -> float:
        return min(max(value, least), MAX_TIMEOUT_SCALE * least)

    chunk_s = min(STATE_CHUNK_BYTES, state_bytes) / rate + LATENCY_ROUND_TRIPS * rtt
    transfer_s = state_bytes / rate + LATENCY_ROUND_TRIPS * rtt
    return DownloadTimeouts(silence_s=bounded(DOWNLOAD_SAFETY * chunk_s, cfg.next_chunk_timeout_s),
                            per_donor_s=bounded(DOWNLOAD_SAFETY * transfer_s, cfg.state_timeout_s),
                            state_bytes=state_bytes, throughput_Bps=rate, rtt_s=rtt)


@dataclass
class LinkMeter:
    """What our link carried, every fragment's rounds together: marks of the averagers' byte counters, taken as the
    engine steps. A round's own throughput is its share of the link while other rounds of ours ran beside it; the
    link's is what all of them moved meanwhile (:meth:`rate`)."""

    marks: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=METER_MARKS))
    """(monotonic seconds, bytes sent, bytes received), oldest first."""

    def mark(self, t: float, counters: Callable[[], tuple[int, int]]) -> None:
        """Note the ``counters`` -- (bytes sent, bytes received), read only for a mark that is kept -- at ``t`` (kept
        when :data:`METER_SPACING_S` passed since the last mark: the engine marks every step)."""
        if not self.marks or t - self.marks[-1][0] >= METER_SPACING_S:
            self.marks.append((t, *counters()))

    def rate(self, start: float, end: float) -> float | None:
        """Bytes per second our rounds moved (the larger direction) from the last mark at or before ``start`` to the
        first at or after ``end`` -- an interval that holds ``[start, end]``; None where the marks do not cover it."""
        before = [m for m in self.marks if m[0] <= start]
        after = [m for m in self.marks if m[0] >= end]
        if not before or not after:
            return None
        (t0, sent0, received0), (t1, sent1, received1) = before[-1], after[0]
        return throughput_sample(max(sent1 - sent0, received1 - received0), t1 - t0)


@dataclass
class LinkHistory:
    """What a learner saw of its link, round after round (one per learner: every fragment shares the link)."""

    throughputs: list[float] = field(default_factory=list)
    """Committed rounds' own throughputs: what a round got, which its deadlines are sized by."""
    link_throughputs: list[float] = field(default_factory=list)
    """... or, where more, what the link carried while each ran, every round of ours together (:class:`LinkMeter`):
    what the plans -- the period, the window -- are sized by."""
    rtts: list[float] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)
    """Committed rounds' seconds beyond their all-reduce (:meth:`round_overhead_s`)."""
    failures: int = 0
    """Rounds in a row whose all-reduce ran but which did not commit (the back-off)."""

    def observe(self, *, committed: bool, bytes_moved: float, allreduce_s: float, rtt_s: float,
                duration_s: float = math.nan, link_Bps: float | None = None) -> None:
        """Learn from a round that ended (``allreduce_s``: NaN when no all-reduce ran; ``duration_s``: the whole
        round's seconds, NaN if not known; ``link_Bps``: what the link carried meanwhile, every round of ours
        together, None if not known): its RTT sample if it has one; a committed round's throughput and overhead
        (and the back-off ends); a failed round whose all-reduce ran adds a back-off step (one that found no group
        says nothing about the link)."""
        if math.isfinite(rtt_s) and rtt_s > 0:
            self.rtts = [*self.rtts, rtt_s][-LINK_HISTORY_ROUNDS:]
        if committed:
            sample = throughput_sample(bytes_moved, allreduce_s)
            if sample is not None:
                self.throughputs = [*self.throughputs, sample][-LINK_HISTORY_ROUNDS:]
                link = max(sample, link_Bps) if link_Bps is not None and math.isfinite(link_Bps) else sample
                self.link_throughputs = [*self.link_throughputs, link][-LINK_HISTORY_ROUNDS:]
                if math.isfinite(duration_s):
                    self.overheads = [*self.overheads, max(0.0, duration_s - allreduce_s)][-LINK_HISTORY_ROUNDS:]
            self.failures = 0
        elif math.isfinite(allreduce_s):
            self.failures += 1

    def estimate(self) -> LinkEstimate:
        """The link for a round's deadlines: backed off by the failures in a row (:data:`DEADLINE_PRIOR_THROUGHPUT_BPS`
        before any round committed)."""
        return estimate_link(self.throughputs, self.rtts, self.failures, prior_Bps=DEADLINE_PRIOR_THROUGHPUT_BPS)

    def measured(self) -> LinkEstimate:
        """The link for planning (the window, the period): the typical round's link throughput -- what the link
        carried while it ran, our other rounds' bytes included (:data:`PLANNING_QUANTILE` of
        :attr:`link_throughputs`) --, the back-off only until a round committed: a period or window stretched by lost
        rounds would stretch further with every round they lose. Not a round's own share: at 0.25 Mbit/s rounds that
        ran two at a time each measured half the link, the period derived from them doubled (41.8 to 84.8 s, 2.6x
        what one sync's link time calls for), and a fragment whose boundary then came while the others' rounds ran
        never synced."""
        return estimate_link(self.link_throughputs, self.rtts, 0 if self.link_throughputs else self.failures,
                             quantile=PLANNING_QUANTILE)

    def round_overhead_s(self) -> float:
        """The median seconds a recent committed round spent beyond its all-reduce (0.0 before one): the arrivals,
        offers, decision and verdicts, which on a slow link with a deep queue wait behind the data of the round
        before (a round holds its link for all of it)."""
        return statistics.median(self.overheads) if self.overheads else 0.0
