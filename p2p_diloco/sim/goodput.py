"""Goodput at scale: an event-driven simulation of learner units that fail and come back.

*Goodput* is the share of allocated learner-time whose work reached the model: N units are
allocated for ``horizon_s`` seconds each (N x horizon unit-seconds); whatever a unit spends down,
restarting, stalled, or on work that is later thrown away is not goodput. This module compares
our protocol (p2p Decoupled DiLoCo, :func:`simulate_p2p`) with elastic synchronous data-parallel
(:func:`simulate_dp`) on *the same* failure timelines (:func:`unit_timelines`), so the two are
paired draws of one seeded experiment. Nothing here reads a clock: time is simulated seconds.

Failures (the same for both protocols)
    Each unit's hardware fails after an exponential time with mean ``mtbf_s`` of being up
    (a failure can strike while it trains, waits or restarts), stays down ``repair_s`` (fixed or
    exponential with that mean), then is up again and its process restarts. At t = 0 every unit is
    up, trained to the same point and synced (steady state; no start-up charged).

Our protocol (what ``p2p_diloco.engine.options`` / ``averaging`` do; see the README)
    * A unit trains without ever waiting for anyone; a fixed share ``blocked_share`` of its
      training time is its inner loop blocked on averaging (measured, ~0.3%).
    * The model has F fragments; fragment j's rounds fall on the swarm clock every
      ``round_period_s`` (H x step time), staggered: boundary m (m >= 1) is at m x period / F and
      belongs to fragment m mod F. At a boundary, every training unit sends the fragment's
      pseudo-gradient (its work on that fragment since its last *committed* round) to one group
      all-reduce among the live units (``group_size`` = 0, as configured: everyone; or random
      groups of at most ``group_size``). The round takes ``round_s``.
    * A round is **discarded** for its group if fewer than ``min_group_size`` units are live, or
      if a member fails within ``round_s`` of the boundary. Survivors of a discarded round lose
      nothing: their pseudo-gradient still covers their work and goes out again at the next
      boundary (delayed, not lost). Work pending at the horizon counts as reaching the model
      (it will at the next round), for both protocols.
    * A failed unit **loses** its uncommitted work: for each fragment, the time since its last
      committed round (or since it started training), divided by F. It then is down for its repair
      time and restarts: ``startup_s`` (process start, DHT join) + ``state_download_s`` (the
      anchors from live peers) with no training; then it trains and contributes at the next
      boundary. Nobody else pays for its failure or its return.

Elastic synchronous data-parallel (the baseline), two standard variants
    Every step needs every member; a member's failure stalls all of them for ``detect_s`` (the
    collective times out) and then a reconfiguration; a unit that comes back (after its repair and
    its own process start-up) forces a reconfiguration too, and joins at its end. Units waiting
    for a reconfiguration to end count as *stalled*. Failures during a reconfiguration restart it.
    * ``variant="restart"`` (torchelastic-style): a reconfiguration stops and restarts every
      worker from the last checkpoint: it lasts ``startup_s + state_download_s`` (process start,
      checkpoint load), and a failure **rolls back** every member's work since the last checkpoint
      (taken every ``checkpoint_interval_s`` of training; ``checkpoint_save_s`` of stall each,
      default 0: asynchronous checkpoints, which favours the baseline). A rejoin does not roll
      back (``rollback_on_rejoin`` = False: the workers checkpoint on the SIGTERM; also favourable).
    * ``variant="in-memory"`` (torchft-style): survivors keep their state; a reconfiguration is
      one re-forming of the group, ``reconfigure_s``, and a failure loses only the step in flight
      of every member; a unit that comes back restarts its process and downloads the state
      (``startup_s + state_download_s``) before it asks to join.
    The data-parallel step's own communication is not charged (on slow links it would lower the
    baseline further); only failures count.

Breakdown (unit-seconds; they sum to N x horizon): ``useful`` (goodput), ``down`` (repair),
``restart`` (process start-up and state download of a unit coming back), ``lost`` (work done and
thrown away), ``stalled`` (waiting for others: data-parallel reconfigurations and checkpoint
saves), ``blocked`` (our inner loop blocked on averaging). ``pending`` is the part of ``useful`` not
yet committed at the horizon (``committed_goodput`` leaves it out, as a run that stops there would).

Calibration (:func:`calibration_from_results`) reads the real system's measurements on this
machine from ``results/`` and the config those runs used; see its docstring for each number.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, Sequence

import numpy as np

REPAIR_KINDS = ("fixed", "exponential")
DP_VARIANTS = ("restart", "in-memory")


class GoodputError(ValueError):
    """A bad parameter or missing calibration input; the message names it."""


def require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise GoodputError(f"{name}: {why}")


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Failures:
    """Per-unit failure process: exponential time to failure while up, then a repair."""

    mtbf_s: float
    """Mean time between failures of one unit, counted while it is up (math.inf: never fails)."""
    repair_s: float
    """Down time after a failure (the mean, when ``repair`` is "exponential")."""
    repair: str = "fixed"
    """"fixed" or "exponential"."""

    def __post_init__(self) -> None:
        require(self.mtbf_s > 0, "mtbf_s", f"must be > 0, got {self.mtbf_s}")
        require(math.isfinite(self.repair_s) and self.repair_s >= 0, "repair_s",
                 f"must be finite and >= 0, got {self.repair_s}")
        require(self.repair in REPAIR_KINDS, "repair", f"must be one of {REPAIR_KINDS}, got {self.repair!r}")


@dataclass(frozen=True)
class Calibration:
    """Times of the real system (seconds), shared by both protocols."""

    step_s: float
    """One inner step (also one data-parallel step)."""
    round_period_s: float
    """Time between two rounds of the same fragment: H x step_s."""
    fragments: int
    """F: fragments on the staggered schedule."""
    round_s: float
    """Duration of one round (matchmaking + all-reduce + verdicts): a member failing within it
    discards the round for its group."""
    startup_s: float
    """Process start of a unit coming back, until it is in the swarm (imports, DHT join)."""
    state_download_s: float
    """Downloading the current state (all fragments) from a live peer."""
    detect_s: float
    """Time for the others to notice a dead member (the collective's timeout)."""
    reconfigure_s: float
    """Re-forming a group without restarting processes (one matchmaking + all-reduce)."""
    blocked_share: float = 0.0
    """Share of our inner loop's time blocked on averaging (a fixed cost of our protocol)."""

    def __post_init__(self) -> None:
        for name in ("step_s", "round_period_s", "round_s"):
            v = getattr(self, name)
            require(math.isfinite(v) and v > 0, name, f"must be finite and > 0, got {v}")
        for name in ("startup_s", "state_download_s", "detect_s", "reconfigure_s"):
            v = getattr(self, name)
            require(math.isfinite(v) and v >= 0, name, f"must be finite and >= 0, got {v}")
        require(self.fragments >= 1, "fragments", f"must be >= 1, got {self.fragments}")
        require(0 <= self.blocked_share < 1, "blocked_share", f"must be in [0, 1), got {self.blocked_share}")

    @property
    def boundary_s(self) -> float:
        """Time between two consecutive (staggered) boundaries of any fragment."""
        return self.round_period_s / self.fragments

    @property
    def rejoin_s(self) -> float:
        """A unit's own restart after its repair: process start + state download."""
        return self.startup_s + self.state_download_s


@dataclass(frozen=True)
class P2PParams:
    """Our protocol's knobs beyond the calibration."""

    min_group_size: int = 2
    """Fewest live units that make a round (averaging.min_group_size)."""
    group_size: int = 0
    """Units per all-reduce group (0 = one group of every live unit, as averaging.target_group_size = 0)."""

    def __post_init__(self) -> None:
        require(self.min_group_size >= 1, "min_group_size", f"must be >= 1, got {self.min_group_size}")
        require(self.group_size == 0 or self.group_size >= 2, "group_size",
                 f"must be 0 (everyone) or >= 2, got {self.group_size}")


@dataclass(frozen=True)
class DPParams:
    """Elastic synchronous data-parallel: which variant, and its checkpointing."""

    variant: str = "restart"
    """"restart" (torchelastic: restart from the last checkpoint) or "in-memory" (torchft)."""
    checkpoint_interval_s: float = 300.0
    """Training time between two checkpoints ("restart" only)."""
    checkpoint_save_s: float = 0.0
    """Stall of every member while a checkpoint is written ("restart" only; 0 = asynchronous)."""
    rollback_on_rejoin: bool = False
    """"restart" only: whether a rejoin's restart also loses the work since the last checkpoint."""

    def __post_init__(self) -> None:
        require(self.variant in DP_VARIANTS, "variant", f"must be one of {DP_VARIANTS}, got {self.variant!r}")
        require(self.checkpoint_interval_s > 0, "checkpoint_interval_s",
                 f"must be > 0, got {self.checkpoint_interval_s}")
        require(math.isfinite(self.checkpoint_save_s) and self.checkpoint_save_s >= 0, "checkpoint_save_s",
                 f"must be finite and >= 0, got {self.checkpoint_save_s}")


# ---------------------------------------------------------------- failure timelines


@dataclass(frozen=True)
class Timelines:
    """Every unit's up intervals [up_s, fail_s) over [0, horizon_s), one row per interval.

    ``fail_s`` >= horizon_s means the interval outlives the horizon (no failure inside it). Rows are
    sorted by (unit, up_s); each unit's first interval starts at 0 (``first`` True: no restart)."""

    units: int
    horizon_s: float
    unit: np.ndarray  # int64
    up_s: np.ndarray  # float64
    fail_s: np.ndarray  # float64
    first: np.ndarray  # bool

    @staticmethod
    def from_intervals(units: int, horizon_s: float, intervals: Sequence[tuple[int, float, float]]) -> Timelines:
        """Hand-made timelines (tests): ``(unit, up_s, fail_s)`` rows; every unit needs one row with up_s = 0."""
        require(units >= 1, "units", f"must be >= 1, got {units}")
        require(horizon_s > 0, "horizon_s", f"must be > 0, got {horizon_s}")
        rows = sorted(intervals)
        for u in range(units):
            require(any(r[0] == u and r[1] == 0.0 for r in rows), "intervals", f"unit {u} has no interval at 0")
        for (u0, _a0, b0), (u1, a1, _) in zip(rows, rows[1:]):
            require(not (u0 == u1 and a1 < b0), "intervals", f"unit {u0}: overlapping intervals at {a1}")
        for u, a, b in rows:
            require(0 <= u < units and 0 <= a < b, "intervals", f"bad row {(u, a, b)}")
        return Timelines(units, horizon_s, np.array([r[0] for r in rows], dtype=np.int64),
                         np.array([r[1] for r in rows], dtype=float), np.array([r[2] for r in rows], dtype=float),
                         np.array([r[1] == 0.0 for r in rows], dtype=bool))

    @property
    def failures(self) -> int:
        return int(np.sum(self.fail_s < self.horizon_s))


def unit_timelines(units: int, failures: Failures, horizon_s: float, seed: int) -> Timelines:
    """Seeded failure/repair timelines of ``units`` units over ``horizon_s`` (vectorised over units)."""
    require(units >= 1, "units", f"must be >= 1, got {units}")
    require(math.isfinite(horizon_s) and horizon_s > 0, "horizon_s", f"must be finite and > 0, got {horizon_s}")
    rng = np.random.default_rng(seed)
    ids = np.arange(units)
    up = np.zeros(units)
    rows_u, rows_up, rows_fail = [], [], []
    while ids.size:
        fail = up + (rng.exponential(failures.mtbf_s, ids.size) if math.isfinite(failures.mtbf_s)
                     else np.full(ids.size, math.inf))
        rows_u.append(ids)
        rows_up.append(up)
        rows_fail.append(fail)
        repair = (rng.exponential(failures.repair_s, ids.size) if failures.repair == "exponential"
                  else np.full(ids.size, failures.repair_s))
        nxt = fail + repair
        keep = nxt < horizon_s
        ids, up = ids[keep], nxt[keep]
    unit, up_s, fail_s = np.concatenate(rows_u), np.concatenate(rows_up), np.concatenate(rows_fail)
    order = np.lexsort((up_s, unit))
    return Timelines(units, horizon_s, unit[order], up_s[order], fail_s[order], up_s[order] == 0.0)


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class Breakdown:
    """Where the allocated unit-seconds went (they sum to ``allocated_s``)."""

    protocol: str
    units: int
    horizon_s: float
    useful_s: float
    down_s: float
    restart_s: float
    lost_s: float
    stalled_s: float
    blocked_s: float
    failures: int
    pending_s: float = 0.0
    """Part of ``useful_s`` done but not yet committed at the horizon (it would be at the next round
    or checkpoint; a finite run that stops there loses it)."""
    discarded_share: float | None = None
    """Ours: share of unit-rounds discarded (live x expected share, over all boundaries)."""
    reconfigurations: int | None = None
    """Data-parallel: pauses of the whole group (failures, rejoins, restarts of a restart)."""

    @property
    def allocated_s(self) -> float:
        return self.units * self.horizon_s

    @property
    def goodput(self) -> float:
        return self.useful_s / self.allocated_s

    @property
    def committed_goodput(self) -> float:
        """Goodput of a run that stops at the horizon: pending work not counted."""
        return (self.useful_s - self.pending_s) / self.allocated_s

    def shares(self) -> dict[str, float]:
        a = self.allocated_s
        return {"goodput": self.useful_s / a, "down": self.down_s / a, "restart": self.restart_s / a,
                "lost": self.lost_s / a, "stalled": self.stalled_s / a, "blocked": self.blocked_s / a}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **self.shares()}


# ---------------------------------------------------------------- our protocol


def simulate_p2p(tl: Timelines, cal: Calibration, params: P2PParams = P2PParams(), seed: int = 0) -> Breakdown:
    """Goodput of our protocol on the timelines ``tl`` (see the module docstring for the model).

    Vectorised: training intervals and failures are arrays, boundaries a grid; only the random
    group draws (``group_size`` > 0) use ``seed``."""
    T, F, dB, d = tl.horizon_s, cal.fragments, cal.boundary_s, cal.round_s
    end = np.minimum(tl.fail_s, T)
    start = np.where(tl.first, tl.up_s, np.minimum(tl.up_s + cal.rejoin_s, end))  # training starts
    restart = float(np.sum(start - tl.up_s))
    train = end - start
    down = tl.units * T - float(np.sum(end - tl.up_s))
    trains = train > 0
    died = trains & (tl.fail_s < T)  # failed while training: loses its uncommitted work

    # Live training units at each boundary m*dB (m = 1..M), and member failures inside each round.
    M = int(math.floor(T / dB))
    b = dB * np.arange(1, M + 1)
    s_tr, e_tr = np.sort(start[trains]), np.sort(np.where(died, tl.fail_s, math.inf)[trains])
    live = np.searchsorted(s_tr, b, side="right") - np.searchsorted(e_tr, b, side="right")
    # A failure at x during training poisons boundaries b with max(start, x - d) <= b < x.
    x, xs = tl.fail_s[died], start[died]
    lo = np.maximum(np.ceil(np.maximum(xs, x - d) / dB), 1).astype(np.int64)
    hi = np.minimum(np.ceil(x / dB).astype(np.int64) - 1, M)  # last boundary strictly before x
    failing = np.zeros(M + 2, dtype=np.int64)  # failing[m]: members failing during round m
    for r in range(int(math.ceil(d / dB)) + 1):
        idx = lo + r
        ok = idx <= hi
        np.add.at(failing, idx[ok], 1)
    n = live.astype(float)
    k = failing[1:M + 1].astype(float)
    p = _share_prob(n, params.group_size)
    disc = np.where(n < params.min_group_size, 1.0, 1.0 - (1.0 - p) ** k)
    discarded_share = float(np.sum(n * disc) / np.sum(n)) if np.sum(n) > 0 else 0.0

    # Each dead unit's (and, at the horizon, each live unit's) last committed boundary of each
    # fragment, walking back from its failure (or the horizon): what it has not committed yet.
    alive = trains & ~died
    X = np.concatenate([x, np.full(int(alive.sum()), T)])
    XS = np.concatenate([xs, start[alive]])
    can_own = np.arange(X.size) < x.size  # the horizon is no failure
    uncommitted = np.zeros(X.size)
    rng = np.random.default_rng(seed)
    m_end = np.ceil(X / dB).astype(np.int64) - 1  # last boundary strictly before the end
    first_m = np.maximum(np.ceil(XS / dB).astype(np.int64), 1)  # first boundary at or after training start
    for j in range(F):
        m = m_end - ((m_end - j) % F)  # last boundary of fragment j before the end
        committed_at = XS.copy()
        active = m >= first_m
        while np.any(active):
            idx = np.flatnonzero(active)
            mi = m[idx]
            own = can_own[idx] & (X[idx] <= dB * mi + d)  # its own failure fell inside this round
            n_m, k_m = live[mi - 1].astype(float), failing[mi].astype(float) - own
            p_disc = 1.0 - (1.0 - _share_prob(n_m, params.group_size)) ** k_m
            draw = rng.random(mi.size) if params.group_size else np.zeros(mi.size)
            discarded = own | (n_m < params.min_group_size) | (draw < p_disc)
            done = idx[~discarded]
            committed_at[done] = dB * m[done]
            active[done] = False
            m[idx[discarded]] -= F
            active &= m >= first_m
        uncommitted += (X - committed_at) / F
    lost = float(np.sum(uncommitted[:x.size]))
    pending = float(np.sum(uncommitted[x.size:]))
    worked = float(np.sum(train)) - lost
    keep = 1 - cal.blocked_share
    return Breakdown("p2p", tl.units, T, useful_s=worked * keep, down_s=down, restart_s=restart, lost_s=lost,
                     stalled_s=0.0, blocked_s=worked * cal.blocked_share, failures=tl.failures,
                     pending_s=pending * keep, discarded_share=discarded_share)


def _share_prob(n: np.ndarray, group_size: int) -> np.ndarray:
    """Probability that one given other member failing is in my group (groups of ``group_size`` among n)."""
    if group_size == 0:
        return np.ones_like(n)
    return np.where(n <= group_size, 1.0, (group_size - 1) / np.maximum(n - 1, 1))


# ---------------------------------------------------------------- elastic data-parallel


def simulate_dp(tl: Timelines, cal: Calibration, params: DPParams = DPParams()) -> Breakdown:
    """Goodput of elastic synchronous data-parallel on the timelines ``tl`` (heapq event loop)."""
    return _DPSim(tl, cal, params).run()


Kind = Literal["fail", "up", "ready", "resume", "ckpt"]
_ORDER = {"fail": 0, "resume": 1, "ckpt": 2, "up": 3, "ready": 4}


class _DPSim:
    """One run of the data-parallel model; all state in unit-seconds and unit counts."""

    def __init__(self, tl: Timelines, cal: Calibration, params: DPParams) -> None:
        self.tl, self.cal, self.p = tl, cal, params
        self.restart_variant = params.variant == "restart"
        self.reconf_s = cal.startup_s + cal.state_download_s if self.restart_variant else cal.reconfigure_s
        self.unit_start_s = cal.startup_s if self.restart_variant else cal.rejoin_s
        self.now = 0.0
        self.status = ["member"] * tl.units
        self.members, self.ready, self.starting, self.down = tl.units, 0, 0, 0
        self.state = "running"  # running | paused | empty
        self.paused_until = 0.0
        self.ready_units: set[int] = set()
        self.epoch = 0
        self.work = 0.0  # unit-seconds since the last checkpoint ("restart"), not yet safe
        self.saving = 0.0  # work being written by a checkpoint in progress
        self.run_s = 0.0  # training time since the last resume ("in-memory": step in flight)
        self.useful = self.lost = self.stalled = self.t_down = self.t_restart = 0.0
        self.reconfigurations = 0
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.seq = 0

    def push(self, t: float, kind: Kind, unit: int = -1, epoch: int = -1) -> None:
        if t < self.tl.horizon_s:
            heapq.heappush(self.heap, (t, _ORDER[kind], self.seq, kind, unit if unit >= 0 else epoch))
            self.seq += 1

    def run(self) -> Breakdown:
        tl = self.tl
        for u, up, fail, first in zip(tl.unit.tolist(), tl.up_s.tolist(), tl.fail_s.tolist(), tl.first.tolist()):
            if not first:
                self.push(up, "up", u)
                if up + self.unit_start_s < fail:
                    self.push(up + self.unit_start_s, "ready", u)
            self.push(fail, "fail", u)
        if self.restart_variant:
            self.push(self.p.checkpoint_interval_s, "ckpt", epoch=self.epoch)
        while self.heap:
            t, _, _, kind, arg = heapq.heappop(self.heap)
            self.advance(t)
            getattr(self, "_" + kind)(arg)
        self.advance(tl.horizon_s)
        # Pending work at the horizon would be saved at the next checkpoint: it counts (as for ours).
        pending = self.work + self.saving
        self.useful += pending
        return Breakdown(f"dp-{self.p.variant}", tl.units, tl.horizon_s, useful_s=self.useful, down_s=self.t_down,
                         restart_s=self.t_restart, lost_s=self.lost, stalled_s=self.stalled, blocked_s=0.0,
                         failures=tl.failures, pending_s=pending, reconfigurations=self.reconfigurations)

    def advance(self, t: float) -> None:
        dt = t - self.now
        self.t_down += self.down * dt
        self.t_restart += self.starting * dt
        if self.state == "running":
            self.run_s += dt
            if self.restart_variant:
                self.work += self.members * dt
            else:
                self.useful += self.members * dt
        else:
            self.stalled += (self.members + self.ready) * dt
        self.now = t

    def pause(self, until: float, extend: bool = False) -> None:
        """Stop the group until ``until`` (a failure during a pause restarts it: ``extend``)."""
        if self.state == "paused":
            if not extend:
                return
            until = max(until, self.paused_until)
        self.state = "paused"
        self.paused_until = until
        self.epoch += 1
        self.reconfigurations += 1
        self.push(until, "resume", epoch=self.epoch)

    # -- events
    def _fail(self, u: int) -> None:
        st = self.status[u]
        self.status[u] = "down"
        self.down += 1
        if st == "starting":
            self.starting -= 1
        elif st == "ready":
            self.ready -= 1
            self.ready_units.discard(u)
        elif st == "member":
            if self.state == "running":
                if self.restart_variant:
                    self.lost += self.work
                    self.work = 0.0
                else:  # the step in flight of every member (the dead one's included)
                    in_flight = self.members * (self.run_s % self.cal.step_s)
                    self.useful -= in_flight
                    self.lost += in_flight
            self.lost += self.saving  # a checkpoint being written is not safe yet
            self.saving = 0.0
            self.members -= 1
            if self.members + self.ready > 0:
                self.pause(self.now + self.cal.detect_s + self.reconf_s, extend=True)
        if self.members + self.ready == 0:
            self.state = "empty"
            self.epoch += 1

    def _up(self, u: int) -> None:
        self.status[u] = "starting"
        self.down -= 1
        self.starting += 1

    def _ready(self, u: int) -> None:
        self.status[u] = "ready"
        self.starting -= 1
        self.ready += 1
        self.ready_units.add(u)
        if self.state == "running" and self.restart_variant:
            # The workers stop for the restart: either they checkpoint on the SIGTERM, or not.
            if self.p.rollback_on_rejoin:
                self.lost += self.work
            else:
                self.useful += self.work
            self.work = 0.0
        if self.state in ("running", "empty"):
            self.pause(self.now + self.reconf_s)

    def _resume(self, epoch: int) -> None:
        if epoch != self.epoch or self.state != "paused":
            return
        self.useful += self.saving
        self.saving = 0.0
        for u in self.ready_units:
            self.status[u] = "member"
        self.ready_units.clear()
        self.members += self.ready
        self.ready = 0
        self.state = "running" if self.members else "empty"
        self.run_s = 0.0
        if self.restart_variant and self.state == "running":
            self.push(self.now + self.p.checkpoint_interval_s, "ckpt", epoch=self.epoch)

    def _ckpt(self, epoch: int) -> None:
        if epoch != self.epoch or self.state != "running":
            return
        if self.p.checkpoint_save_s > 0:
            self.saving, self.work = self.work, 0.0
            self.state = "paused"
            self.paused_until = self.now + self.p.checkpoint_save_s
            self.epoch += 1
            self.push(self.now + self.p.checkpoint_save_s, "resume", epoch=self.epoch)
        else:
            self.useful += self.work
            self.work = 0.0
            self.push(self.now + self.p.checkpoint_interval_s, "ckpt", epoch=self.epoch)


