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
- ``prometheus:[HOST:]PORT`` (:class:`PrometheusSink`): the same figures' latest values on
  ``http://HOST:PORT/metrics`` in Prometheus's text format (prometheus_client's server; HOST 127.0.0.1 unless
  ``0.0.0.0`` is said explicitly), for the scraper an operator already runs.

wandb is not offered: it is not installed beside torch here, and its offline mode writes a folder that only
``wandb sync`` to a server makes viewable, which TensorBoard's local files already give without an account.

Only the standard library is imported at module level; tensorboard (through torch) only when a
``tensorboard`` sink is opened, prometheus_client only when a ``prometheus`` one is.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, TypeGuard

from p2p_diloco.core.events import Event, EvalEvent, ResyncEvent, RoundEvent
from p2p_diloco.net.dashboard import ServeAddress, parse_serve_address

log = logging.getLogger(__name__)

METRICS_KINDS = ("tensorboard", "jsonl", "prometheus")
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
    """A file or folder (``jsonl``, ``tensorboard``); unused (``Path()``) for ``prometheus``."""
    address: ServeAddress | None = None
    """``prometheus``: where its ``/metrics`` listens."""

    @property
    def text(self) -> str:
        if self.address is not None:
            return f"{self.kind}:{self.address.host}:{self.address.port}"
        return f"{self.kind}:{self.path}"


def parse_metrics_spec(text: str) -> MetricsSpec:
    """``tensorboard:DIR``, ``jsonl:FILE`` or ``prometheus:[HOST:]PORT``; ``ValueError`` naming the spec otherwise
    (an unknown kind, no path, a path of the wrong sort: a file for a folder or the reverse; a port that is no
    port, or a host other than this machine's loopback or an explicit 0.0.0.0)."""
    kind, sep, path = text.partition(":")
    if kind not in METRICS_KINDS:
        extra = " (wandb is not supported: use tensorboard)" if kind == "wandb" else ""
        raise ValueError(f"--metrics {text!r}: unknown kind {kind!r}, expected one of "
                         f"{', '.join(f'{k}:PATH' for k in METRICS_KINDS[:2])}, prometheus:[HOST:]PORT{extra}")
    if kind == "prometheus":
        if not sep or not path.strip():
            raise ValueError(f"--metrics {text!r}: needs a port: prometheus:PORT (or prometheus:0.0.0.0:PORT to "
                             f"be reachable from the network)")
        return MetricsSpec(kind, Path(), parse_serve_address(path, "--metrics prometheus:", sep=""))
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


PROMETHEUS_PREFIX = "p2p_diloco_learner_"
_GAUGES = {
    "train/loss": ("loss", "latest training loss (the run's loss unit)"),
    "train/tokens_per_s": ("tokens_per_second", "training tokens per second, over the last span of at least "
                           f"{RATE_MIN_S:g} s"),
    "eval/loss": ("eval_loss", "the global model's (the anchors') loss on held-out batches"),
    "rounds/group_size": ("round_group_size", "learners in the last round's group, us included"),
    "rounds/duration_s": ("round_duration_seconds", "seconds the last round took"),
}
"""ScalarTracker tags shown as gauges: ``p2p_diloco_learner_<name>`` and its help text."""


class PrometheusSink:
    """The learner's figures for a Prometheus scraper: the latest value of :class:`ScalarTracker`'s scalars,
    served by prometheus_client on ``http://HOST:PORT/metrics`` from a thread of its own.

    Every family has the label ``peer`` (the learner's name): tokens (``_tokens_total``), tokens/s, training
    and eval loss, rounds by ``outcome`` (``_rounds_total``), bytes by ``purpose`` (``averaging``: the rounds;
    ``state_download``: resyncs) and ``direction`` (``_bytes_total``), other events by ``kind``
    (``_events_total``) and the last round's group size and duration."""

    def __init__(self, address: ServeAddress) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.address = address
        self.tracker = ScalarTracker()
        self.name = ""
        self.values: dict[str, float] = {}
        self.download_bytes = 0
        self.watched: dict[str, tuple[str, Callable[[], float | None]]] = {}
        """Figures of the loop's own, read at each scrape (:meth:`watch`)."""
        self._lock = threading.Lock()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # prometheus_client duck-types collectors (collect())
        try:
            self._server, self._thread = start_http_server(address.port, address.host, registry)
        except OSError as e:
            raise ValueError(f"--metrics prometheus:{address.host}:{address.port}: cannot listen there "
                             f"({e.strerror or e})") from None
        log.info("serving the learner's metrics at %s", address.url("/metrics"))

    def write(self, event: Event) -> None:
        with self._lock:
            self.name = event.name or self.name
            for tag, value, _step in self.tracker.scalars(event):
                self.values[tag] = value
            if isinstance(event, ResyncEvent) and _number(event.bytes):
                self.download_bytes += int(event.bytes)

    def watch(self, metric: str, doc: str, read: Callable[[], float | None]) -> None:
        """Serve ``read()`` as the gauge ``metric`` at every scrape (None: not known yet, left out)."""
        with self._lock:
            self.watched[metric] = (doc, read)

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            values, counts, name = dict(self.values), dict(self.tracker.counts), self.name
            sent, received, download = self.tracker.bytes_sent, self.tracker.bytes_received, self.download_bytes
            watched = dict(self.watched)
        for tag, (metric, doc) in _GAUGES.items():
            if tag in values:
                gauge = GaugeMetricFamily(PROMETHEUS_PREFIX + metric, doc, labels=["peer"])
                gauge.add_metric([name], values[tag])
                yield gauge
        for metric, (doc, read) in sorted(watched.items()):
            value = read()
            if value is not None and math.isfinite(value):
                gauge = GaugeMetricFamily(PROMETHEUS_PREFIX + metric, doc, labels=["peer"])
                gauge.add_metric([name], value)
                yield gauge
        tokens = CounterMetricFamily(PROMETHEUS_PREFIX + "tokens", "training tokens consumed", labels=["peer"])
        tokens.add_metric([name], values.get("train/tokens", 0.0))
        rounds = CounterMetricFamily(PROMETHEUS_PREFIX + "rounds", "rounds that ended, by outcome",
                                     labels=["peer", "outcome"])
        for outcome in ("committed", "discarded"):
            rounds.add_metric([name, outcome], counts.get(outcome, 0))
        traffic = CounterMetricFamily(PROMETHEUS_PREFIX + "bytes", "bytes on the wire, by purpose and direction",
                                      labels=["peer", "purpose", "direction"])
        traffic.add_metric([name, "averaging", "sent"], sent)
        traffic.add_metric([name, "averaging", "received"], received)
        traffic.add_metric([name, "state_download", "received"], download)
        others = CounterMetricFamily(PROMETHEUS_PREFIX + "events", "other events, by kind", labels=["peer", "kind"])
        for kind, n in sorted(counts.items()):
            if kind not in ("committed", "discarded"):
                others.add_metric([name, kind], n)
        yield from (tokens, rounds, traffic, others)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def open_sink(spec: MetricsSpec) -> Sink:
    if spec.kind == "tensorboard":
        return TensorBoardSink(spec.path)
    if spec.kind == "jsonl":
        return JsonlSink(spec.path)
    if spec.kind == "prometheus" and spec.address is not None:
        return PrometheusSink(spec.address)
    raise ValueError(f"--metrics {spec.text!r}: unknown kind {spec.kind!r}")


def check_available(specs: Sequence[MetricsSpec]) -> None:
    """Fail now (``ValueError``), not once training started, if a sink's package is missing or a
    ``prometheus`` port is taken (tried by binding it and letting it go: one that something takes in between is
    refused when the sink opens, after joining)."""
    if any(s.kind == "tensorboard" for s in specs):
        _summary_writer()
    for spec in specs:
        if spec.address is not None:
            check_listen(spec.address, f"--metrics {spec.text}")


def check_listen(address: ServeAddress, flag: str) -> None:
    """``ValueError`` (one line naming ``flag``) if nothing could listen on ``address`` now."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP servers bind
        try:
            probe.bind((address.host, address.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"{flag}: port {address.port} is already in use; pick another port") from None
            raise ValueError(f"{flag}: cannot listen on {address.host}:{address.port} ({e.strerror or e})") from None


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

    def watch(self, metric: str, doc: str, read: Callable[[], float | None]) -> None:
        """A figure of the loop's own for the sinks that serve gauges (Prometheus: read at each scrape)."""
        for sink in self.sinks:
            if isinstance(sink, PrometheusSink):
                sink.watch(metric, doc, read)

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
