"""Private swarm: the averaging and state-download handlers serve members only (real DHTs and fragment
averagers on 127.0.0.1, in-process).

hivemind's DHT authorizer covers DHT requests, not the averager's RPCs, so a peer that holds the swarm
key (or reaches the averager directly) but has no live, compatible record must be refused by the
handlers themselves. Here B has the key but no record: A refuses its state download, its tensor
parts and its request for A's offer to a group from the clock, so neither B's download nor an A+B round
succeeds; C, a member, downloads A's state and commits rounds with A (found by matchmaking, and from the clock).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from p2p_diloco.averaging.host import FragmentAveragerHost
from p2p_diloco.averaging.plans import RoundPlan
from p2p_diloco.averaging.decisions import anchor_hash
from p2p_diloco.averaging.transfer import state_payload
from p2p_diloco.core.config import load_config
from p2p_diloco.sync.fragment import Contribution

pytestmark = pytest.mark.integration

NAMES = tuple(f"blocks.{i}.fc.weight" for i in range(3))
SHAPES = {n: torch.Size([32, 16]) for n in NAMES}
DEADLINE_S = 60.0
CFG = load_config(None, ["run.run_id=members", "model.n_layer=2", "outer.fragments=2", "outer.merge=\"mean\"",
                         "outer.codec=\"fp32\"", "averaging.window_s=1.5", "averaging.commit_timeout_s=3.0",
                         "averaging.next_chunk_timeout_s=2.0", "averaging.allreduce_timeout_s=10.0",
                         "averaging.state_timeout_s=10.0"])
ANCHOR = {n: torch.full(SHAPES[n], float(i + 1)) for i, n in enumerate(NAMES)}
MOMENTUM = {n: torch.full(SHAPES[n], 0.5) for n in NAMES}


def provide() -> tuple[dict[str, Any], list[torch.Tensor]]:
    return state_payload(0, 3, ANCHOR, MOMENTUM, NAMES)


def round_of(peers: list[FragmentAveragerHost], group_id: str = "") -> list[Any]:
    """A round of ``peers``: found by matchmaking, or with ``group_id`` a group from the clock (its members meet
    directly, averaging/fixed_groups.py)."""
    from hivemind.utils import get_dht_time

    start = get_dht_time() + CFG.averaging.window_s
    members = tuple(sorted(p.dht.peer_id.to_base58() for p in peers)) if group_id else ()
    futures = []
    for i, peer in enumerate(peers):
        contribution = Contribution(fragment=0, version=0, anchor_hash="0" * 16, tokens=1000 * (i + 1), steps=10,
                                    weight=1000.0 * (i + 1), tensors={n: torch.full(SHAPES[n], float(i)) for n in NAMES},
                                    norms={})
        futures.append(peer.start_round(contribution, RoundPlan(start, CFG.averaging.window_s, due=get_dht_time(),
                                                                group_id=group_id, members=members)))
    return [f.result(timeout=DEADLINE_S) for f in futures]


def test_keyed_non_member_is_refused_by_the_averaging_handlers(tmp_path: Path) -> None:
    with keyed_swarm(tmp_path) as (a, b, c):
        donors = {a.dht.peer_id.to_base58(): (3, anchor_hash(ANCHOR))}  # A, as a member's view holds it
        by_b = b.fetch_state((0, "f" * 16), donors).result(timeout=DEADLINE_S)
        refused_downloads = a.refusals()
        print(f"\nB (keyed, no record) downloading A's state: {by_b}; A refused {refused_downloads} request(s)")
        assert by_b.fetched is None and refused_downloads >= 1
        assert by_b.failures, by_b  # the refusal is reported as a failed donor, not silently empty

        by_c = c.fetch_state((0, "f" * 16), donors).result(timeout=DEADLINE_S)
        fetched_by_c = by_c.fetched
        assert by_c.attempts and by_c.attempts[-1][1] == "ok", by_c
        assert fetched_by_c is not None and fetched_by_c.version == 3
        assert fetched_by_c.anchor_hash == anchor_hash(ANCHOR)
        assert all(torch.equal(fetched_by_c.momentum[n], MOMENTUM[n]) for n in NAMES)

        with_b = round_of([a, b])
        print(f"A+B round: {[o.reason for o in with_b]}; A refused {a.refusals() - refused_downloads} more")
        assert not any(o.committed for o in with_b)
        assert a.refusals() > refused_downloads  # B's join request or its tensor parts were refused

        with_c = round_of([a, c])
        assert all(o.committed and o.group_size == 2 for o in with_c), [o.reason for o in with_c]
        merged = [o.merged for o in with_c]
        assert all(m is not None and torch.equal(m[NAMES[0]], merged[0][NAMES[0]]) for m in merged)

        # groups from the clock: B's request for A's offer is refused like its tensor parts; C's is answered
        refused_before = a.refusals()
        clock_b = round_of([a, b], group_id="members-ab")
        print(f"A+B group from the clock: {[o.reason for o in clock_b]}; A refused {a.refusals() - refused_before} more")
        assert not any(o.committed for o in clock_b) and a.refusals() > refused_before
        clock_c = round_of([a, c], group_id="members-ac")
        assert all(o.committed and o.group_size == 2 for o in clock_c), [o.reason for o in clock_c]


@contextlib.contextmanager
def keyed_swarm(tmp_path: Path) -> Iterator[tuple[FragmentAveragerHost, FragmentAveragerHost, FragmentAveragerHost]]:
    """A (member, state donor, checks membership), B (has the swarm key, publishes no record), C (member)."""
    from p2p_diloco.net.addresses import parse_initial_peers
    from p2p_diloco.net.keys import load_or_create_identity, read_swarm_key, write_swarm_key
    from p2p_diloco.net.records import LocalRun, PeerRecord
    from p2p_diloco.net.membership import Membership, RecordPublisher, SwarmOptions, start_dht, visible_addresses

    write_swarm_key(tmp_path / "swarm.secret")
    secret = read_swarm_key(tmp_path / "swarm.secret")
    local = LocalRun.from_config(CFG)
    dhts: list[Any] = []
    peers: list[FragmentAveragerHost] = []
    try:
        for name in ("a", "b", "c"):
            identity = load_or_create_identity(tmp_path / f"{name}.id")
            key = identity.private_key()
            initial = parse_initial_peers(visible_addresses(dhts[0])[:1]) if dhts else ()
            opts = SwarmOptions(initial_peers=initial, identity=identity, check_identity_free=False, swarm_key=secret)
            dht = start_dht(opts, CFG.run.run_id, private_key=key)
            dhts.append(dht)
            if name != "b":
                record = PeerRecord(run_id=local.run_id, protocol_version=local.protocol_version,
                                    config_hash=local.config_hash, software_version=local.software_version,
                                    peer_id=dht.peer_id.to_base58(), name=name, state="training",
                                    addresses=tuple(visible_addresses(dht)))
                assert RecordPublisher(dht, key, record, ttl_s=120.0).publish_within(30.0)
            peers.append(FragmentAveragerHost(
                CFG, 0, NAMES, SHAPES, dht, key, membership=Membership(dht, local) if name == "a" else None,
                state_provider=provide if name == "a" else None))
        peers[2].vouch(3, anchor_hash(ANCHOR))  # C signs A's anchor of v3, as A's co-committer of v3 would have
        yield peers[0], peers[1], peers[2]
    finally:
        for p in peers:
            p.shutdown()
        for d in dhts:
            d.shutdown()
