"""The run that is there: which run a peer without a config picks, the config record's schema and size
cap, the hash check of a fetched config, and the status / consensus fixes that go with it (pure: no
network, a fake clock)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest

from p2p_diloco.core.config import ConfigError, load_config, load_config_data
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.identity import pin_data
from p2p_diloco.net.records import (
    ANNOUNCE_STATE, MAX_CONFIG_CHARS, IndexEntry, LocalRun, PeerRecord, RunConfigRecord, classify, config_key,
    merge_index, tombstone,
)
from p2p_diloco.net.report import config_mismatch, summarize
from p2p_diloco.net.runs import RunInfo, pick_run, primary_run, runs_in_index
from p2p_diloco.core.rejects import Reason
from p2p_diloco.net.runconfig import config_from_record, config_from_records, config_record, config_text

NOW = 1_000_000.0
TINY_PATH = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
TINY = load_config(TINY_PATH)
TINY_HASH = config_hash(TINY)


def entry(name: str, run_id: str = "tiny", state: str = "training", config_hash: str = "h1", time: float = NOW - 1,
          peer_id: str | None = None) -> IndexEntry:
    return IndexEntry(run_id=run_id, protocol_version=1, config_hash=config_hash, software_version="0.1.0",
                      peer_id=peer_id or f"Qm{name}", name=name, state=state, time=time)


def rec(name: str, **kw: Any) -> PeerRecord:
    base = dict(run_id="run-a", protocol_version=1, config_hash="hash-a", software_version="0.1.0",
                peer_id=f"Qm{name}", name=name, state="training", time=NOW - 1, fragment_versions=(3, 3))
    base.update(kw)
    return PeerRecord(**base)


# ---------------------------------------------------------------- which runs are there, which one to pick


def test_runs_in_index_counts_members_bootstraps_and_departures() -> None:
    entries = [
        (entry("a"), NOW + 5), (entry("b", config_hash="h2"), NOW + 5), (entry("c", config_hash="h2"), NOW + 5),
        (entry("boot", state=ANNOUNCE_STATE, config_hash="h0"), NOW + 5),
        (entry("gone", state="left"), NOW + 500),
        (entry("stale"), NOW - 1),  # expired: counts nowhere
        (entry("x", run_id="other"), NOW + 5),
        (entry("restarted", run_id="other", time=NOW - 50), NOW + 5),
        (entry("restarted", run_id="other", state="left", time=NOW - 2), NOW + 500),  # newest per peer id wins
        (entry("b2", run_id="empty", state=ANNOUNCE_STATE), NOW + 5),
    ]
    runs = runs_in_index(entries, NOW)
    assert [r.run_id for r in runs] == ["tiny", "other", "empty"]  # live first, then announced
    tiny, other, empty = runs
    assert (tiny.live, tiny.announced, tiny.left) == (3, 1, 1)
    assert tiny.config_hashes == {"h1": 1, "h2": 2} and tiny.config_hash == "h2"  # the live members' majority
    assert (other.live, other.left) == (1, 1)
    assert (empty.live, empty.announced, empty.config_hash, empty.visible) == (0, 1, "h1", True)
    assert tiny.describe() == "tiny (3 live, announced by a bootstrap, 1 left)"
    assert empty.describe() == "empty (0 live, announced by a bootstrap)"
    assert json.loads(json.dumps(tiny.to_json()))["config_hash"] == "h2"


def test_pick_run_takes_the_only_live_or_announced_run() -> None:
    live_a = RunInfo("a", live=3, config_hashes={"h": 3})
    live_b = RunInfo("b", live=1, config_hashes={"h": 1})
    announced_c = RunInfo("c", announced=1, announced_hashes={"h": 1})
    announced_d = RunInfo("d", announced=1, announced_hashes={"h": 1})
    departed = RunInfo("e", left=2)
    assert pick_run([announced_c, live_a, departed]) is live_a  # a live run beats an announced one
    assert pick_run([announced_c, departed]) is announced_c
    with pytest.raises(ValueError) as several:
        pick_run([live_b, live_a, announced_c])
    assert str(several.value) == ("runs in this DHT: a (3 live), b (1 live), c (0 live, announced by a bootstrap); "
                                  "pick one with --run-id ID or --config FILE")
    with pytest.raises(ValueError, match=r"^runs in this DHT: c \(0 live, announced by a bootstrap\), d "):
        pick_run([announced_c, announced_d])
    with pytest.raises(ValueError) as none:
        pick_run([departed])
    assert "no run in this DHT" in str(none.value) and "e (0 live, 2 left)" in str(none.value)
    assert "--config FILE" in str(none.value) and "\n" not in str(none.value)
    with pytest.raises(ValueError, match="^no run in this DHT: no live peer and no bootstrap announces one; pass"):
        pick_run([])
    # --run-id: that run, whatever the others; a run that is not there is one line listing those that are
    assert pick_run([live_a, live_b], "b") is live_b
    assert pick_run([departed], "e") is departed
    with pytest.raises(ValueError, match=r"^--run-id zzz: no such run in this DHT \(runs in this DHT: a \(3 live\)\)"):
        pick_run([live_a], "zzz")


def test_primary_run_is_the_live_run_with_most_peers() -> None:
    runs = [RunInfo("c", announced=1), RunInfo("b", live=1), RunInfo("a", live=4), RunInfo("z", left=1)]
    assert primary_run(runs).run_id == "a"  # type: ignore[union-attr]
    assert primary_run([RunInfo("z", left=1), RunInfo("c", announced=1)]).run_id == "c"  # type: ignore[union-attr]
    assert primary_run([RunInfo("z", left=1)]).run_id == "z"  # type: ignore[union-attr]  # its tombstones
    assert primary_run([]) is None


# ---------------------------------------------------------------- the config record: wire, schema, size cap


def test_config_record_roundtrip_and_strict_parse() -> None:
    r = config_record(TINY, "QmBoot", NOW)
    assert r.config == config_text(TINY) and r.config_hash == TINY_HASH and r.run_id == "tiny"
    assert RunConfigRecord.from_wire(r.to_wire()) == r
    assert len(r.config) < MAX_CONFIG_CHARS // 8  # room to spare for bigger configs
    for change in ({"config": 1}, {"time": 1}, {"extra": 1}, {"config_hash": "x" * 65}, {"run_id": 3}):
        with pytest.raises(ValueError, match="invalid config record"):
            RunConfigRecord.from_wire({**r.to_wire(), **change})
    with pytest.raises(ValueError, match="invalid config record") as oversize:
        RunConfigRecord.from_wire({**r.to_wire(), "config": "x" * (MAX_CONFIG_CHARS + 1)})
    assert oversize.value.reason is Reason.OVERSIZE  # type: ignore[attr-defined]


def test_every_node_enforces_the_config_record_and_the_bootstrap_state(sign_record: Callable[..., Any]) -> None:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator, DHTRecord
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.net.records import INDEX_KEYS, peer_schemas, run_keys
    signed = functools.partial(sign_record, now=NOW)  # signs a record as its owner (or a forger) would

    t = dict(RSASignatureValidator=RSASignatureValidator, ser=DHTProtocol.serializer, DHTID=DHTID, DHTRecord=DHTRecord)
    alice = RSAPrivateKey()
    node = CompositeValidator([RSASignatureValidator(RSAPrivateKey()), *peer_schemas("tiny")])
    good = config_record(TINY, "QmAlice", NOW).to_wire()
    key = config_key("tiny")
    assert key == "p2p-diloco.run.tiny_config"
    assert node.validate(signed(t, alice, alice, key, good))
    assert not node.validate(signed(t, alice, alice, key, {**good, "config": "x" * (MAX_CONFIG_CHARS + 1)}))
    assert not node.validate(signed(t, alice, alice, key, {**good, "time": 1}))
    assert not node.validate(signed(t, alice, alice, key, {**good, "admin": True}))
    # a bootstrap's announcement is a valid index entry, but no peer record may claim that state
    announcement = entry("boot", state=ANNOUNCE_STATE, peer_id="QmAlice").to_wire()
    assert node.validate(signed(t, alice, alice, INDEX_KEYS[0], announcement))
    assert not node.validate(signed(t, alice, alice, run_keys("tiny")[0], rec("a", state=ANNOUNCE_STATE).to_wire()))
    with pytest.raises(ValueError, match="invalid peer record"):
        PeerRecord.from_wire(rec("a", state=ANNOUNCE_STATE).to_wire())
    assert IndexEntry.from_wire(announcement).announces


# ---------------------------------------------------------------- the fetched config: validated, hash verified


def tiny_run(**kw: Any) -> RunInfo:
    return RunInfo("tiny", live=2, config_hashes={TINY_HASH: 2}, **kw)


def test_fetched_config_is_verified_and_overrides_apply_on_top() -> None:
    honest = config_record(TINY, "QmHonest", NOW - 10)
    cfg, chosen = config_from_records([(honest, NOW + 100)], tiny_run(), NOW)
    # the fetched config pins the publisher's data (fingerprint, tokenizer hash): same hash, checked locally
    assert cfg == pin_data(TINY) and chosen == honest and config_hash(cfg) == TINY_HASH
    assert cfg.data.fingerprint and cfg.data.tokenizer_hash == "bytes"
    with_set, _ = config_from_records([(honest, NOW + 100)], tiny_run(), NOW, ["outer.lr=0.6"])
    assert with_set.outer.lr == 0.6 and with_set == pin_data(load_config(TINY_PATH, ["outer.lr=0.6"]))
    with pytest.raises(ConfigError, match="^outer.lrr: unknown key"):  # our own --set's error names its key
        config_from_records([(honest, NOW + 100)], tiny_run(), NOW, ["outer.lrr=0.5"])


def test_a_config_whose_hash_differs_is_refused() -> None:
    other = load_config(TINY_PATH, ["outer.lr=0.6"])
    # a record that claims the run's hash but holds another config
    forged = replace(config_record(other, "QmMallory", NOW), config_hash=TINY_HASH)
    with pytest.raises(ValueError) as refused:
        config_from_records([(forged, NOW + 100)], tiny_run(), NOW)
    line = str(refused.value)
    assert line.startswith("refused the config of run tiny fetched from the DHT (published by QmMallory): it hashes to ")
    assert f"{config_hash(other)}, but the run's peers announce {TINY_HASH}" in line and "\n" not in line
    with pytest.raises(ValueError, match="hashes to"):
        config_from_record(forged, TINY_HASH)
    # an honest record next to it wins, whichever is newer
    honest = config_record(TINY, "QmHonest", NOW - 50)
    assert config_from_records([(forged, NOW + 100), (honest, NOW + 100)], tiny_run(), NOW)[1] == honest
    # only records claiming the announced hash are candidates; expired ones are ignored
    with pytest.raises(ValueError, match=r"^run tiny: no peer publishes its config \(hash "):
        config_from_records([(config_record(other, "QmOther", NOW), NOW + 100), (honest, NOW - 1)], tiny_run(), NOW)
    with pytest.raises(ValueError, match="none of its peers announces a config hash"):
        config_from_records([(honest, NOW + 100)], RunInfo("tiny", left=1), NOW)


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),  # hostile nesting: one line, no RecursionError
    ('{"inner": {"lr": NaN}}', "is not valid JSON"),
    ("[1, 2]", "is not a table of sections"),
    ('{"inner": {"lr": "fast"}}', "inner.lr: expected a number"),
    ('{"bogus": {}}', "bogus: unknown key"),
    ('{"inner": {"warmup_steps": 1000}}', "inner.warmup_steps: must be in"),
    ('{"run": {"run_id": "other"}}', "it is the config of run 'other'"),
])
def test_a_malformed_or_hostile_config_record_is_one_line(text: str, message: str) -> None:
    record = replace(config_record(TINY, "QmMallory", NOW), config=text)
    with pytest.raises(ValueError) as refused:
        config_from_record(record, TINY_HASH)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert "config of run tiny fetched from the DHT (published by QmMallory)" in str(refused.value)


def test_load_config_data_validates_as_a_file_and_leaves_its_input_alone() -> None:
    data = json.loads(config_text(TINY))
    snapshot = json.dumps(data, sort_keys=True)
    assert load_config_data(data) == pin_data(TINY)
    assert load_config_data(data, ["inner.lr=0.01", "sim.speeds=[1.0, 0.5, 0.5]"]).sim.speeds == (1.0, 0.5, 0.5)
    assert json.dumps(data, sort_keys=True) == snapshot
    with pytest.raises(ConfigError, match="^a config must be a table of sections, got list"):
        load_config_data([])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^model.n_embd: must be a positive multiple"):
        load_config_data({**data, "model": {**data["model"], "n_embd": 33}})


# ---------------------------------------------------------------- what status shows


def test_idle_members_do_not_hold_consensus_back() -> None:
    local = LocalRun("run-a", 1, "hash-a", "0.1.0")
    entries = [(rec("a", anchor_hashes=("aa", "bb")), NOW + 5), (rec("b", anchor_hashes=("aa", "bb")), NOW + 5),
               (rec("hb", state="idle", fragment_versions=(0, 0)), NOW + 5)]
    s = summarize(classify(entries, local, NOW), "run-a")
    assert (s.live, s.trainers, s.consensus) == (3, 2, True)
    assert [(f.top_version, f.agreeing) for f in s.fragments] == [(3, 2), (3, 2)]
    assert s.states == {"training": 2, "idle": 1}
    # a training member that lags is counted, not held against the consensus (tests/unit/test_status_consensus.py)
    lagging = entries + [(rec("c", fragment_versions=(2, 3), anchor_hashes=("a0", "bb")), NOW + 5)]
    assert summarize(classify(lagging, local, NOW), "run-a").consensus is True
    only_idle = summarize(classify(entries[2:], local, NOW), "run-a")
    assert (only_idle.live, only_idle.trainers, only_idle.consensus, only_idle.fragments) == (1, 0, None, ())


def test_an_observer_sees_a_departed_peer_as_left_not_foreign() -> None:
    observer = LocalRun("run-a", 1, "", "0.1.0")  # status without a config, nobody live to adopt a hash from
    gone = tombstone(rec("m2"), NOW - 5)
    [view] = classify([(gone, NOW + 500)], observer, NOW)
    assert (view.status, view.reason) == ("left", f"left at {NOW - 5:.1f}")
    s = summarize([view], "run-a")
    assert [name for name, _, _ in s.left] == ["m2"] and s.foreign == ()
    # a tombstone is left whatever its run or config (tests/unit/test_status_consensus.py); another run's is no
    # peer of ours: merge_index leaves it out
    [other] = classify([(tombstone(rec("x", run_id="run-b"), NOW - 5), NOW + 500)], observer, NOW)
    assert other.status == "left" and merge_index([], [other]) == []
    [with_cfg] = classify([(gone, NOW + 500)], replace(observer, config_hash="other"), NOW)
    assert with_cfg.status == "left"


def test_bootstrap_announcements_are_no_peers() -> None:
    local = LocalRun("run-a", 1, "hash-a", "0.1.0")
    index = classify([(entry("boot", run_id="run-a", state=ANNOUNCE_STATE, config_hash="other"), NOW + 5),
                      (entry("boot-b", run_id="run-b", state=ANNOUNCE_STATE), NOW + 5),
                      (entry("peer-b", run_id="run-b"), NOW + 5)], local, NOW)
    merged = merge_index([], index)
    assert [v.record.name for v in merged] == ["peer-b"]


def test_config_mismatch_says_we_look_with_another_config() -> None:
    mine = LocalRun("run-a", 1, "mine", "0.1.0")
    views = classify([(rec(n, config_hash="theirs"), NOW + 5) for n in "abc"]
                     + [(tombstone(rec("d", config_hash="old"), NOW - 1), NOW + 500)], mine, NOW)
    line = config_mismatch(views, mine)
    assert line.startswith("your config's hash mine differs from the run's theirs: you are looking with another config")
    assert config_mismatch(classify([(rec("a", config_hash="mine"), NOW + 5)], mine, NOW), mine) == ""
    assert config_mismatch([], mine) == ""
    assert config_mismatch(views, replace(mine, config_hash="")) == ""  # an observer adopts the run's


def test_status_lists_other_runs_and_an_empty_dht() -> None:
    from p2p_diloco.net.membership import SwarmSnapshot
    from p2p_diloco.net.report import render_plain, snapshot_json

    local = LocalRun("run-a", 1, "mine", "0.1.0")
    views = classify([(rec("a", config_hash="theirs"), NOW + 5)], local, NOW)
    runs = (RunInfo("run-a", live=1, config_hashes={"theirs": 1}),
            RunInfo("run-b", live=2, config_hashes={"hb": 2}), RunInfo("run-c", announced=1, announced_hashes={"hc": 1}))
    data = json.loads(json.dumps(snapshot_json(SwarmSnapshot(NOW, local, tuple(views), {"run-a": 1, "run-b": 2},
                                                             runs_detail=runs), {})))
    assert {"run_id", "config_hash", "peers", "summary", "runs", "rejected", "runs_detail"} <= set(data)
    assert [r["run_id"] for r in data["runs_detail"]] == ["run-a", "run-b", "run-c"]
    text = render_plain(data).splitlines()
    assert "note: your config's hash mine differs from the run's theirs" in "\n".join(text)
    assert "other run run-b: 2 live, config hash hb (p2p-diloco status --run-id run-b)" in text
    assert "other run run-c: 0 live, announced by 1 bootstrap(s), config hash hc (p2p-diloco status --run-id run-c)" in text
    empty = snapshot_json(SwarmSnapshot(NOW, LocalRun("", 1, "", "0.1.0"), (), {}), {})
    assert "no run in this DHT" in render_plain(empty) and empty["run_id"] == ""


def test_bootstrap_prints_a_join_command_that_works_when_pasted() -> None:
    from p2p_diloco.cli.members import join_instructions

    peers = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWQ6Zc23k8dddq4G2yn3dL546juChnAjDXrbZH89Q1ZH6h"
    lines = join_instructions(peers, " --swarm-key swarm.secret", "configs/tiny.toml", ["outer.lr=0.5"])
    assert f"  p2p-diloco join --initial-peers {peers} --swarm-key swarm.secret" in lines  # no --config: from the DHT
    [alternative] = [line for line in lines if "--config" in line]
    assert alternative.lstrip().startswith("# or") and alternative.endswith("--config configs/tiny.toml --set outer.lr=0.5")
    assert f"  p2p-diloco status --initial-peers {peers} --swarm-key swarm.secret" in lines
    assert not any("--config" in line for line in join_instructions(peers, "", None, []))
