#!/usr/bin/env python3
"""The data-parallel reference for ``p2p-diloco swarm``'s report: eval loss at the same tokens.

Trains the run's model the conventional way, in one process: one replica, fp32 gradients averaged
every step over ``sim.learners`` x the per-learner batch (what data-parallel training over that
many machines computes), on all shards, with the same inner optimizer and schedule shape
(warm-up + cosine over exactly the steps that reach ``--tokens``). The held-out eval loss is
recorded at ``--eval-points`` points. ``p2p-diloco swarm`` reads the curve back for a run with the
same model, data, inner optimizer, seed and number of learners (``reference.reference_key``: the
outer algorithm does not change data-parallel training) and interpolates it at the swarm's tokens
when they lie near the curve's end (``reference.SPAN``: the curve's cosine ends there); a run whose
tokens no curve covers computes its own (``p2p-diloco swarm`` does, and caches it).

    python scripts/bench_reference.py                           # configs/demo.toml, 3.2M tokens
    python scripts/bench_reference.py --config configs/tiny.toml --tokens 200000

    python scripts/bench_reference.py --render-only             # rewrite the page (README.md): the curves there

Writes ``results/reference/dp-<reference key>-<tokens>.json`` (``--out`` to change the folder), then the folder's
page, ``README.md``: every curve in it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import _bench

DEFAULT_TOKENS = 3_200_000
"""About what the default main job's four learners process in 7 minutes on a 2-core machine."""
BENCH = _bench.Bench("reference", "reference", "Data-parallel reference curves", "scripts/bench_reference.py", """\
The reference that `p2p-diloco swarm`'s report compares a run's eval loss with, at the same tokens. The run's model is
trained the conventional way, in one process: one replica, fp32 gradients averaged every step over `sim.learners` x
the per-learner batch (what data-parallel training over that many machines computes), on all shards, with the same
inner optimizer and schedule shape (warm-up + cosine over exactly the steps that reach `--tokens`); the held-out eval
loss is recorded at `--eval-points` points. `p2p-diloco swarm` reads a curve back for a run with the same model,
data, inner optimizer, seed and number of learners (its *reference key*: the outer algorithm does not change
data-parallel training) and interpolates it at the swarm's tokens when they lie near the curve's end. At run time
it looks in the user cache (`~/.cache/p2p-diloco/reference`), then in the curves bundled with the package
(`configs/reference/`, copies of the ones here that the bundled configs need), and otherwise computes the curve and
caches it; it never reads this folder. One file per curve: `dp-<reference key>-<tokens>.json`
(`dp-<reference key>.json`: the first one committed).""", source="the curves (`dp-*.json`) in this folder")


def curves(out: Path) -> list[dict[str, Any]]:
    """Every curve in ``out``, each with its file name, by reference key and tokens."""
    found = [json.loads(path.read_text()) | {"file": path.name} for path in sorted(out.glob("dp-*.json"))]
    return sorted(found, key=lambda c: (c.get("reference_key", ""), c["tokens"]))


def markdown(payload: dict[str, Any]) -> str:
    """The folder's curves: what each was computed on and where it ended."""
    lines = ["| file | reference key | config | replicas | steps | tokens | final eval loss | wall time | command |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in payload["curves"]:
        config = c["config"] + "".join(f" `{o}`" for o in c.get("overrides", []))
        lines.append(f"| [{c['file']}]({c['file']}) | {c.get('reference_key', '—')} | {config} | {c['replicas']} | "
                     f"{c['steps']} | {c['tokens']:,} | {c['final_eval_loss']:.4f} | {c['wall_s']:.0f} s | "
                     f"`{c.get('command') or '—'}` |")
    return "\n".join(lines) + "\n"


def render(out: Path) -> None:
    """The page from the curves in ``out`` (each curve is its own JSON: there is no ``reference.json``)."""
    BENCH.write_page(out, markdown({"curves": curves(out)}))


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"training tokens (default: {DEFAULT_TOKENS:,})")
    p.add_argument("--eval-points", dest="eval_points", type=int, default=12, help="evaluations along the way (default: 12)")
    args = p.parse_args(argv)
    if args.render_only or args.replot:
        render(args.out)
        return 0
    if args.tokens <= 0 or args.eval_points <= 0:
        p.error(f"--tokens and --eval-points must be > 0, got {args.tokens} and {args.eval_points}")
    from p2p_diloco.core.config import load_config
    from p2p_diloco.sim.reference import compute_curve, save_curve, steps_for

    cfg = load_config(args.config, args.overrides)
    per_step = cfg.sim.learners * cfg.inner.batch_size * cfg.model.block_size
    steps = steps_for(cfg, args.tokens)
    print(f"reference: data-parallel over {cfg.sim.learners} x {cfg.inner.batch_size} x {cfg.model.block_size} tokens "
          f"per step, {steps} steps ({steps * per_step:,} tokens) on {args.config}", file=sys.stderr, flush=True)
    command = "python scripts/bench_reference.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = compute_curve(args.config, args.overrides, args.tokens, args.eval_points, progress=True, command=command)
    path = save_curve(_bench.relative_paths(payload), args.out)
    render(args.out)
    print(f"reference: eval loss {payload['final_eval_loss']:.4f} after {payload['tokens']:,} tokens, "
          f"{payload['wall_s']:.0f} s; wrote {path}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
