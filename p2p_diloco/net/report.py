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


@dataclass(frozen=True)
class FragmentConsensus:
    fragment: int
    versions: dict[str, int]
    """Live peers per version (str keys: msgpack/JSON safe)."""
    top_version: int
    agreeing: int
    """Live peers at ``top_version`` (the most common one; ties go to the newer version)."""
    anchors: int = 0
    """Distinct anchor hashes among the live peers at ``top_version`` (> 1: a fork not yet healed)."""
    distance: float = 0.0
    """Largest consensus distance a live peer reports for this fragment (its last healed fork)."""


@dataclass(frozen=True)
class SwarmSummary:
    run_id: str
    live: int
    tokens: int
    tokens_per_s: float
    fragments: tuple[FragmentConsensus, ...]
    consensus: bool
    """Every live peer reports the same version and the same anchor hash for every fragment."""
    states: dict[str, int]
    left: tuple[tuple[str, str, float], ...]
    """(name, peer id, DHT time of leaving), newest first."""
    foreign: tuple[tuple[str, str, str], ...]
    """(name, peer id, reason)."""
    trainers: int = 0
    """Live peers that train (every state but ``idle``): fragment agreement and consensus are taken over
    these, so a ``heartbeat`` member or a monitor never holds consensus back."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(views: Iterable[PeerView], run_id: str) -> SwarmSummary:
    """Swarm-level figures from classified views (pure). Members in state ``idle`` (they publish but train
    no fragment) count as live but not in the fragment figures or the consensus."""
    views = list(views)
    live = [v.record for v in views if v.status == "live" and isinstance(v.record, PeerRecord)]
    trainers = [r for r in live if r.state != "idle"]
    n_frag = max((len(r.fragment_versions) for r in trainers), default=0)
    frags = []
    for f in range(n_frag):
        counts = Counter(r.fragment_versions[f] for r in trainers if len(r.fragment_versions) > f)
        top, agreeing = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        anchors = {r.anchor_hashes[f] for r in trainers if len(r.fragment_versions) > f
                   and r.fragment_versions[f] == top and len(r.anchor_hashes) > f}
        distance = max((r.consensus_distance[f] for r in trainers if len(r.consensus_distance) > f), default=0.0)
        frags.append(FragmentConsensus(f, {str(k): c for k, c in sorted(counts.items())}, top, agreeing,
                                       len(anchors), distance))
    consensus = all(fc.agreeing == len(trainers) and fc.anchors <= 1 for fc in frags)
    left = sorted(((v.record.name, v.peer_id, v.record.time) for v in views if v.status == "left"),
                  key=lambda t: -t[2])
    foreign = tuple((v.record.name, v.peer_id, v.reason) for v in views if v.status == "foreign")
    return SwarmSummary(
        run_id=run_id,
        live=len(live),
        tokens=sum(r.tokens for r in live),
        tokens_per_s=sum(r.tokens_per_s for r in live),
        fragments=tuple(frags),
        consensus=consensus,
        states=dict(Counter(r.state for r in live)),
        left=tuple(left),
        foreign=foreign,
        trainers=len(trainers),
    )


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
    def one(f: dict[str, Any]) -> str:
        fork = f" {f['anchors']} anchors" if f.get("anchors", 0) > 1 else ""
        dist = f" dist {f['distance']:.1e}" if f.get("distance", 0.0) > 0 else ""
        return f"f{f['fragment']}=v{f['top_version']}({f['agreeing']}/{s.get('trainers', s['live'])}{fork}{dist})"

    frag = " ".join(one(f) for f in s["fragments"]) or "-"
    lines = [
        f"run {data['run_id']}: {s['live']} live peers, {s['tokens_per_s']:.0f} tokens/s, {s['tokens']} tokens; "
        f"fragments {frag}; consensus {'yes' if s['consensus'] else 'NO'}" if data["run_id"] else
        "no run in this DHT: no live peer, and no bootstrap announces one",
    ]
    ours = next((r for r in data.get("runs_detail", []) if r["run_id"] == data["run_id"]), None)
    if ours is not None and ours["announced"]:
        lines[0] += f" (announced by {ours['announced']} bootstrap(s))"
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


