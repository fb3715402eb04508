"""``scripts/wan/relay.py``: the delaying TCP relay that gives the emulated WAN its latency.

Loopback only, no root: the relay runs as a subprocess (as the harness runs it) on 127.0.0.1 with a port the
OS picks, in front of a small echo server. Time is only ever bounded from below (the delay is a property of the
relay); nothing asserts how fast anything is."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts_loader import load_script

relay = load_script("wan/relay.py", "relay")

RELAY = Path(__file__).resolve().parents[2] / "scripts" / "wan" / "relay.py"
DELAY_MS = 100.0
START_TIMEOUT_S = 20.0
"""A relay subprocess prints its address within this (generous: a loaded machine)."""
IO_TIMEOUT_S = 30.0
"""Socket operations in the tests; only a hang would reach it."""


class EchoServer:
    """Echoes every connection on 127.0.0.1 until its client half-closes, then closes (``close_after``: close
    after that many bytes instead, to test a server-side close)."""

    def __init__(self, close_after: int | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.close_after = close_after
        self.saw_eof = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by close()
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        seen = 0
        with conn:
            while self.close_after is None or seen < self.close_after:
                data = conn.recv(1 << 16)
                if not data:
                    self.saw_eof.set()
                    return
                seen += len(data)
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


def start_relay(target_port: int, *extra: str) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, str(RELAY), "--listen", "127.0.0.1:0", "--target",
                          f"127.0.0.1:{target_port}", "--delay-ms", f"{DELAY_MS:g}", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = [""]
    reader = threading.Thread(target=lambda: line.__setitem__(0, p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(START_TIMEOUT_S)
    if not line[0].startswith("listening on 127.0.0.1:"):
        p.kill()
        raise AssertionError(f"relay did not start: {line[0]!r} {p.communicate()[1]!r}")
    return p, int(line[0].strip().rsplit(":", 1)[1])


def stop(p: subprocess.Popen[str]) -> int:
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=START_TIMEOUT_S)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture()
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture()
def relayed(echo: EchoServer) -> Iterator[int]:
    """The port of a relay in front of ``echo``; the relay must exit 0 on SIGTERM afterwards."""
    p, port = start_relay(echo.port)
    yield port
    assert stop(p) == 0


def connect(port: int) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c


def round_trip_s(c: socket.socket) -> float:
    t = time.monotonic()
    c.sendall(b"p")
    assert c.recv(1) == b"p"
    return time.monotonic() - t


def test_bytes_arrive_intact_and_in_order_both_ways(relayed: int) -> None:
    data = os.urandom(4 << 20)
    got = bytearray()

    def read() -> None:
        while len(got) < len(data):
            chunk = c.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    with connect(relayed) as c:
        reader = threading.Thread(target=read)
        reader.start()
        c.sendall(data)  # client -> relay -> echo -> relay -> client
        reader.join(IO_TIMEOUT_S)
    assert bytes(got) == data


def test_a_round_trip_takes_at_least_twice_the_delay(relayed: int) -> None:
    with connect(relayed) as c:
        times = [round_trip_s(c) for _ in range(3)]
    assert min(times) >= 2 * DELAY_MS / 1e3


def test_a_source_delay_replaces_the_default_for_that_address(echo: EchoServer) -> None:
    p, port = start_relay(echo.port, "--source-delay-ms", "127.0.0.1=150")
    try:
        with connect(port) as c:
            assert round_trip_s(c) >= 2 * 0.150
    finally:
        assert stop(p) == 0


def test_closing_the_client_closes_the_server_side_and_back(relayed: int, echo: EchoServer) -> None:
    with connect(relayed) as c:
        c.sendall(b"last words")
        c.shutdown(socket.SHUT_WR)  # the echo server sees end of stream, closes; that comes back to us
        got = b""
        while chunk := c.recv(64):
            got += chunk
    assert got == b"last words"
    assert echo.saw_eof.wait(IO_TIMEOUT_S)


def test_closing_the_server_closes_the_client() -> None:
    server = EchoServer(close_after=1)
    p, port = start_relay(server.port)
    try:
        with connect(port) as c:
            c.sendall(b"x")
            assert c.recv(64) == b"x"
            assert c.recv(64) == b""  # the server closed after one byte: the relay passed it on
    finally:
        server.close()
        assert stop(p) == 0


def test_an_unreachable_target_closes_the_incoming_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead_port = s.getsockname()[1]  # closed again before the relay dials it
    p, port = start_relay(dead_port)
    try:
        with connect(port) as c:
            try:
                assert c.recv(64) == b""
            except ConnectionResetError:
                pass  # a reset is a close too
    finally:
        assert stop(p) == 0


@pytest.mark.parametrize("args, message", [
    (["--listen", "127.0.0.1", "--target", "127.0.0.1:1", "--delay-ms", "5"], "--listen '127.0.0.1': expected HOST:PORT"),
    (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:0", "--delay-ms", "5"], "--target '127.0.0.1:0': port must be"),
    (["--listen", "myhost:5", "--target", "127.0.0.1:1", "--delay-ms", "5"], "is not an IPv4 address"),
    (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:x", "--delay-ms", "5"], "is not a number"),
    (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--delay-ms", "-1"], "--delay-ms: delay must be in"),
    (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--delay-ms", "nan"], "--delay-ms: delay must be in"),
    (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--delay-ms", "5", "--source-delay-ms", "10.0.0.1"],
     "expected IP=MS"),
    (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1"], "--delay-ms"),
])
def test_bad_arguments_give_one_line(args: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(RELAY), *args], capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("relay: error: ")
    assert message in res.stderr


def test_the_delay_line_stops_taking_chunks_when_full() -> None:
    async def scenario() -> tuple[bool, bool]:
        line = relay.DelayLine(max_bytes=10)
        await line.put(0.0, b"0123456789")  # full now
        blocked = asyncio.create_task(line.put(0.0, b"x"))
        await asyncio.sleep(0.05)
        was_blocked = not blocked.done()
        assert await line.get() == (0.0, b"0123456789")
        await asyncio.wait_for(blocked, IO_TIMEOUT_S)
        return was_blocked, await line.get() == (0.0, b"x")

    assert asyncio.run(scenario()) == (True, True)


def test_sigterm_with_a_connection_open_exits_0_and_closes_it(echo: EchoServer) -> None:
    p, port = start_relay(echo.port)
    with connect(port) as c:
        assert round_trip_s(c) > 0  # the connection is up through the relay
        assert stop(p) == 0
        try:
            assert c.recv(64) == b""
        except ConnectionResetError:
            pass  # a reset is a close too
