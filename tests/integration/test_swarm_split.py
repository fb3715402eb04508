"""Split-swarm check (hivemind #624) and membership, with in-process DHTs on 127.0.0.1.

A real #624 split cannot be produced on demand, so we build one: two DHTs that never met. A
peer that knows both (initial peers or records) finds one of them missing from its routing table
and heals by pinging it; afterwards records published on either side are visible on both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from p2p_diloco.core.waiting import poll_until

pytestmark = pytest.mark.integration

MERGE_DEADLINE_S = 20.0
"""After the heal: how long b's re-published record may take to reach c through the merged DHT."""


def test_split_detected_and_healed_then_membership(tmp_path: Path, write_rsa_identity: Any) -> None:
    """b has an RSA identity (made before Ed25519), a and c Ed25519 ones: one swarm, both kinds of records."""
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.net.keys import load_or_create_identity
    from p2p_diloco.net.records import LocalRun, PeerRecord
    from p2p_diloco.net.membership import (
        Membership, RecordPublisher, SwarmOptions, read_swarm, start_dht, visible_addresses,
    )
    from p2p_diloco.net.probes import check_split

    local = LocalRun("split-run", 1, "h", "0.1.0")
    write_rsa_identity(tmp_path / "b.id")
    ids = {n: load_or_create_identity(tmp_path / f"{n}.id") for n in ("a", "b", "c")}
    assert [ids[n].key_type for n in ("a", "b", "c")] == ["ed25519", "rsa", "ed25519"]
    dhts = []
    try:
        a = start_dht(SwarmOptions(identity=ids["a"]), local.run_id)
        dhts.append(a)
        b = start_dht(SwarmOptions(identity=ids["b"]), local.run_id)  # a second, separate DHT: the split
        dhts.append(b)
        assert (a.peer_id.to_base58(), b.peer_id.to_base58()) == (ids["a"].peer_id, ids["b"].peer_id)  # p2pd runs on them
        addr_a, addr_b = parse_initial_peers(visible_addresses(a)), parse_initial_peers(visible_addresses(b))
        publisher = RecordPublisher(b, ids["b"].private_key(), PeerRecord(
            run_id=local.run_id, protocol_version=1, config_hash="h", software_version="0.1.0",
            peer_id=ids["b"].peer_id, name="b", addresses=tuple(visible_addresses(b)), state="idle"), ttl_s=30)
        assert publisher.publish()

        # c joins through a only: it cannot see b's record
        c = start_dht(SwarmOptions(initial_peers=addr_a, identity=ids["c"]), local.run_id)
        dhts.append(c)
        assert [v.record.name for v in read_swarm(c, local).live()] == []
        membership = Membership(c, local, refresh_interval_s=60, min_refresh_interval_s=0)
        assert not membership.is_member(ids["b"].peer_id)

        # c is told about b (as a second initial peer would): b is missing from its table -> healed
        report = check_split(c, read_swarm(c, local), addr_a + addr_b)
        assert report.split_suspected and report.missing == (ids["b"].peer_id,) and report.healed == report.missing
        assert publisher.publish()  # b re-publishes; the merged DHT now carries it to c
        poll_until(lambda: membership.is_member(ids["b"].peer_id), MERGE_DEADLINE_S, "b's record seen by c", 0.5)
        assert not membership.is_member(ids["a"].peer_id)  # a publishes no record: not a member
        assert not check_split(c, read_swarm(c, local), addr_a + addr_b).split_suspected
        assert publisher.leave()
        assert not membership.refresh()  # the tombstone is not a member
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
