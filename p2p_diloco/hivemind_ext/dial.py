"""Dial a peer at known addresses through hivemind's p2pd client: hivemind's ``P2P`` has no public call.

``doctor``'s probes (:mod:`p2p_diloco.net.probes`) must reach a peer that is not in our routing
table (a split swarm, a clock-skew ping) at the addresses its record or the initial peers give.
hivemind 1.1.12's ``P2P`` opens connections only implicitly, by peer id; its private p2pd client
(``P2P._client``) has ``connect(peer_id, maddrs)``. The version is checked at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # P2P._client is private to hivemind


async def dial(p2p: Any, peer_id: Any, maddrs: Sequence[str]) -> None:
    """Connect our p2pd (``p2p``: a ``hivemind.p2p.P2P``) to ``peer_id`` (a ``PeerID``) at ``maddrs``
    (multiaddr strings without ``/p2p/``); raises whatever the daemon raises when it cannot."""
    await p2p._client.connect(peer_id, [Multiaddr(m) for m in maddrs])
