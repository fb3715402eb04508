"""The seam between the engine (:class:`~p2p_diloco.learner.engine.DiLoCo`) and a network: what it asks of one.

An engine needs two things from its network, and nothing else of it:

- per fragment, a :class:`Host` that runs rounds and state downloads in the background (futures, never waited for on
  the training thread) and is told when our anchor moves;
- a :class:`View` of the swarm: the other live learners' fragment ranks, states and steps, and the sync clock -- a
  read-only snapshot the engine's round policy decides from (who can form a group, who is ahead).

:class:`Network` makes both for one engine. The hivemind network (:class:`p2p_diloco.learner.network.HivemindNetwork`)
starts an averager process per fragment and reads the DHT; the in-process one
(:class:`p2p_diloco.transport.inprocess.Hub`) groups and reduces the rounds of N engines in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from p2p_diloco.averaging.host import Download, RoundOutcome, RoundPlan
    from p2p_diloco.averaging.linktime import LinkEstimate
    from p2p_diloco.core.config import Config
    from p2p_diloco.net.clock import SyncClock
    from p2p_diloco.sync.fragment import Contribution
    from p2p_diloco.sync.slot import FragmentSlot

Rank = tuple[int, str]
"""A fragment's (version, anchor hash)."""


class Host(Protocol):
    """One fragment's rounds and downloads on one learner (``averaging.host.FragmentAveragerHost`` is one)."""

    prefix: str
    """The fragment's key in its network (grid groups salt their groups with it)."""

    def start_round(self, contribution: Contribution, plan: RoundPlan) -> Future[RoundOutcome]: ...
    def fetch_state(self, ours: Rank, link: LinkEstimate | None = None) -> Future[Download]: ...
    def set_anchor(self, version: int, anchor: str) -> None: ...
    def vouch(self, version: int, anchor: str) -> None: ...
    def cancel(self) -> None: ...
    def shutdown(self) -> None: ...
    def bytes_total(self) -> tuple[int, int]: ...


class View(Protocol):
    """What an engine reads of the swarm (``learner.view.SwarmView`` is one)."""

    @property
    def clock(self) -> SyncClock | None: ...
    @property
    def swarm_reads(self) -> int: ...
    @property
    def peer_states(self) -> list[str]: ...
    @property
    def peer_steps(self) -> list[tuple[int, float, float]]: ...
    @property
    def peer_anchors(self) -> list[list[Rank]]: ...
    @property
    def peer_ids(self) -> list[str]: ...

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def look_before_training(self, stop: threading.Event) -> None: ...
    def wait_for_peers(self, stop: threading.Event) -> None: ...


class Member(Protocol):
    """What an engine needs of a joined swarm (``learner.swarm.Swarm`` is one, ``transport.inprocess.LocalSwarm``
    another): the run's config, our identity and record publisher (``joined``: ``peer_id``, ``name``, ``dht``,
    ``private_key``, ``publisher.update(state=...)``), the run (``local``: ``run_id``, ``config_hash``) and the private
    swarm's member check (``membership``, None in an open swarm)."""

    @property
    def config(self) -> Config: ...
    @property
    def joined(self) -> Any: ...
    @property
    def local(self) -> Any: ...
    @property
    def membership(self) -> Any: ...


class Network(Protocol):
    """Makes an engine's hosts (one per fragment, started) and its view."""

    def hosts(self, cfg: Config, slots: Sequence[FragmentSlot], shapes: Mapping[str, torch.Size]) -> list[Host]: ...
    def view(self, engine: Any) -> View: ...
