"""A thousand learners in bounded groups: consensus distance, contributions kept, mixing time.

Cheap on purpose: a learner is an anchor vector of ``dim`` numbers, one fragment's rounds fall every
``period_s`` (the swarm clock), and a round averages within the groups of
:func:`p2p_diloco.core.groups.assign_groups` (docs/design.md, "Bounded groups"). Failures are the goodput
model's (:func:`p2p_diloco.sim.goodput.unit_timelines`), so a "heavy" run here fails the same units at the
same instants as ``scripts/bench_goodput.py``. Nothing reads a clock.

Per round k (at t = k x period_s), per live learner i (up, and past its restart):

* its progress since its last committed round is ``pending_i``; this round adds ``f x (g + e_i)``: a drift
  ``g`` common to all (||g|| = ``signal``) plus its own noise ``e_i`` (RMS norm ``noise``), ``f`` the share
  of the period it trained (1, or less just after a restart);
* a group that commits sets every member's anchor to the mean of the members' anchors plus the mean of
  their pending updates (equal weights: every learner brings one period of tokens), and clears their
  pending. Every update committed at round k thus enters the sum of the anchors with weight 1, the swarm's
  mean anchor with 1 / N_k: what one group of everyone would give it;
* a group is discarded (all or nothing) if it has fewer than ``min_group_size`` members or one of them
  fails within ``round_s``; its members keep anchors and pending for their next round (delayed, not lost);
* a learner that fails loses its pending (any protocol loses uncommitted work; counted apart) and its anchor;
  when it is back it downloads a random live learner's anchor and trains from there;
* with ``heirs`` (the design's weighted anchors) every anchor carries a weight: a group sets its members to the
  weighted mean anchor plus the sum of their updates over the group's weight, and shares the weight equally; a
  learner that dies leaves its weight to the live member of its last committed group with the smallest id (who
  held the same anchor then), one coming back takes half its donor's weight. The global model is the weighted
  mean anchor. Without, every anchor weighs 1 (plain means).

Measured:

* **consensus distance**: RMS over live learners of ||x_i - mean x||, relative to ||mean x|| (what
  ``status`` publishes) and in units of ``noise`` (scale-free; :func:`p2p_diloco.core.groups.consensus_bound`);
* **contributions reaching the global model**: sampled per-round updates are followed exactly (their
  coefficient in every learner's anchor mixes like the anchors). A committed update's *reach* is its weight
  in the final global model over its ideal weight 1 / W_k (W_k: the live learners' total weight at its
  commit; N_k without heirs). ``reach_weight`` is the total weight present over
  the ideal total (the mean reach); ``reach_kept`` the mean of min(1, reach): what is left after a
  contribution's holders died before it had mixed, with no credit for the surplus that copies to
  rejoining learners give others; ``present`` the share with any weight at all;
* **rounds to mix**: rounds after its commit until every live learner holds at least half the mean
  coefficient of a sampled update.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from p2p_diloco.core.groups import consensus_bound, grid_sides, heir, live_groups, mixing_rounds
from p2p_diloco.sim.goodput import Failures, unit_timelines

MIXED_FRACTION = 0.5
"""A sampled update has mixed everywhere when every live learner holds at least this share of its mean
coefficient."""


@dataclass(frozen=True)
class ScaleParams:
    """One simulated swarm."""

    learners: int = 1000
    group_size: int = 16
    """G: ``averaging.target_group_size`` (0: one group of everyone)."""
    rounds: int = 240
    """Rounds of the fragment (the horizon is rounds x period_s)."""
    dim: int = 64
    period_s: float = 30.92
    """Time between two rounds of the fragment (H x step time; the goodput calibration)."""
    round_s: float = 2.905
    """One round; a member failing within it discards its group's round."""
    rejoin_s: float = 8.32
    """Process start + state download of a learner coming back (the goodput calibration)."""
    min_group_size: int = 2
    signal: float = 1e-3
    """||g||: the common part of one round's update, relative to the starting anchor's norm (1)."""
    noise: float = 1e-3
    """RMS ||e_i||: the learner's own part of one round's update (distances are reported in this unit; 0: none,
    distances absolute)."""
    heirs: bool = True
    """Weighted anchors (design: "Bounded groups"): a learner that dies leaves its weight to a live member of its
    last committed group, a learner coming back takes half its donor's; False: plain means, every anchor weight 1
    (what is lost when a holder dies before an update has mixed stays lost)."""
    sampled_per_round: int = 4
    """Per-round updates followed exactly (their mixing and weight), per round."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.learners < 2 or self.rounds < 1 or self.dim < 1 or self.sampled_per_round < 0:
            raise ValueError(f"bad sizes: {self}")
        if self.signal < 0 or self.noise < 0:
            raise ValueError("signal and noise must be >= 0")
        if self.group_size != 0 and self.group_size < 2:
            raise ValueError(f"group_size must be 0 or >= 2, got {self.group_size}")
        if not (self.period_s > self.round_s > 0 and self.rejoin_s >= 0):
            raise ValueError("need period_s > round_s > 0 and rejoin_s >= 0")


def simulate(params: ScaleParams, failures: Failures | None) -> dict[str, Any]:
    """One seeded run; ``failures`` None: nobody fails. Returns the figures (module docstring) and per-round
    series."""
    p = params
    rng = np.random.default_rng(p.seed)
    n = p.learners
    horizon = (p.rounds + 1) * p.period_s
    tl = unit_timelines(n, failures or Failures(mtbf_s=math.inf, repair_s=0.0), horizon, p.seed)
    ready = tl.up_s + np.where(tl.first, 0.0, p.rejoin_s)

    x0 = rng.standard_normal(p.dim)
    x0 /= np.linalg.norm(x0)
    g = rng.standard_normal(p.dim)
    g *= p.signal / np.linalg.norm(g)
    x = np.tile(x0, (n, 1))
    pending = np.zeros((n, p.dim))
    w = np.zeros(n)  # weight of each learner's anchor in the global model (push-sum; 0: holds none)
    last_group: list[np.ndarray | None] = [None] * n  # members of each learner's last committed round
    pending_share = np.zeros(n)  # periods of training in ``pending``
    ideal = x0.copy()  # the mean anchor one group of everyone would give these committed updates
    interval = np.full(n, -1)  # the timeline row each learner's state belongs to (-1: none)
    trained_to = np.zeros(n)
    ids = [str(u) for u in range(n)]

    # Followed updates: coefficient of each in every learner's anchor (rows), and where it waits uncommitted.
    k_max = p.sampled_per_round * p.rounds
    coef = np.zeros((k_max, n))
    pend_coef = np.zeros((k_max, n))
    ideal_weight = np.zeros(k_max)  # 1 / N at commit; 0 while uncommitted or lost
    committed_at = np.full(k_max, -1)
    mixed_after = np.full(k_max, -1)
    followed = 0

    series: dict[str, list[float]] = {"t_s": [], "live": [], "distance_rel": [], "distance_noise": [],
                                      "bound_noise": [], "spread_noise": [], "discarded_groups": []}
    groups_total = groups_discarded = 0
    spreads: list[float] = []
    sides = grid_sides(n, p.group_size)
    noise_unit = p.noise if p.noise > 0 else 1.0  # distances "in units of the noise"; absolute without noise
    offered = lost_with_failures = 0.0

    for k in range(1, p.rounds + 1):
        t = k * p.period_s
        rows = np.nonzero((ready <= t) & (t < tl.fail_s))[0]
        live_mask = np.zeros(n, dtype=bool)
        live_mask[tl.unit[rows]] = True
        row_of = np.full(n, -1)
        row_of[tl.unit[rows]] = rows
        # Learners whose state was lost since the last round: failed (gone, or back on a new interval).
        gone = (interval >= 0) & (row_of != interval)
        lost_with_failures += float(pending_share[gone].sum())
        for u in np.nonzero(gone)[0]:  # its weight goes to its heir (design: "no lost contribution")
            group = last_group[u]
            if p.heirs and group is not None:
                holding = {ids[m] for m in group if live_mask[m] and interval[m] >= 0 and not gone[m]}
                taker = heir(ids[u], [ids[m] for m in group], holding)
                if taker is not None:
                    w[int(taker)] += w[u]
            w[u] = 0.0
            last_group[u] = None
        pending[gone] = 0.0
        pending_share[gone] = 0.0
        pend_coef[:, gone] = 0.0
        coef[:, gone] = 0.0
        interval[gone] = -1
        holders = np.nonzero(live_mask & (interval >= 0))[0]
        for u in np.nonzero(live_mask & (interval < 0))[0]:  # back (or new): download a live learner's anchor
            if tl.first[row_of[u]] or not holders.size:
                x[u], coef[:, u], w[u] = x0, 0.0, 1.0
            else:
                donor = int(rng.choice(holders))
                x[u], coef[:, u] = x[donor], coef[:, donor]
                if p.heirs:  # the donor hands over half its weight with its anchor: the weighted sum is unchanged
                    w[donor] /= 2
                    w[u] = w[donor]
                else:
                    w[u] = 1.0
            interval[u] = row_of[u]
            trained_to[u] = ready[row_of[u]]
        live = np.nonzero(live_mask)[0]

        # This round's training.
        share = np.clip((t - trained_to[live]) / p.period_s, 0.0, 1.0)
        e = rng.standard_normal((live.size, p.dim)) * (p.noise / math.sqrt(p.dim))
        pending[live] += share[:, None] * (g + e)
        pending_share[live] += share
        trained_to[live] = t
        offered += float(share.sum())
        for u in rng.choice(live, size=min(p.sampled_per_round, live.size), replace=False):
            pend_coef[followed, u] = 1.0
            followed += 1

        # The spread of the updates going out (RMS distance to their mean): what the consensus bound scales.
        spreads.append(math.sqrt(float(np.mean(np.sum((pending[live] - pending[live].mean(axis=0)) ** 2, axis=1)))))

        # The round: groups, verdicts, commits.
        dies = np.zeros(n, dtype=bool)
        dies[live] = tl.fail_s[row_of[live]] < t + p.round_s
        groups = [np.array([int(m) for m in grp]) for grp in
                  live_groups(ids, {ids[u] for u in live}, k, p.group_size, salt="scale")]
        discarded = 0
        total_w = float(w[live].sum())
        for members in groups:
            if members.size < p.min_group_size or dies[members].any():
                discarded += 1
                continue
            size, wm = members.size, w[members]
            big_w = float(wm.sum())
            ideal += pending[members].sum(axis=0) / total_w
            x[members] = (wm @ x[members] + pending[members].sum(axis=0)) / big_w
            w[members] = big_w / size
            for m in members:
                last_group[m] = members
            pending[members] = 0.0
            pending_share[members] = 0.0
            new = np.nonzero(pend_coef[:, members].sum(axis=1) > 0)[0]
            ideal_weight[new] = 1.0 / total_w
            committed_at[new] = k
            coef[:, members] = (coef[:, members] @ wm + pend_coef[:, members].sum(axis=1))[:, None] / big_w
            pend_coef[:, members] = 0.0
        groups_total += len(groups)
        groups_discarded += discarded

        # Measures after the round.
        done = (committed_at > 0) & (mixed_after < 0)
        if done.any():
            c = coef[np.ix_(done, live)]
            ok = c.min(axis=1) >= MIXED_FRACTION * c.mean(axis=1)
            mixed_after[np.nonzero(done)[0][ok]] = k - committed_at[np.nonzero(done)[0][ok]]
        mean = w[live] @ x[live] / w[live].sum()
        dist = math.sqrt(float(np.mean(np.sum((x[live] - mean) ** 2, axis=1))))
        series["t_s"].append(t)
        series["live"].append(int(live.size))
        series["distance_rel"].append(dist / float(np.linalg.norm(mean)))
        series["distance_noise"].append(dist / noise_unit)
        series["bound_noise"].append(consensus_bound(sides, max(spreads[-len(sides):])) / noise_unit)
        series["spread_noise"].append(spreads[-1] / noise_unit)
        series["discarded_groups"].append(discarded / len(groups))

    live = np.nonzero(interval >= 0)[0]
    committed = np.nonzero(ideal_weight > 0)[0]
    reach = coef[np.ix_(committed, live)] @ w[live] / w[live].sum() / ideal_weight[committed]
    mean = w[live] @ x[live] / w[live].sum()
    mixed = mixed_after[committed]
    settled = committed[committed_at[committed] <= p.rounds - 4 * mixing_rounds(n, p.group_size)]
    return {
        "params": asdict(p),
        "failures": None if failures is None else asdict(failures),
        "sides": list(sides),
        "mixing_rounds_bound": mixing_rounds(n, p.group_size),
        "followed": int(followed),
        "followed_committed": int(committed.size),
        "reach_weight": float(reach.sum() / committed.size),
        "reach_kept": float(np.minimum(reach, 1.0).mean()),
        "reach_p01": float(np.quantile(reach, 0.01)),
        "present": float(np.mean(reach > 0)),
        "mix_rounds_median": float(np.median(mixed_after[settled])) if settled.size else math.nan,
        "mix_rounds_p95": float(np.quantile(mixed_after[settled], 0.95)) if settled.size else math.nan,
        "mix_never": int(np.sum(mixed_after[settled] < 0)),
        "mixed_share": float(np.mean(mixed >= 0)) if mixed.size else math.nan,
        "global_error": float(np.linalg.norm(mean - ideal) / np.linalg.norm(ideal - x0)),
        "distance_rel_max": max(series["distance_rel"]),
        "distance_noise_max": max(series["distance_noise"]),
        "distance_noise_median": float(np.median(series["distance_noise"])),
        "bound_noise_max": max(series["bound_noise"]),
        "distance_over_bound_max": max(d / b for d, b in zip(series["distance_noise"], series["bound_noise"]) if b > 0)
        if p.group_size else 0.0,
        "discarded_groups": groups_discarded / groups_total,
        "offered_updates": offered,
        "learner_failures": tl.failures,
        "lost_with_failures": lost_with_failures,
        "series": series,
    }
