"""Which runs a DHT holds: the run index read as runs."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from p2p_diloco.net.records import ANNOUNCE_STATE, IndexEntry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInfo:
    """One run as the index shows it at one moment."""

    run_id: str
    live: int = 0
    """Members with a live entry (bootstraps aside)."""
    announced: int = 0
    """Bootstrap peers that announce the run (never members)."""
    left: int = 0
    """Members whose tombstone is still there."""
    config_hashes: dict[str, int] = field(default_factory=dict)
    """Live members per config hash they publish."""
    announced_hashes: dict[str, int] = field(default_factory=dict)
    """Bootstraps per config hash they announce."""

    @property
    def visible(self) -> bool:
        """Someone is there: a live member or a bootstrap."""
        return self.live > 0 or self.announced > 0

    @property
    def config_hash(self) -> str:
        """The hash the run's peers announce: the live members' majority, else the bootstraps' ("" if none)."""
        counts = self.config_hashes or self.announced_hashes
        return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else ""

    def describe(self) -> str:
        """``a (3 live)``, ``b (0 live, announced by a bootstrap)``, ``c (0 live, 2 left)``."""
        parts = [f"{self.live} live"]
        if self.announced:
            parts.append("announced by a bootstrap" if self.announced == 1 else f"announced by {self.announced} bootstraps")
        if self.left:
            parts.append(f"{self.left} left")
        return f"{self.run_id} ({', '.join(parts)})"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "config_hash": self.config_hash}


def runs_in_index(entries: Iterable[tuple[IndexEntry, float]], now: float) -> list[RunInfo]:
    """Every run the index shows at DHT time ``now`` (expired entries aside; one entry per peer id, the
    newest), the live ones first (most live members first), then the announced ones, then by run id."""
    newest: dict[str, IndexEntry] = {}
    for entry, expiration in entries:
        if expiration >= now and (entry.peer_id not in newest or entry.time > newest[entry.peer_id].time):
            newest[entry.peer_id] = entry
    by_run: dict[str, list[IndexEntry]] = {}
    for entry in newest.values():
        by_run.setdefault(entry.run_id, []).append(entry)
    runs = []
    for run_id, members in by_run.items():
        live = [e for e in members if e.state not in ("left", ANNOUNCE_STATE)]
        announcing = [e for e in members if e.state == ANNOUNCE_STATE]
        runs.append(RunInfo(run_id, live=len(live), announced=len(announcing),
                            left=sum(e.state == "left" for e in members),
                            config_hashes=dict(Counter(e.config_hash for e in live)),
                            announced_hashes=dict(Counter(e.config_hash for e in announcing))))
    return sorted(runs, key=lambda r: (-r.live, -r.announced, r.run_id))


def primary_run(runs: Iterable[RunInfo]) -> RunInfo | None:
    """The run a look without a run id describes: the live one with the most live members, else an
    announced one, else one with departed peers only (its tombstones say who left); ties: the smallest
    run id. None if the index is empty."""
    ordered = sorted(runs, key=lambda r: (-r.live, -r.announced, -r.left, r.run_id))
    return ordered[0] if ordered else None


def pick_run(runs: Iterable[RunInfo], run_id: str | None = None) -> RunInfo:
    """The run a peer without a config joins (``run_id``: the one asked for with ``--run-id``).

    The only run with live members; failing that, the only one a bootstrap announces. Several such
    runs, none, or an asked-for run that is not there: a ``ValueError`` with one line that lists the
    runs and says what to pass.
    """
    runs = sorted(runs, key=lambda r: (-r.live, -r.announced, r.run_id))
    visible = [r for r in runs if r.visible]
    listing = ", ".join(r.describe() for r in visible) or "none"
    if run_id is not None:
        for r in runs:
            if r.run_id == run_id:
                return r
        raise ValueError(f"--run-id {run_id}: no such run in this DHT (runs in this DHT: {listing}); "
                         f"pick one of them, or pass --config FILE to start a run")
    live = [r for r in visible if r.live]
    candidates = live or visible
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        gone = [r.describe() for r in runs]
        seen = f" (only departed peers of: {', '.join(gone)})" if gone else ""
        raise ValueError(f"no run in this DHT: no live peer and no bootstrap announces one{seen}; "
                         f"pass --config FILE (the run's config) to start or join one")
    raise ValueError(f"runs in this DHT: {listing}; pick one with --run-id ID or --config FILE")
