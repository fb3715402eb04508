"""The swarm's state as data and as a table (`status`, the local runner's view)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable

from p2p_diloco.net.records import LocalRun, PeerRecord, PeerView, adopt_majority

if TYPE_CHECKING:
    from p2p_diloco.net.membership import SwarmSnapshot

logger = logging.getLogger(__name__)


CONSENSUS = ("Consensus, per fragment: the anchors (hashes) of the live training peers at the fragment's newest "
             "version are identical. Shown with counts: 'f0 v12: 3/3 peers identical', 'f1 v9: 2 of 3 at v9, "
             "identical' (one peer behind, still catching up), 'f1 v9: 2 of 3 at v9, anchors differ (2 distinct)' "
             "(a fork not yet healed, or grid groups that converge rather than match; a distance, where shown, is the "
             "largest one its peers last measured: at a healed fork, or across their last grid group), "
             "'-' when no training peer is live. Idle members (heartbeat) and departed peers do not count.")
"""What ``consensus`` means, everywhere it is shown (``status``, its ``--help``, the ``swarm`` live view,
``docs/usage.md``): :func:`summarize` computes it, :func:`consensus_text` renders it."""


@dataclass(frozen=True)
class FragmentConsensus:
    """One fragment's consensus (:data:`CONSENSUS`) among the live training peers."""

    fragment: int
    versions: dict[str, int]
    """Live training peers per version (str keys: msgpack/JSON safe)."""
    top_version: int
    """The newest version a live training peer holds."""
    agreeing: int
    """Live training peers at ``top_version``."""
    anchors: int = 0
    """Distinct anchor hashes among the live training peers at ``top_version`` (> 1: a fork not yet healed;
    0: none published yet)."""
    distance: float = 0.0
    """Only while the anchors differ (``anchors > 1``): the largest consensus distance those peers publish (the
    one of their last healed fork); else 0.0: a healed fork's figure is history, not a present difference."""
    peers: int = 0
    """Live training peers that hold this fragment (at any version)."""

    @property
    def identical(self) -> bool | None:
        """The fragment's consensus: True (one anchor at the newest version), False (several), None (no anchor
        hash published yet)."""
        return None if self.anchors == 0 else self.anchors == 1


@dataclass(frozen=True)
class SwarmSummary:
    run_id: str
    live: int
    tokens: int
    tokens_per_s: float
    fragments: tuple[FragmentConsensus, ...]
    consensus: bool | None
    """:data:`CONSENSUS` for every fragment: True if each one's anchors at its newest version are identical,
    False if some differ, None if nobody trains (no live training peer) or no anchor was published yet."""
    states: dict[str, int]
    left: tuple[tuple[str, str, float], ...]
    """(name, peer id, DHT time of leaving), newest first."""
    foreign: tuple[tuple[str, str, str], ...]
    """(name, peer id, reason)."""
    trainers: int = 0
    """Live peers that train (every state but ``idle``): fragment figures and consensus are taken over these, so
    a ``heartbeat`` member or a monitor never holds consensus back."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def fragment_consensus(fragment: int, records: Iterable[PeerRecord]) -> FragmentConsensus:
    """:data:`CONSENSUS` of one fragment among ``records`` (live training peers; pure)."""
    held = [r for r in records if len(r.fragment_versions) > fragment]
    counts = Counter(r.fragment_versions[fragment] for r in held)
    top = max(counts, default=0)
    at_top = [r for r in held if r.fragment_versions[fragment] == top]
    anchors = {r.anchor_hashes[fragment] for r in at_top if len(r.anchor_hashes) > fragment and r.anchor_hashes[fragment]}
    distance = max((r.consensus_distance[fragment] for r in at_top if len(r.consensus_distance) > fragment),
                   default=0.0) if len(anchors) > 1 else 0.0
    return FragmentConsensus(fragment, {str(k): c for k, c in sorted(counts.items())}, top, len(at_top),
                             len(anchors), distance, len(held))


def summarize(views: Iterable[PeerView], run_id: str) -> SwarmSummary:
    """Swarm-level figures from classified views (pure). Members in state ``idle`` (they publish but train
    no fragment) count as live but not in the fragment figures or the consensus."""
    views = list(views)
    live = [v.record for v in views if v.status == "live" and isinstance(v.record, PeerRecord)]
    trainers = [r for r in live if r.state != "idle"]
    n_frag = max((len(r.fragment_versions) for r in trainers), default=0)
    frags = tuple(fragment_consensus(f, trainers) for f in range(n_frag))
    verdicts = [fc.identical for fc in frags]
    consensus = None if not frags or None in verdicts else all(verdicts)
    left = sorted(((v.record.name, v.peer_id, v.record.time) for v in views if v.status == "left"),
                  key=lambda t: -t[2])
    foreign = tuple((v.record.name, v.peer_id, v.reason) for v in views if v.status == "foreign")
    return SwarmSummary(
        run_id=run_id,
        live=len(live),
        tokens=sum(r.tokens for r in live),
        tokens_per_s=sum(r.tokens_per_s for r in live),
        fragments=frags,
        consensus=consensus,
        states=dict(Counter(r.state for r in live)),
        left=tuple(left),
        foreign=foreign,
        trainers=len(trainers),
    )


def consensus_text(summary: dict[str, Any]) -> str:
    """:data:`CONSENSUS` of a summary (``SwarmSummary.to_json()``, as ``snapshot_json`` holds it) in words, one
    part per fragment: what ``status`` and the ``swarm`` live view print after ``consensus``."""
    parts = []
    for f in summary["fragments"]:
        top, at_top, n = f["top_version"], f["agreeing"], f.get("peers", f["agreeing"])
        who = f"{n}/{n} peers" if at_top == n else f"{at_top} of {n} at v{top},"
        if f["anchors"] > 1:
            dist = f"; last measured distance {f['distance']:.1e}" if f.get("distance", 0.0) > 0 else ""
            verdict = f"{at_top} of {n} at v{top}, anchors differ ({f['anchors']} distinct{dist})"
        elif f["anchors"] == 1:
            verdict = f"{who} identical"
        else:
            verdict = f"{who.rstrip(',')}, anchors not published yet"
        parts.append(f"f{f['fragment']} v{top}: {verdict}")
    return "; ".join(parts) or "-"


def config_mismatch(views: Iterable[PeerView], local: LocalRun) -> str:
    """For an observer that brought its own config: "" if the run's peers (departed ones aside) mostly
    publish our config hash, or none is there; else one line saying that we look with another config."""
    records = [v.record for v in views if v.status in ("live", "foreign") and isinstance(v.record, PeerRecord)]
    theirs = adopt_majority(replace(local, config_hash=""), records).config_hash
    if not local.config_hash or not theirs or theirs == local.config_hash:
        return ""
    return (f"your config's hash {local.config_hash} differs from the run's {theirs}: you are looking with another "
            f"config (leave --config/--set out to use the run's own, or pass the ones its peers use)")


def snapshot_json(snapshot: "SwarmSnapshot", timings_s: dict[str, float]) -> dict[str, Any]:
    """One read as JSON: the run looked at (``run_id`` "" when the DHT holds no run), its peers and summary;
    ``runs`` (live peers per run), ``runs_detail`` (every run of the index, live ones first) and
    ``config_mismatch`` (one line when our own config's hash is not the run's; else "")."""

    local = snapshot.local
    return {
        "run_id": local.run_id,
        "config_hash": local.config_hash,
        "protocol_version": local.protocol_version,
        "dht_time": snapshot.now,
        "timings_s": {k: round(v, 3) for k, v in timings_s.items()},
        "summary": summarize(snapshot.views, local.run_id).to_json(),
        "peers": [
            {"status": v.status, "reason": v.reason, "expiration_time": v.expiration_time,
             "kind": type(v.record).__name__, **asdict(v.record)}
            for v in snapshot.views
        ],
        "runs": snapshot.runs,
        "rejected": list(snapshot.rejected),
        "runs_detail": [r.to_json() for r in snapshot.runs_detail],
        "config_mismatch": config_mismatch(snapshot.views, local),
    }


def _fmt_age(now: float, t: float) -> str:
    if t <= 0:
        return "never"
    s = max(0.0, now - t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _rows(data: dict[str, Any]) -> list[list[str]]:
    now = data["dht_time"]
    rows = []
    for p in data["peers"]:
        if p["status"] not in ("live", "foreign"):
            continue
        full = p["kind"] == "PeerRecord"
        frags = ",".join(str(v) for v in p.get("fragment_versions", [])) if full else ""
        loss = p.get("loss")
        rows.append([
            p["name"], p["peer_id"][-8:], p["status"] if p["status"] != "live" else p["state"],
            str(p.get("inner_step", "")) if full else "", str(p.get("tokens", "")) if full else "",
            f"{p['tokens_per_s']:.0f}" if full else "", frags or "-",
            _fmt_age(now, p["last_sync_time"]) if full else "",
            f"{p['bytes_sent'] / 1e6:.1f}/{p['bytes_received'] / 1e6:.1f}" if full else "",
            f"{loss:.3f}" if isinstance(loss, float) else "-", _fmt_age(now, p["time"]),
        ])
    return rows


HEADER = ["name", "peer", "state", "step", "tokens", "tok/s", "fragments", "last sync", "MB out/in", "loss", "seen"]


def _summary_lines(data: dict[str, Any]) -> list[str]:
    s = data["summary"]
    ours = next((r for r in data.get("runs_detail", []) if r["run_id"] == data["run_id"]), None)
    announced = f" (announced by {ours['announced']} bootstrap(s))" if ours is not None and ours["announced"] else ""
    lines = [
        f"run {data['run_id']}: {s['live']} live peers, {s['tokens_per_s']:.0f} tokens/s, {s['tokens']} tokens"
        f"{announced}; consensus {consensus_text(s)}" if data["run_id"] else
        "no run in this DHT: no live peer, and no bootstrap announces one",
    ]
    if data.get("config_mismatch"):
        lines.append(f"note: {data['config_mismatch']}")
    for name, pid, t in s["left"]:
        lines.append(f"left: {name} ({pid[-8:]}) {_fmt_age(data['dht_time'], t)}")
    for name, pid, reason in s["foreign"]:
        lines.append(f"foreign: {name} ({pid[-8:]}): {reason}")
    others = {r: n for r, n in data["runs"].items() if r != data["run_id"]}
    details = [r for r in data.get("runs_detail", []) if r["run_id"] != data["run_id"]]
    for r in details:  # one line per other run, live ones first
        extra = "".join([f", announced by {r['announced']} bootstrap(s)" if r["announced"] else "",
                         f", {r['left']} left" if r["left"] else ""])
        lines.append(f"other run {r['run_id']}: {r['live']} live{extra}, config hash {r['config_hash'] or '-'} "
                     f"(p2p-diloco status --run-id {r['run_id']})")
    if others and not details:
        lines.append("other runs in this DHT: " + ", ".join(f"{r} ({n} peers)" for r, n in sorted(others.items())))
    for line in data["rejected"]:
        lines.append(f"rejected record: {line}")
    return lines


def render_plain(data: dict[str, Any]) -> str:
    rows = [HEADER] + _rows(data)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(rows) == 1:
        table.append("(no live peers)")
    return "\n".join(table + _summary_lines(data))


def render_rich(data: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"p2p-diloco run {data['run_id']}", title_justify="left")
    for h in HEADER:
        table.add_column(h, justify="right" if h in ("step", "tokens", "tok/s", "loss") else "left")
    for row in _rows(data):
        table.add_row(*row, style="red" if row[2] == "foreign" else None)
    return Group(table, *(Text(line) for line in _summary_lines(data)))


