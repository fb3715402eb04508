#!/usr/bin/env python3
"""A delaying TCP relay: latency for the emulated WAN, because ``sch_netem`` is missing on this kernel.

It listens on one address and forwards every accepted connection to one target, holding each chunk
read in either direction for a fixed delay before writing it on. A connection through one relay
therefore has a round trip of at least twice the delay (plus whatever the links add), and the
byte stream is unchanged: order is kept per direction, an end of stream (FIN) is passed on as a
half-close after the same delay, and a reset on either side resets both.

Why a relay and not ``tc``: the kernel has no netem, and a token bucket only adds queueing. The
harness (``netns.py``) runs one relay per service inside each emulated host: the service binds to
127.0.0.1 of its namespace and announces the relay's bridge address, so the relay is the only way in
and every connection between two hosts crosses exactly one relay (the dialled host's).

The delay may depend on the connecting address (``--source-delay-ms IP=MS``), which is how a ragged
host (one host farther away than the others) is expressed: the dialled host's relay knows who dials.

Back-pressure: each direction queues at most :data:`MAX_QUEUED_BYTES`; above that the relay stops
reading from that side, so a slow receiver slows the sender down as TCP would. Nothing polls: each
direction is one reading task and one writing task that sleep until data or its due time arrives.

    python scripts/wan/relay.py --listen 10.77.0.1:31337 --target 127.0.0.1:31337 --delay-ms 50

Prints ``listening on HOST:PORT`` (the real port when 0 was given) once it accepts connections, and
exits 0 on SIGTERM or SIGINT. Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

log = logging.getLogger("wan.relay")

CHUNK_BYTES = 64 * 1024
"""Largest read from a socket at a time (one queued chunk)."""
MAX_QUEUED_BYTES = 8 * 1024 * 1024
"""Per connection and direction: stop reading above this (covers 200 Mbit/s x 300 ms in flight)."""
MAX_DELAY_MS = 10_000.0
"""Refuse longer delays: a typo rather than a WAN."""
CONNECT_TIMEOUT_S = 10.0
"""Dialling the target; a connection that cannot reach it is closed."""
CLOSE_TIMEOUT_S = 5.0
"""Waiting for a transport to close after the relay is stopped."""


class RelayError(ValueError):
    """A bad argument, reported as one line."""


# ---------------------------------------------------------------- arguments (pure)


def parse_endpoint(text: str, *, flag: str, allow_port_zero: bool) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv4 address or ``localhost``) -> (host, port); RelayError naming ``flag``."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise RelayError(f"{flag} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:31337")
    if host != "localhost":
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise RelayError(f"{flag} {text!r}: {host!r} is not an IPv4 address") from None
    try:
        port = int(port_text)
    except ValueError:
        raise RelayError(f"{flag} {text!r}: port {port_text!r} is not a number") from None
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise RelayError(f"{flag} {text!r}: port must be in [{low}, 65535]")
    return host, port


def check_delay_ms(delay_ms: float, flag: str = "--delay-ms") -> float:
    if not 0 <= delay_ms <= MAX_DELAY_MS:  # also refuses NaN
        raise RelayError(f"{flag}: delay must be in [0, {MAX_DELAY_MS:g}] ms, got {delay_ms:g}")
    return delay_ms


def parse_source_delay(text: str) -> tuple[str, float]:
    """``IP=MS`` -> (ip, ms): the delay for connections coming from that address."""
    ip, sep, ms = text.partition("=")
    if not sep:
        raise RelayError(f"--source-delay-ms {text!r}: expected IP=MS, e.g. 10.77.0.4=150")
    try:
        ipaddress.IPv4Address(ip)
    except ValueError:
        raise RelayError(f"--source-delay-ms {text!r}: {ip!r} is not an IPv4 address") from None
    try:
        value = float(ms)
    except ValueError:
        raise RelayError(f"--source-delay-ms {text!r}: {ms!r} is not a number of milliseconds") from None
    return ip, check_delay_ms(value, "--source-delay-ms")


@dataclass(frozen=True)
class RelayConfig:
    """What one relay does; built from the command line by :func:`parse_args`."""

    listen: tuple[str, int]
    """Where to accept connections (port 0: any free port, printed at start)."""
    target: tuple[str, int]
    """Where each accepted connection is forwarded."""
    delay_ms: float
    """One-way delay added in each direction, for connections from addresses not in ``source_delay_ms``."""
    source_delay_ms: Mapping[str, float] = field(default_factory=dict)
    """Per connecting IPv4 address, its one-way delay instead of ``delay_ms``."""

    def delay_s_for(self, source_ip: str) -> float:
        """The one-way delay (s) of a connection from ``source_ip``: who dials decides the round trip."""
        return self.source_delay_ms.get(source_ip, self.delay_ms) / 1e3


# ---------------------------------------------------------------- one direction of one connection


class DelayLine:
    """A FIFO of (due time, chunk) with a cap on queued bytes: the in-flight data of one direction."""

    def __init__(self, max_bytes: int = MAX_QUEUED_BYTES) -> None:
        self._items: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued = 0
        self._max = max_bytes
        self._changed = asyncio.Condition()

    async def put(self, due: float, chunk: bytes) -> None:
        """Queue a chunk (empty: end of stream), first waiting while the line is full."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._queued < self._max)
            self._items.append((due, chunk))
            self._queued += len(chunk)
            self._changed.notify_all()

    async def get(self) -> tuple[float, bytes]:
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._items))
            due, chunk = self._items.popleft()
            self._queued -= len(chunk)
            self._changed.notify_all()
            return due, chunk


async def _read_into(reader: asyncio.StreamReader, line: DelayLine, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        chunk = await reader.read(CHUNK_BYTES)
        await line.put(loop.time() + delay_s, chunk)
        if not chunk:
            return


async def _write_from(line: DelayLine, writer: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due, chunk = await line.get()
        wait_s = due - loop.time()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        if not chunk:  # the sender half-closed: pass it on once its data is out
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            return
        writer.write(chunk)
        await writer.drain()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """One direction: read, hold for ``delay_s``, write; ends after passing on the end of stream."""
    line = DelayLine()
    async with asyncio.TaskGroup() as tg:  # a failure on either side cancels the other task
        tg.create_task(_read_into(reader, line, delay_s))
        tg.create_task(_write_from(line, writer))


# ---------------------------------------------------------------- the relay


class Relay:
    """Accepts on ``config.listen`` and pipes each connection to ``config.target`` with the delay."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> tuple[str, int]:
        """Start listening; returns the bound (host, port)."""
        host, port = self.config.listen
        self._server = await asyncio.start_server(self._connection, host, port, reuse_address=True)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        """Stop accepting and drop every connection (both sides reset: the relay is going away)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(self._conns, timeout=CLOSE_TIMEOUT_S)
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        """One accepted connection (asyncio runs this as its own task; tracked so that close() can cancel it)."""
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._relay(c_reader, c_writer)
        except asyncio.CancelledError:
            # close() dropped the connection (both sides reset already). Ending normally on purpose: asyncio 3.11's
            # stream callback calls task.exception() on a cancelled handler task and logs a traceback for it
            log.debug("relay: connection dropped on close")
        finally:
            self._conns.discard(task)

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        peer = c_writer.get_extra_info("peername")
        source = peer[0] if peer else ""  # gone already: the default delay, and the pipes will see the end
        delay_s = self.config.delay_s_for(source)
        t_host, t_port = self.config.target
        try:
            s_reader, s_writer = await asyncio.wait_for(asyncio.open_connection(t_host, t_port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            log.warning("relay: %s -> %s:%d failed (%s); closing the incoming connection", source, t_host, t_port,
                        e or type(e).__name__)
            c_writer.transport.abort()
            return
        writers = (c_writer, s_writer)
        for w in writers:
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the delay is ours, not Nagle's
        failed = False
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(_pipe(c_reader, s_writer, delay_s))
                    tg.create_task(_pipe(s_reader, c_writer, delay_s))
            except* OSError as eg:  # ConnectionResetError, BrokenPipeError, ...
                log.debug("relay: connection from %s ended with %s", source, eg.exceptions[0])
                failed = True
        except asyncio.CancelledError:  # the relay is closing
            failed = True
            raise
        finally:
            for w in writers:
                if failed:  # reset the other side too, so neither end waits for data that will not come
                    w.transport.abort()
                else:  # both directions passed their end of stream on: close normally
                    w.close()


async def serve(config: RelayConfig) -> None:
    """Run a relay until SIGTERM or SIGINT; prints where it listens once it accepts connections."""
    relay = Relay(config)
    host, port = await relay.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on {host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await relay.close()


# ---------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block
        self.exit(2, f"relay: error: {message}\n")


def parse_args(argv: Sequence[str] | None) -> RelayConfig:
    p = _Parser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="accept connections here (port 0: any)")
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="forward each connection here")
    p.add_argument("--delay-ms", required=True, type=float, metavar="MS",
                   help="one-way delay in each direction (round trip >= 2 x this)")
    p.add_argument("--source-delay-ms", action="append", default=[], metavar="IP=MS",
                   help="one-way delay for connections from IP instead (repeatable)")
    a = p.parse_args(argv)
    try:
        return RelayConfig(listen=parse_endpoint(a.listen, flag="--listen", allow_port_zero=True),
                           target=parse_endpoint(a.target, flag="--target", allow_port_zero=False),
                           delay_ms=check_delay_ms(a.delay_ms),
                           source_delay_ms=dict(parse_source_delay(s) for s in a.source_delay_ms))
    except RelayError as e:
        p.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        asyncio.run(serve(config))
    except OSError as e:  # e.g. the listen address is taken or not ours
        print(f"relay: error: cannot listen on {config.listen[0]}:{config.listen[1]} ({e.strerror or e})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
