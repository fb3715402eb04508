#!/usr/bin/env python3
"""Mixed hardware: 2 full-speed + 2 half-speed learners against 4 full-speed ones, at equal tokens.

Runs two real swarms on 127.0.0.1 one after the other (a bootstrap peer and 4 ``p2p-diloco join``
learners each, ``configs/demo.toml``, the same training time): ``homogeneous`` (4 x
``peers/fast.toml``) and ``mixed`` (``fast, half, fast, half``; a half-speed learner takes twice as
long per inner step: ``peers/half.toml``'s ``slowdown = 2``). Learner 0 of each run evaluates the
global model on the whole held-out set every ``--eval-every`` seconds. Every learner trains for the
whole time whatever the machine's speed (no step cap: ``inner.total_steps`` =
``launcher.NO_STEP_LIMIT``, so the LR's warm-up + cosine runs over the time), so all finish together.

The mixed swarm processes fewer tokens in the same time, so its final eval loss is compared with the
homogeneous swarm's loss *at the same number of tokens*, read off the homogeneous run's eval curve
(linear between evaluations; the swarm's tokens at a time are taken as its total tokens x that time /
its training time: every learner steps at a steady rate). Also reported: each learner's steps,
utilization (time in inner steps / training time) and blocked share (time the inner loop waited for
the swarm), so the fast learners' idle time is visible.

    python scripts/bench_hetero.py                  # 2 swarms x 5 min of training (about 14 min)
    python scripts/bench_hetero.py --minutes 1      # a quick look at the pipeline, not the numbers
    python scripts/bench_hetero.py --render-only    # rewrite the page (README.md) from hetero.json

Writes ``hetero.json``, ``README.md`` (the page) and ``hetero.png`` into ``--out`` (default ``results/hetero``);
each run's learner logs and events go to ``--out/logs/<run>``. Needs the whole machine: other load
changes the speeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import _bench

from p2p_diloco.local.launcher import START_TIMEOUT_S, LocalSwarm, read_jsonl, unlimited_steps
from p2p_diloco.sim.curves import value_at

BENCH = _bench.Bench("hetero", "hetero", "Mixed hardware: 2 full-speed + 2 half-speed learners", "scripts/bench_hetero.py", """\
Two real swarms on this machine, one after the other, each a bootstrap peer and 4 `p2p-diloco join` learners on
127.0.0.1 training for the same time on `configs/demo.toml`:

- `homogeneous`: 4 x `peers/fast.toml`;
- `mixed`: fast, half, fast, half (`peers/half.toml`: every inner step takes twice as long).

Every learner trains for the whole time (no step cap). Learner 0 of each run evaluates the global model on the whole
held-out set every `--eval-every` seconds. The mixed swarm processes fewer tokens in the same time, so its final eval
loss is compared with the homogeneous swarm's eval curve *at the same number of tokens* (linear between evaluations;
a swarm's tokens at a time are its total tokens x that time / its training time). A fast learner's idle time is its
training time not spent in inner steps; blocked is the time its inner loop waited for the swarm. Needs the whole
machine: other load changes the speeds.""")

RUNS = {"homogeneous": ("fast", "fast", "fast", "fast"), "mixed": ("fast", "half", "fast", "half")}
"""Each run's learner profiles (``peers/<name>.toml``), learner i on data shard i."""
FINISH_SLACK_S = 240.0
"""After the training time: final rounds, linger, evaluation and exit."""
LINGER_S = 20.0
PROGRESS_PERIOD_S = 30.0
EVAL_ALL = 1_000_000
"""``--eval-batches`` for the whole held-out set (the learner evaluates at most all of it)."""


# ---------------------------------------------------------------- pure analysis


def swarm_curve(finals: dict[str, dict[str, Any]], evals: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """The global model's eval loss against the swarm's tokens: learner 0's ``eval`` events (training
    seconds -> swarm tokens at a steady rate), the start, and the end (median final eval loss)."""
    tokens = sum(f["tokens"] for f in finals.values())
    train_s = statistics.median(f["train_s"] for f in finals.values())
    start = statistics.median(f["eval_loss_start"] for f in finals.values())
    end = statistics.median(f["eval_loss_end"] for f in finals.values())
    pts = [(0.0, start)]
    pts += sorted((tokens * e["train_s"] / train_s, e["eval_loss"]) for e in evals  # the final evaluation wins at the end
                  if isinstance(e.get("train_s"), (int, float)) and 0 < e["train_s"] < train_s
                  and isinstance(e.get("eval_loss"), float))
    pts.append((float(tokens), end))
    return pts


def summarize(profiles: Sequence[str], finals: dict[str, dict[str, Any]],
              evals: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures: tokens, final eval loss, curve, and per-learner steps / utilization / blocked share."""
    learners = {}
    for i, profile in enumerate(profiles):
        f = finals[f"l{i}"]
        learners[f"l{i}"] = {"profile": profile, "steps": f["steps"], "tokens": f["tokens"], "train_s": f["train_s"],
                             "utilization": f["utilization"], "blocked_share": f["blocked_share"],
                             "idle_share": 1.0 - f["utilization"], "committed": sum(f["committed"]),
                             "discarded": sum(f["discarded"])}
    fast = [v for v in learners.values() if v["profile"] == "fast"]
    return {
        "profiles": list(profiles), "learners": learners,
        "tokens": sum(f["tokens"] for f in finals.values()),
        "eval_loss_end": statistics.median(f["eval_loss_end"] for f in finals.values()),
        "anchors_identical": len({tuple(f["anchor_hashes"]) for f in finals.values()}) == 1,
        "curve": swarm_curve(finals, evals),
        "fast_max_idle_share": max(v["idle_share"] for v in fast),
        "fast_max_blocked_share": max(v["blocked_share"] for v in fast),
    }


def compare(homo: dict[str, Any], mixed: dict[str, Any]) -> dict[str, Any]:
    """The mixed swarm's final eval loss against the homogeneous swarm's at the same tokens."""
    at = value_at(homo["curve"], mixed["tokens"])
    return {"tokens": mixed["tokens"], "homogeneous_at_tokens": at, "mixed": mixed["eval_loss_end"],
            "gap": mixed["eval_loss_end"] / at - 1 if at else None,
            "fast_max_idle_share": mixed["fast_max_idle_share"],
            "fast_max_blocked_share": mixed["fast_max_blocked_share"]}


# ---------------------------------------------------------------- the runs


def run_swarm(name: str, profiles: Sequence[str], args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Bootstrap + one learner per profile for ``--minutes`` of training; their finals and learner 0's evals."""
    sets = [a for o in unlimited_steps(args.overrides) for a in ("--set", o)]  # the time alone ends training
    seconds = args.minutes * 60
    with LocalSwarm(logs) as swarm:
        peers = swarm.start_bootstrap("--config", args.config, *sets)
        names = [f"l{i}" for i in range(len(profiles))]
        for i, (n, profile) in enumerate(zip(names, profiles)):
            evals = ["--eval-every", f"{args.eval_every:g}", "--eval-batches", str(EVAL_ALL)] if i == 0 else []
            swarm.start(n, ["join", "--initial-peers", peers, "--config", args.config, *sets, "--name", n,
                            "--profile", str(_bench.ROOT / "peers" / f"{profile}.toml"), "--shard", str(i), "--num-shards",
                            str(len(profiles)), "--wait-peers", str(len(profiles)), "--max-time", f"{seconds:g}",
                            "--linger", f"{LINGER_S:g}", "--events", str(logs / f"{n}.jsonl"), *evals])

        def progress(elapsed_s: float) -> None:
            steps = [(read_jsonl(logs / f"{n}.jsonl") or [{}])[-1].get("step", 0) for n in names]
            print(f"[{name} {elapsed_s:5.0f}/{seconds:.0f} s] steps "
                  + ", ".join(f"{n} ({p}) {s}" for n, p, s in zip(names, profiles, steps)), file=sys.stderr, flush=True)

        finals = swarm.wait_finals(START_TIMEOUT_S + seconds + FINISH_SLACK_S, f"bench_hetero: {name}", progress,
                                   PROGRESS_PERIOD_S)
    evals = [e for e in read_jsonl(logs / "l0.jsonl") if e.get("event") == "eval"]
    return summarize(profiles, finals, evals)


# ---------------------------------------------------------------- report


def markdown(payload: dict[str, Any]) -> str:
    c = payload["comparison"]
    lines = [f"Mixed hardware ({Path(payload['config']).name}, 4 learners, {payload['minutes']:g} min of training "
             "each run, one run after the other on this 2-core machine):", "",
             "| run | learner | profile | steps | tokens (M) | utilization | blocked | idle | rounds committed / discarded |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in RUNS:
        r = payload["runs"][run]
        for name, v in r["learners"].items():
            lines.append(f"| {run} | {name} | {v['profile']} | {v['steps']} | {v['tokens'] / 1e6:.3f} | "
                         f"{100 * v['utilization']:.1f}% | {100 * v['blocked_share']:.2f}% | {100 * v['idle_share']:.1f}% | "
                         f"{v['committed']} / {v['discarded']} |")
    homo, mixed = payload["runs"]["homogeneous"], payload["runs"]["mixed"]
    gap = c["gap"]
    lines += ["",
              f"Homogeneous: {homo['tokens'] / 1e6:.3f}M tokens, eval loss {homo['eval_loss_end']:.4f}. "
              f"Mixed: {mixed['tokens'] / 1e6:.3f}M tokens, eval loss {mixed['eval_loss_end']:.4f}.",
              "At the mixed swarm's tokens the homogeneous swarm's eval loss was "
              + (f"{c['homogeneous_at_tokens']:.4f}: mixed **{100 * gap:+.2f}%**." if gap is not None else "not known.")
              + f" Fast learners in the mixed swarm: idle (not in an inner step) at most "
              f"**{100 * c['fast_max_idle_share']:.2f}%** of their training time, blocked on the swarm at most "
              f"{100 * c['fast_max_blocked_share']:.2f}%.", ""]
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    with _bench.figure(path, 2, (12, 4.5)) as (ax1, ax2):
        _plot_curves(payload, ax1)
        _plot_learners(payload, ax2)


def _plot_curves(payload: dict[str, Any], ax1: Any) -> None:
    for run, style in (("homogeneous", "o-"), ("mixed", "s-")):
        pts = payload["runs"][run]["curve"][1:]  # the start (5.3) flattens the plot
        ax1.plot([x / 1e6 for x, _ in pts], [y for _, y in pts], style, markersize=3, label=run)
    ax1.set_xlabel("swarm tokens (M)")
    ax1.set_ylabel("held-out eval loss of the global model (nats/byte)")
    ax1.set_title("eval loss vs tokens")
    ax1.legend()


def _plot_learners(payload: dict[str, Any], ax2: Any) -> None:
    bars = [(f"{run[:4]} {n} ({v['profile']})", v) for run in RUNS for n, v in payload["runs"][run]["learners"].items()]
    xs = range(len(bars))
    ax2.bar([x - 0.2 for x in xs], [v["steps"] for _, v in bars], 0.4, label="inner steps")
    ax2b = ax2.twinx()
    ax2b.bar([x + 0.2 for x in xs], [100 * v["idle_share"] for _, v in bars], 0.4, color="tab:red", label="idle %")
    ax2.set_xticks(list(xs), [b for b, _ in bars], rotation=30, ha="right", fontsize=7)
    ax2.set_title("steps and idle share per learner")
    ax2.legend(loc="upper left", fontsize=7)
    ax2b.legend(loc="upper right", fontsize=7)


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml")
    p.add_argument("--minutes", type=float, default=5.0, help="training time of each run (default: 5)")
    p.add_argument("--eval-every", type=float, default=20.0, metavar="SECONDS",
                   help="learner 0 evaluates the global model this often (default: 20)")
    args = p.parse_args(argv)
    out = args.out
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    if args.minutes <= 0 or args.eval_every <= 0:
        p.error(f"--minutes and --eval-every must be > 0, got {args.minutes} and {args.eval_every}")
    t0 = time.monotonic()
    runs = {}
    for name, profiles in RUNS.items():
        print(f"bench_hetero: {name} swarm ({', '.join(profiles)}), {args.minutes:g} min of training", file=sys.stderr)
        runs[name] = run_swarm(name, profiles, args, out / "logs" / name)
    payload = {"config": args.config, "overrides": args.overrides, "minutes": args.minutes,
               "eval_every_s": args.eval_every, "runs": runs,
               "comparison": compare(runs["homogeneous"], runs["mixed"]), "wall_s": round(time.monotonic() - t0, 1),
               "command": "python scripts/bench_hetero.py" + (f" --minutes {args.minutes:g}" if args.minutes != 5 else "")}
    _bench.publish(BENCH, out, payload, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
