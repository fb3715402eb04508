"""Pure rules of the per-round timeouts (:mod:`p2p_diloco.averaging.linktime`): bytes to move / observed
throughput plus latency, floored at the config's values, capped, learned from the rounds seen."""

from __future__ import annotations

import math

import pytest

from p2p_diloco.averaging.linktime import (
    ALLREDUCE_SAFETY,
    BACKOFF_BASE,
    JOIN_ROUND_TRIPS,
    LATENCY_ROUND_TRIPS,
    MAX_BACKOFF_STEPS,
    MAX_TIMEOUT_SCALE,
    DEADLINE_PRIOR_THROUGHPUT_BPS,
    PRIOR_RTT_S,
    PRIOR_THROUGHPUT_BPS,
    REDUCER_OVER_SENDER,
    REQUEST_WINDOW_SHARE,
    SILENCE_SAFETY,
    STATE_CHUNK_BYTES,
    LinkEstimate,
    LinkHistory,
    LinkMeter,
    RoundTimeouts,
    allreduce_bytes,
    estimate_link,
    expected_group_size,
    floor_timeouts,
    join_s,
    link_window_s,
    payload_bytes,
    round_timeouts,
    sync_link_s,
    throughput_sample,
)
from p2p_diloco.core.config import AveragingConfig

CFG = AveragingConfig()  # the defaults: sender 5 s, reducer 10 s, all-reduce 30 s, request 0.5 s
SLOW = LinkEstimate(throughput_Bps=250_000.0, rtt_s=0.1)  # 2 Mbit/s, 100 ms: results/wan-rtt's link
FAST = LinkEstimate(throughput_Bps=1e9, rtt_s=0.001)  # loopback


def floors(t: RoundTimeouts) -> tuple[float, float, float, float]:
    return t.request_timeout_s, t.sender_timeout_s, t.reducer_timeout_s, t.allreduce_timeout_s


def test_a_slow_link_gets_timeouts_proportional_to_bytes_over_throughput_plus_rtt() -> None:
    moved = 2_000_000.0
    t = round_timeouts(moved, SLOW, CFG)
    transfer_s = moved / SLOW.throughput_Bps + LATENCY_ROUND_TRIPS * SLOW.rtt_s  # 8 s of bytes + 0.8 s of latency
    assert t.transfer_s == pytest.approx(transfer_s)
    assert t.sender_timeout_s == pytest.approx(SILENCE_SAFETY * transfer_s)
    assert t.sender_timeout_s > CFG.next_chunk_timeout_s and t.allreduce_timeout_s > CFG.allreduce_timeout_s
    assert t.reducer_timeout_s == pytest.approx(REDUCER_OVER_SENDER * t.sender_timeout_s)
    assert t.allreduce_timeout_s == pytest.approx(ALLREDUCE_SAFETY * transfer_s)
    # twice the bytes: the bytes' share of every timeout doubles, the latency's does not
    t2 = round_timeouts(2 * moved, SLOW, CFG)
    assert t2.sender_timeout_s - t.sender_timeout_s == pytest.approx(SILENCE_SAFETY * moved / SLOW.throughput_Bps)
    # a longer round trip lengthens the same round, and the join requests (up to their cap)
    far = round_timeouts(moved, LinkEstimate(SLOW.throughput_Bps, 0.18), CFG)
    assert far.sender_timeout_s == pytest.approx(t.sender_timeout_s + SILENCE_SAFETY * LATENCY_ROUND_TRIPS * 0.08)
    chunk_s = STATE_CHUNK_BYTES / SLOW.throughput_Bps  # a join request may queue behind one chunk of data
    assert t.request_timeout_s == pytest.approx(JOIN_ROUND_TRIPS * 0.1 + chunk_s) == pytest.approx(join_s(SLOW, moved))
    assert far.request_timeout_s == REQUEST_WINDOW_SHARE * CFG.window_min_s  # 0.98 s: capped by the 1 s window
    wide = round_timeouts(moved, LinkEstimate(SLOW.throughput_Bps, 0.18), CFG, window_s=2.0)
    assert wide.request_timeout_s == pytest.approx(JOIN_ROUND_TRIPS * 0.18 + chunk_s)  # a 2 s window holds it
    assert far.matchmaking_slack_s == pytest.approx(JOIN_ROUND_TRIPS * 0.18)
    assert t.bytes_to_move == moved and t.throughput_Bps == SLOW.throughput_Bps and t.rtt_s == SLOW.rtt_s


def test_a_fast_link_gets_the_config_values() -> None:
    t = round_timeouts(1_000_000.0, FAST, CFG)
    assert floors(t) == floors(floor_timeouts(CFG)) == (0.5, 5.0, 10.0, 30.0)
    assert floor_timeouts(CFG).matchmaking_slack_s == 0.0  # today's matchmaking deadline
    assert round_timeouts(0.0, LinkEstimate(1e9, 0.0), CFG).matchmaking_slack_s == 0.0


def test_caps_hold_and_keep_the_order_hivemind_needs() -> None:
    t = round_timeouts(1e12, LinkEstimate(1.0, 30.0), CFG)  # hopeless: every cap binds
    assert t.sender_timeout_s == MAX_TIMEOUT_SCALE * CFG.next_chunk_timeout_s
    assert t.reducer_timeout_s == REDUCER_OVER_SENDER * t.sender_timeout_s
    assert t.allreduce_timeout_s == MAX_TIMEOUT_SCALE * CFG.allreduce_timeout_s
    assert t.request_timeout_s == REQUEST_WINDOW_SHARE * CFG.window_min_s < CFG.window_min_s
    assert t.matchmaking_slack_s == CFG.window_max_s
    for moved in (0.0, 1e3, 1e5, 1e6, 1e7, 1e8, 1e10):  # sender < reducer < all-reduce, floors and caps
        for link in (FAST, SLOW, LinkEstimate(1e4, 1.0)):
            x = round_timeouts(moved, link, CFG)
            assert x.sender_timeout_s < x.reducer_timeout_s < x.allreduce_timeout_s
            assert all(a >= b for a, b in zip(floors(x), floors(floor_timeouts(CFG))))  # never below the config
            assert x.allreduce_timeout_s <= MAX_TIMEOUT_SCALE * CFG.allreduce_timeout_s


def test_bad_inputs_and_orders_are_refused() -> None:
    with pytest.raises(ValueError, match="bytes_to_move"):
        round_timeouts(math.nan, SLOW, CFG)
    with pytest.raises(ValueError, match="link estimate"):
        round_timeouts(1.0, LinkEstimate(0.0, 0.1), CFG)
    with pytest.raises(ValueError, match="sender"):
        RoundTimeouts(request_timeout_s=0.5, sender_timeout_s=5.0, reducer_timeout_s=5.0, allreduce_timeout_s=30.0)
    event = round_timeouts(1e6, SLOW, CFG).event()
    assert event["sender_timeout_s"] is not None and set(event) >= {"request_timeout_s", "reducer_timeout_s",
                                                                    "allreduce_timeout_s", "rtt_s", "transfer_s"}
    assert floor_timeouts(CFG).event()["throughput_Bps"] is None  # NaN: not derived


def test_bytes_to_move_follow_the_butterfly() -> None:
    assert payload_bytes(1000, "fp32") == 4000 and payload_bytes(1000, "fp16") == 2000
    assert 500 < payload_bytes(1000, "int4") < 600  # 4 bits + the blocks' scales
    assert allreduce_bytes(1000.0, 2) == 1000.0 and allreduce_bytes(1000.0, 4) == 1500.0
    assert allreduce_bytes(1000.0, 1) == allreduce_bytes(1000.0, 2)  # a group of one moves nothing: as two
    assert expected_group_size(0, CFG) == CFG.min_group_size  # alone so far: the smallest group
    assert expected_group_size(5, CFG) == 6
    assert expected_group_size(5, AveragingConfig(target_group_size=3)) == 3


def test_the_prior_is_used_before_any_round() -> None:
    """The deadlines assume the slowest link we measure on, the plans a slow uplink."""
    assert LinkHistory().estimate() == LinkEstimate(DEADLINE_PRIOR_THROUGHPUT_BPS, PRIOR_RTT_S, 0, 0)
    assert LinkHistory().measured() == LinkEstimate(PRIOR_THROUGHPUT_BPS, PRIOR_RTT_S, 0, 0)
    assert DEADLINE_PRIOR_THROUGHPUT_BPS < PRIOR_THROUGHPUT_BPS
    history = LinkHistory()
    history.observe(committed=False, bytes_moved=0, allreduce_s=math.nan, rtt_s=math.nan)  # no group formed
    assert history.estimate() == LinkEstimate(DEADLINE_PRIOR_THROUGHPUT_BPS, PRIOR_RTT_S, 0, 0)


def test_the_estimator_ignores_rounds_that_say_nothing_about_the_link() -> None:
    for moved, seconds in ((1000, 0.0), (1000, math.nan), (1000, math.inf), (0, 1.0), (math.nan, 1.0), (5, -1.0)):
        assert throughput_sample(moved, seconds) is None, (moved, seconds)
    assert throughput_sample(1000, 2.0) == 500.0
    history = LinkHistory()
    history.observe(committed=True, bytes_moved=1000, allreduce_s=0.0, rtt_s=0.0)  # zero duration, zero RTT
    history.observe(committed=True, bytes_moved=1000, allreduce_s=math.nan, rtt_s=math.inf)
    assert history.estimate() == LinkEstimate(DEADLINE_PRIOR_THROUGHPUT_BPS, PRIOR_RTT_S, 0, 0)
    history.observe(committed=True, bytes_moved=1_000_000, allreduce_s=4.0, rtt_s=0.1)
    assert history.estimate() == LinkEstimate(250_000.0, 0.1, 1, 1)
    assert estimate_link([math.nan, -1.0, 0.0, 100.0], [math.nan, 0.2]) == LinkEstimate(100.0, 0.2, 1, 1)


def test_the_estimate_is_a_low_quantile_of_recent_rounds() -> None:
    assert estimate_link([500.0, 100.0, 400.0, 200.0, 300.0], []).throughput_Bps == 200.0  # not the outlier
    assert estimate_link([1.0] + [1000.0] * 8, []).throughput_Bps == 1000.0  # only the last 8 rounds count
    assert estimate_link([], [0.1, 0.1, 3.0]).rtt_s == 0.1  # the median: one slow read does not move it
    history = LinkHistory()
    for i in range(20):
        history.observe(committed=True, bytes_moved=1000 * (i + 1), allreduce_s=1.0, rtt_s=0.01 * (i + 1))
    assert len(history.throughputs) == len(history.rtts) == 8


def test_failed_rounds_back_off_until_one_commits() -> None:
    history = LinkHistory()
    history.observe(committed=True, bytes_moved=1_000_000, allreduce_s=1.0, rtt_s=0.05)
    for k in range(1, 7):  # a link slower than what we saw: each failed all-reduce halves the rate used
        history.observe(committed=False, bytes_moved=10, allreduce_s=5.0, rtt_s=math.nan)
        assert history.estimate().throughput_Bps == 1_000_000 / BACKOFF_BASE ** min(k, MAX_BACKOFF_STEPS)
    history.observe(committed=False, bytes_moved=0, allreduce_s=math.nan, rtt_s=math.nan)  # no group: no step
    assert history.failures == 6
    history.observe(committed=True, bytes_moved=800_000, allreduce_s=1.0, rtt_s=0.05)
    assert history.failures == 0 and history.estimate().throughput_Bps == 800_000  # the low quantile of two
    longer = round_timeouts(1e7, estimate_link([1e6], [0.05], failures=2), CFG)
    assert longer.sender_timeout_s > round_timeouts(1e7, estimate_link([1e6], [0.05]), CFG).sender_timeout_s


# ---------------------------------------------------------------- state downloads


def test_a_state_download_gets_silence_and_budget_from_its_bytes() -> None:
    from p2p_diloco.averaging.linktime import DOWNLOAD_SAFETY, STATE_CHUNK_BYTES, download_timeouts

    half_mbit = LinkEstimate(throughput_Bps=62_500.0, rtt_s=0.1)  # 0.5 Mbit/s: a demo fragment's 1.7 MB take 27 s
    t = download_timeouts(1_700_000, half_mbit, CFG)
    assert t.per_donor_s == pytest.approx(DOWNLOAD_SAFETY * (1_700_000 / 62_500 + LATENCY_ROUND_TRIPS * 0.1))
    assert t.per_donor_s > CFG.state_timeout_s  # the fixed 15 s killed every such download
    assert t.silence_s == pytest.approx(DOWNLOAD_SAFETY * (STATE_CHUNK_BYTES / 62_500 + LATENCY_ROUND_TRIPS * 0.1))
    assert t.total_s(4, 3.0) == pytest.approx(4 * (t.per_donor_s + 3.0))
    # a fast link gets the config's values, a hopeless one the caps
    fast = download_timeouts(1_700_000, FAST, CFG)
    assert (fast.silence_s, fast.per_donor_s) == (CFG.next_chunk_timeout_s, CFG.state_timeout_s)
    crawl = download_timeouts(1_700_000, LinkEstimate(throughput_Bps=10.0, rtt_s=1.0), CFG)
    assert crawl.per_donor_s == MAX_TIMEOUT_SCALE * CFG.state_timeout_s
    assert crawl.silence_s == MAX_TIMEOUT_SCALE * CFG.next_chunk_timeout_s
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="state_bytes"):
            download_timeouts(bad, FAST, CFG)
    with pytest.raises(ValueError, match="link estimate"):
        download_timeouts(1.0, LinkEstimate(throughput_Bps=0.0, rtt_s=0.1), CFG)


def test_the_window_grows_to_hold_a_join_request_on_a_slow_deep_queued_link() -> None:
    half_mbit = LinkEstimate(throughput_Bps=31_000.0, rtt_s=0.3)  # what 4 hosts measured at 0.5 Mbit/s, 1 s queue
    window = link_window_s(half_mbit, CFG, 1e5)
    assert window == pytest.approx((JOIN_ROUND_TRIPS * 0.3 + STATE_CHUNK_BYTES / 31_000.0) / REQUEST_WINDOW_SHARE)
    assert CFG.window_min_s < window < CFG.window_max_s
    t = round_timeouts(1e5, half_mbit, CFG, window_s=window)
    assert t.request_timeout_s == pytest.approx(join_s(half_mbit, 1e5))
    assert t.request_timeout_s < window  # hivemind needs it below the window
    assert link_window_s(FAST, CFG, 1e5) == CFG.window_min_s  # a fast link: the adaptive window alone decides
    assert link_window_s(LinkEstimate(100.0, 5.0), CFG, 1e5) == CFG.window_max_s  # capped
    # a small payload queues behind no more than its own bytes
    assert join_s(half_mbit, 1e4) == pytest.approx(JOIN_ROUND_TRIPS * 0.3 + 1e4 / 31_000.0)


def test_one_sync_takes_every_fragments_window_and_link_time() -> None:
    payloads = [100_000.0, 50_000.0]
    bare = sync_link_s(payloads, 4, SLOW)  # the measured throughput holds the round trips: none on top
    assert bare == pytest.approx(sum(allreduce_bytes(p, 4) / SLOW.throughput_Bps for p in payloads))
    assert sync_link_s(payloads, 4, SLOW, window_s=3.0) == pytest.approx(bare + 2 * 3.0)


def test_a_sync_holds_the_transfers_back_to_back_and_one_rounds_overhead() -> None:
    """At 1 Mbit/s with 1 s queues rounds took 2.0-2.9 s of which the all-reduce 1.5-1.9 s: the period must hold the
    rounds, not only their transfers -- but consecutive rounds pipeline (one's verdicts cross the link beside the
    next one's data), so the overhead counts once per sync, not per round."""
    h = LinkHistory()
    assert h.round_overhead_s() == 0.0  # nothing measured
    h.observe(committed=True, bytes_moved=1e5, allreduce_s=2.0, rtt_s=0.2)  # no duration known: no sample
    assert h.round_overhead_s() == 0.0
    for duration in (2.5, 3.0, 2.0, 9.0):  # the median of the overheads (0.5, 1.0, 0.0, 7.0)
        h.observe(committed=True, bytes_moved=1e5, allreduce_s=2.0, rtt_s=0.2, duration_s=duration)
    h.observe(committed=False, bytes_moved=1e5, allreduce_s=2.0, rtt_s=0.2, duration_s=60.0)  # lost: no sample
    assert h.round_overhead_s() == pytest.approx(0.75)
    payloads = [100_000.0, 50_000.0]
    bare = sync_link_s(payloads, 4, SLOW)
    assert sync_link_s(payloads, 4, SLOW, overhead_s=0.75) == pytest.approx(bare + 0.75)


def test_planning_ignores_the_back_off_once_a_round_committed() -> None:
    h = LinkHistory()
    h.observe(committed=False, bytes_moved=1e5, allreduce_s=5.0, rtt_s=0.2)
    assert h.measured().throughput_Bps == PRIOR_THROUGHPUT_BPS / BACKOFF_BASE  # nothing committed yet: the
    assert h.estimate().throughput_Bps == DEADLINE_PRIOR_THROUGHPUT_BPS / BACKOFF_BASE  # backed-off priors
    h.observe(committed=True, bytes_moved=1e5, allreduce_s=2.0, rtt_s=0.2)
    h.observe(committed=False, bytes_moved=1e5, allreduce_s=5.0, rtt_s=0.2)
    assert h.estimate().throughput_Bps == 5e4 / BACKOFF_BASE  # deadlines back off
    assert h.measured().throughput_Bps == 5e4  # the window and the period do not


def test_plans_take_the_typical_round_and_deadlines_a_slow_one() -> None:
    """The period and the window plan for the median committed round; a round's deadlines fit a slower one (on slow
    links the slowest committed rounds are those that shared the link with another)."""
    h = LinkHistory()
    for seconds in (2.0, 2.0, 4.0, 8.0, 8.0):  # 1e5 bytes each
        h.observe(committed=True, bytes_moved=1e5, allreduce_s=seconds, rtt_s=0.2)
    assert h.measured().throughput_Bps == pytest.approx(1e5 / 4.0)  # the median round
    assert h.estimate().throughput_Bps == pytest.approx(1e5 / 8.0)  # the lower quartile's


def test_plans_take_what_the_link_carried_while_a_round_ran_and_deadlines_the_rounds_own_share() -> None:
    """Two rounds of ours that ran together each got half the link: the plans (the period, the window) take what the
    link carried meanwhile, every round of ours together; the round's deadlines its own share. A link sample never
    falls below the round's own."""
    meter = LinkMeter()
    for t in range(0, 21):  # every second: 2e4 bytes out, 1e4 in -- two rounds of 1e4 bytes a second each
        meter.mark(float(t), lambda t=t: (20_000 * t, 10_000 * t))
    assert meter.rate(4.0, 12.0) == pytest.approx(2e4)  # the larger direction, over the marks that hold [4, 12]
    assert meter.rate(4.5, 11.5) == pytest.approx(2e4)  # (from 4 to 12)
    assert meter.rate(-1.0, 5.0) is None and meter.rate(5.0, 25.0) is None  # not covered: unknown
    meter.mark(20.1, lambda: pytest.fail("counters read for a mark that is not kept"))  # too close to the last
    assert meter.marks[-1] == (20.0, 400_000, 200_000)
    h = LinkHistory()
    h.observe(committed=True, bytes_moved=8e4, allreduce_s=8.0, rtt_s=0.2, link_Bps=meter.rate(4.0, 12.0))
    assert h.measured().throughput_Bps == pytest.approx(2e4)  # the link's
    assert h.estimate().throughput_Bps == pytest.approx(1e4)  # the round's own
    h.observe(committed=True, bytes_moved=8e4, allreduce_s=2.0, rtt_s=0.2, link_Bps=1e4)  # a coarse mark's window
    h.observe(committed=True, bytes_moved=8e4, allreduce_s=2.0, rtt_s=0.2, link_Bps=None)  # not covered
    assert h.link_throughputs == [2e4, 4e4, 4e4]  # never below the round's own sample
    h.observe(committed=False, bytes_moved=8e4, allreduce_s=2.0, rtt_s=0.2, link_Bps=1e9)  # a failed round: no sample
    assert len(h.link_throughputs) == 3


def test_a_round_waits_while_another_fragment_holds_a_link_too_slow_for_the_period() -> None:
    """The engine's rule (:func:`p2p_diloco.engine.rounds.link_busy`) on a stand-in for its rounds: a round starts
    beside another fragment's only once a round measured the link and the period leaves it the time for a sync's
    transfers and a round's overhead (the period's safety factor is not required: it is the leader's margin);
    latency does not count (it is not shared)."""
    from types import SimpleNamespace

    from p2p_diloco.engine.rounds import link_busy, transfer_on_link
    from p2p_diloco.net.clock import LINK_PERIOD_SAFETY, SyncClock

    payload, group, fragments, rate_Bps = 200_000.0, 4, 4, 50_000.0
    need_s = fragments * allreduce_bytes(payload, group) / rate_Bps  # 24 s
    slots = [SimpleNamespace(index=i, inflight=None, inflight_kind="round", inflight_since=0.0, names=("w",),
                             anchor={"w": SimpleNamespace(numel=lambda: 100_000)}) for i in range(fragments)]
    history = LinkHistory()
    now = [1000.0]

    def rounds(period_s: float | None) -> SimpleNamespace:
        clock = SyncClock(period_s, 0.0, 0) if period_s is not None else None
        return SimpleNamespace(view=SimpleNamespace(clock=clock), slots=slots, link=history,
                               one_sync=lambda: ([payload] * fragments, group), dht_time=lambda: now[0])

    assert link_busy(rounds(1000.0), slots[1]) == ""  # nothing else on the link
    slots[0].inflight = object()
    assert "no round of ours has measured" in link_busy(rounds(1000.0), slots[1])  # one at a time until measured
    assert link_busy(rounds(None), slots[1]) == ""  # no clock (the step schedule): not this rule's
    history.observe(committed=True, bytes_moved=rate_Bps * 10, allreduce_s=10.0, rtt_s=5.0)  # measured; far
    busy = link_busy(rounds(need_s / 2), slots[1])
    assert busy.startswith("fragment 0 is still on the link") and f"{need_s:.1f} s" in busy, busy
    assert link_busy(rounds(need_s * 1.01), slots[1]) == ""  # the period fits the link: rounds may overlap
    assert need_s * 1.01 < LINK_PERIOD_SAFETY * need_s  # ... below the period the leader would derive
    history.observe(committed=True, bytes_moved=rate_Bps * 10, allreduce_s=10.0, rtt_s=5.0, duration_s=12.0)
    assert link_busy(rounds(need_s * 1.01), slots[1]) != ""  # a round's overhead (2 s) counts too ...
    assert link_busy(rounds(need_s * 1.01 + 2.0), slots[1]) == ""  # ... once: the rounds pipeline
    # ... past each other's coordination, not their data: fragment 0's round (6 s of data) started 2 s ago, so the
    # round waits a little (transfer_on_link; link_busy, which declines, leaves it alone)
    slots[0].inflight_since = now[0] - 2.0
    assert link_busy(rounds(need_s * 10), slots[1]) == ""
    busy = transfer_on_link(rounds(need_s * 10), slots[1])
    assert busy.startswith("fragment 0's transfer is still on the link (2.0 s of about 6.0 s)"), busy
    now[0] += 4.5
    assert transfer_on_link(rounds(need_s * 10), slots[1]) == ""  # its data is through: only its verdicts are left
    slots[0].inflight_kind = "fetch"  # a download's: its fp32 anchor and momentum, 800 kB: 16 s
    assert "transfer is still on the link" in transfer_on_link(rounds(need_s * 10), slots[1])
    slots[0].inflight_kind, slots[0].inflight_since = "round", 0.0
    history.throughputs.clear()
    history.link_throughputs.clear()
    history.overheads.clear()
    history.observe(committed=True, bytes_moved=rate_Bps * 1000, allreduce_s=1.0, rtt_s=5.0)
    assert link_busy(rounds(need_s / 2), slots[1]) == ""  # a fast link (a long round trip does not count)


def test_state_downloads_go_one_at_a_time_where_together_they_would_not_fit_the_link() -> None:
    """The engine's rule (:func:`p2p_diloco.engine.rounds.downloads_in_turn`) on a stand-in: four fragments'
    fp32 states (1.6 MB) together take 13 s at the prior's 1 Mbit/s, above a sender's allowed silence; on a fast
    measured link they go together."""
    from types import SimpleNamespace

    import torch

    from p2p_diloco.engine.rounds import downloads_in_turn

    slots = [SimpleNamespace(anchor={"w": torch.zeros(50_000)}, names=["w"]) for _ in range(4)]
    history = LinkHistory()
    rounds = SimpleNamespace(slots=slots, link=history, cfg=SimpleNamespace(averaging=CFG))
    state_s = 4 * 2 * 4 * 50_000 / PRIOR_THROUGHPUT_BPS
    assert state_s > CFG.next_chunk_timeout_s
    assert downloads_in_turn(rounds)  # type: ignore[arg-type]  # nothing measured: the prior
    history.observe(committed=True, bytes_moved=1e9, allreduce_s=1.0, rtt_s=0.001)
    assert not downloads_in_turn(rounds)  # type: ignore[arg-type]  # loopback


def test_fragments_in_turn_are_fetched_least_recently_fetched_first() -> None:
    """Catch-up's order (:func:`p2p_diloco.engine.catchup.fetch_order`): downloads that go one at a time take turns
    -- the fragment fetched last goes to the back, never-fetched ones come first by index -- so a learner behind on
    every fragment reaches the last one even though the first is behind again by the time its download ends."""
    import torch

    from p2p_diloco.engine.catchup import fetch_order
    from p2p_diloco.sync.slot import FragmentSlot

    slots = [FragmentSlot(i, ("w",), {"w": torch.zeros(1)}) for i in range(4)]
    assert fetch_order(slots) == [0, 1, 2, 3]
    fetched = []
    for now in range(8):  # one download at a time; every fragment is behind again each time
        first = fetch_order(slots)[0]
        slots[first].last_fetch_try = float(now)
        fetched.append(first)
    assert fetched == [0, 1, 2, 3, 0, 1, 2, 3]
    slots[2].last_fetch_try = -math.inf  # a replay that did not reproduce its anchors: downloaded at once
    assert fetch_order(slots)[0] == 2


def test_a_round_due_while_the_link_is_busy_waits_for_it_until_half_its_window() -> None:
    """The engine's rule (:func:`p2p_diloco.engine.rounds.waits_for_link`) on a stand-in: with groups from the clock
    a round due while another is on the link waits for it until half its window past the boundary (its leader awaits
    the offer to the window's end), then it is declined; without the clock's groups it is declined at once."""
    from types import SimpleNamespace

    from p2p_diloco.engine.rounds import LINK_WAIT_SHARE, waits_for_link
    from p2p_diloco.net.clock import SyncClock

    now = [15.2]
    slot = SimpleNamespace(index=1)
    rounds = SimpleNamespace(cfg=SimpleNamespace(averaging=SimpleNamespace(clock_groups=True)),
                             view=SimpleNamespace(clock=SyncClock(10.0, 0.0, 0)), syncs=[None, None], window_s=2.0,
                             deferred={}, dht_time=lambda: now[0])
    assert waits_for_link(rounds, slot)  # type: ignore[arg-type]  # fragment 1 of 2: its boundary was at 15.0
    assert rounds.deferred == {1: 15.0 + LINK_WAIT_SHARE * 2.0}
    now[0] = 15.9
    assert waits_for_link(rounds, slot)  # type: ignore[arg-type]
    now[0] = 16.1
    rounds.deferred.clear()  # (the hand-off takes it out each time)
    assert not waits_for_link(rounds, slot) and rounds.deferred == {}  # type: ignore[arg-type]  # past: declined
    rounds.cfg.averaging.clock_groups = False
    assert not waits_for_link(rounds, slot) and rounds.deferred == {}  # type: ignore[arg-type]


def test_verdicts_are_awaited_longer_on_a_slow_measured_link() -> None:
    from p2p_diloco.averaging.linktime import verdict_wait_s

    assert verdict_wait_s(CFG, floor_timeouts(CFG)) == CFG.commit_timeout_s  # nothing measured: the config's
    half_mbit = LinkEstimate(throughput_Bps=31_000.0, rtt_s=0.3)
    wait = verdict_wait_s(CFG, round_timeouts(1e5, half_mbit, CFG))  # a concurrent round's 100 kB queued ahead
    assert wait == pytest.approx(CFG.commit_timeout_s + JOIN_ROUND_TRIPS * 0.3 + 1e5 / 31_000.0)
    small = verdict_wait_s(CFG, round_timeouts(1e4, half_mbit, CFG))  # small rounds: one streamed chunk still
    assert small == pytest.approx(CFG.commit_timeout_s + JOIN_ROUND_TRIPS * 0.3 + STATE_CHUNK_BYTES / 31_000.0)
    assert verdict_wait_s(CFG, round_timeouts(1e5, FAST, CFG)) < CFG.commit_timeout_s + 0.01  # loopback: as before
