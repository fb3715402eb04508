"""``scripts/bench_parity_demo.py``'s page: its method, the tables of the grid, the acceptance and the figure.

Drawn from the summary (``parity-demo.json``, :func:`bench_parity_demo_grid.summarise` of the run files) alone;
a config other than the demo's gets a page of its own (:func:`bench_for`) that shows only the rows that ran.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import _bench
from bench_parity_demo_grid import (BUDGETS, DEFAULT_H, H_SWEEP, MAX_LOSS_VS_DILOCO, QUICK_DIVISOR, TARGET_BYTES_SAVED,
                                    TARGET_GAP)

BENCH = _bench.Bench("parity-demo", "parity-demo", "ML parity at the demo config (simulator, no network)",
                     "scripts/bench_parity_demo.py", """\
Issue 20 asks what DiLoCo costs in quality at equal tokens at the size users run, and which component costs or
buys what. Every row is one in-process simulation (the same fragment, codec, merge and outer code as the networked
learner) of the demo model of `configs/demo.toml` (the 0.86M-parameter byte GPT of the main job: 4 blocks, width
128, context 128, batch 16 x 128 bytes per learner, AdamW 3e-3 with warm-up + cosine; outer Nesterov lr 0.5,
momentum 0.9, H = 28) with 4 learners on the embedded corpus, at **1,200 and 2,400 inner steps per learner**, one torch
thread each, two at a time on the 2-core machine. Each is what
`p2p-diloco sim --config configs/demo.toml --set inner.total_steps=N [--set ...] [--mode ...] --json` prints; its
run file (linked from each row) holds that output with the overrides, the config hash and where it came from.

- **References** at both budgets: one learner alone for the same steps (`single`), and data-parallel training of
  the same model on a 4x batch (the same tokens). "Gap closed" is the share of the single -> data-parallel gap of
  the same budget that a row closes (100% = data-parallel quality).
- **Ablation ladder** at 1,200 steps, each rung one change on top of the previous one: plain DiLoCo (F = 1, no
  overlap, alpha = 0, fp32, mean merge, uniform weighting, H = 25, outer lr 0.7 as in the DiLoCo paper),
  + fragments (F = 4), + overlap (tau = 1), + alpha-mixing 0.5, + int4, + radial-directional merge, + token
  weighting (the previous default), + outer lr 0.5 and H = 28, which is the demo default since issue 20.
- **H sweep** on the default at 1,200 steps (H = 10, 25, 50, 100 beside its 28), and H = 100 beside the default
  at 2,400.
- **Levers** tried on the default at 1,200 steps to move the curve (error feedback, a final average, the inner
  learning rate, the outer momentum, more alpha-mixing); the outer learning-rate sweep that chose 0.5 is in
  [`results/parity-demo-explore`](../parity-demo-explore/README.md).

Payload bytes are counted as the butterfly all-reduce sends them (all learners together) and compared with what
fp32 data-parallel would send all-reducing gradients every step for the same tokens. Wall time is the simulation's
own, on a shared machine: a cost indication, not a speed figure.

**Acceptance (issue 20):** the default closes **>= 75%** of the gap at 1,200 steps and **>= 85%** at 2,400, at
**>= 200x** fewer payload bytes than fp32 data-parallel; it is never worse than plain DiLoCo at the same budget by
more than 1%; the loss at H = 100 at 2,400 steps is stated beside the default's.""",
                     source="the run files in [`runs/`](runs/) (summarised in "
                            "[`parity-demo.json`](parity-demo.json))")

OTHER_METHOD = """\
Issue 20 asks for the parity table at a second model size, so that the trend with size is measured, not assumed.
Every row is one in-process simulation of `{config}` (its model, on the embedded corpus, with the demo's data,
inner and outer settings: outer Nesterov lr 0.5, momentum 0.9, H = 28, F = 4, tau = 1, alpha = 0.5, int4, radial
merge, token weighting), 4 learners at **1,200 inner steps per learner**, one torch thread each, two at a time on
the 2-core machine: what `p2p-diloco sim --config {config} --set inner.total_steps=1200 [--set ...] [--mode ...]
--json` prints. The rows are the two references (one learner alone for the same steps; data-parallel on a 4x batch,
the same tokens), plain DiLoCo (F = 1, no overlap, alpha = 0, fp32, mean merge, uniform weighting, H = 25, outer lr
0.7) and the default; "gap closed" is the share of the single -> data-parallel gap a row closes. Payload bytes are
counted as the butterfly all-reduce sends them and compared with fp32 data-parallel all-reducing gradients every
step for the same tokens. The demo model's full grid is in [`results/parity-demo`](../parity-demo/README.md).

**Acceptance (issue 20):** the same table at 1,200 steps with a Llama of a few million parameters."""


def bench_for(config: str) -> _bench.Bench:
    """The page of ``config``'s grid: the demo's own (:data:`BENCH`), or the one of a second model size, which
    shows only the rows that ran."""
    stem = Path(config).stem
    if stem == "demo":
        return BENCH
    return replace(BENCH, name=f"parity-{stem}", folder=f"parity-{stem}",
                   title=f"ML parity with `configs/{stem}.toml` (simulator, no network)",
                   method=OTHER_METHOD.format(config=_bench.repo_path(config)),
                   source=f"the run files in [`runs/`](runs/) (summarised in [`parity-{stem}.json`](parity-{stem}.json))",
                   render_args=f"--config {_bench.repo_path(config)}")


TRADE_TICKS = (20, 50, 100, 200, 500, 1000)
"""Payload reductions marked on the figure's log axis (plain fp32 DiLoCo at H = 25 is about 25x)."""


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _saved(e: dict[str, Any]) -> str:
    if e["mode"] == "data-parallel":
        return "1x (reference)"
    return "—" if e.get("bytes_saved_vs_dp_fp32") is None else f"{e['bytes_saved_vs_dp_fp32']:.0f}x"


def _line(e: dict[str, Any], label: str, extra: str | None = None) -> str:
    name = f"[{e['slug']}](runs/{e['slug']}.json)" if e["status"] == "done" else e["slug"]
    if e["status"] != "done":
        return f"| {name} | {label} | not run yet |" + " |" * (4 + (extra is not None))
    mb = "—" if e["mode"] != "diloco" else f"{e['bytes_sent'] / 1e6:.1f} MB"
    cells = [name, label, f"{e['eval_loss']:.4f}", _pct(e.get("gap_closed")), *([extra] if extra is not None else []),
             mb, _saved(e), f"{e['wall_s']:.0f} s"]
    return "| " + " | ".join(cells) + " |"


def _relative(e: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """``e``'s eval loss against ``ref``'s, as a signed percentage ("—" while either has not run)."""
    if ref is None or "eval_loss" not in e or "eval_loss" not in ref:
        return "—"
    return f"{100 * (e['eval_loss'] / ref['eval_loss'] - 1):+.2f}%"


def table(payload: dict[str, Any]) -> str:
    """The page's results: the four tables, the acceptance, where each run came from (for a config other than
    the demo's, only the rows that ran)."""
    if bench_for(payload["config"]) is not BENCH:
        return _table_of_runs(payload)
    by = {e["slug"]: e for e in payload["rows"]}
    head = "| run | {} | eval loss (nats/byte) | gap closed |{} payload | fewer bytes than fp32 DP | wall |"
    lines = []
    if payload["quick"]:
        lines += [f"**Quick smoke run** (1/{QUICK_DIVISOR} of the steps): checks the pipeline, not the numbers.", ""]
    lines += ["### References", "", head.format("reference", ""), "|---|---|---|---|---|---|---|"]
    lines += [_line(by[f"s{s}-{m}"], f"{s:,} steps: {by[f's{s}-{m}']['label']}")
              for s in BUDGETS for m in ("single", "data-parallel")]
    lines += ["", "### Ablation ladder (1,200 steps per learner)", "",
              head.format("rung", " loss vs previous rung |"), "|---|---|---|---|---|---|---|---|"]
    previous = None
    for e in (e for e in payload["rows"] if e["group"] == "ladder"):
        lines.append(_line(e, e["label"], _relative(e, previous)))
        previous = e
    lines += ["", "### H sweep on the default (outer lr 0.5; 1,200 steps per learner)", "", head.format("H", ""),
              "|---|---|---|---|---|---|---|"]
    sweep = [(h, by["s1200-default" if h == DEFAULT_H else f"s1200-h{h}"]) for h in sorted((*H_SWEEP, DEFAULT_H))]
    lines += [_line(e, f"H = {h}" + (" (the default)" if h == DEFAULT_H else "")) for h, e in sweep]
    lines += ["", "### Levers tried on the default (1,200 steps per learner)", "",
              head.format("change", " loss vs the default |"), "|---|---|---|---|---|---|---|---|"]
    d = by["s1200-default"]
    for e in (e for e in payload["rows"] if e["group"] == "lever"):
        lines.append(_line(e, e["label"], _relative(e, d)))
    lines += ["", "### 2,400 steps per learner", "", head.format("what", ""), "|---|---|---|---|---|---|---|"]
    lines += [_line(e, e["label"]) for e in payload["rows"] if e["group"] == "2400"]
    lines += ["", "### Acceptance (issue 20)", "", *_acceptance_lines(payload["acceptance"], by)]
    lines += ["", "### Provenance", "", *_provenance_lines(payload["rows"])]
    return "\n".join(lines) + "\n"


def _table_of_runs(payload: dict[str, Any]) -> str:
    """A second model size's page: the rows that ran, each diloco row against the previous one shown."""
    done = [e for e in payload["rows"] if e["status"] == "done"]
    by = {e["slug"]: e for e in payload["rows"]}
    lines = ["| run | what | eval loss (nats/byte) | gap closed | loss vs the row above | payload | "
             "fewer bytes than fp32 DP | wall |", "|---|---|---|---|---|---|---|---|"]
    previous = None
    for e in done:
        what = "the default (the demo's: F = 4, H = 28, outer lr 0.5, int4)" if e["slug"].endswith("-default") else e["label"]
        label = f"{e['steps']:,} steps: {what}"
        lines.append(_line(e, label, _relative(e, previous) if e["mode"] == "diloco" else "—"))
        previous = e if e["mode"] == "diloco" else previous
    c = payload["acceptance"]["default_vs_diloco_1200"]
    d = by["s1200-default"]
    lines += ["", "### What it says", ""]
    if d["status"] == "done" and "gap_closed" in d:
        lines.append(f"- 1,200 steps: the default closes {_pct(d['gap_closed'])} of the single -> data-parallel gap at "
                     f"{_saved(d)} fewer payload bytes than fp32 data-parallel.")
    if c["loss_vs_diloco"] is not None:
        lines.append(f"- The default against plain DiLoCo at 1,200 steps: {100 * c['loss_vs_diloco']:+.2f}% eval loss.")
    lines += ["", "### Provenance", "", *_provenance_lines(done)]
    return "\n".join(lines) + "\n"


def _verdict(met: bool | None) -> str:
    return "not run yet" if met is None else ("**met**" if met else "**not met**")


def _acceptance_lines(checks: dict[str, Any], by: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for steps in BUDGETS:
        c = checks[f"default_{steps}"]
        saved = "—" if c["bytes_saved_vs_dp_fp32"] is None else f"{c['bytes_saved_vs_dp_fp32']:.0f}x"
        lines.append(f"- {steps:,} steps: the default closes {_pct(c['gap_closed'])} of the gap (needs >= "
                     f"{100 * c['target_gap']:.0f}%) at {saved} fewer payload bytes (needs >= "
                     f"{TARGET_BYTES_SAVED:.0f}x): {_verdict(c['met'])}.")
    c = checks["default_vs_diloco_1200"]
    vs = "—" if c["loss_vs_diloco"] is None else f"{100 * c['loss_vs_diloco']:+.2f}%"
    lines.append(f"- The default against plain DiLoCo at 1,200 steps: {vs} eval loss (needs <= "
                 f"+{100 * MAX_LOSS_VS_DILOCO:.0f}%): {_verdict(c['met'])}.")
    h100, d = by["s2400-h100"], by["s2400-default"]
    if h100["status"] == d["status"] == "done":
        vs = h100["eval_loss"] / d["eval_loss"] - 1
        lines.append(f"- H = 100 at 2,400 steps: {h100['eval_loss']:.4f} at {_saved(h100)} fewer bytes, beside the "
                     f"default's {d['eval_loss']:.4f} at {_saved(d)} ({100 * vs:+.1f}% eval loss).")
    else:
        lines.append("- H = 100 at 2,400 steps beside the default: not run yet.")
    return lines


def _provenance_lines(rows: list[dict[str, Any]]) -> list[str]:
    done = [e for e in rows if e["status"] == "done"]
    here = [e["slug"] for e in done if e["provenance"] == f"run by {BENCH.script}"]
    adopted = [e for e in done if e["provenance"] != f"run by {BENCH.script}"]
    lines = [f"- Run by `{BENCH.script}`: {', '.join(here) or 'none yet'}."]
    if adopted:
        lines.append("- Adopted with `--adopt` from the outputs of `p2p-diloco sim --json` of the same config and "
                     "overrides (the simulator's code has not changed since they ran, and it is deterministic: the "
                     "default at 1,200 steps reproduced 1.3569 to the digit), not re-run; their wall times were "
                     "measured beside other jobs: "
                     + ", ".join(f"{e['slug']} from `{e['provenance']}`" for e in adopted) + ".")
    missing = [e["slug"] for e in rows if e["status"] != "done"]
    if missing:
        lines.append(f"- Not run yet: {', '.join(missing)}; `python {BENCH.script}` runs them (finished runs are "
                     "skipped).")
    return lines


def plot(payload: dict[str, Any], path: Path) -> None:
    """Held-out loss against inner steps at each budget, and gap closed against payload reduction."""
    rows = [e for e in payload["rows"] if e["status"] == "done"]
    budgets = [b for b in BUDGETS if any(e["steps"] == b for e in rows)] or list(BUDGETS)  # a panel per budget run
    with _bench.figure(path, len(budgets) + 1, (19 * (len(budgets) + 1) / 3, 5)) as (*curves, trade):
        for ax, steps in zip(curves, budgets):
            for e in (e for e in rows if e["steps"] == steps):
                xs = [p["tokens"] / max(1, e["tokens"]) * steps for p in e["curve"]]
                ref = e["mode"] != "diloco"
                ax.plot(xs, [p["eval_loss"] for p in e["curve"]], "-" if ref or "default" in e["slug"] else "--",
                        linewidth=2 if ref else 1, label=f"{e['slug']} ({e['eval_loss']:.3f})")
            ax.set_title(f"{steps:,} inner steps per learner: held-out loss")
            ax.set_xlabel("inner steps per learner (single: 1/4 of the tokens)")
            ax.set_ylabel("held-out loss (nats/byte)")
            ax.set_ylim(top=2.5)
            if ax.lines:
                ax.legend(fontsize=7)
        for e in (e for e in rows if "gap_closed" in e and e["mode"] == "diloco"):
            trade.scatter(e["bytes_saved_vs_dp_fp32"], 100 * e["gap_closed"], marker="o" if e["steps"] == 1200 else "s",
                          color="C0" if e["steps"] == 1200 else "C1")
            trade.annotate(e["slug"], (e["bytes_saved_vs_dp_fp32"], 100 * e["gap_closed"]), fontsize=7,
                           xytext=(3, 3), textcoords="offset points")
        for steps, target in TARGET_GAP.items():
            trade.axhline(100 * target, color="C0" if steps == 1200 else "C1", linestyle=":",
                          label=f"target at {steps:,} steps ({100 * target:.0f}%)")
        trade.axvline(TARGET_BYTES_SAVED, color="grey", linestyle=":", label=f"{TARGET_BYTES_SAVED:.0f}x fewer bytes")
        trade.set_xscale("log")
        trade.set_xticks(TRADE_TICKS, [f"{t}x" for t in TRADE_TICKS])
        trade.minorticks_off()
        trade.set_title("gap closed against payload reduction (circles 1,200, squares 2,400 steps)")
        trade.set_xlabel("fewer payload bytes than fp32 data-parallel (x)")
        trade.set_ylabel("single -> data-parallel gap closed (%)")
        trade.legend(fontsize=7)
