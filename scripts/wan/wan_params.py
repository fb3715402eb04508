"""``scripts/wan/bench_wan.py``'s plan: what one invocation measures, checked before anything starts.

:class:`BenchParams` is the whole plan (rates, methods, hosts, budgets); it refuses an impossible one at
construction, including one whose worst-case wall time (:func:`worst_case_s`) is over its budget. Beside it the pure
decisions on a plan: the config overrides that make our learner run a method, the relays latency needs, and whether a
new run may be merged into an earlier result. Stdlib only (with ``netns.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import _bench  # scripts/wan/_bench.py: scripts/_bench.py
import netns  # scripts/wan/netns.py, stdlib only

ROOT = _bench.ROOT

METHODS = ("dp", "blocking", "decoupled")
START_SLACK_S = 90.0
"""Per run: process start, corpus load, gloo init / DHT join and waiting for the peers (2 busy cores)."""
FINISH_SLACK_S = 90.0
"""Per run, after the training budget: a slow last step, final rounds, linger, evaluation and exit."""
BOOT_PORT = 31330
"""With latency: the bootstrap's fixed port in host 0 (behind its relay)."""
LEARNER_PORT = 31337
"""With latency: each learner's fixed port in its host (behind its relay)."""


@dataclass(frozen=True)
class BenchParams:
    """One invocation's plan; an impossible one, or one over its budget, raises ``ValueError`` here."""

    rates_mbit: tuple[float, ...] = (10.0,)
    """Per-host link rates to measure, Mbit/s each way (one rate with all methods fits in 30 minutes; measure
    the others with further runs and ``merge``)."""
    methods: tuple[str, ...] = METHODS
    hosts: int = 4
    config: str = str(ROOT / "configs" / "demo.toml")
    overrides: tuple[str, ...] = ()
    """``--set`` overrides applied to every method (the model, data and budget must stay the same)."""
    steps: int = 0
    """Cap on inner steps per host (each step is inner.batch_size x model.block_size bytes per host); 0 = none:
    the training time alone ends every run, whatever the machine's speed (``launcher.NO_STEP_LIMIT``)."""
    max_time_s: float = 300.0
    """Training time of each learner run (blocking, decoupled)."""
    dp_max_time_s: float = 100.0
    """Training time of each rate's data-parallel run: long enough for a median step time (at least 3 steps)."""
    eval_every_s: float = 15.0
    """Learners: seconds between evaluations of the global model by learner 0 (for the time to the target)."""
    trajectory_steps: int = 240
    """Data-parallel steps of the trajectory run (on an unlimited link); the learners' tokens should not
    exceed its tokens, or their loss at equal tokens is not known."""
    trajectory_eval_every: int = 10
    """Trajectory: steps between held-out evaluations."""
    target_loss: float = 2.3
    """Eval loss (nats/byte) whose first crossing is the time to target."""
    budget_s: float = 1800.0
    """Refuse a plan whose worst-case wall time is above this."""
    out: str = str(ROOT / "results" / "wan")
    compute_steps: int = 30
    """Steps of the compute-only run (its median step time is all that is used)."""
    merge: bool = False
    """Add the rates measured now to ``out/wan.json`` (same hosts, config, budget), reusing its compute-only
    step time and trajectory, instead of starting a new result."""
    rtt_ms: float = 0.0
    """Round trip between hosts added by relays in front of the learners (ms); 0 = none."""
    host_rtt_ms: tuple[tuple[int, float], ...] = ()
    """(host, ms): hosts with a round trip of their own (a ragged host); a pair gets the larger of theirs."""

    def __post_init__(self) -> None:
        if not self.rates_mbit:
            raise ValueError("rates: give at least one rate")
        for r in self.rates_mbit:
            self.plan(r)  # validates hosts, rate and round trips
        if self.plan(self.rates_mbit[0]).relayed and "dp" in self.methods:
            raise ValueError("--rtt-ms/--host-rtt-ms apply to the learners only: gloo's connections use ports chosen "
                             "at run time, which no relay can sit in front of; pass --methods blocking,decoupled")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods must be some of {', '.join(METHODS)}, got {list(self.methods)}")
        if self.hosts < 2:
            raise ValueError(f"hosts must be >= 2 (data-parallel and averaging need peers), got {self.hosts}")
        if self.steps < 0 or self.max_time_s <= 0 or self.dp_max_time_s <= 0 or self.compute_steps < 3:
            raise ValueError(f"steps >= 0, max_time_s > 0, dp_max_time_s > 0 and compute_steps >= 3 required, got "
                             f"{self.steps}, {self.max_time_s}, {self.dp_max_time_s}, {self.compute_steps}")
        if self.trajectory_steps < 1 or self.trajectory_eval_every < 1 or self.eval_every_s <= 0:
            raise ValueError(f"trajectory_steps >= 1, trajectory_eval_every >= 1 and eval_every_s > 0 required, got "
                             f"{self.trajectory_steps}, {self.trajectory_eval_every}, {self.eval_every_s}")
        if self.target_loss <= 0:
            raise ValueError(f"target_loss must be > 0, got {self.target_loss}")
        if worst_case_s(self) > self.budget_s:
            raise ValueError(f"worst case {worst_case_s(self) / 60:.1f} min exceeds the budget of "
                             f"{self.budget_s / 60:.1f} min: lower --max-time, or measure fewer --rates / --methods")


    def plan(self, rate_mbit: float) -> netns.WanPlan:
        """The hosts at one rate, with the round trips (if any)."""
        return netns.WanPlan(hosts=self.hosts, rate_mbit=rate_mbit, rtt_ms=self.rtt_ms, host_rtt_ms=self.host_rtt_ms)


TRAJECTORY_RATE_MBIT = 10_000.0
"""The trajectory's link: a veth with no practical limit (its step time is not used)."""
TRAJECTORY_STEP_S = 3.0
"""Worst-case data-parallel step on that link, 4 ranks on 2 busy cores (measured about 1.6 s)."""


def worst_case_s(p: BenchParams) -> float:
    """Upper bound on the whole benchmark's wall time (every run using its full budget and slack)."""
    slack = START_SLACK_S + FINISH_SLACK_S
    once = 0.0
    if not p.merge:  # a compute-only step is under 2 s here
        once = START_SLACK_S + 2.0 * p.compute_steps + slack + TRAJECTORY_STEP_S * p.trajectory_steps
    per_rate = sum((p.dp_max_time_s if m == "dp" else p.max_time_s) + slack for m in p.methods)
    return once + len(p.rates_mbit) * per_rate



def relay_endpoints(hosts: int) -> list[tuple[int, int]]:
    """(host, port) of every relay a learner run needs with latency: the bootstrap's in host 0, each learner's."""
    return [(0, BOOT_PORT), *((i, LEARNER_PORT) for i in range(hosts))]


def method_overrides(method: str, hosts: int) -> list[str]:
    """Config overrides that make our learner run ``method`` (the model, data and inner loop untouched)."""
    if method == "decoupled":
        return []
    if method == "blocking":
        # OpenDiLoCo-style: the whole model in one round, applied at once as a plain anchor step,
        # and a round only with every peer in it
        return ["outer.fragments=1", "outer.overlap=0", "outer.alpha=0.0",
                f"averaging.min_group_size={hosts}", f"averaging.target_group_size={hosts}"]
    raise ValueError(f"no learner overrides for method {method!r}")



COMPARABLE = ("hosts", "config", "overrides", "steps", "max_time_s", "dp_max_time_s", "eval_every_s",
              "trajectory_steps", "trajectory_eval_every", "target_loss", "rtt_ms", "host_rtt_ms")
"""Parameters that must agree for results of two runs to share one table."""
ADDED_LATER: dict[str, Any] = {"rtt_ms": 0.0, "host_rtt_ms": []}
"""Comparable parameters that results written before them lack, with the value those runs had."""


def merge_check(old_params: dict[str, Any], p: BenchParams) -> None:
    """Refuse to merge into a result measured under other conditions (one line naming the parameter). Paths are
    compared as results store them, relative to the repository."""
    new, old_params = _bench.relative_paths(asdict(p)), _bench.relative_paths(old_params)
    for key in COMPARABLE:
        old, now = old_params.get(key, ADDED_LATER.get(key)), new[key]
        if isinstance(now, tuple):
            old = tuple(old or ())
        if old != now:
            raise ValueError(f"--merge: {key} differs from the existing result's ({old!r} there, {now!r} now)")
