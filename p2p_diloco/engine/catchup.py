"""Catching up, applied: a finished state download -- a state, or rounds a peer kept to replay -- becomes our
fragment's anchor (:class:`~p2p_diloco.engine.rounds.Rounds` collects it; :meth:`~p2p_diloco.engine.rounds.Rounds.
catch_up` starts it)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from p2p_diloco.averaging.decisions import is_ahead, relative_distance
from p2p_diloco.core import events
from p2p_diloco.core.replay import KeptRound
from p2p_diloco.sync.fragment import FragmentSync
from p2p_diloco.sync.slot import FragmentSlot

if TYPE_CHECKING:
    from p2p_diloco.averaging.host import Download

Event = Callable[[events.Event], None]
"""Logs an event (the learner fills its envelope)."""
Keep = Callable[[KeptRound], None]
"""Keeps a round for peers that replay it (the fragment's host)."""

logger = logging.getLogger("p2p_diloco.engine.rounds")


def fetch_order(slots: Sequence[FragmentSlot]) -> list[int]:
    """The order catch-up considers fragments in: the least recently fetched first (never fetched: by index). On a
    slow link downloads go one at a time and the swarm moves on while one goes, so the first fragments were always
    behind again when the link came free: in fragment order, a learner paused 60 s at 0.5 Mbit/s fetched fragment 0
    three times and fragment 1 twice in 170 s and never reached fragment 3, which stayed at v0 to the end."""
    return sorted(range(len(slots)), key=lambda i: (slots[i].last_fetch_try, i))


def apply_download(sync: FragmentSync, download: Download, event: Event, keep: Keep) -> None:
    """Rebase our progress onto a downloaded anchor (:meth:`FragmentSync.apply_fetched`), or onto where the rounds a
    peer kept take ours (:func:`apply_replayed`). At equal versions (a fork) the distance between the two anchors is
    our consensus distance."""
    if download.replayed:
        apply_replayed(sync, download, event, keep)
        return
    slot, fetched = sync.slot, download.fetched
    tried, failures, took_s = len(download.attempts), tuple(download.failures), round(download.duration_s, 3)
    received = download.bytes_received
    for failure in download.failures:
        logger.warning("fragment %d: a donor failed: %s", slot.index, failure)
    if fetched is None or not is_ahead((fetched.version, fetched.anchor_hash), slot.rank):
        event(events.ResyncEvent(fragment=slot.index, outcome="failed" if failures else "nothing newer",
                                 version=slot.version, donors_tried=tried, donor_failures=failures,
                                 duration_s=took_s, bytes=received))
        return
    fork = fetched.version == slot.version
    if fork:  # only this thread writes the anchor: read without the lock
        slot.consensus_distance = relative_distance(slot.anchor, fetched.anchor)
    old, old_hash = slot.version, slot.anchor_hash
    how = sync.apply_fetched(fetched)
    event(events.ResyncEvent(fragment=slot.index, outcome=how, version=old, version_after=slot.version,
                             anchor_hash_before=old_hash, anchor_hash=slot.anchor_hash, donors_tried=tried,
                             donor_failures=failures, duration_s=took_s, bytes=received,
                             consensus_distance=slot.consensus_distance if fork else None))
    logger.info("fragment %d: %s from v%d (%s) onto v%d (%s)%s", slot.index,
                "reset (the swarm moved on since our checkpoint)" if how == "reset after resume" else "rebased",
                old, old_hash, slot.version, slot.anchor_hash,
                f"; fork healed, consensus distance {slot.consensus_distance:.2e}" if fork else "")


def apply_replayed(sync: FragmentSync, download: Download, event: Event, keep: Keep) -> None:
    """Catch up by the rounds a peer kept (:meth:`FragmentSync.replayed`: each step must make the anchor its round
    names), applied as a downloaded state would be, and kept to serve in turn (a peer that caught up so serves the
    rounds it did not commit itself); if a step does not, the state is downloaded at once instead."""
    slot, rounds = sync.slot, download.replayed
    state = sync.replayed(rounds)
    if state is None:
        slot.no_replay_from, slot.last_fetch_try = slot.rank, -math.inf  # retried at once
        event(events.ResyncEvent(fragment=slot.index, outcome="failed", version=slot.version,
                                 reason=f"replaying {len(rounds)} rounds from v{slot.version} did not "
                                        "reproduce the anchors they named; downloading the state instead",
                                 duration_s=round(download.duration_s, 3), bytes=download.bytes_received))
        logger.warning("fragment %d: replaying %d rounds from v%d (%s) did not reproduce their anchors; "
                       "downloading the state instead", slot.index, len(rounds), slot.version, slot.anchor_hash)
        return
    old, old_hash = slot.rank
    how = sync.apply_fetched(state)
    for kept in rounds:
        keep(kept)
    event(events.ReplayEvent(fragment=slot.index, outcome=how, rounds=len(rounds), version=old,
                             version_after=slot.version, anchor_hash_before=old_hash,
                             anchor_hash=slot.anchor_hash, duration_s=round(download.duration_s, 3),
                             bytes=download.bytes_received))
    logger.info("fragment %d: replayed %d rounds a peer kept (%d B), v%d (%s) -> v%d (%s)", slot.index,
                len(rounds), download.bytes_received, old, old_hash, slot.version, slot.anchor_hash)
