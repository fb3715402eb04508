"""The fault wrappers (``engine/faulty.py``, ``averaging/faulty.py``): each hits its point where the production code
used to, passes everything else through, and they are the only modules that hit a point (issue 47)."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import re
import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
import torch
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

import p2p_diloco
from p2p_diloco.averaging.faulty import FaultyAveragerHost, FaultyAveragerProcess, FaultyRunner
from p2p_diloco.averaging.process import FragmentAveragerProcess
from p2p_diloco.core import faults
from p2p_diloco.core.config import load_config
from p2p_diloco.engine.faulty import FaultyHost, FaultyNetwork
from p2p_diloco.hivemind_ext.compression import get_codec
from p2p_diloco.learner.loop import FaultyLearner, Learner

OURS, THEIRS = PeerID(b"\x00\x05peerA"), PeerID(b"\x00\x05peerB")
REDUCE_DEADLINE_S = 10.0


@pytest.fixture
def armed() -> Any:
    """``armed(spec, ...)`` arms those faults for the test; disarmed after it."""
    yield lambda *specs: faults.arm([faults.parse_fault(s) for s in specs])
    faults.arm([])


def test_only_the_fault_wrappers_hit_fault_points() -> None:
    root = Path(p2p_diloco.__file__).parent
    hitting = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                     if re.search(r"\bfaults\.(hit|after_first)\(", p.read_text()))
    assert hitting == ["averaging/faulty.py", "engine/faulty.py"]


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class _Host:
    """A fragment's host that records what it was asked."""

    prefix = "run-f0"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def start_round(self, contribution: Any, plan: Any) -> Future[Any]:
        self.calls.append(("start_round", contribution.fragment))
        return _done("outcome")

    def fetch_state(self, ours: Any, donors: Any, link: Any = None, replay: bool = True) -> Future[Any]:
        self.calls.append(("fetch_state", ours, donors, link))
        return _done("download")

    def keep_round(self, kept: Any) -> None:
        self.calls.append(("keep_round", kept))

    def vouch(self, version: int, anchor: str) -> None:
        self.calls.append(("vouch", version, anchor))

    def cancel(self) -> None:
        self.calls.append(("cancel",))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))

    def bytes_total(self) -> tuple[int, int]:
        return 3, 4

    def last_group(self) -> tuple[int, tuple[str, ...]]:
        return 5, ("QmA", "QmB")


def test_faulty_host_hits_before_send_then_passes_everything_through(armed: Any,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    armed("raise@before-send:fragment=1:at=2")
    inner = _Host()
    host = FaultyHost(inner)
    offer = [SimpleNamespace(fragment=f) for f in (0, 1, 2)]
    plan: Any = SimpleNamespace()
    assert host.start_round(offer[0], plan).result() == "outcome"  # another fragment: not counted
    assert host.start_round(offer[1], plan).result() == "outcome"  # hit 1 of fragment 1
    with pytest.raises(faults.FaultInjected, match=r"raise@before-send:fragment=1:at=2 \(hit 2\)"):
        host.start_round(offer[1], plan)  # raised on the training thread, before the host sees the contribution
    assert "FAULT fired: raise@before-send:fragment=1:at=2 (hit 2" in capfd.readouterr().err
    assert host.fetch_state((3, "ab"), {"QmA": (4, "cd")}, None).result() == "download"
    host.vouch(3, "ab")
    host.cancel()
    host.shutdown()
    assert host.bytes_total() == (3, 4) and host.prefix == "run-f0" and host.last_group() == (5, ("QmA", "QmB"))
    assert inner.calls == [("start_round", 0), ("start_round", 1), ("fetch_state", (3, "ab"), {"QmA": (4, "cd")}, None),
                           ("vouch", 3, "ab"), ("cancel",), ("shutdown",)]


def test_the_join_loops_faulty_learner_runs_on_a_faulty_network_and_hits_inner_step_first(
        armed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``learner.loop.FaultyLearner`` (join's process) takes the engine's ``FaultyNetwork`` and hits ``inner-step``
    through ``engine.faulty`` before each turn of the loop."""
    seen: dict[str, Any] = {"turns": 0}

    def fake_init(self: Any, cfg: Any, profile: Any, opts: Any, swarm: Any, splits: Any = None,
                  network: Any = None) -> None:
        seen["network"] = network

    def fake_turn(self: Any) -> None:
        seen["turns"] += 1

    monkeypatch.setattr(Learner, "__init__", fake_init)
    monkeypatch.setattr(Learner, "train_once", fake_turn)
    armed("raise@inner-step:at=2")
    swarm: Any = SimpleNamespace(config=load_config("tiny"))
    learner = FaultyLearner(swarm.config, SimpleNamespace(), SimpleNamespace(), swarm)
    assert isinstance(seen["network"], FaultyNetwork) and seen["network"].swarm is swarm
    learner.train_once()
    with pytest.raises(faults.FaultInjected, match=r"raise@inner-step:at=2 \(hit 2\)"):
        learner.train_once()
    assert seen["turns"] == 1  # the point fires before the loop's turn


def test_faulty_averager_host_blinds_its_reads_of_verdicts(armed: Any) -> None:
    armed("blind@reading-verdicts:fragment=0:at=2:seconds=60")
    hosts = []
    for fragment in (0, 1):
        host = FaultyAveragerHost.__new__(FaultyAveragerHost)  # no averager process: only the read
        host.fragment, host._cancelled = fragment, threading.Event()
        host.dht = SimpleNamespace(get=lambda key, latest, return_future: _done({"peer": "ok"}))
        hosts.append(host)
    reads = [hosts[0]._read_verdicts("k") for _ in range(3)]
    assert [found for found, _ in reads] == [{"peer": "ok"}, None, None]  # blind from the 2nd read on, for 60 s
    assert all(read_s >= 0 for _, read_s in reads)
    assert hosts[1]._read_verdicts("k")[0] == {"peer": "ok"}  # another fragment reads what is there
    assert FaultyAveragerHost.averager_class is FaultyAveragerProcess


def test_faulty_averager_process_serves_under_the_production_handler_names() -> None:
    """hivemind names RPC handlers after the servicer's class: a faulty learner's averager must still answer (and
    call) everyone else's FragmentAveragerProcess."""
    FaultyAveragerProcess._collect_rpc_handlers()
    FragmentAveragerProcess._collect_rpc_handlers()
    assert FaultyAveragerProcess._rpc_handlers == FragmentAveragerProcess._rpc_handlers
    for handler in FragmentAveragerProcess._rpc_handlers or []:
        name = handler.method_name
        assert FaultyAveragerProcess._get_handle_name("p", name) == f"p::FragmentAveragerProcess.{name}"


def _reduce_with_faulty_runner() -> list[torch.Tensor]:
    """Our own share through a FaultyRunner's local path, then THEIRS' three parts through its reducer."""
    counters = (mp.Value(ctypes.c_longlong, 0), mp.Value(ctypes.c_longlong, 0))
    ours = torch.arange(768, dtype=torch.float32)

    async def run() -> list[torch.Tensor]:
        runner = FaultyRunner(
            p2p=SimpleNamespace(peer_id=OURS), servicer_type=FaultyRunner, prefix=None, group_id=b"g", tensors=[ours],
            weight=1.0, ordered_peer_ids=[OURS, THEIRS], peer_fractions=(1.0, 0.0), counters=counters,
            compression=get_codec("fp32"), part_size_bytes=1024, fragment=0)
        codec = get_codec("fp32")
        messages = [averaging_pb2.AveragingData(tensor_part=codec.compress(p, CompressionInfo.from_tensor(p)),
                                                weight=1.0) for p in runner.parts_for_local_averaging]
        assert len(messages) == 3

        async def stream() -> AsyncIterator[averaging_pb2.AveragingData]:
            for m in messages:
                yield m

        local = asyncio.create_task(runner._communicate_with_peer(OURS))
        answered = [m async for m in runner._accumulate_parts_streaming(stream(), 1)]
        await asyncio.wait_for(local, REDUCE_DEADLINE_S)
        return answered

    return asyncio.run(run())


def test_faulty_runner_hits_while_reducing_once_per_remote_sender(armed: Any,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    armed("stall@while-reducing:fragment=0:seconds=0.01")
    assert len(_reduce_with_faulty_runner()) == 3  # the parts still go back
    assert capfd.readouterr().err.count("FAULT fired: stall@while-reducing:fragment=0:seconds=0.01 (hit 1") == 1
    armed("stall@while-reducing:fragment=0:at=2:seconds=0.01")  # our own share is no hit: one sender, one hit
    assert len(_reduce_with_faulty_runner()) == 3
    assert "FAULT fired" not in capfd.readouterr().err
