"""Identity files, swarm keys, the shared-secret authorizer and join-failure messages (no network)."""

from __future__ import annotations

import asyncio
import os
import stat
from concurrent.futures import Future
from pathlib import Path
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest

from p2p_diloco.net.addresses import parse_initial_peers
from p2p_diloco.net.keys import load_or_create_identity, peer_id_from_public_key
from p2p_diloco.net.nearest import store_nearest

if TYPE_CHECKING:
    from p2p_diloco.net.membership import RecordPublisher


def test_identity_created_0600_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "peer.id"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(path)
    assert again.peer_id == first.peer_id and again.key_data == first.key_data
    assert first.key_type == "ed25519" and first.peer_id.startswith("12D3KooW")  # the key is the peer id
    from p2p_diloco.net.membership import owner_peer_id, owner_subkey

    assert owner_peer_id(owner_subkey(first.private_key())) == first.peer_id  # the same key signs records
    assert len(owner_subkey(first.private_key())) == 54
    assert owner_peer_id(b"[owner:garbage]") is None and owner_peer_id(b"plain") is None
    assert owner_peer_id(b"[ed25519:" + b"A" * 43 + b"=]") is not None  # any 32 bytes are a public key's
    assert owner_peer_id(b"[ed25519:" + b"A" * 42 + b"=]") is None and owner_peer_id(b"[ed25519:x]") is None


def test_an_rsa_identity_made_before_still_loads_and_signs(tmp_path: Path, write_rsa_identity: Any) -> None:
    from p2p_diloco.net.membership import owner_peer_id, owner_subkey

    path = tmp_path / "old.id"
    write_rsa_identity(path)
    old = load_or_create_identity(path)
    assert old.key_type == "rsa" and old.peer_id.startswith("Qm")
    assert owner_peer_id(owner_subkey(old.private_key())) == old.peer_id
    assert path.read_bytes() == load_or_create_identity(path).path.read_bytes()  # never rewritten


def test_identity_refuses_open_permissions_and_garbage(tmp_path: Path) -> None:
    path = tmp_path / "peer.id"
    load_or_create_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by others.*chmod 600"):
        load_or_create_identity(path)
    junk = tmp_path / "junk.id"
    junk.write_bytes(b"\xff\x00 not a key")
    os.chmod(junk, 0o600)
    with pytest.raises(ValueError, match=r"is not a p2p-diloco/libp2p key \(Ed25519 or RSA\)"):
        load_or_create_identity(junk)
    from hivemind.proto import crypto_pb2

    from p2p_diloco.net.signing import Ed25519Key

    a, b = Ed25519Key.generate(), Ed25519Key.generate()
    mismatched = tmp_path / "mismatched.id"  # a seed with another key's public half
    mismatched.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                                 data=a.seed + b.public_bytes()).SerializeToString())
    os.chmod(mismatched, 0o600)
    with pytest.raises(ValueError, match="public key does not belong to the seed"):
        load_or_create_identity(mismatched)


def test_peer_id_from_public_key_matches_libp2p(tmp_path: Path, write_rsa_identity: Any) -> None:
    from hivemind.p2p import PeerID

    from p2p_diloco.hivemind_ext import peerids

    write_rsa_identity(tmp_path / "rsa.id")
    rsa_identity = load_or_create_identity(tmp_path / "rsa.id")
    assert PeerID.from_identity(rsa_identity.path.read_bytes()).to_base58() == rsa_identity.peer_id
    public = rsa_identity.private_key().get_public_key().to_bytes()
    assert peer_id_from_public_key(public) == rsa_identity.peer_id
    # hivemind reads RSA files only (its check that an identity is free); patched, it reads ours too
    identity = load_or_create_identity(tmp_path / "peer.id")
    peerids.install()
    peerids.install()  # idempotent
    assert PeerID.from_identity(identity.path.read_bytes()).to_base58() == identity.peer_id
    assert PeerID.from_identity(rsa_identity.path.read_bytes()).to_base58() == rsa_identity.peer_id


def test_swarm_key_file(tmp_path: Path) -> None:
    from p2p_diloco.net.keys import read_swarm_key, swarm_key_fingerprint, write_swarm_key

    path = tmp_path / "swarm.secret"
    fingerprint = write_swarm_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = read_swarm_key(path)
    assert len(secret) == 32 and swarm_key_fingerprint(secret) == fingerprint
    with pytest.raises(ValueError, match="already exists"):
        write_swarm_key(path)
    with pytest.raises(ValueError, match="file not found.*keygen"):
        read_swarm_key(tmp_path / "missing")
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        read_swarm_key(path)
    bad = tmp_path / "bad.secret"
    bad.write_text("zz\n")
    os.chmod(bad, 0o600)
    with pytest.raises(ValueError, match="not a swarm key"):
        read_swarm_key(bad)


def test_authorizer_tokens_need_the_same_secret() -> None:
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.net.authorizer import SwarmKeyAuthorizer

    a = SwarmKeyAuthorizer(b"1" * 32, RSAPrivateKey())
    b = SwarmKeyAuthorizer(b"1" * 32, RSAPrivateKey())
    outsider = SwarmKeyAuthorizer(b"2" * 32, RSAPrivateKey())
    token = asyncio.run(a.get_token())
    assert b.is_token_valid(token) and a.is_token_valid(token)
    assert not outsider.is_token_valid(token)
    forged = type(token)()
    forged.CopyFrom(token)
    forged.expiration_time = repr(float(token.expiration_time) + 1e6)  # extend it: the MAC no longer matches
    assert not b.is_token_valid(forged)
    assert not a.does_token_need_refreshing(token)


def test_join_failure_messages_are_one_line() -> None:
    from p2p_diloco.net.membership import JoinError, SwarmKeyError, SwarmOptions, explain_join_failure

    addr = "/ip4/127.0.0.1/tcp/1/p2p/QmRSLzsXh75eE8qsybQkfgAz4wHaSjHTB4uqrbmtMnpVY1"
    opts = SwarmOptions(initial_peers=parse_initial_peers([addr]))
    e = explain_join_failure(RuntimeError("Daemon failed to start: 2026/11/29 failed to connect to bootstrap peers"), opts)
    assert type(e) is JoinError and addr in str(e) and "connection refused" in str(e) and "\n" not in str(e)
    e = explain_join_failure(RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping."), opts)
    assert isinstance(e, SwarmKeyError) and "swarm key mismatch" in str(e) and "\n" not in str(e)
    e = explain_join_failure(TimeoutError(), opts)
    assert "could not join within 10 s" in str(e)


def test_status_rendering_plain_and_json() -> None:
    import json

    from p2p_diloco.net.records import LocalRun, PeerRecord, classify, tombstone
    from p2p_diloco.net.membership import SwarmSnapshot
    from p2p_diloco.net.report import render_rich, render_plain, snapshot_json

    local = LocalRun("run-a", 1, "h", "0.1.0")
    now = 1000.0
    live = PeerRecord("run-a", 1, "h", "0.1.0", "QmLive1234", "alpha", state="training", inner_step=7, tokens=512,
                      tokens_per_s=64.0, fragment_versions=(2, 2), loss=3.25, time=now - 1)
    left = tombstone(PeerRecord("run-a", 1, "h", "0.1.0", "QmLeft5678", "beta", time=now - 30), now - 20)
    alien = PeerRecord("run-a", 1, "other", "0.1.0", "QmAlien999", "gamma", time=now - 1)
    views = classify([(live, now + 20), (left, now + 500), (alien, now + 20)], local, now)
    snap = SwarmSnapshot(now, local, tuple(views), {"run-a": 2, "run-b": 1})
    data = json.loads(json.dumps(snapshot_json(snap, {"import": 1.0})))
    assert data["summary"]["live"] == 1 and data["runs"] == {"run-a": 2, "run-b": 1}
    text = render_plain(data)
    assert "alpha" in text and "training" in text and "3.250" in text and "2,2" in text
    assert "left: beta (Left5678) 20s ago" in text
    assert "foreign: gamma" in text and "config hash differs" in text
    assert "other runs in this DHT: run-b (1 peers)" in text
    assert render_rich(data) is not None


def test_status_at_sixteen_peers_is_one_line_each_in_name_order_and_a_summary() -> None:
    """Issue 22 asks that ``status`` stay readable past a handful of peers: one line per peer (l2 before l10),
    one summary line, and ``--json`` of the same shape as with three."""
    import json

    from p2p_diloco.net.records import LocalRun, PeerRecord, classify
    from p2p_diloco.net.membership import SwarmSnapshot
    from p2p_diloco.net.report import render_plain, snapshot_json

    local, now = LocalRun("run-a", 1, "h", "0.1.0"), 1000.0

    def shown(n: int) -> dict[str, object]:
        records = [(PeerRecord("run-a", 1, "h", "0.1.0", f"QmPeer{i:04d}", f"l{i}", state="training", inner_step=i,
                               tokens=512 * i, tokens_per_s=64.0, fragment_versions=(12, 11), loss=2.5, time=now - 1),
                    now + 20) for i in reversed(range(n))]
        snap = SwarmSnapshot(now, local, tuple(classify(records, local, now)), {"run-a": n})
        return json.loads(json.dumps(snapshot_json(snap, {"import": 1.0})))

    data = shown(16)
    lines = render_plain(data).splitlines()
    rows = [line.split()[0] for line in lines[1:] if line.startswith("l")]
    assert rows == [f"l{i}" for i in range(16)], rows
    assert len(lines) == 1 + 16 + 1 and lines[-1].startswith("run run-a: 16 live peers"), lines[-1]
    small = shown(3)
    assert data.keys() == small.keys() and data["summary"].keys() == small["summary"].keys()  # type: ignore[union-attr]
    assert [p.keys() for p in data["peers"]] == [small["peers"][0].keys()] * 16  # type: ignore[index,union-attr]


class _FlakyDHT:
    """A DHT whose first ``refusals`` stores are refused (their futures hold False), then accepted."""

    def __init__(self, refusals: int):
        self.refusals, self.calls = refusals, 0

    def run_coroutine(self, coro: partial[object], return_future: bool = False) -> Future[bool]:
        """What :func:`p2p_diloco.net.membership.store` hands the DHT process: a store of ``coro.args[0]``."""
        assert coro.func is store_nearest and return_future, coro
        self.calls += 1
        fut: Future[bool] = Future()
        fut.set_result(self.calls > 2 * self.refusals)  # two stores (record + index) per attempt
        return fut


def _publisher(dht: object, tmp_path: Path) -> RecordPublisher:
    from p2p_diloco.net.records import PeerRecord
    from p2p_diloco.net.membership import RecordPublisher

    key = load_or_create_identity(tmp_path / "p.id").private_key()
    record = PeerRecord(run_id="r", protocol_version=1, config_hash="h", software_version="0.1.0",
                        peer_id="QmX", name="p", addresses=(), state="idle")
    return RecordPublisher(dht, key, record, ttl_s=3.0)  # type: ignore[arg-type]


def test_publish_within_retries_a_refused_first_store(tmp_path: Path) -> None:
    dht = _FlakyDHT(refusals=2)
    pub = _publisher(dht, tmp_path)
    assert pub.publish_within(deadline_s=10.0, retry_interval_s=0.01)
    assert pub.failures == 2 and dht.calls == 6


def test_publish_within_gives_up_at_its_deadline(tmp_path: Path) -> None:
    dht = _FlakyDHT(refusals=10**6)
    pub = _publisher(dht, tmp_path)
    assert not pub.publish_within(deadline_s=0.2, retry_interval_s=0.05)
    assert 1 <= pub.failures <= 5



class _RecordDHT(_FlakyDHT):
    """A DHT that accepts every store and counts those of peer records (``records``), index entries aside."""

    def __init__(self) -> None:
        super().__init__(refusals=0)
        self.records = 0

    def run_coroutine(self, coro: partial[object], return_future: bool = False) -> Future[bool]:
        from p2p_diloco.net.records import INDEX_KEYS

        self.records += coro.args[0] not in INDEX_KEYS
        return super().run_coroutine(coro, return_future)


def test_the_keep_alive_refreshes_the_record_until_it_hands_over_and_again_after(tmp_path: Path) -> None:
    """A joined Swarm's record keep-alive (issue 49: a Swarm alone let its record lapse until DiLoCo.start): it
    publishes every ttl/3 s, nothing while the status thread it handed over to runs, and again once that ends."""
    import threading
    import time

    dht = _RecordDHT()
    pub = _publisher(dht, tmp_path)  # ttl 3 s: a heartbeat every 1 s
    pub.start()
    try:
        time.sleep(2.5)
        assert 2 <= dht.records <= 3, dht.records  # at 0, 1 and 2 s (a busy machine may be late)
        done = threading.Event()
        status = threading.Thread(target=done.wait)
        pub.hand_over(status)
        status.start()
        pub.publish()  # the status thread's own heartbeat
        during = dht.records
        time.sleep(2.5)
        assert dht.records == during  # two periods: the keep-alive stored nothing beside it
        done.set()
        status.join()
        time.sleep(1.6)  # a period after the last publish, and the keep-alive's look at the thread
        assert dht.records > during
    finally:
        pub.stop()
    stopped = dht.calls
    time.sleep(1.2)
    assert dht.calls == stopped
