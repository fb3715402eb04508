#!/usr/bin/env python3
"""How fast a newcomer contributes: a running swarm on 127.0.0.1, then brand-new learners join it.

Starts a bootstrap peer and K learners on ``configs/demo.toml``; once they have committed rounds of
every fragment, starts a newcomer (a fresh identity, nothing on disk) and measures, from its
process start: when it had joined the DHT, when its fragments were downloaded and rebased, and
when its first round committed (its first contribution). Repeats for ``--newcomers`` newcomers,
one after the other, each stopped gracefully before the next.

    python scripts/bench_rejoin.py               # 3 learners + 3 newcomers, one at a time (~4 min)
    python scripts/bench_rejoin.py --render-only # rewrite the page (README.md) from rejoin.json

Writes ``rejoin.json`` and ``README.md`` (the page) into ``--out`` (default results/rejoin); logs in ``--out/logs``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _bench
from _swarm import events_of

from p2p_diloco.core.events import FirstContributionEvent, ResyncEvent, RoundEvent
from p2p_diloco.core.waiting import WaitTimeout, poll_until
from p2p_diloco.local.launcher import LocalSwarm

WARMUP_DEADLINE_S = 240.0
"""Start of the swarm to committed rounds of every fragment."""
NEWCOMER_DEADLINE_S = 120.0
TARGET_S = 15.0
BENCH = _bench.Bench("rejoin", "rejoin", "Newcomers: time to a first contribution", "scripts/bench_rejoin.py", """\
A bootstrap peer and a swarm of 3 learners (`--learners`) on `configs/demo.toml`, on 127.0.0.1, that is already
averaging: once it has committed rounds of every fragment, brand-new learners (a fresh identity, nothing on disk)
join it one at a time (`--newcomers`, default 3), each stopped gracefully before the next. For each newcomer,
from its process start: when it had joined the DHT, its fragment downloads (outcome and donors tried), and when its
first round committed -- its first contribution. The target: within 15 s.""")


def measure(config: str, learners: int, newcomers: int, logs: Path) -> list[dict[str, Any]]:
    with LocalSwarm(logs) as swarm:
        peers = swarm.start_bootstrap("--config", config)
        common = ["--initial-peers", peers, "--config", config, "--num-shards", str(learners + 1), "--linger", "5"]
        for i in reversed(range(learners)):  # l0 last: the one whose rounds we watch
            first_learner = swarm.start(f"l{i}", ["join", *common, "--name", f"l{i}", "--shard", str(i), "--wait-peers", str(learners),
                                  "--steps", "100000", "--max-time", "900", "--events", str(logs / f"l{i}.jsonl")])
        def every_fragment_committed() -> bool:
            done = {e.fragment for e in events_of(logs / "l0.jsonl") if isinstance(e, RoundEvent) and e.committed}
            m = first_learner.find(r"(\d+) fragments, codec")
            return m is not None and len(done) >= int(m.group(1))

        poll_until(every_fragment_committed, WARMUP_DEADLINE_S, f"a committed round of every fragment (see {logs})",
                   interval_s=1.0)
        print(f"swarm of {learners} is averaging every fragment; newcomers join one at a time", flush=True)
        results = []
        for k in range(newcomers):
            name = f"new{k}"
            events = logs / f"{name}.jsonl"
            child = swarm.start(name, ["join", *common, "--name", name, "--shard", str(learners), "--steps", "100000",
                                       "--max-time", "60", "--events", str(events)])
            t0 = child.started_at
            child.wait_for(r"^joined run ", NEWCOMER_DEADLINE_S)  # RuntimeError naming the log if it does not
            t_joined = time.monotonic() - t0
            def first_contribution(child: Any = child, name: str = name,
                                   events: Path = events) -> FirstContributionEvent | None:
                found = [e for e in events_of(events) if isinstance(e, FirstContributionEvent)]
                if not found and not child.alive:
                    raise WaitTimeout(f"{name}'s first contribution (it exited)", 0.0)
                return found[0] if found else None

            try:
                first = poll_until(first_contribution, NEWCOMER_DEADLINE_S, f"{name}'s first contribution")
            except WaitTimeout as e:  # recorded as "none" in the results: what this benchmark measures
                print(f"{name}: {e}", flush=True)
                first = None
            resyncs = [e for e in events_of(events) if isinstance(e, ResyncEvent)]
            result = {"newcomer": name, "joined_s": round(t_joined, 2),
                      "first_contribution_s": first.seconds_since_start if first else None,
                      "downloads": [{"fragment": e.fragment, "outcome": e.outcome, "donors_tried": e.donors_tried,
                                     "donor_failures": list(e.donor_failures) if e.donor_failures is not None else None,
                                     "duration_s": e.duration_s} for e in resyncs]}
            print(f"{name}: joined {t_joined:.1f} s after start, first contribution "
                  + (f"{first.seconds_since_start:.1f} s" if first else "none") + f", {len(resyncs)} downloads",
                  flush=True)
            results.append(result)
            child.stop(grace_s=60)
        return results


def markdown(summary: dict[str, Any]) -> str:
    """The newcomers' table and the median, from ``rejoin.json``."""
    results, med = summary["newcomers"], summary["median_first_contribution_s"]
    return ("| newcomer | joined the DHT | downloads (donors tried) | first contribution |\n|---|---|---|---|\n"
            + "".join(f"| {r['newcomer']} | {r['joined_s']:.1f} s | "
                      + ", ".join(f"f{d['fragment']} {d['outcome']} ({d['donors_tried']})" for d in r["downloads"])
                      + f" | {r['first_contribution_s'] if r['first_contribution_s'] is not None else '-'} s |\n"
                      for r in results)
            + "\nMedian time from process start to first committed round: "
            + (f"**{med:.1f} s**" if med is not None else "none") + f" (target <= {summary['target_s']:.0f} s), "
            f"{summary['contributed']} of {len(results)} newcomers contributed; swarm of {summary['learners']} on "
            f"{Path(summary['config']).name}.\n")


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml", overrides=False)
    p.add_argument("--learners", type=int, default=3, help="learners of the running swarm (default: 3)")
    p.add_argument("--newcomers", type=int, default=3, help="newcomers, one after the other (default: 3)")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, markdown, None):
        return 0
    results = measure(args.config, args.learners, args.newcomers, args.out / "logs")
    times = [r["first_contribution_s"] for r in results if r["first_contribution_s"] is not None]
    summary = {"config": args.config, "learners": args.learners, "newcomers": results, "target_s": TARGET_S,
               "median_first_contribution_s": statistics.median(times) if times else None,
               "contributed": len(times)}
    _bench.publish(BENCH, args.out, summary, markdown, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
