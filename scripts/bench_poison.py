#!/usr/bin/env python3
"""Poisoning benchmark: one of 4 learners sends 1000x pseudo-gradients every round.

Every run is the simulator users run (``p2p-diloco sim``: 4 real DiLoCo engines on the in-process network, the
same fragment, codec, merge, robust-merge and outer code as the networked learner) on configs/bench.toml with 4 learners and the same number of steps. One
learner (``--attacker``) poisons every contribution it sends, on every surface a peer controls (its
streamed tensors and the radial norms in its metadata; see :class:`p2p_diloco.sim.simulator.Attack`):

* ``sign-flip``: ``-1000`` x its encoded tensors, ``1000`` x its norms;
* ``random``: a random tensor of ``1000`` x the norm of each, ``1000`` x its norms.

Each attack runs with the robust merge off (``outer.robust = "none"``: the damage) and on
(``--robust``, default ``"trim"``), next to the clean run with each setting (the cost of the robust
merge without an attacker). The verdict: with the robust merge, the final eval loss is within 3% of the clean run.

    python scripts/bench_poison.py               # 6 runs of 300 steps: 15 minutes on 2 busy cores (load 5-14)
    python scripts/bench_poison.py --quick       # a smoke run of the whole pipeline (~1 minute)

    python scripts/bench_poison.py --render-only # rewrite the page (README.md) from poison.json

Writes ``poison.json``, ``README.md`` (the page) and ``poison.png`` into ``--out`` (default ``results/poison``).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _bench

from p2p_diloco.core.config import Config, load_config

BENCH = _bench.Bench("poison", "poison", "Poisoned contributions", "scripts/bench_poison.py", """\
`p2p-diloco sim`'s engines (4 real DiLoCo engines on the in-process network: the networked learner's fragment, codec,
merge, robust-merge and outer code) on
`configs/bench.toml`, 4 learners x 300 inner steps each (`--steps`). One learner (`--attacker`, default 3) poisons
every contribution it sends, on every surface a peer controls -- its streamed tensors and the radial norms in its
metadata; its claimed progress is honest:

- *sign-flip*: -1000 x its encoded tensors, 1000 x its norms;
- *random*: a random tensor of 1000 x the norm of each, 1000 x its norms.

Each attack runs with the robust merge off (`outer.robust = "none"`: the damage) and on (`--robust`, default
`"trim"`), next to the clean run with each setting (the cost of the robust merge without an attacker). Same seed and
steps in every run. The bar: with the robust merge, the final eval loss is within 3% of the clean run's.""")

TOLERANCE = 0.03
"""Acceptance: a robust run's final eval loss may exceed the clean run's by at most this share."""


@dataclass(frozen=True)
class Run:
    name: str
    robust: str  # outer.robust
    attack: str = ""  # "" (clean), sign-flip or random

    @property
    def clean(self) -> bool:
        return not self.attack


def runs(robust: str) -> list[Run]:
    return [
        Run("clean", "none"),
        Run("clean, robust merge", robust),
        Run("sign-flip x1000, no defence", "none", "sign-flip"),
        Run("sign-flip x1000, robust merge", robust, "sign-flip"),
        Run("random x1000, no defence", "none", "random"),
        Run("random x1000, robust merge", robust, "random"),
    ]


def _config(run: Run, args: argparse.Namespace) -> Config:
    steps = max(30, args.steps // 10) if args.quick else args.steps
    overrides = [f"inner.total_steps={steps}", f"outer.robust={run.robust}", f"outer.clip_factor={args.clip_factor}",
                 *(["inner.warmup_steps=5"] if args.quick else []), *args.overrides]
    return load_config(args.config, overrides)


def _worker(job: tuple[Run, argparse.Namespace]) -> dict[str, Any]:
    import torch

    from p2p_diloco.core import data
    from p2p_diloco.sim import engines
    from p2p_diloco.sim import simulator as sim

    torch.set_num_threads(1)
    run, args = job
    cfg = _config(run, args)
    splits = data.split_corpus(data.load_corpus(cfg.data), cfg.sim.learners, cfg.data.eval_fraction)
    attack = sim.Attack(args.attacker, run.attack, args.scale) if run.attack else None
    t0 = time.monotonic()
    result = engines.run(cfg, splits, eval_points=args.eval_points, attack=attack)
    out = result.summary()
    out.update(name=run.name, robust=run.robust, attack=run.attack or None, scale=args.scale if run.attack else None,
               attacker=args.attacker if run.attack else None, total_steps=cfg.inner.total_steps,
               clip_factor=cfg.outer.clip_factor, run_s=round(time.monotonic() - t0, 1))
    print(f"[{time.strftime('%H:%M:%S')}] {run.name:32s} eval {result.final_eval_loss:.4f}  ({out['run_s']:.0f} s)",
          file=sys.stderr, flush=True)
    return _json_safe(out)


def _json_safe(value: Any) -> Any:
    """NaN/inf (a model destroyed by an attack) become None: the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def analyse(results: list[dict[str, Any]]) -> dict[str, Any]:
    clean = next(r for r in results if r["name"] == "clean")["final_eval_loss"]
    table = []
    for r in results:
        loss = r["final_eval_loss"]
        ratio = None if loss is None else loss / clean - 1
        row = {"run": r["name"], "attack": r["attack"], "robust": r["robust"], "eval_loss": loss, "vs_clean": ratio,
               "local_drops": r["local_drops"], "discarded_rounds": r["discarded_rounds"], "rounds": r["rounds"]}
        if r["robust"] != "none":
            row["within_tolerance"] = ratio is not None and ratio <= TOLERANCE
        table.append(row)
    robust_rows = [row for row in table if row["robust"] != "none" and row["attack"]]
    return {"table": table, "clean_eval_loss": clean,
            "robust_cost_clean": next((row["vs_clean"] for row in table if row["robust"] != "none" and not row["attack"]),
                                      None),
            "accepted": all(row["within_tolerance"] for row in robust_rows) if robust_rows else None}


def _loss_text(loss: float | None) -> str:
    if loss is None:
        return "not finite"
    return f"{loss:.2e}" if loss >= 100 else f"{loss:.4f}"


def _ratio_text(row: dict[str, Any], clean: float) -> str:
    if row["run"] == "clean":
        return "reference"
    if row["eval_loss"] is None:
        return "diverged"
    if row["vs_clean"] > 10:
        return f"x{row['eval_loss'] / clean:.1e}"
    return f"{100 * row['vs_clean']:+.2f}%"


def markdown(analysis: dict[str, Any], steps: int) -> str:
    lines = [f"| run ({steps} steps/learner, 4 learners) | robust merge | eval loss (nats/byte) | vs clean | "
             "rounds applied | own pseudo-gradients dropped |",
             "|---|---|---|---|---|---|"]
    clean = analysis["clean_eval_loss"]
    for row in analysis["table"]:
        robust = "off" if row["robust"] == "none" else f"on ({row['robust']})"
        lines.append(f"| {row['run']} | {robust} | {_loss_text(row['eval_loss'])} | {_ratio_text(row, clean)} | "
                     f"{row['rounds'] - row['discarded_rounds']} | {row['local_drops']} |")
    lines.append("")
    cost = analysis["robust_cost_clean"]
    if cost is not None:
        lines.append(f"Cost of the robust merge without an attacker: {100 * cost:+.2f}% eval loss.")
    if analysis["accepted"] is not None:
        verdict = "within" if analysis["accepted"] else "NOT within"
        lines.append(f"With the robust merge, every attacked run is {verdict} {100 * TOLERANCE:.0f}% of the clean run.")
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    """Left: every run on a log scale (the undefended runs leave the chart); right: a close-up."""
    results = payload["results"]
    clean = next(r for r in results if r["name"] == "clean")
    colors = {None: "black", "sign-flip": "tab:red", "random": "tab:blue"}
    with _bench.figure(path, 2, (14, 5)) as axes:
        for ax, log_scale in zip(axes, (True, False)):
            for r in results:
                per_step = r["tokens"] / r["total_steps"]
                points = [(p["tokens"] / per_step, p["eval_loss"]) for p in r["curve"] if p["eval_loss"] is not None]
                ax.plot([x for x, _ in points], [y for _, y in points], "--" if r["robust"] == "none" else "-",
                        color=colors[r["attack"]], label=f"{r['name']} ({_loss_text(r['final_eval_loss'])})",
                        linewidth=1 if r["robust"] == "none" else 2)
            ax.set_xlabel("inner steps per learner")
            ax.set_ylabel("held-out loss of the global model (nats/byte)")
            if log_scale:
                ax.set_yscale("log")
                ax.set_title("1 of 4 learners sends 1000x pseudo-gradients every round")
                ax.legend(fontsize=8)
            else:
                losses = [p["eval_loss"] for p in clean["curve"]]
                ax.set_ylim(bottom=min(losses) * 0.97, top=min(losses) * 1.5)
                ax.set_title("close-up: the robust merge against the clean run")


def table(payload: dict[str, Any]) -> str:
    return markdown(analyse(payload["results"]), payload["steps"])


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="bench.toml", quick="1/10 of the steps: checks the pipeline, not the numbers")
    p.add_argument("--steps", type=int, default=300, help="inner steps per learner (default: 300)")
    p.add_argument("--attacker", type=int, default=3, help="index of the poisoning learner (default: 3)")
    p.add_argument("--scale", type=float, default=1000.0, help="attack magnitude (default: 1000)")
    p.add_argument("--robust", choices=["clip", "trim"], default="trim", help="outer.robust of the defended runs "
                   "(default: trim)")
    p.add_argument("--clip-factor", type=float, default=2.0, help="outer.clip_factor of the robust runs (default: 2)")
    p.add_argument("--eval-points", type=int, default=8, help="evaluations per run (default: 8)")
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="parallel simulations")
    args = p.parse_args(argv)
    out = args.out
    if _bench.rerender(args, BENCH, table, plot):
        return 0
    if args.steps < 1 or args.scale <= 0 or args.workers < 1:
        p.error("--steps, --scale and --workers must be positive")
    plan = runs(args.robust)
    cfg = _config(plan[0], args)  # fail fast on a bad config, before forking workers
    if not 0 <= args.attacker < cfg.sim.learners:
        p.error(f"--attacker must be in 0..{cfg.sim.learners - 1}")
    print(f"bench_poison: {len(plan)} runs of {cfg.inner.total_steps} steps/learner on {args.workers} workers -> {out}",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with mp.get_context("fork").Pool(args.workers, maxtasksperchild=1) as pool:
        results = pool.map(_worker, [(r, args) for r in plan], chunksize=1)
    analysis = analyse(results)
    payload = {"config": args.config, "overrides": args.overrides, "quick": args.quick, "steps": cfg.inner.total_steps,
               "attacker": args.attacker, "scale": args.scale, "robust": args.robust, "clip_factor": args.clip_factor,
               "tolerance": TOLERANCE, "wall_s": round(time.monotonic() - t0, 1), "results": results, **analysis}
    _bench.publish(BENCH, out, payload, table, plot)
    print(f"bench_poison: done in {payload['wall_s']:.0f} s; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
