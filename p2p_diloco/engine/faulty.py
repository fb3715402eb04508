"""The engine's fault points (``p2p-diloco join --fault``, :mod:`p2p_diloco.core.faults`): a network and a host that
wrap the production ones from outside, hit their points and otherwise do exactly what they do.

``p2p-diloco join`` builds a :class:`~p2p_diloco.learner.loop.FaultyLearner` (a loop on a :class:`FaultyNetwork`)
instead of a :class:`~p2p_diloco.learner.loop.Learner` only when faults are armed, after :func:`faults.arm` and so
before the averager processes are forked. Points:

- ``inner-step`` (:func:`hit_inner_step`, which the join command's ``FaultyLearner`` calls): before each turn of
  the loop;
- ``before-send`` (:class:`FaultyHost`): as a round's contribution is handed to its fragment's host;
- the averaging side's points (``while-sending``, ``while-reducing``, ``serving-state``, ``fetching-state``,
  ``reading-verdicts``, ``serving-offers``): :class:`FaultyNetwork` starts :class:`~p2p_diloco.averaging.faulty.FaultyAveragerHost`\\ s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from p2p_diloco.averaging.faulty import FaultyAveragerHost
from p2p_diloco.core import faults
from p2p_diloco.engine.network import HivemindNetwork

if TYPE_CHECKING:
    import torch

    from p2p_diloco.averaging.host import Download
    from p2p_diloco.averaging.plans import RoundOutcome
    from p2p_diloco.averaging.linktime import LinkEstimate
    from p2p_diloco.core.config import Config
    from p2p_diloco.core.replay import KeptRound
    from p2p_diloco.sync.fragment import Contribution
    from p2p_diloco.sync.slot import FragmentSlot
    from p2p_diloco.transport.network import Host, Rank, RoundContext


class FaultyHost:
    """A fragment's :class:`~p2p_diloco.transport.network.Host` with the ``before-send`` point."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.prefix = host.prefix

    def start_round(self, contribution: Contribution, context: RoundContext) -> Future[RoundOutcome]:
        faults.hit("before-send", contribution.fragment)
        return self.host.start_round(contribution, context)

    def decline(self, context: RoundContext) -> None:
        self.host.decline(context)

    def leave(self) -> None:
        self.host.leave()

    def fetch_state(self, ours: Rank, donors: Mapping[str, Rank], link: LinkEstimate | None = None,
                    replay: bool = True) -> Future[Download]:
        return self.host.fetch_state(ours, donors, link, replay)

    def keep_round(self, kept: KeptRound) -> None:
        self.host.keep_round(kept)

    def last_group(self) -> tuple[int, tuple[str, ...]]:
        return self.host.last_group()

    def vouch(self, version: int, anchor: str) -> None:
        self.host.vouch(version, anchor)

    def cancel(self) -> None:
        self.host.cancel()

    def shutdown(self) -> None:
        self.host.shutdown()

    def bytes_total(self) -> tuple[int, int]:
        return self.host.bytes_total()


class FaultyNetwork(HivemindNetwork):
    """The swarm's hivemind network with every fault point: faulty averager hosts, each behind a :class:`FaultyHost`."""

    host_class = FaultyAveragerHost

    def hosts(self, cfg: Config, slots: Sequence[FragmentSlot], shapes: Mapping[str, torch.Size]) -> list[Host]:
        return [FaultyHost(host) for host in super().hosts(cfg, slots, shapes)]


def hit_inner_step() -> None:
    """The ``inner-step`` point: the join command's loop (:class:`~p2p_diloco.learner.loop.FaultyLearner`) hits it
    before each turn, so that only the fault wrappers' modules name a point."""
    faults.hit("inner-step")
