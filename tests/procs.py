"""Run real ``p2p-diloco`` processes in tests: start, wait for a line, signal, and always clean up.

Each process is started in its own session (process group), so that killing the group also
kills what it started (the hivemind DHT process and its ``p2pd``). :class:`ProcGroup` kills every
group it started on exit, whatever happened. Deadlines are explicit and generous (the test
machine is shared with long benchmarks); no test asserts on speed.

Usage::

    with ProcGroup(tmp_path) as procs:
        boot = procs.cli("bootstrap", "--identity", str(tmp_path / "boot.id"))
        addr = boot.wait_for(r"^initial peers: (\\S+)", timeout_s=60).group(1)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from p2p_diloco.hivemind_ext.procguard import session_members, signal_session

START_TIMEOUT_S = 60.0
"""Generous: importing hivemind (which imports torch) takes 3-10 s on a busy 2-core machine."""
EXIT_TIMEOUT_S = 30.0


class Proc:
    """One child process with its stdout/stderr collected line by line in background threads."""

    def __init__(self, argv: Sequence[str], cwd: Path, env: dict[str, str], name: str):
        self.argv, self.name = list(argv), name
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(
            self.argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, bufsize=1,
        )
        self.pgid = self.popen.pid  # start_new_session: the child leads its own group
        self.stdout: list[tuple[float, str]] = []
        self.stderr: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self.stderr), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: "subprocess.IO[str]", sink: list[tuple[float, str]]) -> None:
        for line in stream:
            with self._cond:
                sink.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_for(self, pattern: str, timeout_s: float = START_TIMEOUT_S, stream: str = "stdout") -> re.Match[str]:
        """Wait until a line of ``stream`` matches ``pattern``; fail with everything printed so far."""
        regex = re.compile(pattern)
        sink = self.stdout if stream == "stdout" else self.stderr
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for _, line in sink[seen:]:
                    m = regex.search(line)
                    if m:
                        return m
                seen = len(sink)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{self.name}: no line matching {pattern!r} within {timeout_s:.0f} s\n{self.output()}")
                if self.popen.poll() is not None and not any(t.is_alive() for t in self._readers):
                    raise AssertionError(f"{self.name}: exited with {self.popen.returncode} before printing "
                                         f"{pattern!r}\n{self.output()}")
                self._cond.wait(min(remaining, 0.2))

    def line_time(self, pattern: str, stream: str = "stdout") -> float:
        """Monotonic time at which the first line matching ``pattern`` arrived."""
        regex = re.compile(pattern)
        with self._cond:
            for t, line in self.stdout if stream == "stdout" else self.stderr:
                if regex.search(line):
                    return t
        raise AssertionError(f"{self.name}: no line matching {pattern!r}\n{self.output()}")

    def wait_exit(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        try:
            rc = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name}: still running after {timeout_s:.0f} s\n{self.output()}") from None
        for t in self._readers:
            t.join(timeout=5)
        return rc

    def send(self, sig: signal.Signals) -> None:
        """Signal the main process only (as a user's ``kill PID`` does)."""
        self.popen.send_signal(sig)

    def kill_group(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal the main process's group (as ``kill -- -PGID`` or a terminal's Ctrl+C does). The
        helpers (DHT, averagers, p2pd) have groups of their own and follow the main process
        (:mod:`p2p_diloco.hivemind_ext.procguard`): with SIGKILL this is a crash of the peer."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:  # the group is already gone: nothing left to kill
            pass

    def session(self) -> list[tuple[int, str]]:
        """(pid, command name) of every live process of this peer: its session (we started it as the
        leader of a new one), helpers included."""
        return session_members(self.pid)

    def kill_session(self) -> None:
        """SIGKILL every process of this peer's session: nothing of it survives, whatever its state."""
        signal_session(self.pid, signal.SIGKILL)

    def output(self) -> str:
        with self._cond:
            out = "\n".join(line for _, line in self.stdout)
            err = "\n".join(line for _, line in self.stderr)
        return f"--- {self.name} argv: {' '.join(self.argv)}\n--- stdout:\n{out}\n--- stderr:\n{err[-4000:]}"


class ProcGroup:
    """Starts processes and kills every process group it started on exit (``finally`` semantics)."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.procs: list[Proc] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.workdir))

    def cli(self, *args: str, name: str | None = None) -> Proc:
        argv = [sys.executable, "-m", "p2p_diloco.cli.main", *args]
        proc = Proc(argv, self.workdir, self.env, name or f"{args[0]}#{len(self.procs)}")
        self.procs.append(proc)
        return proc

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
        for proc in self.procs:
            proc.kill_group(signal.SIGKILL)
            proc.kill_session()
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=10)
            finally:
                for stream in (proc.popen.stdout, proc.popen.stderr):
                    if stream is not None:
                        stream.close()


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

    def until(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> tuple[dict[str, Any], float]:
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            lines = self.proc.stdout[self.consumed:]
            for t, line in lines:
                self.consumed += 1
                last = json.loads(line)
                if predicate(last):
                    return last, t
            if self.proc.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"status never showed {what} within {timeout_s:.0f} s; last snapshot: "
                             f"{json.dumps(last)[:2000]}\n{self.proc.output()}")


def live_names(snapshot: dict[str, Any]) -> set[str]:
    return {p["name"] for p in snapshot["peers"] if p["status"] == "live"}
