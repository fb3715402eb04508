"""The tests of ``tests/unit/test_vouched_state.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

from pathlib import Path
import pytest
import torch
from averagers import averaging_swarm
from p2p_diloco.averaging.decisions import anchor_hash, vouch_key
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.transfer import state_payload
from p2p_diloco.engine.view import vouched_heads
from p2p_diloco.net.membership import owned_values, read_many
from test_vouched_state import CFG, DEADLINE_S, FAKE, HONEST, MOMENTUM, NAMES, SHAPES

pytestmark = pytest.mark.integration


def test_a_fabricated_newer_anchor_is_refused_and_the_next_donor_used(tmp_path: Path) -> None:
    honest_hash, fake_hash = anchor_hash(HONEST), anchor_hash(FAKE)
    providers = [lambda: state_payload(0, 6, FAKE, MOMENTUM, NAMES),  # the liar: "v6"
                 lambda: state_payload(0, 5, HONEST, MOMENTUM, NAMES),  # an honest donor at the swarm's v5
                 None,  # its co-committer of v5 (shares nothing)
                 None]  # the newcomer
    with averaging_swarm(tmp_path, CFG, NAMES, SHAPES, (ExactAllReduceRunner,) * 4, providers) as peers:
        liar, donor, witness, newcomer = peers
        liar.vouch(6, fake_hash)  # signing for itself is not enough
        donor.vouch(5, honest_hash)
        witness.vouch(5, honest_hash)
        # the donors as the newcomer's view holds them (from their records): the liar claims v6
        donors = {liar.dht.peer_id.to_base58(): (6, fake_hash), donor.dht.peer_id.to_base58(): (5, honest_hash),
                  witness.dht.peer_id.to_base58(): (5, honest_hash)}
        got = newcomer.fetch_state((0, "f" * 16), donors).result(timeout=DEADLINE_S)
        print(f"\nattempts: {[(d[-8:], why, round(s, 2)) for d, why, s in got.attempts]}")
        tried = [d for d, _, _ in got.attempts]
        assert tried[0] == liar.dht.peer_id.to_base58(), got.attempts  # the liar ranks first: it claims v6
        assert got.attempts[0][1].startswith("unvouched: state download: no peer other than the donor signed"), got
        assert tried[-1] == donor.dht.peer_id.to_base58() and got.attempts[-1][1] == "ok", got.attempts
        assert got.fetched is not None and got.fetched.version == 5 and got.fetched.anchor_hash == honest_hash
        assert all(torch.equal(got.fetched.anchor[n], HONEST[n]) for n in NAMES)

        # The learners' head probe reads the same vouches, several keys in one batched search: who among
        # the live peers holds the next version, on which anchor (the view's fast path, O(1) in the swarm).
        ids = [p.dht.peer_id.to_base58() for p in peers]
        keys = [vouch_key(liar.prefix, v) for v in (5, 6, 7)]
        found = read_many(newcomer.dht, keys)
        assert set(found) == set(keys) and found[keys[2]] is None
        assert vouched_heads(owned_values(found[keys[0]]), 5, set(ids), ids[3]) == {
            ids[1]: (5, honest_hash), ids[2]: (5, honest_hash)}
        assert vouched_heads(owned_values(found[keys[0]]), 5, {ids[1]}, ids[3]) == {ids[1]: (5, honest_hash)}  # dead: out
        assert vouched_heads(owned_values(found[keys[1]]), 6, set(ids), ids[0]) == {}  # our own vouch is no news

