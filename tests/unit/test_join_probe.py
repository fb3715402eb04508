"""What a failed join says about an initial peer's address (:func:`~p2p_diloco.net.membership.tcp_probe` and
:func:`~p2p_diloco.net.membership.explain_join_failure`), on real loopback sockets: a closed port, a port where
another program listens, and -- where this machine lets the test drop packets -- an unreachable host."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest

from p2p_diloco.net.addresses import parse_initial_peers
from p2p_diloco.net.membership import HANDSHAKE_FAILED, SwarmOptions, explain_join_failure, tcp_probe

PEER_ID = "12D3KooWG2rGRLwZHVBC2UGmDu2NUmW4JmQtR8jn7vaiURxKPUVK"
DROPPED_HOST = "127.0.0.79"
"""A loopback address whose packets the unreachable case drops with iptables (its own rule, removed after)."""


def address(host: str, port: int):  # type: ignore[no-untyped-def]
    return parse_initial_peers([f"/ip4/{host}/tcp/{port}/p2p/{PEER_ID}"], "initial_peers")[0]


def join_error(host: str, port: int) -> str:
    opts = SwarmOptions(initial_peers=(address(host, port),))
    return str(explain_join_failure(RuntimeError("failed to connect to bootstrap peers"), opts))


def test_a_closed_port_is_refused_in_words() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    assert tcp_probe(address("127.0.0.1", port)) == "connection refused: the host is up but nothing listens on that port"
    assert "connection refused" in join_error("127.0.0.1", port)


def test_a_port_of_another_program_says_the_handshake_failed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert tcp_probe(address("127.0.0.1", port)) is None
        text = join_error("127.0.0.1", port)
    assert HANDSHAKE_FAILED in text and "\n" not in text


@pytest.fixture
def dropped_host() -> Iterator[str]:
    iptables = shutil.which("iptables")
    if iptables is None or os.geteuid() != 0:
        pytest.skip("needs root and iptables to drop packets to a loopback address")
    rule = ["OUTPUT", "-d", DROPPED_HOST, "-p", "tcp", "-j", "DROP"]
    added = subprocess.run([iptables, "-A", *rule], capture_output=True, text=True)
    if added.returncode != 0:
        pytest.skip(f"iptables refused the rule: {added.stderr.strip()}")
    try:
        yield DROPPED_HOST
    finally:
        subprocess.run([iptables, "-D", *rule], check=True)


def test_an_unreachable_host_is_not_said_to_have_an_open_port(dropped_host: str) -> None:
    why = tcp_probe(address(dropped_host, 4444), timeout_s=0.5)
    assert why is not None and why.startswith("no answer within 0.5 s: the host is unreachable"), why
    assert "port open" not in join_error(dropped_host, 4444) and "TCP connection opened" not in join_error(dropped_host, 4444)
