"""A round as the engine hands it to a transport (:class:`RoundPlan`: its schedule, its group, its deadlines) and as it
comes back (:class:`RoundOutcome`: committed or why not, the merged update, and what the round cost, part by part).
Imports no hivemind."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from p2p_diloco.averaging.linktime import RoundTimeouts


@dataclass(frozen=True)
class RoundPlan:
    """How the transport runs one round of a :class:`~p2p_diloco.sync.fragment.Contribution`: its schedule, its
    timeouts and its group (planned beside the contribution, which it does not copy)."""

    scheduled_time: float
    """DHT time at which the group should start its all-reduce."""
    window_s: float
    due: float
    """DHT time at which the contribution was handed off (``RoundMeta.due``: the members' arrival spread)."""
    doomed: Callable[[], bool] | None = None
    """Polled while the round is still matching: True abandons it (a live peer is already past our version: a
    group there would fork or find nobody, and waiting out the window only delays our catching up). Read on the round's
    worker thread: a read-only look at the swarm's records, never the engine's state."""
    timeouts: RoundTimeouts | None = None
    """This round's hivemind timeouts, derived from the link (:func:`~p2p_diloco.averaging.linktime.round_timeouts`);
    None: the config's fixed values (:func:`~p2p_diloco.averaging.linktime.floor_timeouts`)."""
    group_bits: str = ""
    """Grid groups: the group key (:func:`~p2p_diloco.averaging.decisions.grid_group_bits`); empty: the version's."""
    at_rank: int = 0
    """The live learners, us included, at our (version, anchor hash) of the fragment when the round started (0:
    not checked): a group of at most half of them does not commit (:func:`~p2p_diloco.averaging.decisions.quorum_problem`)."""
    group_id: str = ""
    """Groups from the clock (``averaging.matchmaking = "clock"``): the group's id
    (:func:`~p2p_diloco.core.groups.clock_group`); empty: matchmaking finds the group."""
    members: tuple[str, ...] = ()
    """Groups from the clock: the group's members, us included, in their order; the round starts once all of them
    are in and fails for all alike if one is not by ``scheduled_time``."""
    boundary_ms: int = -1
    """Groups from the clock: the clock's boundary the group meets at, in DHT milliseconds (a member that skips it
    says so: :meth:`~p2p_diloco.transport.network.Host.decline`); -1: none."""
    link_Bps: float = 0.0
    """Our link's measured throughput (bytes per second; 0.0: none measured yet), in our round metadata: the group
    sizes its all-reduce parts for its slowest member (:func:`~p2p_diloco.hivemind_ext.compression.link_part_bytes`)."""


@dataclass(frozen=True)
class RoundOutcome:
    """How a round ended. ``merged`` is set only when ``committed``."""

    fragment: int
    version: int
    committed: bool
    reason: str
    group_size: int = 0
    peers: tuple[str, ...] = ()
    absent: int = 0
    """Groups from the clock: the members the group named that did not show; the round went on without them."""
    own_share: float = 0.0
    weights: tuple[float, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    duration_s: float = 0.0
    finished_at: float = float("nan")
    """When the round ended (committed or not), on this process's ``time.monotonic()`` clock."""
    arrival_spread_s: float = float("nan")
    waited_s: float = float("nan")
    """Seconds from our hand-off to the group's last member's (their DHT times): the part of ``duration_s`` spent
    waiting for the others to arrive; NaN: no group formed."""
    window_s: float = 0.0
    setup_s: float = float("nan")
    """Seconds from the round's start to its step in the averager (timeouts and group set, tensors copied in)."""
    verdicts_s: float = float("nan")
    """Seconds the members' verdicts took to agree, after the all-reduce; NaN: none exchanged."""
    meet_s: float = float("nan")
    """Seconds our step took to meet its group (offers and the leader's decision, or matchmaking), timed in the
    averager process; NaN: no group formed."""
    handback_s: float = float("nan")
    """Seconds from the all-reduce's end to our verdicts' start: its result's way to this process and our checks;
    NaN: not measured."""
    allreduce_end: float = float("nan")
    """DHT time our all-reduce ended (NaN: none ended well): the group's last member's end is the group's all-reduce's,
    which the others' verdicts wait for."""
    allreduce_s: float = float("nan")
    """Seconds the all-reduce itself ran (timed in the averager process); NaN: no group formed."""
    part_bytes: int = 0
    """The size of the parts the all-reduce was cut in (the same on every member: :func:`~p2p_diloco.hivemind_ext.
    compression.link_part_bytes`); 0: no all-reduce ran."""
    rtt_s: float = float("nan")
    """The fastest DHT read of the members' verdicts (a round trip to the group); NaN: none was read."""
    timeouts: RoundTimeouts | None = None
    """The timeouts the round ran with."""
    merged: dict[str, torch.Tensor] | None = None
    mixed_anchor: dict[str, torch.Tensor] | None = None
    """Grid groups, committed: the members' averaged anchor and outer momentum, and the version the group commits
    (:func:`~p2p_diloco.averaging.decisions.grid_version`): the outer step starts from them."""
    mixed_momentum: dict[str, torch.Tensor] | None = None
    version_after: int = -1
    group_distance: float = float("nan")
    """Grid groups, committed: ``||our anchor - the group's averaged anchor|| / ||averaged||`` (consensus distance)."""
    pending: dict[str, torch.Tensor] | None = None
    """Discarded for want of verdicts only (our all-reduce was complete and every verdict we read was "ok"): the
    merged pseudo-gradient we would have applied. A member that read every "ok" just before we withdrew ours may
    have committed it; the learner keeps it and adopts it if a peer turns out to hold exactly its result
    (:meth:`~p2p_diloco.sync.fragment.FragmentSync.adopt_pending`), with no download and no third peer."""

    def event(self) -> dict[str, Any]:
        """The JSONL record of this round (no tensors)."""
        # not asdict(): it deep-copied the merged tensors (a whole fragment) on the training thread only to drop
        # them; finished_at is on this process's clock only
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("merged", "mixed_anchor", "mixed_momentum", "pending", "finished_at")}
        d["peers"] = list(self.peers)
        d["weights"] = list(self.weights)
        d["outcome"] = "committed" if self.committed else "discarded"
        for key in ("arrival_spread_s", "waited_s", "setup_s", "verdicts_s", "meet_s", "handback_s", "allreduce_end", "allreduce_s",
                    "rtt_s", "group_distance"):
            if not math.isfinite(d[key]):
                d[key] = None
        d["timeouts"] = self.timeouts.event() if self.timeouts is not None else None
        return d
