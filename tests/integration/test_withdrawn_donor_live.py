"""A donor that leaves gracefully withdraws its state-sharing declaration (issue 49): a newcomer then never dials
it (it did, and waited out a dial back-off, until the declaration expired), and downloads from a donor still
there. Real DHTs and averagers on 127.0.0.1 (``tests/averagers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from averagers import averaging_swarm, wait_declared
from p2p_diloco.averaging.decisions import anchor_hash, sharing_priority
from p2p_diloco.averaging.downloads import declared_priorities
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.transfer import state_payload
from p2p_diloco.core.waiting import poll_until
from test_vouched_state import CFG, DEADLINE_S, HONEST, MOMENTUM, NAMES, SHAPES

pytestmark = pytest.mark.integration

WITHDRAWN_DEADLINE_S = 30.0
"""How long the test waits for the leaver's withdrawal to be what the newcomer reads (generous: a loaded machine)."""


def test_a_donor_that_left_gracefully_is_not_tried(tmp_path: Path) -> None:
    honest = anchor_hash(HONEST)
    providers = [lambda: state_payload(0, 5, HONEST, MOMENTUM, NAMES),  # leaves gracefully
                 lambda: state_payload(0, 5, HONEST, MOMENTUM, NAMES),  # stays
                 None]  # the newcomer
    with averaging_swarm(tmp_path, CFG, NAMES, SHAPES, (ExactAllReduceRunner,) * 3, providers) as peers:
        leaver, donor, newcomer = peers
        for p in (leaver, donor):
            p.set_anchor(5, honest)
            p.vouch(5, honest)
        wait_declared(newcomer.dht, leaver, sharing_priority(5, honest))
        wait_declared(newcomer.dht, donor, sharing_priority(5, honest))
        key = f"{leaver.prefix}.all_averagers"
        leaver_id = leaver.dht.peer_id.to_base58()
        assert leaver_id in declared_priorities(newcomer.dht.get(key, latest=True))

        leaver.shutdown()  # what DiLoCo.close() does to each fragment's averager when a learner leaves
        poll_until(lambda: leaver_id not in declared_priorities(newcomer.dht.get(key, latest=True)),
                   WITHDRAWN_DEADLINE_S, "the leaver's withdrawn declaration")

        got = newcomer.fetch_state((0, "f" * 16)).result(timeout=DEADLINE_S)
        print(f"\nattempts: {[(d[-8:], why, round(s, 2)) for d, why, s in got.attempts]}")
        assert [d for d, _, _ in got.attempts] == [donor.dht.peer_id.to_base58()], got.attempts
        assert got.fetched is not None and got.fetched.version == 5 and got.fetched.anchor_hash == honest
