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
``parity-demo.png`` into ``--out`` (default ``results/parity-demo``). This script runs and keeps the runs; the grid
and its acceptance are in ``bench_parity_demo_grid.py``, the page in ``bench_parity_demo_page.py``.
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
from pathlib import Path
from typing import Any

import _bench
from bench_parity_demo_grid import QUICK_DIVISOR, Row, check_ladder, expected, grid, same_run, selects, summarise
from bench_parity_demo_page import BENCH, bench_for, plot, table

from p2p_diloco.core.config import Config, load_config


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
