"""Chaos against learner processes on this machine: which disruptions happen when, and doing them.

The one place that decides and applies chaos for ``p2p-diloco swarm --chaos`` and ``scripts/chaos.py``:

* the **schedule** is pure data: :class:`ChaosAction` (at ``at_s`` a victim is killed or stopped for
  ``down_s``), made by :func:`make_schedule` (seeded, one learner down or stopped at a time, quiet at the
  edges; :class:`ScheduleParams` paces it) or :func:`one_kill` (the swarm's single kill and restart), and
  checked by :func:`check_schedule`;
* the **driver** (:class:`ChaosDriver`) executes a schedule on live processes, in time order. A kill is
  kill -9 of the victim's whole process group and session (its CLI, DHT and averager processes, p2pd:
  :meth:`~p2p_diloco.local.launcher.ChildProcess.kill`), and its end starts the victim again through the
  caller's ``restart`` (the caller knows how its learners start: same identity, what time is left); a
  stop is SIGSTOP to the victim's session, and its end SIGCONT. A victim that is not training when its
  action is due (exited, or printed its final summary) is skipped, and so is that action's end. Every
  step is handed to the caller's ``on_applied`` at once, which logs it its own way.

``p2p_diloco.sim.goodput`` models failures at scale instead (a simulation, no processes).

Only the standard library is imported here (``p2p-diloco --help`` stays fast).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from p2p_diloco.local.launcher import Child

KILL, STOP = "kill", "stop"
"""The kinds of :class:`ChaosAction`."""


@dataclass(frozen=True)
class ChaosAction:
    """One disruption: at ``at_s`` (seconds after the schedule's zero) ``victim`` is killed (kill -9,
    restarted after ``down_s``) or stopped (SIGSTOP, SIGCONT after ``down_s``)."""

    at_s: float
    victim: str
    kind: str
    """:data:`KILL` or :data:`STOP`."""
    down_s: float

    def __post_init__(self) -> None:
        if self.kind not in (KILL, STOP):
            raise ValueError(f"ChaosAction.kind: must be {KILL!r} or {STOP!r}, got {self.kind!r}")
        if self.down_s < 0:
            raise ValueError(f"ChaosAction.down_s: must be >= 0, got {self.down_s}")

    @property
    def end_s(self) -> float:
        """When the victim is restarted (kill) or continued (stop)."""
        return self.at_s + self.down_s


@dataclass(frozen=True)
class ScheduleParams:
    """Pacing of :func:`make_schedule` (seconds)."""

    every_s: float = 60.0
    """Mean time between two actions."""
    jitter_s: float = 15.0
    """Each action comes up to this much before or after its nominal time."""
    stop_s: tuple[float, float] = (10.0, 30.0)
    """SIGSTOP lasts uniformly this long."""
    down_s: tuple[float, float] = (15.0, 45.0)
    """A killed learner is restarted after uniformly this long."""
    quiet_start_s: float = 45.0
    """No action before this (start-up, the first rounds)."""
    quiet_end_s: float = 60.0
    """Every action is over (restarted / continued) this long before the end (final rounds, linger)."""
    settle_s: float = 20.0
    """The next action comes at least this long after the previous one ended (a restart takes ~15 s to
    come back): so only one learner is down or stopped at a time."""

    def __post_init__(self) -> None:
        if self.every_s <= 0 or self.jitter_s < 0 or self.jitter_s >= self.every_s:
            raise ValueError(f"ScheduleParams: need every_s > jitter_s >= 0, got every_s={self.every_s}, "
                             f"jitter_s={self.jitter_s}")
        for what, (lo, hi) in (("stop_s", self.stop_s), ("down_s", self.down_s)):
            if not 0 < lo <= hi:
                raise ValueError(f"ScheduleParams.{what}: must be 0 < low <= high, got {(lo, hi)}")
        if self.quiet_start_s < 0 or self.quiet_end_s < 0 or self.settle_s < 0:
            raise ValueError(f"ScheduleParams: quiet_start_s, quiet_end_s and settle_s must be >= 0, got "
                             f"{self.quiet_start_s}, {self.quiet_end_s}, {self.settle_s}")


def make_schedule(seed: int, duration_s: float, learners: Sequence[str],
                  params: ScheduleParams = ScheduleParams()) -> list[ChaosAction]:
    """The chaos actions of a run of ``duration_s``, deterministic for ``seed``.

    Actions come every ``every_s`` +- ``jitter_s``, none before ``quiet_start_s``; each must be over
    (restart or SIGCONT) ``quiet_end_s`` before the end, and the next starts at least ``settle_s`` after
    the previous ended, so at most one learner is down or stopped at any time. Kinds alternate in
    pairs of random order (half kills, half stops); the victim is random, never the previous one.
    """
    if not learners:
        raise ValueError("make_schedule: no learners to disrupt")
    p = params
    rng = random.Random(seed)
    actions: list[ChaosAction] = []
    counts = {KILL: 0, STOP: 0}
    nominal = 0.0
    while True:
        nominal += p.every_s
        at = max(nominal + rng.uniform(-p.jitter_s, p.jitter_s), p.quiet_start_s)
        if actions:
            at = max(at, actions[-1].end_s + p.settle_s)
        if counts[KILL] == counts[STOP]:
            kind = rng.choice((KILL, STOP))
        else:
            kind = KILL if counts[KILL] < counts[STOP] else STOP
        lo, hi = p.stop_s if kind == STOP else p.down_s
        length = rng.uniform(lo, hi)
        last_end = duration_s - p.quiet_end_s
        if at + lo > last_end:
            return actions
        length = min(length, last_end - at)  # the last action may be shortened to end in time
        candidates = [n for n in learners if not actions or n != actions[-1].victim] or list(learners)
        actions.append(ChaosAction(at, rng.choice(candidates), kind, length))
        counts[kind] += 1
        nominal = max(nominal, at)


def check_schedule(actions: Sequence[ChaosAction], duration_s: float, params: ScheduleParams) -> None:
    """ValueError if two actions overlap or one falls in the quiet edges (what :func:`make_schedule` promises)."""
    first, last = params.quiet_start_s, duration_s - params.quiet_end_s
    for a in actions:
        if a.at_s < first or a.end_s > last:
            raise ValueError(f"chaos action {a} is outside [{first}, {last}] s")
    for a, b in zip(actions, actions[1:]):
        if b.at_s < a.end_s:
            raise ValueError(f"chaos actions overlap: {a} and {b}")


def one_kill(run_s: float, victim: str) -> list[ChaosAction]:
    """``p2p-diloco swarm --chaos``: kill -9 ``victim`` a third into a run of ``run_s`` and restart it at half."""
    if run_s <= 0:
        raise ValueError(f"one_kill: run_s must be > 0, got {run_s}")
    return [ChaosAction(run_s / 3, victim, KILL, run_s / 2 - run_s / 3)]


@dataclass(frozen=True)
class Applied:
    """What :class:`ChaosDriver` did at one phase of an action."""

    action: ChaosAction
    what: str
    """"kill" (kill -9 of the victim's group and session, reaped), "stop" (SIGSTOP to its session), "cont"
    (SIGCONT), "restart" (the victim started again) or "skip" (nothing done, see ``why``)."""
    child: Child
    """The victim's process acted on; for "restart" the new one."""
    phase: str
    """"begin" (at ``at_s``: kill, stop, or skip of both) or "end" (at ``end_s`` or at cleanup: restart, cont, or
    skip of the restart)."""
    why: str = ""
    """"skip": why nothing was done; "cont" at :meth:`ChaosDriver.continue_stopped`: "cleanup"."""
    reached: int | None = None
    """"stop" and "cont": how many processes the signal reached (0: the session was gone, or no ``/proc``)."""


Restart = Callable[[ChaosAction], Child | str]
"""Starts the victim of a kill again: its new process, or why it is not restarted."""


class ChaosDriver:
    """Executes a schedule on live processes, each action's begin at ``at_s`` and its end at ``end_s``.

    ``victim(name)`` is that learner's current process; ``restart(action)`` starts a killed one again (or
    says why not); ``on_applied`` hears of every step the moment it is done. :meth:`tick` is called with
    the seconds since the schedule's zero, as often as the caller's loop runs (an action is late by at
    most that period). :meth:`continue_stopped` SIGCONTs whatever is still stopped: call it before stopping
    the swarm, since a stopped learner cannot leave.
    """

    def __init__(self, schedule: Sequence[ChaosAction], victim: Callable[[str], Child], restart: Restart,
                 on_applied: Callable[[Applied], None]) -> None:
        self.victim, self.restart, self.on_applied = victim, restart, on_applied
        phases = [(a.at_s, 0, i, a) for i, a in enumerate(schedule)]
        phases += [(a.end_s, 1, i, a) for i, a in enumerate(schedule)]
        self._pending = sorted(phases, key=lambda p: p[0])  # stable: a begin before its own end at equal times
        self._stopped: dict[int, Child] = {}
        """Stopped and not yet continued, by the action's index."""

    @property
    def done(self) -> bool:
        """Every action has begun and ended (or was skipped)."""
        return not self._pending

    def tick(self, now_s: float) -> None:
        """Apply every phase due by ``now_s``, in time order."""
        while self._pending and now_s >= self._pending[0][0]:
            _, phase, index, action = self._pending.pop(0)
            if phase == 0:
                self._begin(index, action)
            else:
                self._end(index, action)

    def continue_stopped(self) -> None:
        """SIGCONT every process this driver stopped and has not continued yet (``why`` "cleanup")."""
        for index in list(self._stopped):
            child = self._stopped.pop(index)
            action = next(a for _, _, i, a in self._pending if i == index)
            self._pending = [p for p in self._pending if p[2] != index]
            self.on_applied(Applied(action, "cont", child, "end", "cleanup", child.signal_session(signal.SIGCONT)))

    def _begin(self, index: int, action: ChaosAction) -> None:
        child = self.victim(action.victim)
        if not child.alive or child.final() is not None:
            self._pending = [p for p in self._pending if p[2] != index]  # nothing to restart or continue
            self.on_applied(Applied(action, "skip", child, "begin", f"{child.name} not training"))
        elif action.kind == KILL:
            child.kill()
            self.on_applied(Applied(action, "kill", child, "begin"))
        else:
            self._stopped[index] = child
            self.on_applied(Applied(action, "stop", child, "begin", reached=child.signal_session(signal.SIGSTOP)))

    def _end(self, index: int, action: ChaosAction) -> None:
        if action.kind == STOP:
            child = self._stopped.pop(index)
            self.on_applied(Applied(action, "cont", child, "end", reached=child.signal_session(signal.SIGCONT)))
            return
        new = self.restart(action)
        if isinstance(new, str):
            self.on_applied(Applied(action, "skip", self.victim(action.victim), "end", new))
        else:
            self.on_applied(Applied(action, "restart", new, "end"))
