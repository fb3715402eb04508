"""Stores along a remembered route: a key stored again and again skips the DHT search for its nearest nodes.

hivemind's ``DHTNode.store`` first searches for the key's nearest nodes (``rpc_find``), and every node it asks
answers with everything it holds under that key: a peer record's heartbeat fetched the whole shard of records
from every node before storing its own (at 4 learners, about 4 KB per node asked, three quarters of what a
heartbeat cost). A key's nearest nodes change only when nodes join or leave, so :func:`store_routed` searches
once, remembers the nodes (:class:`Route`) for :data:`ROUTE_TTL_S` and stores straight to them; a replica that
does not answer forgets the route (the next store searches again), and a store that no replica accepted falls
back to hivemind's own, searching the whole way. A search that found fewer nodes than the DHT's replicas (a
swarm smaller than that) is not remembered: every node that joins would be one of the key's nearest. Signing and validation are hivemind's, as in its own store:
the record validator signs the value, and each receiving node validates it (our schemas, the owner's signature).

For keys stored once (a round's verdict, a version's vouch) a route buys nothing: they use ``dht.store``.
The coroutines run in the DHT process, where :data:`_routes` lives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.utils import MPFuture

ROUTE_TTL_S = 60.0
"""How long a key's nearest nodes are stored to without searching again (nodes that join meanwhile are not
among them until then; one that leaves is noticed at the first store it does not answer)."""


@dataclass(frozen=True)
class Route:
    """The nearest nodes of one key, as a search found them."""

    nodes: tuple[tuple["DHTID", "PeerID"], ...]
    """(node id, peer id), nearest first; our own node among them when it is one of the nearest."""
    found_at: float
    """``time.monotonic()`` of the search."""


def route_fresh(route: Route | None, now: float, ttl_s: float = ROUTE_TTL_S) -> bool:
    """Whether a store at ``now`` may use ``route`` without searching."""
    return route is not None and bool(route.nodes) and 0.0 <= now - route.found_at < ttl_s


def worth_remembering(route: Route, replicas: int) -> bool:
    """Whether a search's route is kept: only when it found as many nodes as the value is stored on (in a
    smaller swarm, each node that joins is one of the key's nearest, and should get the next store)."""
    return len(route.nodes) >= replicas


_routes: dict["DHTID", Route] = {}
"""By key id, in the DHT process."""


async def _store_on(node: "DHTNode", key_id: "DHTID", subkey: Any, value: Any, expiration: float,
                    route: Route) -> tuple[bool, bool]:
    """Store one signed value on the route's nodes: (some node accepted it, some node did not answer)."""
    from hivemind.dht.validation import DHTRecord

    protocol = node.protocol
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration)
    validator = protocol.record_validator
    if validator is not None:
        record = dataclasses.replace(record, value=validator.sign_value(record))
    accepted, remote = False, []
    for node_id, peer_id in route.nodes:
        if node_id == node.node_id:
            if validator is None or validator.validate(record):
                accepted |= bool(protocol.storage.store(key_id, record.value, expiration, subkey=subkey))
        else:
            remote.append(protocol.call_store(peer_id, keys=[key_id], values=[record.value],
                                              expiration_time=[expiration], subkeys=[subkey]))
    answers = await asyncio.gather(*remote)
    accepted |= any(a is not None and any(a) for a in answers)
    return accepted, any(a is None for a in answers)


async def _store_routed(key: Any, subkey: Any, value: Any, expiration: float, dht: "DHT", node: "DHTNode") -> bool:
    from hivemind.dht.routing import DHTID

    key_id = DHTID.generate(source=key)
    route = _routes.get(key_id)
    if not route_fresh(route, time.monotonic()):
        found_at = time.monotonic()
        nearest = await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas, exclude_self=False)
        route = Route(tuple(nearest.get(key_id, {}).items()), found_at)
        if worth_remembering(route, node.num_replicas):
            _routes[key_id] = route
    assert route is not None
    accepted, unanswered = await _store_on(node, key_id, subkey, value, expiration, route)
    if unanswered:
        _routes.pop(key_id, None)
    if accepted:
        return True
    return bool(await node.store(key, value, expiration, subkey=subkey))  # the whole way, as hivemind does


def store_routed(dht: "DHT", key: Any, value: Any, expiration_time: float, subkey: Any) -> "MPFuture[bool]":
    """``dht.store(key, value, expiration_time, subkey=subkey, return_future=True)`` along the key's remembered
    route (see the module): a future of True if some node accepted the value."""
    return dht.run_coroutine(partial(_store_routed, key, subkey, value, expiration_time), return_future=True)


async def _route_of(key: Any, dht: "DHT", node: "DHTNode") -> tuple[tuple[str, ...], float] | None:
    from hivemind.dht.routing import DHTID

    route = _routes.get(DHTID.generate(source=key))
    return None if route is None else (tuple(p.to_base58() for _, p in route.nodes), route.found_at)


def route_of(dht: "DHT", key: Any) -> tuple[tuple[str, ...], float] | None:
    """The route remembered for ``key`` in ``dht``'s process (peer ids nearest first, when found), or None
    (for tests and diagnostics)."""
    return dht.run_coroutine(partial(_route_of, key))
