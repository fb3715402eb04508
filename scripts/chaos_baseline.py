"""``scripts/chaos.py``'s baseline: the same learners and shards without chaos, for the chaos run's steps each.

Each learner runs ``--steps`` = the inner steps of all its chaos incarnations (``chaos_analysis.steps_per_learner``),
so the two runs train on the same number of tokens and their global models compare at equal tokens.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from chaos_record import compact_rounds, max_step
from chaos_run import FINISH_SLACK_S, LINGER_S, PROGRESS_PERIOD_S, WAIT_PEERS_TIMEOUT_S

from p2p_diloco.local.launcher import START_TIMEOUT_S, LocalSwarm, read_jsonl


def run_baseline(config: str, overrides: list[str], steps: dict[str, int], step_time_s: float, logs: Path,
                 stop: threading.Event) -> dict[str, Any]:
    """The same learners and shards without chaos, each for its ``steps`` (the chaos run's), started together.
    Early finishers linger until the last one is done, so the anchors agree at the end."""
    sets = [a for o in overrides for a in ("--set", o)]
    names = sorted(steps, key=lambda n: int(n[1:]))  # l0, l1, ...: the shard is the number
    spread_s = (max(steps.values()) - min(steps.values())) * step_time_s
    linger_s = LINGER_S + 1.5 * spread_s
    longest_s = max(steps.values()) * step_time_s
    with LocalSwarm(logs, grace_s=LINGER_S + 60) as swarm:
        peers = swarm.start_bootstrap("--config", config, *sets)
        for name in names:
            swarm.start(name, [
                "join", "--initial-peers", peers, "--config", config, *sets, "--name", name, "--shard", name[1:],
                "--num-shards", str(len(names)), "--wait-peers", str(len(names)), "--steps", str(max(1, steps[name])),
                "--linger", f"{linger_s:.0f}", "--events", str(logs / f"{name}.jsonl")])
        t0 = time.monotonic()
        limit_s = START_TIMEOUT_S + WAIT_PEERS_TIMEOUT_S + 2 * longest_s + linger_s + FINISH_SLACK_S
        next_report = t0 + PROGRESS_PERIOD_S
        error = None
        while True:
            pending = [c for c in swarm.learners() if c.final() is None]
            if not pending:
                break
            dead = [c for c in pending if not c.alive]
            if dead:
                error = f"{dead[0].name} exited without a final summary (code {dead[0].popen.poll()}); see {dead[0].log_path}"
            elif time.monotonic() - t0 > limit_s:
                error = f"the baseline overran its deadline of {limit_s:.0f} s; see {logs}"
            elif stop.is_set():
                error = "interrupted"
            if error:
                print(f"chaos: baseline: {error}", file=sys.stderr, flush=True)
                break
            if time.monotonic() >= next_report:
                next_report += PROGRESS_PERIOD_S
                progress = []
                for name in names:
                    events = read_jsonl(logs / f"{name}.jsonl")
                    progress.append(f"{name} step {max_step(events)}/{steps[name]}")
                print(f"chaos: baseline [{time.monotonic() - t0:5.0f} s] " + "; ".join(progress), file=sys.stderr,
                      flush=True)
            time.sleep(1.0)
        swarm.close()
        finals = {c.name: f for c in swarm.learners() if (f := c.final()) is not None}
        final_s = {c.name: round(c.final_at - t0, 2) for c in swarm.learners() if c.final_at is not None}
        rounds = [r for name in names for r in compact_rounds(read_jsonl(logs / f"{name}.jsonl"), 0.0)]
        return {"finals": finals, "final_s": final_s, "steps": steps, "linger_s": linger_s, "rounds": rounds,
                "error": error, "wall_s": time.monotonic() - t0}

