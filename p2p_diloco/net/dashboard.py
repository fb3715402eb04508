"""What ``status --serve`` serves, as data: where it listens, the history its charts draw, its Prometheus figures.

Everything here is computed from ``status --json``'s object (:func:`~p2p_diloco.net.report.snapshot_json`), the
same read ``status`` prints: the page, ``/api/status`` and ``/metrics`` show one swarm, never a second
derivation of it. Pure functions and a bounded history; the HTTP server is :mod:`p2p_diloco.cli.serve`.

Only the standard library is imported at module level (``p2p-diloco --help`` stays fast); prometheus_client
only when the figures are collected.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

LOOPBACK_NAMES = ("localhost",)
WILDCARD_HOSTS = ("0.0.0.0", "::")
"""Hosts that say "every interface" explicitly: the only way to serve beyond this machine."""
HISTORY_POINTS = 1440
"""Reads kept for the charts (at the default 2 s interval: the last 48 minutes); older ones are dropped."""


@dataclass(frozen=True)
class ServeAddress:
    """Where a page or a metrics endpoint listens (``[HOST:]PORT``, 127.0.0.1 by default)."""

    host: str
    port: int

    @property
    def public(self) -> bool:
        """Listening on every interface (``0.0.0.0`` / ``::``): reachable from the network."""
        return self.host in WILDCARD_HOSTS

    def url(self, path: str = "/") -> str:
        """The address to open in a browser on this machine (a wildcard host is reached at its loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{self.port}{path}"


def parse_serve_address(text: str, flag: str, sep: str = " ") -> ServeAddress:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT``; ``ValueError`` naming ``flag`` otherwise (``flag``, ``sep``, the
    text: ``--serve 8080``, ``--metrics prometheus:9100``).

    HOST is a loopback address (127.0.0.1, the default; localhost; ::1) or a wildcard that says so
    explicitly (0.0.0.0, ::: every interface). Any other host is refused: a page of the swarm is read-only and
    holds nothing secret, but who may read it is the operator's choice, made in words, not by a typo."""
    raw = text.strip()
    host, colon, port_text = raw.rpartition(":")
    if not colon:
        host, port_text = "127.0.0.1", raw
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{flag}{sep}{text}: expected [HOST:]PORT with PORT in 1-65535 (e.g. {flag}{sep}8080, "
                         f"{flag}{sep}127.0.0.1:8080, {flag}{sep}0.0.0.0:8080 to be reachable from the network)")
    if not host:
        raise ValueError(f"{flag}{sep}{text}: no host before ':' (give PORT alone for 127.0.0.1:PORT)")
    if host not in WILDCARD_HOSTS and not _loopback(host):
        raise ValueError(f"{flag}{sep}{text}: {host} is not this machine's loopback; to serve beyond this machine say "
                         f"so explicitly with {flag}{sep}0.0.0.0:{port_text} (every interface: anyone who can reach "
                         f"this machine can read the page), or leave the host out for 127.0.0.1")
    return ServeAddress(host, int(port_text))


def _loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: not resolved, not trusted to be this machine
        return False


# ---------------------------------------------------------------- history (the charts)


def history_point(data: dict[str, Any]) -> dict[str, Any]:
    """One read of ``status --json`` as a point of the charts: DHT time, live peers, tokens, tokens/s,
    the swarm's committed rounds (the fragments' newest versions summed: each committed round of a fragment
    adds one), and each live training peer's latest training loss by name."""
    s = data["summary"]
    losses = {p["name"]: p["loss"] for p in data["peers"]
              if p["status"] == "live" and p["kind"] == "PeerRecord" and isinstance(p.get("loss"), (int, float))}
    return {"t": data["dht_time"], "live": s["live"], "tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"],
            "rounds": sum(f["top_version"] for f in s["fragments"]), "loss": losses}


class History:
    """The last :data:`HISTORY_POINTS` reads as chart points (:func:`history_point`); a read of a DHT that
    holds no run adds none."""

    def __init__(self, max_points: int = HISTORY_POINTS) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=max_points)

    def add(self, data: dict[str, Any]) -> None:
        if data["run_id"]:
            self.points.append(history_point(data))

    def to_json(self) -> dict[str, Any]:
        return {"points": list(self.points)}


# ---------------------------------------------------------------- Prometheus figures of a status read


def status_families(data: dict[str, Any]) -> Iterator[Any]:
    """The Prometheus metric families of one ``status --json`` object: the swarm's figures (``run`` label),
    and each live peer's (``run``, ``peer``: its name, ``peer_id``: the end of its peer id)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    run = data["run_id"]
    s = data["summary"]
    ours = next((r for r in data.get("runs_detail", []) if r["run_id"] == run), None)

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        return GaugeMetricFamily(f"p2p_diloco_{name}", doc, labels=["run", *labels])

    up = gauge("swarm_live_peers", "live peers of the run (training and idle members)")
    up.add_metric([run], s["live"])
    yield up
    trainers = gauge("swarm_training_peers", "live peers that train")
    trainers.add_metric([run], s.get("trainers", 0))
    yield trainers
    tokens = CounterMetricFamily("p2p_diloco_swarm_tokens", "tokens trained on by the live peers", labels=["run"])
    tokens.add_metric([run], s["tokens"])
    yield tokens
    rate = gauge("swarm_tokens_per_second", "tokens per second of the live peers, summed")
    rate.add_metric([run], s["tokens_per_s"])
    yield rate
    consensus = gauge("swarm_consensus", "1: every fragment's anchors at its newest version are identical; 0: some "
                      "differ; absent: nobody trains or no anchor published yet")
    if s["consensus"] is not None:
        consensus.add_metric([run], 1.0 if s["consensus"] else 0.0)
    yield consensus
    version = gauge("fragment_version", "newest version of the fragment among the live training peers", ("fragment",))
    agreeing = gauge("fragment_peers_at_version", "live training peers at the fragment's newest version", ("fragment",))
    for f in s["fragments"]:
        version.add_metric([run, str(f["fragment"])], f["top_version"])
        agreeing.add_metric([run, str(f["fragment"])], f["agreeing"])
    yield version
    yield agreeing
    if ours is not None:
        left = gauge("swarm_left_peers", "peers that left the run (tombstones still in the DHT)")
        left.add_metric([run], ours["left"])
        yield left

    peer_labels = ("peer", "peer_id")
    p_tokens = CounterMetricFamily("p2p_diloco_peer_tokens", "tokens the peer trained on", labels=["run", *peer_labels])
    p_rate = gauge("peer_tokens_per_second", "the peer's training throughput", peer_labels)
    p_step = gauge("peer_inner_step", "the peer's inner step", peer_labels)
    p_loss = gauge("peer_loss", "the peer's latest training loss", peer_labels)
    p_sync = gauge("peer_last_sync_time_seconds", "DHT time of the peer's last completed fragment sync",
                   peer_labels)
    p_bytes = CounterMetricFamily("p2p_diloco_peer_bytes", "bytes the peer sent or received in the swarm",
                                  labels=["run", *peer_labels, "direction"])
    p_version = gauge("peer_fragment_version", "the peer's version of each fragment", (*peer_labels, "fragment"))
    for p in data["peers"]:
        if p["status"] != "live" or p["kind"] != "PeerRecord":
            continue
        who = [run, p["name"], p["peer_id"][-8:]]
        p_tokens.add_metric(who, p["tokens"])
        p_rate.add_metric(who, p["tokens_per_s"])
        p_step.add_metric(who, p["inner_step"])
        if isinstance(p.get("loss"), (int, float)):
            p_loss.add_metric(who, p["loss"])
        if p["last_sync_time"] > 0:
            p_sync.add_metric(who, p["last_sync_time"])
        p_bytes.add_metric([*who, "sent"], p["bytes_sent"])
        p_bytes.add_metric([*who, "received"], p["bytes_received"])
        for i, v in enumerate(p["fragment_versions"]):
            p_version.add_metric([*who, str(i)], v)
    yield from (p_tokens, p_rate, p_step, p_loss, p_sync, p_bytes, p_version)
