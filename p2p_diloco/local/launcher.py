"""Start ``p2p-diloco`` subcommands as child processes on this machine, and always stop them.

Used by ``p2p-diloco swarm``, the benchmarks in ``scripts/`` and the tests (``tests/procs.py``). Each child runs in its own session
(process group), so stopping the group stops what it started too (hivemind's DHT and averager
processes, ``p2pd``). :class:`LocalSwarm` is a context manager: leaving it, however, stops every
child it started -- gracefully first (SIGTERM: a learner finishes its round, publishes a tombstone,
prints its ``final`` line), then by SIGKILL after ``grace_s``.

Only the standard library (and the stdlib-only :mod:`p2p_diloco.core.waiting` and
:mod:`p2p_diloco.hivemind_ext.procguard`) is imported here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
from signal import Signals  # the annotation inside the class, where the method `signal` hides the module
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from p2p_diloco.core.waiting import WaitTimeout, poll_until
from p2p_diloco.hivemind_ext.procguard import session_members, signal_session

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Bootstrap start: importing hivemind (which imports torch) takes 3-10 s on a busy 2-core machine."""
FINAL_RE = re.compile(r"^final (\{.*\})$")
LINE_POLL_S = 0.2
"""Longest wait between two looks for an awaited line (a new line ends the wait at once)."""
REAP_TIMEOUT_S = 10.0
"""After SIGKILL of a child's group and session: how long reaping it may take."""
SESSION_POLL_S = 0.05
"""Seconds between two looks at a killed child's session while its processes die."""
READER_JOIN_S = 5.0
"""After a child exited: how long its output readers may take to read what is left in the pipes."""
OUTPUT_TAIL_CHARS = 4000
"""How much of a child's stderr a failure message shows."""
HAVE_PROC = os.path.isdir("/proc")
"""Session walking reads ``/proc`` (Linux); elsewhere a child's group is all we stop."""
NO_STEP_LIMIT = 1_000_000_000
"""Inner steps that no learner reaches: the step cap of a learner whose time budget alone ends its training
(a time-budgeted benchmark must not end early on a fast machine because the step cap came first). Used as
``join --steps`` (the LR schedule keeps ``inner.total_steps``) or as ``inner.total_steps`` itself (then the
warm-up + cosine of a ``--max-time`` learner runs over its time only: :func:`p2p_diloco.core.inner.schedule_step`)."""
PAGE_CHILD = "page"
"""The child of a :class:`LocalSwarm` that serves its page (``swarm --serve``): not a learner."""


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


class ChildProcess:
    """One child process in a session of its own, its output read line by line as it comes.

    The one place that starts, watches and stops children: ``p2p-diloco swarm``, the benchmarks and the
    tests' ``procs.Proc`` build on it. A new session (``start_new_session``) makes the child the leader of
    its own process group *and* session: a signal to the group reaches what a terminal's Ctrl+C would, and
    the session holds the whole peer (hivemind's DHT and averager processes and ``p2pd`` move to groups of
    their own, but stay in the session: :func:`p2p_diloco.hivemind_ext.procguard.session_members`).

    ``stdout`` (and ``stderr``, unless ``stderr_log`` names a file that takes it) are kept as
    ``(time.monotonic() of arrival, line)`` pairs, so that callers can wait for a line and tell when it came.
    """

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str], cwd: Path | None = None,
                 stderr_log: Path | None = None) -> None:
        self.argv, self.name = list(argv), name
        self.log_path = stderr_log
        self._log = stderr_log.open("w") if stderr_log is not None else None
        self.popen = subprocess.Popen(self.argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=self._log if self._log is not None else subprocess.PIPE,
                                      text=True, bufsize=1, start_new_session=True)
        self.started_at = time.monotonic()
        self.stdout: list[tuple[float, str]] = []
        self.stderr: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        pipes = [(self.popen.stdout, self.stdout), (self.popen.stderr, self.stderr)]
        self._readers = [threading.Thread(target=self._read, args=(stream, sink), name=f"read-{name}", daemon=True)
                         for stream, sink in pipes if stream is not None]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str], sink: list[tuple[float, str]]) -> None:
        for raw in stream:
            line, now = raw.rstrip("\n"), time.monotonic()
            with self._cond:
                self._on_line(sink, now, line)
                sink.append((now, line))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _on_line(self, sink: list[tuple[float, str]], at: float, line: str) -> None:
        """Called (under the lock) for every line before it is kept: a subclass notes events as they arrive."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def _sink(self, stream: str) -> list[tuple[float, str]]:
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r}")
        if stream == "stderr" and self._log is not None:
            raise ValueError(f"{self.name}: its stderr goes to {self.log_path}, not kept in memory")
        return self.stdout if stream == "stdout" else self.stderr

    def find(self, pattern: str | re.Pattern[str], stream: str = "stdout") -> re.Match[str] | None:
        """The first line of ``stream`` so far that matches ``pattern``."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        with self._cond:
            for _, line in self._sink(stream):
                m = rx.search(line)
                if m:
                    return m
        return None

    def line_time(self, pattern: str, stream: str = "stdout") -> float | None:
        """When (``time.monotonic()``) the first line of ``stream`` matching ``pattern`` arrived; None if none has."""
        rx = re.compile(pattern)
        with self._cond:
            return next((t for t, line in self._sink(stream) if rx.search(line)), None)

    def wait_for(self, pattern: str, timeout_s: float, stream: str = "stdout") -> re.Match[str]:
        """The first line of ``stream`` matching ``pattern``, once it has come. :class:`WaitTimeout` after
        ``timeout_s``, :class:`ChildExited` if the child ended without printing it; both carry :meth:`output`."""
        rx = re.compile(pattern)

        def printed() -> re.Match[str] | None:
            m = self.find(rx, stream)
            if m is None and not self.alive and not any(r.is_alive() for r in self._readers):
                raise ChildExited(f"{self.name}: exited with code {self.popen.returncode} before printing "
                                  f"{pattern!r}\n{self.output()}")
            return m

        return poll_until(printed, timeout_s, f"{self.name}: a line matching {pattern!r}", LINE_POLL_S,
                          detail=self.output, nap=self._nap)

    def _nap(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the next line (or the end of the output)."""
        with self._cond:
            self._cond.wait(seconds)

    def wait_exit(self, timeout_s: float) -> int:
        """The exit code, once the child has exited and its output is read; :class:`WaitTimeout` after ``timeout_s``."""
        try:
            rc = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise WaitTimeout(f"{self.name}: its exit", timeout_s, self.output()) from None
        for reader in self._readers:
            reader.join(timeout=READER_JOIN_S)
        return rc

    def signal(self, sig: Signals) -> None:
        """Signal the main process only (as ``kill PID`` does): on SIGTERM a peer leaves gracefully and stops its
        own children (its DHT and averager processes and p2pd must stay up until it has left)."""
        if self.alive:
            self.popen.send_signal(sig)

    def signal_group(self, sig: Signals) -> None:
        """Signal the main process's group (as ``kill -- -PGID`` or a terminal's Ctrl+C does). The helpers have
        groups of their own and follow the main process (:mod:`p2p_diloco.hivemind_ext.procguard`)."""
        try:
            os.killpg(self.popen.pid, sig)  # start_new_session: the child leads its own group
        except ProcessLookupError:  # the group is already gone: nothing left to signal
            pass

    def session(self) -> list[tuple[int, str]]:
        """(pid, command name) of every live process of this child's session, helpers included (Linux only)."""
        return session_members(self.pid) if HAVE_PROC else []

    def signal_session(self, sig: Signals) -> int:
        """Send ``sig`` to every process of this child's session; returns how many it reached (Linux only)."""
        return signal_session(self.pid, sig) if HAVE_PROC else 0

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the main process, wait up to ``grace_s`` for it to leave, then :meth:`kill`; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit %.0f s after SIGTERM; killing it", self.name, grace_s)
        self.kill()
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the group and the session (the CLI, its DHT and averager processes, its p2pd), even if the
        leader already exited; reap it and close its output. Nothing of it survives, whatever its state."""
        self.signal_group(signal.SIGKILL)
        self.signal_session(signal.SIGKILL)
        try:
            self.popen.wait(timeout=REAP_TIMEOUT_S)
            # a killed helper (reparented, not our child) may take a moment to die on a loaded machine: the caller
            # -- e.g. ``swarm`` exiting on Ctrl+C -- must not return while one still runs
            deadline = time.monotonic() + REAP_TIMEOUT_S
            while (left := self.session()) and time.monotonic() < deadline:
                time.sleep(SESSION_POLL_S)
            if left:
                logger.warning("%s: %d processes of its session still run %.0f s after SIGKILL: %s", self.name,
                               len(left), REAP_TIMEOUT_S, left)
        finally:
            for reader in self._readers:
                reader.join(timeout=READER_JOIN_S)
            for stream in (self.popen.stdout, self.popen.stderr, self._log):
                if stream is not None:
                    stream.close()

    def output(self) -> str:
        """Everything it printed so far (stderr's last lines), for failure messages."""
        with self._cond:
            out = "\n".join(line for _, line in self.stdout)
            err = "\n".join(line for _, line in self.stderr)
        if self.log_path is not None:
            err = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            err = f"(in {self.log_path})\n{err}"
        return (f"--- {self.name} argv: {' '.join(self.argv)}\n--- stdout:\n{out}\n"
                f"--- stderr:\n{err[-OUTPUT_TAIL_CHARS:]}")


class ChildExited(RuntimeError):
    """A child exited before printing what was awaited."""


class Child(ChildProcess):
    """One ``p2p-diloco`` subcommand: stdout lines kept, stderr written to ``log``; notes when its ``final`` came.
    A learner (``join``) runs with ``-v``: its log file is for reading afterwards, a line per round (and the
    benchmarks read it)."""

    def __init__(self, name: str, args: Sequence[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> None:
        self.final_at: float | None = None
        """When (``time.monotonic()``) its ``final`` line arrived: which learners finished together."""
        if args and args[0] == "join" and not {"-v", "--verbose"} & set(args):
            args = [args[0], "-v", *args[1:]]
        super().__init__(cli_argv(*args), name, env, cwd, stderr_log=log)

    def _on_line(self, sink: list[tuple[float, str]], at: float, line: str) -> None:
        if sink is self.stdout and self.final_at is None and FINAL_RE.match(line):
            self.final_at = at

    @property
    def lines(self) -> list[str]:
        """Its stdout lines so far."""
        with self._cond:
            return [line for _, line in self.stdout]

    def final(self) -> dict[str, Any] | None:
        """A learner's ``final`` JSON summary, once printed."""
        m = self.find(FINAL_RE)
        return json.loads(m.group(1)) if m else None


def cli_argv(*args: str) -> list[str]:
    """The command line of a ``p2p-diloco`` subcommand run by this Python (the virtualenv's, in tests)."""
    return [sys.executable, "-m", "p2p_diloco.cli.main", *args]


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

    def start_page(self, host: str, port: int, *extra: str) -> str:
        """Start ``status --serve HOST:PORT`` on the run (after :meth:`start_bootstrap`); returns the line it printed
        once serving (where the page is, and who can reach it)."""
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        page = self.start(PAGE_CHILD, ["status", "--initial-peers", self.initial_peers, "--serve", where, *extra])
        return page.wait_for(r"^(serving the swarm's page at .*)$", START_TIMEOUT_S).group(1)

    def learners(self) -> list[Child]:
        return [c for c in self.children if c.name not in ("boot", PAGE_CHILD)]

    def wait_finals(self, timeout_s: float, what: str, progress: Callable[[float], None] | None = None,
                    period_s: float = 30.0, poll_s: float = 1.0) -> dict[str, dict[str, Any]]:
        """Every learner's ``final`` summary, by name; ``progress(elapsed_s)`` every ``period_s`` meanwhile.
        RuntimeError naming ``what`` and the logs if a learner exits without one or ``timeout_s`` passes."""
        t0 = time.monotonic()
        next_report = t0 + period_s

        def all_final() -> dict[str, dict[str, Any]] | None:
            nonlocal next_report
            pending = [c for c in self.learners() if c.final() is None]
            if not pending:
                return {c.name: c.final() for c in self.learners()}  # type: ignore[misc]
            dead = [c for c in pending if not c.alive]
            if dead:
                raise ChildExited(f"{what}: {dead[0].name} exited without a final line; see the logs in {self.logs}")
            if progress is not None and time.monotonic() >= next_report:
                next_report += period_s
                progress(time.monotonic() - t0)
            return None

        return poll_until(all_final, timeout_s, f"{what}: every learner's final line", poll_s,
                          detail=lambda: f"see the logs in {self.logs}")

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
