"""Output that does not shout: stderr holds warnings and errors unless ``-v``; a failure our code handles is one
line (its traceback with ``-v`` only); a SIGTERM leaves no asyncio or thread traceback; losses are named in the
tokenizer's unit; a swarm that ran no round compares no bytes and draws its plots without a warning.

Pure checks first; then the averager's own process (in-process averagers) and one swarm of real learners.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import multiprocessing as mp
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Iterator

import pytest

from test_learner_swarm import TINY

from p2p_diloco.averaging.runner import ExactAllReduceRunner

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120.0


@contextlib.contextmanager
def root_level(level: int) -> Iterator[None]:
    """The root logger at ``level`` (what ``-v`` sets: INFO with it, WARNING without), restored after."""
    root = logging.getLogger()
    before = root.level
    root.setLevel(level)
    try:
        yield
    finally:
        root.setLevel(before)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def captured(name: str) -> Iterator[list[logging.LogRecord]]:
    handler = Records()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


# ---------------------------------------------------------------- 1. logs at WARNING unless -v

SETUP_CHILD = """
import logging, os, sys
sys.path.insert(0, {root!r})
from p2p_diloco.cli.common import setup_logging
setup_logging({verbose!r})
logging.getLogger("p2p_diloco.engine.rounds").info("round f0 v1 committed")
logging.getLogger("p2p_diloco.engine.rounds").warning("a warning of ours")
import hivemind.utils.logging as hl
hl.get_logger("hivemind.averaging.averager").info("hivemind info")
hl.get_logger("hivemind.averaging.averager").warning("hivemind warning")
print(os.environ["HIVEMIND_LOGLEVEL"])
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_without_v_stderr_holds_warnings_only_ours_and_hiveminds(verbose: bool) -> None:
    # a quiet parent's HIVEMIND_LOGLEVEL=WARNING, inherited, does not hide hivemind's INFO from a child with -v
    env = {"PATH": "/usr/bin:/bin", "HIVEMIND_LOGLEVEL": "WARNING"}
    r = subprocess.run([sys.executable, "-c", SETUP_CHILD.format(root=str(REPO), verbose=verbose)],
                       capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "a warning of ours" in r.stderr and "hivemind warning" in r.stderr, r.stderr
    assert ("round f0 v1 committed" in r.stderr) == verbose and ("hivemind info" in r.stderr) == verbose, r.stderr
    assert r.stdout.split() == ["INFO" if verbose else "WARNING"]


def test_join_help_says_what_v_shows() -> None:
    from p2p_diloco.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["join"].format_help().split())
    assert "a line per round" in text and "Without it, stderr holds warnings and errors only" in text, text


# ---------------------------------------------------------------- 2. a handled failure is one line


def _step(logger: logging.Logger, inner: BaseException) -> None:
    """Logs as hivemind's ``DecentralizedAverager._step`` does (the filters go by the function's name)."""
    from hivemind.averaging.matchmaking import MatchmakingException

    try:
        try:
            raise inner
        except BaseException as e:
            raise MatchmakingException(f"Unable to run All-Reduce: {e}")  # noqa: B904 (as hivemind does)
    except MatchmakingException as e:
        logger.exception(e)


def _aggregate_with_group(logger: logging.Logger, inner: BaseException) -> None:
    try:
        raise inner
    except BaseException as e:
        logger.exception(e)


def finalize(logger: logging.Logger) -> None:
    logger.warning("Reducer: received 83.3% of input tensors")


def test_a_failed_round_is_one_warning_line_and_whole_with_v() -> None:
    from hivemind.averaging.partition import AllreduceException

    from p2p_diloco.hivemind_ext.logfilters import AVERAGER_LOGGER, quiet_expected_failures

    quiet_expected_failures()
    quiet_expected_failures()  # idempotent
    averager, partition = logging.getLogger(AVERAGER_LOGGER), logging.getLogger("hivemind.averaging.partition")
    partial = AllreduceException("partial all-reduce: 4352 of 20896 elements not averaged (a reducer failed)\n[x]")

    def log_a_failed_round() -> list[logging.LogRecord]:
        with captured(AVERAGER_LOGGER) as got, captured("hivemind.averaging.partition") as detail:
            finalize(partition)
            _aggregate_with_group(averager, partial)
            _step(averager, partial)
        return detail + got

    with root_level(logging.WARNING):  # no -v
        quiet = log_a_failed_round()
    [line] = quiet
    assert line.levelno == logging.WARNING and line.exc_info is None, line
    assert line.getMessage() == ("averaging round failed, discarded: Unable to run All-Reduce: partial all-reduce: "
                                 "4352 of 20896 elements not averaged (a reducer failed) [x]")
    with root_level(logging.INFO):  # -v: as hivemind wrote them
        loud = log_a_failed_round()
    assert [r.funcName for r in loud] == ["finalize", "_aggregate_with_group", "_step"]
    assert all(r.exc_info is not None for r in loud[1:]) and loud[2].levelno == logging.ERROR

    # not how a peer's failure looks (a bug of ours, perhaps): whole, with its traceback, even without -v
    with root_level(logging.WARNING), captured(AVERAGER_LOGGER) as got:
        _step(averager, TypeError("unsupported operand"))
    assert len(got) == 1 and got[0].exc_info is not None and got[0].levelno == logging.ERROR


def _handle_stream(logger: logging.Logger) -> None:
    """Logs as hivemind's ``P2P`` stream handler does when a peer's stream is cut mid-message."""
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except Exception:
        logger.warning("Exception while receiving requests:", exc_info=True)


def test_a_peer_stream_cut_mid_message_is_one_warning_line_and_whole_with_v() -> None:
    """A peer killed with kill -9 while it streams us a part: hivemind's warning with a traceback becomes one line."""
    from p2p_diloco.hivemind_ext.logfilters import quiet_expected_failures

    quiet_expected_failures()
    daemon = logging.getLogger("hivemind.p2p.p2p_daemon")
    with root_level(logging.WARNING), captured("hivemind.p2p.p2p_daemon") as quiet:
        _handle_stream(daemon)
    [line] = quiet
    assert line.exc_info is None and line.getMessage() == (
        "a peer's stream broke: Exception while receiving requests: ConnectionResetError: [Errno 104] Connection "
        "reset by peer"), line.getMessage()
    with root_level(logging.INFO), captured("hivemind.p2p.p2p_daemon") as loud:
        _handle_stream(daemon)
    assert len(loud) == 1 and loud[0].exc_info is not None


def test_our_own_handled_failures_are_one_line_and_whole_with_v() -> None:
    from p2p_diloco.core.logs import log_handled

    logger = logging.getLogger("p2p_diloco.test_quiet_output")
    for level, traceback in ((logging.WARNING, False), (logging.INFO, True)):
        with root_level(level), captured(logger.name) as got:
            try:
                raise TimeoutError("the DHT did not answer\nwithin 5 s")
            except TimeoutError:
                log_handled(logger, "heartbeat failed; retrying in %.1f s", 10.0)
        [record] = got
        assert record.levelno == logging.WARNING and bool(record.exc_info) == traceback
        assert record.funcName == "test_our_own_handled_failures_are_one_line_and_whole_with_v"  # where it failed
        assert record.getMessage() == "heartbeat failed; retrying in 10.0 s: TimeoutError: the DHT did not answer within 5 s"


# ---------------------------------------------------------------- 3. SIGTERM: no traceback from the averager


def test_stopping_an_averager_with_a_round_in_flight_raises_nothing() -> None:
    """hivemind 1.1.12's ``_shutdown`` calls ``finalize`` on the futures of ``_running_groups`` (AttributeError: a
    thread traceback at SIGTERM); ours cancels the running runner and the pending futures."""
    from hivemind.averaging import DecentralizedAverager

    from p2p_diloco.averaging.process import FragmentAveragerProcess

    finalized: list[dict[str, Any]] = []

    async def stop(shutdown: Any) -> tuple[asyncio.Future[Any], asyncio.Future[Any]]:
        running: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        running.set_result(SimpleNamespace(finalize=lambda **kw: finalized.append(kw)))
        pending: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        averager = FragmentAveragerProcess.__new__(FragmentAveragerProcess)  # no process: only the shutdown logic
        averager.client_mode, averager._running_groups = True, {b"running": running, b"pending": pending}
        averager.init_group_leading()  # as __init__ does: no group led
        averager._parent_pid = 0  # hivemind's __del__ stops the process only in the process that started it
        await shutdown(averager, 1.0)
        return running, pending

    with pytest.raises(AttributeError, match="finalize"):  # the bug our override is for (remove with it)
        asyncio.run(stop(DecentralizedAverager._shutdown))
    _, pending = asyncio.run(stop(FragmentAveragerProcess._shutdown))
    assert finalized == [{"cancel": True}] and pending.cancelled()


SLOWED = mp.Value(ctypes.c_int, 0)  # shared with the forked averager processes


class SlowReducer(ExactAllReduceRunner):
    """Reduces a remote sender's parts after a second: the all-reduce runs long enough to be cancelled, then
    succeeds."""

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[Any], sender_index: int) -> AsyncIterator[Any]:
        if self.sender_peer_ids[sender_index] != self.peer_id:
            with SLOWED.get_lock():
                SLOWED.value += 1
            await asyncio.sleep(1.0)
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            yield message


# ---------------------------------------------------------------- 1-3 with real learners


# ---------------------------------------------------------------- 4. the loss unit


def test_the_loss_unit_is_the_tokenizers() -> None:
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.tokenizer import loss_unit

    assert loss_unit(load_config(TINY)) == "nats/byte"
    assert loss_unit(SimpleNamespace(data=SimpleNamespace(tokenizer="tokenizers/bpe-4k"))) == "nats/token"


# ---------------------------------------------------------------- 5. a swarm that ran no round


def swarm_report(tmp_path: Path, rounds: int) -> dict[str, Any]:
    """The report of a 2-learner swarm on the tiny config whose learners' event files hold ``rounds`` rounds."""
    from p2p_diloco.core.config import load_config
    from p2p_diloco.local.run import build_report

    (tmp_path / "logs").mkdir(exist_ok=True)
    final = {"steps": 40, "tokens": 10240, "utilization": 0.9, "blocked_share": 0.0, "committed": [rounds, 0],
             "discarded": [0, 0], "eval_loss_start": 5.5, "eval_loss_end": 3.2, "anchor_hashes": ["a", "b"],
             "bytes_sent": 1000 * rounds}
    for name in ("l0", "l1"):
        (tmp_path / "logs" / f"{name}.jsonl").write_text("".join(
            json.dumps({"event": "round", "outcome": "committed", "reason": "ok"}) + "\n" for _ in range(rounds)))
    args = argparse.Namespace(overrides=[], peers=2, chaos=False, minutes=0.0)
    return build_report(load_config(TINY), TINY, args, {"l0": final, "l1": final}, [], tmp_path, 60.0)


def test_a_swarm_that_ran_no_round_compares_no_bytes(tmp_path: Path) -> None:
    from p2p_diloco.local.run import render_report

    report = swarm_report(tmp_path, rounds=0)
    text = render_report(report)
    assert "no round ran: no bytes to compare" in text and "MB for fp32" not in text, text
    assert report["loss_unit"] == "nats/byte" and "3.2000 nats/byte after 20,480 tokens" in text, text
    text = render_report(swarm_report(tmp_path, rounds=2))
    assert "no round ran" not in text and "bytes sent 0.00 MB vs" in text and "MB for fp32 data-parallel" in text, text
    assert "3.2000 nats/token after" in render_report({**report, "loss_unit": "nats/token"})


@pytest.mark.parametrize("logs", ["none", "no rounds"])
def test_the_plots_of_a_swarm_that_ran_no_round_raise_no_warning(tmp_path: Path, logs: str) -> None:
    from p2p_diloco.local.run import plot

    (tmp_path / "logs").mkdir()
    if logs == "no rounds":  # learners that never trained: an event file without rounds or evaluations
        (tmp_path / "logs" / "l0.jsonl").write_text(json.dumps({"event": "resync", "outcome": "rebased"}) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot(tmp_path, "nats/byte")
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "rounds.png").stat().st_size > 0


def test_the_loss_plot_is_labelled_with_the_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from p2p_diloco.local.run import plot

    labels: list[str] = []
    original = plt.Axes.set_ylabel
    monkeypatch.setattr(plt.Axes, "set_ylabel", lambda ax, label, *a, **k: (labels.append(label),
                                                                             original(ax, label, *a, **k))[1])
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "l0.jsonl").write_text(json.dumps({"event": "round", "outcome": "committed", "time": 1.0,
                                                            "loss": 3.0, "group_size": 2, "own_share": 0.5}) + "\n")
    plot(tmp_path, "nats/token")
    assert labels == ["loss (nats/token)"]
