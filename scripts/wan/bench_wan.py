#!/usr/bin/env python3
"""Emulated-WAN benchmark: data-parallel (gloo), blocking DiLoCo and p2p-diloco on rate-limited hosts.

For each link rate, N hosts are built as network namespaces on a private bridge (``netns.py``: a
token bucket on each host's link, both directions; latency only with ``--rtt-ms``, added by delaying
TCP relays in front of the learners since netem is missing here; data-parallel's gloo connections
cannot be relayed, so ``dp`` runs only without latency), and on the same hosts, model, data and seeds
it runs:

- ``dp``: data-parallel with torch.distributed gloo, gradients all-reduced every step
  (``dp_gloo.py``, one rank per host) -- conventional synchronization;
- ``blocking``: our learner as OpenDiLoCo-style DiLoCo: ``join --blocking`` (the inner loop waits for
  each round), one fragment, no overlap (tau = 0), no alpha-mixing, every round needs all N peers
  (``averaging.min_group_size = target_group_size = N``);
- ``decoupled``: our learner with the config as it is (F fragments, tau, int4, any live peers).

Once, before the rates (reused by ``--merge``):

- ``compute``: the data-parallel loop with no all-reduce on all hosts at once (the same CPU
  contention, no network). Data-parallel step time / compute-only step time is the *ideal bound* on
  any speed-up over data-parallel at that rate, reported next to every speed-up.
- ``trajectory``: data-parallel on an unlimited link, evaluated every ``--trajectory-eval-every``
  steps: its eval loss per step. Data-parallel's loss after k steps does not depend on the link (the
  same math, seeds and data), only its step time does; so at each rate data-parallel runs only long
  enough for its step time (``--dp-max-time``), and its **time to the target is projected**: steps to
  the target on the trajectory x the step time measured at that rate. Running it to the target at
  2 Mbit/s would take hours.

The learners run for real at every rate (``--max-time`` of training, with no step cap unless ``--steps``:
a fast machine must not end them early); learner 0 evaluates the global
model on the whole held-out set every ``--eval-every`` seconds, which gives their time to the target.

Reported per rate and method: median step time, tokens, time to ``--target-loss`` (linear between
evaluations), the final held-out eval loss and the data-parallel trajectory's loss at the same tokens,
bytes on the wire per token (every host's interface ``tx_bytes`` over the run, all traffic included:
DHT, headers, retransmissions), learner utilization (share of training time spent in inner steps; for
data-parallel compute-only step / step), and the speed-up over data-parallel in time to the target,
next to the ideal bound and its share of it.

    sudo python scripts/wan/bench_wan.py --rates 10                    # compute-only, trajectory, then 10 Mbit/s (<= 30 min)
    for r in 2 5 50 200; do sudo python scripts/wan/bench_wan.py --rates $r --merge; done   # the other rates
    sudo python scripts/wan/bench_wan.py --methods dp --max-time 60 --trajectory-steps 20   # a smoke run
    sudo python scripts/wan/bench_wan.py --rates 10 --methods blocking,decoupled --rtt-ms 100 --host-rtt-ms 3=300 \
        --out results/wan-rtt                                              # learners at 100 ms, host 3 at 300 ms
    python scripts/wan/bench_wan.py --render-only                         # rewrite the page (README.md) from wan.json
    sudo python scripts/wan/netns.py --cleanup                            # leftovers of a run killed by SIGKILL

Writes ``wan.json``, ``README.md`` (the page) and ``wan.png`` into ``--out`` (default ``results/wan``); every
process's output goes to ``--out/logs``. Everything started is stopped, and every namespace and
link removed, on exit, on error and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

import _bench  # scripts/wan/_bench.py: scripts/_bench.py
import netns  # scripts/wan/netns.py, stdlib only
from dp_gloo import summarize_steps  # imports torch lazily

from p2p_diloco.hivemind_ext.procguard import die_with_parent
from p2p_diloco.local.launcher import NO_STEP_LIMIT
from p2p_diloco.sim.curves import crossing, value_at

HERE = Path(__file__).resolve().parent
ROOT = _bench.ROOT

log = logging.getLogger("wan.bench")

METHODS = ("dp", "blocking", "decoupled")
START_SLACK_S = 90.0
"""Per run: process start, corpus load, gloo init / DHT join and waiting for the peers (2 busy cores)."""
FINISH_SLACK_S = 90.0
"""Per run, after the training budget: a slow last step, final rounds, linger, evaluation and exit."""
STOP_GRACE_S = 30.0
"""SIGTERM to SIGKILL for a process still running when its run ends."""
POLL_S = 1.0
LINGER_S = 20.0
"""A learner's --linger: after its final rounds, how long it waits for its peers to agree."""
BOOT_PORT = 31330
"""With latency: the bootstrap's fixed port in host 0 (behind its relay)."""
LEARNER_PORT = 31337
"""With latency: each learner's fixed port in its host (behind its relay)."""
FINAL_RE = re.compile(r"^final (\{.*\})$", re.M)
PEERS_RE = re.compile(r"^initial peers: (\S+)$", re.M)
BENCH = _bench.Bench("wan", "wan", "Emulated WAN: data-parallel, blocking DiLoCo and ours on slow links",
                     "scripts/wan/bench_wan.py", """\
`scripts/wan/netns.py` makes each of N hosts (4 here) a Linux network namespace on a private bridge, with no default
route; each host's link is limited by a token bucket (`tc qdisc ... tbf`) in both directions. Latency only with
`--rtt-ms` (netem is not available here): the learners then listen behind a delaying TCP relay in each host
(`scripts/wan/relay.py`), and data-parallel, whose gloo connections cannot be relayed, is not run. Without it round
trips stay below a millisecond, which favours data-parallel training. On the same hosts, model (`configs/demo.toml`, 16 x 128 bytes per host per step), data shards and seeds,
three methods:

- `dp`: `scripts/wan/dp_gloo.py`, torch.distributed gloo DDP, fp32 gradients all-reduced every step;
- `blocking`: our learner with `join --blocking` (the inner loop waits for each round), F=1, tau=0, alpha=0, every
  round needing all 4 peers (OpenDiLoCo-style);
- `decoupled`: our learner with its default config (F=4, tau=1, int4, any live peers).

How each figure is measured:

- **Ideal bound** at a rate = data-parallel's step time there / the compute-only step time (the same loop with no
  all-reduce, all hosts at once: the same CPU contention).
- **Data-parallel's time to the target is projected**: its loss after k steps does not depend on the link, only its
  step time does, so a *trajectory* run on an unlimited link gives the steps to the target once, and at each rate
  data-parallel runs only long enough for its step time; time to target = steps x step time.
- **The learners are measured at every rate**: `--max-time` of training; learner 0 evaluates the global model on the
  whole held-out set every `--eval-every` seconds, and the time to the target is read off that curve, linear between
  evaluations.
- Wire bytes: the `tx_bytes` of every host's interface (all traffic: DHT, headers, retransmissions).
- "Data-parallel at equal tokens": the trajectory's eval loss at the learners' total tokens; "—" where those are
  beyond the trajectory.

Rates are measured one run at a time and merged into one table (`--merge`).""")


@dataclass(frozen=True)
class BenchParams:
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


# ---------------------------------------------------------------- pure decisions

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


def trajectory_summary(curve: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    """The trajectory run's rank-0 curve and its steps (and tokens) to ``target``."""
    pts = [(float(c["step"]), float(c["eval_loss"])) for c in curve]
    steps = crossing(pts, target)
    tokens_per_step = curve[-1]["tokens"] / curve[-1]["step"] if curve and curve[-1]["step"] else None
    return {"curve": list(curve), "target_loss": target, "steps_to_target": steps,
            "tokens_to_target": steps * tokens_per_step if steps is not None and tokens_per_step else None}


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


def dp_metrics(ranks: Sequence[dict[str, Any]], wire_tx: Sequence[int], compute_step_s: float,
               trajectory: dict[str, Any]) -> dict[str, Any]:
    """One rate's data-parallel figures from its ranks' ``final`` lines; the time to the target is the
    trajectory's steps to it x this rate's median step time (projected: see the module's text)."""
    r0 = next(r for r in ranks if r["rank"] == 0)
    step_s = statistics.median(r["median_step_s"] for r in ranks)
    tokens = r0["tokens"]  # all ranks together
    steps_to_target = trajectory.get("steps_to_target")
    return {
        "steps_per_host": r0["steps"], "tokens": tokens, "median_step_s": step_s, "train_s": r0["train_s"],
        "final_eval_loss": None,  # a few steps only: the trajectory holds data-parallel's losses
        "time_to_target_s": steps_to_target * step_s if steps_to_target is not None else None,
        "time_to_target_projected": True,
        "wire_bytes": sum(wire_tx), "wire_bytes_per_token": sum(wire_tx) / tokens if tokens else None,
        "utilization": compute_step_s / step_s if step_s > 0 else None,
        "tokens_per_s": tokens / r0["train_s"] if r0["train_s"] > 0 else None,
    }


def learner_metrics(finals: Sequence[dict[str, Any]], wire_tx: Sequence[int], evals: Sequence[dict[str, Any]],
                    trajectory: dict[str, Any]) -> dict[str, Any]:
    """One learner run's figures from the learners' ``final`` lines and learner 0's ``eval`` events (training
    seconds and loss of the global model), next to the data-parallel trajectory at the same tokens."""
    tokens = sum(f["tokens"] for f in finals)
    train_s = statistics.median(f["train_s"] for f in finals)
    final_loss = statistics.median(f["eval_loss_end"] for f in finals)
    pts = [(float(e["train_s"]), float(e["eval_loss"])) for e in evals if "train_s" in e and "eval_loss" in e]
    pts.append((train_s, final_loss))
    per_step = trajectory["curve"][-1]["tokens"] / trajectory["curve"][-1]["step"] if trajectory.get("curve") else 0
    dp_loss = value_at([(c["step"] * per_step, c["eval_loss"]) for c in trajectory.get("curve", [])], tokens)
    return {
        "steps_per_host": statistics.median(f["steps"] for f in finals), "tokens": tokens,
        # wall time per step, like data-parallel's (inner step + any time the loop was held up)
        "median_step_s": statistics.median(f["train_s"] / max(1, f["steps"]) for f in finals),
        "train_s": train_s, "final_eval_loss": final_loss,
        "time_to_target_s": crossing(sorted(pts), trajectory["target_loss"]) if trajectory else None,
        "eval_curve": pts,
        "dp_eval_loss_at_tokens": dp_loss,
        "vs_dp_at_tokens": final_loss / dp_loss - 1 if dp_loss else None,
        "wire_bytes": sum(wire_tx), "wire_bytes_per_token": sum(wire_tx) / tokens if tokens else None,
        "utilization": statistics.median(f["utilization"] for f in finals),
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "committed": [sum(f["committed"]) for f in finals], "discarded": [sum(f["discarded"]) for f in finals],
        "anchors_identical": len({tuple(f["anchor_hashes"]) for f in finals}) == 1,
        "app_bytes_sent": sum(f["bytes_sent"] for f in finals),
    }


def speedups(rows: dict[str, dict[str, Any]], compute_step_s: float) -> dict[str, Any]:
    """Each method's speed-up over data-parallel at one rate (time to target, and tokens per second), with
    the ideal bound (data-parallel step time / compute-only step time) and the share of it reached."""
    dp = rows.get("dp")
    if dp is None:
        return {}
    bound = dp["median_step_s"] / compute_step_s if compute_step_s > 0 else None
    out: dict[str, Any] = {"ideal_bound": bound}
    for name, row in rows.items():
        if name == "dp":
            continue
        tput = row["tokens_per_s"] / dp["tokens_per_s"] if row.get("tokens_per_s") and dp.get("tokens_per_s") else None
        ttt = (dp["time_to_target_s"] / row["time_to_target_s"]
               if row.get("time_to_target_s") and dp.get("time_to_target_s") else None)
        bytes_x = (dp["wire_bytes_per_token"] / row["wire_bytes_per_token"]
                   if row.get("wire_bytes_per_token") and dp.get("wire_bytes_per_token") else None)
        out[name] = {"throughput": tput, "time_to_target": ttt,
                     "share_of_bound": ttt / bound if ttt is not None and bound else None,
                     "fewer_wire_bytes_per_token": bytes_x}
    return out


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


def merge_results(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the rates of ``new`` added; at a rate both have, ``new``'s methods replace or join ``old``'s
    and the speed-ups are computed again (``old``'s compute-only step). Rates sorted."""
    compute_step_s = old.get("compute_only", {}).get("median_step_s", 0.0)
    rates = dict(old["rates"])
    for key, r in new["rates"].items():
        if key in rates:
            methods = {**rates[key]["methods"], **r["methods"]}
            r = {**rates[key], **r, "methods": methods, "speedups": speedups(methods, compute_step_s)}
        rates[key] = r
    out = {**old, "rates": dict(sorted(rates.items(), key=lambda kv: kv[1]["rate_mbit"]))}
    out["runs"] = [*old.get("runs", [old.get("started")]), new.get("started")]
    return out


# ---------------------------------------------------------------- processes in the hosts


class Procs:
    """Processes started inside the hosts; all stopped (leader SIGTERM, then group SIGKILL) on exit."""

    def __init__(self, wan: netns.Wan, logs: Path) -> None:
        self.wan = wan
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[Any], Any, Any]] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="p2pdw-", dir="/tmp"))  # short: p2pd's unix sockets live here
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.tmp))

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self, name: str, host: int, cmd: Sequence[str]) -> subprocess.Popen[Any]:
        out = (self.logs / f"{name}.out").open("w")
        err = (self.logs / f"{name}.log").open("w")
        p = self.wan.popen(host, cmd, stdout=out, stderr=err, env=self.env, cwd=str(ROOT), preexec_fn=die_with_parent)
        self.procs.append((name, p, out, err))
        return p

    def output(self, name: str) -> str:
        return (self.logs / f"{name}.out").read_text(errors="replace")

    def wait_for(self, name: str, rx: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        p = next(p for n, p, _, _ in self.procs if n == name)
        deadline = time.monotonic() + timeout_s
        while True:
            m = rx.search(self.output(name))
            if m:
                return m
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no line matching {rx.pattern!r} within {timeout_s:.0f} s "
                                   f"(exit code {p.poll()}); see {self.logs / name}.log")
            time.sleep(POLL_S)

    def wait_finals(self, names: Sequence[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        """Every named process's ``final`` JSON line; RuntimeError if one exits without it or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            finals = {n: FINAL_RE.search(self.output(n)) for n in names}
            if all(finals.values()):
                return {n: json.loads(m.group(1)) for n, m in finals.items() if m}
            dead = [n for n, p, _, _ in self.procs if n in names and not finals[n] and p.poll() is not None]
            if dead or time.monotonic() > deadline:
                what = f"{dead[0]} exited without a final line" if dead else f"no final lines within {timeout_s:.0f} s"
                raise RuntimeError(f"{what}; see the logs in {self.logs}")
            time.sleep(POLL_S)

    def close(self) -> None:
        for _, p, _out, _err in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # SIGTERM to every leader first, so they leave together
        for name, p, out, err in self.procs:
            code = netns.stop_group(p, grace_s=STOP_GRACE_S)
            out.close()
            err.close()
            log.debug("%s exited with %s", name, code)
        self.procs = []
        shutil.rmtree(self.tmp, ignore_errors=True)


def _dp_cmd(p: BenchParams, wan: netns.Wan, i: int, mode: str, json_path: Path) -> list[str]:
    """Host i's ``dp_gloo.py`` for ``mode``: ``compute`` (no all-reduce), ``trajectory`` (evaluated every
    ``trajectory_eval_every`` steps) or ``rate`` (step times only)."""
    sets = [a for o in p.overrides for a in ("--set", o)]
    cmd = [sys.executable, str(HERE / "dp_gloo.py"), "--config", p.config, *sets, "--json", str(json_path), "-v"]
    if mode == "compute":
        return [*cmd, "--steps", str(p.compute_steps), "--compute-only", "--shard", str(i), "--num-shards",
                str(p.hosts), "--eval-every", "0"]
    cmd += ["--rank", str(i), "--world-size", str(p.hosts), "--master-addr", wan.address(0), "--ifname",
            netns.inner_if(i)]
    if mode == "trajectory":
        return [*cmd, "--steps", str(p.trajectory_steps), "--eval-every", str(p.trajectory_eval_every)]
    return [*cmd, "--steps", str(p.steps or NO_STEP_LIMIT), "--max-time", str(p.dp_max_time_s), "--eval-every", "0"]


def run_dp(p: BenchParams, wan: netns.Wan, logs: Path, tag: str, mode: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Data-parallel (``mode`` as in :func:`_dp_cmd`) on every host; the ranks' finals and each host's bytes sent."""
    budget = {"compute": 2.0 * p.compute_steps, "trajectory": TRAJECTORY_STEP_S * p.trajectory_steps,
              "rate": p.dp_max_time_s}[mode]
    before = wan.all_counters()
    with Procs(wan, logs) as procs:
        names = [f"{tag}-r{i}" for i in range(p.hosts)]
        for i, name in enumerate(names):
            procs.start(name, i, _dp_cmd(p, wan, i, mode, logs / f"{name}.json"))
        finals = procs.wait_finals(names, timeout_s=START_SLACK_S + budget + FINISH_SLACK_S)
    after = wan.all_counters()
    wire = [netns.byte_delta(b, a)["tx_bytes"] for b, a in zip(before, after)]
    return [finals[n] for n in names], wire


def run_learners(p: BenchParams, wan: netns.Wan, logs: Path, tag: str,
                 method: str) -> tuple[list[dict[str, Any]], list[int], list[dict[str, Any]]]:
    """A bootstrap peer in host 0 and one ``p2p-diloco join`` learner per host; their finals, bytes sent,
    and learner 0's ``eval`` events (the global model on the whole held-out set every ``eval_every_s``)."""
    sets = [a for o in [*p.overrides, *method_overrides(method, p.hosts), f"run.run_id=wan-{method}"]
            for a in ("--set", o)]
    cli = [sys.executable, "-m", "p2p_diloco.cli.main"]
    before = wan.all_counters()
    with Procs(wan, logs) as procs:
        procs.start(f"{tag}-boot", 0, [*cli, "bootstrap", *netns.listen_args(wan.plan, 0, BOOT_PORT), "--identity",
                                       str(procs.tmp / "boot.id"), "--config", p.config, *sets])
        peers = procs.wait_for(f"{tag}-boot", PEERS_RE, START_SLACK_S).group(1)
        names = [f"{tag}-l{i}" for i in range(p.hosts)]
        for name in names:  # learners append to their events files: an earlier run's must not mix in
            (logs / f"{name}.jsonl").unlink(missing_ok=True)
        for i, name in enumerate(names):
            evals = ["--eval-every", f"{p.eval_every_s:g}", "--eval-batches", str(EVAL_ALL)] if i == 0 else []
            procs.start(name, i, [*cli, "join", "--initial-peers", peers, *netns.listen_args(wan.plan, i, LEARNER_PORT),
                                  "--config",
                                  p.config, *sets, "--name", f"l{i}", "--shard", str(i), "--num-shards", str(p.hosts),
                                  "--wait-peers", str(p.hosts), "--steps", str(p.steps or NO_STEP_LIMIT), "--max-time",
                                  str(p.max_time_s), "--lr-schedule", "steps", "--linger", str(LINGER_S), "--events",
                                  str(logs / f"{name}.jsonl"), *evals,
                                  *(["--blocking"] if method == "blocking" else [])])
        finals = procs.wait_finals(names, timeout_s=START_SLACK_S + p.max_time_s + FINISH_SLACK_S)
    after = wan.all_counters()
    wire = [netns.byte_delta(b, a)["tx_bytes"] for b, a in zip(before, after)]
    events = logs / f"{names[0]}.jsonl"
    evals_l0 = [e for e in map(json.loads, events.read_text().splitlines() if events.exists() else [])
                if e.get("event") == "eval"]
    return [finals[n] for n in names], wire, evals_l0


def discard_reasons(logs: Path, tag: str, hosts: int) -> dict[str, int]:
    """The learners' discarded rounds by reason, peer ids, hashes and numbers masked (a round counts once per
    learner)."""
    found: collections.Counter[str] = collections.Counter()
    for i in range(hosts):
        path = logs / f"{tag}-l{i}.jsonl"
        for e in map(json.loads, path.read_text().splitlines() if path.exists() else []):
            if e.get("event") == "round" and e.get("outcome") != "committed":
                found[_bench.normalise_reason(str(e.get("reason", "")), REASON_CHARS)] += 1
    return dict(found.most_common())


REASON_CHARS = 90
"""A discarded round's reason is kept to this length (its exception and the first words of its message)."""

EVAL_ALL = 1_000_000
"""``--eval-batches`` for the whole held-out set (the learner evaluates at most all of it), as data-parallel does."""


def bench(p: BenchParams) -> dict[str, Any]:
    out = Path(p.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"params": asdict(p), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "latency_emulation": p.plan(p.rates_mbit[0]).relayed, "rates": {}}
    previous: dict[str, Any] | None = None
    if p.merge:
        previous = json.loads((out / "wan.json").read_text())
        merge_check(previous["params"], p)
    t0 = time.monotonic()
    if previous is not None:
        result["compute_only"] = previous["compute_only"]
        result["trajectory"] = previous["trajectory"]
    else:
        with netns.Wan(netns.WanPlan(hosts=p.hosts, rate_mbit=TRAJECTORY_RATE_MBIT)) as wan:
            ranks, _ = run_dp(p, wan, logs, "compute", "compute")
            compute_step_s = statistics.median(summarize_steps(r["step_s"])["median_step_s"] for r in ranks)
            result["compute_only"] = {"median_step_s": compute_step_s, "steps": p.compute_steps,
                                      "per_rank": [r["median_step_s"] for r in ranks]}
            log.info("compute-only: %.3f s per step (%d hosts at once)", compute_step_s, p.hosts)
            ranks, _ = run_dp(p, wan, logs, "trajectory", "trajectory")
            r0 = next(r for r in ranks if r["rank"] == 0)
            result["trajectory"] = {**trajectory_summary(r0["curve"], p.target_loss),
                                    "median_step_s": r0["median_step_s"], "rate_mbit": TRAJECTORY_RATE_MBIT}
        _write(out, result)
    compute_step_s = result["compute_only"]["median_step_s"]
    trajectory = result["trajectory"]
    log.info("trajectory: %s steps to %g; final %.4f after %d steps", _fmt(trajectory["steps_to_target"], ".1f"),
             p.target_loss, trajectory["curve"][-1]["eval_loss"], trajectory["curve"][-1]["step"])
    for rate in p.rates_mbit:
        plan = p.plan(rate)
        rows: dict[str, dict[str, Any]] = {}
        with netns.Wan(plan) as wan:
            qdisc = wan.qdisc(0)
            if plan.relayed:  # they outlive each method's processes, as a link would
                for host, port in relay_endpoints(p.hosts):
                    wan.start_relay(host, port)
            for method in p.methods:
                tag = f"{rate:g}mbit-{method}"
                if method == "dp":
                    log.info("dp: %d hosts at %g Mbit/s, %.0f s", p.hosts, rate, p.dp_max_time_s)
                    ranks, wire = run_dp(p, wan, logs, tag, "rate")
                    rows[method] = dp_metrics(ranks, wire, compute_step_s, trajectory)
                else:
                    log.info("%s: %d hosts at %g Mbit/s, %.0f s", method, p.hosts, rate, p.max_time_s)
                    finals, wire, evals = run_learners(p, wan, logs, tag, method)
                    rows[method] = learner_metrics(finals, wire, evals, trajectory)
                    rows[method]["discard_reasons"] = discard_reasons(logs, tag, p.hosts)
                rows[method]["wire_tx_per_host"] = wire
                log.info("%s at %g Mbit/s: %s", method, rate, _brief(rows[method]))
        result["rates"][f"{rate:g}"] = {"rate_mbit": rate, "plan": asdict(plan), "qdisc": qdisc, "methods": rows,
                                        "speedups": speedups(rows, compute_step_s)}
        # a partial result survives an interrupted benchmark
        _write(out, merge_results(previous, result) if previous is not None else result)
    result["wall_s"] = time.monotonic() - t0
    if previous is not None:
        result = merge_results(previous, result)
    _write(out, result)
    return result


def _brief(row: dict[str, Any]) -> str:
    return (f"{row['steps_per_host']} steps/host, {row['median_step_s']:.3f} s/step, eval "
            f"{_fmt(row['final_eval_loss'], '.4f')}, to target {_fmt(row['time_to_target_s'], '.0f')} s, "
            f"{row['wire_bytes_per_token'] or 0:.1f} wire B/token, utilization {row['utilization'] or 0:.1%}")


# ---------------------------------------------------------------- report


def _fmt(v: Any, spec: str, none: str = "—") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def latency_text(params: dict[str, Any]) -> str:
    """The page's sentence on latency, from the run's parameters (results older than ``rtt_ms`` had none)."""
    rtt, ragged = params.get("rtt_ms", 0.0), [tuple(x) for x in params.get("host_rtt_ms", ())]
    if not rtt and not any(ms for _, ms in ragged):
        return ("**no latency emulation** (netem is not available): round trips stay sub-millisecond, so these "
                "figures favour data-parallel.")
    extra = "".join(f", host {i} at {ms:g} ms" for i, ms in ragged)
    return (f"round trips of {rtt:g} ms between hosts{extra} (a pair gets the larger of its two), added by a delaying "
            "TCP relay in front of each learner (netem is not available).")


def render_md(result: dict[str, Any]) -> str:
    p = result["params"]
    c = result.get("compute_only", {})
    t = result.get("trajectory", {})
    target = p["target_loss"]
    last = t["curve"][-1] if t.get("curve") else {}
    lines = [
        f"Emulated WAN: {p['hosts']} hosts, {Path(p['config']).name}, learners {p['max_time_s']:g} s of training.",
        "",
        "Per-host links limited with tc tbf in both directions; " + latency_text(p),
        f"Compute-only step (all hosts at once, no all-reduce): {_fmt(c.get('median_step_s'), '.3f')} s. "
        f"Data-parallel trajectory (unlimited link): {_fmt(t.get('steps_to_target'), '.1f')} steps "
        f"({_fmt((t.get('tokens_to_target') or 0) / 1e6 or None, '.2f')}M tokens) to eval loss {target:g}; "
        f"{_fmt(last.get('eval_loss'), '.4f')} after {last.get('step', '—')} steps.",
        f"Data-parallel's time to {target:g} at each rate is projected: those steps x the step time measured "
        "at that rate. The learners' is measured (the global model evaluated every "
        f"{p.get('eval_every_s', 0):g} s on the whole held-out set).",
        "",
        f"| Mbit/s | method | s/step | tokens (M) | time to {target:g} (s) | eval loss | data-parallel at "
        "equal tokens | wire B/token | fewer bytes | utilization | speed-up to target | ideal bound | share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in result["rates"].items():
        sp = r["speedups"]
        for method, row in r["methods"].items():
            s = sp.get(method, {}) if method != "dp" else {}
            ttt = _fmt(row["time_to_target_s"], ".0f") + (" (projected)" if row.get("time_to_target_projected") else "")
            vs = row.get("vs_dp_at_tokens")
            at_tokens = (f"{_fmt(row.get('dp_eval_loss_at_tokens'), '.4f')} ({_fmt(100 * vs if vs is not None else None, '+.1f')}%)"
                         if method != "dp" else "—")
            lines.append(
                f"| {key} | {method} | {_fmt(row['median_step_s'], '.3f')} | {_fmt(row['tokens'] / 1e6, '.2f')} | "
                f"{ttt} | {_fmt(row['final_eval_loss'], '.4f')} | {at_tokens} | "
                f"{_fmt(row['wire_bytes_per_token'], '.1f')} | {_fmt(s.get('fewer_wire_bytes_per_token'), '.0f')}× | "
                f"{_fmt(row['utilization'], '.1%')} | {_fmt(s.get('time_to_target'), '.2f')}× | "
                f"{_fmt(sp.get('ideal_bound'), '.2f')}× | {_fmt(s.get('share_of_bound'), '.0%')} |")
    rounds = [(key, method, row) for key, r in result["rates"].items() for method, row in r["methods"].items()
              if "committed" in row]
    if rounds:
        lines += ["", "Rounds (summed over the learners; a round counts once per learner):", ""]
    for key, method, row in rounds:
        done, lost = sum(row["committed"]), sum(row["discarded"])
        why = "; ".join(f"{n}: {reason}" for reason, n in row.get("discard_reasons", {}).items())
        lines.append(f"- {key} Mbit/s, {method}: {done} of {done + lost} committed ({done / max(1, done + lost):.1%})"
                     + (f"; discarded by reason: {why}" if why else ""))
    lines += ["", "Wire bytes: every host's interface tx_bytes over the run (all traffic: gradients or pseudo-"
              "gradients, DHT, TCP/IP headers as handed to the interface with segmentation offload). "
              "Share: speed-up to target / ideal bound.", ""]
    return "\n".join(lines)


COLORS = {"dp": "tab:blue", "blocking": "tab:orange", "decoupled": "tab:green"}


def plot(result: dict[str, Any], path: Path) -> None:
    """Time to the target and speed-ups against the link rate, and the eval curves against tokens (nothing without
    a measured rate)."""
    if not result["rates"]:
        return
    with _bench.figure(path, 3, (16, 4.2)) as (ax1, ax2, ax3):
        _plot_rates(result, ax1, ax2)
        _plot_curves(result, ax3)


def _plot_rates(result: dict[str, Any], ax1: Any, ax2: Any) -> None:
    rates = list(result["rates"].values())
    for method in METHODS:
        pts = [(r["rate_mbit"], r["methods"][method]) for r in rates if method in r["methods"]]
        if not pts:
            continue
        tt = [(x, m["time_to_target_s"]) for x, m in pts if m.get("time_to_target_s")]
        if tt:
            ax1.plot(*zip(*tt), marker="o", color=COLORS[method], label=method + (" (projected)" if method == "dp" else ""))
        if method != "dp":
            sp = [(r["rate_mbit"], r["speedups"].get(method, {}).get("time_to_target")) for r in rates]
            sp = [(x, y) for x, y in sp if y]
            if sp:
                ax2.plot(*zip(*sp), marker="o", color=COLORS[method], label=method)
    bound = [(r["rate_mbit"], r["speedups"].get("ideal_bound")) for r in rates]
    bound = [(x, y) for x, y in bound if y]
    if bound:
        ax2.plot(*zip(*bound), color="grey", linestyle="--", label="ideal bound")
    ax1.set_title(f"time to eval loss {result['params']['target_loss']:g} (s)")
    ax2.set_title("speed-up over data-parallel (time to target)")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_yscale("log")
        rtt = result["params"].get("rtt_ms", 0.0)
        ax.set_xlabel(f"per-host link (Mbit/s), round trip {rtt:g} ms" if rtt else "per-host link (Mbit/s), no added latency")
        ax.legend(fontsize=8)


def _plot_curves(result: dict[str, Any], ax3: Any) -> None:
    t = result.get("trajectory", {})
    if t.get("curve"):
        ax3.plot([c["tokens"] / 1e6 for c in t["curve"]], [c["eval_loss"] for c in t["curve"]], "k-",
                 label="data-parallel (trajectory)")
    for key, r in result["rates"].items():
        for method in ("blocking", "decoupled"):
            m = r["methods"].get(method)
            if m and m.get("eval_curve") and m.get("tokens_per_s"):
                ax3.plot([x * m["tokens_per_s"] / 1e6 for x, _ in m["eval_curve"]], [y for _, y in m["eval_curve"]],
                         linestyle=":" if method == "blocking" else "-", alpha=0.7, label=f"{method} {key} Mbit/s")
    target = result["params"]["target_loss"]
    ax3.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax3.set_title("held-out eval loss vs tokens (learners: approx. tokens)")
    ax3.set_xlabel("tokens (M), all hosts")
    ax3.set_ylim(top=min(3.5, ax3.get_ylim()[1]))
    ax3.legend(fontsize=6)


def _write(out: Path, result: dict[str, Any]) -> None:
    """The result so far (after every rate: an interrupted sweep keeps what it measured)."""
    _bench.publish(BENCH, out, result, render_md, plot, indent=1, echo=False)


def main(argv: Sequence[str] | None = None) -> int:
    d = BenchParams.__dataclass_fields__
    ap = _bench.parser(__doc__, BENCH, config="demo.toml")
    ap.add_argument("--rates", default="10", help="per-host Mbit/s, comma-separated (default: 10)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"some of {', '.join(METHODS)}")
    ap.add_argument("--hosts", type=int, default=d["hosts"].default)
    ap.add_argument("--steps", type=int, default=d["steps"].default,
                    help="cap on inner steps per host (default: 0 = none, the training time alone ends each run)")
    ap.add_argument("--max-time", type=float, default=d["max_time_s"].default, metavar="SECONDS",
                    help="training time of each learner run (default: %(default)s)")
    ap.add_argument("--dp-max-time", type=float, default=d["dp_max_time_s"].default, metavar="SECONDS",
                    help="training time of each rate's data-parallel run (step times only; default: %(default)s)")
    ap.add_argument("--eval-every", type=float, default=d["eval_every_s"].default, metavar="SECONDS",
                    help="learner 0 evaluates the global model this often (default: %(default)s)")
    ap.add_argument("--trajectory-steps", type=int, default=d["trajectory_steps"].default,
                    help="data-parallel steps on an unlimited link (default: %(default)s)")
    ap.add_argument("--trajectory-eval-every", type=int, default=d["trajectory_eval_every"].default,
                    help="steps between the trajectory's evaluations (default: %(default)s)")
    ap.add_argument("--target-loss", type=float, default=d["target_loss"].default,
                    help="eval loss (nats/byte) for the time to target (default: %(default)s)")
    ap.add_argument("--compute-steps", type=int, default=d["compute_steps"].default)
    ap.add_argument("--budget-min", type=float, default=d["budget_s"].default / 60, help="refuse longer plans")
    ap.add_argument("--rtt-ms", type=float, default=d["rtt_ms"].default, metavar="MS",
                    help="round trip between hosts, added by relays in front of the learners (default: 0 = none; "
                         "not with dp)")
    ap.add_argument("--host-rtt-ms", action="append", default=[], metavar="HOST=MS",
                    help="a host with its own round trip, e.g. 3=300 (repeatable); a pair gets the larger of theirs")
    ap.add_argument("--merge", action="store_true",
                    help="add these rates to --out/wan.json (same parameters; its compute-only step and trajectory)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if _bench.rerender(a, BENCH, render_md, plot):
        return 0
    try:
        params = BenchParams(rates_mbit=tuple(float(x) for x in a.rates.split(",")),
                             methods=tuple(m.strip() for m in a.methods.split(",")), hosts=a.hosts, config=a.config,
                             overrides=tuple(a.overrides), steps=a.steps, max_time_s=a.max_time,
                             dp_max_time_s=a.dp_max_time, eval_every_s=a.eval_every,
                             trajectory_steps=a.trajectory_steps, trajectory_eval_every=a.trajectory_eval_every,
                             target_loss=a.target_loss, budget_s=a.budget_min * 60, out=str(a.out),
                             compute_steps=a.compute_steps, merge=a.merge, rtt_ms=a.rtt_ms,
                             host_rtt_ms=netns.parse_host_rtts(a.host_rtt_ms))
    except ValueError as e:
        print(f"bench_wan: {e}", file=sys.stderr)
        return 2
    log.info("worst case %.1f min", worst_case_s(params) / 60)
    try:
        with netns.handle_signals():
            result = bench(params)
    except netns.Interrupted as e:
        print(f"bench_wan: interrupted ({e}); processes stopped, namespaces removed", file=sys.stderr)
        return 130
    except (netns.WanError, RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"bench_wan: {e}", file=sys.stderr)
        return 1
    print(render_md(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
