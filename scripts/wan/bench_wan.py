#!/usr/bin/env python3
"""Emulated-WAN benchmark: data-parallel (gloo), blocking DiLoCo and p2p-diloco on rate-limited hosts.

For each link rate, N hosts are built as network namespaces on a private bridge (``netns.py``: a
token bucket on each host's link, both directions; **no latency emulation**, netem is missing
here), and on the same hosts, model, data, seeds and token budget (``--steps`` per host, capped by
``--max-time`` seconds of training) it runs:

- ``dp``: data-parallel with torch.distributed gloo, gradients all-reduced every step
  (``dp_gloo.py``, one rank per host) -- conventional synchronization;
- ``blocking``: our learner as OpenDiLoCo-style DiLoCo: ``join --blocking`` (the inner loop waits for
  each round), one fragment, no overlap (tau = 0), no alpha-mixing, every round needs all N peers
  (``averaging.min_group_size = target_group_size = N``);
- ``decoupled``: our learner with the config as it is (F fragments, tau, int4, any live peers).

Once, before the rates: ``compute``, the data-parallel loop with no all-reduce on all hosts at once
(the same CPU contention, no network); data-parallel step time / compute-only step time is the
*ideal bound* on any speed-up over data-parallel at that rate, reported next to every speed-up.

Reported per rate and method: steps and tokens per host, median step time, final held-out eval
loss, time to ``--target-loss``, bytes on the wire per token (every host's interface ``tx_bytes``
over the run, all traffic included: DHT, headers, retransmissions), learner utilization (share of
training time spent in inner steps; for data-parallel compute-only step / step), and the speed-up
over data-parallel in tokens per second next to the ideal bound.

    sudo python scripts/wan/bench_wan.py                          # 10 Mbit/s, all methods, 300 s each (<= 30 min)
    for r in 2 5 50 200; do sudo python scripts/wan/bench_wan.py --rates $r --merge; done   # the other rates
    sudo python scripts/wan/bench_wan.py --methods dp --steps 20 --max-time 150   # a smoke run
    python scripts/wan/bench_wan.py --replot                              # rewrite wan.md / wan.png from wan.json
    sudo python scripts/wan/netns.py --cleanup                            # leftovers of a run killed by SIGKILL

Writes ``wan.json``, ``wan.md`` and ``wan.png`` into ``--out`` (default ``results/wan``); every
process's output goes to ``--out/logs``. Everything started is stopped, and every namespace and
link removed, on exit, on error and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import netns  # noqa: E402  (scripts/wan/netns.py, stdlib only)
from dp_gloo import summarize_steps  # noqa: E402  (imports torch lazily)
from p2p_diloco.procguard import die_with_parent  # noqa: E402  (stdlib only)

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
FINAL_RE = re.compile(r"^final (\{.*\})$", re.M)
PEERS_RE = re.compile(r"^initial peers: (\S+)$", re.M)


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
    steps: int = 600
    """Token budget: inner steps per host (each step is inner.batch_size x model.block_size bytes per host)."""
    max_time_s: float = 300.0
    """Cap on one run's training time; a run that hits it reports fewer tokens."""
    eval_every: int = 50
    """Data-parallel: steps between held-out evaluations (for the time to the target)."""
    target_loss: float = 2.0
    """Eval loss (nats/byte) whose first crossing is the time to target."""
    budget_s: float = 1800.0
    """Refuse a plan whose worst-case wall time is above this."""
    out: str = str(ROOT / "results" / "wan")
    compute_steps: int = 30
    """Steps of the compute-only run (its median step time is all that is used)."""
    compute_step_s: float = 0.0
    """A compute-only step time measured before (seconds); > 0 skips the compute-only run."""
    merge: bool = False
    """Add the rates measured now to ``out/wan.json`` (same hosts, config, budget), reusing its compute-only
    step time, instead of starting a new result."""

    def __post_init__(self) -> None:
        if not self.rates_mbit:
            raise ValueError("rates: give at least one rate")
        for r in self.rates_mbit:
            netns.WanPlan(hosts=self.hosts, rate_mbit=r)  # validates hosts and rate
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods must be some of {', '.join(METHODS)}, got {list(self.methods)}")
        if self.hosts < 2:
            raise ValueError(f"hosts must be >= 2 (data-parallel and averaging need peers), got {self.hosts}")
        if self.steps < 1 or self.max_time_s <= 0 or self.compute_steps < 3:
            raise ValueError(f"steps >= 1, max_time_s > 0 and compute_steps >= 3 required, got {self.steps}, "
                             f"{self.max_time_s}, {self.compute_steps}")
        if self.compute_step_s < 0:
            raise ValueError(f"compute_step_s must be >= 0, got {self.compute_step_s}")
        if self.target_loss <= 0:
            raise ValueError(f"target_loss must be > 0, got {self.target_loss}")
        if worst_case_s(self) > self.budget_s:
            raise ValueError(f"worst case {worst_case_s(self) / 60:.1f} min exceeds the budget of "
                             f"{self.budget_s / 60:.1f} min: lower --max-time, or measure fewer --rates / --methods")


# ---------------------------------------------------------------- pure decisions


def worst_case_s(p: BenchParams) -> float:
    """Upper bound on the whole benchmark's wall time (every run using its full budget and slack)."""
    per_run = p.max_time_s + START_SLACK_S + FINISH_SLACK_S
    # a compute-only step is under 2 s here; none is run with a given or merged compute-only step time
    compute = 0.0 if p.compute_step_s > 0 or p.merge else START_SLACK_S + 2.0 * p.compute_steps
    return compute + len(p.rates_mbit) * len(p.methods) * per_run


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
               target: float) -> dict[str, Any]:
    """One data-parallel run's figures from its ranks' ``final`` lines (rank 0 holds the eval curve)."""
    r0 = next(r for r in ranks if r["rank"] == 0)
    step_s = statistics.median(r["median_step_s"] for r in ranks)
    tokens = r0["tokens"]  # all ranks together
    curve = r0["curve"]
    return {
        "steps_per_host": r0["steps"], "tokens": tokens, "median_step_s": step_s,
        "train_s": r0["train_s"], "final_eval_loss": r0["final_eval_loss"],
        "time_to_target_s": next((p["train_s"] for p in curve if p["eval_loss"] <= target), None),
        "wire_bytes": sum(wire_tx), "wire_bytes_per_token": sum(wire_tx) / tokens if tokens else None,
        "utilization": compute_step_s / step_s if step_s > 0 else None,
        "tokens_per_s": tokens / r0["train_s"] if r0["train_s"] > 0 else None,
        "curve": curve,
    }


def learner_metrics(finals: Sequence[dict[str, Any]], wire_tx: Sequence[int], target: float) -> dict[str, Any]:
    """One learner run's figures from the learners' ``final`` lines; the anchors are evaluated only at
    the end, so the time to target is the training time if the end is at or below the target, else
    unknown (None)."""
    tokens = sum(f["tokens"] for f in finals)
    train_s = statistics.median(f["train_s"] for f in finals)
    final_loss = statistics.median(f["eval_loss_end"] for f in finals)
    return {
        "steps_per_host": statistics.median(f["steps"] for f in finals), "tokens": tokens,
        # wall time per step, like data-parallel's (inner step + any time the loop was held up)
        "median_step_s": statistics.median(f["train_s"] / max(1, f["steps"]) for f in finals),
        "train_s": train_s, "final_eval_loss": final_loss,
        "time_to_target_s": train_s if final_loss <= target else None,
        "wire_bytes": sum(wire_tx), "wire_bytes_per_token": sum(wire_tx) / tokens if tokens else None,
        "utilization": statistics.median(f["utilization"] for f in finals),
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "committed": [sum(f["committed"]) for f in finals], "discarded": [sum(f["discarded"]) for f in finals],
        "anchors_identical": len({tuple(f["anchor_hashes"]) for f in finals}) == 1,
        "app_bytes_sent": sum(f["bytes_sent"] for f in finals),
    }


def speedups(rows: dict[str, dict[str, Any]], compute_step_s: float) -> dict[str, Any]:
    """Each method's speed-up over data-parallel at one rate (tokens per second, and time to target),
    with the ideal bound: data-parallel step time / compute-only step time."""
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
        out[name] = {"throughput": tput, "time_to_target": ttt}
    return out


COMPARABLE = ("hosts", "config", "overrides", "steps", "max_time_s", "eval_every", "target_loss")
"""Parameters that must agree for results of two runs to share one table."""


def merge_check(old_params: dict[str, Any], p: BenchParams) -> None:
    """Refuse to merge into a result measured under other conditions (one line naming the parameter)."""
    new = asdict(p)
    for key in COMPARABLE:
        old, now = old_params.get(key), new[key]
        if isinstance(now, tuple):
            old = tuple(old or ())
        if old != now:
            raise ValueError(f"--merge: {key} differs from the existing result's ({old!r} there, {now!r} now)")


def merge_results(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the rates of ``new`` added (a rate measured again is replaced); rates sorted."""
    rates = {**old["rates"], **new["rates"]}
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
        for _, p, out, err in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # SIGTERM to every leader first, so they leave together
        for name, p, out, err in self.procs:
            code = netns.stop_group(p, grace_s=STOP_GRACE_S)
            out.close()
            err.close()
            log.debug("%s exited with %s", name, code)
        self.procs = []
        shutil.rmtree(self.tmp, ignore_errors=True)


def _dp_cmd(p: BenchParams, wan: netns.Wan, i: int, steps: int, compute_only: bool, json_path: Path) -> list[str]:
    sets = [a for o in p.overrides for a in ("--set", o)]
    cmd = [sys.executable, str(HERE / "dp_gloo.py"), "--config", p.config, *sets, "--steps", str(steps),
           "--json", str(json_path), "-v"]
    if compute_only:
        return [*cmd, "--compute-only", "--shard", str(i), "--num-shards", str(p.hosts), "--eval-every", "0"]
    return [*cmd, "--rank", str(i), "--world-size", str(p.hosts), "--master-addr", wan.address(0),
            "--ifname", netns.inner_if(i), "--max-time", str(p.max_time_s), "--eval-every", str(p.eval_every)]


def run_dp(p: BenchParams, wan: netns.Wan, logs: Path, tag: str, compute_only: bool) -> tuple[list[dict[str, Any]], list[int]]:
    """Data-parallel (or compute-only) on every host; returns the ranks' finals and each host's bytes sent."""
    steps = p.compute_steps if compute_only else p.steps
    before = wan.all_counters()
    with Procs(wan, logs) as procs:
        names = [f"{tag}-r{i}" for i in range(p.hosts)]
        for i, name in enumerate(names):
            procs.start(name, i, _dp_cmd(p, wan, i, steps, compute_only, logs / f"{name}.json"))
        budget = START_SLACK_S + (2.0 * steps if compute_only else p.max_time_s) + FINISH_SLACK_S
        finals = procs.wait_finals(names, timeout_s=budget)
    after = wan.all_counters()
    wire = [netns.byte_delta(b, a)["tx_bytes"] for b, a in zip(before, after)]
    return [finals[n] for n in names], wire


def run_learners(p: BenchParams, wan: netns.Wan, logs: Path, tag: str, method: str) -> tuple[list[dict[str, Any]], list[int]]:
    """A bootstrap peer in host 0 and one ``p2p-diloco join`` learner per host; their finals and bytes sent."""
    sets = [a for o in [*p.overrides, *method_overrides(method, p.hosts), f"run.run_id=wan-{method}"]
            for a in ("--set", o)]
    cli = [sys.executable, "-m", "p2p_diloco.cli"]
    before = wan.all_counters()
    with Procs(wan, logs) as procs:
        procs.start(f"{tag}-boot", 0, [*cli, "bootstrap", "--host", wan.address(0), "--identity",
                                       str(procs.tmp / "boot.id"), "--config", p.config, *sets])
        peers = procs.wait_for(f"{tag}-boot", PEERS_RE, START_SLACK_S).group(1)
        names = [f"{tag}-l{i}" for i in range(p.hosts)]
        for i, name in enumerate(names):
            procs.start(name, i, [*cli, "join", "--initial-peers", peers, "--host", wan.address(i), "--config",
                                  p.config, *sets, "--name", f"l{i}", "--shard", str(i), "--num-shards", str(p.hosts),
                                  "--wait-peers", str(p.hosts), "--steps", str(p.steps), "--max-time",
                                  str(p.max_time_s), "--lr-schedule", "steps", "--linger", str(LINGER_S), "--events",
                                  str(logs / f"{name}.jsonl"), *(["--blocking"] if method == "blocking" else [])])
        finals = procs.wait_finals(names, timeout_s=START_SLACK_S + p.max_time_s + FINISH_SLACK_S)
    after = wan.all_counters()
    wire = [netns.byte_delta(b, a)["tx_bytes"] for b, a in zip(before, after)]
    return [finals[n] for n in names], wire


def bench(p: BenchParams) -> dict[str, Any]:
    out = Path(p.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"params": asdict(p), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "latency_emulation": False, "rates": {}}
    previous: dict[str, Any] | None = None
    if p.merge:
        previous = json.loads((out / "wan.json").read_text())
        merge_check(previous["params"], p)
    t0 = time.monotonic()
    if p.compute_step_s > 0 or previous is not None:
        compute_step_s = p.compute_step_s or previous["compute_only"]["median_step_s"]  # type: ignore[index]
        result["compute_only"] = {"median_step_s": compute_step_s, "steps": 0, "given": True}
    else:
        with netns.Wan(netns.WanPlan(hosts=p.hosts, rate_mbit=max(p.rates_mbit))) as wan:
            ranks, _ = run_dp(p, wan, logs, "compute", compute_only=True)
        compute_step_s = statistics.median(summarize_steps(r["step_s"])["median_step_s"] for r in ranks)
        result["compute_only"] = {"median_step_s": compute_step_s, "steps": p.compute_steps,
                                  "per_rank": [r["median_step_s"] for r in ranks]}
    log.info("compute-only: %.3f s per step (%d hosts at once)", compute_step_s, p.hosts)
    for rate in p.rates_mbit:
        plan = netns.WanPlan(hosts=p.hosts, rate_mbit=rate)
        rows: dict[str, dict[str, Any]] = {}
        with netns.Wan(plan) as wan:
            qdisc = wan.qdisc(0)
            for method in p.methods:
                tag = f"{rate:g}mbit-{method}"
                log.info("%s: %d hosts at %g Mbit/s, %d steps or %.0f s", method, p.hosts, rate, p.steps, p.max_time_s)
                if method == "dp":
                    ranks, wire = run_dp(p, wan, logs, tag, compute_only=False)
                    rows[method] = dp_metrics(ranks, wire, compute_step_s, p.target_loss)
                else:
                    finals, wire = run_learners(p, wan, logs, tag, method)
                    rows[method] = learner_metrics(finals, wire, p.target_loss)
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
    return (f"{row['steps_per_host']} steps/host, {row['median_step_s']:.3f} s/step, eval {row['final_eval_loss']:.4f}, "
            f"{row['wire_bytes_per_token'] or 0:.1f} wire B/token, utilization {row['utilization'] or 0:.1%}")


# ---------------------------------------------------------------- report


def _fmt(v: Any, spec: str, none: str = "—") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def render_md(result: dict[str, Any]) -> str:
    p = result["params"]
    c = result.get("compute_only", {})
    lines = [
        f"# Emulated WAN: {p['hosts']} hosts, {Path(p['config']).name}, {p['steps']} steps/host or "
        f"{p['max_time_s']:g} s of training",
        "",
        "Per-host links limited with tc tbf in both directions; **no latency emulation** (netem is not "
        "available): round trips stay sub-millisecond, so these figures favour data-parallel.",
        f"Compute-only step (all hosts at once, no all-reduce): {_fmt(c.get('median_step_s'), '.3f')} s.",
        "",
        "| Mbit/s | method | steps/host | s/step | train s | eval loss | time to "
        f"{p['target_loss']:g} (s) | wire B/token | utilization | speed-up (tokens/s) | ideal bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in result["rates"].items():
        sp = r["speedups"]
        for method, row in r["methods"].items():
            s = sp.get(method, {}) if method != "dp" else {}
            lines.append(
                f"| {key} | {method} | {_fmt(row['steps_per_host'], 'g')} | {_fmt(row['median_step_s'], '.3f')} | "
                f"{_fmt(row['train_s'], '.0f')} | {_fmt(row['final_eval_loss'], '.4f')} | "
                f"{_fmt(row['time_to_target_s'], '.0f')} | {_fmt(row['wire_bytes_per_token'], '.1f')} | "
                f"{_fmt(row['utilization'], '.1%')} | {_fmt(s.get('throughput'), '.2f')}× | "
                f"{_fmt(sp.get('ideal_bound'), '.2f')}× |")
    lines += ["", "Wire bytes: every host's interface tx_bytes over the run (all traffic: gradients or pseudo-"
              "gradients, DHT, TCP/IP headers as handed to the interface with segmentation offload).", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate_mbit"] for r in result["rates"].values()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for method in METHODS:
        pts = [(r["rate_mbit"], r["methods"][method]) for r in result["rates"].values() if method in r["methods"]]
        if not pts:
            continue
        ax1.plot([x for x, _ in pts], [m["median_step_s"] for _, m in pts], marker="o", label=method)
        ax2.plot([x for x, _ in pts], [m["final_eval_loss"] for _, m in pts], marker="o", label=method)
    c = result.get("compute_only", {}).get("median_step_s")
    if c and rates:
        ax1.axhline(c, color="grey", linestyle="--", label="compute only")
    for ax, title in ((ax1, "step time (s)"), (ax2, "final eval loss (nats/byte)")):
        ax.set_xscale("log")
        ax.set_xlabel("per-host link (Mbit/s), no added latency")
        ax.set_title(title)
        ax.legend()
    ax1.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "wan.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "wan.md").write_text(render_md(result))
    if result["rates"]:
        plot(result, out / "wan.png")


def main(argv: Sequence[str] | None = None) -> int:
    d = BenchParams.__dataclass_fields__
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10", help="per-host Mbit/s, comma-separated (default: 10)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"some of {', '.join(METHODS)}")
    ap.add_argument("--hosts", type=int, default=d["hosts"].default)
    ap.add_argument("--config", default=d["config"].default)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=d["steps"].default, help="inner steps per host (token budget)")
    ap.add_argument("--max-time", type=float, default=d["max_time_s"].default, metavar="SECONDS",
                    help="cap on each run's training time")
    ap.add_argument("--eval-every", type=int, default=d["eval_every"].default)
    ap.add_argument("--target-loss", type=float, default=d["target_loss"].default)
    ap.add_argument("--compute-steps", type=int, default=d["compute_steps"].default)
    ap.add_argument("--compute-step-s", type=float, default=0.0, metavar="SECONDS",
                    help="reuse a compute-only step time measured before instead of measuring it")
    ap.add_argument("--budget-min", type=float, default=d["budget_s"].default / 60, help="refuse longer plans")
    ap.add_argument("--out", default=d["out"].default)
    ap.add_argument("--merge", action="store_true",
                    help="add these rates to --out/wan.json (same hosts, config, budget; its compute-only step time)")
    ap.add_argument("--replot", action="store_true", help="rewrite wan.md and wan.png from wan.json")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if a.replot:
        result = json.loads((Path(a.out) / "wan.json").read_text())
        _write(Path(a.out), result)
        return 0
    try:
        params = BenchParams(rates_mbit=tuple(float(x) for x in a.rates.split(",")),
                             methods=tuple(m.strip() for m in a.methods.split(",")), hosts=a.hosts, config=a.config,
                             overrides=tuple(a.overrides), steps=a.steps, max_time_s=a.max_time,
                             eval_every=a.eval_every, target_loss=a.target_loss, budget_s=a.budget_min * 60,
                             out=a.out, compute_steps=a.compute_steps,
                             compute_step_s=a.compute_step_s, merge=a.merge)
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
