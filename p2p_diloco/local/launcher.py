"""Start ``p2p-diloco`` subcommands as child processes on this machine, and always stop them.

Used by ``p2p-diloco swarm`` and the benchmarks in ``scripts/``. Each child runs in its own session
(process group), so stopping the group stops what it started too (hivemind's DHT and averager
processes, ``p2pd``). :class:`LocalSwarm` is a context manager: leaving it, however, stops every
child it started -- gracefully first (SIGTERM: a learner finishes its round, publishes a tombstone,
prints its ``final`` line), then by SIGKILL after ``grace_s``.

Only the standard library is imported here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Bootstrap start: importing hivemind (which imports torch) takes 3-10 s on a busy 2-core machine."""
FINAL_RE = re.compile(r"^final (\{.*\})$")
NO_STEP_LIMIT = 1_000_000_000
"""Inner steps that no learner reaches: the step cap of a learner whose time budget alone ends its training
(a time-budgeted benchmark must not end early on a fast machine because the step cap came first). Used as
``join --steps`` (the LR schedule keeps ``inner.total_steps``) or as ``inner.total_steps`` itself (then the
warm-up + cosine of a ``--max-time`` learner runs over its time only: :func:`p2p_diloco.core.inner.schedule_step`)."""


def unlimited_steps(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with ``inner.total_steps`` = :data:`NO_STEP_LIMIT` put first, so that an explicit
    ``inner.total_steps`` among them still wins: for learners with ``--max-time`` whose LR runs over time."""
    return [f"inner.total_steps={NO_STEP_LIMIT}", *overrides]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a child writes (e.g. a learner's ``--events``); none if it does not
    exist yet; a last line being written, or cut by kill -9, is skipped."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Child:
    """One ``p2p-diloco`` subcommand in its own process group; stdout lines are kept, stderr goes to ``log``."""

    def __init__(self, name: str, args: Sequence[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log
        self._log = log.open("w")
        self.popen = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.main", *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                      start_new_session=True)
        self.started_at = time.monotonic()
        self.final_at: float | None = None
        """When (``time.monotonic()``) its ``final`` line arrived: which learners finished together."""
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(self.popen.stdout,), name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                if self.final_at is None and FINAL_RE.match(line.rstrip("\n")):
                    self.final_at = time.monotonic()
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def find(self, pattern: str | re.Pattern[str]) -> re.Match[str] | None:
        """The first stdout line so far that matches ``pattern``."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        with self._cond:
            for line in self.lines:
                m = rx.search(line)
                if m:
                    return m
        return None

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Wait for a stdout line matching ``pattern``; RuntimeError (naming the log) on timeout or exit."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.find(rx)
            if m:
                return m
            left = deadline - time.monotonic()
            if left <= 0 or (not self.alive and not self._reader.is_alive()):
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] if self.log_path.exists() else []
                raise RuntimeError(f"{self.name}: no line matching {pattern!r} within {timeout_s:.0f} s "
                                   f"(exit code {self.popen.poll()}; last log line: {tail[0] if tail else '-'}; "
                                   f"full log: {self.log_path})")
            with self._cond:
                self._cond.wait(min(left, 0.5))

    def final(self) -> dict[str, Any] | None:
        """A learner's ``final`` JSON summary, once printed."""
        m = self.find(FINAL_RE)
        return json.loads(m.group(1)) if m else None

    def signal(self, sig: signal.Signals) -> None:
        """Signal the ``p2p-diloco`` process only: on SIGTERM it leaves gracefully and stops its own
        children (its DHT and averager processes and p2pd must stay up until it has left)."""
        if self.alive:
            self.popen.send_signal(sig)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group, wait up to ``grace_s``, then SIGKILL it; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the whole group (the CLI, its DHT process, its p2pd), even if the leader already exited."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=10)
        finally:
            self._reader.join(timeout=2)
            self._log.close()


class LocalSwarm:
    """A bootstrap peer and learners on this machine, as child processes; all stopped on exit."""

    def __init__(self, logs: Path, grace_s: float = 60.0) -> None:
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        stale = [*self.logs.glob("*.jsonl"), *self.logs.glob("*.log")]
        for path in stale:  # learners append to their events files: a previous run's must not mix in
            path.unlink()
        if stale:
            logger.info("removed %d log and event files of a previous run from %s", len(stale), self.logs)
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="p2pds-", dir=_short_tmp()))  # this run's identities and sockets
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.tmp))
        self.initial_peers = ""

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self, name: str, args: Sequence[str]) -> Child:
        child = Child(name, args, self.logs / f"{name}.log", self.env)
        self.children.append(child)
        return child

    def start_bootstrap(self, *extra: str) -> str:
        """Start the bootstrap peer; returns its first full multiaddr (what ``--initial-peers`` takes)."""
        boot = self.start("boot", ["bootstrap", "--identity", str(self.tmp / "boot.id"), *extra])
        self.initial_peers = boot.wait_for(r"^initial peers: (\S+)", START_TIMEOUT_S).group(1)
        return self.initial_peers

    def learners(self) -> list[Child]:
        return [c for c in self.children if c.name != "boot"]

    def wait_finals(self, timeout_s: float, what: str, progress: Callable[[float], None] | None = None,
                    period_s: float = 30.0, poll_s: float = 1.0) -> dict[str, dict[str, Any]]:
        """Every learner's ``final`` summary, by name; ``progress(elapsed_s)`` every ``period_s`` meanwhile.
        RuntimeError naming ``what`` and the logs if a learner exits without one or ``timeout_s`` passes."""
        t0 = time.monotonic()
        next_report = t0 + period_s
        while True:
            pending = [c for c in self.learners() if c.final() is None]
            if not pending:
                return {c.name: c.final() for c in self.learners()}  # type: ignore[misc]
            dead = [c for c in pending if not c.alive]
            if dead or time.monotonic() - t0 > timeout_s:
                why = f"{dead[0].name} exited without a final line" if dead else f"no final lines within {timeout_s:.0f} s"
                raise RuntimeError(f"{what}: {why}; see the logs in {self.logs}")
            if progress is not None and time.monotonic() >= next_report:
                next_report += period_s
                progress(time.monotonic() - t0)
            time.sleep(poll_s)

    def close(self) -> None:
        """Stop every learner gracefully (in parallel), then everything else; nothing is left behind."""
        learners = [c for c in self.learners() if c.alive]
        for c in learners:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for c in learners:
            try:
                c.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            c.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


MAX_TMP_CHARS = 40
"""Unix socket paths are limited to 107 bytes: p2pd's and torch's shared-memory manager's sockets
live in TMPDIR, so the children's TMPDIR must be short."""


def _short_tmp() -> str:
    """The temp folder for children: the usual one if its path is short, else /tmp."""
    usual = tempfile.gettempdir()
    return usual if len(usual) <= MAX_TMP_CHARS or not os.path.isdir("/tmp") else "/tmp"
