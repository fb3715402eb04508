"""procguard's pieces on their own: our signal handlers survive hivemind, the /proc session walk, and
the bounded shutdown of a helper process (the whole paths are in test_signals.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from p2p_diloco.hivemind_ext import procguard

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")


def test_handlers_kept_puts_back_what_hivemind_replaces() -> None:
    def ours(_signum: int, _frame: Any) -> None:
        pass

    before = signal.signal(signal.SIGINT, ours)
    try:
        with procguard.handlers_kept():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # what DecentralizedAverager.run_in_background does
        assert signal.getsignal(signal.SIGINT) is ours
    finally:
        signal.signal(signal.SIGINT, before)


def test_session_members_finds_a_whole_session_and_signal_session_reaches_it() -> None:
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60; wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(procguard.session_members(leader.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = procguard.session_members(leader.pid)
        assert sorted(comm for _, comm in members) == ["sh", "sleep", "sleep"], members
        assert procguard.signal_session(leader.pid, signal.SIGKILL) == 3
        leader.wait(timeout=20)
        deadline = time.monotonic() + 20
        while procguard.session_members(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procguard.session_members(leader.pid) == []
    finally:
        procguard.signal_session(leader.pid, signal.SIGKILL)


class _Stubborn(mp.Process):
    """A helper whose graceful shutdown never works and which ignores SIGTERM (as a forked child that
    inherited a Python-level SIGTERM handler did)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.shutdowns = 0
        self.ignoring = mp.Event()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.ignoring.set()
        while True:
            time.sleep(1)

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.terminate()


def test_stop_process_kills_a_helper_that_ignores_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procguard, "TERMINATE_WAIT_S", 0.5)
    proc = _Stubborn()
    proc.start()
    assert proc.ignoring.wait(timeout=30)
    procguard.stop_process(proc, "stubborn helper")
    assert proc.shutdowns == 1
    assert not proc.is_alive() and proc.exitcode == -signal.SIGKILL
