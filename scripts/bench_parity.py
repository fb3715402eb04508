#!/usr/bin/env python3
"""ML-parity benchmark: DiLoCo / Streaming / decoupled variants against data-parallel, at equal tokens.

Every run uses the in-process simulator (the same fragment, codec, merge and outer code as the
networked learner) on the embedded corpus, with 4 learners, and is compared at equal tokens with
data-parallel training of the same model on a 4x batch, and with one learner alone. The headline
is the share of the gap between one learner and data-parallel that the decoupled default closes
(100% = data-parallel quality), next to the bytes it saves against fp32 data-parallel.

    python scripts/bench_parity.py                  # full grid, about 20-30 minutes on 2 cores
    python scripts/bench_parity.py --quick          # a smoke run of the whole pipeline (~1 minute)
    python scripts/bench_parity.py --only decoupled # runs whose name contains "decoupled"

Writes ``parity.json``, ``parity.md`` (the README's table) and ``parity.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.core.config import Config, load_config

BUDGETS = {"short": 600, "long": 1200}
DECOUPLED = ["outer.fragments=4", "outer.overlap=1", "outer.codec=int4", "outer.merge=radial", "outer.weighting=tokens"]
DILOCO = ["outer.fragments=1", "outer.overlap=0", "outer.codec=fp32", "outer.merge=mean", "outer.weighting=uniform",
          "outer.alpha=0.0"]
STREAMING = ["outer.fragments=4", "outer.overlap=1", "outer.codec=int4", "outer.merge=mean", "outer.weighting=uniform"]


@dataclass(frozen=True)
class Run:
    name: str
    budget: str
    mode: str  # diloco | data-parallel | single
    overrides: tuple[str, ...] = ()
    headline: bool = False

    @property
    def key(self) -> str:
        return f"{self.budget}/{self.name}"


def grid(decoupled_h: int) -> list[Run]:
    runs: list[Run] = []
    for budget in BUDGETS:
        runs += [Run("data-parallel", budget, "data-parallel"), Run("single", budget, "single")]
        runs.append(Run(f"decoupled H={decoupled_h}", budget, "diloco", (*DECOUPLED, f"outer.sync_every={decoupled_h}"),
                        headline=True))
        runs.append(Run("DiLoCo H=25 fp32", budget, "diloco", (*DILOCO, "outer.sync_every=25")))
        runs.append(Run("decoupled H=64", budget, "diloco", (*DECOUPLED, "outer.sync_every=64")))
    short = "short"
    runs += [
        Run("DiLoCo H=10 fp32", short, "diloco", (*DILOCO, "outer.sync_every=10")),
        Run("DiLoCo H=50 fp32", short, "diloco", (*DILOCO, "outer.sync_every=50")),
        Run("DiLoCo H=25 int4", short, "diloco", (*DILOCO, "outer.sync_every=25", "outer.codec=int4")),
        Run("DiLoCo H=25 radial", short, "diloco", (*DILOCO, "outer.sync_every=25", "outer.merge=radial")),
        Run("Streaming F=4 H=25 int4", short, "diloco", (*STREAMING, "outer.sync_every=25")),
        Run(f"decoupled H={decoupled_h} fp32", short, "diloco",
            (*DECOUPLED, f"outer.sync_every={decoupled_h}", "outer.codec=fp32")),
        Run(f"decoupled H={decoupled_h} hetero 1x/0.5x", short, "diloco",
            (*DECOUPLED, f"outer.sync_every={decoupled_h}", "sim.speeds=[1.0, 1.0, 0.5, 0.5]")),
        Run(f"decoupled H={decoupled_h} ramp from H=2", short, "diloco",
            (*DECOUPLED, f"outer.sync_every={decoupled_h}", "outer.sync_every_start=2", "outer.sync_ramp_steps=100")),
    ]
    return runs


def _cost(run: Run) -> float:
    steps = BUDGETS[run.budget]
    return steps * (1 if run.mode == "single" else 4)


def _config(run: Run, base: str, extra: list[str], quick: bool) -> Config:
    steps = BUDGETS[run.budget] // 15 if quick else BUDGETS[run.budget]
    overrides = [f"inner.total_steps={steps}", *(["inner.warmup_steps=5"] if quick else []), *run.overrides, *extra]
    return load_config(base, overrides)


def _worker(args: tuple[Run, str, list[str], bool]) -> dict[str, Any]:
    import torch

    from p2p_diloco.sim import simulator as sim

    torch.set_num_threads(1)
    run, base, extra, quick = args
    cfg = _config(run, base, extra, quick)
    splits = _splits(cfg)
    t0 = time.monotonic()
    result = sim.run(cfg, splits, run.mode, eval_points=8)
    out = result.summary()
    out.update(name=run.name, budget=run.budget, headline=run.headline, overrides=list(run.overrides),
               total_steps=cfg.inner.total_steps, run_s=round(time.monotonic() - t0, 1),
               weight_share_vs_token_share=_share_check(result))
    print(f"[{time.strftime('%H:%M:%S')}] {run.key:40s} eval {result.final_eval_loss:.4f}  ({out['run_s']:.0f} s)",
          file=sys.stderr, flush=True)
    return out


_SPLITS_CACHE: dict[tuple[Any, ...], Any] = {}


def _splits(cfg: Config) -> Any:
    from p2p_diloco.core import data

    key = (cfg.data, cfg.sim.learners)
    if key not in _SPLITS_CACHE:
        _SPLITS_CACHE[key] = data.split_corpus(data.load_corpus(cfg.data), cfg.sim.learners, cfg.data.eval_fraction)
    return _SPLITS_CACHE[key]


def _share_check(result: Any) -> list[list[float]] | None:
    """Mean weight share per learner next to its token share (shows weighting by progress)."""
    if not result.weight_shares:
        return None
    k = len(result.token_shares)
    mean_w = [sum(s[i] for s in result.weight_shares) / len(result.weight_shares) for i in range(k)]
    return [[round(w, 4), round(t, 4)] for w, t in zip(mean_w, result.token_shares)]


def gap_closed(loss: float, single: float, dp: float) -> float:
    """Share of the single-learner -> data-parallel gap closed (1.0 = data-parallel quality)."""
    return (single - loss) / (single - dp)


def analyse(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["budget"], r["name"]): r for r in results}
    table = []
    for r in results:
        dp = by.get((r["budget"], "data-parallel"))
        single = by.get((r["budget"], "single"))
        row = {"budget": r["budget"], "steps_per_learner": r["total_steps"], "method": r["name"],
               "eval_loss": r["final_eval_loss"], "bytes_saved_vs_dp_fp32": r["bytes_saved_vs_dp_fp32"]}
        if dp and single and r["name"] not in ("data-parallel", "single"):
            row["gap_closed"] = gap_closed(r["final_eval_loss"], single["final_eval_loss"], dp["final_eval_loss"])
            row["loss_vs_dp"] = r["final_eval_loss"] / dp["final_eval_loss"] - 1
        table.append(row)
    headline = {b: next((row for row in table if row["budget"] == b and by[(b, row["method"])]["headline"]), None)
                for b in BUDGETS}
    int4_cost = None
    a, b = by.get(("short", "DiLoCo H=25 int4")), by.get(("short", "DiLoCo H=25 fp32"))
    if a and b:
        int4_cost = a["final_eval_loss"] / b["final_eval_loss"] - 1
    return {"table": table, "headline": headline, "int4_vs_fp32_loss_cost": int4_cost}


def markdown(analysis: dict[str, Any]) -> str:
    lines = ["| budget (steps/learner) | method | eval loss (nats/byte) | gap closed | bytes saved vs fp32 DP |",
             "|---|---|---|---|---|"]
    order = {"data-parallel": 0, "single": 1}
    for row in sorted(analysis["table"], key=lambda r: (r["steps_per_learner"], order.get(r["method"], 2), r["method"])):
        gap = f"{100 * row['gap_closed']:.0f}%" if "gap_closed" in row else "—"
        saved = row["bytes_saved_vs_dp_fp32"]
        saved_s = "1× (reference)" if row["method"] == "data-parallel" else ("—" if saved is None else f"{saved:.0f}×")
        lines.append(f"| {row['budget']} ({row['steps_per_learner']}) | {row['method']} | {row['eval_loss']:.4f} | "
                     f"{gap} | {saved_s} |")
    cost = analysis["int4_vs_fp32_loss_cost"]
    if cost is not None:
        lines.append("")
        lines.append(f"int4 against fp32 at the same H (DiLoCo H=25, short budget): {100 * cost:+.2f}% eval loss.")
    for budget, row in analysis["headline"].items():
        if row and "gap_closed" in row:
            lines.append(f"Headline ({budget}, {row['steps_per_learner']} steps/learner): {row['method']} closes "
                         f"{100 * row['gap_closed']:.0f}% of the single→data-parallel gap at "
                         f"{row['bytes_saved_vs_dp_fp32']:.0f}× fewer bytes than fp32 data-parallel.")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [b for b in BUDGETS if any(r["budget"] == b for r in results)]
    fig, axes = plt.subplots(1, len(budgets), figsize=(7 * len(budgets), 5), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for r in sorted((r for r in results if r["budget"] == budget), key=lambda r: r["name"]):
            per_step = r["tokens"] / r["total_steps"]  # tokens per (nominal) inner step, all learners together
            xs = [p["tokens"] / per_step for p in r["curve"]]
            ys = [p["eval_loss"] for p in r["curve"]]
            style = "-" if r["name"] in ("data-parallel", "single") or r["headline"] else "--"
            ax.plot(xs, ys, style, label=f"{r['name']} ({r['final_eval_loss']:.3f})", linewidth=2 if r["headline"] else 1)
        ax.set_title(f"{budget} budget: held-out loss of the global model")
        ax.set_xlabel("inner steps per learner (single: 1/4 of the tokens of the others)")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_ylim(top=3.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "bench.toml"), help="base config (default: configs/bench.toml)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    p.add_argument("--out", default=str(ROOT / "results" / "parity"), help="output folder")
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="parallel simulations")
    p.add_argument("--decoupled-h", type=int, default=32, help="H of the decoupled default (default: 32)")
    p.add_argument("--only", action="append", default=[], help="run only methods whose name contains this (repeatable)")
    p.add_argument("--budget", choices=list(BUDGETS), help="run only this budget")
    p.add_argument("--quick", action="store_true", help="1/15 of the steps: checks the pipeline, not the numbers")
    p.add_argument("--replot", action="store_true", help="rewrite parity.md and parity.png from --out/parity.json")
    args = p.parse_args(argv)
    if args.replot:
        payload = json.loads((Path(args.out) / "parity.json").read_text())
        (Path(args.out) / "parity.md").write_text(markdown(analyse(payload["results"])))
        plot(payload["results"], Path(args.out) / "parity.png")
        return 0

    runs = grid(args.decoupled_h)
    if args.only:
        runs = [r for r in runs if r.name in ("data-parallel", "single") or any(s in r.name for s in args.only)]
    if args.budget:
        runs = [r for r in runs if r.budget == args.budget]
    runs.sort(key=_cost, reverse=True)  # longest first balances the pool
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_config(args.config, args.extra)  # fail fast on a bad config, before forking workers
    print(f"bench_parity: {len(runs)} runs on {args.workers} workers -> {out}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    ctx = mp.get_context("fork")
    with ctx.Pool(args.workers, maxtasksperchild=1) as pool:
        results = pool.map(_worker, [(r, args.config, args.extra, args.quick) for r in runs], chunksize=1)
    analysis = analyse(results)
    payload = {"config": args.config, "overrides": args.extra, "quick": args.quick, "wall_s": round(time.monotonic() - t0, 1),
               "results": results, **analysis}
    (out / "parity.json").write_text(json.dumps(payload, indent=2))
    (out / "parity.md").write_text(markdown(analysis))
    plot(results, out / "parity.png")
    print(markdown(analysis))
    print(f"bench_parity: done in {payload['wall_s']:.0f} s; wrote {out}/parity.json, parity.md, parity.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
