"""``scripts/bench_parity_demo.py``'s grid: the simulations it runs, how a run file is recognised, what they add up to.

Every row of the grid is one simulation of the config with a few overrides (:class:`Row`): the references, the
ablation ladder from plain DiLoCo to the default, the levers, the H sweep and the 2,400-step rows. A finished run is
kept when its run file describes the same simulation (:func:`expected`, :func:`same_run`), and :func:`summarise` turns
the runs there are into the page's figures and issue 20's acceptance. Pure: nothing here runs a simulation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import _bench
import bench_parity

from p2p_diloco.core.config import Config, load_config
from p2p_diloco.core.identity import config_hash

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
