"""No orphans, no hangs: hivemind's helper processes live and die with the process that started them.

hivemind runs its DHT and every averager in forked processes, and each DHT starts a ``p2pd``
daemon. Three things go wrong with them, each seen here:

* **kill -9 of the main process** (or a crash): none of them notices; the DHT process is re-parented
  to init and keeps its ``p2pd`` (and a place in the swarm) forever. Linux's ``PR_SET_PDEATHSIG``
  makes the kernel signal a child when its parent dies: :func:`install` sets it for every forked
  child (``os.register_at_fork``) and for every ``p2pd`` hivemind launches (a ``preexec_fn`` on its
  ``create_subprocess_exec``, which runs the same at-fork hook), so the whole tree goes down.
* **A signal to the whole process group** (Ctrl+C in a terminal, ``timeout``, ``kill -- -PGID``,
  service managers): it reached the helpers too. ``p2pd`` died at once, so the main process could
  not publish its tombstone; a forked child had inherited our Python-level SIGTERM handler (which
  only sets an event in *its* copy of memory), so it ignored the signal and, later, the
  ``terminate()`` that multiprocessing's exit handler sends before it joins the child without a
  timeout: the peer hung for minutes. So every helper moves to a process group of its own
  (group signals reach only the main process, which shuts its helpers down in order), SIGTERM is
  reset to its default there (``terminate()`` works) and SIGINT is ignored (the main process owns
  Ctrl+C).
* **hivemind takes our Ctrl+C**: ``DecentralizedAverager.run_in_background`` sets SIGINT to
  ``SIG_IGN`` in the *calling* process. :func:`handlers_kept` puts our handlers back.

:func:`stop_process` bounds a helper's shutdown: hivemind's graceful ``shutdown()``, then SIGTERM,
then SIGKILL, each with a named timeout. On other platforms than Linux the kernel part does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Protocol

from p2p_diloco.hivemind_ext import require_hivemind

log = logging.getLogger(__name__)

TERMINATE_WAIT_S = 5.0
"""After a helper's graceful shutdown timed out: how long SIGTERM may take to end it."""
KILL_WAIT_S = 5.0
"""After SIGTERM: how long to wait for the process to be reaped after SIGKILL."""

_PR_SET_PDEATHSIG = 1
_installed = False
# resolved once, up front: die_with_parent also runs between fork and exec, where nothing may
# spawn a process or take a lock (find_library does both)
_LIBC: ctypes.CDLL | None = (
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    if _LIBC is None:
        return
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def own_group_and_default_signals() -> None:
    """In a freshly forked helper: leave the parent's process group, so that a signal to that group
    (Ctrl+C, ``timeout``, ``kill -- -PGID``) reaches only the main process; SIGTERM back to its
    default (multiprocessing's ``terminate()`` must end us: an inherited Python handler would only set
    an event in our copy of the parent's memory); SIGINT ignored (the main process owns Ctrl+C)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _after_fork_in_child() -> None:
    die_with_parent()
    own_group_and_default_signals()


def install() -> None:
    """Make every process hivemind forks or spawns from now on die with its parent, in a process group
    of its own, with default SIGTERM handling (:func:`own_group_and_default_signals`). Idempotent."""
    global _installed
    if _installed or _LIBC is None:
        return
    require_hivemind(__name__)  # we patch the asyncio that hivemind's daemon module reads
    os.register_at_fork(after_in_child=_after_fork_in_child)

    from hivemind.p2p import p2p_daemon  # the module that launches p2pd

    original: Callable[..., Any] = p2p_daemon.asyncio.subprocess.create_subprocess_exec

    @functools.wraps(original)
    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", die_with_parent)
        return await original(*args, **kwargs)

    # patch only the reference hivemind's daemon module uses, not asyncio for everyone
    p2p_daemon.asyncio = _AsyncioProxy(p2p_daemon.asyncio, create_subprocess_exec)
    _installed = True
    log.debug("procguard: child processes will die with their parent")


@contextlib.contextmanager
def handlers_kept(signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Put back, on exit, the handlers of ``signals`` that were in place on entry.

    hivemind's ``DecentralizedAverager.run_in_background`` sets SIGINT to ``SIG_IGN`` in the calling
    process (verified in 1.1.12), so after an averager starts Ctrl+C no longer reached our handler and
    a learner trained on. Only the main thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in signals}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None and signal.getsignal(s) != handler:
                signal.signal(s, handler)


class _Process(Protocol):
    """What :func:`stop_process` needs of a hivemind DHT or averager (a ``multiprocessing.Process``)."""

    def shutdown(self) -> None: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def stop_process(proc: _Process, what: str) -> None:
    """Shut a hivemind helper process down within bounded time: its own ``shutdown()`` (which waits
    for its ``shutdown_timeout`` and then sends SIGTERM), then :data:`TERMINATE_WAIT_S` for SIGTERM to
    work, then SIGKILL and :data:`KILL_WAIT_S`. Logs each escalation; never waits forever."""
    if proc.is_alive():
        proc.shutdown()
    if not proc.is_alive():
        return
    proc.join(TERMINATE_WAIT_S)  # shutdown() sent SIGTERM after its grace period
    if proc.is_alive():
        log.warning("%s did not exit %.0f s after SIGTERM; killing it", what, TERMINATE_WAIT_S)
        proc.kill()
        proc.join(KILL_WAIT_S)
        if proc.is_alive():
            log.error("%s still alive %.0f s after SIGKILL", what, KILL_WAIT_S)


def session_members(sid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every live (non-zombie) process in session ``sid``, from ``/proc``.

    A peer started as a session leader (``start_new_session``) keeps its helpers in its session even
    though they have process groups of their own: this is how to find (or signal) the whole peer."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # the process ended while we looked
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append((int(entry.name), comm))
    return found


def signal_session(sid: int, sig: int) -> int:
    """Send ``sig`` to every process of session ``sid`` (e.g. SIGSTOP/SIGCONT to freeze a whole peer,
    helpers included); returns how many processes it reached."""
    sent = 0
    for pid, _ in session_members(sid):
        try:
            os.kill(pid, sig)
            sent += 1
        except ProcessLookupError:  # it ended in between
            pass
    return sent


class _AsyncioProxy:
    """``asyncio`` as seen by hivemind's daemon module, with ``subprocess.create_subprocess_exec`` wrapped."""

    def __init__(self, real: Any, create_subprocess_exec: Callable[..., Any]) -> None:
        self._real = real
        self.subprocess = _SubprocessProxy(real.subprocess, create_subprocess_exec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _SubprocessProxy:
    def __init__(self, real: Any, create_subprocess_exec: Callable[..., Any]) -> None:
        self._real = real
        self.create_subprocess_exec = create_subprocess_exec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)
