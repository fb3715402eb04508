"""The seam between the engine (:class:`~p2p_diloco.engine.engine.DiLoCo`) and a network: what it asks of one.

An engine needs two things from its network, and nothing else of it:

- per fragment, a :class:`Host` that runs rounds and state downloads in the background (futures, never waited for on
  the training thread) and is told when our anchor moves. A round is the fragment's
  :class:`~p2p_diloco.sync.fragment.Contribution` (the one form it has from the hand-off to its outcome) and a
  :class:`RoundContext`: the engine's read-only snapshot at the hand-off, from which the host plans the round;
- a :class:`View` of the swarm: the other live learners' fragment ranks, states and steps, and the sync clock -- a
  read-only snapshot the engine's round policy decides from (who can form a group, who is ahead).

:class:`Network` makes both for one engine. The hivemind network (:class:`p2p_diloco.engine.network.HivemindNetwork`)
starts an averager process per fragment (its hosts: :mod:`p2p_diloco.transport.hivemind`) and reads the DHT; the
in-process one
(:class:`p2p_diloco.transport.inprocess.Hub`) groups and reduces the rounds of N engines in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from p2p_diloco.averaging.host import Download
    from p2p_diloco.averaging.plans import RoundOutcome
    from p2p_diloco.averaging.linktime import LinkEstimate
    from p2p_diloco.core.config import Config
    from p2p_diloco.core.replay import KeptRound
    from p2p_diloco.net.clock import SyncClock
    from p2p_diloco.sync.fragment import Contribution
    from p2p_diloco.sync.slot import FragmentSlot

Rank = tuple[int, str]
"""A fragment's (version, anchor hash)."""


@dataclass(frozen=True)
class RoundContext:
    """What the engine knows as it hands a contribution off, beside the contribution: a read-only snapshot (taken on the
    training thread) from which the fragment's host plans the round (:func:`~p2p_diloco.transport.planning.plan_round`:
    its schedule, timeouts and group)."""

    due: float
    """DHT time of the hand-off."""
    window_s: float
    """The matchmaking window the engine's measured arrival spreads and link call for."""
    link: LinkEstimate
    """What the engine's earlier rounds measured of its link."""
    clock: SyncClock | None
    """The sync clock (None: the step schedule, or before a derived clock is known)."""
    fragments: int
    """How many fragments the model has (the clock staggers their boundaries)."""
    own_id: str
    """Our peer id."""
    roster: tuple[str, ...]
    """The live learners we know of, us included (the cells of the grid groups), sorted."""
    peers: tuple[tuple[str, Rank], ...]
    """(peer id, this fragment's rank) of the other live learners, at the hand-off."""
    live_ranks: Callable[[], Sequence[Rank]]
    """The same as the view holds it when called (:func:`fragment_ranks` of the view): a read-only look that the
    round's worker polls while it matches (its doomed check), never the engine's state."""

    @property
    def peer_ranks(self) -> tuple[Rank, ...]:
        """This fragment's rank in the other live learners' records, at the hand-off."""
        return tuple(rank for _, rank in self.peers)


def fragment_peers(view: View, fragment: int) -> list[tuple[str, Rank]]:
    """(peer id, ``fragment``'s (version, anchor hash)) of the other live learners, as ``view`` holds them now."""
    return [(peer, ranks[fragment]) for peer, ranks in zip(view.peer_ids, view.peer_anchors) if len(ranks) > fragment]


def fragment_ranks(view: View, fragment: int) -> list[Rank]:
    """``fragment``'s (version, anchor hash) in the other live learners' records, as ``view`` holds them now."""
    return [ranks[fragment] for ranks in view.peer_anchors if len(ranks) > fragment]


class Host(Protocol):
    """One fragment's rounds and downloads on one learner (``transport.hivemind.AveragerLink`` is one,
    ``transport.inprocess.InProcessHost`` another)."""

    @property
    def prefix(self) -> str:
        """The fragment's key in its network (grid groups salt their groups with it)."""
        ...

    def start_round(self, contribution: Contribution, context: RoundContext) -> Future[RoundOutcome]: ...

    def decline(self, context: RoundContext) -> None:
        """We skip the fragment's round due now (our link still carries another round, or the fragment's last one is
        in flight): with groups from the clock, any group that counts on us in the clock's round hears so at once
        (:func:`~p2p_diloco.core.groups.without_absent`) instead of waiting out our offer --
        whatever rank it counts us at (a round of ours in flight moves it); otherwise nothing. Never waits."""
        ...

    def leave(self) -> None:
        """We are done with rounds for good (our final rounds are over): with groups from the clock, every group that
        still counts on us goes on without us, its majority counted without us (:func:`~p2p_diloco.core.groups.
        without_absent`); otherwise nothing. Never waits."""
        ...

    def fetch_state(self, ours: Rank, donors: Mapping[str, Rank], link: LinkEstimate | None = None,
                    replay: bool = True) -> Future[Download]:
        """Download a state ahead of ``ours`` from ``donors`` (peer id -> the rank our view holds for it); with
        ``replay``, the rounds the best donor kept from ``ours`` instead where it kept them (``Download.replayed``)."""
        ...

    def keep_round(self, kept: KeptRound) -> None:
        """A round we committed: keep it for peers that replay it (:mod:`p2p_diloco.core.replay`). Never waits."""
        ...

    def last_group(self) -> tuple[int, tuple[str, ...]]:
        """(the version the fragment's last committed round led to, its members' peer ids); (-1, ()) before one
        (:class:`~p2p_diloco.transport.planning.LastGroup`: planning counts them at our rank, and so does the view)."""
        ...

    def vouch(self, version: int, anchor: str) -> None: ...
    def cancel(self) -> None: ...
    def shutdown(self) -> None: ...
    def bytes_total(self) -> tuple[int, int]: ...


class View(Protocol):
    """What an engine reads of the swarm (``engine.view.SwarmView`` is one)."""

    @property
    def clock(self) -> SyncClock | None: ...
    @property
    def swarm_reads(self) -> int: ...
    @property
    def peer_states(self) -> list[str]: ...
    @property
    def peer_steps(self) -> list[tuple[int, float, float]]: ...
    @property
    def peer_tokens(self) -> list[tuple[int, float, float]]: ...
    @property
    def peer_anchors(self) -> list[list[Rank]]: ...
    @property
    def peer_ids(self) -> list[str]: ...

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def look_before_training(self, stop: threading.Event) -> None: ...
    def wait_for_peers(self, stop: threading.Event) -> None: ...


class Member(Protocol):
    """What an engine needs of a joined swarm (``engine.swarm.Swarm`` is one, ``transport.inprocess.LocalSwarm``
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
