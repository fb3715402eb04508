"""One fragment's sync state on a learner."""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from p2p_diloco.core import outer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingRound:
    """A round we discarded for want of verdicts although our all-reduce was complete: its result, kept in case
    a member committed it (see :meth:`~p2p_diloco.sync.fragment.FragmentSync.adopt_pending`)."""

    base: tuple[int, str]
    """The (version, anchor hash) it was computed from: it is adoptable only while we are still there."""
    rank: tuple[int, str]
    """The (version, anchor hash) its commit makes: a peer that holds exactly this committed it."""
    anchor: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    sent_tokens: int
    sent_steps: int


@dataclass
class FragmentSlot:
    """The learner's view of one fragment: its anchor, outer state, progress, and what is in flight
    (moved through its cycle by :class:`~p2p_diloco.sync.fragment.FragmentSync`)."""

    index: int
    names: tuple[str, ...]
    anchor: dict[str, torch.Tensor]
    state: outer.OuterState = field(default_factory=outer.OuterState)
    anchor_hash: str = ""
    since_tokens: int = 0
    since_steps: int = 0
    inflight: Future | None = None
    inflight_kind: str = ""  # "round" or "fetch" (sync.fragment.ROUND, FETCH)
    inflight_since: float = 0.0
    """When what is in flight started (the engine's DHT time)."""
    last_round_at: float = -math.inf
    """When our last round of this fragment was handed off (the engine's DHT time): a final round does not go to a
    boundary whose round we already took part in (:func:`~p2p_diloco.engine.rounds.final_rounds`)."""
    sent_step: int = 0
    sent_tokens: int = 0
    sent_steps: int = 0
    committed: int = 0
    discarded: int = 0
    resynced: int = 0
    forks_healed: int = 0
    consensus_distance: float = 0.0
    """``||ours - winner|| / ||winner||`` at the last fork we healed (0.0: none yet)."""
    late_commits: int = 0
    """Rounds we first discarded for want of verdicts, then adopted when a peer turned out to have committed them."""
    pending: PendingRound | None = None
    busy_skips: int = 0
    local_drops: int = 0
    """Own pseudo-gradients the local check refused (the fragment was re-anchored)."""
    behind_skips: int = 0
    """Due rounds not started because a live peer was ahead (see round_is_doomed)."""
    restored: bool = False
    """Progress restored from a checkpoint and not yet in a round we committed: rounds that committed after
    the checkpoint (before the crash) may already hold part of it, so it is not rebased (see apply_fetched)."""
    last_fetch_try: float = -math.inf
    no_replay_from: tuple[int, str] | None = None
    """A rank from which replaying a peer's kept rounds did not reproduce their anchors: from it, we download."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def rank(self) -> tuple[int, str]:
        """(version, anchor hash): what :func:`~p2p_diloco.averaging.decisions.anchor_order` compares."""
        return self.state.version, self.anchor_hash


