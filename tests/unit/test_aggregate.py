"""The way from a group's meeting into its all-reduce in the averager process
(``FragmentAveragerProcess._aggregate_with_group``): the vector's split and the tensors' lock taken on the event loop
when they can be, and the lock given back on every way out -- the all-reduce ending, failing, or the step cancelled
while the host held the lock. Pure logic: the method runs on a stand-in averager with a real lock."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.averaging.process import FragmentAveragerProcess

PEERS = tuple(PeerID(bytes([i]) * 34) for i in range(3))
LOCK_WAIT_S = 5.0


def _group(bandwidths: tuple[float | None, ...] = (None, None, None)) -> GroupInfo:
    gathered = tuple(MSGPackSerializer.dumps([b, AveragingMode.NODE.value, MSGPackSerializer.dumps({"member": i})])
                     for i, b in enumerate(bandwidths))
    return GroupInfo(b"group", PEERS, gathered)


def _averager(run: Any) -> SimpleNamespace:
    return SimpleNamespace(serializer=MSGPackSerializer, lock_averaged_tensors=mp.Lock(), total_size=1000,
                           _averaged_tensors=[torch.zeros(1000)], _run_allreduce_inplace_=run)


def _aggregate(averager: SimpleNamespace, group: GroupInfo) -> Any:
    return FragmentAveragerProcess._aggregate_with_group(averager, group, 0)  # type: ignore[arg-type]


def test_the_all_reduce_runs_on_an_even_split_with_the_lock_held_and_gives_it_back() -> None:
    seen: dict[str, Any] = {}

    async def run(tensors: Any, group_info: GroupInfo, peer_fractions: tuple[int, ...], **kwargs: Any) -> None:
        seen.update(fractions=peer_fractions, held=not averager.lock_averaged_tensors.acquire(block=False),
                    tensors=tensors, kwargs=kwargs)

    averager = _averager(run)
    gathered = asyncio.run(_aggregate(averager, _group()))
    assert gathered == {p: {"member": i} for i, p in enumerate(PEERS)}
    assert seen["held"] and seen["tensors"] is averager._averaged_tensors and seen["kwargs"] == {}
    assert seen["fractions"] == (334, 333, 333), seen["fractions"]
    assert averager.lock_averaged_tensors.acquire(block=False), "the lock was not given back"


def test_a_stated_bandwidth_still_gets_hivemind_s_split() -> None:
    seen: dict[str, Any] = {}

    async def run(tensors: Any, group_info: GroupInfo, peer_fractions: tuple[int, ...], **kwargs: Any) -> None:
        seen["fractions"] = peer_fractions

    asyncio.run(_aggregate(_averager(run), _group((1.0, 3.0, None))))
    assert sum(seen["fractions"]) == 1000 and seen["fractions"][1] > seen["fractions"][0], seen["fractions"]


def test_a_failed_all_reduce_reads_as_hivemind_s_and_gives_the_lock_back() -> None:
    async def run(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a reducer failed")

    averager = _averager(run)
    with pytest.raises(MatchmakingException, match="^Unable to run All-Reduce: a reducer failed$"):
        asyncio.run(_aggregate(averager, _group()))
    assert averager.lock_averaged_tensors.acquire(block=False), "the lock was not given back"


def test_a_step_cancelled_while_the_host_holds_the_lock_leaves_it_free_once_the_host_lets_go() -> None:
    ran = threading.Event()

    async def run(*args: Any, **kwargs: Any) -> None:
        ran.set()

    averager = _averager(run)
    lock = averager.lock_averaged_tensors
    lock.acquire()  # the host copies a round's tensors

    async def cancel_while_waiting() -> None:
        task = asyncio.create_task(_aggregate(averager, _group()))
        await asyncio.sleep(0.2)
        assert not task.done()
        task.cancel()
        with pytest.raises((MatchmakingException, asyncio.CancelledError)):
            await task
        lock.release()  # the host is done: the pool's thread takes the lock, and gives it back
        for _ in range(int(LOCK_WAIT_S / 0.05)):
            await asyncio.sleep(0.05)
            if lock.acquire(block=False):
                return
        raise AssertionError(f"the lock was still held {LOCK_WAIT_S} s after the host let go")

    asyncio.run(cancel_while_waiting())
    assert not ran.is_set(), "the all-reduce ran after its step was cancelled"
