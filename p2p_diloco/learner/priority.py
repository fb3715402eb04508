"""CPU priority of a training learner: below its own networking, and below a newcomer starting beside it.

A learner's training thread lowers its nice value once it trains (``join --train-nice``), so that its
DHT, ``p2pd`` and averager processes -- and a learner starting up on the same machine -- are not
starved. A thread's nice value only ranks it against threads of its own *autogroup*, though: with
Linux's autogroup scheduling (``kernel.sched_autogroup_enabled``, on by default on many systems and on
our CI machines), every session gets an equal share of the CPU whatever its threads' nice values. A
newcomer started beside three training learners, each in its own session as ``p2p-diloco swarm`` and
the benchmarks start them, then gets a quarter of the CPU however low the others' priority is: on 2
cores its start-up took 2-3x as long as on an idle machine.

So a learner that leads its own session also lowers its session's autogroup priority. One that does
not (started from a user's shell) leaves the autogroup alone: it is shared with the shell and
whatever else runs in that terminal.

The two happen at different times. The training thread's nice value goes up when training starts
(:func:`lower_thread_priority`): from then on the session's own averager and DHT processes come
first within the session. The session's autogroup goes down only once the learner has joined
(:func:`lower_session_priority`, when :func:`joining_done`: its first committed round, or
:data:`JOINING_MAX_S` into training). Until then it is the newcomer: on 2 cores beside three lowered
learners its first inner steps took 1.2-3.7 s of wall time for 0.5-0.7 s of CPU, and a fragment
boundary passing during that first step left it past the others' matchmaking window, so its first
round found no group and it waited for the next boundary. (Keeping the thread at its full priority
too, until the first contribution, made the swarm's first rounds fail more often on a loaded machine:
the training thread then competed on equal terms with its own averager processes.)

Only the standard library is imported here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

AUTOGROUP_PATH = Path("/proc/self/autogroup")
_AUTOGROUP_RE = re.compile(r"^/autogroup-\d+ nice (-?\d+)\s*$")
MAX_NICE = 19
JOINING_MAX_S = 30.0
"""A learner that has not committed a round this many seconds into training lowers its priority anyway
(alone in the swarm, or failing its rounds: it is no newcomer to make room for any more)."""


def parse_autogroup_nice(text: str) -> int | None:
    """The nice value in ``/proc/self/autogroup``'s text (``/autogroup-4597 nice 0``), or None if it is
    not in that form."""
    m = _AUTOGROUP_RE.match(text.strip())
    return int(m.group(1)) if m else None


def joining_done(contributed: bool, training_s: float, limit_s: float = JOINING_MAX_S) -> bool:
    """Lower the training priority now? Once the learner has contributed (a committed round), or has
    trained ``limit_s`` without contributing."""
    return contributed or training_s >= limit_s


def raised_nice(current: int, by: int) -> int:
    """``current`` lowered in priority by ``by`` (a higher nice value), at most :data:`MAX_NICE`."""
    return min(MAX_NICE, current + max(0, by))


def lower_thread_priority(by: int) -> str:
    """Raise the calling thread's nice value by ``by`` (``os.nice``: on Linux, this thread only), so that
    it yields to its own process's networking and the averager and DHT processes of its session.
    Needs no privilege. Returns what was changed, one line for the log."""
    if by <= 0:
        return "training thread's CPU priority unchanged (--train-nice 0)"
    return f"training thread at nice {os.nice(by)}"


def lower_session_priority(by: int, autogroup: Path = AUTOGROUP_PATH) -> str:
    """If this process leads its own session, raise its session's autogroup nice value by ``by``, so that
    the whole session yields to other sessions -- a newcomer starting beside us (see the module
    docstring). Returns what was changed, one line for the log; a failure to change the autogroup (no
    autogroup support, a read-only /proc) is said there, not raised."""
    if by <= 0:
        return "session autogroup unchanged (--train-nice 0)"
    if os.getsid(0) != os.getpid():
        return "session autogroup left alone (not our own session)"
    try:
        current = parse_autogroup_nice(autogroup.read_text())
        if current is None:
            return f"autogroup unchanged ({autogroup}: unexpected format)"
        target = raised_nice(current, by)
        autogroup.write_text(f"{target}\n")
    except OSError as e:
        return f"autogroup unchanged ({type(e).__name__}: {e})"
    return f"our session's autogroup at nice {target}"


class SessionPriority:
    """Lowers our session's autogroup priority (if we lead our session) once we have joined: at our first
    contribution, or :data:`JOINING_MAX_S` into training. Until then we are the newcomer, and the learners
    beside us already make room for us. ``by`` 0: never."""

    def __init__(self, by: int) -> None:
        self.by = by
        self.lowered = by <= 0

    def settle(self, contributed: bool, training_s: float) -> str | None:
        """Lower it now if joining is done; returns what was done, for the log (None: nothing this time)."""
        if self.lowered or not joining_done(contributed, training_s):
            return None
        self.lowered = True
        when = "after our first contribution" if contributed else \
            f"{JOINING_MAX_S:.0f} s into training without a contribution"
        return f"{lower_session_priority(self.by)} ({when})"

