"""Private swarm end to end (real hivemind on 127.0.0.1, in-process): two swarms with different keys
share a machine, a run id and therefore every DHT key and averager prefix; outsiders who know a
member's full address call its DHT and averaging handlers directly; clocks that are off refuse the join.

Swarm A: ``a1`` (member, state donor, checks membership), ``a2`` (member). Swarm B: ``b1`` (a member of B,
same run id and config, B's key). Outsider ``o``: no key at all (a standalone open DHT).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from p2p_diloco.core.config import load_config

NAMES = ("blocks.0.fc.weight", "blocks.1.fc.weight")
SHAPES = {n: torch.Size([8, 4]) for n in NAMES}
CFG = load_config(None, ["run.run_id=private", "model.n_layer=2", "outer.fragments=2", "averaging.window_s=1.0",
                         "averaging.state_timeout_s=10.0"])
RPC_TIMEOUT_S = 10.0
"""Bound on each probe RPC (the refusals come back in well under a second)."""


# ---------------------------------------------------------------- pure: the clock-skew error and verdict


def test_clock_skew_error_is_one_line_with_the_measured_offset() -> None:
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.net.membership import (
        ClockSkewError, SwarmOptions, clock_skew_in, explain_join_failure, skew_verdict,
    )

    peer = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWQ6Zc23k8dddq4G2yn3dL546juChnAjDXrbZH89Q1ZH6h"
    opts = SwarmOptions(initial_peers=parse_initial_peers([peer]))
    # hivemind's text, verbatim (double space included), as the DHT process raises it
    hivemind = ("hivemind.dht.protocol.ValidationError: local time must be within 3 seconds  of others"
                "(local: {local:.5f}, peer: {peer:.5f})")
    for local, theirs, words in ((1795998680.5, 1795998670.25, "10.2 s ahead of"), (1000.0, 1120.0, "120.0 s behind")):
        assert clock_skew_in(hivemind.format(local=local, peer=theirs)) == pytest.approx(local - theirs)
        e = explain_join_failure(RuntimeError("Traceback …\n" + hivemind.format(local=local, peer=theirs)), opts)
        assert type(e) is ClockSkewError and "\n" not in str(e)
        assert str(e).startswith(f"could not join: clock skew above 3 s: our clock is {words} an initial peer")
        assert peer in str(e) and "NTP" in str(e)
    assert clock_skew_in("local time must be within 3 seconds") is None
    unparsed = explain_join_failure(RuntimeError("local time must be within 3 seconds of others"), opts)
    assert type(unparsed) is ClockSkewError and "local time must be within 3 seconds" in str(unparsed)
    assert [skew_verdict(s) for s in (0.0, -1.0, 1.5, -2.9, 3.0, -3.5, 120.0)] == [True, True, None, None, False,
                                                                                  False, False]


# ---------------------------------------------------------------- swarms


@dataclass(frozen=True)
class Probe:
    """(runs in a DHT process, as that peer) call ``target``'s DHT and averaging handlers directly."""

    target: str
    maddrs: tuple[str, ...]
    prefix: str
    run_key: str
    state_only: bool = False

    async def __call__(self, _dht: Any, node: Any) -> dict[str, Any]:
        import asyncio
        from asyncio import IncompleteReadError

        from hivemind.dht.routing import DHTID
        from hivemind.p2p import PeerID
        from hivemind.proto import averaging_pb2
        from hivemind.utils import get_dht_time
        from hivemind.utils.asyncio import aiter_with_timeout, as_aiter
        from hivemind.utils.multiaddr import Multiaddr

        from p2p_diloco.averaging.process import FragmentAveragerProcess

        pid = PeerID.from_base58(self.target)
        await node.p2p._client.connect(pid, [Multiaddr(m) for m in self.maddrs])  # hivemind has no public dial
        stub = FragmentAveragerProcess.get_stub(node.p2p, pid, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        out: dict[str, Any] = {"state_messages": len([m async for m in aiter_with_timeout(stream, RPC_TIMEOUT_S)])}
        if self.state_only:
            return out
        join = await stub.rpc_join_group(averaging_pb2.JoinRequest(
            schema_hash=b"", expiration=get_dht_time() + 5, group_key=f"{self.prefix}.0b00000000"))
        out["join"] = [averaging_pb2.MessageCode.Name(m.code) async for m in aiter_with_timeout(join, RPC_TIMEOUT_S)]
        parts = as_aiter(averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"guess"))
        out["parts"] = []
        try:  # a handler that refuses closes the stream without reading ours: our side may see it broken
            async for m in aiter_with_timeout(await stub.rpc_aggregate_part(parts), RPC_TIMEOUT_S):
                out["parts"].append(averaging_pb2.MessageCode.Name(m.code))
        except (BrokenPipeError, ConnectionResetError, IncompleteReadError) as e:
            out["parts"].append(f"closed: {type(e).__name__}")
        key = DHTID.generate(source=self.run_key)
        out["dht_find"] = await asyncio.wait_for(node.protocol.call_find(pid, [key]), RPC_TIMEOUT_S)
        out["dht_store"] = await asyncio.wait_for(
            node.protocol.call_store(pid, [key], [b"forged"], [get_dht_time() + 60]), RPC_TIMEOUT_S)
        return out


@dataclass(frozen=True)
class Neighbours:
    """(runs in a DHT process) peer ids in this node's routing table, and those libp2p is connected to."""

    async def __call__(self, _dht: Any, node: Any) -> tuple[set[str], set[str]]:
        table = {p.to_base58() for p in node.protocol.routing_table.peer_id_to_uid}
        return table, {info.peer_id.to_base58() for info in await node.p2p.list_peers()}


@pytest.fixture(scope="module")
def swarms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.averaging.host import FragmentAveragerHost
    from p2p_diloco.averaging.transfer import state_payload
    from p2p_diloco.net.keys import load_or_create_identity, read_swarm_key, write_swarm_key
    from p2p_diloco.net.records import LocalRun, PeerRecord
    from p2p_diloco.net.membership import Membership, RecordPublisher, SwarmOptions, start_dht, visible_addresses

    tmp = tmp_path_factory.mktemp("private")
    keys = {}
    for swarm in ("a", "b"):
        write_swarm_key(tmp / f"{swarm}.secret")
        keys[swarm] = read_swarm_key(tmp / f"{swarm}.secret")
    local = LocalRun.from_config(CFG)
    log_path = tmp / "member-a1.log"  # a1's averager process (forked) logs its refusals here
    handler = logging.FileHandler(log_path)
    handler.setLevel(logging.WARNING)
    averaging_log = logging.getLogger("p2p_diloco.averaging")
    averaging_log.addHandler(handler)
    dhts: dict[str, Any] = {}
    averagers: list[FragmentAveragerHost] = []
    try:
        for name, swarm in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("o", None)):
            identity = load_or_create_identity(tmp / f"{name}.id")
            first = dhts.get(f"{swarm}1")
            initial = parse_initial_peers(visible_addresses(first)[:1]) if first is not None else ()
            opts = SwarmOptions(initial_peers=initial, identity=identity, check_identity_free=False,
                                swarm_key=keys[swarm] if swarm else None)
            dhts[name] = dht = start_dht(opts, CFG.run.run_id, private_key=identity.private_key())
            if swarm is not None:  # a member of its swarm: a live record of the run (the same run id in A and B)
                record = PeerRecord(run_id=local.run_id, protocol_version=local.protocol_version,
                                    config_hash=local.config_hash, software_version=local.software_version,
                                    peer_id=dht.peer_id.to_base58(), name=name, state="training",
                                    addresses=tuple(visible_addresses(dht)))
                assert RecordPublisher(dht, identity.private_key(), record, ttl_s=120.0).publish_within(30.0)
            if name == "a1":
                state = state_payload(0, 1, {n: torch.ones(SHAPES[n]) for n in NAMES}, {}, NAMES)
                averagers.append(FragmentAveragerHost(CFG, 0, NAMES, SHAPES, dht, identity.private_key(),
                                                   membership=Membership(dht, local), state_provider=lambda state=state: state))
        yield SimpleNamespace(dhts=dhts, a1=averagers[0], log_path=log_path, keys=keys)
    finally:
        averaging_log.removeHandler(handler)
        handler.close()
        for averager in averagers:
            averager.shutdown()
        for dht in dhts.values():
            dht.shutdown()


@contextlib.contextmanager
def clock_off_by(offset_s: float) -> Iterator[None]:
    """hivemind's DHT time (``get_dht_time``, bound by name in many modules) runs ``offset_s`` ahead in this
    process and in the DHT processes forked inside the block; restored on exit (forked ones keep it)."""
    from hivemind.utils import timed_storage

    original = timed_storage.get_dht_time

    def skewed() -> float:
        return original() + offset_s

    patched = [m for m in list(sys.modules.values()) if getattr(m, "get_dht_time", None) is original]
    for module in patched:
        module.get_dht_time = skewed  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in patched:
            module.get_dht_time = original  # type: ignore[attr-defined]
