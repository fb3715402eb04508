"""Probes for `doctor`: split swarms, clock skew, refused RPCs."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p_diloco.hivemind_ext.dial import dial
from p2p_diloco.net.addresses import PeerAddress
from p2p_diloco.net.authorizer import SwarmKeyAuthorizer
from p2p_diloco.net.membership import SwarmSnapshot
from p2p_diloco.net.records import (
    PeerRecord,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- split swarm (hivemind #624)


@dataclass(frozen=True)
class SplitReport:
    known: int
    """Peers known from the initial peers and live records."""
    missing: tuple[str, ...]
    """Of those, the ones absent from our routing table before healing."""
    healed: tuple[str, ...]
    """Of the missing, the ones that answered a ping (now in our routing table)."""

    @property
    def split_suspected(self) -> bool:
        return bool(self.missing)


async def _ping_missing(_dht: DHT, node: Any, peers: Sequence[tuple[str, Sequence[str]]]) -> tuple[list[str], list[str]]:
    """(runs inside the DHT process) ping every known peer that is not in our routing table."""
    missing, healed = [], []
    for pid_text, maddrs in peers:
        pid = PeerID.from_base58(pid_text)
        if pid == node.peer_id or pid in node.protocol.routing_table:
            continue
        missing.append(pid_text)
        try:
            if maddrs:
                await dial(node.p2p, pid, maddrs)  # hivemind's P2P has no public call for this
        except Exception as e:
            logger.debug("could not dial %s: %s", pid_text, e)
        if await node.protocol.call_ping(pid) is not None:
            healed.append(pid_text)
    return missing, healed


def check_split(dht: DHT, snapshot: SwarmSnapshot, initial_peers: Iterable[PeerAddress]) -> SplitReport:
    """Compare what the records say exists with our routing table; ping whoever is missing.

    hivemind #624: peers given the same initial peers sometimes form two DHTs. Each side then sees
    only its own records. Every peer we know of (initial peers, addresses in live records) that is
    not in our routing table is dialled and pinged, which merges the tables (the ping adds us to
    theirs too). Run after joining and then every few heartbeats.
    """
    peers: dict[str, list[str]] = {}
    for a in initial_peers:
        if a.peer_id is not None:
            peers.setdefault(a.peer_id, []).append(a.text.split("/p2p/")[0])
    for v in snapshot.views:
        if v.status == "live" and isinstance(v.record, PeerRecord):
            peers.setdefault(v.peer_id, []).extend(m.split("/p2p/")[0] for m in v.record.addresses)
    missing, healed = dht.run_coroutine(_AsyncPing(tuple((k, tuple(v)) for k, v in peers.items())))
    report = SplitReport(len(peers), tuple(missing), tuple(healed))
    if report.missing:
        logger.warning("split swarm suspected: %d of %d known peers were not in our routing table; healed %d",
                       len(missing), len(peers), len(healed))
    return report


@dataclass(frozen=True)
class _AsyncPing:
    """Picklable callable for ``DHT.run_coroutine`` (lambdas and closures are not)."""

    peers: tuple[tuple[str, tuple[str, ...]], ...]

    async def __call__(self, dht: DHT, node: Any) -> tuple[list[str], list[str]]:
        return await _ping_missing(dht, node, self.peers)


# ---------------------------------------------------------------- clock skew (doctor)


@dataclass(frozen=True)
class _AsyncSkew:
    """Ping peers with the DHT's ``validate`` ping and return (peer id, skew s or None, error)."""

    peers: tuple[tuple[str, tuple[str, ...]], ...]
    timeout_s: float = 3.0

    async def __call__(self, _dht: DHT, node: Any) -> list[tuple[str, float | None, str]]:
        from hivemind.proto import dht_pb2

        out: list[tuple[str, float | None, str]] = []
        for pid_text, maddrs in self.peers:
            pid = PeerID.from_base58(pid_text)
            try:
                if maddrs:
                    await dial(node.p2p, pid, maddrs)
                request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False)
                t0 = get_dht_time()
                response = await asyncio.wait_for(node.protocol.get_stub(pid).rpc_ping(request), self.timeout_s)
                t1 = get_dht_time()
            except Exception as e:
                out.append((pid_text, None, f"{type(e).__name__}: {e}".splitlines()[0][:200]))
                continue
            if response is None or not response.dht_time:
                out.append((pid_text, None, "no answer (swarm key mismatch?)"))
            else:
                out.append((pid_text, response.dht_time - (t0 + t1) / 2, ""))
        return out


def measure_clock_skew(dht: DHT, peers: dict[str, list[str]], timeout_s: float = 3.0) -> list[tuple[str, float | None, str]]:
    """Clock offset (their DHT time minus ours, seconds) to each peer, from one ping each."""
    return dht.run_coroutine(_AsyncSkew(tuple((k, tuple(v)) for k, v in peers.items()), timeout_s))


# ---------------------------------------------------------------- private swarm: what the DHT refused


@dataclass(frozen=True)
class _AsyncRefusals:
    """Picklable callable for ``DHT.run_coroutine``: the authorizer's refusal count in the DHT process."""

    async def __call__(self, _dht: DHT, node: Any) -> int | None:
        authorizer = node.protocol.authorizer
        return authorizer.refused if isinstance(authorizer, SwarmKeyAuthorizer) else None


def dht_refusals(dht: DHT) -> int | None:
    """DHT requests this node refused for want of our swarm key (None: an open swarm, nothing is refused)."""
    return dht.run_coroutine(_AsyncRefusals())
