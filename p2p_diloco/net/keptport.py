"""The port a bootstrap listens on, kept beside its identity file, so that its whole address survives a restart.

The identity file keeps the peer id (:mod:`p2p_diloco.net.keys`); an address others pasted,
``/ip4/HOST/tcp/PORT/p2p/PEER_ID``, also needs the port. A bootstrap started without ``--port`` writes the port
it got into ``<identity file>.port`` (one line) and listens there again at its next start; if something else
took it meanwhile, a WARNING and any free port (a new address, printed as usual). Imports no hivemind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from p2p_diloco.net.addresses import AddressError, check_port_free, parse_peer_address

if TYPE_CHECKING:
    from p2p_diloco.net.membership import SwarmOptions

logger = logging.getLogger(__name__)


def port_file(identity_path: str | Path) -> Path:
    """``<identity file>.port``: where the port of the last start with this identity is kept."""
    path = Path(identity_path).expanduser()
    return path.with_name(path.name + ".port")


def remembered_port(identity_path: str | Path) -> int:
    """The port :func:`remember_port` kept beside ``identity_path``; 0 if none (or not a port: logged)."""
    path = port_file(identity_path)
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as e:
        logger.warning("cannot read the kept port %s (%s); listening on a new port", path, e)
        return 0
    if not text.isdigit() or not 0 < int(text) < 65536:
        logger.warning("%s holds no port (%r); listening on a new port", path, text[:20])
        return 0
    return int(text)


def remember_port(identity_path: str | Path, listening: str) -> None:
    """Keep the port of the multiaddr ``listening`` (``/ip4/HOST/tcp/PORT/...``, as the DHT reports it) beside
    ``identity_path``; replaced atomically, so a bootstrap killed while writing leaves the old one."""
    path = port_file(identity_path)
    port = parse_peer_address(listening, require_peer_id=False).port
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n", encoding="ascii")
    os.replace(tmp, path)


def with_kept_port(opts: "SwarmOptions") -> "SwarmOptions":
    """``opts`` (port 0, an identity) listening on the port kept beside the identity, if there is one and it is
    free; else unchanged (any free port), with a WARNING when the kept port is taken."""
    assert opts.identity is not None and opts.port == 0
    port = remembered_port(opts.identity.path)
    if port == 0:
        return opts
    try:
        check_port_free(opts.host, port)
    except AddressError as e:
        logger.warning("cannot listen again on port %d, kept in %s from this identity's last start: %s; listening on "
                       "a new port: the address printed below replaces the old one", port,
                       port_file(opts.identity.path), e)
        return opts
    return dataclasses.replace(opts, port=port)
