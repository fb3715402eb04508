"""User-given multiaddrs: each malformed value gets one precise line naming the bad part."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2p_diloco.net.addresses import (
    AddressError, host_multiaddr, parse_announce_address, parse_initial_peers, parse_peer_address,
)

PID = "QmRSLzsXh75eE8qsybQkfgAz4wHaSjHTB4uqrbmtMnpVY1"
GOOD = f"/ip4/127.0.0.1/tcp/4001/p2p/{PID}"


@pytest.mark.parametrize(
    "text, must_contain",
    [
        ("/ip4/999.1.1.1/tcp/1", "bad part '/ip4/999.1.1.1'"),
        ("/ip4/127.0.0.1/tcp/x", "bad part '/tcp/x'"),
        ("/ip4/127.0.0.1/tcp/1", "missing the peer id part '/p2p/<peer id>'"),
        ("/ip4/127.0.0.1/tcp/99999/p2p/" + PID, "bad part '/tcp/99999'"),
        ("/ip4/127.0.0.1/tcp/0/p2p/" + PID, "bad part '/tcp/0'"),
        ("/ip4/127.0.0.1/tcp/1/p2p/QmBad", "bad part '/p2p/QmBad'"),
        ("/ip4/1.2.3.4/foo/1", "unknown protocol '/foo'"),
        ("127.0.0.1:4001", "must start with '/' (write /ip4/127.0.0.1/tcp/4001/p2p/<peer id>)"),
        ("/tcp/1/p2p/" + PID, "must start with a host part"),
        ("/ip4/127.0.0.1/p2p/" + PID, "missing the transport part '/tcp/PORT'"),
        ("/ip4/127.0.0.1/tcp/", "part '/tcp' has no value"),
        (f"/ip4/127.0.0.1/tcp/1/p2p/{PID}/tcp/2", "must come last"),
    ],
)
def test_malformed_addresses_name_the_bad_part(text: str, must_contain: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_peer_address(text)
    message = str(info.value)
    assert must_contain in message
    assert "\n" not in message
    assert message.startswith(f"--initial-peers {text!r}")
    assert isinstance(info.value, ValueError)


def test_good_address_parts() -> None:
    a = parse_peer_address(GOOD)
    assert (a.host, a.port, a.transport, a.peer_id, a.text) == ("127.0.0.1", 4001, "tcp", PID, GOOD)
    assert parse_peer_address(f"/dns4/localhost/tcp/5/p2p/{PID}").host == "localhost"


def test_initial_peers_split_and_dedup() -> None:
    other = f"/ip4/127.0.0.1/tcp/4002/p2p/{PID}"
    peers = parse_initial_peers([f"{GOOD},{other}", GOOD, f" {other} "])
    assert [p.text for p in peers] == [GOOD, other]
    assert parse_initial_peers([]) == ()


def test_announce_and_host() -> None:
    assert parse_announce_address("/ip4/192.168.1.5/tcp/31337") == "/ip4/192.168.1.5/tcp/31337"
    with pytest.raises(AddressError, match="leave out the '/p2p/"):
        parse_announce_address(GOOD)
    with pytest.raises(AddressError, match="bad part '/tcp/0'"):
        parse_announce_address("/ip4/192.168.1.5/tcp/0")
    assert host_multiaddr("0.0.0.0", 0) == "/ip4/0.0.0.0/tcp/0"
    assert host_multiaddr("::1", 5) == "/ip6/::1/tcp/5"
    with pytest.raises(AddressError, match=r"--host '1\.2\.3'"):
        host_multiaddr("1.2.3", 5)
    with pytest.raises(AddressError, match="--port 70000"):
        host_multiaddr("127.0.0.1", 70000)


@pytest.mark.parametrize("bad, part", [("/ip4/999.1.1.1/tcp/1", "/ip4/999.1.1.1"), ("/ip4/127.0.0.1/tcp/x", "/tcp/x"),
                                       ("/ip4/127.0.0.1/tcp/1", "/p2p/")])
def test_cli_prints_one_line_and_exits_2(bad: str, part: str) -> None:
    # the address is checked before hivemind is imported, so this is fast
    proc = subprocess.run([sys.executable, "-m", "p2p_diloco.cli.main", "status", "--initial-peers", bad],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("p2p-diloco: error: --initial-peers") and part in lines[0]
    assert proc.stdout == ""
