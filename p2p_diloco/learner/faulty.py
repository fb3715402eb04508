"""The learner's fault points (``p2p-diloco join --fault``, :mod:`p2p_diloco.core.faults`): a loop, a network and a
host that wrap the production ones from outside, hit their points and otherwise do exactly what they do.

``p2p-diloco join`` builds a :class:`FaultyLearner` instead of a :class:`~p2p_diloco.learner.loop.Learner` only when
faults are armed, after :func:`faults.arm` and so before the averager processes are forked. Points:

- ``inner-step`` (:class:`FaultyLearner`): before each turn of the loop;
- ``before-send`` (:class:`FaultyHost`): as a round's contribution is handed to its fragment's host;
- the averaging side's points (``while-sending``, ``while-reducing``, ``serving-state``, ``fetching-state``,
  ``reading-verdicts``): :class:`FaultyNetwork` starts :class:`~p2p_diloco.averaging.faulty.FaultyAveragerHost`\\ s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from p2p_diloco.averaging.faulty import FaultyAveragerHost
from p2p_diloco.core import faults
from p2p_diloco.learner.loop import Learner
from p2p_diloco.learner.network import HivemindNetwork

if TYPE_CHECKING:
    import torch

    from p2p_diloco.averaging.host import Download, RoundOutcome
    from p2p_diloco.averaging.linktime import LinkEstimate
    from p2p_diloco.core.config import Config
    from p2p_diloco.core.data import TrainingData
    from p2p_diloco.learner.options import LearnerOptions, Profile
    from p2p_diloco.learner.swarm import Swarm
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

    def fetch_state(self, ours: Rank, link: LinkEstimate | None = None) -> Future[Download]:
        return self.host.fetch_state(ours, link)

    def set_anchor(self, version: int, anchor: str) -> None:
        self.host.set_anchor(version, anchor)

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


class FaultyLearner(Learner):
    """A :class:`~p2p_diloco.learner.loop.Learner` on a :class:`FaultyNetwork`, with the ``inner-step`` point."""

    def __init__(self, cfg: Config, profile: Profile, opts: LearnerOptions, swarm: Swarm,
                 splits: TrainingData | None = None) -> None:
        super().__init__(cfg, profile, opts, swarm, splits, network=FaultyNetwork(swarm))

    def train_once(self) -> None:
        faults.hit("inner-step")
        super().train_once()
