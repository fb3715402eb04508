"""The hivemind transport: each fragment's :class:`~p2p_diloco.transport.network.Host` is an :class:`AveragerLink`
over its averager process (:class:`~p2p_diloco.averaging.host.FragmentAveragerHost`), started side by side by
:func:`averager_hosts`.

It imports no part of the engine: what it knows of a round is the :class:`~p2p_diloco.sync.fragment.Contribution`
and the engine's snapshot at its hand-off (:class:`~p2p_diloco.transport.network.RoundContext`); it plans the round
from them (:func:`~p2p_diloco.transport.planning.plan_round`) and derives the wire metadata from the contribution
(:meth:`~p2p_diloco.averaging.decisions.RoundMeta.of`). What it reads of the engine's fragments is the slot's anchor
and momentum, under the slot's lock: what a grid round averages too, and what a peer that downloads is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from p2p_diloco.averaging.decisions import ANCHOR_TENSOR, MOMENTUM_TENSOR
from p2p_diloco.averaging.host import Download, FragmentAveragerHost, decline_round, leave_rounds
from p2p_diloco.averaging.plans import RoundOutcome
from p2p_diloco.averaging.linktime import LinkEstimate
from p2p_diloco.averaging.transfer import state_payload
from p2p_diloco.core.config import Config
from p2p_diloco.core.replay import KeptRound
from p2p_diloco.sync.fragment import Contribution
from p2p_diloco.sync.slot import FragmentSlot
from p2p_diloco.transport.network import Rank, RoundContext
from p2p_diloco.transport.planning import LastGroup, clock_boundary_ms, plan_round

AVERAGER_START_TIMEOUT_S = 120.0
"""How long a fragment's averager process may take to come up (generous: a loaded 2-core machine)."""


class AveragerLink:
    """A fragment's :class:`~p2p_diloco.transport.network.Host` over its averager: a contribution becomes a round
    planned from the engine's snapshot (:func:`~p2p_diloco.transport.planning.plan_round`); with grid groups the
    round averages the fragment's anchor and outer momentum beside it (copied under the slot's lock)."""

    def __init__(self, averager: FragmentAveragerHost, slot: FragmentSlot, cfg: Config) -> None:
        self.averager, self.slot, self.cfg = averager, slot, cfg
        self.grid = cfg.averaging.groups == "grid"
        self._last_group = LastGroup()

    @property
    def prefix(self) -> str:
        """The fragment's averager prefix (its key in the DHT; grid groups salt their groups with it)."""
        return self.averager.prefix

    def start_round(self, contribution: Contribution, context: RoundContext) -> Future[RoundOutcome]:
        c = self._with_state(contribution) if self.grid else contribution
        plan = plan_round(c, context, self.cfg, self.prefix, self._last_group.get())
        return self._last_group.watch(self.averager.start_round(c, plan))

    def decline(self, context: RoundContext) -> None:
        boundary_ms = clock_boundary_ms(self.slot.index, context, self.cfg)
        if boundary_ms >= 0:
            decline_round(self.averager, boundary_ms)

    def leave(self) -> None:
        if self.cfg.averaging.clock_groups:
            leave_rounds(self.averager)

    def _with_state(self, contribution: Contribution) -> Contribution:
        """Grid groups: ``contribution`` with copies of the anchor and momentum (zeros where there is none yet), under
        ``ANCHOR_TENSOR`` and ``MOMENTUM_TENSOR`` + name: the group's members hold different ones."""
        slot = self.slot
        with slot.lock:
            anchor = {ANCHOR_TENSOR + n: slot.anchor[n].clone() for n in slot.names}
            momentum = {MOMENTUM_TENSOR + n: slot.state.momentum[n].clone() if n in slot.state.momentum
                        else torch.zeros_like(slot.anchor[n]) for n in slot.names}
        return replace(contribution, tensors={**contribution.tensors, **anchor, **momentum})

    def fetch_state(self, ours: Rank, donors: Mapping[str, Rank], link: LinkEstimate | None = None,
                    replay: bool = True) -> Future[Download]:
        return self.averager.fetch_state(ours, donors, link, replay)

    def keep_round(self, kept: KeptRound) -> None:
        self.averager.keep_round(kept)

    def last_group(self) -> tuple[int, tuple[str, ...]]:
        return self._last_group.get()

    def vouch(self, version: int, anchor: str) -> None:
        self.averager.vouch(version, anchor)

    def cancel(self) -> None:
        self.averager.cancel()

    def shutdown(self) -> None:
        self.averager.shutdown()

    def bytes_total(self) -> tuple[int, int]:
        return self.averager.bytes_total()


def averager_hosts(cfg: Config, slots: Sequence[FragmentSlot], shapes: Mapping[str, torch.Size], dht: Any,
                   private_key: Any, membership: Any,
                   host_class: type[FragmentAveragerHost] | None = None) -> list[AveragerLink]:
    """Every fragment's :class:`AveragerLink` over its averager (:func:`start_averagers`)."""
    averagers = start_averagers(cfg, slots, shapes, dht, private_key, membership, host_class)
    return [AveragerLink(averager, slot, cfg) for averager, slot in zip(averagers, slots)]


def start_averagers(cfg: Config, slots: Sequence[FragmentSlot], shapes: Mapping[str, torch.Size], dht: Any,
                    private_key: Any, membership: Any,
                    host_class: type[FragmentAveragerHost] | None = None) -> list[FragmentAveragerHost]:
    """One averager per fragment (a ``host_class``, None: :class:`FragmentAveragerHost`; a faulty one when faults are
    armed), their processes started side by side (a newcomer is up sooner); all shut down if one fails to start."""
    make = host_class or FragmentAveragerHost
    hosts = [make(cfg, s.index, s.names, shapes, dht, private_key, membership=membership,
                  state_provider=_state_provider(s), start=False) for s in slots]
    try:
        for host in hosts:
            host.start_background()
        for host in hosts:
            host.wait_ready(AVERAGER_START_TIMEOUT_S)
    except BaseException:
        for host in hosts:
            host.shutdown()
        raise
    return hosts


def _state_provider(slot: FragmentSlot) -> Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]:
    """What our averager sends a peer that downloads this fragment (read under the slot's lock)."""
    def provide() -> tuple[dict[str, Any], list[torch.Tensor]]:
        with slot.lock:
            return state_payload(slot.index, slot.version, slot.anchor, slot.state.momentum, slot.names)
    return provide
