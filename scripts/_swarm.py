"""A benchmark's local swarm: peers started on 127.0.0.1 whose cleanup no signal cuts short, and their events.

:class:`p2p_diloco.local.launcher.LocalSwarm` starts a bootstrap and learners and stops them all on leaving its
``with``. A benchmark adds what a long measurement needs around it: SIGTERM raised as an exception in the main thread
(:func:`raise_on_sigterm`), so every ``with`` stops what it started; a cleanup that a second Ctrl+C or SIGTERM does not
interrupt (:class:`Swarm`); and the learners' events and log lines read while they run.
"""

from __future__ import annotations

import signal
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import _bench

from p2p_diloco.core.events import Event, RoundEvent, read_events
from p2p_diloco.local.launcher import Child, LocalSwarm

TRAINING_LINE = "training from step"
"""The learner's log line when its inner loop starts (after ``--wait-peers``)."""


class Interrupted(RuntimeError):
    """SIGTERM: raised in the main thread so that every ``with`` block stops what it started."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(f"stopped by {signal.Signals(signum).name}")


def raise_on_sigterm() -> None:
    """SIGTERM raises :class:`Interrupted` from now on (Ctrl+C raises KeyboardInterrupt, which cleans up the same
    way)."""
    signal.signal(signal.SIGTERM, _raise_interrupted)


class Swarm(LocalSwarm):
    """:class:`LocalSwarm` whose cleanup no signal interrupts: a SIGINT or SIGTERM that comes while it stops
    everything is noted and raised once it is done (raised in the middle of it, one once left the bootstrap running;
    masking the signal in this thread does not help: Python runs handlers here whichever thread the kernel picks)."""

    def close(self) -> None:
        caught: list[int] = []
        held = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            super().close()
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)
        if caught:
            raise Interrupted(f"stopped by {signal.Signals(caught[0]).name} (after stopping every process)")


def events_of(path: Path) -> list[Event]:
    """A learner's events (none if it has not opened its ``--events`` file yet, or never did)."""
    return read_events(path) if path.exists() else []


def steps_of(path: Path) -> int:
    """The last inner step a learner's events file names (0 without any)."""
    return max((e.step for e in events_of(path)), default=0)


def training(children: list[Child]) -> bool:
    """Whether every learner has started its inner loop; RuntimeError naming the log of one that exited."""
    for child in children:
        if not child.alive:
            raise RuntimeError(f"{child.name} exited (code {child.popen.returncode}) before training; see {child.log_path}")
    return all(child.log_path is not None and child.log_path.exists()
               and TRAINING_LINE in child.log_path.read_text(errors="replace") for child in children)


def rounds_in(events: list[list[Event]], t0: float, t1: float, reason_chars: int) -> dict[str, Any]:
    """The rounds the learners (one event list each) ended within [t0, t1] (wall clock, as the events' DHT time):
    committed and discarded (a round counts once per learner), the three commonest discard reasons (masked by
    :func:`_bench.normalise_reason`, at most ``reason_chars``), the median committed group and step time there."""
    rounds = [e for ev in events for e in ev if isinstance(e, RoundEvent) and t0 <= e.time <= t1]
    steps_s = []
    for ev in events:
        inside = [e for e in ev if t0 <= e.time <= t1]
        if len(inside) >= 2 and inside[-1].step > inside[0].step:
            steps_s.append((inside[-1].time - inside[0].time) / (inside[-1].step - inside[0].step))
    committed = [e for e in rounds if e.committed]
    reasons = Counter(_bench.normalise_reason(e.reason, reason_chars) for e in rounds if not e.committed)
    return {"committed": len(committed), "discarded": len(rounds) - len(committed),
            "discard_reasons": [[reason, count] for reason, count in reasons.most_common(3)],
            "median_group_size": statistics.median(e.group_size for e in committed) if committed else None,
            "median_step_s": statistics.median(steps_s) if steps_s else None}
