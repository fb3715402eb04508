"""No orphans: hivemind's helper processes die with the process that started them.

hivemind runs its DHT and every averager in forked processes, and each DHT starts a ``p2pd``
daemon. When the main process is killed with SIGKILL (or crashes) none of them notices: the DHT
process is re-parented to init and keeps its ``p2pd`` (and a place in the swarm) forever — seen
here with ``kill -9`` of a member. Linux's ``PR_SET_PDEATHSIG`` makes the kernel signal a child
when its parent dies; :func:`install` sets it for every forked child (``os.register_at_fork``) and
for every ``p2pd`` hivemind launches (a ``preexec_fn`` on its ``create_subprocess_exec``), so a
kill of the main process takes the whole tree down. On other platforms it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import sys
from typing import Any, Callable

log = logging.getLogger(__name__)

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


def install() -> None:
    """Make every process hivemind forks or spawns from now on die with its parent. Idempotent."""
    global _installed
    if _installed or _LIBC is None:
        return
    os.register_at_fork(after_in_child=die_with_parent)

    from hivemind.p2p import p2p_daemon  # the module that launches p2pd

    original: Callable[..., Any] = p2p_daemon.asyncio.subprocess.create_subprocess_exec

    @functools.wraps(original)
    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", die_with_parent)
        return await original(*args, **kwargs)

    # patch only the reference hivemind's daemon module uses, not asyncio for everyone
    p2p_daemon.asyncio = _AsyncioProxy(p2p_daemon.asyncio, create_subprocess_exec)  # type: ignore[attr-defined]
    _installed = True
    log.debug("procguard: child processes will die with their parent")


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
