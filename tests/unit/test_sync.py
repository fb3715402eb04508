"""The per-fragment sync state machine (p2p_diloco/sync/fragment.py) on a fake transport: no network, no
model, two tensors. These are the rules both the networked learner and the simulator follow."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from p2p_diloco.core import outer
from p2p_diloco.core.config import OuterConfig
from p2p_diloco.sync.fragment import (
    BUSY,
    Contribution,
    DROPPED,
    FETCH,
    ROUND,
    STARTED,
    FragmentSync,
    SwarmState,
)
from p2p_diloco.sync.slot import FragmentSlot

NAMES = ("a", "b")


@dataclass
class FakeTransport:
    """Records contributions and fetches; the test resolves their futures."""

    offers: list[tuple[Contribution, Future[Any]]] = field(default_factory=list)
    fetches: list[tuple[tuple[int, str], Future[Any]]] = field(default_factory=list)
    advertised: list[tuple[int, str]] = field(default_factory=list)

    def start_round(self, contribution: Contribution) -> Future[Any]:
        done: Future[Any] = Future()
        self.offers.append((contribution, done))
        return done

    def fetch_state(self, ours: tuple[int, str]) -> Future[Any]:
        done: Future[Any] = Future()
        self.fetches.append((ours, done))
        return done

    def anchor_changed(self, version: int, anchor_hash: str) -> None:
        self.advertised.append((version, anchor_hash))


@dataclass
class FakeReplica:
    params: dict[str, torch.nn.Parameter]
    opt: Any


@dataclass(frozen=True)
class Ended:
    committed: bool
    merged: dict[str, torch.Tensor] | None = None


def make(theta: float = 0.5, anchor: float = 1.0, **cfg: Any) -> tuple[FragmentSync, FakeTransport, FakeReplica]:
    params = {n: torch.nn.Parameter(torch.full((3,), theta)) for n in NAMES}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    for p in params.values():
        opt.state[p] = {"momentum_buffer": torch.ones(3)}
    replica = FakeReplica(params, opt)
    transport = FakeTransport()
    slot = FragmentSlot(0, NAMES, {n: torch.full((3,), anchor) for n in NAMES}, since_tokens=100, since_steps=4)
    o = OuterConfig(**{"lr": 1.0, "momentum": 0.0, "alpha": 0.0, "merge": "mean", "weighting": "tokens", **cfg})
    return FragmentSync(slot, replica, o, transport, hash_anchor=lambda a: f"h{float(a['a'][0]):g}"), transport, replica


def test_hand_off_sends_the_pseudo_gradient_and_marks_what_went_out() -> None:
    sync, transport, _ = make()
    handed = sync.hand_off(step=7)
    assert handed.status == STARTED and handed.contribution is not None
    offer = handed.contribution
    assert offer.tokens == 100 and offer.steps == 4 and offer.weight == 100.0 and offer.version == 0
    assert all(torch.equal(offer.tensors[n], torch.full((3,), 0.5)) for n in NAMES)  # anchor - theta
    assert sync.slot.inflight_kind == ROUND and sync.slot.sent_step == 7 and len(transport.offers) == 1


def test_a_second_hand_off_while_in_flight_is_busy() -> None:
    sync, transport, _ = make()
    sync.hand_off(step=1)
    assert sync.hand_off(step=2).status == BUSY
    assert sync.slot.busy_skips == 1 and len(transport.offers) == 1


def test_a_non_finite_pseudo_gradient_is_dropped_and_the_fragment_re_anchored() -> None:
    sync, transport, replica = make(theta=float("nan"))
    handed = sync.hand_off(step=3)
    assert handed.status == DROPPED and "not finite" in handed.reason
    assert not transport.offers and sync.slot.inflight is None
    assert all(torch.equal(replica.params[n].detach(), torch.ones(3)) for n in NAMES)  # weights <- anchor
    assert not replica.opt.state  # fresh moments for the fragment's weights
    assert sync.slot.since_tokens == sync.slot.since_steps == 0 and sync.slot.local_drops == 1


def test_an_absurd_pseudo_gradient_is_dropped() -> None:
    sync, _, _ = make(theta=-100.0, max_delta_ratio=10.0)
    assert sync.hand_off(step=3).status == DROPPED


def test_a_committed_round_waits_tau_steps_then_steps_the_anchor_and_settles() -> None:
    sync, transport, replica = make()
    sync.hand_off(step=10)
    sync.slot.since_tokens, sync.slot.since_steps = 125, 5  # a step taken since
    transport.offers[0][1].set_result(Ended(True, {n: torch.full((3,), 0.25) for n in NAMES}))
    assert sync.finished(step=10, min_age_steps=1) is None  # tau = 1: not yet
    done = sync.finished(step=11, min_age_steps=1)
    assert done is not None and done.kind == ROUND and sync.slot.inflight is None
    sync.apply_round(done.future.result())
    # lr 1, no momentum: anchor 1.0 - 0.25; alpha 0: the weights take the anchor
    assert all(torch.equal(sync.slot.anchor[n], torch.full((3,), 0.75)) for n in NAMES)
    assert all(torch.equal(replica.params[n].detach(), torch.full((3,), 0.75)) for n in NAMES)
    assert sync.slot.version == 1 and sync.slot.committed == 1 and sync.slot.anchor_hash == "h0.75"
    assert (sync.slot.since_tokens, sync.slot.since_steps) == (25, 1)  # only what went out is settled
    assert transport.advertised == [(1, "h0.75")]
    sync.settle()  # idempotent
    assert (sync.slot.since_tokens, sync.slot.since_steps) == (25, 1)


def test_alpha_mix_and_nesterov_match_core_outer() -> None:
    sync, transport, replica = make(lr=0.7, momentum=0.9, alpha=0.5)
    sync.hand_off(step=0)
    merged = {n: torch.full((3,), 0.5) for n in NAMES}
    transport.offers[0][1].set_result(Ended(True, merged))
    done = sync.finished(step=5, min_age_steps=1)
    assert done is not None
    sync.apply_round(done.future.result())
    expected = {n: torch.ones(3) for n in NAMES}
    outer.nesterov_step(expected, merged, outer.OuterState(), 0.7, 0.9)
    local = {n: torch.full((3,), 0.5) for n in NAMES}
    outer.alpha_mix(local, expected, 0.5)
    assert all(torch.equal(sync.slot.anchor[n], expected[n]) for n in NAMES)
    assert all(torch.equal(replica.params[n].detach(), local[n]) for n in NAMES)


@dataclass(frozen=True)
class GridEnded:
    committed: bool
    merged: dict[str, torch.Tensor] | None
    mixed_anchor: dict[str, torch.Tensor] | None
    mixed_momentum: dict[str, torch.Tensor] | None
    version_after: int


def test_a_grid_round_steps_from_the_groups_mixed_anchor_and_keeps_our_unsent_progress() -> None:
    sync, transport, replica = make(lr=0.7, momentum=0.9, alpha=0.0)
    sync.hand_off(step=0)
    with torch.no_grad():  # a step taken since: unsent progress of 0.1
        for p in replica.params.values():
            p.sub_(0.1)
    mixed = {n: torch.full((3,), 1.2) for n in NAMES}  # the group's averaged anchor (ours was 1.0)
    momentum = {n: torch.full((3,), 0.3) for n in NAMES}
    merged = {n: torch.full((3,), 0.5) for n in NAMES}
    transport.offers[0][1].set_result(GridEnded(True, merged, mixed, momentum, version_after=8))
    done = sync.finished(step=2, min_age_steps=1)
    assert done is not None
    sync.apply_round(done.future.result())
    expected = {n: t.clone() for n, t in mixed.items()}
    state = outer.OuterState(momentum={n: t.clone() for n, t in momentum.items()}, version=7)
    outer.nesterov_step(expected, merged, state, 0.7, 0.9)
    assert all(torch.allclose(sync.slot.anchor[n], expected[n]) for n in NAMES)
    assert all(torch.allclose(sync.slot.state.momentum[n], state.momentum[n]) for n in NAMES)
    assert sync.slot.version == 8 and transport.advertised == [(8, sync.slot.anchor_hash)]
    # alpha 0: the weights take the new anchor; the mixed inputs were copied, not aliased
    assert all(torch.allclose(replica.params[n].detach(), expected[n]) for n in NAMES)
    assert all(torch.equal(mixed[n], torch.full((3,), 1.2)) for n in NAMES)


def test_a_grid_round_rebases_unsent_progress_onto_the_mixed_anchor() -> None:
    sync, transport, replica = make(alpha=1.0)  # alpha 1: the weights keep their own (rebased) values
    sync.hand_off(step=0)
    mixed = {n: torch.full((3,), 1.2) for n in NAMES}
    transport.offers[0][1].set_result(GridEnded(True, {n: torch.zeros(3) for n in NAMES}, mixed,
                                                {n: torch.zeros(3) for n in NAMES}, version_after=1))
    done = sync.finished(step=1, min_age_steps=1)
    assert done is not None
    sync.apply_round(done.future.result())
    # theta 0.5 with anchor 1.0 -> 0.7 with the mixed anchor 1.2 (zero pseudo-gradient: the anchor stays 1.2)
    assert all(torch.allclose(replica.params[n].detach(), torch.full((3,), 0.7)) for n in NAMES)
    with pytest.raises(ValueError, match="momentum or version"):
        sync.hand_off(step=2)
        transport.offers[1][1].set_result(GridEnded(True, {n: torch.zeros(3) for n in NAMES}, mixed, None, 2))
        done = sync.finished(step=3, min_age_steps=1)
        assert done is not None
        sync.apply_round(done.future.result())


def test_a_discarded_round_changes_nothing_and_is_collected_at_once() -> None:
    sync, transport, replica = make()
    sync.hand_off(step=10)
    transport.offers[0][1].set_result(Ended(False))
    done = sync.finished(step=10, min_age_steps=5)  # a discard waits for no tau
    assert done is not None
    sync.apply_round(done.future.result())
    assert sync.slot.discarded == 1 and sync.slot.version == 0 and sync.slot.since_tokens == 100
    assert all(torch.equal(replica.params[n].detach(), torch.full((3,), 0.5)) for n in NAMES)


@dataclass(frozen=True)
class Kept:
    """A round discarded for want of verdicts, its merged result kept (``averaging.plans.RoundOutcome`` has it)."""

    committed: bool
    merged: dict[str, torch.Tensor] | None
    pending: dict[str, torch.Tensor] | None


def test_a_kept_round_survives_a_later_discard_at_the_same_version_and_is_adopted() -> None:
    """In a swarm of two the kept round is the only way back (nobody else vouches for a download): a second round at
    the same version, abandoned because the peer was already past us, dropped it (CI: no late commit, then failed
    downloads until the end)."""
    sync, transport, _ = make()
    sync.hand_off(step=10)
    step = {n: torch.full((3,), 0.25) for n in NAMES}
    transport.offers[0][1].set_result(Kept(False, None, step))  # no verdicts: discarded, its result kept
    sync.apply_round(sync.finished(step=10, min_age_steps=0).future.result())  # type: ignore[union-attr]
    kept = sync.slot.pending
    assert kept is not None and kept.base == sync.slot.rank
    sync.hand_off(step=20)  # the next round at the same version ...
    transport.offers[1][1].set_result(Kept(False, None, None))  # ... abandoned while matching
    sync.apply_round(sync.finished(step=20, min_age_steps=0).future.result())  # type: ignore[union-attr]
    assert sync.slot.pending is kept  # still ours to adopt
    sync.adopt_pending()
    assert sync.slot.version == 1 and sync.slot.anchor_hash == kept.rank[1] and sync.slot.pending is None
    # once we moved on, a discard drops a kept round whose base is no longer ours
    sync.slot.pending = kept
    sync.hand_off(step=30)
    transport.offers[2][1].set_result(Kept(False, None, None))
    sync.apply_round(sync.finished(step=30, min_age_steps=0).future.result())  # type: ignore[union-attr]
    assert sync.slot.pending is None


def test_a_committed_round_without_a_merged_result_is_refused() -> None:
    sync, _, _ = make()
    with pytest.raises(ValueError, match="without a merged"):
        sync.apply_round(Ended(True, None))


def test_a_fetched_state_rebases_our_progress() -> None:
    sync, transport, replica = make()
    sync.start_fetch()
    assert sync.slot.inflight_kind == FETCH and transport.fetches[0][0] == (0, "")
    transport.fetches[0][1].set_result(SwarmState(3, {n: torch.full((3,), 2.0) for n in NAMES}, {}, "h2"))
    done = sync.finished(step=0, min_age_steps=99)  # downloads are applied whatever tau
    assert done is not None and done.kind == FETCH
    assert sync.apply_fetched(done.future.result()) == "rebased"
    # theta <- new + (theta - old) = 2.0 + (0.5 - 1.0)
    assert all(torch.equal(replica.params[n].detach(), torch.full((3,), 1.5)) for n in NAMES)
    assert sync.slot.rank == (3, "h2") and sync.slot.resynced == 1 and sync.slot.since_tokens == 100


def test_a_fork_at_our_version_is_healed() -> None:
    sync, _, _ = make()
    assert sync.apply_fetched(SwarmState(0, {n: torch.full((3,), 2.0) for n in NAMES}, {}, "h2")) == "fork healed"
    assert sync.slot.forks_healed == 1


def test_after_a_resume_a_newer_anchor_resets_the_fragment() -> None:
    sync, _, replica = make()
    sync.slot.restored = True
    assert sync.apply_fetched(SwarmState(2, {n: torch.full((3,), 2.0) for n in NAMES}, {}, "h2")) == "reset after resume"
    assert all(torch.equal(replica.params[n].detach(), torch.full((3,), 2.0)) for n in NAMES)
    assert sync.slot.since_tokens == 0 and not sync.slot.restored


def test_a_record_without_replica_only_steps_its_anchor() -> None:
    slot = FragmentSlot(0, NAMES, {n: torch.ones(3) for n in NAMES})
    record = FragmentSync(slot, None, OuterConfig(lr=1.0, momentum=0.0), None)
    record.apply_round(Ended(True, {n: torch.full((3,), 0.5) for n in NAMES}), plain=True)
    assert slot.version == 1 and all(torch.equal(slot.anchor[n], torch.full((3,), 0.5)) for n in NAMES)
    copy = record.state_copy()
    assert copy.version == 1 and copy.anchor["a"] is not slot.anchor["a"]
