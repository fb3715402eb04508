"""Goodput calibration from the real system's results."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from p2p_diloco.core.events import RoundEvent, read_events
from p2p_diloco.sim.goodput import Calibration, GoodputError, require


def calibration_from_results(results: Path, config: Path) -> tuple[Calibration, dict[str, Any]]:
    """The real system's times, from the benchmark results on this machine; also where each came from.

    * ``step_s``: median train_s / steps of the learners in ``learners/learners.json`` (4 learners
      sharing 2 cores); ``round_period_s``: their published ``sync_period_s`` (H x median step time);
      ``fragments``: F of ``config``.
    * ``round_s``: median ``duration_s`` of committed rounds in ``learners/logs/*.jsonl`` when those
      logs are there, else 2 x the median final matchmaking window (``window_s``) of learners.json.
    * ``startup_s``: median start-up (spawn to up) of the restarted incarnations in ``chaos/chaos.json``.
    * ``state_download_s``: median over ``rejoin/rejoin.json``'s newcomers of the summed durations
      of their fragment downloads.
    * ``detect_s``: ``averaging.next_chunk_timeout_s`` of ``config`` (a silent member is dropped).
    * ``reconfigure_s``: ``round_s`` (re-forming a group is one matchmaking + all-reduce).
    * ``blocked_share``: median ``blocked_share`` of the learners in learners.json.
    """
    from p2p_diloco.core.config import load_config

    paths = {"learners": results / "learners" / "learners.json", "chaos": results / "chaos" / "chaos.json",
             "rejoin": results / "rejoin" / "rejoin.json"}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    require(not missing, "calibration", f"missing result files {missing}: run scripts/bench_learners.py, "
             "scripts/chaos.py and scripts/bench_rejoin.py first")
    learners = json.loads(paths["learners"].read_text())
    chaos = json.loads(paths["chaos"].read_text())
    rejoin = json.loads(paths["rejoin"].read_text())
    cfg = load_config(config)
    try:
        finals = list(learners["swarm"]["finals"].values())
        step_s = statistics.median(f["train_s"] / f["steps"] for f in finals)
        period_s = statistics.median(f["sync_period_s"] for f in finals)
        blocked = statistics.median(f["blocked_share"] for f in finals)
        window_s = statistics.median(f["window_s"] for f in finals)
        startups = [e["startup_s"] for e in chaos["chaos"]["events"] if e["event"] == "up"]
        downloads = [sum(d["duration_s"] for d in n["downloads"]) for n in rejoin["newcomers"]]
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise GoodputError(f"calibration: unexpected result file layout ({type(e).__name__}: {e})") from e
    require(bool(startups), "calibration", f"{paths['chaos']} has no restart ('up' event)")
    require(bool(downloads), "calibration", f"{paths['rejoin']} has no newcomer downloads")
    durations = [e.duration_s for log in sorted((results / "learners" / "logs").glob("*.jsonl"))
                 for e in read_events(log)
                 if isinstance(e, RoundEvent) and e.committed and math.isfinite(e.duration_s)]
    round_s = statistics.median(durations) if durations else 2 * window_s
    cal = Calibration(step_s=step_s, round_period_s=period_s, fragments=cfg.outer.fragments, round_s=round_s,
                      startup_s=statistics.median(startups), state_download_s=statistics.median(downloads),
                      detect_s=cfg.averaging.next_chunk_timeout_s, reconfigure_s=round_s, blocked_share=blocked)
    sources = {
        "step_s": f"median train_s/steps of {len(finals)} learners, {paths['learners']}",
        "round_period_s": f"median sync_period_s, {paths['learners']} (H={cfg.outer.sync_every} x step)",
        "fragments": f"outer.fragments of {config}",
        "round_s": (f"median duration_s of {len(durations)} committed rounds, {results / 'learners' / 'logs'}"
                    if durations else f"2 x median window_s {window_s:.2f} s, {paths['learners']} (no round logs)"),
        "startup_s": f"median of {len(startups)} restarts (spawn to up) {sorted(startups)}, {paths['chaos']}",
        "state_download_s": f"median over {len(downloads)} newcomers of summed fragment downloads "
                            f"{[round(x, 2) for x in downloads]}, {paths['rejoin']}",
        "detect_s": f"averaging.next_chunk_timeout_s of {config}",
        "reconfigure_s": "= round_s (one matchmaking + all-reduce)",
        "blocked_share": f"median blocked_share of the learners, {paths['learners']}",
    }
    return cal, sources
