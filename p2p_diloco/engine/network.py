"""The hivemind network of an engine (:class:`~p2p_diloco.transport.network.Network`): the hivemind transport's hosts,
one averager process per fragment on the swarm's DHT (:func:`~p2p_diloco.transport.hivemind.averager_hosts`), and the
learner's status thread that reads the records and tends the clock (:class:`~p2p_diloco.engine.view.SwarmView`).
What :class:`DiLoCo` uses unless it is given another network."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from p2p_diloco.engine.view import SwarmView
from p2p_diloco.transport.hivemind import averager_hosts

if TYPE_CHECKING:
    import torch

    from p2p_diloco.averaging.host import FragmentAveragerHost
    from p2p_diloco.core.config import Config
    from p2p_diloco.sync.slot import FragmentSlot
    from p2p_diloco.transport.network import Host, Member, View


class HivemindNetwork:
    """A joined :class:`~p2p_diloco.engine.swarm.Swarm`'s network."""

    host_class: type[FragmentAveragerHost] | None = None
    """Each fragment's averager (None: :func:`~p2p_diloco.transport.hivemind.start_averagers`' default; :class:`p2p_diloco.engine.faulty.FaultyNetwork`
    starts faulty ones)."""

    def __init__(self, swarm: Member) -> None:
        self.swarm = swarm

    def hosts(self, cfg: Config, slots: Sequence[FragmentSlot], shapes: Mapping[str, torch.Size]) -> list[Host]:
        joined = self.swarm.joined
        return list(averager_hosts(cfg, slots, shapes, joined.dht, joined.private_key, self.swarm.membership,
                                   host_class=self.host_class))

    def view(self, engine: Any) -> View:
        return SwarmView(engine)
