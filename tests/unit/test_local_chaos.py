"""The one chaos implementation (``p2p_diloco/local/chaos.py``): the seeded schedule and the driver that applies it,
on stand-in processes (no swarm); and ``p2p-diloco swarm --chaos`` built on them."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from p2p_diloco.local.chaos import (
    KILL,
    STOP,
    Applied,
    ChaosAction,
    ChaosDriver,
    ScheduleParams,
    check_schedule,
    make_schedule,
    one_kill,
)
from p2p_diloco.core.events import TrainingEvent
from p2p_diloco.local.run import Chaos, began_training

NAMES = ["l0", "l1", "l2", "l3"]
RESULTS = Path(__file__).resolve().parents[2] / "results"


@pytest.mark.parametrize("seed", range(20))
def test_schedule_is_seeded_one_at_a_time_and_quiet_at_the_edges(seed: int) -> None:
    actions = make_schedule(seed, 600.0, NAMES)
    assert actions == make_schedule(seed, 600.0, NAMES)
    assert len(actions) >= 6
    for a in actions:
        assert a.at_s >= 45.0 and a.end_s <= 600.0 - 60.0
        assert a.victim in NAMES and a.kind in (KILL, STOP)
        lo, hi = (10.0, 30.0) if a.kind == STOP else (15.0, 45.0)
        assert lo <= a.down_s <= hi
    for a, b in zip(actions, actions[1:]):
        assert b.at_s >= a.end_s + 20.0  # never two learners down or stopped at once
        assert b.victim != a.victim
    kills = sum(a.kind == KILL for a in actions)
    assert abs(kills - (len(actions) - kills)) <= 1
    check_schedule(actions, 600.0, ScheduleParams())


def test_schedules_differ_between_seeds_and_the_quick_one_fits() -> None:
    from scripts_loader import load_script

    assert make_schedule(1, 600.0, NAMES) != make_schedule(2, 600.0, NAMES)
    q = load_script("chaos.py", "chaos_script").QUICK_SCHEDULE
    quick = make_schedule(0, 90.0, NAMES[:3], q)
    assert quick
    check_schedule(quick, 90.0, q)


@pytest.mark.parametrize("folder", ["chaos", "chaos-run-a", "chaos-run-c", "chaos-run-f", "chaos-run-g"])
def test_the_committed_runs_schedules_come_again_from_their_seed_and_pacing(folder: str) -> None:
    """Golden values: ``make_schedule`` gives each committed run's schedule again (``scripts/chaos.py`` records its
    seed, pacing and learners in ``chaos.json``)."""
    d = json.loads((RESULTS / folder / "chaos.json").read_text())
    params = ScheduleParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["schedule_params"].items()})
    learners = sorted({inc["learner"] for inc in d["chaos"]["incarnations"]})
    schedule = make_schedule(d["seed"], d["duration_s"], learners, params)
    assert [asdict(a) for a in schedule] == d["chaos"]["schedule"]


def test_check_schedule_rejects_overlap() -> None:
    a = ChaosAction(60.0, "l0", KILL, 30.0)
    b = ChaosAction(80.0, "l1", STOP, 10.0)
    with pytest.raises(ValueError, match="overlap"):
        check_schedule([a, b], 600.0, ScheduleParams())


def test_impossible_pacing_and_actions_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="every_s > jitter_s"):
        ScheduleParams(every_s=10.0, jitter_s=15.0)
    with pytest.raises(ValueError, match="stop_s"):
        ScheduleParams(stop_s=(5.0, 1.0))
    with pytest.raises(ValueError, match="kind"):
        ChaosAction(1.0, "l0", "pause", 1.0)
    with pytest.raises(ValueError, match="no learners"):
        make_schedule(0, 600.0, [])


def test_one_kill_is_the_swarms_kill_at_a_third_and_restart_at_half() -> None:
    (a,) = one_kill(90.0, "quick-2")
    assert (a.at_s, a.victim, a.kind) == (30.0, "quick-2", KILL) and a.end_s == pytest.approx(45.0)


class FakeChild:
    """What the driver uses of a :class:`~p2p_diloco.local.launcher.Child`; records the signals it got."""

    def __init__(self, name: str) -> None:
        self.name, self.alive, self.signals = name, True, []
        self.summary: dict[str, Any] | None = None

    def final(self) -> dict[str, Any] | None:
        return self.summary

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)
        self.alive = False

    def signal_session(self, sig: signal.Signals) -> int:
        self.signals.append(sig)
        return 3


def _driver(schedule: list[ChaosAction], children: dict[str, Any], restart_ok: bool = True
            ) -> tuple[ChaosDriver, list[Applied]]:
    log: list[Applied] = []

    def restart(a: ChaosAction) -> Any:
        if not restart_ok:
            return "only 3 s of training left"
        children[a.victim] = FakeChild(f"{a.victim}.1")
        return children[a.victim]

    return ChaosDriver(schedule, lambda name: children[name], restart, log.append), log


def test_driver_kills_restarts_stops_and_continues_in_time_order() -> None:
    children = {n: FakeChild(f"{n}.0") for n in NAMES}
    first = dict(children)
    driver, log = _driver([ChaosAction(10.0, "l1", KILL, 5.0), ChaosAction(30.0, "l2", STOP, 4.0)], children)
    driver.tick(9.9)
    assert log == []
    driver.tick(10.0)
    assert [(a.what, a.child.name, a.phase) for a in log] == [("kill", "l1.0", "begin")]
    assert first["l1"].signals == [signal.SIGKILL]
    driver.tick(31.0)  # late: the restart (15 s) and the stop (30 s) both come, in order
    assert [(a.what, a.child.name) for a in log[1:]] == [("restart", "l1.1"), ("stop", "l2.0")]
    assert log[2].reached == 3 and not driver.done
    driver.tick(34.0)
    assert (log[3].what, log[3].child.name, log[3].phase) == ("cont", "l2.0", "end")
    assert children["l2"].signals == [signal.SIGSTOP, signal.SIGCONT] and driver.done


def test_driver_skips_a_victim_that_is_not_training_and_its_end_too() -> None:
    children = {n: FakeChild(f"{n}.0") for n in NAMES}
    children["l0"].summary = {"steps": 3}  # printed its final summary: leaving, not training
    children["l3"].alive = False
    driver, log = _driver([ChaosAction(1.0, "l0", KILL, 1.0), ChaosAction(5.0, "l3", STOP, 1.0)], children)
    driver.tick(100.0)
    assert [(a.what, a.why, a.phase) for a in log] == [("skip", "l0.0 not training", "begin"),
                                                       ("skip", "l3.0 not training", "begin")]
    assert driver.done and children["l0"].signals == [] and children["l3"].signals == []


def test_driver_reports_a_restart_it_was_refused_and_continues_what_it_stopped_at_cleanup() -> None:
    children = {n: FakeChild(f"{n}.0") for n in NAMES}
    driver, log = _driver([ChaosAction(1.0, "l0", KILL, 1.0), ChaosAction(5.0, "l1", STOP, 10.0)], children,
                          restart_ok=False)
    driver.tick(6.0)
    assert [(a.what, a.phase, a.why) for a in log] == [("kill", "begin", ""), ("skip", "end", "only 3 s of training left"),
                                                       ("stop", "begin", "")]
    driver.continue_stopped()
    assert (log[-1].what, log[-1].why, log[-1].child.name) == ("cont", "cleanup", "l1.0")
    assert children["l1"].signals == [signal.SIGSTOP, signal.SIGCONT] and driver.done
    driver.tick(100.0)  # its scheduled SIGCONT is not sent a second time
    assert children["l1"].signals == [signal.SIGSTOP, signal.SIGCONT]


def test_swarm_chaos_counts_from_when_every_learner_trains_kills_at_a_third_and_restarts_at_half() -> None:
    learners = [FakeChild(f"quick-{i}") for i in range(3)]
    started: list[tuple[int, dict[str, Any]]] = []
    training: set[str] = set()

    def start_learner(i: int, **kw: Any) -> FakeChild:
        started.append((i, kw))
        return FakeChild(f"quick-{i}{kw['suffix']}")

    events: list[dict[str, Any]] = []
    chaos = Chaos(True, 90.0, learners, start_learner, 90.0, events,  # type: ignore[arg-type]
                  lambda c: c.name in training)
    chaos.t0 = time.monotonic() - 31.0  # a third of the launch's 90 s, but two learners are still starting
    training.add("quick-0")
    chaos.tick()
    assert chaos.trained_from_s is None and learners[2].signals == [] and events == []
    training.update(("quick-1", "quick-2"))
    chaos.t0 = time.monotonic() - 30.0  # every learner trains from 30 s: 60 s of training left
    chaos.tick()
    assert chaos.trained_from_s is not None and 29.0 <= chaos.trained_from_s <= 31.0 and learners[2].signals == []
    chaos.t0 = time.monotonic() - 51.0  # a third of the 60 s in
    chaos.tick()
    assert learners[2].signals == [signal.SIGKILL] and set(chaos.killed) == {"quick-2"}
    chaos.t0 = time.monotonic() - 61.0  # half of them
    chaos.tick()
    assert [e["what"] for e in events] == ["kill -9 quick-2", "restart quick-2-rejoined"]
    (index, kw), = started
    assert index == 2 and kw["wait"] == 0 and kw["suffix"] == "-rejoined" and 28.0 <= kw["max_time_s"] <= 29.5
    off = Chaos(False, 90.0, learners, start_learner, 90.0, [], lambda c: True)  # type: ignore[arg-type]
    off.t0 = time.monotonic() - 100.0
    off.tick()
    assert off.driver.done and off.killed == {} and off.trained_from_s is None


def test_swarm_chaos_does_nothing_when_the_training_begins_past_the_time_budget() -> None:
    learners = [FakeChild(f"quick-{i}") for i in range(2)]
    chaos = Chaos(True, 60.0, learners, lambda i, **kw: FakeChild("x"), 60.0, [],  # type: ignore[arg-type]
                  lambda c: True)
    chaos.t0 = time.monotonic() - 70.0
    chaos.tick()
    chaos.tick()
    assert chaos.driver.done and chaos.killed == {} and learners[1].signals == []


def test_began_training_reads_the_training_event_from_an_events_files_head(tmp_path: Path) -> None:
    path = tmp_path / "quick-0.jsonl"
    assert not began_training(path)  # not written yet
    resync = {"name": "quick-0", "step": 0, "tokens": 0, "time": 1.0, "loss": None, "event": "resync"}
    path.write_text(json.dumps(resync) + "\n" + '{"name": "quick-0", "ev')  # a line still being written
    assert not began_training(path)
    path.write_text(json.dumps(resync) + "\n" + json.dumps(
        TrainingEvent(seconds_since_start=38.1).stamped(name="quick-0", step=0, tokens=0, time=2.0, loss=None)
        .to_json()) + "\n")
    assert began_training(path)
