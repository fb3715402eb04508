"""Stores and reads straight at the nearest nodes (``p2p_diloco.net.nearest``) on five real hivemind DHTs on
127.0.0.1: a signed entry lands on exactly the three nodes nearest its key (no search), every node reads it back (by
the values handler, or by ``rpc_find`` from a node without it), a holder that is gone is stood in for by the next
nearest, and a node that knows too few others searches as before.

In a Python of its own (like ``test_dead_dht``): hivemind's futures share one lock among the processes forked from
one parent, and DHTs shut down mid-call must not leave it held for the rest of the suite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2p_diloco.net.nearest import READ_REPLICAS

pytestmark = pytest.mark.integration
DEADLINE_S = 120.0

SCRIPT = """
import json, time
from functools import partial
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from p2p_diloco.net.membership import read_many, store
from p2p_diloco.net.nearest import answer_values, knows_whole_swarm
from p2p_diloco.net.signing import Ed25519Key, owner_subkey, signature_validators


async def known(_dht, node):
    return len(node.protocol.routing_table.uid_to_peer_id), knows_whole_swarm(node)


async def holds(key, _dht, node):
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return None if found is None else len(list(found.value.items()))


async def node_id(_dht, node):
    return node.node_id.to_bytes()


async def count_finds(_dht, node):
    original, node.protocol.finds = node.protocol.call_find, 0

    async def counted(*args, **kwargs):
        node.protocol.finds += 1
        return await original(*args, **kwargs)
    node.protocol.call_find = counted


async def finds(_dht, node):
    return node.protocol.finds


async def warm(_dht, node):
    return await node.get_many([f"warm-{i}" for i in range(8)])


key = Ed25519Key.generate()
subkey = owner_subkey(key)
options = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], num_replicas=3, record_validators=signature_validators(key))
out = {}
alone = DHT(start=True, **options)
try:
    out["alone_known"] = alone.run_coroutine(known)
    out["alone_store"] = store(alone, "solo", {"v": 1}, get_dht_time() + 60, subkey=subkey)
    found = read_many(alone, ["solo"])["solo"]
    out["alone_read"] = found.value[subkey].value
finally:
    alone.shutdown()

dhts = [DHT(start=True, **options)]
dhts += [DHT(start=True, initial_peers=dhts[0].get_visible_maddrs(), **options) for _ in range(4)]
try:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(d.run_coroutine(known)[0] < 4 for d in dhts):
        for d in dhts:
            d.run_coroutine(warm)  # searches: every node meets every other
    out["known"] = [d.run_coroutine(known) for d in dhts]
    ids = [DHTID.from_bytes(d.run_coroutine(node_id)) for d in dhts]
    target = DHTID.generate(source="entry")
    nearest = sorted(range(5), key=lambda i: target.xor_distance(ids[i]))
    writer = nearest[3]  # a node that does not hold the entry itself
    for i in range(5):
        if i != nearest[0]:  # the nearest runs an older version: no values handler
            dhts[i].run_coroutine(answer_values)
    out["nearest"], out["writer"] = nearest, writer
    dhts[writer].run_coroutine(count_finds)
    out["stored"] = store(dhts[writer], "entry", {"v": 1}, get_dht_time() + 60, subkey=subkey)
    out["finds_to_store"] = dhts[writer].run_coroutine(finds)
    out["holders"] = [i for i, d in enumerate(dhts) if d.run_coroutine(partial(holds, "entry"))]
    out["read"] = [read_many(d, ["entry"])["entry"].value[subkey].value for d in dhts]
    out["finds_to_read"] = dhts[writer].run_coroutine(finds)
    out["read_one"] = read_many(dhts[writer], ["entry"], replicas=1)["entry"].value[subkey].value
    out["finds_to_read_one"] = dhts[writer].run_coroutine(finds) - out["finds_to_read"]
    gone = nearest[0]
    dhts[gone].shutdown()
    out["gone"] = gone
    out["stored_again"] = store(dhts[writer], "entry", {"v": 2}, get_dht_time() + 60, subkey=subkey)
    live = [i for i in range(5) if i != gone]
    out["holders_after"] = [i for i in live if dhts[i].run_coroutine(partial(holds, "entry"))]
    out["read_after"] = [read_many(dhts[i], ["entry"])["entry"].value[subkey].value for i in live]
finally:
    for d in dhts:
        if d.is_alive():
            d.shutdown()
print(json.dumps(out, default=repr))
"""


def test_entries_go_straight_to_the_nearest_nodes_and_are_read_back_from_them() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["alone_known"] == [0, False]  # a lone node searches (and stores on itself)
    assert out["alone_store"] is True and out["alone_read"] == {"v": 1}
    assert all(k == [4, True] for k in out["known"]), out["known"]  # the fault-free precondition: all know all
    nearest, writer = out["nearest"], out["writer"]
    assert out["stored"] is True
    assert sorted(out["holders"]) == sorted(nearest[:3]) and writer not in out["holders"], out
    assert out["finds_to_store"] == 0  # no search: straight to the three
    # the writer's read asked two of the three for their values alone, and the one without that handler by rpc_find
    assert READ_REPLICAS == 2 and out["finds_to_read"] == 1
    assert out["read_one"] == {"v": 1} and out["finds_to_read_one"] == 1  # one replica: the nearest alone
    assert out["read"] == [{"v": 1}] * 5  # signed by the writer, checked by every reader
    # the nearest holder is gone: the writer's table still names it, its store is not answered, the next stands in
    assert out["gone"] == nearest[0] and out["stored_again"] is True
    assert sorted(out["holders_after"]) == sorted(nearest[1:4]), out
    assert out["read_after"] == [{"v": 2}] * 4
