"""The in-process hub's rounds (:mod:`p2p_diloco.transport.inprocess`): its members, the contributions of a group
open at one fragment, version and anchor, why such a group cannot commit, and the average it hands every member --
what hivemind's matchmaking, runner and verdicts decide over the network, as pure functions where they can be.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Any

import torch

from p2p_diloco.averaging.decisions import NO_GROUP, missing_reason, quorum_problem
from p2p_diloco.averaging.plans import RoundOutcome, RoundPlan
from p2p_diloco.core import outer
from p2p_diloco.core.config import Config
from p2p_diloco.core.groups import without_absent
from p2p_diloco.core.replay import KeptRound
from p2p_diloco.hivemind_ext import compression

if TYPE_CHECKING:
    from p2p_diloco.sync.fragment import Contribution
    from p2p_diloco.transport.network import Rank


@dataclass(eq=False)
class Member:
    """One learner of the hub: its identity, what its record would say, and its engine once it has one."""

    peer_id: str
    name: str
    state: str = "joining"
    alive: bool = True
    engine: Any = None
    """Its :class:`~p2p_diloco.engine.engine.DiLoCo` (set when the engine makes its view)."""
    side: int = 0
    """Its side of a network partition (:meth:`~p2p_diloco.transport.inprocess.Hub.partition`): members see and average only with their side."""
    bytes_sent: int = 0
    bytes_received: int = 0
    kept: dict[int, list[KeptRound]] = field(default_factory=dict)
    """Fragment -> the rounds it committed last (:meth:`~p2p_diloco.transport.inprocess.InProcessHost.keep_round`)."""

    def ranks(self) -> list[Rank]:
        out = []
        for s in self.engine.slots:
            with s.lock:
                out.append(s.rank)
        return out


@dataclass(eq=False)
class Offer:
    member: Member
    contribution: Contribution
    plan: RoundPlan
    done: Future[RoundOutcome]
    arrived: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class OpenGroup:
    key: tuple[int, int, str, int, str]
    """(fragment, version, anchor hash, side of a partition, group id from the clock or ""): who averages together."""
    offers: list[Offer]
    closed: bool = False
    members: tuple[str, ...] = ()
    """Groups from the clock: the peer ids the group's id names (it starts once all are in or declined)."""
    boundary_ms: int = -1
    """Groups from the clock: the boundary it meets at (DHT ms; members that skip it decline: :meth:`~p2p_diloco.transport.inprocess.Hub.decline`)."""
    complete: bool = False


@dataclass(frozen=True)
class RoundRecord:
    """A round the hub ran (for tests and reports): its fragment, version, members' names, outcome, reason."""

    fragment: int
    version: int
    members: tuple[str, ...]
    committed: bool
    reason: str
    weights: tuple[float, ...] = ()
    """The members' weights (their progress), in ``members`` order."""
    tokens: int = 0
    """The tokens of progress the members sent."""
    complete: bool = False
    """Groups from the clock: it started as soon as every member its id names was in (no window waited out)."""
    absent: int = 0
    """Groups from the clock: the members its id names that were not in by the scheduled time (declined included)."""
    declined: int = 0
    """Groups from the clock: the members its id names that declined its boundary (:meth:`~p2p_diloco.transport.inprocess.Hub.decline`)."""
    left: int = 0
    """Groups from the clock: the members its id names that had left its fragment's rounds (:meth:`~p2p_diloco.transport.inprocess.Hub.leave`)."""


def absent_members(offers: Sequence[Offer]) -> set[str]:
    """Groups from the clock: the members a group's id names that are not among its ``offers`` (one group: one plan's
    members for all)."""
    return set(offers[0].plan.members) - {o.member.peer_id for o in offers}


def refusal(cfg: Config, offers: Sequence[Offer], declined: set[str], left: AbstractSet[str] = frozenset()) -> str:
    """Why a group of ``offers`` cannot commit, before reducing (empty: it may); ``declined``: the members its id names
    that declined its boundary, ``left``: those done with rounds for good. (Over hivemind one of the group's leaders
    decides this for all; a leader that died is passed over: :func:`~p2p_diloco.core.groups.group_leaders`.)"""
    a = cfg.averaging
    members = offers[0].plan.members
    if members:  # groups from the clock: without whoever the id names and did not show, if most did; else all fail
        missing = absent_members(offers)
        gone, declined = missing & left, declined - left
        if missing and not without_absent(offers[0].plan.group_id, members, missing - declined - gone, declined,
                                          gone)[1]:
            return missing_reason(len(members) - len(missing), len(members), len(declined & missing), len(gone))
    if len(offers) < max(2, a.min_group_size):
        return NO_GROUP
    for o in offers:
        problem = quorum_problem(len(offers), o.plan.at_rank, a.target_group_size)
        if problem is not None:
            return problem
    return ""


def round_record(group: OpenGroup, offers: Sequence[Offer], outcomes: Sequence[RoundOutcome], declined: set[str],
                 left: set[str]) -> RoundRecord:
    """What the hub records of a round it ran (``declined``, ``left``: the members its id names that said so)."""
    committed = any(o.committed for o in outcomes)  # a member whose verdicts were lost discards what others commit
    absent = absent_members(offers)
    return RoundRecord(group.key[0], group.key[1], tuple(o.member.name for o in offers), committed,
                       "committed" if committed else outcomes[0].reason, tuple(o.contribution.weight for o in offers),
                       sum(o.contribution.tokens for o in offers), group.complete, len(absent), len(declined & absent),
                       len(left & absent))


def failed_outcomes(group: OpenGroup, offers: Sequence[Offer], reason: str) -> list[RoundOutcome]:
    now = time.monotonic()
    return [RoundOutcome(fragment=group.key[0], version=group.key[1], committed=False, reason=reason,
                         group_size=len(offers) if reason != NO_GROUP else 0, finished_at=now,
                         window_s=o.plan.window_s) for o in offers]


def average(codec: str, sent: Sequence[dict[str, torch.Tensor]], weights: Sequence[float],
            robust: outer.Robust) -> dict[str, torch.Tensor]:
    """The weighted average of the members' ``sent`` tensors as hivemind's butterfly all-reduce hands it back (each
    part through the run's ``codec``), or, with a robust rule, as a robust reducer does: the decoded parts, its rule,
    the codec of the result back to all."""
    averaged: dict[str, torch.Tensor] = {}
    for n in sent[0]:
        tensors = [t[n] for t in sent]
        if robust.active:
            received = [compression.roundtrip(codec, t) for t in tensors]
            reduced = outer.robust_mean(received, outer.clip_to_median(list(weights), robust.clip_factor), robust)
            averaged[n] = compression.roundtrip(codec, reduced)
        else:
            averaged[n] = compression.simulate_allreduce(codec, tensors, list(weights))
    return averaged
