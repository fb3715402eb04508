"""Leaving cancels what the averaging worker waits on (issue 49): a helper process's future is never resolved once
that process is stopped, and interpreter exit joins the worker, so Ctrl+C with a round in flight took 31-37 s to
exit. Stand-in averagers and DHTs whose futures never resolve (pure host logic, no process)."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from p2p_diloco.averaging.decisions import CANCEL_POLL_S, RoundMeta
from p2p_diloco.averaging.host import LEAVING, FragmentAveragerHost, Leaving
from p2p_diloco.averaging.plans import RoundPlan
from p2p_diloco.core.config import load_config
from p2p_diloco.sync.fragment import Contribution

ENDED_WITHIN_S = 10 * CANCEL_POLL_S
"""A cancelled wait ends at its next look; generous for a loaded machine."""


class NeverResolved(Future[Any]):
    """A helper process's future once that process is gone: no result ever comes. Counts cancel() calls."""

    began_allreduce = False
    cancels = 0

    def cancel(self) -> bool:
        self.cancels += 1
        return super().cancel()


def shared(value: float) -> SimpleNamespace:
    return SimpleNamespace(value=value)


def host_of(averager: Any, dht: Any = None) -> FragmentAveragerHost:
    host = FragmentAveragerHost.__new__(FragmentAveragerHost)  # no averager process: only the host's logic
    host.cfg, host.fragment, host.averager, host.names, host.wire_names = load_config(None, []), 0, averager, (), ()
    host.dht, host.prefix, host.report_subkey, host.radial_names, host.grid = dht, "run_f0", b"us", (), False
    host.state_bytes, host.config_hash = 1 << 20, "c" * 16
    host._cancelled = threading.Event()
    host._executor = ThreadPoolExecutor(max_workers=1)
    return host


def averager(step: Any, download: Any = None) -> SimpleNamespace:
    done: Future[Any] = Future()
    done.set_result({})
    return SimpleNamespace(bytes_sent=shared(0), bytes_received=shared(0), last_allreduce_s=shared(0.0), last_meet_s=shared(0.0), last_allreduce_end=shared(0.0), last_part_bytes=shared(0),
                           set_round_timeouts=lambda limits: done, set_group_bits=lambda bits, wait: done,
                           get_tensors=lambda: contextlib.nullcontext([]), step=step, download_state=download,
                           is_alive=lambda: False)  # stopped: procguard.stop_process has nothing to do


def contribution() -> Contribution:
    return Contribution(fragment=0, version=3, anchor_hash="a" * 16, tokens=100, steps=10, weight=10.0, tensors={},
                        norms={})


def plan() -> RoundPlan:
    from hivemind.utils import get_dht_time

    return RoundPlan(get_dht_time() + 1.0, 1.0, due=get_dht_time())


def meta() -> RoundMeta:
    """What a member gathers of :func:`contribution`."""
    from hivemind.utils import get_dht_time

    return RoundMeta.of(contribution(), "c" * 16, get_dht_time())


def cancelled_after(host: FragmentAveragerHost, future: Future[Any], delay_s: float = 0.3) -> float:
    """Shut ``host`` down after ``delay_s`` (as :meth:`DiLoCo.close` does); seconds until ``future`` is done from
    then."""
    time.sleep(delay_s)
    t0 = time.monotonic()
    host.shutdown()
    with contextlib.suppress(Exception):
        future.result(timeout=ENDED_WITHIN_S)
    return time.monotonic() - t0


def test_a_round_waiting_on_a_stopped_averager_ends_when_the_learner_leaves() -> None:
    step = NeverResolved()
    host = host_of(averager(lambda **_kw: step))
    running = host.start_round(contribution(), plan())
    took_s = cancelled_after(host, running)
    outcome = running.result(timeout=0)
    assert not outcome.committed and outcome.reason == LEAVING, outcome
    assert step.cancels == 1, "the step was not cancelled: its group would wait for our tensors"
    assert took_s < ENDED_WITHIN_S, took_s


def test_a_round_reading_verdicts_from_a_stopped_dht_ends_when_the_learner_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round gathered a group and posted its verdict; the DHT's reads never answer (its process stopped)."""
    from p2p_diloco.averaging import host as host_module
    from p2p_diloco.averaging.decisions import Decision

    gathered: Future[Any] = Future()
    gathered.set_result({"peer-a": b"", "peer-b": b""})
    monkeypatch.setattr(host_module, "parse_gathered", lambda g: [meta(), meta()])
    monkeypatch.setattr(host_module, "round_verdict", lambda *a, **kw: Decision(True, "ok"))
    posted: Future[Any] = Future()
    posted.set_result(True)
    reads: list[NeverResolved] = []

    def get(key: str, latest: bool, return_future: bool) -> NeverResolved:
        assert return_future, "a blocking read cannot be cancelled"
        reads.append(NeverResolved())
        return reads[-1]

    dht = SimpleNamespace(run_coroutine=lambda *a, **kw: posted, get=get)  # a store runs in the DHT process
    host = host_of(averager(lambda **_kw: gathered), dht)
    running = host.start_round(contribution(), plan())
    took_s = cancelled_after(host, running)
    outcome = running.result(timeout=0)
    assert reads, "the round never reached its verdicts"
    assert not outcome.committed and outcome.reason == LEAVING and outcome.group_size == 2, outcome
    assert took_s < ENDED_WITHIN_S, took_s


def test_a_download_from_a_stopped_averager_raises_leaving() -> None:
    host = host_of(averager(None, download=lambda ours, donors, timeouts, replay=True: NeverResolved()))
    running = host.fetch_state((3, "a" * 16), {"QmA": (4, "b" * 16)})
    took_s = cancelled_after(host, running)
    with pytest.raises(Leaving, match=LEAVING):
        running.result(timeout=0)
    assert took_s < ENDED_WITHIN_S, took_s


def test_a_wait_that_is_not_cancelled_keeps_its_bound_and_its_result() -> None:
    host = host_of(averager(None))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        host._wait(NeverResolved(), 0.6)
    assert 0.6 <= time.monotonic() - t0 < 0.6 + ENDED_WITHIN_S
    done: Future[Any] = Future()
    done.set_result(7)
    assert host._wait(done, None) == 7


class Hanging:
    """A fragment averager whose rounds end only when cancelled (as a real one's with no group yet)."""

    prefix = "run_f0"

    def __init__(self, cfg: Any, index: int, *_args: Any, **_kwargs: Any) -> None:
        self.index = index
        self.calls: list[str] = []
        self.pending: list[tuple[Future[Any], int]] = []

    def start_background(self) -> None: ...
    def wait_ready(self, timeout_s: float) -> None: ...
    def vouch(self, version: int, anchor: str) -> None: ...

    def start_round(self, contribution: Contribution, plan: RoundPlan) -> Future[Any]:
        self.pending.append((Future(), contribution.version))
        return self.pending[-1][0]

    def cancel(self) -> None:
        from p2p_diloco.averaging.plans import RoundOutcome

        self.calls.append("cancel")
        for future, version in self.pending:
            if not future.done():
                future.set_result(RoundOutcome(fragment=self.index, version=version, committed=False, reason=LEAVING))

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def bytes_total(self) -> tuple[int, int]:
        return 0, 0  # nothing ever moves


def test_leaving_the_block_on_ctrl_c_cancels_the_rounds_in_flight(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import torch
    from test_engine import OVERRIDES, fake_swarm, train

    from p2p_diloco import DiLoCo, build_model, training_batches
    from p2p_diloco.engine import rounds
    from p2p_diloco.transport import hivemind

    cfg = load_config("llama-tiny", OVERRIDES)
    torch.set_num_threads(1)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hivemind, "FragmentAveragerHost", Hanging)
        d = DiLoCo(model, opt, fake_swarm(cfg))  # type: ignore[arg-type]
    d.view.swarm_reads, d.training = 1, True  # as after start(), which reads the DHT (there is none)
    caplog.set_level(logging.INFO, logger=rounds.__name__)
    with pytest.raises(KeyboardInterrupt), d:
        train(d, model, opt, training_batches(cfg, seed=1), steps=4)  # a fragment falls due every 2 steps
        in_flight = [s.index for s in d.slots if s.inflight is not None and not s.inflight.done()]
        assert in_flight, "no round in flight: the interrupt would test nothing"
        raise KeyboardInterrupt
    hosts: list[Hanging] = [h.averager for h in d.rounds.hosts]  # type: ignore[attr-defined, misc]
    assert all(h.calls[:1] == ["cancel"] and "shutdown" in h.calls for h in hosts), [h.calls for h in hosts]
    assert all(f.done() for h in hosts for f, _ in h.pending)
    said = [r.getMessage() for r in caplog.records if "leaving: cancelled the round in flight" in r.getMessage()]
    assert len(said) == len(in_flight), caplog.text
