#!/usr/bin/env python3
"""Fast steps: does a fragment sync every H steps when steps are short? Four learners on 127.0.0.1 with steps of
about 0.1 s and H = 20 (a fragment due every 2 s of compute), on the derived sync clock, once with groups from the
clock (``averaging.matchmaking = "clock"``: the group is known, its members fetch each other's offers and send their
verdicts to each other, no DHT search or window) and once with hivemind's matchmaking (``"dht"``, the default), one
arm after the other, the same config, pacing and time.

Per arm, from the learners' events: the realized period (the median time between two rounds of a fragment on a
learner) against H x the median step (each learner's training time over its inner steps); the rounds committed
(every learner lives the whole run, so every discard is a round lost with every member alive) and the commonest
reasons of the others; a committed round's median time against its all-reduce's and its fastest verdict round trip
(issue 48 asks for at most 2 x (all-reduce + 2 round trips)), and its time from the group's last member's hand-off
(less the wait for the others to arrive); and whether the learners ended with identical anchors.
The swarm is ``p2p-diloco swarm`` on ``configs/tiny.toml`` (a model whose step is far shorter than the pacing), no
data-parallel reference.

    python scripts/bench_fast_steps.py                   # 4 learners, 2 minutes an arm
    python scripts/bench_fast_steps.py --quick           # 30 s an arm: checks the pipeline
    python scripts/bench_fast_steps.py --render-only     # rewrite the page from fast-steps.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import _bench
from _swarm import events_of

from p2p_diloco.core.events import ClockEvent, RoundEvent

BENCH = _bench.Bench("fast-steps", "fast-steps", "Fast steps: the sync period against H x the step",
                     "scripts/bench_fast_steps.py", __doc__.split("\n\n", 1)[1].split("\n    python")[0])
ARMS = ("clock", "dht")
STEP_S = 0.1
"""Each learner's pacing: seconds per inner step (the tiny model computes one in a few milliseconds)."""
SYNC_EVERY = 20
PEERS = 4
SWARM_SLACK_S = 300.0
"""Past the training time: start-up, the wait for peers, the final rounds, the linger and the report."""
REASON_CHARS = 70


def run_arm(arm: str, out: Path, seconds: float) -> Path:
    """One arm's swarm; returns its output folder."""
    folder = out / "logs" / arm  # the runs themselves: git-ignored, as every results/*/logs/
    profile = out / "logs" / "paced.toml"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(f'name = "paced"\nslowdown = 1.0\nmin_step_s = {STEP_S}\nthreads = 1\n')
    cmd = [sys.executable, "-m", "p2p_diloco.cli.main", "swarm", "--peers", str(PEERS), "--config", "tiny",
           "--set", "averaging.schedule=clock", "--set", "averaging.sync_period_s=0",
           "--set", f"outer.sync_every={SYNC_EVERY}", "--set", f"averaging.matchmaking={arm}",
           "--set", "inner.total_steps=1000000", "--profiles", str(profile), "--minutes", f"{seconds / 60:g}",
           "--max-tokens", "0", "--no-reference", "--out", str(folder), "--plain"]
    print(f"[{arm}] {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, timeout=seconds + SWARM_SLACK_S)
    return folder


def median(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and v == v and abs(v) != float("inf")]
    return statistics.median(finite) if finite else None


def measure(arm: str, folder: Path, sync_every: int = SYNC_EVERY) -> dict[str, Any]:
    """An arm's figures, from its learners' events and the swarm's summary (``sync_every``: the run's H)."""
    report = json.loads((folder / "summary.json").read_text())
    logs = {p.stem: events_of(p) for p in sorted((folder / "logs").glob("*.jsonl"))}
    rounds = {n: [e for e in log if isinstance(e, RoundEvent)] for n, log in logs.items()}
    every = [e for r in rounds.values() for e in r]
    committed = [e for e in every if e.committed]
    intervals = []
    for r in rounds.values():
        for f in {e.fragment for e in r}:
            times = sorted(e.time for e in r if e.fragment == f)
            intervals += [b - a for a, b in zip(times, times[1:])]
    learners = report.get("learners", {}).values()
    step_s = median([f["train_s"] / f["steps"] for f in learners if f.get("steps")])  # the paced step, measured
    periods = [e.period_s for log in logs.values() for e in log if isinstance(e, ClockEvent)]
    duration, allreduce, rtt = (median([getattr(e, k) for e in committed]) for k in ("duration_s", "allreduce_s",
                                                                                       "rtt_s"))
    # the round once its last member handed off: a member's duration less its wait for the others to arrive
    after_last = median([e.duration_s - e.waited_s for e in committed if e.waited_s is not None])
    group_allreduce = median(group_allreduce_s(committed))
    reasons = Counter(_bench.normalise_reason(e.reason, REASON_CHARS) for e in every if not e.committed)
    bound = 2 * (allreduce + 2 * rtt) if allreduce is not None and rtt is not None else None
    return {
        "arm": arm, "learners": len(logs), "rounds": len(every), "committed": len(committed),
        "committed_share": len(committed) / len(every) if every else None,
        "discard_reasons": dict(reasons.most_common(3)),
        "median_step_s": step_s, "h_x_step_s": sync_every * step_s if step_s else None,
        "realized_period_s": median(intervals), "published_period_s": periods[-1] if periods else None,
        "period_ratio": (median(intervals) or 0) / (sync_every * step_s) if step_s else None,
        "median_round_s": duration, "median_allreduce_s": allreduce, "median_rtt_s": rtt, "round_bound_s": bound,
        "median_part_bytes": median([e.part_bytes for e in committed if e.part_bytes]),
        "coordination_share": 1 - allreduce / duration if duration and allreduce is not None else None,
        "median_waited_s": median([e.waited_s for e in committed if e.waited_s is not None]),
        "median_after_last_s": after_last,
        "coordination_after_last": 1 - allreduce / after_last if after_last and allreduce is not None else None,
        "median_group_allreduce_s": group_allreduce,
        "coordination_after_last_group": (1 - group_allreduce / after_last if after_last and group_allreduce is not None
                                          else None),
        "median_setup_s": median([e.setup_s for e in committed if e.setup_s is not None]),
        "median_verdicts_s": median([e.verdicts_s for e in committed if e.verdicts_s is not None]),
        # meeting once the last member is in: our step's meeting less its wait for the others to arrive
        "median_meet_s": median([max(0.0, e.meet_s - (e.waited_s or 0.0)) for e in committed if e.meet_s is not None]),
        "median_handback_s": median([e.handback_s for e in committed if e.handback_s is not None]),
        "anchors_identical": report.get("anchors_identical"),
        "tokens": report.get("tokens"),
    }


def group_allreduce_s(committed: list[Any]) -> list[float]:
    """Each committed round's all-reduce as its group ran it: a member's own, extended to the group's last member's
    end (the members' verdicts wait for that one; members of one round found by fragment, version and members)."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for e in committed:
        if e.allreduce_end is not None and e.allreduce_s is not None:
            groups.setdefault((e.fragment, e.version, tuple(sorted(e.peers))), []).append(e)
    out = []
    for members in groups.values():
        last = max(e.allreduce_end for e in members)
        out += [e.allreduce_s + last - e.allreduce_end for e in members]
    return out


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def after_last(arm: dict[str, Any]) -> str:
    """A committed round's median time from its last member's hand-off, and the coordination share of it."""
    share, group = arm.get("coordination_after_last"), arm.get("coordination_after_last_group")
    if arm.get("median_after_last_s") is None:
        return "-"
    past_group = "" if group is None else f"; {100 * group:.0f}% past the group's all-reduce"
    return f"{fmt(arm['median_after_last_s'])} s ({fmt(None if share is None else 100 * share, '.0f')}%{past_group})"


def breakdown(payloads: list[dict[str, Any]]) -> str:
    """A line per arm that measured them: a committed round from its last hand-off, by part (medians)."""
    lines = []
    for a in payloads:
        if a.get("median_setup_s") is None or a.get("median_after_last_s") is None:
            continue
        parts = ("median_setup_s", "median_meet_s", "median_allreduce_s", "median_handback_s", "median_verdicts_s")
        known = sum(a.get(k) or 0 for k in parts)
        measured = a.get("median_meet_s") is not None  # runs before the meeting and the hand-back were timed
        lines.append(f"- {a['arm']}: of {fmt(a['median_after_last_s'], '.3f')} s from the last hand-off, setup "
                     f"{fmt(a['median_setup_s'], '.3f')} s (timeouts, group, tensors into the averager), "
                     + (f"meeting {fmt(a['median_meet_s'], '.3f')} s (offers and the leader's decision, or "
                        "matchmaking, once the last member is in), " if measured else "")
                     + f"all-reduce {fmt(a['median_allreduce_s'], '.3f')} s, "
                     + (f"hand-back {fmt(a.get('median_handback_s'), '.3f')} s (the result back to the learner, its "
                        "checks), " if measured else "")
                     + f"verdicts {fmt(a.get('median_verdicts_s'), '.3f')} s, "
                     f"the rest {fmt(max(0.0, a['median_after_last_s'] - known), '.3f')} s ("
                     + ("the step's way into the averager, the merge" if measured else
                        "offers or matchmaking, the averager's hops, checks and the merge") + ")")
    return ("\n\nA committed round's parts (medians of each, so they need not add up):\n\n" + "\n".join(lines)
            if lines else "")


def table(payload: dict[str, Any]) -> str:
    rows = ["| matchmaking | H x step | realized period (ratio) | rounds committed | median round | all-reduce | "
            "fastest verdict RTT | bound 2 x (AR + 2 RTT) | coordination | after the last hand-off (coordination) | "
            "anchors identical | discards |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in payload["arms"]:
        reasons = "; ".join(f"{n}x {r}" for r, n in a["discard_reasons"].items()) or "-"
        rows.append(f"| {a['arm']} | {fmt(a['h_x_step_s'])} s | {fmt(a['realized_period_s'])} s "
                    f"({fmt(a['period_ratio'])}x) | {a['committed']} of {a['rounds']} "
                    f"({fmt(100 * a['committed_share'] if a['committed_share'] is not None else None, '.1f')}%) | "
                    f"{fmt(a['median_round_s'])} s | {fmt(a['median_allreduce_s'], '.3f')} s | "
                    f"{fmt(a['median_rtt_s'], '.3f')} s | {fmt(a['round_bound_s'])} s | "
                    f"{fmt(100 * a['coordination_share'] if a['coordination_share'] is not None else None, '.0f')}% | "
                    f"{after_last(a)} | {a['anchors_identical']} | {reasons} |")
    note = (f"\n{payload['peers']} learners, {payload['seconds']:g} s of training an arm, steps paced at "
            f"{STEP_S} s, H = {SYNC_EVERY}; {_bench.code_line(payload['code'])}.")
    return "\n".join(rows) + "\n" + note + breakdown(payload["arms"])


def plot(payload: dict[str, Any], path: Path) -> None:
    with _bench.figure(path, ncols=2, size=(10.0, 4.0)) as (left, right):
        arms = payload["arms"]
        names = [a["arm"] for a in arms]
        x = range(len(arms))
        left.bar([i - 0.2 for i in x], [a["h_x_step_s"] or 0 for a in arms], 0.4, label="H x median step")
        left.bar([i + 0.2 for i in x], [a["realized_period_s"] or 0 for a in arms], 0.4, label="realized period")
        left.set_xticks(list(x), names)
        left.set_ylabel("seconds")
        left.set_title("sync period")
        left.legend()
        ar = [a["median_allreduce_s"] or 0 for a in arms]
        after = [max(r, a.get("median_after_last_s") or a["median_round_s"] or 0) for a, r in zip(arms, ar)]
        wait = [max(0.0, (a["median_round_s"] or 0) - t) for a, t in zip(arms, after)]
        right.bar(list(x), ar, 0.5, label="all-reduce")
        right.bar(list(x), [t - r for t, r in zip(after, ar)], 0.5, bottom=ar, label="coordination")
        right.bar(list(x), wait, 0.5, bottom=after, label="waiting for the last member")
        right.set_xticks(list(x), names)
        right.set_ylabel("seconds (median committed round)")
        right.set_title("a round's time")
        right.legend()


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, quick="30 s an arm: checks the pipeline, not the figures")
    p.add_argument("--seconds", type=float, default=120.0, help="training time of each arm (default: 120)")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, table, plot):
        return 0
    seconds = 30.0 if args.quick else args.seconds
    code = _bench.code_identity(None, 10.0)
    arms = [measure(arm, run_arm(arm, args.out, seconds)) for arm in ARMS]
    _bench.publish(BENCH, args.out, {"peers": PEERS, "seconds": seconds, "code": code, "arms": arms}, table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
