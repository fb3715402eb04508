"""What ``status`` and the ``swarm`` live view call consensus (one definition, ``report.CONSENSUS``), how a healed
fork's distance is shown (not at all), and departed peers shown as left whatever config they had (pure: records
built in-process, no DHT)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from p2p_diloco.net.membership import SwarmSnapshot
from p2p_diloco.net.records import LocalRun, PeerRecord, check_join, classify, merge_index, tombstone
from p2p_diloco.net.report import CONSENSUS, consensus_text, render_plain, snapshot_json

LOCAL = LocalRun("run-a", 1, "hash-a", "0.1.0")
NOW = 1_000_000.0


def rec(name: str, versions: tuple[int, ...] = (12,), anchors: tuple[str, ...] = ("aa",), **kw: Any) -> PeerRecord:
    base: dict[str, Any] = dict(run_id="run-a", protocol_version=1, config_hash="hash-a", software_version="0.1.0",
                peer_id=f"Qm{name}", name=name, state="training", time=NOW - 1, fragment_versions=versions,
                anchor_hashes=anchors)
    base.update(kw)
    return PeerRecord(**base)


def shown(*records: PeerRecord, local: LocalRun = LOCAL) -> dict[str, Any]:
    """What ``status --json`` prints for these records (the live view reads the same)."""
    entries = [(r, NOW + (600 if r.state == "left" else 20)) for r in records]
    snap = SwarmSnapshot(NOW, local, tuple(classify(entries, local, NOW)), {"run-a": len(records)})
    return json.loads(json.dumps(snapshot_json(snap, {})))


def consensus_line(data: dict[str, Any]) -> str:
    [line] = [line for line in render_plain(data).splitlines() if line.startswith("run run-a:")]
    return line.split("; consensus ", 1)[1]


# ---------------------------------------------------------------- the definition and its counts


def test_nobody_live_is_no_consensus_but_a_dash() -> None:
    data = shown()
    assert data["summary"]["consensus"] is None and consensus_text(data["summary"]) == "-"
    assert consensus_line(data) == "-"
    # heartbeat members (idle) train nothing: still nobody to agree
    idle = shown(rec("hb", versions=(0,), anchors=(), state="idle"))
    assert (idle["summary"]["live"], idle["summary"]["consensus"], consensus_line(idle)) == (1, None, "-")
    # departed peers do not count either
    assert consensus_line(shown(tombstone(rec("gone"), NOW - 5))) == "-"


def test_identical_anchors_at_the_newest_version_with_counts() -> None:
    data = shown(rec("a", (12, 9), ("aa", "b1")), rec("b", (12, 9), ("aa", "b1")), rec("c", (12, 9), ("aa", "b1")))
    assert data["summary"]["consensus"] is True
    assert consensus_line(data) == "f0 v12: 3/3 peers identical; f1 v9: 3/3 peers identical"


def test_a_peer_behind_is_counted_not_held_against_it() -> None:
    """Heartbeats come at different moments, so one peer's record often still shows the previous version: the
    old definition (everyone at one version) read "no" for a whole healthy run."""
    data = shown(rec("a", (12, 9), ("aa", "b1")), rec("b", (12, 9), ("aa", "b1")), rec("c", (11, 9), ("a0", "b1")))
    assert data["summary"]["consensus"] is True
    assert consensus_line(data) == "f0 v12: 2 of 3 at v12, identical; f1 v9: 3/3 peers identical"
    [f0, _] = data["summary"]["fragments"]
    assert (f0["top_version"], f0["agreeing"], f0["peers"], f0["versions"]) == (12, 2, 3, {"11": 1, "12": 2})


def test_the_newest_version_counts_even_held_by_one() -> None:
    data = shown(rec("a", (13,), ("new",)), rec("b", (12,), ("aa",)), rec("c", (12,), ("aa",)))
    assert consensus_line(data) == "f0 v13: 1 of 3 at v13, identical"


def test_anchors_that_differ_now_show_the_distance() -> None:
    data = shown(rec("a", (12, 9), ("aa", "b1")), rec("b", (12, 9), ("aa", "c2"), consensus_distance=(0.0, 0.03)),
                 rec("c", (12, 8), ("aa", "b0")))
    assert data["summary"]["consensus"] is False
    assert consensus_line(data) == "f0 v12: 3/3 peers identical; f1 v9: 2 of 3 at v9, anchors differ (2 distinct; last measured distance 3.0e-02)"
    [_, f1] = data["summary"]["fragments"]
    assert (f1["anchors"], f1["distance"]) == (2, 0.03)


def test_a_healed_fork_shows_no_distance() -> None:
    """Records keep ``consensus_distance`` of the last fork they healed: once the anchors are identical again that
    figure is history, not a difference, and status shows nothing of it."""
    healed = [rec(n, (12, 9), ("aa", "b1"), consensus_distance=(0.0, d)) for n, d in (("a", 0.0), ("b", 0.03))]
    data = shown(*healed)
    assert consensus_line(data) == "f0 v12: 2/2 peers identical; f1 v9: 2/2 peers identical"
    assert "dist" not in render_plain(data)
    assert [f["distance"] for f in data["summary"]["fragments"]] == [0.0, 0.0]


def test_records_without_anchor_hashes_yet() -> None:
    data = shown(rec("a", (0,), ()), rec("b", (0,), ()))  # a first record (joining), before the learner publishes
    assert data["summary"]["consensus"] is None
    assert consensus_line(data) == "f0 v0: 2/2 peers, anchors not published yet"


def test_the_definition_is_in_status_help() -> None:
    from p2p_diloco.cli.main import build_parser

    parser = build_parser()
    status = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "status")[1]  # type: ignore[union-attr]
    assert CONSENSUS in (status.epilog or "")
    assert "newest version" in CONSENSUS and "'-' when no training peer is live" in CONSENSUS


def test_the_live_view_prints_the_same_consensus_as_status(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``swarm``'s live view and ``status`` render consensus with one function (``report.consensus_text``)."""
    import p2p_diloco.net.membership as membership
    from p2p_diloco.local.run import LiveView

    records = (rec("a", (12, 9), ("aa", "b1")), rec("b", (12, 9), ("aa", "c2")), rec("c", (11, 9), ("a0", "b1")))
    entries = [(r, NOW + 20) for r in records]
    snap = SwarmSnapshot(NOW, LOCAL, tuple(classify(entries, LOCAL, NOW)), {"run-a": 3})
    monkeypatch.setattr(membership, "read_swarm", lambda dht, local: snap)

    class AliveDHT:
        def is_alive(self) -> bool:
            return True

    view = LiveView.__new__(LiveView)  # its DHT is the fake above: no process
    view.dht, view.local, view.rich, view.live = AliveDHT(), LOCAL, False, None
    view.budget_tokens, view.seconds, view.last_plain, view.train_started_s = None, 60.0, -math.inf, None
    view.update(5.0, [])
    line = capsys.readouterr().out
    expected = "f0 v12: 2 of 3 at v12, identical; f1 v9: 3 of 3 at v9, anchors differ (2 distinct)"
    assert f"consensus {expected}" in line, line
    assert consensus_line(json.loads(json.dumps(snapshot_json(snap, {})))) == expected


# ---------------------------------------------------------------- departed peers are left, never foreign


def test_a_departed_peer_is_left_whatever_config_it_had() -> None:
    """A tombstone of a peer that ran another config (or protocol) is a departure, not a foreign peer: status
    lists it as left, and neither the join check nor its notes (``joined_run``) nor ``doctor`` warn about it (they
    warn about views of status ``foreign``)."""
    old = tombstone(rec("old", config_hash="hash-old", protocol_version=0), NOW - 30)
    data = shown(rec("a"), old)
    assert data["summary"]["foreign"] == [] and [n for n, _, _ in data["summary"]["left"]] == ["old"]
    text = render_plain(data)
    assert "left: old (Qmold) 30s ago" in text and "foreign" not in text
    views = classify([(old, NOW + 600)], LOCAL, NOW)
    assert [v.status for v in views] == ["left"]
    assert check_join(views, LOCAL, "Qmme") == (True, "")
    # an observer without a config (adopting the live peers' hash) sees it as left too
    observer = LocalRun("run-a", 1, "", "0.1.0")
    assert [n for n, _, _ in shown(rec("a"), old, local=observer)["summary"]["left"]] == ["old"]
    # a live peer with another config is still foreign
    assert [n for n, _, _ in shown(rec("a"), rec("alien", config_hash="hash-b"))["summary"]["foreign"]] == ["alien"]


def test_another_runs_tombstone_from_the_index_is_not_ours() -> None:
    from p2p_diloco.net.records import IndexEntry

    gone = IndexEntry.of(tombstone(rec("x", run_id="run-b"), NOW - 5))
    alive = IndexEntry.of(rec("y", run_id="run-b"))
    index = classify([(gone, NOW + 600), (alive, NOW + 60)], LOCAL, NOW)
    assert [(v.record.name, v.status) for v in merge_index([], index)] == [("y", "foreign")]
