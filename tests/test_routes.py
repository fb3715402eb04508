"""Stores along a remembered route (``p2p_diloco.net.routes``): the pure rules, and real hivemind DHTs on
127.0.0.1 -- a repeated store skips the search, a replica that died is forgotten, a refused value stays refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2p_diloco.core.waiting import poll_until
from p2p_diloco.net.routes import ROUTE_TTL_S, Route, route_fresh, worth_remembering

DEADLINE_S = 30.0
WAIT_TIMEOUT_S = 2.0
"""hivemind's ``wait_timeout`` in the test DHTs: how long a store to a dead replica waits."""


def test_route_rules() -> None:
    route = Route((("n1", "p1"), ("n2", "p2")), found_at=100.0)  # type: ignore[arg-type]
    assert route_fresh(route, 100.0) and route_fresh(route, 100.0 + ROUTE_TTL_S - 0.1)
    assert not route_fresh(route, 100.0 + ROUTE_TTL_S)
    assert not route_fresh(route, 99.0)  # a clock that went back: search again
    assert not route_fresh(None, 100.0) and not route_fresh(Route((), 100.0), 100.0)
    assert worth_remembering(route, 2) and not worth_remembering(route, 3)


@pytest.mark.integration
def test_repeated_stores_skip_the_search_and_a_dead_replica_is_forgotten() -> None:
    from hivemind import DHT

    from p2p_diloco.net.routes import route_of, store_routed

    kwargs = dict(num_replicas=2, wait_timeout=WAIT_TIMEOUT_S, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    first = DHT(start=True, **kwargs)  # type: ignore[arg-type]
    dhts = [first]
    try:
        peers = [str(a) for a in first.get_visible_maddrs()]
        dhts += [DHT(start=True, initial_peers=peers, **kwargs) for _ in range(2)]  # type: ignore[arg-type]
        writer, reader = dhts[1], dhts[2]
        assert store_routed(writer, "k", "v1", _dht_time() + 60, b"s").result(timeout=DEADLINE_S)
        route = route_of(writer, "k")
        assert route is not None and len(route[0]) == 2  # 2 replicas: remembered
        assert store_routed(writer, "k", "v2", _dht_time() + 60, b"s").result(timeout=DEADLINE_S)
        assert route_of(writer, "k") == route  # the same route, not searched again
        found = reader.get("k", latest=True)
        assert found is not None and found.value[b"s"].value == "v2"

        # a replica of the route other than the writer dies: the next store still lands, and forgets the route
        victim = next(d for d in dhts if d is not writer and d.peer_id.to_base58() in route[0])
        victim.shutdown()
        dhts.remove(victim)
        assert store_routed(writer, "k", "v3", _dht_time() + 60, b"s").result(timeout=DEADLINE_S)
        assert route_of(writer, "k") is None  # forgotten: the next store searches again
        survivor = next(d for d in dhts if d is not writer)
        poll_until(lambda: _value(survivor, "k") == "v3", DEADLINE_S, "v3 readable from the survivor", 0.5)
        assert store_routed(writer, "k", "v4", _dht_time() + 60, b"s").result(timeout=DEADLINE_S)
        again = route_of(writer, "k")
        assert again is not None and victim.peer_id.to_base58() not in again[0]
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


@pytest.mark.integration
def test_a_refused_value_is_refused_along_a_route_too(tmp_path: Path) -> None:
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.net.identity import load_or_create_identity
    from p2p_diloco.net.membership import SwarmOptions, owner_subkey, start_dht, visible_addresses
    from p2p_diloco.net.records import run_key
    from p2p_diloco.net.routes import store_routed

    ids = [load_or_create_identity(tmp_path / f"{i}.id") for i in range(2)]
    a = start_dht(SwarmOptions(identity=ids[0]), "routes-run")
    dhts = [a]
    try:
        b = start_dht(SwarmOptions(initial_peers=parse_initial_peers(visible_addresses(a)), identity=ids[1]),
                      "routes-run")
        dhts.append(b)
        assert [d.peer_id.to_base58() for d in dhts] == [i.peer_id for i in ids]  # p2pd runs on our Ed25519 keys
        key = run_key("routes-run", ids[1].peer_id)
        subkey = owner_subkey(ids[1].private_key())
        bad = {"run_id": "routes-run", "peer_id": ids[1].peer_id, "tokens": "not a number"}
        assert not store_routed(b, key, bad, _dht_time() + 30, subkey).result(timeout=DEADLINE_S)
        assert a.get(key, latest=True) is None and b.get(key, latest=True) is None  # stored nowhere
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


def _dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


def _value(dht: object, key: str) -> object:
    found = dht.get(key, latest=True)  # type: ignore[attr-defined]
    return None if found is None else found.value[b"s"].value
