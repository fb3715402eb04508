"""``scripts/chaos.py``'s learner incarnations: what the harness keeps of each learner process, and its record.

Learner ``l2`` is one peer (``--name l2``, one identity file) across restarts; its processes are incarnations
``l2.0``, ``l2.1``, ... (:class:`Incarnation`). :func:`incarnation_record` is what one of them leaves in
``chaos.json`` (``chaos.incarnations``): its times, how it ended, its final summary and its round events,
compacted (:func:`compact_rounds`), which is all the analysis (``chaos_analysis``) reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p_diloco.local.launcher import Child, read_jsonl

RESUMED_RE = re.compile(r"^resumed from \S+: step (\d+)")
"""A learner's stdout line when it resumed from a checkpoint."""


@dataclass
class Incarnation:
    """One process of a learner (``key`` = ``<learner>.<n>``); times in seconds since the harness started."""

    learner: str
    key: str
    shard: int
    child: Child
    events: Path
    spawned: float
    max_time_s: float
    """Its ``--max-time``."""
    up: float | None = None
    """When it printed its ``learner ...`` line (built, about to train)."""
    ended: float | None = None
    end: str = "running"
    """"final" (printed its summary), "killed" (by us), "crashed" (exited without a summary), "running"."""
    stops: list[list[float | None]] = field(default_factory=list)
    """[SIGSTOP, SIGCONT] times."""


def incarnation_record(inc: Incarnation, train0: float, t_harness: float, train0_wall: float) -> dict[str, Any]:
    """One incarnation's raw record (JSON), times in seconds since training started (``train0``, in harness
    seconds; the harness started at ``time.monotonic()`` = ``t_harness``, training at ``time.time()`` =
    ``train0_wall``)."""

    def rel(t: float | None) -> float | None:
        return round(t - train0, 2) if t is not None else None

    events = read_jsonl(inc.events)
    return {
        "learner": inc.learner, "key": inc.key, "shard": inc.shard, "pid": inc.child.popen.pid,
        "spawned_s": rel(inc.spawned), "up_s": rel(inc.up), "ended_s": rel(inc.ended),
        "end": inc.end, "exit_code": inc.child.popen.poll(),
        "stops": [[rel(a), rel(b)] for a, b in inc.stops],
        "final": inc.child.final(), "max_step": max_step(events),
        "final_s": rel(inc.child.final_at - t_harness) if inc.child.final_at is not None else None,
        "resumed_from_step": resumed_step(inc.child),
        "rounds": compact_rounds(events, train0_wall),
        "resyncs": sum(e.get("event") == "resync" for e in events),
    }


def resumed_step(child: Any) -> int | None:
    """The step an incarnation resumed from (its ``resumed from DIR: step N`` stdout line), None if it
    started afresh."""
    m = child.find(RESUMED_RE)
    return int(m.group(1)) if m else None


def max_step(events: Sequence[dict[str, Any]]) -> int:
    """The largest ``step`` in a learner's events (a killed incarnation's steps: those it printed)."""
    return max((int(e["step"]) for e in events if isinstance(e.get("step"), int)), default=0)


def compact_rounds(events: Sequence[dict[str, Any]], t0_wall: float) -> list[dict[str, Any]]:
    """The round events an analysis needs: time since training start, fragment, version, outcome, reason, tokens."""
    return [{"t": round(e["time"] - t0_wall, 2), "fragment": e["fragment"], "version": e["version"],
             "outcome": e["outcome"], "reason": e.get("reason", ""), "tokens_sent": e.get("tokens_sent"),
             "group_size": e.get("group_size"), "step": e.get("step")}
            for e in events if e.get("event") == "round"]
