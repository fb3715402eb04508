"""Peer records: wire format, the schema + signature every node enforces, and the pure decisions
(compatibility, live/left/foreign classification with a fake clock, join check, summary)."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable

import pytest

from p2p_diloco.net.records import (
    INDEX_KEYS, RECORD_SHARDS, IndexEntry, LocalRun, PeerRecord, adopt_majority, check_join, classify, index_key,
    is_compatible, merge_index, record_shard, run_key, run_keys, tombstone,
)
from p2p_diloco.net.report import summarize

LOCAL = LocalRun("run-a", 1, "hash-a", "0.1.0")
NOW = 1_000_000.0


def rec(name: str, **kw: Any) -> PeerRecord:
    base = dict(run_id="run-a", protocol_version=1, config_hash="hash-a", software_version="0.1.0",
                peer_id=f"Qm{name}", name=name, state="training", time=NOW - 1, tokens=100, tokens_per_s=10.0,
                fragment_versions=(3, 3))
    base.update(kw)
    return PeerRecord(**base)


# ---------------------------------------------------------------- wire format


def test_wire_roundtrip_and_nan_loss() -> None:
    r = rec("a", loss=2.5, addresses=("/ip4/127.0.0.1/tcp/1/p2p/Qma",), last_sync_time=5.0,
            anchor_hashes=("0123456789abcdef", "fedcba9876543210"), consensus_distance=(0.0, 0.25))
    assert PeerRecord.from_wire(r.to_wire()) == r
    wire = rec("a", loss=float("nan")).to_wire()
    assert wire["loss"] is None  # NaN != NaN would make every node reject the record
    assert all(not isinstance(k, int) for k in wire)


def test_a_record_without_a_sync_link_time_is_valid_and_unmeasured() -> None:
    wire = rec("a", sync_link_s=12.5).to_wire()
    assert PeerRecord.from_wire(wire).sync_link_s == 12.5
    del wire["sync_link_s"]  # a peer of the release before it
    assert PeerRecord.from_wire(wire).sync_link_s == 0.0


@pytest.mark.parametrize("change", [
    {"tokens": 1.0}, {"tokens": "1"}, {"tokens": -1}, {"tokens_per_s": 1}, {"state": "bogus"},
    {"fragment_versions": ["1"]}, {"fragment_versions": {0: 1}}, {"name": "x" * 65}, {"extra": 1},
    {"loss": float("inf")}, {"ttl_s": 0.0}, {"sync_link_s": -1.0}, {"sync_link_s": float("nan")}, {"anchor_hashes": ["XYZ"]}, {"anchor_hashes": ["0" * 17]},
    {"consensus_distance": [-1.0]}, {"consensus_distance": [float("nan")]},
])
def test_from_wire_is_strict(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="invalid peer record"):
        PeerRecord.from_wire({**rec("a").to_wire(), **change})


# ---------------------------------------------------------------- compatibility and classification


def test_is_compatible_reasons() -> None:
    assert is_compatible(rec("a"), LOCAL) == (True, "")
    ok, why = is_compatible(rec("a", config_hash="hash-b"), LOCAL)
    assert not ok and "config hash differs: theirs hash-b, ours hash-a" in why
    ok, why = is_compatible(rec("a", protocol_version=2), LOCAL)
    assert not ok and "protocol version differs" in why
    ok, why = is_compatible(rec("a", run_id="run-b"), LOCAL)
    assert not ok and "run id differs" in why
    ok, why = is_compatible(rec("a", software_version="0.2.0"), LOCAL)
    assert ok and "software version differs" in why


def test_classify_with_fake_clock() -> None:
    entries = [
        (rec("live"), NOW + 2),
        (tombstone(rec("gone"), NOW - 0.5), NOW + 600),
        (rec("alien", config_hash="hash-b"), NOW + 2),
        (rec("stale"), NOW - 0.1),  # a cache may return it after its expiration
    ]
    views = {v.record.name: v for v in classify(entries, LOCAL, NOW)}
    assert {n: v.status for n, v in views.items()} == {"live": "live", "gone": "left", "alien": "foreign",
                                                      "stale": "expired"}
    assert "config hash differs" in views["alien"].reason
    # the same records a few seconds later: the live one expired (kill -9: no refresh)
    later = {v.record.name: v.status for v in classify(entries, LOCAL, NOW + 3)}
    assert later["live"] == "expired" and later["gone"] == "left"


def test_classify_keeps_newest_record_per_peer() -> None:
    old, new = rec("a", time=NOW - 10, tokens=1), rec("a", time=NOW - 1, tokens=2)
    [view] = classify([(new, NOW + 5), (old, NOW + 5)], LOCAL, NOW)
    assert view.record.tokens == 2


def test_merge_index_adds_other_runs_as_foreign() -> None:
    views = classify([(rec("a"), NOW + 5)], LOCAL, NOW)
    index = classify([(IndexEntry.of(rec("a")), NOW + 5), (IndexEntry.of(rec("b", run_id="run-b")), NOW + 5)],
                     LOCAL, NOW)
    merged = merge_index(views, index)
    assert [(v.record.name, v.status, type(v.record).__name__) for v in merged] == [
        ("a", "live", "PeerRecord"), ("b", "foreign", "IndexEntry")]


def test_check_join() -> None:
    me = LOCAL
    alone = classify([], me, NOW)
    assert check_join(alone, me, "Qmme") == (True, "")
    others = classify([(rec("a", config_hash="hash-b"), NOW + 5), (rec("b", config_hash="hash-b"), NOW + 5)], me, NOW)
    ok, why = check_join(others, me, "Qmme")
    assert not ok
    assert why == ("refused by run 'run-a': config hash differs: ours hash-a, the run's hash-b (2 of 2 live peers); "
                   "start with the run's config (same --config/--set as its peers) or choose another run.run_id")
    ok, why = check_join(classify([(rec("a", protocol_version=2), NOW + 5)], me, NOW), me, "Qmme")
    assert not ok and "protocol version differs: ours 1, the run's 2" in why
    # one compatible live peer is enough; departed and other-run peers do not count
    mixed = classify([(rec("a", config_hash="hash-b"), NOW + 5), (rec("b"), NOW + 5)], me, NOW)
    assert check_join(mixed, me, "Qmme")[0]
    gone = classify([(tombstone(rec("a", config_hash="hash-b"), NOW), NOW + 600)], me, NOW)
    assert check_join(gone, me, "Qmme")[0]
    other_run = classify([(IndexEntry.of(rec("a", run_id="run-b")), NOW + 5)], me, NOW)
    assert check_join(other_run, me, "Qmme")[0]
    # our own (previous) record does not vote
    assert check_join(classify([(rec("me", config_hash="hash-b"), NOW + 5)], me, NOW), me, "Qmme")[0]


def test_adopt_majority_for_observers() -> None:
    observer = LocalRun("run-a", 1, "", "0.1.0")
    records = [rec("a", config_hash="x"), rec("b", config_hash="x"), rec("c", config_hash="y")]
    assert adopt_majority(observer, records).config_hash == "x"
    assert adopt_majority(LOCAL, records) is LOCAL
    assert adopt_majority(observer, []) is observer


def test_summarize() -> None:
    entries = [
        (rec("a", fragment_versions=(3, 4), tokens=100, tokens_per_s=10.0), NOW + 5),
        (rec("b", fragment_versions=(3, 3), tokens=50, tokens_per_s=5.0, state="averaging"), NOW + 5),
        (rec("c", fragment_versions=(3, 4), tokens=10, tokens_per_s=1.0), NOW + 5),
        (tombstone(rec("d"), NOW - 2), NOW + 600),
        (rec("e", config_hash="hash-b"), NOW + 5),
    ]
    s = summarize(classify(entries, LOCAL, NOW), "run-a")
    assert (s.live, s.tokens, s.tokens_per_s) == (3, 160, 16.0)
    assert [(f.top_version, f.agreeing, f.versions) for f in s.fragments] == [
        (3, 3, {"3": 3}), (4, 2, {"3": 1, "4": 2})]
    assert s.consensus is None  # no anchor hash published
    assert s.states == {"training": 2, "averaging": 1}
    assert s.left == (("d", "Qmd", NOW - 2),)
    assert [name for name, _, _ in s.foreign] == ["e"]
    # a fork: same versions, two anchors for fragment 1 -> no consensus, and the distance is shown
    forked = [(rec(n, fragment_versions=(3, 4), anchor_hashes=("aa", h), consensus_distance=(0.0, d)), NOW + 5)
              for n, h, d in (("a", "b1", 0.0), ("b", "b1", 0.0), ("c", "c2", 0.03))]
    s = summarize(classify(forked, LOCAL, NOW), "run-a")
    assert [(f.anchors, f.distance) for f in s.fragments] == [(1, 0.0), (2, 0.03)] and s.consensus is False
    healed = [(rec(n, fragment_versions=(3, 4), anchor_hashes=("aa", "b1")), NOW + 5) for n in "abc"]
    assert summarize(classify(healed, LOCAL, NOW), "run-a").consensus is True
    empty = summarize([], "run-a")
    assert empty.live == 0 and empty.consensus is None and empty.fragments == ()


def test_keys_are_sharded_by_peer_id() -> None:
    """A peer's record and index entry live in its shard's keys (a store is answered with one shard, not the
    whole swarm); the shard is a stable hash of its peer id, and peer ids spread over every shard."""
    assert run_keys("run-a") == tuple(f"p2p-diloco.run.run-a_peers_{s}" for s in range(RECORD_SHARDS))
    assert INDEX_KEYS == tuple(f"p2p-diloco_runs_{s}" for s in range(RECORD_SHARDS))
    shard = record_shard("QmAlice")
    assert run_key("run-a", "QmAlice") == f"p2p-diloco.run.run-a_peers_{shard}" and record_shard("QmAlice") == shard
    assert index_key("QmAlice") == f"p2p-diloco_runs_{shard}"
    assert {record_shard(f"Qm{i}") for i in range(400)} == set(range(RECORD_SHARDS))


# ---------------------------------------------------------------- what every DHT node enforces (no network)


@pytest.fixture(scope="module")
def dht_tools() -> dict[str, Any]:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator, DHTRecord
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.net.records import RSA_OWNER_RE, peer_schemas
    from p2p_diloco.net.signing import Ed25519Key

    assert RSA_OWNER_RE.pattern.replace(b"^", b"").replace(b"$", b"") == RSASignatureValidator.PUBLIC_KEY_REGEX
    return dict(RSASignatureValidator=RSASignatureValidator, ser=DHTProtocol.serializer, DHTID=DHTID,
                CompositeValidator=CompositeValidator, DHTRecord=DHTRecord, peer_schemas=peer_schemas,
                rsa=RSAPrivateKey, ed25519=Ed25519Key.generate)


@pytest.mark.parametrize("kind,node_kind", [("rsa", "rsa"), ("ed25519", "ed25519"), ("rsa", "ed25519"),
                                            ("ed25519", "rsa")])
def test_every_node_rejects_forged_and_malformed_records(dht_tools: dict[str, Any], sign_record: Callable[..., Any],
                                                         kind: str, node_kind: str) -> None:
    """Owners with either kind of key, checked by a node with either kind (every node runs both validators)."""
    from p2p_diloco.net.signing import signature_validators

    t = dht_tools
    signed = functools.partial(sign_record, now=NOW)
    alice, mallory = t[kind](), t[kind]()
    node = t["CompositeValidator"]([*signature_validators(t[node_kind]()), *t["peer_schemas"]("run-a")])
    good = rec("alice").to_wire()
    key = run_key("run-a", "Qmalice")

    assert node.validate(signed(t, alice, alice, key, good))
    for other in run_keys("run-a"):  # any shard validates (readers read them all)
        assert node.validate(signed(t, alice, alice, other, good))
    assert node.validate(signed(t, alice, alice, index_key("Qmalice"), IndexEntry.of(rec("alice")).to_wire()))
    # another peer's subkey: signed by the wrong key, or not signed at all
    assert not node.validate(signed(t, mallory, alice, key, good))
    unsigned = signed(t, alice, alice, key, good)
    assert not node.validate(replace(unsigned, value=t["ser"].dumps(good)))
    # the owner's own subkey but wrong types / unknown state / extra field / bad subkey shape
    for bad in ({**good, "tokens": "lots"}, {**good, "tokens_per_s": 1}, {**good, "state": "hacking"},
                {**good, "admin": True}, "not a dict"):
        assert not node.validate(signed(t, mallory, mallory, key, bad)), bad
    assert not node.validate(signed(t, mallory, mallory, INDEX_KEYS[0], {**IndexEntry.of(rec("m")).to_wire(), "time": 1}))
    plain_subkey = t["DHTRecord"](key=t["DHTID"].generate(source=key).to_bytes(), subkey=t["ser"].dumps(b"mallory"),
                                  value=t["ser"].dumps(good), expiration_time=NOW + 30)
    assert not node.validate(plain_subkey)


def test_the_index_entry_is_stored_when_it_changes_or_once_a_record_ttl_has_passed() -> None:
    from p2p_diloco.net.membership import index_due

    entry = IndexEntry.of(rec("alice"))
    assert index_due(100.0, None, entry, 10.0)  # the first publish
    sent = (100.0, replace(entry, time=0.0))
    assert not index_due(103.3, sent, replace(entry, time=103.3), 10.0)  # a heartbeat: only the time moved
    assert not index_due(109.9, sent, entry, 10.0)
    assert index_due(110.0, sent, entry, 10.0)  # a record TTL later (the entry lives three)
    assert index_due(101.0, sent, replace(entry, state="leaving"), 10.0)  # what it says changed
