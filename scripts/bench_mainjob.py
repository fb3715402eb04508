#!/usr/bin/env python3
"""The main job's rounds: what a round of ``p2p-diloco swarm`` (no flags: 4 learners of mixed speed on
``configs/demo.toml``, 6.5 minutes or the longest stored data-parallel curve's tokens) costs in coordination, once
with groups from the clock (``averaging.matchmaking = "clock"``) and once with hivemind's matchmaking (``"dht"``),
one arm after the other on the same machine.

Per arm, from the learners' events and the swarm's report: a committed round's median time against its all-reduce's
(the coordination share is the rest; issue 48 asks for at most 30%), and the same from the group's last member's
hand-off (a member's round less its wait for the others to arrive: learners of different speeds hand off up to a
step apart, a wait their loops never see), and that share once more past the group's all-reduce -- a member's own
extended to the group's last member's end, which every member's verdicts wait for: bytes still moving, not
coordination (runs before round events carried the all-reduce's end show none); the rounds committed (every learner lives the
whole run, so every discard is a round lost with every member alive) and the commonest reasons of the others; the
realized period (the median time between two rounds of a fragment on a learner) against H x the median step; the
held-out eval loss at the end against data-parallel training at the same tokens (the stored curve the report
reads); and whether the learners ended with identical anchors.

    python scripts/bench_mainjob.py                   # both arms, the main job's own defaults
    python scripts/bench_mainjob.py --quick           # 1 minute an arm: checks the pipeline
    python scripts/bench_mainjob.py --arms clock      # groups from the clock alone (half the time)
    python scripts/bench_mainjob.py --render-only     # rewrite the page from mainjob-rounds.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import _bench
from bench_fast_steps import after_last, breakdown, fmt, measure, plot

from p2p_diloco.core.config import load_config

BENCH = _bench.Bench("mainjob-rounds", "mainjob-rounds", "The main job's rounds: coordination against bytes",
                     "scripts/bench_mainjob.py", __doc__.split("\n\n", 1)[1].split("\n    python")[0])
ARMS = ("clock", "dht")
SWARM_SLACK_S = 420.0
"""Past the training time: start-up, the wait for peers, the final rounds, the linger and the report."""
MAIN_JOB_MINUTES = 6.5
"""``p2p-diloco swarm``'s own default training time."""


def run_arm(arm: str, out: Path, minutes: float) -> Path:
    """One arm's swarm (the main job, with only the matchmaking set); returns its output folder."""
    folder = out / "logs" / arm  # the runs themselves: git-ignored, as every results/*/logs/
    cmd = [sys.executable, "-m", "p2p_diloco.cli.main", "swarm", "--set", f"averaging.matchmaking={arm}",
           "--minutes", f"{minutes:g}", "--out", str(folder), "--plain"]
    print(f"[{arm}] {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, timeout=minutes * 60 + SWARM_SLACK_S)
    return folder


def measure_main_job(arm: str, folder: Path) -> dict[str, Any]:
    """An arm's figures: the rounds' (:func:`bench_fast_steps.measure`) and the eval against data-parallel."""
    report = json.loads((folder / "summary.json").read_text())
    figures = measure(arm, folder, load_config(report["config"]).outer.sync_every)
    reference = report.get("reference") or {}
    ours, theirs = report.get("eval_loss_end"), reference.get("eval_loss")
    return {**figures, "eval_loss": ours, "dp_eval_loss": theirs,
            "eval_vs_dp": ours / theirs - 1 if ours is not None and theirs else None,
            "wall_s": report.get("wall_s"), "config": report["config"]}


def pct(v: float | None, spec: str = ".1f", sign: str = "") -> str:
    return fmt(None if v is None else 100 * v, f"{sign}{spec}") + ("" if v is None else "%")


def table(payload: dict[str, Any]) -> str:
    rows = ["| matchmaking | rounds committed | median round | all-reduce | coordination | after the last hand-off "
            "(coordination) | realized period | H x step | eval vs data-parallel | anchors identical | discards |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in payload["arms"]:
        reasons = "; ".join(f"{n}x {r}" for r, n in a["discard_reasons"].items()) or "-"
        rows.append(f"| {a['arm']} | {a['committed']} of {a['rounds']} ({pct(a['committed_share'])}) | "
                    f"{fmt(a['median_round_s'])} s | {fmt(a['median_allreduce_s'], '.3f')} s | "
                    f"{pct(a['coordination_share'], '.0f')} | {after_last(a)} | {fmt(a['realized_period_s'])} s | "
                    f"{fmt(a['h_x_step_s'])} s | {pct(a['eval_vs_dp'], '.1f', '+')} | {a['anchors_identical']} | "
                    f"{reasons} |")
    note = (f"\n`p2p-diloco swarm --set averaging.matchmaking=ARM --minutes {payload['minutes']:g}` (otherwise its "
            f"defaults), {payload['arms'][0]['learners']} learners; {_bench.code_line(payload['code'])}.")
    return "\n".join(rows) + "\n" + note + breakdown(payload["arms"])


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, quick="1 minute an arm: checks the pipeline, not the figures")
    p.add_argument("--minutes", type=float, default=MAIN_JOB_MINUTES,
                   help=f"training time of each arm (default: the main job's {MAIN_JOB_MINUTES:g})")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                   help="the arms to run, in this order (default: both, for the side-by-side comparison)")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, table, plot):
        return 0
    minutes = 1.0 if args.quick else args.minutes
    code = _bench.code_identity(None, 10.0)
    arms = [measure_main_job(arm, run_arm(arm, args.out, minutes)) for arm in args.arms]
    _bench.publish(BENCH, args.out, {"minutes": minutes, "code": code, "arms": arms}, table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
