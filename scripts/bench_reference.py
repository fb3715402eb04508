#!/usr/bin/env python3
"""The data-parallel reference for ``p2p-diloco swarm``'s report: eval loss at the same tokens.

Trains the run's model the conventional way, in one process: one replica, fp32 gradients averaged
every step over ``sim.learners`` x the per-learner batch (what data-parallel training over that
many machines computes), on all shards, with the same inner optimizer and schedule shape
(warm-up + cosine over exactly the steps that reach ``--tokens``). The held-out eval loss is
recorded at ``--eval-points`` points. ``p2p-diloco swarm`` reads the curve back for a run with the
same model, data, inner optimizer, seed and number of learners (``swarm_run.reference_key``: the
outer algorithm does not change data-parallel training) and interpolates it at the swarm's tokens.

    python scripts/bench_reference.py                           # configs/demo.toml, 3.2M tokens
    python scripts/bench_reference.py --config configs/tiny.toml --tokens 200000

Writes ``results/reference/dp-<reference key>.json`` (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_TOKENS = 3_200_000
"""About what the default main job's four learners process in 7 minutes on a 2-core machine."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"), help="run config (default: configs/demo.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"training tokens (default: {DEFAULT_TOKENS:,})")
    p.add_argument("--eval-points", dest="eval_points", type=int, default=12, help="evaluations along the way (default: 12)")
    p.add_argument("--out", default=str(ROOT / "results" / "reference"), help="output folder (default: results/reference)")
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.eval_points <= 0:
        p.error(f"--tokens and --eval-points must be > 0, got {args.tokens} and {args.eval_points}")
    from p2p_diloco import data, sim
    from p2p_diloco.config import config_hash, load_config
    from p2p_diloco.swarm_run import reference_key

    cfg = load_config(args.config, args.overrides)
    per_step = cfg.sim.learners * cfg.inner.batch_size * cfg.model.block_size
    steps = max(cfg.inner.warmup_steps + 1, math.ceil(args.tokens / per_step))
    ref_cfg = load_config(args.config, [*args.overrides, f"inner.total_steps={steps}"])
    print(f"reference: data-parallel over {cfg.sim.learners} x {cfg.inner.batch_size} x {cfg.model.block_size} tokens "
          f"per step, {steps} steps ({steps * per_step:,} tokens) on {args.config}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    corpus = data.load_corpus(cfg.data)
    splits = data.split_corpus(corpus, cfg.sim.learners, cfg.data.eval_fraction)
    result = sim.run_reference(ref_cfg, splits, "data-parallel", eval_points=args.eval_points, progress=True)
    payload = {
        "config": args.config, "overrides": args.overrides, "config_hash": config_hash(cfg),
        "reference_key": reference_key(cfg), "mode": "data-parallel",
        "replicas": cfg.sim.learners, "steps": steps, "tokens": result.tokens, "final_eval_loss": result.final_eval_loss,
        "curve": result.curve, "wall_s": round(time.monotonic() - t0, 1),
        "command": "python scripts/bench_reference.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"dp-{payload['reference_key']}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"reference: eval loss {result.final_eval_loss:.4f} after {result.tokens:,} tokens, {payload['wall_s']:.0f} s; "
          f"wrote {path}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
