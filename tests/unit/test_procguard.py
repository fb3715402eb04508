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

from p2p_diloco.core.waiting import poll_until
from p2p_diloco.hivemind_ext import procguard

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")

SESSION_DEADLINE_S = 20.0
"""Generous: starting (or reaping) three tiny processes takes milliseconds on an idle machine."""
SESSION_POLL_S = 0.05
"""/proc walks are cheap: look often."""


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
        def all_three() -> list[tuple[int, str]] | None:
            found = procguard.session_members(leader.pid)
            # a child forked but not yet exec'd still reads "sh": wait until both sleeps run
            return found if sorted(comm for _, comm in found) == ["sh", "sleep", "sleep"] else None

        members = poll_until(all_three, SESSION_DEADLINE_S, "sh and its two sleeps in the session", SESSION_POLL_S)
        assert len(members) == 3, members
        assert procguard.signal_session(leader.pid, signal.SIGKILL) == 3
        leader.wait(timeout=SESSION_DEADLINE_S)
        poll_until(lambda: procguard.session_members(leader.pid) == [], SESSION_DEADLINE_S,
                   "every process of the session gone", SESSION_POLL_S)
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
        while True:  # the behaviour under test: alive until SIGKILL, whatever else it is sent
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
