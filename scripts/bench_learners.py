#!/usr/bin/env python3
"""Networked learners against the simulator: a real swarm on 127.0.0.1, then the same run in-process.

Starts a bootstrap peer and K ``p2p-diloco join`` learners (real processes, real hivemind DHT and
all-reduce) for a fixed wall time on ``configs/demo.toml``, then runs the in-process simulator
with the same config, learners, fragments and data shards for the same number of inner steps per
learner (the median the learners reached), and compares the global model's held-out loss. Every learner
trains for the whole wall time whatever the machine's speed (no step cap); the LR's warm-up + cosine
runs over ``inner.total_steps`` steps in both (``--lr-schedule steps``), then stays at its floor.

Reported per learner: inner steps, utilization (time in inner steps / wall time), time the inner
loop was blocked, rounds committed / discarded, forks healed, consensus distance, bytes. The
swarm's figures are medians over learners.

    python scripts/bench_learners.py                 # 4 learners x 10 minutes on demo.toml, then the simulator
    python scripts/bench_learners.py --quick         # tiny.toml, 60 s: checks the pipeline, not the numbers
    python scripts/bench_learners.py --render-only   # rewrite the page (README.md) from learners.json

Writes ``learners.json``, ``README.md`` (the page) and ``learners.png`` into ``--out``;
each learner's round events (JSONL) and log go to ``--out/logs``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _bench
from _swarm import events_of

from p2p_diloco.core.events import RoundEvent
from p2p_diloco.local.launcher import NO_STEP_LIMIT, START_TIMEOUT_S, LocalSwarm

FINISH_SLACK_S = 300.0
"""After the training time: final rounds, linger, evaluation and exit."""
PROGRESS_PERIOD_S = 30.0
BENCH = _bench.Bench("learners", "learners", "Networked learners against the simulator", "scripts/bench_learners.py", """\
A bootstrap peer and 4 `p2p-diloco join` processes on 127.0.0.1 (real processes, real hivemind DHT and all-reduce)
train for a fixed wall time (10 minutes by default) on `configs/demo.toml` (0.86M parameters, F=4, H=25, int4, radial
merge); all learners share this machine's cores. Then the in-process simulator runs with the same config, learners,
fragments and data shards for the same number of inner steps per learner (the median the learners reached), and the
global models' held-out losses are compared. Every learner trains for the whole wall time whatever the machine's
speed (no step cap); the LR's warm-up + cosine runs over `inner.total_steps` steps in both (`--lr-schedule steps`),
then stays at its floor.

Per learner: inner steps, utilization (time in inner steps / wall time), the share of time the inner loop was
blocked on the swarm, rounds committed / discarded, forks healed, the eval loss of its anchors at the end, and bytes
sent. The swarm's figures are medians over learners. Overrides of the run (for instance `averaging.schedule = "steps"`,
each learner due every H of its *own* steps) are listed in the JSON.""")


def run_swarm(config: str, overrides: list[str], learners: int, seconds: float, logs: Path) -> dict[str, Any]:
    """Bootstrap + ``learners`` learners for ``seconds`` of training; returns their ``final`` summaries."""
    sets = [a for o in overrides for a in ("--set", o)]
    with LocalSwarm(logs) as swarm:
        peers = swarm.start_bootstrap("--config", config, *sets)
        names = [f"l{i}" for i in range(learners)]
        for i, name in enumerate(names):
            swarm.start(name, [
                "join", "--initial-peers", peers, "--config", config, *sets, "--name", name, "--shard", str(i),
                "--num-shards", str(learners), "--wait-peers", str(learners), "--max-time", str(seconds), "--lr-schedule", "steps",
                "--steps", str(NO_STEP_LIMIT),  # the time alone ends training, however fast the machine
                "--linger", "30", "--events", str(logs / f"{name}.jsonl")])
        t0 = time.monotonic()
        finals = swarm.wait_finals(START_TIMEOUT_S + seconds + FINISH_SLACK_S, "bench_learners",
                                   lambda elapsed_s: _report_progress(names, logs, elapsed_s, seconds), PROGRESS_PERIOD_S)
        return {"finals": finals, "wall_s": time.monotonic() - t0}


def _report_progress(names: list[str], logs: Path, elapsed_s: float, seconds: float) -> None:
    parts = []
    for name in names:
        path = logs / f"{name}.jsonl"
        events = events_of(path)  # none before the learner opens it
        rounds = [e for e in events if isinstance(e, RoundEvent)]
        committed = sum(e.committed for e in rounds)
        step = events[-1].step if events else 0
        parts.append(f"{name} step {step} rounds {committed}/{len(rounds)}")
    print(f"[{elapsed_s:5.0f}/{seconds:.0f} s] " + "; ".join(parts), file=sys.stderr, flush=True)


def run_sim(config: str, overrides: list[str], learners: int, steps: int) -> dict[str, Any]:
    from p2p_diloco.core import data
    from p2p_diloco.core.config import load_config
    from p2p_diloco.sim.simulator import Simulator

    cfg = load_config(config, [*overrides, f"sim.learners={learners}"])
    splits = data.split_corpus(data.load_corpus(cfg.data), learners, cfg.data.eval_fraction)
    result = Simulator(cfg, splits, stop_after_ticks=steps).run(progress=True)
    return result.summary() | {"curve": result.curve, "steps_per_learner": steps}


def analyse(swarm: dict[str, Any], sim: dict[str, Any] | None) -> dict[str, Any]:
    finals = list(swarm["finals"].values())
    eval_end = statistics.median(f["eval_loss_end"] for f in finals)
    out: dict[str, Any] = {
        "learners": len(finals),
        "median_utilization": statistics.median(f["utilization"] for f in finals),
        "median_blocked_share": statistics.median(f["blocked_share"] for f in finals),
        "median_steps": statistics.median(f["steps"] for f in finals),
        "tokens": sum(f["tokens"] for f in finals),
        "eval_loss_start": statistics.median(f["eval_loss_start"] for f in finals),
        "eval_loss_end": eval_end,
        "anchors_identical": len({tuple(f["anchor_hashes"]) for f in finals}) == 1,
        "committed": sum(sum(f["committed"]) for f in finals),
        "discarded": sum(sum(f["discarded"]) for f in finals),
        "forks_healed": sum(sum(f.get("forks_healed", [0])) for f in finals),
        "max_consensus_distance": max(max(f.get("consensus_distance", [0.0]) or [0.0]) for f in finals),
        "bytes_sent": sum(f["bytes_sent"] for f in finals),
    }
    if sim is not None:
        out["sim_eval_loss"] = sim["final_eval_loss"]
        out["sim_tokens"] = sim["tokens"]
        out["eval_vs_sim"] = eval_end / sim["final_eval_loss"] - 1
    return out


def markdown(payload: dict[str, Any]) -> str:
    a = payload["analysis"]
    lines = [
        f"Networked learners vs the simulator ({payload['config']}"
        + "".join(f", `{o}`" for o in payload.get("overrides", [])) + f", {a['learners']} learners, "
        f"{payload['seconds']:.0f} s of training, {'quick' if payload['quick'] else 'full'} run):",
        "",
        "| learner | steps | utilization | blocked | committed | discarded | forks healed | eval loss (anchors) | MB out |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in sorted(payload["swarm"]["finals"].items()):
        lines.append(f"| {name} | {f['steps']} | {100 * f['utilization']:.1f}% | {100 * f['blocked_share']:.2f}% | "
                     f"{sum(f['committed'])} | {sum(f['discarded'])} | {sum(f.get('forks_healed', [0]))} | "
                     f"{f['eval_loss_end']:.4f} | {f['bytes_sent'] / 1e6:.2f} |")
    lines.append("")
    lines.append(f"Median utilization {100 * a['median_utilization']:.1f}%, median blocked "
                 f"{100 * a['median_blocked_share']:.2f}%; anchors identical at the end: "
                 f"{'yes' if a['anchors_identical'] else 'NO'}; largest consensus distance healed "
                 f"{a['max_consensus_distance']:.3g}.")
    if "sim_eval_loss" in a:
        lines.append(f"Eval loss {a['eval_loss_end']:.4f} (networked, median) vs {a['sim_eval_loss']:.4f} (simulator, "
                     f"{payload['sim']['steps_per_learner']} steps per learner): {100 * a['eval_vs_sim']:+.1f}%.")
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    with _bench.figure(path, 2, (12, 4.5)) as (ax1, ax2):
        _plot_losses(payload, ax1)
        _plot_utilization(payload, ax2)


def _plot_losses(payload: dict[str, Any], ax1: Any) -> None:
    finals = payload["swarm"]["finals"]
    sim = payload.get("sim")
    if sim:
        per_step = sim["tokens"] / max(1, sim["steps_per_learner"])
        ax1.plot([p["tokens"] / per_step for p in sim["curve"]], [p["eval_loss"] for p in sim["curve"]], "-",
                 label=f"simulator ({sim['final_eval_loss']:.3f})")
    for name in sorted(finals):
        f = finals[name]
        ax1.plot([f["steps"]], [f["eval_loss_end"]], "o", label=f"{name} networked ({f['eval_loss_end']:.3f})")
    ax1.set_xlabel("inner steps per learner")
    ax1.set_ylabel("held-out loss of the anchors (nats/byte)")
    ax1.set_title("global model: networked vs simulator")
    ax1.legend(fontsize=7)


def _plot_utilization(payload: dict[str, Any], ax2: Any) -> None:
    finals = payload["swarm"]["finals"]
    names = sorted(finals)
    xs = range(len(names))
    ax2.bar([x - 0.2 for x in xs], [100 * finals[n]["utilization"] for n in names], 0.4, label="utilization %")
    ax2.bar([x + 0.2 for x in xs], [100 * finals[n]["blocked_share"] for n in names], 0.4, label="blocked %")
    ax2.axhline(90, color="gray", linestyle="--", linewidth=1)
    ax2.set_xticks(list(xs), names)
    ax2.set_title("time in inner steps / blocked, per learner")
    ax2.legend(fontsize=7)


def compare(payload: dict[str, Any], learners: int) -> dict[str, Any]:
    """``payload`` with the simulator run for ``learners`` learners at its swarm's median steps, and the analysis."""
    steps = int(statistics.median(f["steps"] for f in payload["swarm"]["finals"].values()))
    print(f"bench_learners: simulator, {learners} learners x {steps} steps", file=sys.stderr, flush=True)
    sim = run_sim(payload["config"], payload["overrides"], learners, steps)
    return payload | {"sim": sim, "analysis": analyse(payload["swarm"], sim)}


def resim(out: Path) -> int:
    """The simulator comparison of the swarm recorded in ``out`` (``learners.json``), the page written again."""
    payload = BENCH.load(out)
    _bench.publish(BENCH, out, compare(payload, len(payload["swarm"]["finals"])), markdown, plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml", quick="tiny.toml for 60 s: checks the pipeline, not the numbers")
    p.add_argument("--learners", type=int, default=4, help="learner processes (default: 4)")
    p.add_argument("--seconds", type=float, default=600.0, help="training wall time of each learner (default: 600)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator comparison")
    p.add_argument("--resim", action="store_true",
                   help="run only the simulator comparison again, against the swarm recorded in --out (its "
                        "config, overrides, learners and median steps): after a fix to the simulator, or a run "
                        "with --no-sim")
    args = p.parse_args(argv)
    out = args.out
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    if args.resim:
        return resim(out)
    if args.learners < 2 or args.seconds <= 0:
        p.error(f"need --learners >= 2 and --seconds > 0, got {args.learners} and {args.seconds}")
    if args.quick:
        args.config, args.seconds = str(_bench.ROOT / "configs" / "tiny.toml"), 60.0
        args.overrides = ["inner.total_steps=100000", *args.overrides]
    from p2p_diloco.core.config import load_config

    load_config(args.config, args.overrides)  # a bad config fails here, before any process starts
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"bench_learners: {args.learners} learners x {args.seconds:.0f} s on {args.config} -> {out}", file=sys.stderr,
          flush=True)
    swarm = run_swarm(args.config, args.overrides, args.learners, args.seconds, logs)
    print(f"bench_learners: swarm done in {swarm['wall_s']:.0f} s", file=sys.stderr, flush=True)
    payload = {"config": args.config, "overrides": args.overrides, "quick": args.quick, "seconds": args.seconds,
               "swarm": swarm, "sim": None}
    payload = payload | {"analysis": analyse(swarm, None)} if args.no_sim else compare(payload, args.learners)
    _bench.publish(BENCH, out, payload, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
