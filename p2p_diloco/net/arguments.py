"""From command-line arguments to :class:`~p2p_diloco.net.membership.SwarmOptions`.

Every argument is validated before hivemind is imported, so bad input fails fast with one line.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from p2p_diloco.hivemind_ext.lazyimports import light_hivemind_import

if TYPE_CHECKING:
    from p2p_diloco.net.membership import SwarmOptions


def swarm_options(args: argparse.Namespace, *, client_mode: bool, default_identity: str | None = None) -> "SwarmOptions":
    from p2p_diloco.net.addresses import (
        check_port_free,
        host_multiaddr,
        parse_announce_address,
        parse_initial_peers,
    )

    initial = parse_initial_peers(args.initial_peers)  # before importing hivemind: bad input fails fast
    host, port = getattr(args, "host", "127.0.0.1"), getattr(args, "port", 0)
    host_multiaddr(host, port)  # validates --host / --port before anything starts
    announce = tuple(parse_announce_address(a) for a in getattr(args, "announce", []))
    if host in ("0.0.0.0", "::") and not announce:
        raise ValueError(f"--host {host}: listening on all interfaces needs --announce /ip4/<LAN address>/tcp/<port> "
                         f"so that others know where to dial")
    if announce and port == 0:
        raise ValueError("--announce needs a fixed --port (the announced port must be the one we listen on)")
    if port != 0:
        check_port_free(host, port)  # libp2p would share a taken port silently (SO_REUSEPORT)
    from p2p_diloco.net.keys import read_swarm_key

    swarm_key = read_swarm_key(args.swarm_key) if args.swarm_key else None  # before an identity file is created
    light_hivemind_import()
    from p2p_diloco.net.keys import load_or_create_identity
    from p2p_diloco.net.membership import SwarmOptions

    identity_path = getattr(args, "identity", None) or default_identity
    identity = load_or_create_identity(identity_path) if identity_path else None
    if args.join_timeout_s <= 0:
        raise ValueError(f"--join-timeout: must be > 0 s, got {args.join_timeout_s}")
    return SwarmOptions(
        initial_peers=initial, host=host, port=port, announce=announce, identity=identity,
        client_mode=client_mode, swarm_key=swarm_key,
        join_timeout_s=args.join_timeout_s,
    )
