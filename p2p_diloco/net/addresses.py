"""User-given multiaddrs (``--initial-peers``, ``--announce``): parse, validate, explain.

py-multiaddr does the parsing; we walk the address one ``/proto/value`` part at a time first so
that an error names the bad part (py-multiaddr's own message sometimes does not, e.g.
"invalid base 10 integer" for ``/tcp/x``). Every error is one line and a :class:`ValueError`, so
the CLI prints it as ``p2p-diloco: error: …`` and exits 2.

Imports only the standard library and py-multiaddr (no torch, no hivemind).
"""

from __future__ import annotations

import errno
import logging
import re
import socket
from dataclasses import dataclass
from typing import Iterable

from multiaddr import Multiaddr
from multiaddr import protocols as ma_protocols
from multiaddr.exceptions import Error as MultiaddrError

logger = logging.getLogger(__name__)

HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")
TRANSPORT_PROTOCOLS = ("tcp", "udp")


class AddressError(ValueError):
    """A malformed or unusable multiaddr; the message is one line naming the bad part."""


@dataclass(frozen=True)
class PeerAddress:
    """A validated peer multiaddr: ``/ip4/HOST/tcp/PORT/p2p/PEER_ID``."""

    text: str
    """The full multiaddr, normalised by py-multiaddr."""
    host_protocol: str
    """ip4, ip6, dns, dns4 or dns6."""
    host: str
    transport: str
    """tcp or udp."""
    port: int
    peer_id: str | None
    """Base58 peer id from the ``/p2p/…`` part; None only where it was not required."""

    def __str__(self) -> str:
        return self.text


def _reason(e: Exception) -> str:
    """py-multiaddr's message without the repeated address: "Invalid MultiAddr 'x': why (string: y)" -> "why"."""
    text = str(e)
    if text.startswith("Invalid MultiAddr") and "': " in text:
        text = text.split("': ", 1)[1]
    return re.sub(r" \(string: [^)]*\)$", "", text)


def _split_parts(text: str, flag: str) -> list[tuple[str, str | None]]:
    """Split ``/a/1/b/2`` into ``[("a", "1"), ("b", "2")]`` using the protocol registry."""
    if not text.startswith("/"):
        hint = ""
        if ":" in text and "/" not in text:
            host, _, port = text.rpartition(":")
            hint = f" (write /ip4/{host}/tcp/{port}/p2p/<peer id>)"
        raise AddressError(f"{flag} {text!r}: not a multiaddr, it must start with '/'{hint}")
    parts = text.split("/")[1:]
    if text.endswith("/"):
        parts = parts[:-1]
    result: list[tuple[str, str | None]] = []
    i = 0
    while i < len(parts):
        name = parts[i]
        if not name:
            raise AddressError(f"{flag} {text!r}: empty part '//' at position {i + 1}")
        try:
            proto = ma_protocols.protocol_with_name(name)
        except MultiaddrError:
            raise AddressError(f"{flag} {text!r}: unknown protocol '/{name}'") from None
        if proto.size == 0:
            result.append((name, None))
            i += 1
            continue
        if proto.path:
            result.append((name, "/".join(parts[i + 1:])))
            break
        if i + 1 >= len(parts) or not parts[i + 1]:
            raise AddressError(f"{flag} {text!r}: part '/{name}' has no value")
        value = parts[i + 1]
        try:
            Multiaddr(f"/{name}/{value}")
        except MultiaddrError as e:
            raise AddressError(f"{flag} {text!r}: bad part '/{name}/{value}' ({_reason(e)})") from None
        result.append((name, value))
        i += 2
    return result


def parse_peer_address(text: str, *, require_peer_id: bool = True, flag: str = "--initial-peers") -> PeerAddress:
    """Validate one peer multiaddr; raise :class:`AddressError` naming the bad part."""
    text = text.strip()
    if not text:
        raise AddressError(f"{flag}: empty address")
    parts = _split_parts(text, flag)
    try:
        normalised = str(Multiaddr(text))
    except MultiaddrError as e:  # every part parsed alone, but not together
        raise AddressError(f"{flag} {text!r}: {_reason(e)}") from None
    names = [name for name, _ in parts]
    if not names or names[0] not in HOST_PROTOCOLS:
        raise AddressError(f"{flag} {text!r}: must start with a host part (/ip4/…, /ip6/… or /dns/…), got '/{names[0] if names else ''}'")
    if len(names) < 2 or names[1] not in TRANSPORT_PROTOCOLS:
        got = f"'/{names[1]}'" if len(names) >= 2 else "nothing"
        raise AddressError(f"{flag} {text!r}: missing the transport part '/tcp/PORT' after the host, got {got}")
    host, port_text = parts[0][1], parts[1][1]
    assert host is not None and port_text is not None  # both protocols carry values
    port = int(port_text)
    if port == 0:
        raise AddressError(f"{flag} {text!r}: bad part '/{names[1]}/0' (port 0 means 'any port' and cannot be dialled)")
    peer_id = dict(parts).get("p2p")
    if require_peer_id and peer_id is None:
        raise AddressError(
            f"{flag} {text!r}: missing the peer id part '/p2p/<peer id>' "
            f"(copy the full address that `p2p-diloco bootstrap` prints)"
        )
    if peer_id is not None and names[-1] != "p2p":
        raise AddressError(f"{flag} {text!r}: the '/p2p/<peer id>' part must come last")
    return PeerAddress(normalised, names[0], host, names[1], port, peer_id)


def parse_initial_peers(values: Iterable[str], flag: str = "--initial-peers") -> tuple[PeerAddress, ...]:
    """Parse repeated and/or comma- or space-separated ``--initial-peers`` values; duplicates are dropped.

    A value with no address in it (``--initial-peers ""``, an unset shell variable) is refused: the peer
    would start a swarm of its own and train alone while the user believes it joined one."""
    seen: dict[str, PeerAddress] = {}
    for value in values:
        items = value.replace(",", " ").split()
        if not items:
            raise AddressError(f"{flag} {value!r}: no address given; pass the multiaddr a running peer printed, "
                               "e.g. /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID")
        for item in items:
            addr = parse_peer_address(item, flag=flag)
            seen.setdefault(addr.text, addr)
    return tuple(seen.values())


def parse_announce_address(text: str, flag: str = "--announce") -> str:
    """Validate an address to announce: host + transport with an explicit port, no peer id needed."""
    addr = parse_peer_address(text, require_peer_id=False, flag=flag)
    if addr.peer_id is not None:
        raise AddressError(f"{flag} {text!r}: leave out the '/p2p/…' part; the peer id is added automatically")
    return addr.text


def check_port_free(host: str, port: int) -> None:
    """Refuse a fixed ``--port`` that something on this machine already listens on.

    libp2p's daemon binds with SO_REUSEPORT, so a second peer on a taken port starts without an error
    and both listen on it, each getting some of the connections. We bind a plain socket (SO_REUSEADDR
    only: a port left in TIME_WAIT by a peer that just stopped is free) and close it again; a peer that
    takes the port between this check and the daemon's start is not caught.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AddressError(f"--port {port}: {host}:{port} is already in use (another peer?); pick another "
                                   "port or 0 for any free port") from None
            if e.errno == errno.EACCES:
                raise AddressError(f"--port {port}: permission denied on {host}:{port} (ports below 1024 need root); "
                                   "pick another port or 0 for any free port") from None
            raise AddressError(f"--host {host}: cannot listen on {host}:{port} ({e.strerror}); give an address "
                               "of this machine") from None


def host_multiaddr(host: str, port: int, flag: str = "--host") -> str:
    """``/ip4/HOST/tcp/PORT`` (or ip6) for a listening address given as a plain host and port."""
    if not 0 <= port < 65536:
        raise AddressError(f"--port {port}: must be in [0, 65535]")
    proto = "ip6" if ":" in host else "ip4"
    text = f"/{proto}/{host}/tcp/{port}"
    try:
        return str(Multiaddr(text))
    except MultiaddrError as e:
        raise AddressError(f"{flag} {host!r}: not an {proto.upper()} address ({_reason(e)})") from None
