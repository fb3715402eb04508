"""Pure decisions of per-fragment averaging: group checks, completeness, window, schedule, state parsing; and
one swarm of two real averagers: each round runs with the timeouts its contribution brings."""

from __future__ import annotations

import ctypes
import math
import struct
import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from p2p_diloco.averaging.decisions import (
    GRID_KEY_BITS, META_FIELDS, RoundMeta, adapt_window, anchor_hash, averager_prefix, check_group, completeness_problem,
    grid_group_bits, grid_version, peers_at_rank, quorum_problem, version_group_bits, NOT_FINITE, VerdictRule,
    round_verdict,
)
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.transfer import parse_state, state_payload
from p2p_diloco.core.config import AveragingConfig
from p2p_diloco.sync.fragment import Contribution

RADIAL = ("blocks.0.fc.weight",)


def meta(**kw: object) -> RoundMeta:
    base: dict[str, object] = dict(fragment=0, version=3, anchor="a" * 16, config="c" * 16, tokens=2560, steps=10,
                                   weight=2560.0, due=100.0, norms=(0.5,))
    base.update(kw)
    return RoundMeta(**base)  # type: ignore[arg-type]


def contribution_of(m: RoundMeta, tensors: dict[str, torch.Tensor] | None = None) -> Contribution:
    """The contribution whose wire metadata is ``m`` (:meth:`RoundMeta.of` with its config and due)."""
    return Contribution(fragment=m.fragment, version=m.version, anchor_hash=m.anchor, tokens=m.tokens, steps=m.steps,
                        weight=m.weight, tensors=tensors or {}, norms=m.norms_by_name(RADIAL))


def test_the_wire_metadata_is_derived_from_the_contribution() -> None:
    m = meta()
    assert RoundMeta.of(contribution_of(m), m.config, m.due) == m
    assert RoundMeta.of(contribution_of(m), m.config, m.due).to_wire() == m.to_wire()
    measured = meta(link=250_000.0)  # our link's measured throughput goes along (0.0: none measured yet)
    assert RoundMeta.of(contribution_of(measured), m.config, m.due, 250_000.0) == measured


def decide(own: RoundMeta, members: list[RoundMeta], min_group_size: int = 2) -> tuple[bool, str]:
    d = check_group(own, members, RADIAL, min_group_size=min_group_size, weighting="tokens")
    return d.ok, d.reason


def test_a_verdict_checks_the_group_then_the_quorum_then_the_tensors() -> None:
    """What the averager process sends as the all-reduce ends and the host checks again: the same pure rule."""
    members = [meta(), meta(tokens=768, steps=3, weight=768.0, due=100.4)]
    rule = VerdictRule(RADIAL, min_group_size=2, weighting="tokens", at_rank=3)
    assert round_verdict(rule, members[0], members, finite=True).ok  # 2 of the 3 at our rank: a majority
    assert round_verdict(rule, members[0], members, finite=False).reason == NOT_FINITE
    minority = VerdictRule(RADIAL, min_group_size=2, weighting="tokens", at_rank=4)  # 2 of 4: another pair could too
    assert round_verdict(minority, members[0], members, finite=False).reason.startswith("a minority group")
    wrong = [members[0], meta(version=2)]  # the gathered data first: a member at another version
    assert round_verdict(rule, members[0], wrong, finite=False).reason.startswith("version mismatch")


def test_a_consistent_group_is_accepted_by_every_member() -> None:
    members = [meta(), meta(tokens=768, steps=3, weight=768.0, due=100.4)]
    for own in members:
        assert decide(own, members) == (True, "")


@pytest.mark.parametrize("change, reason", [
    (dict(version=4), "version mismatch"),
    (dict(anchor="b" * 16), "anchor mismatch"),
    (dict(config="d" * 16), "config hash"),
    (dict(fragment=1), "fragment 1"),
    (dict(weight=1.0), "does not match its progress"),
    (dict(norms=()), "holds 0 norms, the fragment has 1 radial tensors"),
])
def test_a_disagreeing_member_makes_everyone_discard(change: dict[str, object], reason: str) -> None:
    members = [meta(), meta(**change)]
    verdicts = [decide(own, members) for own in members]
    assert all(not ok for ok, _ in verdicts), verdicts  # every member takes the same decision
    assert reason in verdicts[0][1], verdicts


@pytest.mark.parametrize("change, grid_ok", [
    (dict(version=4), True), (dict(anchor="b" * 16), True),  # grid groups average members of other groups
    (dict(config="d" * 16), False), (dict(fragment=1), False), (dict(weight=1.0), False), (dict(norms=()), False),
])
def test_grid_groups_accept_other_versions_and_anchors_only(change: dict[str, object], grid_ok: bool) -> None:
    members = [meta(), meta(**change)]
    verdicts = [check_group(own, members, RADIAL, min_group_size=2, weighting="tokens", grid=True) for own in members]
    assert [v.ok for v in verdicts] == [grid_ok, grid_ok], verdicts
    if grid_ok:
        assert grid_version(members) == max(m.version for m in members) + 1


def test_grid_group_keys_name_the_round_and_the_group() -> None:
    bits = grid_group_bits(1234567, "QmA")
    assert len(bits) == GRID_KEY_BITS and set(bits) <= {"0", "1"} and bits == grid_group_bits(1234567, "QmA")
    others = {grid_group_bits(1234567 + k, "QmA") for k in range(1, 9)} | {grid_group_bits(1234567, f"Qm{c}")
                                                                           for c in "BCDEFGH"}
    assert bits not in others and len(others) == 15  # another round or another group: another key


def test_all_zero_weights_are_refused_not_nan() -> None:
    members = [meta(tokens=0, steps=0, weight=0.0), meta(tokens=0, steps=0, weight=0.0, due=101.0)]
    ok, why = decide(members[0], members)
    assert not ok and "all weights are zero" in why


def test_group_too_small() -> None:
    ok, why = decide(meta(), [meta()])
    assert not ok and "min_group_size" in why
    ok, why = decide(meta(), [meta(), meta(due=1.0)], min_group_size=3)
    assert not ok and "< min_group_size 3" in why


def test_round_meta_wire_is_strict() -> None:
    m = meta()
    assert RoundMeta.from_wire(m.to_wire()) == m
    wire = m.to_wire()
    assert wire == [0, 3, "a" * 16, "c" * 16, 2560, 10, 2560.0, 100.0, struct.pack("<f", 0.5), 0.0]  # no names
    assert RoundMeta.from_wire([*wire[:-1], 31_250]).link == 31_250.0  # an int is a number too

    def changed(**fields: object) -> list[object]:
        return [fields.get(name, v) for name, v in zip(META_FIELDS, wire)]

    for bad in ([*wire, 1], wire[:-1], changed(tokens=-1), changed(weight=math.nan), changed(anchor=5),
                changed(norms=struct.pack("<f", -1.0)), changed(norms=struct.pack("<f", math.inf)),
                changed(norms=b"abc"), changed(norms=[0.5]), {"norms": b""}, [1, 2], changed(link=-1.0),
                changed(link=math.inf), changed(link="fast")):
        with pytest.raises(ValueError):
            RoundMeta.from_wire(bad)
    huge = meta(norms=(1e39,))  # beyond float32: sent as inf, which every peer refuses; so it is never sent
    with pytest.raises(ValueError, match="would be refused by every peer"):
        huge.check_outgoing()


def test_completeness_problem_names_the_partial_cause() -> None:
    assert completeness_problem(1000, 0, 0, 6, 6) is None
    assert "300 of 1000 elements" in (completeness_problem(1000, 300, 0, 6, 6) or "")
    assert "1 sender(s) dropped" in (completeness_problem(1000, 0, 1, 6, 6) or "")
    assert completeness_problem(1000, 300, 1, 6, 6) == ("partial all-reduce: 300 of 1000 elements not averaged (a "
                                                        "reducer failed), 1 sender(s) dropped mid-round")
    assert "received 4 of 6 parts" in (completeness_problem(1000, 0, 0, 6, 4) or "")


def test_adaptive_window_follows_arrivals_within_bounds() -> None:
    cfg = AveragingConfig(window_s=2.0, window_min_s=1.0, window_max_s=5.0, request_timeout_s=0.5)
    assert adapt_window([], cfg) == 2.0
    assert adapt_window([0.1, 0.1, 0.1], cfg) == 1.0  # clamped below
    assert adapt_window([1.0, 1.2, 1.1, 30.0], cfg) == pytest.approx(1.15 + 2 * 0.1 + 0.5)  # one outlier: robust
    assert adapt_window([9.0] * 4, cfg) == 5.0  # clamped above


def test_version_bits_and_prefix() -> None:
    assert version_group_bits(0) == "00000000" and version_group_bits(257) == "00000001"
    assert version_group_bits(3, "a0") == "00000011" + "1010"  # + the anchor's first hex digit: forks do not meet
    assert "." not in averager_prefix("run.v2", 3)


def test_state_payload_roundtrip_and_validation() -> None:
    names = ("a", "b")
    anchor = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    momentum = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    shapes = {n: t.shape for n, t in anchor.items()}
    meta_, tensors = state_payload(1, 7, anchor, momentum, names)
    got = parse_state(meta_, tensors, 1, names, shapes, ours=(5, "f" * 16))
    assert got is not None and got.version == 7 and got.anchor_hash == anchor_hash(anchor)
    assert all(torch.equal(got.anchor[n], anchor[n]) and torch.equal(got.momentum[n], momentum[n]) for n in names)
    assert parse_state(meta_, tensors, 1, names, shapes, ours=(8, "f" * 16)) is None  # not newer
    assert parse_state(meta_, tensors, 1, names, shapes, ours=(7, anchor_hash(anchor))) is None  # the same anchor
    assert parse_state(meta_, tensors, 1, names, shapes, ours=(7, "0" * 16)) is None  # a fork we win
    assert parse_state(meta_, tensors, 1, names, shapes, ours=(7, "f" * 16)) is not None  # a fork we lose
    with pytest.raises(ValueError, match="anchor hash"):
        parse_state({**meta_, "anchor": "0" * 16}, tensors, 1, names, shapes, (5, ""))
    with pytest.raises(ValueError, match="not finite"):
        parse_state(meta_, [tensors[0] * math.nan, *tensors[1:]], 1, names, shapes, (5, ""))
    with pytest.raises(ValueError, match="fragment 2"):
        parse_state(meta_, tensors, 2, names, shapes, (5, ""))
    fresh = state_payload(1, 0, anchor, {}, names)  # version 0: no momentum yet
    assert parse_state(*fresh, 1, names, shapes, (0, "f" * 16)).momentum == {}  # type: ignore[union-attr]


def test_anchor_hash_is_bit_exact() -> None:
    t = {"w": torch.ones(4)}
    assert anchor_hash(t) == anchor_hash({"w": torch.ones(4)})
    assert anchor_hash(t) != anchor_hash({"w": torch.ones(4) + 1e-7})


def test_commit_needs_every_member_ok() -> None:
    from p2p_diloco.averaging.decisions import commit_decision, commit_key

    peers = ["QmA", "QmB", "QmC"]
    assert commit_decision({"QmA": "ok", "QmB": "ok", "QmC": "ok"}, peers).ok
    d = commit_decision({"QmA": "ok", "QmB": "partial all-reduce: 1 sender(s) dropped mid-round", "QmC": "ok"}, peers)
    assert not d.ok and "partial all-reduce" in d.reason  # one member's partial result vetoes everyone
    d = commit_decision({"QmA": "ok", "QmC": "ok"}, peers)
    assert not d.ok and "no verdict from 1 of 3" in d.reason  # silence is a veto
    assert commit_decision({"QmA": "ok", "QmB": "ok", "QmC": "ok", "QmX": "fail"}, peers).ok  # outsiders ignored
    # a retry by the same group at the same version posts under another key
    first = {p: meta(due=100.0 + i) for i, p in enumerate(peers)}
    retry = {p: meta(due=130.0 + i) for i, p in enumerate(peers)}
    assert commit_key("run_frag0", first) != commit_key("run_frag0", retry)
    assert commit_key("run_frag0", first) == commit_key("run_frag0", dict(reversed(list(first.items()))))


def test_at_the_deadline_only_silence_withdraws_an_ok() -> None:
    from p2p_diloco.averaging.decisions import Decision, decision_at_deadline, vetoed

    peers = ["QmA", "QmB", "QmC"]
    assert decision_at_deadline({"QmA": "ok", "QmB": "ok", "QmC": "ok"}, peers, 3.0) == (Decision(True), False)
    d, silent = decision_at_deadline({"QmA": "ok", "QmC": "ok"}, peers, 3.0)
    assert silent and not d.ok and d.reason == "no verdict from 1 of 3 members within 3 s"
    d, silent = decision_at_deadline({"QmA": "ok", "QmB": "partial"}, peers, 3.0)  # a veto beside the silence
    assert not silent and not d.ok and "partial" in d.reason and "within" not in d.reason
    assert vetoed({"QmB": "withdrawn: x"}, peers) and not vetoed({"QmA": "ok", "QmX": "fail"}, peers)


def test_start_instant_is_the_same_for_everyone_who_saw_the_first_proposals() -> None:
    from p2p_diloco.averaging.decisions import start_instant

    assert start_instant({"a": 10.0, "b": 11.5}, 3) is None
    assert start_instant({"a": 10.0, "b": 11.5, "c": 10.7}, 3) == 11.5
    assert start_instant({"a": 10.0, "b": 11.5, "c": 10.7, "late": 30.0}, 3) == 11.5  # a 4th does not move it


def test_anchor_order_heals_forks_the_same_way_everywhere() -> None:
    from p2p_diloco.averaging.decisions import anchor_order, is_ahead, relative_distance, sharing_priority

    a, b = "0123456789abcdef", "fedcba9876543210"  # a fork at v5: the smaller hash wins
    assert is_ahead((5, a), (5, b)) and not is_ahead((5, b), (5, a))
    assert not is_ahead((5, a), (5, a))  # the same anchor is not ahead
    assert is_ahead((6, b), (5, a)) and not is_ahead((4, a), (5, b))  # a newer version always wins
    ranked = sorted([(5, b), (6, b), (5, a), (4, a)], key=lambda r: anchor_order(*r), reverse=True)
    assert ranked == [(6, b), (5, a), (5, b), (4, a)]
    # hivemind tries donors by descending priority: the same order, and within a version's [v, v+1)
    assert sharing_priority(6, b) > sharing_priority(5, a) > sharing_priority(5, b) >= 5.0
    assert sharing_priority(5, "0" * 16) < 6.0 and sharing_priority(5, "") == 5.0
    x = {"w": torch.ones(4), "b": torch.zeros(2)}
    y = {"w": torch.ones(4) * 1.1, "b": torch.zeros(2)}
    assert relative_distance(x, x) == 0.0
    assert math.isclose(relative_distance(y, x), 0.1, rel_tol=1e-6)


def test_a_round_is_doomed_when_a_peer_is_at_a_newer_version_or_wins_a_fork_and_nobody_is_where_we_are() -> None:
    from p2p_diloco.averaging.decisions import round_is_doomed

    a, b = "0123456789abcdef", "fedcba9876543210"
    assert not round_is_doomed((5, a), [])  # alone: nothing known, the round goes ahead (and finds out)
    assert not round_is_doomed((5, a), [(5, a), (5, a)])  # everyone where we are: the usual round
    assert not round_is_doomed((5, a), [(4, a), (5, b)])  # peers behind or losing a fork: we are ahead
    assert round_is_doomed((5, a), [(6, b)])  # one peer moved on: nobody to meet at v5
    assert round_is_doomed((5, b), [(5, a), (5, a)])  # a fork we lost: the winners meet at their own key
    assert round_is_doomed((5, a), [(6, b), (5, a)])  # one peer moved on: v6 is taken, a second v6 would fork
    assert round_is_doomed((5, a), [(6, a), (5, a), (5, a)])  # even with a majority still here
    assert not round_is_doomed((5, b), [(5, a), (5, b), (4, a)])


def test_donor_order_only_donors_ahead_best_first_and_spread_over_equal_ones() -> None:
    from p2p_diloco.averaging.decisions import donor_order

    peers = {f"donor{i}": 7.25 for i in range(6)} | {"behind": 6.9, "equal": 5.0, "ahead": 8.1, "me": 9.0,
                                                      "nan": float("nan")}
    order = donor_order(peers, "me", ours=5.0)
    assert order[0] == "ahead" and order[-1] == "behind"  # the best rank first
    assert set(order) == {"ahead", "behind", *(f"donor{i}" for i in range(6))}  # not us, not equal, not NaN
    assert donor_order(peers, "me", ours=5.0) == order  # stable for one newcomer
    # equal donors: different newcomers start with different ones (rendezvous hashing), roughly evenly
    firsts = [donor_order({f"donor{i}": 7.25 for i in range(6)}, f"newcomer{k}", ours=0.0)[0] for k in range(600)]
    counts = [firsts.count(f"donor{i}") for i in range(6)]
    assert min(counts) > 60, counts  # 100 each on average
    assert donor_order({"x": 1.0}, "me", ours=1.0) == []
    # one learner's fragments start with different equal donors (rotated), the worse ones still last
    three = {"d0": 7.25, "d1": 7.25, "d2": 7.25, "behind": 6.9}
    orders = [donor_order(three, "me", ours=5.0, fragment=f) for f in range(4)]
    assert orders[0] == donor_order(three, "me", ours=5.0)  # fragment 0: the rendezvous order itself
    assert len({o[0] for o in orders[:3]}) == 3 and orders[3] == orders[0], orders
    assert all(o[-1] == "behind" and sorted(o) == sorted(three) for o in orders), orders


def test_state_size_cap_allows_the_state_and_little_more() -> None:
    from p2p_diloco.averaging.decisions import state_size_cap

    shapes = [torch.Size([64, 32]), torch.Size([32])]
    fp32 = 4 * (64 * 32 + 32)
    assert 2 * fp32 < state_size_cap(shapes) < 2.2 * fp32 + 65537


# -- integration: the averager process runs each round with the timeouts that came with its contribution

SEEN_TIMEOUTS = mp.Array(ctypes.c_double, 2)  # (sender, reducer) of the last runner built, shared with the forks
ROUND_DEADLINE_S = 60.0


ANSWER_STREAMS = mp.Array(ctypes.c_int, 2)  # answer streams that got every part: (closed by their sender, lingered out)


class RecordsTimeouts(ExactAllReduceRunner):
    """Records the sender and reducer timeouts hivemind built this all-reduce's runner with, and how each answer
    stream this runner served ended."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        SEEN_TIMEOUTS[0], SEEN_TIMEOUTS[1] = self.sender_timeout, self.reducer_timeout

    def _answers_ended(self, closed_by_sender: bool) -> None:
        with ANSWER_STREAMS.get_lock():
            ANSWER_STREAMS[0 if closed_by_sender else 1] += 1


def test_group_key_reads_are_throttled() -> None:
    """hivemind's matchmaking re-reads its group key as fast as the DHT answers; ours at most once per interval
    (a lower bound on the spacing, which sleeping guarantees: not a speed assertion)."""
    import asyncio

    from p2p_diloco.averaging.process import throttled

    starts: list[float] = []

    async def read(key: str, only_active: bool) -> list[str]:
        starts.append(time.monotonic())
        return [key]

    async def main() -> list[list[str]]:
        get = throttled(read, 0.2)
        assert getattr(get, "throttled", False)
        return [await get("k", only_active=True) for _ in range(3)]

    assert asyncio.run(main()) == [["k"]] * 3
    assert all(b - a >= 0.2 for a, b in zip(starts, starts[1:])), starts


def test_a_step_that_hivemind_cancels_itself_discards_the_round() -> None:
    """hivemind may cancel a step on its own (its matchmaking cancelled while a join request was in flight); the
    ``asyncio.CancelledError`` that ``control.result()`` then raises is a BaseException, which once went past the
    round's handler and killed the learner. A stand-in averager (pure host logic) raises it."""
    import asyncio
    import contextlib
    import threading
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from p2p_diloco.averaging.host import FragmentAveragerHost
    from p2p_diloco.averaging.plans import RoundPlan
    from p2p_diloco.core.config import load_config

    steps: list[dict[str, Any]] = []

    class CancelledStep:
        began_allreduce = False

        def result(self, timeout: float | None = None) -> Any:
            raise asyncio.CancelledError()

        def cancel(self) -> bool:
            return True

    def step(**kwargs: Any) -> CancelledStep:
        steps.append(kwargs)
        return CancelledStep()

    def shared(value: float) -> SimpleNamespace:
        return SimpleNamespace(value=value)

    averager = SimpleNamespace(bytes_sent=shared(0), bytes_received=shared(0), last_allreduce_s=shared(0.0), last_meet_s=shared(0.0), last_allreduce_end=shared(0.0), last_part_bytes=shared(0),
                               set_round_timeouts=lambda limits: SimpleNamespace(result=lambda timeout: {}),
                               set_group_bits=lambda bits, wait: SimpleNamespace(result=lambda timeout: None),
                               get_tensors=lambda: contextlib.nullcontext([]),
                               step=step)
    host = FragmentAveragerHost.__new__(FragmentAveragerHost)  # no averager process: only the round's logic
    host.cfg, host.fragment, host.averager, host.names, host.wire_names, host._cancelled = (
        load_config(None, []), 0, averager, (), (), threading.Event())
    own = meta(weight=10.0)
    outcome = host._round(contribution_of(own), own, RoundPlan(get_dht_time() + 1.0, 1.0, due=own.due))
    assert len(steps) == 1, "the fault did not fire"
    assert not outcome.committed and outcome.reason == "CancelledError: the averager cancelled the step", outcome


def test_a_group_of_at_most_half_the_peers_at_its_version_does_not_commit() -> None:
    # four at the version: two disjoint pairs could both commit it (a fork); three of them cannot be matched twice
    assert "minority group: 2 of the 4" in (quorum_problem(2, 4) or "")
    assert quorum_problem(3, 4) is None and quorum_problem(4, 4) is None
    assert quorum_problem(2, 3) is None and quorum_problem(2, 2) is None  # a pair in a swarm of 2 or 3
    assert quorum_problem(5, 4) is None  # a member our records did not show yet
    assert quorum_problem(2, 0) is None  # not checked (grid groups)
    # groups capped below the peers at the version: several groups a round are the design
    assert quorum_problem(2, 8, target_group_size=4) is None
    assert quorum_problem(2, 4, target_group_size=4) is not None
    # no two disjoint groups can both pass, whatever the sizes
    for at_rank in range(1, 12):
        passing = [g for g in range(1, at_rank + 1) if quorum_problem(g, at_rank) is None]
        assert all(a + b > at_rank for a in passing for b in passing)


def test_peers_at_the_version_count_the_ones_whose_records_lag_one_round() -> None:
    ours = (3, "aa")
    assert peers_at_rank(ours, []) == 1
    # two at our rank, two whose records still show v2 (they committed v3 with us, or are one behind): all count
    assert peers_at_rank(ours, [(3, "aa"), (3, "aa"), (2, "xx"), (2, "yy")]) == 5
    # another anchor at our version (a fork), further behind, ahead: not at our rank
    assert peers_at_rank(ours, [(3, "bb"), (1, "aa"), (4, "cc")]) == 1
    assert quorum_problem(2, peers_at_rank(ours, [(3, "aa"), (2, "zz"), (2, "zz")])) is not None


def test_a_verdicts_exchange_that_outlives_its_deadline_is_a_silence_not_a_crash() -> None:
    """A learner SIGSTOPped while its round exchanged verdicts: once continued, the wait for the averager process's
    answer is past its deadline (TimeoutError). That discards the round and withdraws our "ok"; it once raised into
    the training loop and ended the learner (scripts/chaos.py, a 15 s SIGSTOP)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from p2p_diloco.averaging.host import agree_in_group
    from p2p_diloco.averaging.linktime import floor_timeouts
    from p2p_diloco.core.config import load_config

    sent: list[str] = []

    def never_in_time(future: Any, timeout_s: float) -> Any:
        raise TimeoutError()

    averager = SimpleNamespace(exchange_verdicts=lambda *args: Future(),
                               send_verdict=lambda group, peers, verdict, timeout: sent.append(verdict) or Future())
    cfg = load_config(None, [])
    host = SimpleNamespace(cfg=cfg, fragment=2, averager=averager, _wait=never_in_time)
    decision, rtt_s, withdrawn = agree_in_group(host, b"group", ("QmA", "QmB"), "ok", floor_timeouts(cfg.averaging))
    assert not decision.ok and "no verdict" in decision.reason and withdrawn and math.isnan(rtt_s), decision
    assert sent and sent[0].startswith("withdrawn: ")  # the withdrawal was tried (its wait timed out too)


def test_any_exception_a_round_raises_discards_it_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a round's worker raises outside hivemind's step (here: the averager's shared tensors are gone) is the
    round's reason for discarding, logged with its traceback -- not an exception in the future, which the training
    loop's collect re-raised and so ended the learner. A stand-in averager (pure host logic) raises it."""
    import threading
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from p2p_diloco.averaging.host import FragmentAveragerHost
    from p2p_diloco.averaging.plans import RoundPlan
    from p2p_diloco.core.config import load_config

    raised: list[str] = []

    def tensors_gone() -> Any:
        raised.append("get_tensors")
        raise RuntimeError("the averager's shared tensors are gone")

    def shared(value: float) -> SimpleNamespace:
        return SimpleNamespace(value=value)

    averager = SimpleNamespace(bytes_sent=shared(0), bytes_received=shared(0), last_allreduce_s=shared(0.0), last_meet_s=shared(0.0), last_allreduce_end=shared(0.0),
                               last_part_bytes=shared(0),
                               set_round_timeouts=lambda limits: SimpleNamespace(result=lambda timeout: {}),
                               set_group_bits=lambda bits, wait: SimpleNamespace(result=lambda timeout: None),
                               get_tensors=tensors_gone)
    host = FragmentAveragerHost.__new__(FragmentAveragerHost)  # no averager process: only the round's logic
    host.cfg, host.fragment, host.averager, host.names, host.wire_names, host._cancelled = (
        load_config(None, []), 3, averager, (), (), threading.Event())
    own = meta(weight=10.0)
    with caplog.at_level("ERROR", logger="p2p_diloco.averaging.host"):
        outcome = host._round(contribution_of(own), own, RoundPlan(get_dht_time() + 1.0, 1.0, due=own.due))
    assert raised == ["get_tensors"], "the fault did not fire"
    assert not outcome.committed and outcome.fragment == 3 and outcome.version == own.version, outcome
    assert outcome.reason == "the round failed: RuntimeError: the averager's shared tensors are gone", outcome
    assert any(r.exc_info for r in caplog.records), "the traceback was not logged"
