"""The ``final`` line of a learner (:func:`final_summary`) and the evaluation of anchors it reports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from p2p_diloco.core import data
from p2p_diloco.core.config import Config
from p2p_diloco.core.devices import load_into
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.model import build_model

if TYPE_CHECKING:
    from p2p_diloco.engine.engine import DiLoCo
    from p2p_diloco.engine.rounds import Rounds


def final_consensus(rounds: Rounds) -> list[float | None]:
    """Per fragment, the consensus distance we can state at the end: 0.0 when every live peer of the last view
    holds exactly our (version, anchor hash); None when one holds another anchor (it differs, by an amount we
    did not measure) or no live peer was left to compare with. In grid mode groups are small and anchors only
    converge, so it is the relative distance measured across the last committed group instead."""
    if rounds.grid:
        return [slot.consensus_distance for slot in rounds.slots]
    out: list[float | None] = []
    for slot in rounds.slots:
        ranks = rounds.peer_ranks(slot)
        out.append(0.0 if ranks and all(tuple(rank) == slot.rank for rank in ranks) else None)
    return out


def final_summary(d: DiLoCo, eval_start: float, eval_end: float, train_s: float, stepping_s: float,
                  resumed_from_step: int | None, lr: float) -> dict[str, Any]:
    """The ``final`` line: where we ended (versions, anchor hashes), the anchors' eval loss before and after,
    rounds and downloads per fragment, how long the inner loop waited (stepping: the inner steps) and the inner
    learning rate of the last step (``lr``: where the schedule ended)."""
    sent, received = d.rounds.bytes_total()
    slots, r = d.slots, d.rounds
    return {
        "name": d.joined.name, "peer_id": d.joined.peer_id, "config_hash": config_hash(d.cfg),
        "steps": d.inner_step, "tokens": d.tokens, "versions": [s.version for s in slots],
        "anchor_hashes": [s.anchor_hash for s in slots],
        "committed": [s.committed for s in slots], "discarded": [s.discarded for s in slots],
        "resynced": [s.resynced for s in slots], "forks_healed": [s.forks_healed for s in slots],
        "late_commits": [s.late_commits for s in slots],
        "consensus_distance": final_consensus(r),
        "fork_distance": [s.consensus_distance for s in slots],
        "busy_skips": [s.busy_skips for s in slots],
        "behind_skips": [s.behind_skips for s in slots],
        "eval_loss_start": eval_start, "eval_loss_end": eval_end,
        "train_s": round(train_s, 3), "stepping_s": round(stepping_s, 3), "blocked_s": round(d.blocked_s, 4),
        "max_stall_s": round(d.max_stall_s, 4),
        "blocked_share": d.blocked_s / train_s if train_s > 0 else 0.0,
        "utilization": stepping_s / train_s if train_s > 0 else 0.0,
        "bytes_sent": sent, "bytes_received": received, "window_s": round(r.window_s, 3),
        "schedule": d.cfg.averaging.schedule, "sync_period_s": d.clock.period_s if d.clock else None,
        "first_contribution_s": None if r.first_contribution_s is None else round(r.first_contribution_s, 3),
        "last_sync_time": r.last_sync_time,
        "resumed_from_step": resumed_from_step, "lr": lr,
    }


def evaluate_weights(cfg: Config, device: torch.device, weights: Mapping[str, torch.Tensor], batches: list[Any]) -> float:
    """Held-out eval loss of a model with these weights on ``batches``, on ``device``, in fp32 whatever
    ``inner.precision`` (the loss of the anchors themselves)."""
    model = build_model(cfg.model, cfg.run.seed).to(device)
    load_into(dict(model.named_parameters()), weights)
    if device.type != "cpu":
        batches = [(x.to(device), y.to(device)) for x, y in batches]
    with torch.no_grad():
        return data.evaluate(model, batches)
