"""Where a learner's events go: the JSONL file of ``--events`` and the metric sinks of ``--metrics``.

Every event the learner logs (an :class:`~p2p_diloco.core.events.Event`: ``round``, ``eval``, ``resync``,
``checkpoint``, ...; each carries the learner's ``name``, inner ``step``, ``tokens``, DHT ``time`` and latest
training ``loss``) goes through one :class:`EventLog` to every sink, so the JSONL file and TensorBoard show the
same run:

- ``jsonl:FILE`` (:class:`JsonlSink`; ``--events FILE`` is the same): each event's
  :meth:`~p2p_diloco.core.events.Event.to_json`, one per line, appended
  (:func:`~p2p_diloco.core.events.read_events` reads them back).
- ``tensorboard:DIR`` (:class:`TensorBoardSink`): scalars for ``tensorboard --logdir DIR``, the inner step as
  the x-axis and the event's time as the wall time (:class:`ScalarTracker` says which).

wandb is not offered: it is not installed beside torch here, and its offline mode writes a folder that only
``wandb sync`` to a server makes viewable, which TensorBoard's local files already give without an account.

Only the standard library is imported at module level; tensorboard (through torch) only when a
``tensorboard`` sink is opened.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, TypeGuard

from p2p_diloco.core.events import Event, EvalEvent, RoundEvent

log = logging.getLogger(__name__)

METRICS_KINDS = ("tensorboard", "jsonl")
RATE_MIN_S = 1.0
"""Shortest span of DHT time (seconds) over which ``train/tokens_per_s`` is measured: events closer together
than this would give a noisy rate."""
TENSORBOARD_FLUSH_S = 5
"""How often (seconds) the TensorBoard writer flushes to disk, so that a live ``tensorboard`` shows the run."""


@dataclass(frozen=True)
class MetricsSpec:
    """One ``--metrics KIND:PATH``."""

    kind: str
    path: Path

    @property
    def text(self) -> str:
        return f"{self.kind}:{self.path}"


def parse_metrics_spec(text: str) -> MetricsSpec:
    """``tensorboard:DIR`` or ``jsonl:FILE``; ``ValueError`` naming the spec otherwise (an unknown kind, no
    path, a path of the wrong sort: a file for a folder or the reverse)."""
    kind, sep, path = text.partition(":")
    if kind not in METRICS_KINDS:
        extra = " (wandb is not supported: use tensorboard)" if kind == "wandb" else ""
        raise ValueError(f"--metrics {text!r}: unknown kind {kind!r}, expected one of "
                         f"{', '.join(f'{k}:PATH' for k in METRICS_KINDS)}{extra}")
    if not sep or not path.strip():
        what = "DIR" if kind == "tensorboard" else "FILE"
        raise ValueError(f"--metrics {text!r}: needs a {'folder' if what == 'DIR' else 'file'}: {kind}:{what}")
    spec = MetricsSpec(kind, Path(path).expanduser())
    if kind == "tensorboard" and spec.path.exists() and not spec.path.is_dir():
        raise ValueError(f"--metrics {text!r}: {spec.path} exists and is not a folder")
    if kind == "jsonl" and spec.path.is_dir():
        raise ValueError(f"--metrics {text!r}: {spec.path} is a folder, not a file")
    return spec


class Sink(Protocol):
    """Receives every event the learner logs."""

    def write(self, event: Event) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, appended and flushed at once (a killed learner loses nothing it logged)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, event: Event) -> None:
        self._file.write(json.dumps(event.to_json()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ScalarTracker:
    """Which TensorBoard scalars an event gives, as ``(tag, value, step)``; pure bookkeeping, no I/O.

    - ``train/loss``: the event's ``loss`` (the latest inner step's), once per step;
    - ``train/tokens`` and ``train/tokens_per_s``: tokens trained on, and the rate since the last rate point
      (over at least :data:`RATE_MIN_S` of the events' DHT ``time``);
    - ``eval/loss``: an ``eval`` event's ``eval_loss`` (the anchors, on held-out batches);
    - per ``round`` event: ``rounds/committed`` and ``rounds/discarded`` (counts so far),
      ``rounds/group_size``, ``rounds/duration_s``, ``rounds/bytes_sent``, ``rounds/bytes_received`` (this
      round), ``comm/bytes_sent`` and ``comm/bytes_received`` (totals so far);
    - any other event kind: ``events/<kind>``, its count so far (``resync``, ``local_drop``, ``checkpoint``...).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._loss_step = -1
        self._tokens = -1
        self._rate_from: tuple[float, int] | None = None

    def scalars(self, event: Event) -> list[tuple[str, float, int]]:
        if not _number(event.step):
            return []
        step = int(event.step)
        out: list[tuple[str, float, int]] = []
        loss = event.loss
        if _number(loss) and step > self._loss_step:
            out.append(("train/loss", float(loss), step))
            self._loss_step = step
        tokens, now = event.tokens, event.time
        if _number(tokens) and tokens > self._tokens:
            out.append(("train/tokens", float(tokens), step))
            self._tokens = int(tokens)
        if _number(tokens) and _number(now):
            if self._rate_from is None or tokens < self._rate_from[1]:
                self._rate_from = (float(now), int(tokens))
            elif now - self._rate_from[0] >= RATE_MIN_S and tokens > self._rate_from[1]:
                rate = (tokens - self._rate_from[1]) / (now - self._rate_from[0])
                out.append(("train/tokens_per_s", rate, step))
                self._rate_from = (float(now), int(tokens))
        if isinstance(event, EvalEvent):
            if _number(event.eval_loss):
                out.append(("eval/loss", float(event.eval_loss), step))
        elif isinstance(event, RoundEvent):
            self.counts[event.outcome] += 1
            out += [("rounds/committed", float(self.counts["committed"]), step),
                    ("rounds/discarded", float(self.counts["discarded"]), step)]
            for key, value in (("group_size", event.group_size), ("duration_s", event.duration_s),
                               ("bytes_sent", event.bytes_sent), ("bytes_received", event.bytes_received)):
                if _number(value):
                    out.append((f"rounds/{key}", float(value), step))
            self.bytes_sent += event.bytes_sent
            self.bytes_received += event.bytes_received
            out += [("comm/bytes_sent", float(self.bytes_sent), step),
                    ("comm/bytes_received", float(self.bytes_received), step)]
        elif event.kind:
            self.counts[event.kind] += 1
            out.append((f"events/{event.kind}", float(self.counts[event.kind]), step))
        return out


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _summary_writer() -> Any:
    """torch's SummaryWriter class; ``ValueError`` if the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(f"--metrics tensorboard: needs the tensorboard package (pip install tensorboard): {e}") from e
    return SummaryWriter


class TensorBoardSink:
    """TensorBoard scalars (:class:`ScalarTracker`) in an event file under ``logdir``, via torch's
    ``SummaryWriter``; the event's DHT ``time`` is the wall time of its points."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = Path(logdir)
        self.tracker = ScalarTracker()
        self._writer = _summary_writer()(log_dir=str(self.logdir), flush_secs=TENSORBOARD_FLUSH_S)

    def write(self, event: Event) -> None:
        walltime = float(event.time) if _number(event.time) else None
        for tag, value, step in self.tracker.scalars(event):
            self._writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def close(self) -> None:
        self._writer.close()


def open_sink(spec: MetricsSpec) -> Sink:
    if spec.kind == "tensorboard":
        return TensorBoardSink(spec.path)
    if spec.kind == "jsonl":
        return JsonlSink(spec.path)
    raise ValueError(f"--metrics {spec.text!r}: unknown kind {spec.kind!r}")


def check_available(specs: Sequence[MetricsSpec]) -> None:
    """Fail now (``ValueError``), not once training started, if a sink's package is missing."""
    if any(s.kind == "tensorboard" for s in specs):
        _summary_writer()


class EventLog:
    """Fans every event out to its sinks, one event at a time (thread-safe: the learner's status, eval and
    checkpoint threads log events too)."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        with self._lock:
            for sink in self.sinks:
                sink.write(event)

    def close(self) -> None:
        """Close every sink, even if one fails (the first failure is raised after the others are closed)."""
        failure: BaseException | None = None
        with self._lock:
            for sink in self.sinks:
                try:
                    sink.close()
                except Exception as e:  # raised below, after the other sinks have had their chance
                    log.error("closing metrics sink %s failed: %s", type(sink).__name__, e)
                    failure = failure or e
        if failure is not None:
            raise failure


def open_event_log(events_path: Path | None, specs: Sequence[MetricsSpec] = ()) -> EventLog | None:
    """The learner's event log: ``--events FILE`` (JSONL) and each ``--metrics`` sink; None when neither."""
    sinks: list[Sink] = []
    try:
        if events_path is not None:
            sinks.append(JsonlSink(events_path))
        for spec in specs:
            sinks.append(open_sink(spec))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return EventLog(sinks) if sinks else None
