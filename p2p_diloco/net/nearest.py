"""Stores and reads that go straight to the nodes nearest a key, when this node knows the whole swarm.

hivemind finds the nodes nearest a key by a search, for a read and for a store alike: every node the search asks
answers with all it holds under the key (every subkey's entry: a shard's peer records, a version's vouches) and up
to 20 of its own nearest neighbours. So a store of our record read back its whole shard from three nodes or more,
and a latest read asked about as many. In a swarm this node knows whole -- its routing table holds fewer nodes than
one bucket takes (``bucket_size``, 20), so none was ever turned away, and it has met at least as many as a value
is stored on -- the nearest nodes it knows are the key's nearest nodes, the ones a search would end at:

- a **store** (:func:`store_nearest`) goes straight to the :attr:`num_replicas` nearest (this node among them if it
  is one): one call each, carrying the value, answered with a yes or no; the next nearest stand in for one that
  does not answer;
- a **latest read** (:func:`get_nearest`) asks the :data:`READ_REPLICAS` nearest of each key, one call to each node
  for all the keys it is nearest to, and merges their answers entry by entry (the latest of each subkey wins), as
  a search does; the next nearest stand in for one that does not answer.

A node that joins later is told what it should hold by the nodes that held it (hivemind's routing table does that
when it meets a node), and every one of our entries is stored again within a minute or, for a vouch, read where it
was stored. A larger swarm, or a node that has met too few others yet, searches as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Sequence

from hivemind.dht.node import DHTNode, _SearchState
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils.timed_storage import ValueWithExpiration

logger = logging.getLogger(__name__)

READ_REPLICAS = 2
"""How many of a key's nearest nodes a latest read asks by default, of the three that store it: one that missed a
store (it was restarting, or joined since) or does not answer leaves the other. Vouches are stored once, at a
commit; what is stored again every few seconds (peer records) is read from one (:data:`RECORD_READ_REPLICAS`)."""
RECORD_READ_REPLICAS = 1
"""How many nodes a full read of the swarm's records asks for each shard: a record is stored again every 10 s, so
a node that missed one store has it again within a heartbeat, and a full read is a tenth of a record's TTL late
at most. Two doubled the largest cost left at 16 learners (a full read is every record of the swarm)."""


def knows_whole_swarm(node: DHTNode) -> bool:
    """Whether ``node``'s routing table holds the whole swarm: fewer nodes than a bucket takes (none was ever turned
    away) and at least as many as a value is stored on (a newcomer that has met one node searches)."""
    known = len(node.protocol.routing_table.uid_to_peer_id)
    return node.num_replicas <= known < node.protocol.bucket_size


def nearest_known(node: DHTNode, key_id: DHTID) -> list[tuple[DHTID, PeerID | None]]:
    """Every node ``node`` knows and its peer id (None: ``node`` itself, unless a client), nearest to ``key_id`` first.
    The peer ids are taken now: a node that fails a call meanwhile leaves the routing table."""
    known: list[tuple[DHTID, PeerID | None]] = list(node.protocol.routing_table.get_nearest_neighbors(
        key_id, node.protocol.bucket_size, exclude=node.node_id))
    if not node.protocol.client_mode:
        known.append((node.node_id, None))
    return sorted(known, key=lambda known_node: key_id.xor_distance(known_node[0]))


async def store_nearest(key: Any, value: Any, expiration_time: float, subkey: Any, _dht: Any,
                        node: DHTNode) -> bool:
    """(DHT process) Store ``value`` under ``key`` (and ``subkey``) on the nearest nodes ``node`` knows, signed as
    hivemind's store signs it; True if some node accepted it. A swarm not known whole is searched
    (:meth:`DHTNode.store`)."""
    if not knows_whole_swarm(node):
        return bool(await node.store(key, value, expiration_time, subkey=subkey, beam_size=node.num_replicas))
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration_time)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
    candidates = nearest_known(node, key_id)
    accepted: list[bool] = []

    async def store_at(peer: PeerID | None) -> bool | None:
        if peer is None:  # this node
            valid = protocol.record_validator is None or protocol.record_validator.validate(record)
            return valid and protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey)
        answer = await protocol.call_store(peer, keys=[key_id], values=[record.value],
                                           expiration_time=[expiration_time], subkeys=[subkey])
        return None if answer is None else bool(answer[0])

    while candidates and len(accepted) < node.num_replicas:
        batch, candidates = candidates[:node.num_replicas - len(accepted)], candidates[node.num_replicas - len(accepted):]
        answers = await asyncio.gather(*(store_at(peer) for _, peer in batch))
        accepted += [a for a in answers if a is not None]
    return any(accepted)


async def get_nearest(keys: Sequence[Any], replicas: int | Sequence[int], _dht: Any, node: DHTNode) -> dict[Any, Any]:
    """(DHT process) The latest value of each of ``keys`` (None where none), as :meth:`DHTNode.get_many` returns it,
    from the ``replicas`` nearest nodes ``node`` knows of each key (:data:`READ_REPLICAS`; one count for all, or one
    per key). A swarm not known whole is searched (with as narrow a beam as a value is stored on)."""
    if not knows_whole_swarm(node):
        found = await node.get_many(keys, sufficient_expiration_time=float("inf"), beam_size=node.num_replicas)
        return {key: found.get(key) for key in keys}
    protocol = node.protocol
    key_ids = {key: DHTID.generate(source=key) for key in keys}
    wanted = dict(zip(key_ids.values(), [replicas] * len(keys) if isinstance(replicas, int) else replicas))
    states = {key_id: _SearchState(key_id, float("inf"), serializer=protocol.serializer,
                                   record_validator=protocol.record_validator) for key_id in key_ids.values()}
    pending = {key_id: nearest_known(node, key_id) for key_id in states}
    answered = dict.fromkeys(states, 0)
    while True:
        asked: dict[tuple[DHTID, PeerID | None], list[DHTID]] = {}
        for key_id, candidates in pending.items():
            while candidates and answered[key_id] + sum(key_id in ks for ks in asked.values()) < wanted[key_id]:
                asked.setdefault(candidates.pop(0), []).append(key_id)
        if not asked:
            break
        replies = await asyncio.gather(*(_find(node, peer, ks) for (_, peer), ks in asked.items()))
        for ((node_id, _), ks), reply in zip(asked.items(), replies):
            if reply is None:
                continue
            for key_id in ks:
                answered[key_id] += 1
                states[key_id].add_candidate(reply.get(key_id), source_node_id=node_id)
    for state in states.values():
        state.finish_search()
    return {key: await states[key_id].future for key, key_id in key_ids.items()}


async def _find(node: DHTNode, peer: PeerID | None, key_ids: list[DHTID]) -> dict[DHTID, Any] | None:
    """What ``peer`` (None: ``node`` itself) holds under ``key_ids`` (binary, as :meth:`DHTProtocol.call_find` returns
    it), or None if it did not answer. This node's own storage (and cache) is read without a call; another node is asked for the values
    alone (:class:`NearestValues`), or, if it has no such handler (an older version), by hivemind's ``rpc_find``."""
    protocol = node.protocol
    if peer is None:
        return {key_id: _held(protocol, key_id) for key_id in key_ids}
    try:
        return await NearestValues.call(protocol, peer, key_ids)
    except NoValuesHandler:
        reply = await protocol.call_find(peer, key_ids)
        return None if reply is None else {key_id: value for key_id, (value, _neighbours) in reply.items()}


def _held(protocol: DHTProtocol, key_id: DHTID) -> ValueWithExpiration[Any] | None:
    """What ``protocol``'s node holds under ``key_id``: stored, or cached if that is newer (as ``rpc_find`` answers)."""
    stored, cached = protocol.storage.get(key_id), protocol.cache.get(key_id)
    if cached is not None and (stored is None or cached.expiration_time > stored.expiration_time):
        return cached
    return stored


class NoValuesHandler(Exception):
    """The node asked does not answer :meth:`NearestValues.rpc_values` (a version before it)."""


MAX_VALUE_KEYS = 64
"""The most keys one values request may name (ours name at most a read's keys: the record shards and the index)."""


class NearestValues(ServicerBase):
    """``rpc_values``: hivemind's ``rpc_find`` without the neighbours. ``rpc_find`` answers every key with up to a
    bucket (20) of the node's nearest neighbours, about 60 bytes each, so that a search can go on; a read that knows
    where the key lives needs only the values (at N = 16 the neighbours were most of a read's bytes). Same messages,
    same private-swarm check (hivemind's authorizer wraps both sides, as it wraps the DHT's own RPCs)."""

    def __init__(self, protocol: DHTProtocol):
        self.protocol = protocol

    async def rpc_values(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        protocol = self.protocol
        if request.peer:  # as rpc_find does: the asker goes into our routing table
            asyncio.create_task(protocol.rpc_ping(dht_pb2.PingRequest(peer=request.peer), context))
        response = dht_pb2.FindResponse(results=[], peer=protocol.node_info)
        for key_bytes in request.keys[:MAX_VALUE_KEYS]:
            held = _held(protocol, DHTID.from_bytes(key_bytes))
            if held is None:
                response.results.append(dht_pb2.FindResult(type=dht_pb2.NOT_FOUND))
            elif isinstance(held.value, DictionaryDHTValue):
                response.results.append(dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY,
                                                           value=protocol.serializer.dumps(held.value),
                                                           expiration_time=held.expiration_time))
            else:
                response.results.append(dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=held.value,
                                                           expiration_time=held.expiration_time))
        return response

    @classmethod
    async def call(cls, protocol: DHTProtocol, peer: PeerID, key_ids: list[DHTID]) -> dict[DHTID, Any] | None:
        """``peer``'s values under ``key_ids``, checked as ``call_find`` checks them (an entry that fails its
        validators is None); None if it did not answer (it leaves our routing table, as after a failed
        ``call_find``). Raises :class:`NoValuesHandler` if ``peer`` has no such handler."""
        stub = AuthRPCWrapper(cls.get_stub(protocol.p2p, peer), AuthRole.CLIENT, protocol.authorizer,
                              service_public_key=None)
        request = dht_pb2.FindRequest(keys=[key_id.to_bytes() for key_id in key_ids], peer=protocol.node_info)
        try:
            async with protocol.rpc_semaphore:
                response = await stub.rpc_values(request, timeout=protocol.wait_timeout)
        except P2PDaemonError as e:
            if "protocols not supported" in str(e):  # libp2p's words for a peer without the handler
                raise NoValuesHandler(str(e)) from None
            _unanswered(protocol, peer, e)
            return None
        except Exception as e:
            _unanswered(protocol, peer, e)
            return None
        if response is None:  # hivemind's authorizer refused the answer
            return None
        if response.peer and response.peer.node_id:
            asyncio.create_task(protocol.update_routing_table(DHTID.from_bytes(response.peer.node_id), peer,
                                                              responded=True))
        if len(response.results) != len(key_ids):
            return None
        return {key_id: _checked(protocol, key_id, result) for key_id, result in zip(key_ids, response.results)}


def _unanswered(protocol: DHTProtocol, peer: PeerID, error: Exception) -> None:
    """A values request ``peer`` did not answer: it leaves our routing table, as after a failed ``call_find``."""
    logger.debug("no values from %s: %s: %s", peer, type(error).__name__, error)
    asyncio.create_task(protocol.update_routing_table(protocol.routing_table.get(peer_id=peer), peer, responded=False))


async def answer_values(_dht: Any, node: DHTNode) -> None:
    """(DHT process) Answer :meth:`NearestValues.rpc_values` on ``node``'s libp2p host (a server node only: a
    client is never asked)."""
    protocol = node.protocol
    if not protocol.client_mode:
        servicer = NearestValues(protocol)
        await servicer.add_p2p_handlers(protocol.p2p, AuthRPCWrapper(servicer, AuthRole.SERVICER, protocol.authorizer))


def _checked(protocol: DHTProtocol, key_id: DHTID, result: dht_pb2.FindResult) -> ValueWithExpiration[Any] | None:
    """A values answer for one key as ``call_find`` unpacks it: None unless found and passing the validators."""
    key_bytes = key_id.to_bytes()
    if result.type == dht_pb2.FOUND_REGULAR:
        if not protocol._validate_record(key_bytes, protocol.IS_REGULAR_VALUE, result.value, result.expiration_time):
            return None
        return ValueWithExpiration(result.value, result.expiration_time)
    if result.type == dht_pb2.FOUND_DICTIONARY:
        dictionary = protocol.serializer.loads(result.value)
        if not isinstance(dictionary, DictionaryDHTValue) or not protocol._validate_dictionary(key_bytes, dictionary):
            return None
        return ValueWithExpiration(dictionary, result.expiration_time)
    return None
