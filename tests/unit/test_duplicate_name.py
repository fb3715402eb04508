"""``--name NAME`` held by another live peer is refused with one line and exit code 2, before we publish; a name
held only by a tombstone, an expired record or a stopped peer's record (not refreshed) is free."""

from __future__ import annotations

from typing import Any

import pytest

from p2p_diloco.net.membership import SwarmSnapshot
from p2p_diloco.net.records import LocalRun, PeerRecord, classify, name_holder, tombstone

LOCAL = LocalRun("run-a", 1, "hash-a", "0.1.0")
NOW = 1_000_000.0


def rec(name: str, peer_id: str, **kw: Any) -> PeerRecord:
    base: dict[str, Any] = dict(run_id="run-a", protocol_version=1, config_hash="hash-a", software_version="0.1.0",
                peer_id=peer_id, name=name, state="training", time=NOW - 1, ttl_s=3.0)
    base.update(kw)
    return PeerRecord(**base)


def test_who_holds_a_name() -> None:
    live = rec("dup", "QmOther12345678")
    views = classify([(live, NOW + 20)], LOCAL, NOW)
    assert name_holder(views, "dup", "QmMe") == live
    assert name_holder(views, "other", "QmMe") is None
    assert name_holder(views, "dup", "QmOther12345678") is None  # our own earlier record (same identity)
    assert name_holder(classify([(tombstone(live, NOW), NOW + 600)], LOCAL, NOW), "dup", "QmMe") is None
    assert name_holder(classify([(live, NOW - 1)], LOCAL, NOW), "dup", "QmMe") is None  # expired
    foreign = rec("dup", "QmAlien", config_hash="hash-b")
    assert name_holder(classify([(foreign, NOW + 20)], LOCAL, NOW), "dup", "QmMe") is None


class _Clock:
    """DHT time that moves only when the check sleeps."""

    def __init__(self) -> None:
        self.now = NOW

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.mark.parametrize("refreshed", [True, False])
def test_the_holder_must_refresh_its_record_to_keep_the_name(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str], refreshed: bool) -> None:
    """A live record may be a peer killed without a goodbye (it stays for a TTL): the name is taken only if the
    holder's record is refreshed by its next heartbeat (ttl / 3, with as much again in slack)."""
    import time

    import hivemind.utils

    import p2p_diloco.net.membership as membership
    from p2p_diloco.net.joined import check_name_free

    clock = _Clock()
    monkeypatch.setattr(hivemind.utils, "get_dht_time", clock.time)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    first = rec("dup", "QmOther12345678", time=NOW - 0.5)

    def read(dht: Any, local: LocalRun, index: bool = True) -> SwarmSnapshot:
        beat = first.time + (1.0 if refreshed and clock.now >= first.time + 1.0 else 0.0)  # a beat every ttl/3 = 1 s
        return SwarmSnapshot(clock.now, local, tuple(classify([(rec("dup", first.peer_id, time=beat), NOW + 20)],
                                                              local, clock.now)), {})

    monkeypatch.setattr(membership, "read_swarm", read)
    snapshot = read(None, LOCAL)
    if refreshed:
        with pytest.raises(ValueError) as info:
            check_name_free(None, LOCAL, "dup", "QmMe", snapshot)
        assert str(info.value) == ("name 'dup': already taken by live peer 12345678 (pick another name, or give "
                                   "none for a generated one)")
        assert clock.now - NOW < 1.0  # found at its next heartbeat
    else:
        check_name_free(None, LOCAL, "dup", "QmMe", snapshot)
        assert "note: name 'dup': the record of peer 12345678 that holds it was not refreshed" in capsys.readouterr().out
        assert clock.now >= first.time + 2.0  # two heartbeat periods waited, then the name is ours
    check_name_free(None, LOCAL, "free", "QmMe", snapshot)  # nobody holds it: no wait, no note
