#!/usr/bin/env python3
"""Past one group, on real learners: N learners on 127.0.0.1 in grid groups of at most G, against the same learners
in one group, at equal tokens, with learners killed and restarted in both.

Two arms, one after the other, on the same config, learners, data shards, pacing and kill schedule:

- ``grid``: ``averaging.groups = "grid"``, ``averaging.target_group_size = G`` (docs/design.md, "Bounded groups"):
  each round's groups of at most G lie on a grid that changes every round; every group keeps its update; anchors
  and outer momenta are averaged with the pseudo-gradients, so anchors converge instead of being identical;
- ``one group``: the default (every round holds every live learner).

Both arms send fp32 (grid groups average anchors, which a lossy codec would blur) and use one fragment per learner
(one averager process each, so that many learners fit on two cores). Every learner trains until the same wall-clock
deadline, ``--seconds`` after the learners were started, at the same pacing, so both arms see about the same tokens
(the ratio is reported). A third of the way into training, ``--kill`` learners are SIGKILLed (nothing saved,
nothing said); ``--restart-after`` seconds later each is started again on its shard, fresh, until the deadline: it
downloads the current anchor and trains on.

Reported per arm: the learners' median eval loss at the end (each evaluates its own anchor on the held-out set) and
its spread, total tokens, rounds committed and discarded, rounds half-applied (a group some of whose members
committed it and others discarded it), and the consensus distance at the end, measured on the learners' final
checkpoints: RMS over learners of ``||anchor_i - mean anchor|| / ||mean anchor||``, against the estimate each learner
publishes (:func:`p2p_diloco.core.groups.swarm_distance_estimate` of its last d rounds' in-group distances).
A ``status`` read during the run is kept (text and JSON) to show that it stays readable at that N.

    python scripts/bench_groups.py                       # 12 learners, G = 4
    python scripts/bench_groups.py --quick               # 4 learners, G = 2, short: checks the pipeline
    python scripts/bench_groups.py --render-only         # rewrite the page from groups.json
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _bench
from _swarm import Swarm, events_of, steps_of

from p2p_diloco.core.events import RoundEvent
from p2p_diloco.local.launcher import NO_STEP_LIMIT, START_TIMEOUT_S, cli_argv

BENCH = _bench.Bench("groups", "groups", "Past one group: grid groups against one group, on real learners",
                     "scripts/bench_groups.py", __doc__.split("\n\n", 1)[1].split("\n    python")[0])
FINISH_SLACK_S = 300.0
"""After the last restart: training, final rounds, linger, evaluation and exit."""
STATUS_TIMEOUT_S = 60.0
PROGRESS_PERIOD_S = 30.0
ATTEMPT_GAP_S = 2.0
"""Members of one round attempt start it within this many seconds of each other (the matchmaking window)."""
GIT_TIMEOUT_S = 10.0
"""Seconds a git command may take (naming the code a run used)."""


def arm_overrides(arm: str, group_size: int) -> list[str]:
    if arm == "grid":
        return ["averaging.groups=grid", f"averaging.target_group_size={group_size}"]
    return []


def common_overrides(seconds: float, step_s: float, period_s: float) -> list[str]:
    """What both arms run with; the LR's cosine spans the steps the pacing allows in ``seconds``."""
    return ["outer.codec=fp32", "outer.fragments=1", "averaging.schedule=clock", f"averaging.sync_period_s={period_s}",
            f"averaging.window_max_s={min(10.0, period_s / 2)}", f"inner.total_steps={int(seconds / step_s)}"]


def run_arm(arm: str, args: Any, logs: Path) -> dict[str, Any]:
    """One swarm: bootstrap, learners, the kills and restarts, a status read; every learner's final summary."""
    sets = [a for o in [*args.overrides, *common_overrides(args.seconds, args.step_s, args.period),
                        *arm_overrides(arm, args.group_size)] for a in ("--set", o)]
    profile = logs / "paced.toml"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(f'name = "paced"\nmin_step_s = {args.step_s}\nthreads = 1\n')
    names = [f"l{i}" for i in range(args.learners)]
    killed = names[1::max(1, args.learners // max(1, args.kill))][:args.kill]
    log: dict[str, Any] = {"killed": {}, "restarted": {}, "status_text": "", "status_json": None}

    def learner(name: str, shard: int, seconds: float, wait_peers: int) -> list[str]:
        return ["join", "--initial-peers", peers, "--config", args.config, *sets, "--name", name, "--shard", str(shard),
                "--num-shards", str(args.learners), "--wait-peers", str(wait_peers), "--steps", str(NO_STEP_LIMIT),
                "--max-time", f"{seconds:.1f}",
                "--profile", str(profile), "--lr-schedule", "steps", "--linger", "20", "--events",
                str(logs / f"{name}.jsonl"), "--checkpoint-dir", str(logs / "ckpt" / name)]

    t0 = time.monotonic()
    with Swarm(logs) as swarm:
        peers = swarm.start_bootstrap("--config", args.config, *sets)
        launched = time.monotonic()
        deadline = launched + args.seconds
        children = {n: swarm.start(n, learner(n, i, args.seconds, args.learners)) for i, n in enumerate(names)}
        for c in children.values():
            c.wait_for(r"^learner ", START_TIMEOUT_S + 20 * args.learners)
        training = time.monotonic()
        print(f"bench_groups [{arm}]: {args.learners} learners training", file=sys.stderr, flush=True)
        time.sleep(max(0.0, (deadline - training) / 3))
        for name in killed:
            done = steps_of(logs / f"{name}.jsonl")
            children[name].kill()
            swarm.children.remove(children[name])  # killed on purpose: it prints no final line
            log["killed"][name] = {"step": done, "at_s": round(time.monotonic() - t0, 1)}
            print(f"bench_groups [{arm}]: killed {name} at step ~{done}", file=sys.stderr, flush=True)
        time.sleep(args.restart_after)
        for name in killed:
            left_s = deadline - time.monotonic()
            swarm.start(f"{name}r", learner(f"{name}r", names.index(name), left_s, 0))
            log["restarted"][f"{name}r"] = {"max_time_s": round(left_s, 1), "at_s": round(time.monotonic() - t0, 1)}
        time.sleep(max(0.0, training + 2 * (deadline - training) / 3 - time.monotonic()))
        log["status_text"], log["status_json"] = read_status(peers, args.config, sets)
        finals = swarm.wait_finals(FINISH_SLACK_S + args.seconds, f"bench_groups {arm}",
                                   lambda s: print(f"bench_groups [{arm}]: {s:.0f} s", file=sys.stderr, flush=True),
                                   PROGRESS_PERIOD_S)
    return {"finals": finals, "wall_s": time.monotonic() - t0, **log}


def read_status(peers: str, config: str, sets: list[str]) -> tuple[str, Any]:
    """``p2p-diloco status`` once as text and once as JSON, during the run."""
    import json

    base = [*cli_argv("status", "--initial-peers", peers, "--config", config, *sets)]
    text = subprocess.run(base, capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)
    raw = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)
    try:
        parsed = json.loads(raw.stdout.strip().splitlines()[-1]) if raw.stdout.strip() else None
    except ValueError:
        parsed = None
    return text.stdout + (f"\n(exit {text.returncode}: {text.stderr.strip()[-300:]})" if text.returncode else ""), parsed


def attempts(starts: list[tuple[float, str, str]], gap_s: float = ATTEMPT_GAP_S) -> list[set[str]]:
    """The outcomes of each attempt of one group (same fragment, same members), from its members' (start time, name,
    outcome) in any order: an attempt's members start within a matchmaking window of each other, so a gap longer
    than ``gap_s`` or a member seen twice starts the next attempt."""
    out: list[set[str]] = []
    names: set[str] = set()
    last = -math.inf
    for start, name, outcome in sorted(starts):
        if start - last > gap_s or name in names:
            out.append(set())
            names = set()
        out[-1].add(outcome)
        names.add(name)
        last = start
    return out


def analyse(swarm: dict[str, Any], logs: Path, group_size: int) -> dict[str, Any]:
    """The arm's figures from its finals, round events and final checkpoints (see the module docstring). A group
    round is half-applied when, of the members of one attempt (:func:`attempts`), some committed it and some
    discarded it."""
    from p2p_diloco.core.groups import grid_sides, swarm_distance_estimate
    from p2p_diloco.learner.checkpoint import load_checkpoint

    finals = swarm["finals"]
    evals = [f["eval_loss_end"] for f in finals.values()]
    groups: dict[tuple[Any, ...], list[tuple[float, str, str]]] = {}
    last: dict[str, list[float]] = {}
    for name in [*finals, *swarm["killed"]]:
        rows = [e for e in events_of(logs / f"{name}.jsonl") if isinstance(e, RoundEvent) and e.peers]
        for e in rows:
            groups.setdefault((e.fragment, tuple(sorted(e.peers))), []).append((e.time - e.duration_s, name, e.outcome))
        distances = [e.group_distance for e in rows if e.committed and e.group_distance is not None]
        if name in finals and distances:
            last[name] = distances
    anchors = {}
    for name in finals:
        ckpt = load_checkpoint(logs / "ckpt" / name)
        anchors[name] = {k: v.double() for k, v in ckpt.tensors.items() if k.startswith("anchor/")}
    mean = {k: sum(a[k] for a in anchors.values()) / len(anchors) for k in next(iter(anchors.values()))}
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in mean.values()))
    dist = [math.sqrt(sum(float((a[k] - mean[k]).pow(2).sum()) for k in mean)) / norm for a in anchors.values()]
    axes = len(grid_sides(len(finals), group_size)) if group_size else 1  # d rounds' in-group distances
    per_axis = [math.sqrt(statistics.mean([d[-1 - i] ** 2 for d in last.values() if len(d) > i] or [0.0]))
                for i in range(axes)]
    return {
        "learners_at_end": len(finals), "eval_loss_median": statistics.median(evals), "eval_loss_min": min(evals),
        "eval_loss_max": max(evals), "tokens": sum(f["tokens"] for f in finals.values()),
        "tokens_of_killed": sum(max((e.tokens for e in events_of(logs / f"{n}.jsonl")), default=0)
                                for n in swarm["killed"]),
        "committed": sum(sum(f["committed"]) for f in finals.values()),
        "discarded": sum(sum(f["discarded"]) for f in finals.values()),
        "group_rounds": sum(len(attempts(g)) for g in groups.values()),
        "half_applied": sum(1 for g in groups.values() for o in attempts(g) if o == {"committed", "discarded"}),
        "largest_group": max((len(k[1]) for k in groups), default=0),
        "consensus_distance_rms": math.sqrt(statistics.mean(d * d for d in dist)),
        "consensus_distance_max": max(dist), "published_estimate": swarm_distance_estimate(per_axis),
        "anchor_hashes": len({tuple(f["anchor_hashes"]) for f in finals.values()}),
    }


def markdown(payload: dict[str, Any]) -> str:
    a = payload["arms"]
    grid, one = a["grid"]["analysis"], a["one group"]["analysis"]
    lines = [f"{payload['learners']} learners ({payload['config']}, {payload['seconds']:.0f} s from start to the "
             f"deadline at >= {payload['step_s']} s a step, a round every {payload['period']} s, fp32, one fragment); "
             f"{payload['kill']} killed at a third of the run and restarted {payload['restart_after']} s later"
             + (f"; code {payload['commit']}." if payload.get("commit") else "."), "",
             "| arm | learners at the end | eval loss (median, min-max) | tokens (M) | rounds committed / discarded "
             "| largest group | group rounds half-applied | consensus distance at the end (RMS, max) | distinct anchors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in ("grid", "one group"):
        x = a[name]["analysis"]
        lines.append(f"| {name} | {x['learners_at_end']} | {x['eval_loss_median']:.4f} ({x['eval_loss_min']:.4f}-"
                     f"{x['eval_loss_max']:.4f}) | {x['tokens'] / 1e6:.2f} | {x['committed']} / {x['discarded']} | "
                     f"{x['largest_group']} | {x['half_applied']} of {x['group_rounds']} | "
                     f"{x['consensus_distance_rms']:.2e}, {x['consensus_distance_max']:.2e} | {x['anchor_hashes']} |")
    ratio = grid["eval_loss_median"] / one["eval_loss_median"] - 1
    tokens = (grid["tokens"] + grid["tokens_of_killed"]) / max(1, one["tokens"] + one["tokens_of_killed"])
    lines += ["", f"Grid groups of at most {payload['group_size']} against one group, at {tokens:.3f}x the tokens "
              f"(the killed learners' included): eval loss {100 * ratio:+.2f}% (bar: within "
              f"2%: {'met' if abs(ratio) <= 0.02 else 'not met'}). Consensus distance at the end "
              f"{grid['consensus_distance_rms']:.2e} (RMS) against the learners' published estimate "
              f"{grid['published_estimate']:.2e}: {'within' if grid['consensus_distance_rms'] <= grid['published_estimate'] else 'ABOVE'}.",
              "", "`p2p-diloco status` during the grid run:", "", "```", a["grid"]["swarm"]["status_text"].strip(), "```"]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    with _bench.figure(path, 1, (7, 4.5)) as (ax,):
        for i, name in enumerate(("grid", "one group")):
            finals = payload["arms"][name]["swarm"]["finals"]
            evals = sorted(f["eval_loss_end"] for f in finals.values())
            ax.plot([i] * len(evals), evals, "o", alpha=0.6, label=f"{name} (median "
                    f"{payload['arms'][name]['analysis']['eval_loss_median']:.3f})")
        ax.set_xticks([0, 1], ["grid", "one group"])
        ax.set_ylabel("held-out loss of each learner's anchor at the end")
        ax.set_title(f"{payload['learners']} learners, groups of at most {payload['group_size']} vs one group")
        ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="tiny.toml", quick="4 learners, G = 2, 150 steps: checks the pipeline")
    p.add_argument("--learners", type=int, default=12, help="learner processes (default: 12)")
    p.add_argument("--group-size", type=int, default=4, help="G: grid groups of at most this many (default: 4)")
    p.add_argument("--seconds", type=float, default=180.0,
                   help="every learner trains until this long after the learners were started (default: 180)")
    p.add_argument("--step-s", type=float, default=0.3, help="pacing: at least this many seconds a step (default: 0.3)")
    p.add_argument("--period", type=float, default=12.0, help="seconds between a fragment's rounds (default: 12)")
    p.add_argument("--kill", type=int, default=2, help="learners killed at a third of the run (default: 2)")
    p.add_argument("--restart-after", type=float, default=15.0, help="seconds before a killed one restarts (default: 15)")
    p.add_argument("--reanalyse", action="store_true",
                   help="recompute the analysis from --out's JSON and logs (after a change to it), then render")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    if args.reanalyse:
        payload = BENCH.load(args.out)
        for arm, x in payload["arms"].items():
            x["analysis"] = analyse(x["swarm"], args.out / "logs" / arm.replace(" ", "-"),
                                    payload["group_size"] if arm == "grid" else 0)
        _bench.publish(BENCH, args.out, payload, markdown, plot)
        return 0
    if args.quick:
        args.learners, args.group_size, args.seconds, args.period, args.kill = 4, 2, 60.0, 6.0, 1
    if args.learners < 2 * args.group_size or args.group_size < 2 or not 0 <= args.kill < args.learners:
        p.error(f"need --group-size >= 2, --learners >= 2 x group size and 0 <= --kill < --learners, got "
                f"{args.group_size}, {args.learners}, {args.kill}")
    from p2p_diloco.core.config import load_config

    for arm in ("grid", "one group"):  # a bad config fails here, before any process starts
        load_config(args.config, [*args.overrides, *common_overrides(args.seconds, args.step_s, args.period),
                                  *arm_overrides(arm, args.group_size)])
    arms = {}
    for arm in ("grid", "one group"):
        logs = args.out / "logs" / arm.replace(" ", "-")
        swarm = run_arm(arm, args, logs)
        print(f"bench_groups [{arm}]: done in {swarm['wall_s']:.0f} s", file=sys.stderr, flush=True)
        arms[arm] = {"swarm": swarm, "analysis": analyse(swarm, logs, args.group_size if arm == "grid" else 0)}
    payload = {"config": args.config, "overrides": args.overrides, "learners": args.learners,
               "group_size": args.group_size, "seconds": args.seconds, "step_s": args.step_s, "period": args.period,
               "kill": args.kill, "restart_after": args.restart_after, "quick": args.quick, "arms": arms,
               "commit": _bench.short_commit(GIT_TIMEOUT_S)}
    _bench.publish(BENCH, args.out, payload, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
