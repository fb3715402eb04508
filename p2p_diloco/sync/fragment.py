"""One fragment's sync on one learner: the state machine shared by the networked learner and the simulator.

A learner trains its replica freely; every fragment ``f`` keeps an *anchor* (the swarm's last agreed
weights of f) and its outer Nesterov state. :class:`FragmentSync` moves one fragment through its cycle:

1. **hand off** (:meth:`FragmentSync.hand_off`): the pseudo-gradient ``anchor - theta`` is checked
   locally (:func:`~p2p_diloco.core.outer.local_problem`); a non-finite or absurd one is never sent:
   it is dropped and the fragment re-anchored (weights <- anchor, fresh AdamW moments for them, no
   unsynced progress). Otherwise it is encoded into a :class:`Contribution` -- the one form a round's contribution
   takes from here to its outcome -- and handed to the transport, which returns a future of the round's outcome; at
   most one round or download is in flight.
2. **collect** (:meth:`FragmentSync.finished`): a finished round is applied at least ``tau`` steps
   after it was sent (committed ones; a discarded one at once).
3. **apply a round** (:meth:`FragmentSync.apply_round`): committed -> outer Nesterov step on the anchor
   and alpha-mix into the weights; the progress that went out is settled. Discarded -> nothing changes
   (a round is never half-applied).
4. **adopt a pending round** (:meth:`FragmentSync.adopt_pending`): a round discarded for want of verdicts
   (a member was late, not dead) may have been committed by that member; its result is kept and adopted as a
   commit once a peer holds exactly that (version, anchor hash). Nothing is downloaded and no third peer is
   needed: we apply only what our own complete all-reduce gave us.
5. **apply a fetched state** (:meth:`FragmentSync.apply_fetched`): catch up or heal a fork by rebasing
   our progress onto the downloaded anchor, ``theta <- new + (theta - old)``; after a resume whose
   checkpoint the swarm has moved past, restart the fragment from the downloaded anchor.

The transport is injected (:class:`Transport`): the learner's wraps a fragment averager (a hivemind
all-reduce in a background process), the simulator's an in-process reducer. This module imports only
:mod:`p2p_diloco.core`: no network.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from p2p_diloco.core import outer
from p2p_diloco.core.config import OuterConfig
from p2p_diloco.core.devices import load_into, to_host
from p2p_diloco.core.replay import KeptRound
from p2p_diloco.sync.slot import FragmentSlot, PendingRound

ROUND = "round"
FETCH = "fetch"
"""What a slot has in flight (``FragmentSlot.inflight_kind``)."""

STARTED, BUSY, DROPPED = "started", "busy", "dropped"
"""How a hand-off ended (:attr:`HandOff.status`)."""


# ---------------------------------------------------------------- what crosses the boundary


@dataclass(frozen=True)
class Contribution:
    """One fragment's contribution to a round, as the state machine hands it to its transport: what the members
    gather of each other (the fragment, the version and anchor hash it starts from, the progress and its weight, the
    radial norms) and the tensors. Every transport takes this one form; the hivemind one derives its wire metadata
    from it (``averaging.decisions.RoundMeta.of``) and plans the round beside it (``averaging.plans.RoundPlan``)."""

    fragment: int
    version: int
    anchor_hash: str
    tokens: int
    steps: int
    weight: float
    """:func:`~p2p_diloco.core.outer.contribution_weight` of the progress sent."""
    tensors: dict[str, torch.Tensor]
    """The encoded pseudo-gradient (:func:`~p2p_diloco.core.outer.encode_contribution`)."""
    norms: dict[str, float]
    delta_ratio: float = math.nan
    """``||pseudo-gradient|| / ||anchor||`` when the sync measures it (the simulator), else NaN."""


@dataclass(frozen=True)
class HandOff:
    """How :meth:`FragmentSync.hand_off` ended: ``started`` (``contribution`` sent), ``busy`` (something is in
    flight: the progress waits for the next round) or ``dropped`` (``reason``: the local check refused it)."""

    status: str
    contribution: Contribution | None = None
    reason: str = ""


class Outcome(Protocol):
    """A round's end as the transport reports it (``averaging.plans.RoundOutcome`` is one)."""

    @property
    def committed(self) -> bool: ...

    @property
    def merged(self) -> Mapping[str, torch.Tensor] | None: ...


class GridOutcome(Outcome, Protocol):
    """A committed round of grid groups (``averaging.groups = "grid"``): the members' anchors and momenta were
    averaged too, and the group commits ``version_after`` (``averaging.plans.RoundOutcome`` is one)."""

    @property
    def mixed_anchor(self) -> Mapping[str, torch.Tensor] | None: ...

    @property
    def mixed_momentum(self) -> Mapping[str, torch.Tensor] | None: ...

    @property
    def version_after(self) -> int: ...


class AnchorState(Protocol):
    """A fragment's state as a donor sends it (``averaging.transfer.FetchedState`` is one)."""

    @property
    def version(self) -> int: ...

    @property
    def anchor(self) -> dict[str, torch.Tensor]: ...

    @property
    def momentum(self) -> dict[str, torch.Tensor]: ...

    @property
    def anchor_hash(self) -> str: ...


@dataclass(frozen=True)
class SwarmState:
    """An :class:`AnchorState` handed over in process (the simulator's swarm record)."""

    version: int
    anchor: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    anchor_hash: str = ""


class Transport(Protocol):
    """How a fragment's rounds and downloads reach the other learners."""

    def start_round(self, contribution: Contribution) -> Future[Any]:
        """Start a round with ``contribution``; the future's result is an :class:`Outcome`. Never waits."""
        ...

    def fetch_state(self, ours: tuple[int, str]) -> Future[Any]:
        """Download a state ahead of ``ours`` = (version, anchor hash); the result is transport-specific."""
        ...

    def anchor_changed(self, version: int, anchor_hash: str) -> None:
        """Our anchor moved (a commit, a download, a restore): advertise it to peers that download."""
        ...


class Replica(Protocol):
    """The learner's local weights (on its device) and the inner optimizer that owns their moments."""

    @property
    def params(self) -> Mapping[str, torch.nn.Parameter]: ...

    @property
    def opt(self) -> Any: ...


@dataclass(frozen=True)
class Finished:
    """What :meth:`FragmentSync.finished` took out of the slot: the kind (:data:`ROUND` or :data:`FETCH`)
    and its done future (``result()`` may raise for a failed download)."""

    kind: str
    future: Future[Any]


def no_hash(anchor: Mapping[str, torch.Tensor]) -> str:
    """For a sync whose anchors nobody compares by hash (the simulator): hashing costs a full pass."""
    return ""


# ---------------------------------------------------------------- the state machine


class FragmentSync:
    """One fragment on one learner: its :class:`~p2p_diloco.sync.slot.FragmentSlot`, the learner's replica
    (None: an anchor without weights, such as the simulator's swarm record) and the transport.

    Only the training thread calls its methods; ``slot.lock`` guards the anchor and momentum against
    the threads that read them (the averager's state provider, checkpoints)."""

    def __init__(self, slot: FragmentSlot, replica: Replica | None, cfg: OuterConfig, transport: Transport | None,
                 hash_anchor: Callable[[Mapping[str, torch.Tensor]], str] = no_hash,
                 measure_ratio: bool = False) -> None:
        self.slot, self.replica, self.cfg, self.transport = slot, replica, cfg, transport
        self.hash_anchor = hash_anchor
        self.measure_ratio = measure_ratio
        self.max_delta_ratio = 0.0
        """The largest ``||pseudo-gradient|| / ||anchor||`` handed off so far (measured only with ``measure_ratio``)."""

    @property
    def index(self) -> int:
        return self.slot.index

    @property
    def lock(self) -> threading.Lock:
        return self.slot.lock

    def _transport(self) -> Transport:
        if self.transport is None:
            raise ValueError(f"fragment {self.slot.index}: this sync has no transport")
        return self.transport

    def _replica(self) -> Replica:
        if self.replica is None:
            raise ValueError(f"fragment {self.slot.index}: this sync has no replica")
        return self.replica

    # ------------------------------------------------------------ hand off

    def hand_off(self, step: int) -> HandOff:
        """Start a round with this fragment's progress (never waits for it): refused while something is in
        flight; dropped, with the fragment re-anchored, when the local check refuses the pseudo-gradient."""
        slot = self.slot
        if slot.inflight is not None:
            slot.busy_skips += 1
            return HandOff(BUSY)
        params = self._replica().params
        with torch.no_grad():  # on the CPU, in fp32, on every peer alike
            delta = {n: slot.anchor[n] - theta for n, theta in to_host(params, slot.names).items()}
        problem = outer.local_problem(delta, slot.anchor, self.cfg.max_delta_ratio)
        if problem is not None:
            self.reanchor()
            return HandOff(DROPPED, reason=problem)
        ratio = outer.delta_ratio(delta, slot.anchor) if self.measure_ratio else math.nan
        if self.measure_ratio:
            self.max_delta_ratio = max(self.max_delta_ratio, ratio)
        sent, norms = outer.encode_contribution(delta, self.cfg.merge)
        contribution = Contribution(fragment=slot.index, version=slot.version, anchor_hash=slot.anchor_hash,
                                    tokens=slot.since_tokens, steps=slot.since_steps,
                                    weight=outer.contribution_weight(slot.since_tokens, slot.since_steps,
                                                                     self.cfg.weighting),
                                    tensors=sent, norms=norms, delta_ratio=ratio)
        slot.sent_step, slot.sent_tokens, slot.sent_steps = step, slot.since_tokens, slot.since_steps
        slot.inflight = self._transport().start_round(contribution)
        slot.inflight_kind = ROUND
        return HandOff(STARTED, contribution=contribution)

    def reanchor(self) -> None:
        """Drop this fragment's progress: weights <- anchor, fresh AdamW moments for them (never sent)."""
        slot, replica = self.slot, self._replica()
        with slot.lock, torch.no_grad():
            load_into(replica.params, slot.anchor)
            for n in slot.names:
                replica.opt.state.pop(replica.params[n], None)
        slot.since_tokens = slot.since_steps = 0
        slot.local_drops += 1

    # ------------------------------------------------------------ collect

    def finished(self, step: int, min_age_steps: int) -> Finished | None:
        """Take the finished round or download out of the slot, or None: nothing in flight, not done yet,
        or a committed round younger than ``min_age_steps`` (tau: mixed in a few steps after it was sent)."""
        slot = self.slot
        fut = slot.inflight
        if fut is None or not fut.done():
            return None
        if slot.inflight_kind == ROUND and fut.result().committed and step - slot.sent_step < min_age_steps:
            return None
        slot.inflight = None
        return Finished(slot.inflight_kind, fut)

    def abandon(self) -> None:
        """Forget what is in flight (a learner that left loses its round)."""
        self.slot.inflight = None

    def start_fetch(self) -> None:
        """Download a state ahead of ours (collected by :meth:`finished`, applied by :meth:`apply_fetched`)."""
        slot = self.slot
        slot.inflight = self._transport().fetch_state(slot.rank)
        slot.inflight_kind = FETCH

    # ------------------------------------------------------------ apply

    def apply_round(self, outcome: Outcome, plain: bool = False) -> None:
        """Commit: outer Nesterov step on the anchor, alpha-mix into the weights, settle what was sent.
        ``plain``: the anchor takes the merged step whole (lr 1, no momentum: the final average).
        Discard: nothing changes."""
        slot = self.slot
        if not outcome.committed:
            slot.discarded += 1
            pending = getattr(outcome, "pending", None)
            if pending is not None:
                slot.pending = self._pending(pending)
            elif slot.pending is not None and slot.pending.base != slot.rank:
                slot.pending = None  # a kept round stays while we are still at its base: a later round at the same
            return  # version that failed otherwise (abandoned: a peer is past us) must not drop it (a swarm of two)
        merged = outcome.merged
        if merged is None:
            raise ValueError(f"fragment {slot.index}: a committed round without a merged pseudo-gradient")
        o = self.cfg
        mixed = getattr(outcome, "mixed_anchor", None)
        with slot.lock, torch.no_grad():
            if mixed is not None:  # grid groups: start from the group's averaged anchor, momentum and version
                self._take_mixed(mixed, outcome)  # type: ignore[arg-type]
            if plain:  # anchor <- anchor - mean delta = the weighted average of the members' weights
                outer.nesterov_step(slot.anchor, merged, outer.OuterState(), lr=1.0, momentum=0.0)
                slot.state.version += 1
            else:
                outer.nesterov_step(slot.anchor, merged, slot.state, o.lr, o.momentum)
            if self.replica is not None:
                mixed = to_host(self.replica.params, slot.names)  # mixed on the CPU, then loaded onto the device
                outer.alpha_mix(mixed, slot.anchor, o.alpha)
                load_into(self.replica.params, mixed)
            slot.anchor_hash = self.hash_anchor(slot.anchor)
        self.settle()
        slot.committed += 1
        slot.restored = False
        slot.pending = None
        self._advertise()

    def _pending(self, merged: Mapping[str, torch.Tensor]) -> PendingRound:
        """What committing ``merged`` would make of our anchor and momentum (copies: nothing changes now)."""
        slot = self.slot
        anchor, state, base = self._copies()
        outer.nesterov_step(anchor, merged, state, self.cfg.lr, self.cfg.momentum)
        return PendingRound(base=base, rank=(state.version, self.hash_anchor(anchor)), anchor=anchor,
                            momentum=state.momentum, sent_tokens=slot.sent_tokens, sent_steps=slot.sent_steps)

    def _copies(self) -> tuple[dict[str, torch.Tensor], outer.OuterState, tuple[int, str]]:
        """Copies of our anchor and outer state, and our rank, taken together."""
        slot = self.slot
        with slot.lock, torch.no_grad():
            return ({n: t.clone() for n, t in slot.anchor.items()},
                    outer.OuterState(momentum={n: t.clone() for n, t in slot.state.momentum.items()},
                                     version=slot.version), slot.rank)

    def adopt_pending(self) -> None:
        """Commit the round we kept (:attr:`FragmentSlot.pending`) as :meth:`apply_round` would have: its anchor
        and momentum become ours, our weights are alpha-mixed with the anchor, and what it carried is settled."""
        slot = self.slot
        pending = slot.pending
        if pending is None or pending.base != slot.rank or slot.inflight is not None:
            raise ValueError(f"fragment {slot.index}: no pending round to adopt at {slot.rank}")
        with slot.lock, torch.no_grad():
            slot.anchor = pending.anchor
            slot.state = outer.OuterState(momentum=pending.momentum, version=pending.rank[0])
            slot.anchor_hash = pending.rank[1]
            if self.replica is not None:
                mixed = to_host(self.replica.params, slot.names)
                outer.alpha_mix(mixed, slot.anchor, self.cfg.alpha)
                load_into(self.replica.params, mixed)
        slot.since_tokens = max(0, slot.since_tokens - pending.sent_tokens)
        slot.since_steps = max(0, slot.since_steps - pending.sent_steps)
        slot.pending = None
        slot.committed += 1
        slot.late_commits += 1
        slot.restored = False
        self._advertise()

    def _take_mixed(self, anchor: Mapping[str, torch.Tensor], outcome: GridOutcome) -> None:
        """(under the lock) Grid groups: rebase our weights onto the group's averaged anchor, ``theta <- theta +
        (mixed - ours)`` (our unsent progress is kept), and take its averaged momentum and the group's version, from
        which the outer step then moves on (to ``version_after``)."""
        slot = self.slot
        momentum = outcome.mixed_momentum
        if momentum is None or outcome.version_after < 1:
            raise ValueError(f"fragment {slot.index}: a grid round without its averaged momentum or version")
        if self.replica is not None:
            rebased = to_host(self.replica.params, slot.names)
            outer.rebase(rebased, slot.anchor, anchor)
            load_into(self.replica.params, rebased)
        slot.anchor = {n: anchor[n].clone() for n in slot.names}
        slot.state = outer.OuterState(momentum={n: momentum[n].clone() for n in slot.names},
                                      version=outcome.version_after - 1)

    def settle(self) -> None:
        """What went out is in the anchor now: it leaves the unsynced progress (once; idempotent)."""
        slot = self.slot
        slot.since_tokens -= slot.sent_tokens
        slot.since_steps -= slot.sent_steps
        slot.sent_tokens = slot.sent_steps = 0

    def apply_fetched(self, fetched: AnchorState) -> str:
        """Rebase our progress onto a downloaded anchor that is ahead of ours: ``theta <- new + (theta - old)``;
        after a resume (``slot.restored``) onto a newer version, restart from the new anchor instead (rounds
        committed after the checkpoint may already hold that progress). Returns what was done: ``"fork
        healed"`` (equal versions), ``"reset after resume"`` or ``"rebased"``."""
        slot = self.slot
        fork = fetched.version == slot.version
        reset = slot.restored and not fork
        with slot.lock, torch.no_grad():
            if self.replica is not None:
                if reset:
                    load_into(self.replica.params, {n: fetched.anchor[n] for n in slot.names})
                else:
                    rebased = to_host(self.replica.params, slot.names)
                    outer.rebase(rebased, slot.anchor, fetched.anchor)
                    load_into(self.replica.params, rebased)
            if reset:
                slot.since_tokens = slot.since_steps = 0
                slot.restored = False
            slot.anchor = fetched.anchor
            slot.state = outer.OuterState(momentum=fetched.momentum, version=fetched.version)
            slot.anchor_hash = fetched.anchor_hash
        slot.resynced += 1
        slot.forks_healed += fork
        slot.pending = None
        self._advertise()
        return "fork healed" if fork else "reset after resume" if reset else "rebased"

    def replayed(self, rounds: Sequence[KeptRound]) -> SwarmState | None:
        """Where replaying ``rounds`` (a chain of committed rounds from our rank, :func:`~p2p_diloco.core.replay.
        chain`) takes our anchor and momentum: each outer step, on copies, must make the anchor hash its round names;
        None at the first that does not (or if the chain does not start at our rank). Nothing changes here: the
        caller applies the state as a download's (:meth:`apply_fetched`)."""
        anchor, state, at = self._copies()
        if not rounds:
            return None
        with torch.no_grad():
            for kept in rounds:
                if kept.base != at:
                    return None
                outer.nesterov_step(anchor, kept.merged, state, self.cfg.lr, self.cfg.momentum)
                at = (state.version, self.hash_anchor(anchor))
                if at[1] != kept.anchor_hash:
                    return None
        return SwarmState(state.version, anchor, state.momentum, at[1])

    def reset_to(self, state: AnchorState) -> None:
        """(Re)join: the weights and anchor become ``state``'s, with no unsynced progress (the caller gives
        the replica a fresh inner optimizer). What is in flight stays: a round we sent before is still ours."""
        slot = self.slot
        with slot.lock, torch.no_grad():
            if self.replica is not None:
                load_into(self.replica.params, {n: state.anchor[n] for n in slot.names})
            slot.anchor = state.anchor
            slot.state = outer.OuterState(momentum=state.momentum, version=state.version)
            slot.anchor_hash = state.anchor_hash
        slot.since_tokens = slot.since_steps = 0

    def state_copy(self) -> SwarmState:
        """A copy of this fragment's anchor, momentum and version (what a donor would send)."""
        slot = self.slot
        with slot.lock:
            return SwarmState(slot.version, {n: t.clone() for n, t in slot.anchor.items()},
                              {n: t.clone() for n, t in slot.state.momentum.items()}, slot.anchor_hash)

    def _advertise(self) -> None:
        if self.transport is not None:
            self.transport.anchor_changed(*self.slot.rank)
