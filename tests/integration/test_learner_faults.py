"""Faults injected into real hivemind all-reduces (3 DHTs + 3 fragment averagers on 127.0.0.1, in-process).

The hivemind trap: when a reducer drops a sender mid-round, the third peer's ``step()`` succeeds
with an average that silently lacks a contribution. We inject exactly that (a reducer bans its
first remote sender) and check that the fault fired, that *no* member commits the round (the
faulty reducer and the dropped sender see a partial all-reduce; the third peer waits for their
verdicts and vetoes by their silence), and that the next, clean round commits bit-identical
results on every member -- the weighted mean within the int4 codec's bound.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import time
from dataclasses import replace
from typing import Any, AsyncIterator

import pytest
import torch
from averagers import averaging_swarm, run_round

from p2p_diloco.averaging.plans import RoundPlan
from p2p_diloco.sync.fragment import Contribution
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.hivemind_ext.compression import error_bound
from p2p_diloco.core.config import load_config

pytestmark = pytest.mark.integration

FIRED = mp.Value(ctypes.c_int, 0)  # shared with the forked averager processes
STALLED = mp.Value(ctypes.c_int, 0)
# six equal tensors: two parts per tensor here (pipelined_part_bytes), dealt to reducers by position, so with
# fewer parts than peers some peer would reduce nothing
NAMES = tuple(f"blocks.{i}.fc.weight" for i in range(6))
SHAPES = {n: torch.Size([64, 32]) for n in NAMES}
TOKENS = (2560, 1280, 3840)
ROUND_DEADLINE_S = 60.0
CFG = load_config(None, ["run.run_id=faults", "model.n_layer=2", "outer.fragments=2", "outer.merge=\"mean\"",
                         "outer.codec=\"int4\"", "averaging.window_s=1.5", "averaging.commit_timeout_s=3.0",
                         "averaging.next_chunk_timeout_s=2.0", "averaging.allreduce_timeout_s=10.0"])


class DropFirstRemoteSender(ExactAllReduceRunner):
    """As a reducer, ban the first remote sender before reading any of its parts (once)."""

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[Any], sender_index: int) -> AsyncIterator[Any]:
        sender = self.sender_peer_ids[sender_index]
        if sender != self.peer_id:
            with FIRED.get_lock():
                fire = FIRED.value == 0
                FIRED.value += fire
            if fire:
                await self._ban_sender(sender)
                return
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            yield message


def test_partial_round_is_discarded_by_every_member_then_a_clean_round_commits(tmp_path: Any) -> None:
    cfg = CFG
    with swarm(tmp_path, (DropFirstRemoteSender, ExactAllReduceRunner, ExactAllReduceRunner)) as peers:
        gen = torch.Generator().manual_seed(0)
        tensors = [{n: torch.randn(SHAPES[n], generator=gen) for n in NAMES} for _ in peers]

        faulty = run_round(peers, tensors, cfg, TOKENS, ROUND_DEADLINE_S)
        for o in faulty:
            print(f"\nfaulty round: committed={o.committed} group={o.group_size} {o.duration_s:.2f} s: {o.reason}")
        assert FIRED.value == 1, "the fault did not fire"
        assert not any(o.committed for o in faulty), [o.reason for o in faulty]
        assert any("partial all-reduce" in o.reason for o in faulty), [o.reason for o in faulty]
        # the members that saw a complete all-reduce were told by the others' vetoes, not by a timeout
        assert all("partial all-reduce" in o.reason or "reported" in o.reason for o in faulty), [o.reason for o in faulty]
        assert all(o.merged is None for o in faulty)

        clean = run_round(peers, tensors, cfg, TOKENS, ROUND_DEADLINE_S)
        assert all(o.committed and o.group_size == 3 for o in clean), [o.reason for o in clean]
        merged = [o.merged for o in clean]
        assert merged[0] is not None
        total = sum(TOKENS)
        for n in NAMES:
            assert all(torch.equal(m[n], merged[0][n]) for m in merged if m is not None), n  # bit-identical
            exact = sum(t[n] * (w / total) for t, w in zip(tensors, TOKENS))
            # two codec passes: each sender's part into the reducer, then the reducer's average back;
            # block absmaxes replaced by tensor absmaxes, which holds whatever the part layout
            e_in = sum(w / total * error_bound("int4", torch.full_like(t[n], float(t[n].abs().max())))
                       for t, w in zip(tensors, TOKENS))
            e_out = error_bound("int4", torch.full_like(exact, float(exact.abs().max() + e_in.max())))
            assert bool(((merged[0][n] - exact).abs() <= e_in + e_out + 1e-6).all()), n
        shares = [o.own_share for o in clean]
        assert shares == pytest.approx([w / total for w in TOKENS])
        print(f"clean round: shares {[round(s, 3) for s in shares]}, bytes out {[o.bytes_sent for o in clean]}")


class Stall(ExactAllReduceRunner):
    """As a reducer, never answer (a peer that hangs with its connections open, like one stopped by SIGSTOP)."""

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[Any], sender_index: int) -> AsyncIterator[Any]:
        if self.sender_peer_ids[sender_index] != self.peer_id:
            with STALLED.get_lock():
                STALLED.value += 1
            await asyncio.sleep(3600)
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            yield message


def test_a_hanging_peer_fails_the_round_in_bounded_time_and_nobody_commits(tmp_path: Any) -> None:
    a = CFG.averaging
    with swarm(tmp_path, (ExactAllReduceRunner, ExactAllReduceRunner, Stall)) as peers:
        gen = torch.Generator().manual_seed(1)
        tensors = [{n: torch.randn(SHAPES[n], generator=gen) for n in NAMES} for _ in peers]
        t0 = time.monotonic()
        outcomes = run_round(peers, tensors, CFG, TOKENS, ROUND_DEADLINE_S)
        wall_s = time.monotonic() - t0
        for o in outcomes:
            print(f"\nhanging peer: committed={o.committed} {o.duration_s:.2f} s: {o.reason}")
        assert STALLED.value >= 1, "the fault did not fire"
        assert not any(o.committed for o in outcomes), [o.reason for o in outcomes]
        # bounded by the window, the all-reduce timeout and the commit timeout -- never a hang
        bound_s = 3 * a.window_s + a.allreduce_timeout_s + a.commit_timeout_s + 5
        assert wall_s < bound_s, (wall_s, bound_s)
        print(f"all three rounds ended {wall_s:.1f} s after they started (bound {bound_s:.0f} s)")


def swarm(tmp_path: Any, runners: tuple[type[ExactAllReduceRunner], ...]) -> Any:
    """One DHT + one fragment averager per runner class, on 127.0.0.1, all shut down on exit."""
    return averaging_swarm(tmp_path, CFG, NAMES, SHAPES, runners)


def test_a_round_still_matching_is_abandoned_once_a_peer_is_past_its_version(tmp_path: Any) -> None:
    """A learner behind the swarm (its group key names a version nobody holds any more) learns it from the
    records while its round is matching: the round ends then, not at its matchmaking deadline, and the
    fragment is free for the download."""
    from hivemind.utils import get_dht_time

    polls: list[float] = []

    def doomed() -> bool:  # the records say a peer is ahead from the third look on
        polls.append(time.monotonic())
        return len(polls) >= 3

    with swarm(tmp_path, (ExactAllReduceRunner,)) as (peer,):
        tensors = {n: torch.ones(SHAPES[n]) for n in NAMES}
        at_v3 = Contribution(fragment=0, version=3, anchor_hash="0" * 16, tokens=TOKENS[0], steps=10,
                             weight=float(TOKENS[0]), tensors=tensors, norms={})
        late_start_s = 20.0  # a lone peer would match until then plus two windows
        outcome = peer.start_round(at_v3, RoundPlan(get_dht_time() + late_start_s, CFG.averaging.window_s,
                                                    due=get_dht_time(), doomed=doomed)).result(timeout=ROUND_DEADLINE_S)
        print(f"\nabandoned after {outcome.duration_s:.2f} s and {len(polls)} looks: {outcome.reason}")
        assert not outcome.committed and outcome.merged is None
        assert outcome.reason == "abandoned while matching: a live peer is past v3", outcome.reason
        assert len(polls) == 3
        assert outcome.duration_s < late_start_s  # ended by the third look, not by the deadline

        # the averager is free again: a normal round from the same peer runs (and, alone, finds nobody)
        alone = peer.start_round(replace(at_v3, version=4), RoundPlan(
            get_dht_time() + CFG.averaging.window_s, CFG.averaging.window_s, due=get_dht_time())
        ).result(timeout=ROUND_DEADLINE_S)
        # it ran (a busy averager would refuse it) and found nobody: hivemind says so, or -- on a machine so loaded
        # that its matchmaking outlives the round's own limit -- the round's deadline ends it first
        assert not alone.committed, alone.reason
        assert "could not find a group" in alone.reason or alone.reason.startswith("round exceeded "), alone.reason
