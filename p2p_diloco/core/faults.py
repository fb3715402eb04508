"""Deterministic fault injection: make a learner fail at a chosen point (tests and chaos drills).

``p2p-diloco join --fault SPEC`` arms a fault and builds the fault wrappers, which call :func:`hit` at each point
(:mod:`p2p_diloco.engine.faulty`: the loop and each fragment's host; :mod:`p2p_diloco.averaging.faulty`: the
runner, the averager process and the averager host); the production classes never do. A fault fires on the
``at``-th hit of its point (counted in the process that reaches it), optionally only for one fragment, so a test
knows exactly when it fires -- no timers, no randomness::

    kill@while-reducing:fragment=0:at=2     the 2nd time fragment 0's averager reduces a remote part
    kill@serving-state:fragment=0           while sending our state to a newcomer (after the first chunk)
    stall@inner-step:at=40:seconds=20       the inner loop hangs 20 s before step 40 (a straggler)

Points (and the process that reaches them): ``inner-step`` and ``before-send`` (the learner, before a
round's contribution is handed to its averager), ``while-sending`` (a fragment averager, after the
first part went out to a reducer), ``while-reducing`` (a fragment averager, after it received the
first part from a remote sender), ``serving-state`` (a fragment averager, after the first chunk of a
state download it serves), ``fetching-state`` (a fragment averager, after the first chunk of a state
download it receives), ``reading-verdicts`` (the learner, each time it reads a round's verdicts),
``serving-offers`` (a fragment averager, each time a member of a group from the clock asks for its offer).

Actions: ``kill`` -- SIGKILL of the learner's main process (its DHT, averagers and ``p2pd`` die with
it: :mod:`p2p_diloco.hivemind_ext.procguard`), exactly what ``kill -9`` does; ``stall`` -- the process that hit
the point sleeps ``seconds`` (an averager that stalls hangs with its connections open, as if it
were stopped by SIGSTOP); ``raise`` -- the process that hit the point raises :class:`FaultInjected`
(at ``inner-step`` or ``before-send``: the learner fails as on a bug, after joining, and must still
publish its tombstone); ``blind`` -- for ``seconds`` from its firing, every hit of the point reports
True, and the caller acts as if its read found nothing (``blind@reading-verdicts``: a member that
misses the others' verdicts, as one behind a slow DHT path would, while they read its own;
``blind@serving-offers``: a member whose offer does not reach the others while theirs reach it).

Before it acts, a fault writes ``FAULT fired: <spec> (hit N, pid P)`` to stderr, flushed, so a test
can check that it fired even when the process dies of it. The armed faults live in this module's
globals; hivemind's averager processes are forked after :func:`arm`, so they inherit them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
POINTS = ("inner-step", "before-send", "while-sending", "while-reducing", "serving-state", "fetching-state",
          "reading-verdicts", "serving-offers")
ACTIONS = ("kill", "stall", "raise", "blind")
DEFAULT_STALL_S = 30.0


class FaultInjected(RuntimeError):
    """Raised by a ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    at: int = 1
    """Fire on this hit of the point (1 = the first), counted per process."""
    fragment: int | None = None
    """Only hits for this fragment count (None: any fragment)."""
    seconds: float = DEFAULT_STALL_S
    """How long a ``stall`` lasts."""

    @property
    def spec(self) -> str:
        extra = f":fragment={self.fragment}" if self.fragment is not None else ""
        extra += f":at={self.at}" if self.at != 1 else ""
        extra += f":seconds={self.seconds:g}" if self.action in ("stall", "blind") else ""
        return f"{self.action}@{self.point}{extra}"


def parse_fault(spec: str) -> Fault:
    """``ACTION@POINT[:fragment=F][:at=N][:seconds=S]`` -> :class:`Fault`; ValueError (one line) otherwise."""
    head, *options = spec.strip().split(":")
    action, sep, point = head.partition("@")
    if not sep or action not in ACTIONS or point not in POINTS:
        raise ValueError(f"--fault {spec!r}: expected ACTION@POINT with ACTION in {list(ACTIONS)} and POINT in "
                         f"{list(POINTS)}, e.g. kill@while-reducing:fragment=0:at=2")
    values: dict[str, int | float] = {}
    for option in options:
        key, sep, raw = option.partition("=")
        if not sep or key not in ("fragment", "at", "seconds") or key in values:
            raise ValueError(f"--fault {spec!r}: bad option {option!r} (known: fragment=F, at=N, seconds=S, once each)")
        try:
            values[key] = float(raw) if key == "seconds" else int(raw)
        except ValueError:
            raise ValueError(f"--fault {spec!r}: {key} must be a number, got {raw!r}") from None
    fault = Fault(action, point, at=int(values.get("at", 1)), seconds=float(values.get("seconds", DEFAULT_STALL_S)),
                  fragment=int(values["fragment"]) if "fragment" in values else None)
    if fault.at < 1 or (fault.fragment is not None and fault.fragment < 0) or not 0 < fault.seconds <= 3600:
        raise ValueError(f"--fault {spec!r}: need at >= 1, fragment >= 0 and 0 < seconds <= 3600")
    if "seconds" in values and action not in ("stall", "blind"):
        raise ValueError(f"--fault {spec!r}: seconds= only applies to stall and blind")
    return fault


_armed: tuple[Fault, ...] = ()
_main_pid = 0
_hits: dict[Fault, int] = {}
_blind_until: dict[Fault, float] = {}
_lock = threading.Lock()


def arm(faults: Sequence[Fault]) -> None:
    """Arm ``faults`` in this process (the learner's main process, before its averagers start)."""
    global _armed, _main_pid
    with _lock:
        _armed, _main_pid = tuple(faults), os.getpid()
        _hits.clear()
        _blind_until.clear()


def armed() -> tuple[Fault, ...]:
    return _armed


def hit(point: str, fragment: int | None = None) -> bool:
    """A fault point: fires the armed fault whose turn it is (a no-op when none is armed). True while a
    ``blind`` fault of this point is in force: the caller then acts as if what it read there was empty."""
    if not _armed:
        return False
    firing = None
    blind = False
    with _lock:
        for fault in _armed:
            if fault.point != point or (fault.fragment is not None and fault.fragment != fragment):
                continue
            if time.monotonic() < _blind_until.get(fault, -1.0):
                blind = True
                continue
            count = _hits[fault] = _hits.get(fault, 0) + 1
            if count == fault.at:
                firing = fault, count
                if fault.action == "blind":
                    _blind_until[fault] = time.monotonic() + fault.seconds
                    blind = True
                break
    if firing is not None:
        _fire(*firing)
    return blind


async def after_first(stream: AsyncIterator[T], point: str, fragment: int | None = None) -> AsyncIterator[T]:
    """``stream`` unchanged, with :func:`hit` called once its first item has been handled by the consumer
    (the points "after the first part / chunk went out or came in")."""
    first = True
    async for item in stream:
        yield item
        if first:
            first = False
            hit(point, fragment)


def _fire(fault: Fault, count: int) -> None:
    sys.stderr.write(f"FAULT fired: {fault.spec} (hit {count}, pid {os.getpid()})\n")
    sys.stderr.flush()
    if fault.action == "kill":
        os.kill(_main_pid or os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)  # an averager process: do not outlive the main one by a moment
    elif fault.action == "raise":
        raise FaultInjected(f"fault {fault.spec} (hit {count})")
    elif fault.action == "stall":
        time.sleep(fault.seconds)
