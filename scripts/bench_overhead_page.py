"""``scripts/bench_overhead.py``'s page: the table of both arms' steps/s per thread count, the bar, the figure.

Drawn from ``overhead.json`` alone (``--render-only`` calls it with nothing run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _bench

TARGET = 0.95
"""The acceptance bar (issue 19): learner steps/s >= 0.95 x the plain loop's."""


def markdown(payload: dict[str, Any]) -> str:
    m = payload["model"]
    lines = [f"Learner overhead ({m['description']}, {m['parameters'] / 1e6:.2f}M parameters, batch {m['batch']} x "
             f"{m['block_size']} tokens, {payload['precision']}, {payload['device']}; {payload['blocks']} alternating blocks "
             f"of {payload['steps_per_block']} steps per arm; load average {payload['load_average_start'][0]:.2f} at the "
             f"start, {payload['load_average_end'][0]:.2f} at the end, {payload['cpus']} CPUs):", "",
             "| torch threads | plain loop (steps/s, median) | learner (steps/s, median) | ratio of the medians | "
             "learner / plain (median of paired blocks) |",
             "|---|---|---|---|---|"]
    for r in payload["results"]:
        lines.append(f"| {r['threads']} | {r['plain_median']:.3f} | {r['learner_median']:.3f} | "
                     f"{r['ratio_of_medians']:.3f} | **{r['ratio']:.3f}** |")
    verdict = "meets" if all(r["ratio"] >= TARGET for r in payload["results"]) else "does NOT meet"
    lines += ["", f"The learner {verdict} the bar of {TARGET:.2f} x the plain loop's steps/s at every thread count."]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    with _bench.figure(path, 1, (6.5, 4)) as (ax,):
        _plot_arms(payload, ax)


def _plot_arms(payload: dict[str, Any], ax: Any) -> None:
    results = payload["results"]
    width = 0.38
    for k, (arm, color) in enumerate((("plain", "#888888"), ("learner", "#1f77b4"))):
        xs = [i + (k - 0.5) * width for i in range(len(results))]
        ax.bar(xs, [r[f"{arm}_median"] for r in results], width, color=color, alpha=0.8,
               label="plain PyTorch loop" if arm == "plain" else "learner (train_once)")
        for x, r in zip(xs, results):
            blocks = r[f"{arm}_steps_per_s"]
            ax.scatter([x] * len(blocks), blocks, s=8, color="black", zorder=3)
    for i, r in enumerate(results):
        top = max(r["plain_median"], r["learner_median"])
        ax.text(i, top * 1.04, f"{r['ratio']:.3f}x", ha="center")
    ax.set_xticks(range(len(results)), [f"{r['threads']} thread{'s' * (r['threads'] > 1)}" for r in results])
    ax.set_ylabel("inner steps / s (bars: medians; dots: blocks)")
    ax.set_title(f"Learner vs plain loop: {payload['model']['description']}, {payload['precision']}")
    ax.legend(loc="upper left")
    ax.set_ylim(0, max(max(r["plain_median"], r["learner_median"]) for r in results) * 1.25)
