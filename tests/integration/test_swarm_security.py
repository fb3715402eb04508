"""Real processes on 127.0.0.1: refusing incompatible members, forged records, private swarms,
unreachable initial peers. Times are printed (``-s``), never asserted."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from procs import ProcGroup, start_bootstrap, start_member

pytestmark = pytest.mark.integration

DHT_KW: dict[str, Any] = dict(use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False)


@dataclass(frozen=True)
class FindOnEach:
    """(runs in the inspector's DHT process) ask each node directly what it stores under ``key``."""

    peer_ids: tuple[str, ...]
    key: str

    async def __call__(self, _dht: Any, node: Any) -> dict[str, list[bytes]]:
        from hivemind.dht.routing import DHTID
        from hivemind.p2p import PeerID

        key_id = DHTID.generate(source=self.key)
        out: dict[str, list[bytes]] = {}
        for pid in self.peer_ids:
            response = await node.protocol.call_find(PeerID.from_base58(pid), [key_id])
            assert response is not None, f"node {pid} did not answer"
            value, _nearest = response[key_id]
            out[pid] = [] if value is None else [bytes(k) for k in value.value.data.keys()]
        return out


def test_incompatible_member_refused_and_forged_records_rejected(tmp_path: Path) -> None:
    from hivemind import DHT
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.net.keys import load_or_create_identity
    from p2p_diloco.net.membership import owner_subkey
    from p2p_diloco.net.records import PeerRecord, record_shard, run_key
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.identity import config_hash

    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path)
        boot_id = load_or_create_identity(tmp_path / "boot.id").peer_id
        victim_id = load_or_create_identity(tmp_path / "victim.id")
        victim = start_member(procs, peers, "victim", "--identity", str(victim_id.path))
        other = start_member(procs, peers, "other")
        other_id = other.wait_for(r"^joined run \S+ as other \((\w+)\)").group(1)
        victim.wait_for(r"^joined run ")

        # another config hash: refused at join with one line that says what differs, exit 2
        t0 = time.monotonic()
        rc, bad, wall_s = procs.run("heartbeat", "--initial-peers", peers, "--name", "bad", "--set", "outer.lr=0.6")
        assert rc == 2, bad.output()
        errors = [line for _, line in bad.stderr if line.startswith("p2p-diloco:")]
        assert len(errors) == 1, bad.output()
        assert "config hash differs" in errors[0] and "--config/--set" in errors[0]
        print(f"\nrefusal after {time.monotonic() - t0:.1f} s: {errors[0]}")

        # forgers: one writes into the victim's subkey, one writes wrong types into its own (signed)
        run_id = load_config().run.run_id
        key = run_key(run_id, victim_id.peer_id)  # the victim's shard of the records
        forger_key = RSAPrivateKey()
        forger = DHT(initial_peers=[peers], start=True, client_mode=True,
                     record_validators=[RSASignatureValidator(forger_key)], **DHT_KW)
        inspector = DHT(initial_peers=[peers], start=True, client_mode=True, record_validators=[], **DHT_KW)
        try:
            cfg = load_config()
            fake = PeerRecord(run_id=run_id, protocol_version=1, config_hash=config_hash(cfg), software_version="0.1.0",
                              peer_id=victim_id.peer_id, name="victim-forged", state="training",
                              time=get_dht_time()).to_wire()
            victim_subkey = owner_subkey(victim_id.private_key())  # Ed25519; the forger's RSA (an older identity)
            forger_subkey = owner_subkey(forger_key)
            expiration = get_dht_time() + 60
            assert forger.store(key, fake, expiration, subkey=victim_subkey) is False
            assert forger.store(key, {**fake, "tokens": "lots"}, expiration, subkey=forger_subkey) is False
            assert forger.store(key, {**fake, "peer_id": "x", "tokens_per_s": 1}, expiration, subkey=forger_subkey) is False

            # every node, asked directly, holds only the two honest subkeys
            nodes = (boot_id, victim_id.peer_id, other_id)
            stored = inspector.run_coroutine(FindOnEach(nodes, key))
            for pid in nodes:
                assert forger_subkey not in stored[pid], pid
            honest = set().union(*stored.values())
            sharing = [p for p in (victim_id.peer_id, other_id) if record_shard(p) == record_shard(victim_id.peer_id)]
            assert len(honest) == len(sharing) and victim_subkey in honest, stored  # the victim's (and the other member's)
        finally:
            forger.shutdown()
            inspector.shutdown()


def test_private_swarms_do_not_mix(tmp_path: Path) -> None:
    with ProcGroup(tmp_path) as procs:
        for name in ("a", "b"):
            rc, proc, _ = procs.run("keygen", "--out", f"{name}.secret")
            assert rc == 0, proc.output()
        boots = [procs.cli("bootstrap", "--identity", str(tmp_path / f"boot-{n}.id"), "--swarm-key", f"{n}.secret",
                           name=f"boot-{n}") for n in ("a", "b")]  # both at once: the waits overlap
        peers_a, peers_b = (b.wait_for(r"^initial peers: (\S+)").group(1) for b in boots)
        ma = start_member(procs, peers_a, "in-a", "--swarm-key", "a.secret")
        mb = start_member(procs, peers_b, "in-b", "--swarm-key", "b.secret")
        # outsiders: a member of B tries A; a doctor without a key looks at A
        outsiders = [procs.cli("heartbeat", "--initial-peers", peers_a, "--name", "intruder", "--swarm-key", "b.secret",
                               name="intruder-b")]
        ma.wait_for(r"^joined run ")
        mb.wait_for(r"^joined run ")
        for proc in outsiders:
            assert proc.wait_exit(60) == 2, proc.output()
            errors = [line for _, line in proc.stderr if line.startswith("p2p-diloco:")]
            assert len(errors) == 1 and "swarm key mismatch" in errors[0], proc.output()
            print(f"\n{proc.name}: refused {proc.stderr[-1][0] - proc.started_at:.1f} s after start: {errors[0]}")

        looks = [(procs.cli("status", "--initial-peers", peers, "--swarm-key", key, "--json"), expect)
                 for peers, key, expect in ((peers_a, "a.secret", {"in-a"}), (peers_b, "b.secret", {"in-b"}))]
        doctors = [procs.cli("doctor", "--initial-peers", peers_a, "--swarm-key", "a.secret", name="doctor-a"),
                   procs.cli("doctor", "--initial-peers", peers_a, name="doctor-nokey")]
        for proc, expect in looks:
            assert proc.wait_exit(60) == 0, proc.output()
            snap = json.loads(proc.stdout[-1][1])
            assert {p["name"] for p in snap["peers"]} == expect, snap

        good, wrong = doctors
        assert good.wait_exit(60) == 0, good.output()
        report = [line for _, line in good.stdout]
        assert any(line.startswith("[ok  ] reach /ip4/127.0.0.1/") for line in report), report
        assert any("1 live peers" in line for line in report), report
        clocks = [line for line in report if line[7:].startswith("clock of ")]
        assert len(clocks) == 2 and all(c.startswith(("[ok  ]", "[warn]")) for c in clocks), report  # boot + member
        assert not any(line.startswith("[FAIL]") for line in report), report
        assert wrong.wait_exit(60) == 1, wrong.output()
        [fail] = [line for _, line in wrong.stdout if line.startswith("[FAIL]")]
        assert "swarm key mismatch" in fail and "-- fix: pass the swarm's secret with --swarm-key FILE" in fail

        for m in (ma, mb):
            m.send(signal.SIGTERM)
            assert m.wait_exit() == 0, m.output()


def test_unreachable_initial_peers_fail_in_bounded_time(tmp_path: Path) -> None:
    from p2p_diloco.net.keys import load_or_create_identity

    pid = load_or_create_identity(tmp_path / "ghost.id").peer_id
    dead = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{pid}" for port in (1, 9)]
    with ProcGroup(tmp_path) as procs:
        rc, proc, wall_s = procs.run("status", "--initial-peers", ",".join(dead), "--join-timeout", "10")
        assert rc == 2, proc.output()
        [line] = [line for _, line in proc.stderr if line.startswith("p2p-diloco:")]
        assert "no initial peer reachable" in line and all(d in line for d in dead) and "connection refused" in line
        print(f"\nunreachable: {wall_s:.1f} s wall: {line}")
