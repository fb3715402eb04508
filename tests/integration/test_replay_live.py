"""Catch-up by replay over real hivemind averagers (``p2p_diloco.core.replay``; the pure parts are
``tests/unit/test_replay.py``): a donor serves the rounds it kept from the asker's rank, over the averager's own
connections, in a fraction of a state download's bytes; the last anchor must be vouched by a peer other than the donor;
an asker from a rank the donor kept nothing from, or that asks for no replay, downloads the state."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from averagers import averaging_swarm
from p2p_diloco.averaging.decisions import anchor_hash
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.transfer import state_payload
from p2p_diloco.core.codecs import local_roundtrip
from p2p_diloco.core.replay import KeptRound
from test_vouched_state import CFG, DEADLINE_S, MOMENTUM, NAMES, SHAPES

pytestmark = pytest.mark.integration

AT_V7 = {n: torch.full(SHAPES[n], 7.0) for n in NAMES}  # what the donor holds (and serves as a state)
H = ["5" * 16, "6" * 16, anchor_hash(AT_V7), "8" * 16]  # the anchor hashes of v5..v8


def merged(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: local_roundtrip("int4", torch.randn(SHAPES[n], generator=g)) for n in NAMES}


def test_a_learner_behind_replays_the_kept_rounds_and_falls_back_to_a_download(tmp_path: Path) -> None:
    providers = [lambda: state_payload(0, 7, AT_V7, MOMENTUM, NAMES), None, None]
    with averaging_swarm(tmp_path, CFG, NAMES, SHAPES, (ExactAllReduceRunner,) * 3, providers) as peers:
        donor, witness, behind = peers
        rounds = [KeptRound(v, H[v - 5], H[v - 4], merged(v)) for v in (5, 6)]
        for kept in rounds:
            donor.keep_round(kept)
        witness.vouch(7, H[2])  # v7's other committer
        donors = {donor.dht.peer_id.to_base58(): (7, H[2])}
        deadline = time.monotonic() + DEADLINE_S
        got = behind.fetch_state((5, H[0]), donors).result(timeout=DEADLINE_S)
        while not got.replayed and time.monotonic() < deadline:  # the rounds not packed yet: downloaded instead
            time.sleep(0.5)
            got = behind.fetch_state((5, H[0]), donors).result(timeout=DEADLINE_S)
        print(f"\nreplayed {len(got.replayed)} rounds in {got.bytes_received} B; attempts {got.attempts}")
        assert got.fetched is None and [(k.base, k.rank) for k in got.replayed] == [(k.base, k.rank) for k in rounds]
        for k, sent in zip(got.replayed, rounds):
            assert all(torch.equal(k.merged[n].view(torch.int32), sent.merged[n].view(torch.int32)) for n in NAMES)
        state_bytes = 2 * 4 * sum(SHAPES[n].numel() for n in NAMES)
        assert got.bytes_received < state_bytes  # two rounds of int4 averages, not one fp32 anchor and momentum

        one = behind.fetch_state((6, H[1]), donors).result(timeout=DEADLINE_S)  # one version behind: one round
        assert [k.version for k in one.replayed] == [6]
        elsewhere = behind.fetch_state((6, "f" * 16), donors).result(timeout=DEADLINE_S)  # a fork: nothing kept
        assert not elsewhere.replayed and elsewhere.fetched is not None and elsewhere.fetched.version == 7
        asked = behind.fetch_state((5, H[0]), donors, replay=False).result(timeout=DEADLINE_S)
        assert not asked.replayed and asked.fetched is not None and asked.fetched.anchor_hash == H[2]  # downloaded

        # a chain to an anchor nobody else signed (v8 from v7: only the donor "holds" it): refused, downloaded
        donor.keep_round(KeptRound(7, H[2], H[3], merged(7)))
        time.sleep(1.0)
        lone = behind.fetch_state((7, H[2]), {donor.dht.peer_id.to_base58(): (8, H[3])}).result(timeout=DEADLINE_S)
        assert not lone.replayed and lone.fetched is None, lone  # (the donor's state is not ahead of v7)
