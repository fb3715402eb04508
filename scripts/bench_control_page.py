"""``scripts/bench_control.py``'s page: the per-N table, the control plane by purpose, the bar, and the figure.

Everything here is drawn from ``control.json`` alone (``--render-only`` calls it with nothing run); the bar and what
counts as a swarm that was averaging are decided here too, so that the page and the figure say the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _bench
from _tally import PAYLOAD

PLOT_FLOOR_BPS = 100.0
"""The figure's floor (log scale): smaller rates are drawn on it, purposes that never reach it are left out."""
HEALTHY_SHARE = 0.5
"""A size whose swarm committed fewer than this share of the rounds that ended in its window was not averaging (on
this machine: CPU-starved, its matchmaking failing): its bytes are those of a broken swarm, and no growth is computed
from them."""
TARGET_BYTES_PER_S = 2000.0
"""The bar: control-plane bytes per second per peer at every N (2 kB/s)."""
TARGET_GROWTH = 1.5
"""The bar: control bytes/s per peer from N = 16 to N = 64 grow at most this much."""


def control_purposes(result: dict[str, Any]) -> list[str]:
    """Every control-plane purpose, in ``summarize``'s order, ours last."""
    first = result["runs"][0]["purposes"] if result["runs"] else {}
    return [p for p in first if p != PAYLOAD]


def healthy(row: dict[str, Any]) -> bool:
    """Whether the swarm of one size was averaging over its window (see :data:`HEALTHY_SHARE`)."""
    rounds = row["rounds"]["committed"] + row["rounds"]["discarded"]
    return rounds > 0 and row["rounds"]["committed"] >= HEALTHY_SHARE * rounds


def verdict(result: dict[str, Any]) -> list[str]:
    """The bar, against what was measured; sizes whose swarm was not averaging say so and set no growth."""
    runs = result["runs"]
    if not runs:
        return ["Nothing was measured."]
    over = [r for r in runs if r["control_bps_per_peer"] > TARGET_BYTES_PER_S]
    lines = [f"- <= {TARGET_BYTES_PER_S:,.0f} B/s of control plane per peer at every N: **"
             + ("not met" if over else "met") + "**: "
             + ", ".join(f"N = {r['n']} {r['control_bps_per_peer']:,.0f} B/s "
                         f"({r['control_bps_per_peer'] / TARGET_BYTES_PER_S:.2f}x the bar"
                         + ("" if healthy(r) else ", swarm not averaging") + ")" for r in runs) + "."]
    by_n = {r["n"]: r for r in runs}
    largest = max(by_n)
    if 16 not in by_n or largest <= 16:
        return [*lines, "- Growth from N = 16 to N = 64: not measured (needs N = 16 and a larger N)."]
    broken = [by_n[n] for n in (16, largest) if not healthy(by_n[n])]
    scope = "" if largest == 64 else " (N = 64 was not run; the bar is for 16 to 64)"
    growth = by_n[largest]["control_bps_per_peer"] / by_n[16]["control_bps_per_peer"]
    if broken:
        why = "; ".join(f"at N = {r['n']} {r['rounds']['committed']} of {r['rounds']['committed'] + r['rounds']['discarded']} "
                        f"rounds committed" for r in broken)
        return [*lines, f"- Growth from N = 16 to N = {largest}: **not measurable on this machine** ({why}: the swarm "
                        f"was not averaging, its bytes are a broken swarm's; the ratio would be {growth:.2f}x){scope}."]
    ok = growth <= TARGET_GROWTH
    return [*lines, f"- Growth from N = 16 to N = {largest}: **{growth:.2f}x** (bar <= {TARGET_GROWTH:g}x: "
                    f"**{'met' if ok else 'not met'}**){scope}."]


def cpu_cell(row: dict[str, Any]) -> str:
    """CPU cores used over the window by the swarm and by the whole machine, and the load average at its end."""
    cpu = row["cpu"]
    return (f"{cpu['swarm_cores']:.2f} / {cpu['machine_busy_cores']:.2f} of {cpu['machine_cores']} "
            f"(load {row['loadavg_1min_at_end']:.0f})")


def markdown(result: dict[str, Any]) -> str:
    """The per-N table, control plane by purpose, the bar, and which sizes ran."""
    p, runs = result["params"], result["runs"]
    lines = [f"{'Quick run (checks the pipeline, not the numbers): ' if p['quick'] else ''}"
             f"Steps padded to {p['step_s']:g} s, {p['settle_s']:g} s settle, then a {p['window_s']:g} s window; "
             f"whole benchmark {result.get('wall_s', 0) / 60:.1f} min. Code: {_bench.code_line(result['code'])}."
             + "".join(f" `--set {kv}`." for kv in p.get("overrides", ())), "",
             "| N | control B/s per peer | top 3 purposes, B/s per peer | payload B/s per peer | busiest learner, "
             "control B/s | rounds in window: committed / discarded (median group) | s per step | CPU cores: swarm / "
             "whole machine | PSS per learner | start-up (all training) | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        control = {k: v for k, v in r["purposes"].items() if k != PAYLOAD}
        top = sorted(control.items(), key=lambda kv: -kv[1]["bps_per_peer"])[:3]
        rd = r["rounds"]
        group = "-" if rd["median_group_size"] is None else f"{rd['median_group_size']:g}"
        step = "-" if rd["median_step_s"] is None else f"{rd['median_step_s']:.2f} s"
        alive = "" if r["alive_at_end"] == r["n"] else f" ({r['alive_at_end']} alive at the end)"
        alive += " (**the code changed while it ran**)" if r.get("code_changed") else ""
        alive += "" if healthy(r) else " (**not averaging**)"
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(
            f"| {r['n']}{note}{alive} | **{r['control_bps_per_peer']:,.0f}** | "
            + "; ".join(f"{k}: {v['bps_per_peer']:,.0f}" for k, v in top)
            + f" | {r['payload_bps_per_peer']:,.0f} | {r['learner_control_bps']['max']:,.0f} | "
            f"{rd['committed']} / {rd['discarded']} ({group}) | {step} | {cpu_cell(r)} | "
            f"{r['memory']['pss_per_learner_mib']:.0f} MiB | "
            f"{r['startup']['all_training_s']:.0f} s | {r['wall_s'] / 60:.1f} min |")
    discards = [f"N = {r['n']}: " + "; ".join(f"{reason} ({count})" for reason, count in r["rounds"]["discard_reasons"])
                for r in runs if r["rounds"]["discard_reasons"]]
    if discards:
        lines += ["", "Discarded rounds in the window, the commonest reasons (numbers folded to N):", "",
                  *[f"- {d}" for d in discards]]
    lines += ["", "## The bar", "", *verdict(result), ""]
    if runs:
        ns = [r["n"] for r in runs]
        lines += ["## Control plane by purpose", "", "Bytes per second per peer (calls per second per peer).", "",
                  "| purpose | " + " | ".join(f"N = {n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
        for purpose in control_purposes(result):
            lines.append(f"| {purpose} | " + " | ".join(
                f"{r['purposes'][purpose]['bps_per_peer']:,.0f} ({r['purposes'][purpose]['calls_per_s_per_peer']:.2f})"
                for r in runs) + " |")
        lines.append("| **control plane, all** | " + " | ".join(f"**{r['control_bps_per_peer']:,.0f}**" for r in runs)
                     + " |")
        lines.append(f"| {PAYLOAD} (not control) | " + " | ".join(f"{r['payload_bps_per_peer']:,.0f}" for r in runs) + " |")
        big = runs[-1]
        lines += ["", f"The busiest RPCs at N = {big['n']} (DHT keys with hashes and versions folded, B/s per peer):", "",
                  "| RPC | B/s per peer | calls/s per peer |", "|---|---|---|"]
        lines += [f"| `{t['rpc']}` | {t['bps_per_peer']:,.0f} | {t['calls_per_s_per_peer']:.2f} |" for t in big["top_rpcs"]]
        lines += ["", "Per size: the busiest learner's own calls (control B/s: min / median / max), the bootstrap's, "
                  "and memory (sum over every process of the run, and per learner).", "",
                  "| N | learners' control B/s (min / median / max) | bootstrap control B/s | PSS per learner | RSS per "
                  "learner | PSS, all processes | available at the end |",
                  "|---|---|---|---|---|---|---|"]
        for r in runs:
            lc, m = r["learner_control_bps"], r["memory"]
            lines.append(f"| {r['n']} | {lc['min']:,.0f} / {lc['median']:,.0f} / {lc['max']:,.0f} | "
                         f"{r['bootstrap_control_bps']:,.0f} | {m['pss_per_learner_mib']:.0f} MiB | "
                         f"{m['rss_per_learner_mib']:.0f} MiB | {m['pss_all_gib']:.2f} GiB | "
                         f"{m['available_at_end_gib']:.1f} GiB |")
    lines += ["", "## Sizes", "", f"Requested: {', '.join(str(n) for n in p['sizes_requested'])}; run: "
              + (", ".join(str(r["n"]) + (f" ({r['note']})" if r.get("note") else "") for r in runs) or "none") + "."]
    lines += [f"- N = {s['n']} skipped: {s['reason']}." for s in result["skipped"]]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Control bytes/s per peer against N (log x), total and by purpose, the payload beside it, the bar drawn."""
    runs = result["runs"]
    if not runs:
        return
    ns = [r["n"] for r in runs]
    with _bench.figure(path, 1, (9, 5)) as (ax,):
        totals = [r["control_bps_per_peer"] for r in runs]
        ax.plot(ns, totals, "k-o", linewidth=2.5, label="control plane, all")
        for r, total in zip(runs, totals):
            if not healthy(r):  # a broken swarm's bytes: marked where they are drawn
                ax.annotate("not averaging", (r["n"], total), textcoords="offset points", xytext=(0, 9), ha="center",
                            fontsize=8, color="tab:red")
        for purpose in control_purposes(result):
            ys = [r["purposes"][purpose]["bps_per_peer"] for r in runs]
            if any(y >= PLOT_FLOOR_BPS for y in ys):
                ax.plot(ns, [max(y, PLOT_FLOOR_BPS) for y in ys], marker=".", linewidth=1, label=purpose)
        ax.plot(ns, [max(r["payload_bps_per_peer"], PLOT_FLOOR_BPS) for r in runs], color="grey", linestyle=":",
                marker="s", label=f"{PAYLOAD} (not control)")
        ax.axhline(TARGET_BYTES_PER_S, color="tab:red", linestyle="--", label=f"bar: {TARGET_BYTES_PER_S:,.0f} B/s per peer")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(PLOT_FLOOR_BPS / 1.5, 3 * max(max(totals), TARGET_BYTES_PER_S))  # room for the labels above
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("learners N (127.0.0.1)")
        ax.set_ylabel(f"bytes/s per peer (below {PLOT_FLOOR_BPS:g}: drawn at {PLOT_FLOOR_BPS:g})")
        ax.set_title(f"Control-plane bytes per peer against N (steps of {result['params']['step_s']:g} s, "
                     f"{result['params']['window_s']:g} s window)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
