#!/usr/bin/env python3
"""Chaos against a local swarm: seeded kill -9 and SIGSTOP/SIGCONT of learners, restarts, and what it cost.

Starts a bootstrap peer and K ``p2p-diloco join`` learners (real processes on 127.0.0.1) for a fixed
training time and, on a seeded schedule (:func:`p2p_diloco.local.chaos.make_schedule`), every ~60 s either

* **kills** one learner with kill -9 of its whole process group (CLI, DHT and averager processes,
  p2pd) and starts it again after a down time, as the *same peer* (same identity and name): it resumes
  from its newest complete checkpoint (every learner checkpoints every ``--checkpoint-every`` seconds,
  default 15; 0 = restart afresh), downloads the fragments the live peers moved on and rejoins by itself; or
* **stops** one learner with SIGSTOP to its whole process group and SIGCONTs it after a while.

Every incarnation trains until the end of the window whatever the machine's speed: there is no step
cap (``--steps`` = ``launcher.NO_STEP_LIMIT``; the LR's warm-up + cosine still runs over
``inner.total_steps`` steps, then stays at its floor, so the baseline's ``--steps`` replays it). Never
more than one learner is down or stopped at a time, and nothing happens in the first ~45 s
(start-up) or the last 60 s (final rounds). Then, unless ``--no-baseline``, the same learners run again
without chaos for the same number of inner steps each (so on the same number of tokens), and the two
global models are compared.

This file parses the arguments and wires the pieces; each is a module beside it (scripts put their own
folder on ``sys.path``):

* ``p2p_diloco/local/chaos.py``: the schedule and the driver that applies it (shared with ``p2p-diloco swarm --chaos``);
* ``chaos_run.py``: the chaos run on a local swarm; ``chaos_record.py``: what it keeps of each learner incarnation;
* ``chaos_baseline.py``: the no-chaos run at equal steps;
* ``chaos_analysis.py`` and ``chaos_goodput.py``: every reported figure, with its definition (pure, unit-tested);
* ``chaos_page.py``: the page and the timeline figure.

    python scripts/chaos.py                 # 4 learners x 10 minutes on demo.toml, a kill or stop every ~60 s, then the baseline
    python scripts/chaos.py --quick         # tiny.toml, 3 learners, 90 s, every ~20 s: checks the pipeline, not the numbers
    python scripts/chaos.py --render-only   # rewrite the page (README.md) from chaos.json
    python scripts/chaos.py --reanalyse     # analyse the run in chaos.json again: rewrite it, the page and the figure

Writes ``chaos.json``, ``README.md`` (the page), ``chaos.png`` (a timeline per learner) and
``chaos_events.jsonl`` into ``--out``; logs and round events of every incarnation go to ``--out/logs``.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _bench
from chaos_analysis import analyse, steps_per_learner
from chaos_baseline import run_baseline
from chaos_page import BENCH, markdown, plot
from chaos_run import run_chaos

from p2p_diloco.local.chaos import ScheduleParams, check_schedule, make_schedule

GIT_TIMEOUT_S = 10.0
"""How long asking git which commit the run used may take (:func:`_bench.code_identity`)."""
QUICK_SCHEDULE = ScheduleParams(every_s=20.0, jitter_s=4.0, stop_s=(4.0, 8.0), down_s=(5.0, 10.0), quiet_start_s=15.0,
                                quiet_end_s=35.0, settle_s=6.0)
"""``--quick`` (90 s): a stop and a kill whose restart still gets ~15 s of training after its ~20 s start-up."""


def write(payload: dict[str, Any], out: Path) -> dict[str, Any]:
    """Analyses the run (into ``payload["analysis"]``), then writes its JSON, figure and page; returns what was
    written."""
    payload["analysis"] = analyse(payload)
    return _bench.publish(BENCH, out, payload, markdown, plot)


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml",
                      quick="tiny.toml, 3 learners, 90 s, an action every ~20 s: checks the pipeline, not the numbers")
    p.add_argument("--learners", type=int, default=4, help="learner processes (default: 4)")
    p.add_argument("--minutes", type=float, default=10.0, help="training time of the chaos run, minutes (default: 10)")
    p.add_argument("--every", dest="every_s", type=float, default=60.0, metavar="SECONDS",
                   help="mean seconds between chaos actions (default: 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the chaos schedule (default: 0)")
    p.add_argument("--checkpoint-every", dest="checkpoint_every_s", type=float, default=15.0, metavar="SECONDS",
                   help="learners checkpoint this often and a killed one resumes from its checkpoint (default: 15; "
                        "0: restarts start afresh and download everything)")
    p.add_argument("--no-baseline", action="store_true", help="skip the no-chaos run (no eval comparison)")
    p.add_argument("--reanalyse", action="store_true",
                   help="analyse the run in --out/chaos.json again, then rewrite it, the page and the figure")
    args = p.parse_args(argv)
    out = args.out
    if args.reanalyse:
        write(BENCH.load(out), out)
        return 0
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    try:
        params = ScheduleParams(every_s=args.every_s)
    except ValueError as e:  # --every at or under the jitter
        p.error(f"--every: {e}")
    if args.quick:
        args.config, args.learners, args.minutes = str(_bench.ROOT / "configs" / "tiny.toml"), 3, 1.5
        args.overrides = ["inner.total_steps=100000", *args.overrides]
        params = QUICK_SCHEDULE
    if args.learners < 2 or args.minutes <= 0:
        p.error(f"need --learners >= 2 and --minutes > 0, got {args.learners} and {args.minutes}")
    from p2p_diloco.core.config import load_config

    cfg = load_config(args.config, args.overrides)  # a bad config fails here, before any process starts
    duration_s = 60.0 * args.minutes
    names = [f"l{i}" for i in range(args.learners)]
    schedule = make_schedule(args.seed, duration_s, names, params)
    check_schedule(schedule, duration_s, params)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    print(f"chaos: {args.learners} learners x {duration_s:.0f} s on {args.config}, {len(schedule)} actions (seed "
          f"{args.seed}) -> {out}", file=sys.stderr, flush=True)
    code = _bench.code_identity(None, GIT_TIMEOUT_S)  # the code the learners run: results outlive the checkout
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        chaos = run_chaos(args.config, args.overrides, args.learners, duration_s, schedule, out, stop,
                          checkpoint_every_s=args.checkpoint_every_s)
        payload: dict[str, Any] = {
            "code": code, "config": args.config, "overrides": args.overrides, "quick": args.quick, "seed": args.seed,
            "duration_s": duration_s, "schedule_params": asdict(params), "checkpoint_every_s": args.checkpoint_every_s,
            "fragments": cfg.outer.fragments,
            "tokens_per_step": cfg.inner.batch_size * cfg.model.block_size, "chaos": chaos, "baseline": None}
        steps = steps_per_learner(chaos["incarnations"])
        print(f"chaos: chaos run done; steps per learner {steps}", file=sys.stderr, flush=True)
        if not args.no_baseline and not stop.is_set():
            most = max(steps.values()) or 1
            step_time_s = duration_s / most
            print(f"chaos: baseline without chaos, the same steps per learner (~{most * step_time_s:.0f} s)",
                  file=sys.stderr, flush=True)
            payload["baseline"] = run_baseline(args.config, args.overrides, steps, step_time_s, out / "logs" / "baseline",
                                               stop)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    write(payload, out)
    return 130 if stop.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
