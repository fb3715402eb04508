#!/usr/bin/env python3
"""Goodput at scale: our protocol against elastic synchronous data-parallel, 2 to 1,000 units, simulated.

Runs :mod:`p2p_diloco.sim.goodput` (an event-driven model, documented in its docstring) calibrated from
the real system's measurements on this machine (``results/learners``, ``results/chaos``,
``results/rejoin`` and the config those runs used), under two stated per-unit failure rates, for
several seeds each, on the same failure timelines for every protocol; reports medians over seeds.

    python scripts/bench_goodput.py                 # 2, 8, 16, 1000 units, 2 failure rates, 5 seeds (~1-2 min)
    python scripts/bench_goodput.py --quick         # 2 seeds, shorter horizons: checks the pipeline

    python scripts/bench_goodput.py --render-only   # rewrite the page (README.md) from goodput.json

Writes ``goodput.json`` (calibration and its sources, every run's breakdown, medians, the command),
``README.md`` (the page) and ``goodput.png`` (goodput against units) into ``--out`` (default results/goodput).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _bench

from p2p_diloco.sim.calibration import calibration_from_results
from p2p_diloco.sim.goodput import (
    Breakdown,
    Calibration,
    DPParams,
    Failures,
    GoodputError,
    P2PParams,
    Timelines,
    simulate_dp,
    simulate_p2p,
    unit_timelines,
)

UNITS = (2, 8, 16, 1000)
GROUP_CAP = 16
BENCH = _bench.Bench("goodput", "goodput", "Goodput at scale (simulated, calibrated on this machine)",
                     "scripts/bench_goodput.py", """\
An event-driven simulation (`p2p_diloco/sim/goodput.py`, the model stated in full in its docstring) of N learner
units that fail and come back. It compares our protocol with elastic synchronous data-parallel on the **same** seeded
failure timelines, and reports the median over seeds. *Goodput* is the share of allocated learner-time whose work
reached the model.

- **Ours.** A unit trains and never waits; fragment rounds fall on the swarm clock, staggered every period / F. A
  round is discarded for its group when a member dies within it, or when fewer than 2 units are live; the survivors'
  pseudo-gradients go out again at the next round. A unit that dies loses, per fragment, the work since its last
  committed round; after its repair it restarts (process start-up plus state download) and contributes at the next
  boundary.
- **DP restart** (torchelastic-style): any membership change stops every worker; they restart from the last
  checkpoint (every 300 s, asynchronous, free), a failure first waits out the detection timeout and rolls back
  everyone's work since the checkpoint; a rejoin restarts everyone without a rollback.
- **DP in-memory** (torchft-style): a failure costs everyone the detection timeout plus one group re-formation, and
  the step in flight is lost; a rejoin costs everyone one re-formation.
- Data-parallel's per-step communication and checkpoint writes are not charged (both favour the baseline).

Failure rates per unit: **heavy**, MTBF 1 h, repair 5 min (a unit is up 92.3% of the time: the ceiling for any
protocol); **mild**, MTBF 24 h, repair 30 min (up 98.0%); failures exponential, repairs fixed. The calibration (step
time, round time, restart and download times, detection timeout, blocked share) is read at run time from
`results/learners`, `results/chaos`, `results/rejoin` and `configs/demo.toml`, and listed below with its sources. The
model is also replayed on the real chaos run's own kill schedule and compared with what that run measured.""")


@dataclass(frozen=True)
class Scenario:
    """A stated failure rate: every unit fails after Exp(mtbf_s) of being up and is down repair_s."""

    name: str
    failures: Failures
    horizon_mtbfs: float
    """Simulated time, in units of the per-unit MTBF (so every unit fails ~this many times)."""

    @property
    def horizon_s(self) -> float:
        return self.horizon_mtbfs * self.failures.mtbf_s

    @property
    def availability(self) -> float:
        """Share of time a unit is up: no protocol's goodput can exceed it (for long horizons)."""
        return self.failures.mtbf_s / (self.failures.mtbf_s + self.failures.repair_s)

    def describe(self) -> str:
        f = self.failures
        return (f"per-unit MTBF {f.mtbf_s / 3600:g} h, repair {f.repair_s / 60:g} min ({f.repair}), "
                f"horizon {self.horizon_s / 3600:g} h")


SCENARIOS = (
    Scenario("heavy", Failures(mtbf_s=3600.0, repair_s=300.0), horizon_mtbfs=50.0),
    Scenario("mild", Failures(mtbf_s=86400.0, repair_s=1800.0), horizon_mtbfs=50.0),
)


def protocols(cal: Calibration) -> dict[str, Any]:
    """Name -> a function (timelines, seed) -> Breakdown. The data-parallel variants are in DPParams."""
    return {
        "ours": lambda tl, seed: simulate_p2p(tl, cal, P2PParams(), seed),
        f"ours, groups <= {GROUP_CAP}": lambda tl, seed: simulate_p2p(tl, cal, P2PParams(group_size=GROUP_CAP), seed),
        "DP in-memory": lambda tl, seed: simulate_dp(tl, cal, DPParams("in-memory")),
        "DP restart": lambda tl, seed: simulate_dp(tl, cal, DPParams("restart")),
    }


def run(cal: Calibration, scenarios: tuple[Scenario, ...], units: tuple[int, ...], seeds: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    medians: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for sc in scenarios:
        for n in units:
            per: dict[str, list[Breakdown]] = {}
            t0 = time.monotonic()
            for seed in range(seeds):
                tl = unit_timelines(n, sc.failures, sc.horizon_s, seed)
                for name, sim in protocols(cal).items():
                    b = sim(tl, seed)
                    per.setdefault(name, []).append(b)
                    runs.append({"scenario": sc.name, "units": n, "seed": seed, "name": name, **b.to_dict()})
            med = {name: {k: statistics.median(b.shares()[k] for b in bs) for k in bs[0].shares()}
                   for name, bs in per.items()}
            for name, bs in per.items():
                if bs[0].discarded_share is not None:
                    med[name]["discarded_rounds"] = statistics.median(b.discarded_share or 0.0 for b in bs)
            medians.setdefault(sc.name, {})[str(n)] = med
            print(f"goodput: {sc.name:5s} {n:5d} units: "
                  + ", ".join(f"{name} {100 * m['goodput']:.1f}%" for name, m in med.items())
                  + f" ({per['ours'][0].failures} failures in seed 0, {time.monotonic() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    return {"runs": runs, "medians": medians}


def chaos_replay(chaos_json: Path, cal: Calibration) -> dict[str, Any]:
    """The model on the real chaos run's own schedule (``scripts/chaos.py``), against what was measured.

    Kills become failures at their recorded times, each learner up again when its restart was spawned;
    the horizon is the run's training window and pending work at its end is *not* counted (chaos.py
    counts committed tokens only). SIGSTOPs are not in the model: their durations are taken off as
    time without training (no work lost, as measured)."""
    d = json.loads(chaos_json.read_text())
    try:
        names, horizon_s = d["analysis"]["learners"], float(d["analysis"]["train_wall_s"])
        measured, processed = d["analysis"]["goodput"], d["analysis"]["tokens_chaos"]
        up: dict[str, float | None] = {n: 0.0 for n in names}
        rows, stopped_s = [], 0.0
        for e in d["chaos"]["events"]:
            if e["event"] == "kill" and up[e["learner"]] is not None:
                rows.append((names.index(e["learner"]), up[e["learner"]], float(e["t"])))
                up[e["learner"]] = None
            elif e["event"] == "restart":
                up[e["learner"]] = float(e["t"])
            elif e["event"] == "stop":
                stopped_s += max(0.0, min(float(e["cont_in_s"]), horizon_s - float(e["t"])))
    except (KeyError, TypeError, ValueError) as e:
        raise GoodputError(f"{chaos_json}: unexpected layout ({type(e).__name__}: {e})") from e
    rows += [(names.index(n), u, math.inf) for n, u in up.items() if u is not None]
    b = simulate_p2p(Timelines.from_intervals(len(names), horizon_s, rows), cal)
    stop_share = stopped_s * (1 - cal.blocked_share) / b.allocated_s
    not_training = (b.down_s + b.restart_s + stopped_s) / b.allocated_s
    return {"kills": b.failures, "stopped_s": stopped_s, "model": {**b.to_dict(), "goodput_committed_minus_stops":
            b.committed_goodput - stop_share, "not_training_share": not_training,
            "lost_or_pending_s": b.lost_s + b.pending_s},
            "measured": {"goodput": measured["goodput"], "processed_share": processed / measured["allocated_tokens"],
                         # tokens processed but never committed, as unit-seconds of allocated time
                         "lost_tokens_s": (processed - measured["committed_tokens"]) / measured["allocated_tokens"]
                         * b.allocated_s}}


def markdown(payload: dict[str, Any]) -> str:
    cal, med = payload["calibration"], payload["medians"]
    names = list(next(iter(next(iter(med.values())).values())))
    lines = [f"Goodput (median of {payload['seeds']} seeds): share of allocated learner-time whose work reached the "
             "model. Simulated (`p2p_diloco/sim/goodput.py`), calibrated from this machine's measurements.", ""]
    for sc in payload["scenarios"]:
        lines += [f"**{sc['name']}** failures: {sc['describe']}; a unit is up {100 * sc['availability']:.1f}% of "
                  "the time (the ceiling for any protocol).", "",
                  "| units | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for n, m in med[sc["name"]].items():
            lines.append(f"| {n} | " + " | ".join(f"{100 * m[name]['goodput']:.1f}%" for name in names) + " |")
        lines.append("")
    ours = [name for name in names if "discarded_rounds" in next(iter(med.values()))[str(payload["units"][0])][name]]
    lines += ["Our unit-rounds discarded (a member died within the round, or fewer than 2 live units; the "
              "survivors' work goes out at the next round, delayed, not lost):", "",
              "| units | " + " | ".join(f"{sc['name']}: {name}" for sc in payload["scenarios"] for name in ours) + " |",
              "|---|" + "---|" * (len(ours) * len(payload["scenarios"]))]
    for n in payload["units"]:
        lines.append(f"| {n} | " + " | ".join(f"{100 * med[sc['name']][str(n)][name]['discarded_rounds']:.1f}%"
                                              for sc in payload["scenarios"] for name in ours) + " |")
    lines += [""]
    lines += ["Where the rest went (median shares of allocated unit-time, heavy failures):", "",
              "| units | protocol | goodput | down | restart | lost | stalled | blocked |", "|---|---|---|---|---|---|---|---|"]
    for n, m in med[payload["scenarios"][0]["name"]].items():
        for name in names:
            s = m[name]
            lines.append(f"| {n} | {name} | " + " | ".join(f"{100 * s[k]:.1f}%" for k in
                                                          ("goodput", "down", "restart", "lost", "stalled", "blocked")) + " |")
    r = payload["chaos_replay"]
    lines += ["", f"Check against the real chaos run (`results/chaos`, 4 learners, {r['kills']} kill -9 + "
              f"{r['stopped_s']:.0f} s of SIGSTOP): the model on that run's own kill schedule predicts "
              f"**{100 * r['model']['goodput_committed_minus_stops']:.1f}%** goodput (pending work at the end not "
              f"counted, stops as time without training); measured **{100 * r['measured']['goodput']:.1f}%**. "
              f"Learners trained {100 * (1 - r['model']['not_training_share']):.1f}% of the allocated time in the model, "
              f"{100 * r['measured']['processed_share']:.1f}% of it in tokens in the real run; lost or uncommitted "
              f"work {r['model']['lost_or_pending_s']:.0f} unit-s in the model vs ~{r['measured']['lost_tokens_s']:.0f} "
              f"unit-s measured."]
    lines += ["", "Calibration (seconds; from the real system's results on this machine):", ""]
    lines += [f"- `{k}` = {cal[k]:.4g}: {payload['calibration_sources'][k]}" for k in cal]
    dp = {d["variant"]: d for d in payload["dp_params"]}["restart"]
    lines += ["", f"DP restart: checkpoints every {dp['checkpoint_interval_s']:g} s of training, {dp['checkpoint_save_s']:g} s "
              "of stall each (asynchronous), a rejoin restarts every worker without rollback; DP in-memory: no "
              f"checkpoints, a failure loses the step in flight. Ours: one group of every live unit (as configured), "
              f"and groups of at most {GROUP_CAP}.", "", f"Command: `{payload['command']}` ({payload['wall_s']:.0f} s)."]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    med = payload["medians"]
    styles = {"ours": "o-", "DP in-memory": "s--", "DP restart": "^:"}
    with _bench.figure(path, len(med), (6 * len(med), 4.2)) as axes:
        for ax, sc in zip(axes, payload["scenarios"]):
            by_n = med[sc["name"]]
            units = [int(n) for n in by_n]
            for name in next(iter(by_n.values())):
                ax.plot(units, [100 * by_n[str(n)][name]["goodput"] for n in units], styles.get(name, "x-."), label=name)
            ax.axhline(100 * sc["availability"], color="grey", lw=0.8, ls="--", label="units up (ceiling)")
            ax.set_xscale("log")
            ax.set_xticks(units, [str(n) for n in units])
            ax.set_ylim(0, 100)
            ax.set_xlabel("learner units")
            ax.set_ylabel("goodput (%)")
            ax.set_title(f"{sc['name']}: {sc['describe']}", fontsize=9)
            ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml", overrides=False,
                      quick="2 seeds, horizons of 10 MTBFs: checks the pipeline")
    p.add_argument("--results", type=Path, default=_bench.RESULTS, help="where the measured results are (default: results)")
    p.add_argument("--seeds", type=int, default=5, help="seeds per point (default: 5)")
    p.add_argument("--units", type=int, nargs="+", default=list(UNITS), help="unit counts (default: 2 8 16 1000)")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    if args.seeds < 1 or any(n < 1 for n in args.units):
        p.error(f"need --seeds >= 1 and --units >= 1, got {args.seeds} and {args.units}")
    scenarios = SCENARIOS
    if args.quick:
        args.seeds = min(args.seeds, 2)
        scenarios = tuple(Scenario(s.name, s.failures, 10.0) for s in SCENARIOS)
    t0 = time.monotonic()
    try:
        cal, sources = calibration_from_results(args.results, Path(args.config))
    except GoodputError as e:
        print(f"bench_goodput: {e}", file=sys.stderr)
        return 2
    print("goodput: calibration " + ", ".join(f"{k}={v:.4g}" for k, v in asdict(cal).items()), file=sys.stderr,
          flush=True)
    sources = {k: v.replace(f"{_bench.ROOT}/", "") for k, v in sources.items()}
    replay = chaos_replay(args.results / "chaos" / "chaos.json", cal)
    print(f"goodput: the model on the chaos run's schedule: {100 * replay['model']['goodput_committed_minus_stops']:.1f}%, "
          f"measured {100 * replay['measured']['goodput']:.1f}%", file=sys.stderr, flush=True)
    result = run(cal, scenarios, tuple(args.units), args.seeds)
    command = shlex.join(["python", "scripts/bench_goodput.py", *(sys.argv[1:] if argv is None else argv)])
    payload = {
        "command": command, "seeds": args.seeds, "units": args.units, "quick": args.quick,
        "calibration": asdict(cal), "calibration_sources": sources,
        "scenarios": [{"name": s.name, "failures": asdict(s.failures), "horizon_s": s.horizon_s,
                       "availability": s.availability, "describe": s.describe()} for s in scenarios],
        "p2p_params": [asdict(P2PParams()), asdict(P2PParams(group_size=GROUP_CAP))],
        "dp_params": [asdict(DPParams("in-memory")), asdict(DPParams("restart"))],
        "chaos_replay": replay, **result, "wall_s": time.monotonic() - t0,
    }
    _bench.publish(BENCH, args.out, payload, markdown, plot, indent=1)
    print(f"goodput: wrote {args.out} in {payload['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
