#!/usr/bin/env python3
"""Past one group: 1,000 simulated learners averaging in groups of at most G = 8, 16, 32, under heavy failures.

Runs :mod:`p2p_diloco.sim.scale` (cheap vectors, the model stated in its docstring) with the grouping rules of
:mod:`p2p_diloco.core.groups` (docs/design.md, "Bounded groups") on the goodput benchmark's seeded "heavy" failure
timelines, for several seeds, plus each G without failures and one group of everyone (G = 0) as references.

    python scripts/bench_scale.py                  # 1,000 learners, 240 rounds, 3 seeds (~1 min on one core)
    python scripts/bench_scale.py --quick          # 200 learners, 40 rounds, 1 seed: checks the pipeline
    python scripts/bench_scale.py --render-only    # rewrite the page (README.md) from scale.json

Writes ``scale.json``, ``README.md`` and ``scale.png`` into ``--out`` (default results/scale).
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _bench

from p2p_diloco.sim.goodput import Failures
from p2p_diloco.sim.scale import ScaleParams, simulate

GROUP_SIZES = (8, 16, 32)
HEAVY = Failures(mtbf_s=3600.0, repair_s=300.0)
"""bench_goodput's "heavy" failures: per-learner MTBF 1 h, repair 5 min (fixed)."""
ACCEPT_G = 16
ACCEPT_REACH = 0.99
SUMMARY_KEYS = ("reach_weight", "reach_kept", "reach_p01", "present", "distance_rel_max", "distance_noise_max",
                "distance_noise_median", "bound_noise_max", "distance_over_bound_max", "mix_rounds_median",
                "mix_rounds_p95", "discarded_groups", "learner_failures", "lost_with_failures", "offered_updates")

BENCH = _bench.Bench("scale", "scale", "Past one group: 1,000 learners in bounded groups (simulated)",
                     "scripts/bench_scale.py", """\
A simulation (`p2p_diloco/sim/scale.py`, its model stated in its docstring) of N learners, each an anchor vector,
one fragment's rounds every 30.9 s (the goodput calibration's period; a round lasts 2.9 s, a learner coming back
spends 8.3 s on start-up and download). Every round each live learner adds one period's update: a drift common to
all (norm 1e-3 of the starting anchor) plus its own noise (RMS norm 1e-3). A round averages within the groups of
`p2p_diloco/core/groups.py`: a Moshpit-style grid over the roster of learner ids, sides at most G, one axis per
round (docs/design.md, "Bounded groups"). A group commits all or nothing: it is discarded when a member dies
within the round (its members keep their update for their next round); a learner that dies loses its uncommitted
update and its anchor, and when back downloads a random live learner's anchor. Failures: bench_goodput's
**heavy** model (per-learner MTBF 1 h, repair 5 min), the same seeded timelines.

- **Consensus distance**: RMS over live learners of the distance of their anchor to the mean anchor, relative to the
  mean anchor's norm, and in units of the update noise. **Bound**: `consensus_bound(sides, spread)` = spread x
  sum over k = 1..d-1 of 1/sqrt(P_k) (P_k: product of the k smallest sides; spread: the largest RMS spread of the
  updates sent in the last d rounds), the steady state of a full grid with every round committed (its docstring
  gives the argument). *distance / bound* is the largest ratio over all rounds.
- **Heirs** (the design's weighted anchors): every anchor carries a weight, a group averages anchors weighted by them
  and shares their sum equally; a learner that dies leaves its weight to the live member of its last committed
  group with the smallest id, and one coming back takes half its donor's weight with its anchor. The global model
  is the weighted mean anchor. Rows "no heirs" turn this off (plain means, every anchor weight 1).
- **Contributions reaching the global model** (the global model: the mean anchor of the live learners at the
  end; weighted with heirs). Sampled per-round updates (4 per round) are followed exactly. A committed update's *reach* is its weight in
  the global model over its ideal weight, 1 / (the live learners' total weight when it was committed: their number
  without heirs), what one group of everyone gives it. *weight*: total weight present / ideal total; *kept*: mean of min(1, reach), which does not let the
  surplus of some (copied to a learner coming back) make up for the loss of others (their holders died before it
  mixed); *p01*: the 1st percentile of reach; *present*: share with any weight. Updates lost with a learner's
  death before any round committed them are counted apart (*lost with failures*, in learner-periods; every
  protocol loses them).
- **Rounds to mix**: rounds after its commit until every live learner holds at least half the mean weight of a
  followed update (median, 95th percentile).""")


def runs(args: Any) -> list[dict[str, Any]]:
    """Every simulated run: (G, failures, seed) and its figures; the per-round series only for seed 0."""
    out = []
    configs = [(g, "heavy", s, True) for g in GROUP_SIZES for s in range(args.seeds)]
    configs += [(ACCEPT_G, "heavy", s, False) for s in range(args.seeds)]
    configs += [(g, "none", 0, True) for g in GROUP_SIZES] + [(0, "heavy", 0, True)]
    for g, fail, seed, heirs in configs:
        t0 = time.monotonic()
        params = ScaleParams(learners=args.learners, group_size=g, rounds=args.rounds, seed=seed, heirs=heirs)
        r = simulate(params, HEAVY if fail == "heavy" else None)
        if seed != 0:
            r.pop("series")
        out.append({"group_size": g, "failures_name": fail if heirs else f"{fail}, no heirs", "seed": seed, **r})
        print(f"scale: G={g:2d} {fail:5s} heirs {heirs!s:5s} seed {seed}: weight {100 * r['reach_weight']:.2f}%, kept "
              f"{100 * r['reach_kept']:.2f}%, distance/bound {r['distance_over_bound_max']:.2f}, "
              f"mix {r['mix_rounds_median']:g} rounds ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    return out


def summarise(all_runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (G, failures): the median over seeds of every summary figure, and the worst seed where it matters."""
    out: dict[str, dict[str, Any]] = {}
    for r in all_runs:
        out.setdefault(f"{r['group_size']}/{r['failures_name']}", {"runs": []})["runs"].append(r)
    for entry in out.values():
        rs = entry.pop("runs")
        entry.update({k: statistics.median(r[k] for r in rs) for k in SUMMARY_KEYS})
        entry.update(seeds=len(rs), sides=rs[0]["sides"], mixing_rounds_bound=rs[0]["mixing_rounds_bound"],
                     reach_weight_min=min(r["reach_weight"] for r in rs),
                     reach_kept_min=min(r["reach_kept"] for r in rs),
                     distance_over_bound_worst=max(r["distance_over_bound_max"] for r in rs))
    return out


def acceptance(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's acceptance at G = 16, heavy failures, on every seed."""
    s = summary[f"{ACCEPT_G}/heavy"]
    return {"group_size": ACCEPT_G, "reach_weight_min": s["reach_weight_min"], "reach_kept_min": s["reach_kept_min"],
            "distance_over_bound_worst": s["distance_over_bound_worst"],
            "reach_weight_ok": s["reach_weight_min"] >= ACCEPT_REACH, "reach_kept_ok": s["reach_kept_min"] >= ACCEPT_REACH,
            "bound_ok": s["distance_over_bound_worst"] <= 1.0}


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def markdown(payload: dict[str, Any]) -> str:
    hours = payload["rounds"] * payload["runs"][0]["params"]["period_s"] / 3600
    lines = [f"{payload['learners']} learners, {payload['rounds']} rounds ({hours:.1f} h), "
             f"{payload['seeds']} seeds under heavy failures (medians; *min* / *worst*: over seeds).", "",
             "| G | failures | grid sides | reach: weight | kept (min) | p01 | present | distance / norm (max) "
             "| distance / noise (median, max) | bound / noise | distance / bound (worst) | rounds to mix (median, p95) "
             "| groups discarded | lost with failures |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, s in payload["summary"].items():
        g, fail = key.split("/")
        lines.append(
            f"| {g if g != '0' else 'all'} | {fail} | {'x'.join(map(str, s['sides']))} | {100 * s['reach_weight']:.2f}% "
            f"| {100 * s['reach_kept']:.2f}% ({100 * s['reach_kept_min']:.2f}%) | {s['reach_p01']:.3f} "
            f"| {100 * s['present']:.1f}% | {s['distance_rel_max']:.2e} | {s['distance_noise_median']:.3f}, "
            f"{s['distance_noise_max']:.3f} | {s['bound_noise_max']:.3f} | {s['distance_over_bound_worst']:.2f} "
            f"| {s['mix_rounds_median']:g}, {s['mix_rounds_p95']:g} | {100 * s['discarded_groups']:.1f}% "
            f"| {s['lost_with_failures']:.0f} of {s['offered_updates']:.0f} |")
    a = payload["acceptance"]
    lines += ["", f"Acceptance (G = {a['group_size']}, heavy failures, every seed): contribution weight in the global "
              f"model >= 99%: {100 * a['reach_weight_min']:.2f}%, {verdict(a['reach_weight_ok'])}; the stricter *kept* "
              f">= 99%: {100 * a['reach_kept_min']:.2f}%, {verdict(a['reach_kept_ok'])}; consensus distance within the "
              f"bound on every round: worst ratio {a['distance_over_bound_worst']:.2f}, {verdict(a['bound_ok'])}.", "",
              f"`{payload['command']}`, {payload['wall_s']:.0f} s."]
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    series = {(r["group_size"], r["failures_name"]): r["series"] for r in payload["runs"] if "series" in r}
    with _bench.figure(path, ncols=2, size=(11.0, 4.2)) as (left, right):
        for g in GROUP_SIZES:
            s = series.get((g, "heavy"))
            if s is None:
                continue
            t_h = [t / 3600 for t in s["t_s"]]
            line, = left.plot(t_h, s["distance_noise"], lw=1, label=f"G = {g}")
            left.plot(t_h, s["bound_noise"], lw=1, ls="--", color=line.get_color())
            right.plot(t_h, s["distance_rel"], lw=1, label=f"G = {g}", color=line.get_color())
        left.set(xlabel="hours", ylabel="consensus distance / update noise",
                 title="Consensus distance (dashed: bound), heavy failures, seed 0")
        right.set(xlabel="hours", ylabel="consensus distance / anchor norm", title="Relative to the anchor norm")
        right.set_yscale("log")
        left.legend()
        right.legend()


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, quick="200 learners, 40 rounds, 1 seed: checks the pipeline")
    p.add_argument("--seeds", type=int, default=3, help="seeds under heavy failures (default: 3)")
    p.add_argument("--learners", type=int, default=1000, help="learners (default: 1000)")
    p.add_argument("--rounds", type=int, default=240, help="rounds of the fragment (default: 240, about 2 h)")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    if args.quick:
        args.seeds, args.learners, args.rounds = 1, 200, 40
    if args.seeds < 1 or args.learners < 2 or args.rounds < 1:
        p.error("need --seeds >= 1, --learners >= 2, --rounds >= 1")
    t0 = time.monotonic()
    all_runs = runs(args)
    summary = summarise(all_runs)
    command = shlex.join(["python", "scripts/bench_scale.py", *(sys.argv[1:] if argv is None else argv)])
    payload = {"command": command, "quick": args.quick, "learners": args.learners, "rounds": args.rounds,
               "seeds": args.seeds, "failures": asdict(HEAVY), "group_sizes": list(GROUP_SIZES),
               "summary": summary, "acceptance": acceptance(summary), "runs": all_runs,
               "wall_s": time.monotonic() - t0}
    _bench.publish(BENCH, args.out, payload, markdown, plot, indent=1)
    print(f"scale: wrote {args.out} in {payload['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
