"""A learner's events, typed: one frozen dataclass per kind, its JSON record, and the one reader of them.

A learner logs what happens to it as events (``Learner._event``): ``--events FILE`` appends each one's
:meth:`Event.to_json` as a JSON line, and every ``--metrics`` sink receives the same :class:`Event`
(:mod:`p2p_diloco.engine.metrics`). Every record starts with the learner's envelope (:class:`Event`:
``name``, ``step``, ``tokens``, ``time``, ``loss``), then ``"event": KIND``, then the kind's own fields:

``round`` :class:`RoundEvent`, ``resync`` :class:`ResyncEvent`, ``late_commit`` :class:`LateCommitEvent`,
``replay`` :class:`ReplayEvent`, ``training`` :class:`TrainingEvent`, ``first_contribution``
:class:`FirstContributionEvent`, ``local_drop``
:class:`LocalDropEvent`, ``eval`` :class:`EvalEvent`, ``clock`` :class:`ClockEvent`, ``checkpoint``
:class:`CheckpointEvent`.

:func:`parse_event` and :func:`read_events` turn records back into these classes, so that a reader's wrong
field name is a type error, not a ``KeyError`` at the end of a benchmark. They read any version's files:
an unknown kind is an :class:`OtherEvent` (its record kept whole), a key this version does not know is kept
in :attr:`Event.extra`, and a key the record lacks (a file from before the field existed, a hand-written
record) reads as "absent": None for optional fields, NaN for floats, 0, ``""``, False or ``()`` otherwise.

Standard library only: ``core`` is below every reader (``learner``, ``local``, ``sim``, the scripts).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

ENVELOPE = ("name", "step", "tokens", "time", "loss")
"""The keys every record starts with, in this order (the learner's state when it logged the event)."""

_OMIT = {"omit_none": True}
_ABSENT: dict[str, Any] = {"int": 0, "float": math.nan, "str": "", "bool": False,
                           "tuple[str, ...]": (), "tuple[int, ...]": (), "tuple[float, ...]": ()}
"""A missing key's value, by the field's annotation (fields typed ``X | None`` read None)."""


def _omitted() -> Any:
    """A field that only some records of its kind carry: None, and then left out of the JSON record."""
    return field(default=None, metadata=_OMIT)


def finite_or_none(value: float) -> float | None:
    """``value``, or None if it is NaN or infinite (JSON has no NaN: such fields are written as null)."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True, kw_only=True)
class Event:
    """One event of a learner: the envelope every record carries; a subclass per kind adds its fields.

    The emitter builds the kind's fields; the learner fills the envelope when it logs it (:meth:`stamped`).
    """

    KIND: ClassVar[str] = ""
    DERIVED: ClassVar[tuple[str, ...]] = ()
    """Keys the record carries that are computed from the fields (written by :meth:`to_json`, not read)."""

    name: str = ""
    """The learner's ``--name``."""
    step: int = 0
    """Its inner step (optimizer steps since it started training, resumed ones included) when it logged this."""
    tokens: int = 0
    """Training tokens it had consumed by then."""
    time: float = 0.0
    """DHT time (seconds since the Unix epoch, the swarm's shared clock) when it logged this."""
    loss: float | None = None
    """Its latest training loss (in the run's loss unit, :func:`~p2p_diloco.core.tokenizer.loss_unit`);
    None: no step yet, or not finite."""
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """Keys of the record this version does not know (a newer learner's file), kept and written back."""

    @property
    def kind(self) -> str:
        """The record's ``"event"`` value."""
        return self.KIND

    def stamped(self, *, name: str, step: int, tokens: int, time: float, loss: float | None) -> Self:
        """This event with the learner's envelope filled in."""
        return dataclasses.replace(self, name=name, step=step, tokens=tokens, time=time, loss=loss)

    def to_json(self) -> dict[str, Any]:
        """The JSON record (plain str, numbers, bools, None, lists, dicts): envelope, ``event``, the fields in
        declaration order (an omitted-when-None field left out), then :attr:`extra`."""
        record: dict[str, Any] = {key: getattr(self, key) for key in ENVELOPE}
        record["event"] = self.kind
        for f in fields(self):
            if f.name in ENVELOPE or f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            record[f.name] = list(value) if isinstance(value, tuple) else value
        return {**record, **self.extra}


@dataclass(frozen=True, kw_only=True)
class RoundEvent(Event):
    """A round of one fragment ended: committed (the outer step applied) or discarded (nothing changed).

    The averaging fields are :class:`~p2p_diloco.averaging.plans.RoundOutcome`'s; the record also carries
    ``committed`` (``outcome == "committed"``).
    """

    KIND = "round"
    DERIVED = ("committed",)

    fragment: int
    """The fragment's index."""
    version: int
    """The fragment's version the round started from."""
    reason: str
    """Why it committed or was discarded (``"ok"`` when committed)."""
    group_size: int
    """Learners in the all-reduce group, us included (0: no group formed)."""
    peers: tuple[str, ...]
    """The group's members' peer ids."""
    absent: int = 0
    """Groups from the clock: the members the group named that did not show (the round went on without them)."""
    own_share: float
    """Our weight in the group's average (0..1)."""
    weights: tuple[float, ...]
    """Every member's weight in the average, in the order of ``peers``."""
    bytes_sent: int
    """Bytes we sent in the round."""
    bytes_received: int
    """Bytes we received in the round."""
    duration_s: float
    """Seconds from handing the round to the averager to its end."""
    arrival_spread_s: float | None
    """Seconds between the first and the last member joining the group; None: not measured."""
    waited_s: float | None = None
    """Seconds from our hand-off to the group's last member's: the part of ``duration_s`` spent waiting for the
    others to arrive (the rest is the round once all are there); None: not measured."""
    window_s: float
    """The matchmaking window (seconds) the round ran with."""
    setup_s: float | None = None
    """Seconds from the round's start to its step in the averager (timeouts and group set, tensors copied in); None:
    not measured."""
    verdicts_s: float | None = None
    """Seconds the members' verdicts took to agree after the all-reduce; None: none exchanged or not measured."""
    meet_s: float | None = None
    """Seconds our step took to meet its group (offers and the leader's decision, or matchmaking); None: no group
    formed or not measured."""
    handback_s: float | None = None
    """Seconds from the all-reduce's end to our verdicts' start (its result's way back to the learner, our checks);
    None: not measured."""
    allreduce_end: float | None = None
    """DHT time our all-reduce ended (the group's last member's end is the group's all-reduce's); None: not measured."""
    allreduce_s: float | None
    """Seconds the all-reduce itself ran; None: no group formed."""
    part_bytes: int = 0
    """The size of the parts the all-reduce was cut in (the same on every member of the group); 0: none ran."""
    rtt_s: float | None
    """The fastest DHT read of the members' verdicts (a round trip, seconds); None: none was read."""
    timeouts: Mapping[str, float | None] | None
    """The hivemind timeouts the round ran with (:meth:`~p2p_diloco.averaging.linktime.RoundTimeouts.event`,
    seconds, bytes and bytes/s); None: none recorded."""
    version_after: int
    """The fragment's version after the round (the version + 1 when committed)."""
    group_distance: float | None
    """Grid groups, committed: relative distance of our anchor to the group's average; None otherwise."""
    outcome: str
    """``"committed"`` or ``"discarded"``."""
    anchor_hash: str
    """Hash of the fragment's anchor after the round."""
    tokens_sent: int
    """Training tokens whose progress the round's pseudo-gradient carried."""
    steps_sent: int
    """Inner steps whose progress the round's pseudo-gradient carried."""

    @property
    def committed(self) -> bool:
        return self.outcome == "committed"

    def to_json(self) -> dict[str, Any]:
        items = list(super().to_json().items())
        at = [k for k, _ in items].index("version") + 1  # where RoundOutcome's record puts it
        return dict([*items[:at], ("committed", self.committed), *items[at:]])


@dataclass(frozen=True, kw_only=True)
class ResyncEvent(Event):
    """A state download of one fragment ended: applied (``rebased``, ``fork healed``, ``reset after resume``),
    ``nothing newer``, or ``failed``. Which fields a record carries depends on how it ended."""

    KIND = "resync"

    fragment: int
    """The fragment's index."""
    outcome: str
    """``"rebased"``, ``"fork healed"``, ``"reset after resume"``, ``"nothing newer"`` or ``"failed"``."""
    version: int | None = _omitted()
    """Our version of the fragment before the download (None: the download raised before it returned)."""
    version_after: int | None = _omitted()
    """Our version after applying it (applied downloads only)."""
    anchor_hash_before: str | None = _omitted()
    """Hash of our anchor before (applied downloads only)."""
    anchor_hash: str | None = _omitted()
    """Hash of the anchor we adopted (applied downloads only)."""
    donors_tried: int | None = _omitted()
    """Donors asked for the state."""
    donor_failures: tuple[str, ...] | None = _omitted()
    """One line per donor that failed (its peer id's end and why)."""
    duration_s: float | None = _omitted()
    """Seconds the download took."""
    bytes: int | None = _omitted()
    """Wire bytes received from every donor tried (an aborted one's included)."""
    consensus_distance: float | None = _omitted()
    """A fork healed: relative distance between our anchor and the adopted one."""
    reason: str | None = _omitted()
    """A download that raised: the exception, cut to 300 characters."""


@dataclass(frozen=True, kw_only=True)
class LateCommitEvent(Event):
    """A round we had discarded for want of a verdict was committed after all: a live peer holds its result."""

    KIND = "late_commit"

    fragment: int
    """The fragment's index."""
    version: int
    """Our version before adopting the round."""
    version_after: int
    """Our version after."""
    anchor_hash_before: str
    """Hash of our anchor before."""
    anchor_hash: str
    """Hash of our anchor after."""


@dataclass(frozen=True, kw_only=True)
class ReplayEvent(Event):
    """A fragment behind the swarm caught up by replaying rounds a peer kept (:mod:`p2p_diloco.core.replay`) instead
    of downloading its state."""

    KIND = "replay"

    fragment: int
    """The fragment's index."""
    outcome: str
    """How the result was applied: ``"rebased"`` or ``"reset after resume"`` (as a download's)."""
    rounds: int
    """Rounds replayed."""
    version: int
    """Our version before."""
    version_after: int
    """Our version after."""
    anchor_hash_before: str
    """Hash of our anchor before."""
    anchor_hash: str
    """Hash of our anchor after (each round's checked)."""
    duration_s: float
    """Seconds from the request to the rounds' arrival."""
    bytes: int
    """Wire bytes received (the rounds, and anything a failed attempt before them brought)."""


@dataclass(frozen=True, kw_only=True)
class TrainingEvent(Event):
    """The learner began training: its peers were live (or its wait for them ended), the first inner step is next
    (logged once; the envelope's ``step`` is where it starts, not 0 after a resume)."""

    KIND = "training"

    seconds_since_start: float
    """Seconds from the learner's start to its first step (monotonic clock, rounded to ms): start-up and the wait
    for peers."""


@dataclass(frozen=True, kw_only=True)
class FirstContributionEvent(Event):
    """This learner's first committed round (logged once)."""

    KIND = "first_contribution"

    fragment: int
    """The fragment whose round it was."""
    seconds_since_start: float
    """Seconds from the learner's start to that round's end (monotonic clock, rounded to ms)."""


@dataclass(frozen=True, kw_only=True)
class LocalDropEvent(Event):
    """A fragment's round was never sent (its pseudo-gradient was unusable): the fragment restarts from its
    anchor with fresh inner-optimizer moments. The envelope's ``step`` is the step it was due at."""

    KIND = "local_drop"

    fragment: int
    """The fragment's index."""
    version: int
    """Its version."""
    reason: str
    """Why it was dropped."""


@dataclass(frozen=True, kw_only=True)
class EvalEvent(Event):
    """The anchors' (the global model's) loss on held-out batches, every ``--eval-every`` seconds."""

    KIND = "eval"

    eval_loss: float
    """Mean held-out loss of the anchors (the run's loss unit, :func:`~p2p_diloco.core.tokenizer.loss_unit`)."""
    train_s: float
    """Seconds since the learner began training (monotonic clock, rounded to ms)."""
    versions: tuple[int, ...]
    """Each fragment's version at the evaluation."""
    batches: int
    """Held-out batches evaluated."""


@dataclass(frozen=True, kw_only=True)
class ClockEvent(Event):
    """The sync clock's leader (re)tuned the swarm's clock."""

    KIND = "clock"

    period_s: float
    """Seconds between two rounds of a fragment: H x the median step time."""
    origin: float
    """DHT time (seconds since the Unix epoch) the clock counts its rounds from."""
    learners: int
    """Learners whose step times the period was derived from."""


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(Event):
    """A checkpoint was saved, or failed to be (training goes on; the previous one is intact)."""

    KIND = "checkpoint"

    outcome: str
    """``"saved"`` or ``"failed"``."""
    path: str | None = _omitted()
    """Saved: its folder."""
    final: bool | None = _omitted()
    """Saved: whether it is the one written at the end of training."""
    model_digest: str | None = _omitted()
    """Saved: digest of the model's weights."""
    anchor_hashes: tuple[str, ...] | None = _omitted()
    """Saved: each fragment's anchor hash."""
    reason: str | None = _omitted()
    """Failed: the exception, cut to 300 characters."""


@dataclass(frozen=True, kw_only=True)
class OtherEvent(Event):
    """A record of a kind this version does not know (or with no ``event``): kept whole, written back as is."""

    record: Mapping[str, Any] = field(default_factory=dict)
    """The record as read."""

    @property
    def kind(self) -> str:
        kind = self.record.get("event")
        return kind if isinstance(kind, str) else ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.record)


KINDS: dict[str, type[Event]] = {cls.KIND: cls for cls in (
    RoundEvent, ResyncEvent, LateCommitEvent, ReplayEvent, TrainingEvent, FirstContributionEvent, LocalDropEvent,
    EvalEvent, ClockEvent, CheckpointEvent)}
"""Every kind a learner logs, by its ``"event"`` value."""


def parse_event(record: Mapping[str, Any]) -> Event:
    """The typed event of a JSON record (:meth:`Event.to_json`'s inverse); see the module's docstring for
    unknown kinds, unknown keys and missing keys."""
    kind = record.get("event")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    envelope = {key: record[key] for key in ENVELOPE if key in record}
    if cls is None:
        return OtherEvent(**envelope, record=dict(record))
    known = {f.name: f for f in fields(cls) if f.name not in ENVELOPE and f.name != "extra"}
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name in record:
            value = record[name]
            values[name] = tuple(value) if isinstance(value, list) and str(f.type).startswith("tuple[") else value
        elif f.default is dataclasses.MISSING:
            values[name] = None if str(f.type).endswith("| None") else _ABSENT[str(f.type)]
    extra = {k: v for k, v in record.items() if k not in known and k not in ENVELOPE and k != "event"
             and k not in cls.DERIVED}
    return cls(**envelope, **values, extra=extra)


def read_events(path: Path) -> list[Event]:
    """The events of a learner's ``--events`` file, in order. A line that is not a JSON object is skipped:
    the last one may still be being written, and a learner killed mid-line and restarted on the same file
    leaves one in the middle."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(parse_event(record))
    return out
