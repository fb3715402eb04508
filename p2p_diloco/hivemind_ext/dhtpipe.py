"""A DHT process that outlives a request whose sender has exited.

hivemind's DHT runs in a forked process and takes its requests over a pipe: ``(method, args,
kwargs)``, pickled, with an ``MPFuture`` whose answer pipe travels as a *file descriptor to fetch*
(``multiprocessing``'s resource sharer: the DHT process connects back to the sender to receive it).
Every averager process sends such requests too. When a learner leaves, its averager process may
exit with a request still in the DHT's pipe; unpickling it then fails -- connection refused once
the sender is gone (hivemind logs a traceback and goes on), or ``EOFError`` if the sender closes
mid-handshake, which hivemind does not catch: the DHT process died, its ``p2pd`` with it, and the
leaving learner could no longer publish its tombstone (verified on hivemind 1.1.12, seen in CI).

:class:`GuardedDHT` reads each request's bytes as hivemind does and drops, in one DEBUG line, one
that cannot be unpickled: nobody is left to wait for its answer. A broken pipe itself still ends
the process as before (the main process is gone).
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from hivemind.dht import DHT

from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # replaces the DHT's private request pipe (DHT._inner_pipe)

log = logging.getLogger(__name__)

DROPPED = "_drop_request"
"""The method name a request that cannot be read turns into (a no-op of :class:`GuardedDHT`)."""


class RequestPipe:
    """The DHT process's end of its request pipe; what hivemind's loop calls, and nothing else."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def fileno(self) -> int:
        return self._conn.fileno()

    def poll(self, timeout_s: float = 0.0) -> bool:
        return self._conn.poll(timeout_s)

    def recv(self) -> Any:
        data = self._conn.recv_bytes()  # EOF or a broken pipe: raised, as before
        try:
            return ForkingPickler.loads(data)
        except Exception as e:  # noqa: BLE001 -- whatever unpickling a dead sender's handles raises
            log.debug("dropped a DHT request whose sender has exited (%s: %s)", type(e).__name__, e)
            return DROPPED, [], {}


class GuardedDHT(DHT):
    """hivemind's :class:`~hivemind.dht.DHT` whose process survives a request it cannot unpickle."""

    def __init__(self, *args: Any, start: bool = False, await_ready: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, start=False, **kwargs)
        hivemind_end: Connection = vars(self)["_inner_pipe"]  # what hivemind's process loop reads
        self._inner_pipe = RequestPipe(hivemind_end)
        if start:
            self.run_in_background(await_ready=await_ready)

    async def _drop_request(self) -> None:
        """What a dropped request runs: nothing."""
