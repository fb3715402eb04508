"""Run real ``p2p-diloco`` processes in tests: start, wait for a line, signal, and always clean up.

Built on the launcher's child handling (:class:`p2p_diloco.local.launcher.ChildProcess`), the same code
``p2p-diloco swarm`` and the benchmarks use: each process is started in its own session, so that killing
the session also kills what it started (the hivemind DHT process and its ``p2pd``). :class:`ProcGroup`
kills every session it started on exit, whatever happened (the ``procs`` fixture in ``conftest.py`` is one
per test). Deadlines are explicit and generous (the test machine is shared with long benchmarks); no test
asserts on speed.

Usage::

    def test_something(procs: ProcGroup, tmp_path: Path) -> None:
        boot = procs.cli("bootstrap", "--identity", str(tmp_path / "boot.id"))
        addr = boot.wait_for(r"^initial peers: (\\S+)", timeout_s=60).group(1)
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

from p2p_diloco.core.waiting import poll_until
from p2p_diloco.local.launcher import ChildExited, ChildProcess, cli_argv

HEAVY = pytest.mark.xdist_group("heavy")
"""The integration tests that run four or more learner processes on a timing premise (a pause, a kill, a slow
learner's share): they run one after another on one pytest-xdist worker (``--dist loadgroup``), never two at once,
while the tier's other tests share the other workers (on 3 workers without it, a straggler test failed once: two such
tests at once are more learners than 2 cores pace)."""

START_TIMEOUT_S = 60.0
"""Generous: importing hivemind (which imports torch) takes 3-10 s on a busy 2-core machine."""
EXIT_TIMEOUT_S = 30.0
"""How long a process told to stop (or a short command) may take to exit."""
ORPHAN_DEADLINE_S = 20.0
"""After a peer's main process exited: how long its helpers (DHT process, averagers, p2pd) may take to follow."""
UNREACHABLE_PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
"""A well-formed address nobody listens on: for tests that never get as far as dialling it."""


class Proc(ChildProcess):
    """One child process with its stdout and stderr kept line by line (with arrival times) as they come."""

    def __init__(self, argv: Sequence[str], cwd: Path, env: dict[str, str], name: str) -> None:
        super().__init__(argv, name, env, cwd)

    def wait_for(self, pattern: str, timeout_s: float = START_TIMEOUT_S, stream: str = "stdout") -> re.Match[str]:
        """Wait until a line of ``stream`` matches ``pattern``; fail with everything printed so far."""
        return super().wait_for(pattern, timeout_s, stream)

    def line_time(self, pattern: str, stream: str = "stdout") -> float:
        """Monotonic time at which the first line matching ``pattern`` arrived."""
        t = super().line_time(pattern, stream)
        if t is None:
            raise AssertionError(f"{self.name}: no line matching {pattern!r}\n{self.output()}")
        return t

    def wait_exit(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        return super().wait_exit(timeout_s)

    def send(self, sig: signal.Signals) -> None:
        """Signal the main process only (as a user's ``kill PID`` does)."""
        self.signal(sig)

    def kill_group(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal the main process's group (as ``kill -- -PGID`` or a terminal's Ctrl+C does). The
        helpers (DHT, averagers, p2pd) have groups of their own and follow the main process
        (:mod:`p2p_diloco.hivemind_ext.procguard`): with SIGKILL this is a crash of the peer."""
        self.signal_group(sig)

    def kill_session(self) -> None:
        """SIGKILL every process of this peer's session: nothing of it survives, whatever its state."""
        self.signal_session(signal.SIGKILL)

    def wait_no_process_left(self, timeout_s: float = ORPHAN_DEADLINE_S) -> None:
        """Until no process of this peer's session is alive (its helpers followed the main process)."""
        poll_until(lambda: not self.session(), timeout_s, f"{self.name}: every process of its session gone",
                   detail=lambda: f"left: {self.session()}\n{self.output()}")


class ProcGroup:
    """Starts processes and kills every session it started on exit (``finally`` semantics)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.procs: list[Proc] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.workdir))

    def start(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None) -> Proc:
        """Any command (``env``: instead of :attr:`env`), killed with the rest on exit."""
        proc = Proc(argv, self.workdir, self.env if env is None else env, name)
        self.procs.append(proc)
        return proc

    def cli(self, *args: str, name: str | None = None) -> Proc:
        """A ``p2p-diloco`` subcommand."""
        return self.start(cli_argv(*args), name or f"{args[0]}#{len(self.procs)}")

    def run(self, *args: str, timeout_s: float = START_TIMEOUT_S) -> tuple[int, Proc, float]:
        """Run a command to completion; returns (exit code, the process, wall seconds)."""
        proc = self.cli(*args)
        rc = proc.wait_exit(timeout_s)
        return rc, proc, time.monotonic() - proc.started_at

    def __enter__(self) -> "ProcGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """SIGKILL every group and session first (none waits for another), then reap each; write each one's
        output to ``<workdir>/<name>.out``."""
        for proc in self.procs:
            proc.kill_group(signal.SIGKILL)
            proc.kill_session()
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:  # kept beside the test's other files: a failure on a loaded machine can be read after
            (self.workdir / f"{proc.name.replace('#', '-')}.out").write_text(proc.output())


def child_pids() -> list[int]:
    """Live child processes of this test process (from /proc), except torch's ``torch_shm_manager``: torch
    starts that daemon once per process when it first shares memory, and it is not a peer's."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        comm = stat.split("(", 1)[1].rsplit(")", 1)[0]
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and not comm.startswith("torch_shm"):
            found.append(int(entry.name))
    return found


# ---------------------------------------------------------------- p2p-diloco swarm helpers


def start_bootstrap(procs: ProcGroup, tmp: Path, *extra: str, name: str = "boot") -> str:
    boot = procs.cli("bootstrap", "--identity", str(tmp / f"{name}.id"), *extra, name=name)
    return boot.wait_for(r"^initial peers: (\S+)").group(1)


def start_member(procs: ProcGroup, peers: str, name: str, *extra: str, ttl_s: float = 3.0) -> Proc:
    return procs.cli("heartbeat", "--initial-peers", peers, "--name", name, "--ttl", str(ttl_s), *extra, name=name)


class StatusWatcher:
    """A long-running ``status --watch --json`` whose snapshots we poll (no process start per look)."""

    def __init__(self, proc: Proc):
        self.proc = proc
        self.consumed = 0
        self.last: dict[str, Any] = {}

    def until(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> tuple[dict[str, Any], float]:
        """The first new snapshot for which ``predicate`` holds, and when (monotonic) it arrived."""

        def shown() -> tuple[dict[str, Any], float] | None:
            for t, line in self.proc.stdout[self.consumed:]:
                self.consumed += 1
                self.last = json.loads(line)
                if predicate(self.last):
                    return self.last, t
            if not self.proc.alive:
                raise ChildExited(f"status exited before showing {what}\n{self.detail()}")
            return None

        return poll_until(shown, timeout_s, f"status showing {what}", detail=self.detail)

    def detail(self) -> str:
        return f"last snapshot: {json.dumps(self.last)[:2000]}\n{self.proc.output()}"


def live_names(snapshot: dict[str, Any]) -> set[str]:
    return {p["name"] for p in snapshot["peers"] if p["status"] == "live"}

