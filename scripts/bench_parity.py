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

    python scripts/bench_parity.py --render-only    # rewrite the page (README.md) from parity.json

Writes ``parity.json``, ``README.md`` (the page) and ``parity.png`` into ``--out`` (default ``results/parity``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _bench

from p2p_diloco.core.config import Config, load_config

BENCH = _bench.Bench("parity", "parity", "ML parity at equal tokens (simulator, no network)", "scripts/bench_parity.py", """\
4 learners in the in-process simulator (the same fragment, codec, merge and outer code as the networked learner) on
the embedded corpus, the 0.22M-parameter byte GPT of `configs/bench.toml` (4 blocks, width 64, context 64, batch 8 x
64 bytes per learner, AdamW 3e-3 with warm-up + cosine), against data-parallel training of the same model with a 4x
batch (the same tokens) and one learner alone (the same steps). Two budgets: 600 and 1,200 inner steps per learner.

"Gap closed" is the share of the single -> data-parallel gap that a method closes (100% = data-parallel quality);
bytes are counted as the butterfly all-reduce sends them. The decoupled default is F=4 fragments, H=32, tau=1,
alpha=0.5, int4, radial-directional merge, token weighting; plain DiLoCo is F=1, no overlap, fp32, mean merge,
alpha=0; Streaming DiLoCo is F=4 with overlap, int4, mean merge.""")

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


def plot(payload: dict[str, Any], path: Path) -> None:
    results = payload["results"]
    budgets = [b for b in BUDGETS if any(r["budget"] == b for r in results)]
    with _bench.figure(path, len(budgets), (7 * len(budgets), 5)) as axes:
        for ax, budget in zip(axes, budgets):
            for r in sorted((r for r in results if r["budget"] == budget), key=lambda r: r["name"]):
                per_step = r["tokens"] / r["total_steps"]  # tokens per (nominal) inner step, all learners together
                xs = [p["tokens"] / per_step for p in r["curve"]]
                ys = [p["eval_loss"] for p in r["curve"]]
                style = "-" if r["name"] in ("data-parallel", "single") or r["headline"] else "--"
                ax.plot(xs, ys, style, label=f"{r['name']} ({r['final_eval_loss']:.3f})",
                        linewidth=2 if r["headline"] else 1)
            ax.set_title(f"{budget} budget: held-out loss of the global model")
            ax.set_xlabel("inner steps per learner (single: 1/4 of the tokens of the others)")
            ax.set_ylabel("held-out loss (nats/byte)")
            ax.set_ylim(top=3.0)
            ax.legend(fontsize=7)


def table(payload: dict[str, Any]) -> str:
    return markdown(analyse(payload["results"]))


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="bench.toml", quick="1/15 of the steps: checks the pipeline, not the numbers")
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="parallel simulations")
    p.add_argument("--decoupled-h", type=int, default=32, help="H of the decoupled default (default: 32)")
    p.add_argument("--only", action="append", default=[], help="run only methods whose name contains this (repeatable)")
    p.add_argument("--budget", choices=list(BUDGETS), help="run only this budget")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, table, plot):
        return 0

    runs = grid(args.decoupled_h)
    if args.only:
        runs = [r for r in runs if r.name in ("data-parallel", "single") or any(s in r.name for s in args.only)]
    if args.budget:
        runs = [r for r in runs if r.budget == args.budget]
    runs.sort(key=_cost, reverse=True)  # longest first balances the pool
    out = args.out
    load_config(args.config, args.overrides)  # fail fast on a bad config, before forking workers
    print(f"bench_parity: {len(runs)} runs on {args.workers} workers -> {out}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    ctx = mp.get_context("fork")
    with ctx.Pool(args.workers, maxtasksperchild=1) as pool:
        results = pool.map(_worker, [(r, args.config, args.overrides, args.quick) for r in runs], chunksize=1)
    analysis = analyse(results)
    payload = {"config": args.config, "overrides": args.overrides, "quick": args.quick,
               "wall_s": round(time.monotonic() - t0, 1), "results": results, **analysis}
    _bench.publish(BENCH, out, payload, table, plot)
    print(f"bench_parity: done in {payload['wall_s']:.0f} s; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
