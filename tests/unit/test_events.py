"""Typed learner events (:mod:`p2p_diloco.core.events`): every kind's JSON record keeps today's keys and values,
reads back to the same object, and old or unknown records still read.

The expected key sets are written out from the emit sites (``rounds.py``, ``loop.py``, ``view.py``,
``checkpoint.py``) as they were when the events were untyped dicts, so a renamed or dropped key fails here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from p2p_diloco.averaging.plans import RoundOutcome
from p2p_diloco.averaging.linktime import floor_timeouts
from p2p_diloco.core.config import load_config
from p2p_diloco.core.events import (
    KINDS,
    CheckpointEvent,
    ClockEvent,
    EvalEvent,
    Event,
    FirstContributionEvent,
    LateCommitEvent,
    ReplayEvent,
    LocalDropEvent,
    TrainingEvent,
    OtherEvent,
    ResyncEvent,
    RoundEvent,
    parse_event,
    read_events,
)
from p2p_diloco.engine.rounds import _round_event

ENVELOPE = {"name", "step", "tokens", "time", "loss", "event"}
ROUND_KEYS = ENVELOPE | {
    "fragment", "version", "committed", "reason", "group_size", "peers", "absent", "own_share", "weights", "bytes_sent",
    "bytes_received", "duration_s", "arrival_spread_s", "waited_s", "setup_s", "verdicts_s", "meet_s", "handback_s", "allreduce_end", "window_s", "allreduce_s", "part_bytes", "rtt_s", "timeouts",
    "version_after", "group_distance", "outcome", "anchor_hash", "tokens_sent", "steps_sent"}
DOWNLOAD = {"donors_tried", "donor_failures", "duration_s"}
APPLIED = ENVELOPE | {"fragment", "outcome", "version", "version_after", "anchor_hash_before", "anchor_hash"} | DOWNLOAD

STAMP = {"name": "peer-a", "step": 120, "tokens": 15360, "time": 1_700_000_000.25, "loss": 3.5}
OUTCOME = RoundOutcome(
    fragment=1, version=4, committed=True, reason="ok", group_size=2, peers=("QmA", "QmB"), own_share=0.25,
    weights=(0.25, 0.75), bytes_sent=1000, bytes_received=1200, duration_s=2.5, finished_at=10.0,
    arrival_spread_s=0.4, waited_s=0.1, window_s=3.0, allreduce_s=1.25, rtt_s=float("nan"),
    timeouts=floor_timeouts(load_config(None).averaging), version_after=5)
SLOT = SimpleNamespace(version=5, anchor_hash="abc123")

EXAMPLES: dict[str, tuple[Event, set[str]]] = {
    "round": (_round_event(OUTCOME, SLOT, 4096, 32), ROUND_KEYS),
    "round discarded": (_round_event(RoundOutcome(fragment=0, version=3, committed=False, reason="timeout"),
                                     SimpleNamespace(version=3, anchor_hash="h3"), 0, 0), ROUND_KEYS),
    "resync failed": (ResyncEvent(fragment=2, outcome="failed", reason="TimeoutError: no donor"),
                      ENVELOPE | {"fragment", "outcome", "reason"}),
    "resync nothing newer": (ResyncEvent(fragment=2, outcome="nothing newer", version=7, donors_tried=1,
                                         donor_failures=(), duration_s=0.5),
                             ENVELOPE | {"fragment", "version", "outcome"} | DOWNLOAD),
    "resync rebased": (ResyncEvent(fragment=0, outcome="rebased", version=3, version_after=6, anchor_hash_before="h3",
                                   anchor_hash="h6", donors_tried=2, donor_failures=("1234abcd: refused",),
                                   duration_s=1.75), APPLIED),
    "resync fork healed": (ResyncEvent(fragment=0, outcome="fork healed", version=6, version_after=6,
                                       anchor_hash_before="h6", anchor_hash="h6b", donors_tried=1, donor_failures=(),
                                       duration_s=0.9, consensus_distance=1e-3), APPLIED | {"consensus_distance"}),
    "late_commit": (LateCommitEvent(fragment=3, version=8, version_after=9, anchor_hash_before="h8", anchor_hash="h9"),
                    ENVELOPE | {"fragment", "version", "version_after", "anchor_hash_before", "anchor_hash"}),
    "replay": (ReplayEvent(fragment=1, outcome="rebased", rounds=2, version=4, version_after=6, anchor_hash_before="h4",
                           anchor_hash="h6", duration_s=0.4, bytes=61_000),
               ENVELOPE | {"fragment", "outcome", "rounds", "version", "version_after", "anchor_hash_before",
                           "anchor_hash", "duration_s", "bytes"}),
    "training": (TrainingEvent(seconds_since_start=38.125), ENVELOPE | {"seconds_since_start"}),
    "first_contribution": (FirstContributionEvent(fragment=1, seconds_since_start=42.125),
                           ENVELOPE | {"fragment", "seconds_since_start"}),
    "local_drop": (LocalDropEvent(fragment=2, version=4, reason="non-finite pseudo-gradient"),
                   ENVELOPE | {"fragment", "version", "reason"}),  # its "step" is the envelope's
    "eval": (EvalEvent(eval_loss=2.75, train_s=61.5, versions=(3, 4, 4, 3), batches=2),
             ENVELOPE | {"eval_loss", "train_s", "versions", "batches"}),  # its "tokens" is the envelope's
    "clock": (ClockEvent(period_s=12.5, origin=1_700_000_010.0, learners=3),
              ENVELOPE | {"period_s", "origin", "learners"}),
    "checkpoint saved": (CheckpointEvent(outcome="saved", path="/ckpt/peer-a/step-120", final=False,
                                         model_digest="d1g35t", anchor_hashes=("h0", "h1")),
                         ENVELOPE | {"outcome", "path", "final", "model_digest", "anchor_hashes"}),
    "checkpoint failed": (CheckpointEvent(outcome="failed", reason="OSError: disk full"),
                          ENVELOPE | {"outcome", "reason"}),
}


def stamped(event: Event) -> Event:
    return event.stamped(**STAMP)


def test_every_kind_has_an_example() -> None:
    assert {e.kind for e, _ in EXAMPLES.values()} == set(KINDS)


@pytest.mark.parametrize("case", EXAMPLES)
def test_each_kind_keeps_todays_keys(case: str) -> None:
    event, keys = EXAMPLES[case]
    record = stamped(event).to_json()
    assert set(record) == keys, (sorted(set(record) - keys), sorted(keys - set(record)))
    assert list(record)[:6] == ["name", "step", "tokens", "time", "loss", "event"]
    assert {k: record[k] for k in STAMP} == STAMP and record["event"] == event.kind


@pytest.mark.parametrize("case", EXAMPLES)
def test_each_kind_round_trips(case: str) -> None:
    event = stamped(EXAMPLES[case][0])
    assert parse_event(event.to_json()) == event
    assert parse_event(json.loads(json.dumps(event.to_json()))) == event  # through the JSONL text


def test_the_round_event_is_todays_record() -> None:
    """The typed round record equals the dict the learner wrote before (RoundOutcome.event() and the slot's)."""
    before = {**STAMP, "event": "round", **OUTCOME.event(), "anchor_hash": "abc123", "version_after": 5,
              "tokens_sent": 4096, "steps_sent": 32}
    event = stamped(EXAMPLES["round"][0])
    assert event.to_json() == before and list(event.to_json()) == list(before)  # the same keys, values and order
    assert isinstance(event, RoundEvent) and event.committed and event.rtt_s is None  # NaN is written as null
    assert set(OUTCOME.event()) | {"event", *STAMP, "anchor_hash", "tokens_sent", "steps_sent"} == ROUND_KEYS


def test_unknown_kinds_and_keys_are_kept() -> None:
    record = {"name": "peer-z", "step": 3, "event": "teleport", "where": [1, 2]}
    event = parse_event(record)
    assert isinstance(event, OtherEvent) and event.kind == "teleport" and event.step == 3
    assert event.to_json() == record
    assert parse_event({"no": "event"}).kind == ""
    newer = {**stamped(EXAMPLES["clock"][0]).to_json(), "jitter_s": 0.1}  # a newer learner's extra field
    clock = parse_event(newer)
    assert isinstance(clock, ClockEvent) and clock.extra == {"jitter_s": 0.1} and clock.to_json() == newer


def test_a_record_missing_keys_reads_them_as_absent() -> None:
    """An older file (or a hand-written record) without some of a kind's keys still reads."""
    event = parse_event({"event": "round", "outcome": "committed", "reason": "ok"})
    assert isinstance(event, RoundEvent) and event.committed and event.reason == "ok"
    assert event.group_size == 0 and event.peers == () and math.isnan(event.duration_s) and event.rtt_s is None
    assert event.name == "" and event.loss is None
    resync = parse_event({"event": "resync", "fragment": 1})
    assert isinstance(resync, ResyncEvent) and resync.outcome == "" and resync.version is None


def test_read_events_skips_a_cut_line(tmp_path: Path) -> None:
    events = [stamped(e) for e, _ in EXAMPLES.values()]
    path = tmp_path / "peer-a.jsonl"
    lines = [json.dumps(e.to_json()) for e in events]
    path.write_text("\n".join([*lines[:3], '{"event": "round", "frag', *lines[3:], '{"event": "teleport"}',
                               '{"name": "peer-a", "ste']) + "\n")
    got = read_events(path)
    assert got[:-1] == events and isinstance(got[-1], OtherEvent)
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path / "missing.jsonl")


def test_every_field_has_an_absent_value() -> None:
    """Each kind reads from a record holding nothing but its kind (no field type without an absent value)."""
    for kind, cls in KINDS.items():
        assert isinstance(parse_event({"event": kind}), cls)
