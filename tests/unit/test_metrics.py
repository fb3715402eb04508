"""Metric sinks: the learner's events go to the JSONL file and to TensorBoard through one event log.

No processes: a fake event stream (records as the learner writes them) goes through the sinks and the
TensorBoard event file is read back with tensorboard's own ``EventAccumulator``.
"""

from __future__ import annotations

import collections
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from p2p_diloco.cli import main as cli
from p2p_diloco.net import joined as joined_module
from p2p_diloco.core.events import EvalEvent, Event, ResyncEvent, RoundEvent
from p2p_diloco.engine.engine import DiLoCo
from p2p_diloco.engine.metrics import (
    EventLog, JsonlSink, MetricsSpec, ScalarTracker, open_event_log, parse_metrics_spec,
)

ROOT = Path(__file__).resolve().parents[2]
PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


def _round(**fields: Any) -> RoundEvent:
    """A round event of peer-a; the fields no scalar comes from take plain values."""
    plain: dict[str, Any] = {
        "name": "peer-a", "reason": "ok", "peers": (), "own_share": 0.5, "weights": (), "arrival_spread_s": None,
        "window_s": 1.0, "allreduce_s": None, "rtt_s": None, "timeouts": None, "group_distance": None,
        "anchor_hash": "h", "tokens_sent": 0, "steps_sent": 0}
    return RoundEvent(**{**plain, "version_after": fields["version"] + 1, **fields})


def _stream() -> list[Event]:
    """Events as :meth:`Learner._event` logs them: name, step, tokens, DHT time, latest loss, then the event's own."""
    return [
        _round(step=6, tokens=768, time=1000.0, loss=5.1, fragment=0, version=0, outcome="committed", group_size=3,
               bytes_sent=1000, bytes_received=1200, duration_s=0.4),
        _round(step=12, tokens=1536, time=1002.0, loss=4.2, fragment=1, version=0, outcome="discarded", group_size=2,
               bytes_sent=500, bytes_received=0, duration_s=1.5),
        EvalEvent(name="peer-a", step=12, tokens=1536, time=1002.1, loss=4.2, eval_loss=4.5, train_s=10.0,
                  versions=(1, 0), batches=2),
        ResyncEvent(name="peer-a", step=18, tokens=2304, time=1004.0, loss=3.6, fragment=0, outcome="rebased"),
        _round(step=24, tokens=3072, time=1006.0, loss=None, fragment=0, version=1, outcome="committed", group_size=3,
               bytes_sent=1000, bytes_received=1100, duration_s=0.5),
    ]


def test_parse_metrics_spec(tmp_path: Path) -> None:
    assert parse_metrics_spec(f"tensorboard:{tmp_path}/tb") == MetricsSpec("tensorboard", tmp_path / "tb")
    assert parse_metrics_spec("jsonl:ev.jsonl") == MetricsSpec("jsonl", Path("ev.jsonl"))
    (tmp_path / "file").write_text("x")
    for text, expected in [
        ("statsd:x", "--metrics 'statsd:x': unknown kind 'statsd', expected one of tensorboard:PATH"),
        ("prometheus:x", "--metrics prometheus:x: expected [HOST:]PORT"),
        ("wandb:x", "wandb is not supported"),
        ("tensorboard", "--metrics 'tensorboard': needs a folder: tensorboard:DIR"),
        ("tensorboard: ", "needs a folder"),
        ("jsonl:", "needs a file: jsonl:FILE"),
        (f"tensorboard:{tmp_path / 'file'}", "exists and is not a folder"),
        (f"jsonl:{tmp_path}", "is a folder, not a file"),
    ]:
        with pytest.raises(ValueError) as e:
            parse_metrics_spec(text)
        assert expected in str(e.value) and "\n" not in str(e.value), (text, e.value)


def test_scalar_tracker_maps_events_to_scalars() -> None:
    tracker = ScalarTracker()
    got: dict[str, list[tuple[int, float]]] = {}
    for event in _stream():
        for tag, value, step in tracker.scalars(event):
            got.setdefault(tag, []).append((step, value))
    assert got["train/loss"] == [(6, 5.1), (12, 4.2), (18, 3.6)]  # once per step; a missing loss is skipped
    assert got["train/tokens"] == [(6, 768), (12, 1536), (18, 2304), (24, 3072)]
    assert got["train/tokens_per_s"] == [(12, 384.0), (18, 384.0), (24, 384.0)]
    assert got["eval/loss"] == [(12, 4.5)]
    assert got["rounds/committed"] == [(6, 1), (12, 1), (24, 2)]
    assert got["rounds/discarded"] == [(6, 0), (12, 1), (24, 1)]
    assert got["rounds/group_size"] == [(6, 3), (12, 2), (24, 3)]
    assert got["comm/bytes_sent"] == [(6, 1000), (12, 1500), (24, 2500)]
    assert got["comm/bytes_received"] == [(6, 1200), (12, 1200), (24, 2300)]
    assert got["rounds/duration_s"] == [(6, 0.4), (12, 1.5), (24, 0.5)]
    assert got["events/resync"] == [(18, 1)]


def test_tensorboard_and_jsonl_get_the_same_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    specs = [parse_metrics_spec(f"tensorboard:{tmp_path / 'tb'}")]
    log = open_event_log(tmp_path / "events.jsonl", specs)
    assert log is not None
    for event in _stream():
        log.write(event)
    log.close()
    assert [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()] == \
        [e.to_json() for e in _stream()]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "eval/loss", "rounds/committed", "rounds/discarded",
            "rounds/group_size", "comm/bytes_sent", "comm/bytes_received", "events/resync"} <= tags
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/loss")] == [(6, 5.1), (12, 4.2), (18, 3.6)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(12, 4.5)]
    assert [(e.step, e.value) for e in acc.Scalars("rounds/committed")] == [(6, 1.0), (12, 1.0), (24, 2.0)]
    assert [e.wall_time for e in acc.Scalars("eval/loss")] == [pytest.approx(1002.1)]  # the event's own time


def test_no_sink_means_no_event_log(tmp_path: Path) -> None:
    assert open_event_log(None, ()) is None


def test_the_engine_logs_through_the_event_log_and_to_its_subscribers(tmp_path: Path) -> None:
    """:meth:`DiLoCo.log_event` adds the common fields and hands the event to its event log, its subscribers and
    :meth:`DiLoCo.poll_events` (no swarm needed)."""
    written: list[dict[str, Any]] = []
    heard: list[dict[str, Any]] = []
    fake = SimpleNamespace(
        _events=SimpleNamespace(write=lambda e: written.append(e.to_json())), _events_lock=threading.Lock(),
        _recent=collections.deque(maxlen=4), _subscribers=[lambda e: heard.append(e.to_json())],
        joined=SimpleNamespace(name="peer-a"), inner_step=7, tokens=896, dht_time=lambda: 123.0, latest_loss=lambda: 4.0,
    )
    DiLoCo.log_event(fake, EvalEvent(eval_loss=4.4, train_s=1.5, versions=(0, 2), batches=2))  # type: ignore[arg-type]
    assert heard == written
    polled = DiLoCo.poll_events(fake)  # type: ignore[arg-type]
    assert [e.to_json() for e in polled] == written and DiLoCo.poll_events(fake) == []  # type: ignore[arg-type]
    assert written == [{"name": "peer-a", "step": 7, "tokens": 896, "time": 123.0, "loss": 4.0, "event": "eval",
                        "eval_loss": 4.4, "train_s": 1.5, "versions": [0, 2], "batches": 2}]


def test_event_log_closes_every_sink_even_if_one_fails(tmp_path: Path) -> None:
    class Broken:
        def write(self, record: Any) -> None: ...

        def close(self) -> None:
            raise OSError("disk gone")

    good = JsonlSink(tmp_path / "a.jsonl")
    with pytest.raises(OSError, match="disk gone"):
        EventLog([Broken(), good]).close()
    assert good._file.closed


def test_join_refuses_a_bad_metrics_spec_before_joining(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("joined before checking --metrics")

    monkeypatch.setattr(joined_module, "joined_run", never)
    for spec, expected in [("wandb:x", "unknown kind 'wandb'"), ("tensorboard", "needs a folder")]:
        rc = cli.main(["join", "--initial-peers", PEER, "--config", str(ROOT / "configs" / "tiny.toml"),
                       "--metrics", spec])
        out, err = capsys.readouterr()
        assert rc == 2 and out == "" and err.count("\n") == 1, (out, err)
        assert err.startswith("p2p-diloco: error: --metrics") and expected in err, err
