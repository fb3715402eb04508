#!/usr/bin/env python3
"""ML parity at the demo config (issue 20): references, an ablation ladder and an H sweep, resumable across sessions.

Every row is one in-process simulation of `configs/demo.toml` (what `p2p-diloco sim --json` runs), one torch
thread each. A finished simulation is written to ``--out/runs/<slug>.json`` the moment it ends, and a later
invocation skips every row whose run file holds the same config, mode, overrides and config hash: a grid of hours
survives the session that started it. The page is rendered from whatever runs exist (missing rows read "not run
yet"), after every finished run and by ``--render-only``.

    python scripts/bench_parity_demo.py                       # the grid (runs already in --out/runs skipped)
    python scripts/bench_parity_demo.py --only 's1200-h*'     # rows whose slug starts with s1200-h (repeatable)
    python scripts/bench_parity_demo.py --quick --out /tmp/pd # a smoke run of the pipeline, 1/60 of the steps
    python scripts/bench_parity_demo.py --adopt s1200-default=results/parity-demo-explore/sim-default.json
    python scripts/bench_parity_demo.py --render-only         # the page (and parity-demo.json) from --out/runs

Writes ``runs/<slug>.json``, ``parity-demo.json`` (the summary the page is drawn from), ``README.md`` and
``parity-demo.png`` into ``--out`` (default ``results/parity-demo``).
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import _bench
import bench_parity

from p2p_diloco.core.config import Config, load_config
from p2p_diloco.core.identity import config_hash

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


BUDGETS = (1200, 2400)
"""Inner steps per learner."""
QUICK_DIVISOR = 60
"""``--quick`` runs 1/60 of the steps: it checks the pipeline, not the numbers."""
QUICK_WARMUP_STEPS = 2
PLAIN_DILOCO = (*bench_parity.DILOCO, "outer.sync_every=25", "outer.lr=0.7")
"""Plain DiLoCo: F = 1, no overlap, alpha = 0, fp32, mean merge, uniform weighting, H = 25, outer lr 0.7 (the DiLoCo
paper's; outer momentum 0.9 comes from the config)."""
LADDER = (("fragments", "+ fragments (F = 4)", ("outer.fragments=4",)),
          ("overlap", "+ overlap (tau = 1)", ("outer.overlap=1",)),
          ("alpha", "+ alpha-mixing 0.5", ("outer.alpha=0.5",)),
          ("int4", "+ int4 payloads", ("outer.codec=int4",)),
          ("radial", "+ radial-directional merge", ("outer.merge=radial",)),
          ("tokens", "+ token weighting (the previous default)", ("outer.weighting=tokens",)),
          ("default", "+ outer lr 0.5, H = 28 (= the demo default)", ("outer.lr=0.5", "outer.sync_every=28")))
"""The rungs above plain DiLoCo: (slug suffix, label, the overrides it adds). The last one is the default."""
DEFAULT_H = 28
H_SWEEP = (10, 25, 50, 100)
"""H on the default (every other setting the default's) at 1,200 steps; the default's own H is its ladder row."""
LEVERS = (("ef", "error feedback on the int4 codec", ("outer.error_feedback=true",)),
          ("final-avg", "the last sync averages the weights (no outer step)", ("outer.final_average=true",)),
          ("ilr4e3", "inner lr 4e-3 (3e-3)", ("inner.lr=4e-3",)),
          ("m095", "outer momentum 0.95 (0.9)", ("outer.momentum=0.95",)),
          ("alpha075", "alpha-mixing 0.75 (0.5)", ("outer.alpha=0.75",)))
"""Changes tried on top of the default at 1,200 steps to move the curve: (slug suffix, label, overrides)."""
TARGET_GAP = {1200: 0.75, 2400: 0.85}
"""Issue 20's acceptance: share of the gap the default closes, per budget."""
TARGET_BYTES_SAVED = 200.0
"""... at at least this many times fewer payload bytes than fp32 data-parallel."""
MAX_LOSS_VS_DILOCO = 0.01
"""... and never worse than plain DiLoCo at the same budget by more than this (relative eval loss)."""
TRADE_TICKS = (20, 50, 100, 200, 500, 1000)
"""Payload reductions marked on the figure's log axis (plain fp32 DiLoCo at H = 25 is about 25x)."""
RUN_KEYS = ("config", "mode", "sim_hash")
"""What a run file must match for the row to be skipped: the same simulation, however its overrides were spelt
(a row whose overrides now name a value that was the config's default then is the same run)."""


def sim_hash(cfg: Config, mode: str) -> str:
    """The config hash without the sections the simulation does not read: ``averaging`` (only the networked
    learner reads it), and for the references (``single``, ``data-parallel``) ``outer`` too. A finished simulation
    stays valid when a default it does not read changes (``averaging.record_ttl_s`` went from 10 to 30 s while the
    first grid ran; the references stand for every outer setting)."""
    unread = {"averaging": None} if mode == "diloco" else {"averaging": None, "outer": None}
    return config_hash(replace(cfg, **unread))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Row:
    """One simulation of the grid."""

    slug: str
    """File name in ``runs/`` and the row's name on the page."""
    group: str
    """reference | ladder | H | 2400."""
    label: str
    mode: str
    """diloco | data-parallel | single."""
    steps: int
    overrides: tuple[str, ...] = ()
    """On top of the demo config and ``inner.total_steps``."""

    def run_overrides(self, quick: bool, extra: list[str]) -> list[str]:
        """Every ``--set`` of the run, in order (what its run file records)."""
        steps = self.steps // QUICK_DIVISOR if quick else self.steps
        return [f"inner.total_steps={steps}", *([f"inner.warmup_steps={QUICK_WARMUP_STEPS}"] if quick else []),
                *self.overrides, *extra]


def grid() -> list[Row]:
    """The rows in the order they are worth running: references at 1,200, the ladder, the levers, the H rows,
    then 2,400."""
    rows = [Row("s1200-single", "reference", "one learner alone", "single", 1200),
            Row("s1200-data-parallel", "reference", "data-parallel, 4x batch", "data-parallel", 1200),
            Row("s1200-diloco", "ladder", "plain DiLoCo", "diloco", 1200, PLAIN_DILOCO)]
    ladder = dict(o.split("=", 1) for o in PLAIN_DILOCO)
    for suffix, label, changes in LADDER:
        ladder.update(c.split("=", 1) for c in changes)  # the rung's changes, in place: every key is set once
        # the last rung is the default itself: run with no overrides, as `p2p-diloco sim` runs the demo config
        overrides = () if suffix == "default" else tuple(f"{k}={v}" for k, v in ladder.items())
        rows.append(Row(f"s1200-{suffix}", "ladder", label, "diloco", 1200, overrides))
    rows += [Row(f"s1200-{suffix}", "lever", label, "diloco", 1200, changes) for suffix, label, changes in LEVERS]
    rows += [Row(f"s1200-h{h}", "H", f"H = {h}", "diloco", 1200, (f"outer.sync_every={h}",)) for h in H_SWEEP]
    previous = ("outer.lr=0.7", "outer.sync_every=25")
    rows += [Row("s2400-single", "reference", "one learner alone", "single", 2400),
             Row("s2400-data-parallel", "reference", "data-parallel, 4x batch", "data-parallel", 2400),
             Row("s2400-default", "2400", f"the default (outer lr 0.5, H = {DEFAULT_H})", "diloco", 2400),
             Row("s2400-previous", "2400", "the previous default (outer lr 0.7, H = 25)", "diloco", 2400, previous),
             Row("s2400-h100", "2400", "H = 100 on the default", "diloco", 2400, ("outer.sync_every=100",)),
             Row("s2400-h100-olr07", "2400", "H = 100, outer lr 0.7", "diloco", 2400,
                 ("outer.lr=0.7", "outer.sync_every=100"))]
    return rows


def selects(only: str, slug: str) -> bool:
    """Whether ``--only only`` selects the row ``slug``: the same slug, or a prefix of it ending in '*'."""
    return slug.startswith(only[:-1]) if only.endswith("*") else slug == only


def check_ladder(config: str) -> None:
    """The ladder must end at the demo default, or its last rung is not what the page says it is."""
    top = load_config(config, [*PLAIN_DILOCO, *(c for _, _, changes in LADDER for c in changes)])
    if config_hash(top) != config_hash(load_config(config)):
        raise ValueError(f"{config}: plain DiLoCo plus every rung of the ladder is not the config's default "
                         f"(the ladder ends at outer lr 0.5 and H = {DEFAULT_H} with the config's other settings)")


def expected(row: Row, config: str, quick: bool, extra: list[str]) -> dict[str, Any]:
    """What a run file of ``row`` records about how it was run (:data:`RUN_KEYS`)."""
    overrides = row.run_overrides(quick, extra)
    return {"config": _bench.repo_path(config), "mode": row.mode, "overrides": overrides,
            "sim_hash": sim_hash(load_config(config, overrides), row.mode)}


def same_run(run: dict[str, Any], how: dict[str, Any]) -> bool:
    """Whether a run file is the simulation that :func:`expected` describes (:data:`RUN_KEYS`)."""
    return all(run.get(k) == how[k] for k in RUN_KEYS)


def load_runs(out: Path) -> dict[str, dict[str, Any]]:
    """Every finished run in ``out/runs`` by slug (``*.json.tmp``, a run being written, is not one)."""
    folder = out / "runs"
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def write_run(out: Path, record: dict[str, Any]) -> Path:
    """``out/runs/<slug>.json``, written whole or not at all (a ``.json.tmp`` renamed into place)."""
    folder = out / "runs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record['slug']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_bench.relative_paths(record), indent=2) + "\n")
    os.replace(tmp, path)
    return path


class _Tagged(io.TextIOBase):
    """stderr with every line stamped with the time and the run's slug: two simulations share one log."""

    def __init__(self, stream: Any, tag: str) -> None:
        self.stream, self.tag, self.pending = stream, tag, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.stream.write(f"[{time.strftime('%H:%M:%S')}] {self.tag}: {line}\n")
        self.stream.flush()
        return len(text)


def _worker(task: tuple[Row, dict[str, Any], bool, Path]) -> dict[str, Any]:
    """One simulation, its run file written as soon as it ends. A failure is reported (traceback on stderr, an
    ``error`` in the result) and the grid goes on; ``main`` exits non-zero naming it."""
    row, how, quick, out = task
    sys.stderr = _Tagged(sys.__stderr__, row.slug)
    try:
        import torch

        from p2p_diloco.sim import simulator as sim

        torch.set_num_threads(1)
        print(f"start ({row.mode}, {' '.join(how['overrides'])})", file=sys.stderr)
        cfg: Config = load_config(how["config"], how["overrides"])
        summary = sim.run_from_config(cfg, mode=row.mode, progress=True).summary()
        record = {"slug": row.slug, "label": row.label, **how, "quick": quick,
                  "provenance": f"run by {BENCH.script}", "result": summary}
        write_run(out, record)
        print(f"done: eval {summary['final_eval_loss']:.4f} in {summary['wall_s']:.0f} s", file=sys.stderr)
        return record
    except Exception:  # reported and counted: one broken row must not kill the hours of the others
        traceback.print_exc()
        return {"slug": row.slug, "error": traceback.format_exc(limit=1).strip().splitlines()[-1]}


def adopt(row: Row, source: Path, how: dict[str, Any], out: Path) -> Path:
    """``source`` (a ``p2p-diloco sim --json`` output of exactly ``row``'s config and overrides) as ``row``'s run.
    Checks what the output itself can show: the same fields as this script's runs, the mode and the tokens."""
    result = json.loads(source.read_text())
    cfg = load_config(how["config"], how["overrides"])
    learners = 1 if row.mode == "single" else cfg.sim.learners
    tokens = learners * cfg.inner.batch_size * cfg.model.block_size * cfg.inner.total_steps
    fields = set(_summary_fields())
    if set(result) != fields:
        odd = sorted(set(result) ^ fields)
        raise ValueError(f"{source}: not a `p2p-diloco sim --json` output (fields {odd} differ)")
    if result["mode"] != row.mode or result["tokens"] != tokens:
        raise ValueError(f"{source}: mode {result['mode']} with {result['tokens']} tokens, but {row.slug} is "
                         f"{row.mode} with {tokens}")
    return write_run(out, {"slug": row.slug, "label": row.label, **how, "quick": False,
                           "provenance": _bench.repo_path(source.resolve()), "result": result})


def _summary_fields() -> list[str]:
    from p2p_diloco.sim.simulator import SimResult

    return list(SimResult(mode="single", learners=1).summary())


def summarise(rows: list[Row], runs: dict[str, dict[str, Any]], config: str, extra: list[str]) -> dict[str, Any]:
    """The page's figures: every row with its run's numbers, or ``status`` "not run yet"; then the acceptance.
    A run file of another simulation than the row's (another mode, or a config hash that the row's overrides on
    today's config do not give: a grid or a default changed since) counts as not run."""
    table: list[dict[str, Any]] = []
    for row in rows:
        run = runs.get(row.slug)
        entry: dict[str, Any] = {"slug": row.slug, "group": row.group, "label": row.label, "mode": row.mode,
                                 "steps": row.steps, "status": "not run yet"}
        if run and same_run(run, expected(row, config, run["quick"], extra)):
            r = run["result"]
            entry.update(status="done", quick=run["quick"], provenance=run["provenance"],
                         sim_hash=run["sim_hash"], eval_loss=r["final_eval_loss"], bytes_sent=r["bytes_sent"],
                         bytes_saved_vs_dp_fp32=r["bytes_saved_vs_dp_fp32"], wall_s=r["wall_s"], tokens=r["tokens"],
                         curve=r["curve"])
        table.append(entry)
    by = {e["slug"]: e for e in table}
    for e in table:
        single, dp = by[f"s{e['steps']}-single"], by[f"s{e['steps']}-data-parallel"]
        if e["status"] == "done" and single["status"] == dp["status"] == "done":
            e["gap_closed"] = bench_parity.gap_closed(e["eval_loss"], single["eval_loss"], dp["eval_loss"])
    return {"config": _bench.repo_path(config), "extra_overrides": extra,
            "quick": any(e.get("quick") for e in table), "rows": table, "acceptance": acceptance(by)}


def acceptance(by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 20's acceptance on what has run: each check's figures and ``met`` (None while a run is missing)."""
    checks: dict[str, Any] = {}
    for steps, target in TARGET_GAP.items():
        d = by[f"s{steps}-default"]
        gap, saved = d.get("gap_closed"), d.get("bytes_saved_vs_dp_fp32")
        checks[f"default_{steps}"] = {"gap_closed": gap, "bytes_saved_vs_dp_fp32": saved, "target_gap": target,
                                      "met": None if gap is None else gap >= target and saved >= TARGET_BYTES_SAVED}
    d, plain = by["s1200-default"], by["s1200-diloco"]
    vs = d["eval_loss"] / plain["eval_loss"] - 1 if d["status"] == plain["status"] == "done" else None
    checks["default_vs_diloco_1200"] = {"loss_vs_diloco": vs, "met": None if vs is None else vs <= MAX_LOSS_VS_DILOCO}
    return checks


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


def render(out: Path, rows: list[Row], config: str, extra: list[str], draw: bool, echo: bool = False) -> None:
    """The summary JSON and the page from ``out/runs`` (the figure too when ``draw``)."""
    _bench.publish(bench_for(config), out, summarise(rows, load_runs(out), config, extra), table,
                   plot if draw else None, echo=echo)


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml",
                      quick=f"1/{QUICK_DIVISOR} of the steps: checks the pipeline, not the numbers")
    p.add_argument("--workers", type=int, default=2, help="parallel simulations, one torch thread each (default: 2)")
    p.add_argument("--only", action="append", default=[], metavar="SLUG",
                   help="run only this row (repeatable); SLUG ending in '*' selects every row whose slug starts with "
                        "the rest, e.g. 's1200-h*'")
    p.add_argument("--adopt", action="append", default=[], metavar="SLUG=PATH",
                   help="record a `p2p-diloco sim --json` output of exactly that row's config and overrides as its "
                        "run, then render; nothing is simulated (repeatable)")
    args = p.parse_args(argv)
    rows, out = grid(), args.out
    if args.render_only or args.replot:
        render(out, rows, args.config, args.overrides, draw=args.replot or not bench_for(args.config).png_path(out).exists())
        return 0
    check_ladder(args.config)
    by = {r.slug: r for r in rows}
    if args.adopt:
        for item in args.adopt:
            slug, _, source = item.partition("=")
            if slug not in by or not source:
                raise SystemExit(f"--adopt {item}: expected SLUG=PATH with SLUG one of {', '.join(by)}")
            how = expected(by[slug], args.config, False, args.overrides)
            print(f"adopted {adopt(by[slug], Path(source), how, out)}", file=sys.stderr)
        render(out, rows, args.config, args.overrides, draw=True)
        return 0

    runs = load_runs(out)
    todo = []
    for row in rows:
        if args.only and not any(selects(s, row.slug) for s in args.only):
            continue
        how = expected(row, args.config, args.quick, args.overrides)  # loads each config: fails before any fork
        old = runs.get(row.slug)
        if old is not None and same_run(old, how):
            print(f"bench_parity_demo: {row.slug} already run ({old['provenance']}): skipped", file=sys.stderr)
            continue
        if old is not None:
            print(f"bench_parity_demo: {row.slug}: its run file is of another config or overrides: run again",
                  file=sys.stderr)
        todo.append((row, how, args.quick, out))
    print(f"bench_parity_demo: {len(todo)} runs on {args.workers} workers -> {out}", file=sys.stderr, flush=True)
    failed = []
    # SIGTERM (`kill <pid>` of this process) unwinds through the pool's `with`, which terminates the workers: no
    # simulation outlives the grid that started it; finished runs are on disk already
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if todo:
        # spawn, not fork: the pool starts a fresh worker for every run while this process draws the page with
        # matplotlib, and a fork then can copy a held lock into the child, which hangs before it starts
        with mp.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
            for record in pool.imap_unordered(_worker, todo, chunksize=1):  # dispatched in the grid's order
                if "error" in record:
                    failed.append(f"{record['slug']} ({record['error']})")
                render(out, rows, args.config, args.overrides, draw=True)
    render(out, rows, args.config, args.overrides, draw=True, echo=True)
    if failed:
        print(f"bench_parity_demo: failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    print(f"bench_parity_demo: done; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
