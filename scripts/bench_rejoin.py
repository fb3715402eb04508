#!/usr/bin/env python3
"""How fast a newcomer contributes: a running swarm on 127.0.0.1, then brand-new learners join it.

Starts a bootstrap peer and K learners on ``configs/demo.toml``; once they have committed rounds of
every fragment, starts a newcomer (a fresh identity, nothing on disk) and measures, from its
process start: when it had joined the DHT, when its fragments were downloaded and rebased, and
when its first round committed (its first contribution). Repeats for ``--newcomers`` newcomers,
one after the other, each stopped gracefully before the next.

    python scripts/bench_rejoin.py               # 3 learners + 3 newcomers, one at a time (~4 min)

Writes ``rejoin.json`` and ``rejoin.md`` into ``--out`` (default results/rejoin); logs in ``--out/logs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.local.launcher import LocalSwarm, read_jsonl

WARMUP_DEADLINE_S = 240.0
"""Start of the swarm to committed rounds of every fragment."""
NEWCOMER_DEADLINE_S = 120.0
TARGET_S = 15.0


def measure(config: str, learners: int, newcomers: int, logs: Path) -> list[dict[str, Any]]:
    with LocalSwarm(logs) as swarm:
        peers = swarm.start_bootstrap("--config", config)
        common = ["--initial-peers", peers, "--config", config, "--num-shards", str(learners + 1), "--linger", "5"]
        for i in reversed(range(learners)):  # l0 last: the one whose rounds we watch
            first_learner = swarm.start(f"l{i}", ["join", *common, "--name", f"l{i}", "--shard", str(i), "--wait-peers", str(learners),
                                  "--steps", "100000", "--max-time", "900", "--events", str(logs / f"l{i}.jsonl")])
        deadline = time.monotonic() + WARMUP_DEADLINE_S
        fragments = None
        while time.monotonic() < deadline:
            done = {e["fragment"] for e in read_jsonl(logs / "l0.jsonl")
                    if e["event"] == "round" and e["outcome"] == "committed"}
            m = first_learner.find(r"(\d+) fragments, codec")
            fragments = fragments or (int(m.group(1)) if m else None)
            if fragments and len(done) >= fragments:
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"the swarm committed no round of every fragment within {WARMUP_DEADLINE_S:.0f} s; "
                               f"see {logs}")
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
            first = None
            deadline = time.monotonic() + NEWCOMER_DEADLINE_S
            while time.monotonic() < deadline and child.alive:
                found = [e for e in read_jsonl(events) if e["event"] == "first_contribution"]
                if found:
                    first = found[0]
                    break
                time.sleep(0.2)
            resyncs = [e for e in read_jsonl(events) if e["event"] == "resync"]
            result = {"newcomer": name, "joined_s": round(t_joined, 2),
                      "first_contribution_s": first["seconds_since_start"] if first else None,
                      "downloads": [{k2: e.get(k2) for k2 in ("fragment", "outcome", "donors_tried", "donor_failures",
                                                             "duration_s")} for e in resyncs]}
            print(f"{name}: joined {t_joined:.1f} s after start, first contribution "
                  + (f"{first['seconds_since_start']:.1f} s" if first else "none") + f", {len(resyncs)} downloads",
                  flush=True)
            results.append(result)
            child.stop(grace_s=60)
        return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    p.add_argument("--learners", type=int, default=3)
    p.add_argument("--newcomers", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "results" / "rejoin"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = measure(args.config, args.learners, args.newcomers, out / "logs")
    times = [r["first_contribution_s"] for r in results if r["first_contribution_s"] is not None]
    summary = {"config": args.config, "learners": args.learners, "newcomers": results, "target_s": TARGET_S,
               "median_first_contribution_s": statistics.median(times) if times else None,
               "contributed": len(times)}
    (out / "rejoin.json").write_text(json.dumps(summary, indent=2))
    med = summary["median_first_contribution_s"]
    table = ("| newcomer | joined the DHT | downloads (donors tried) | first contribution |\n|---|---|---|---|\n"
             + "".join(f"| {r['newcomer']} | {r['joined_s']:.1f} s | "
                       + ", ".join(f"f{d['fragment']} {d['outcome']} ({d['donors_tried']})" for d in r["downloads"])
                       + f" | {r['first_contribution_s'] if r['first_contribution_s'] is not None else '-'} s |\n"
                       for r in results)
             + "\nMedian time from process start to first committed round: "
             + (f"**{med:.1f} s**" if med is not None else "none") + f" (target <= {TARGET_S:.0f} s), "
             f"{len(times)} of {len(results)} newcomers contributed; swarm of {args.learners} on {Path(args.config).name}.\n")
    (out / "rejoin.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
