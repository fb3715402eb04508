"""The data-parallel reference of a run: the held-out eval loss conventional training reaches on the same tokens.

Data-parallel here is one replica trained in one process with fp32 gradients averaged every step over
K x the per-learner batch (what data-parallel training over K machines computes), on all shards, with
the run's model, data, inner optimizer and seed, and a warm-up + cosine over exactly the steps that reach
its tokens (:func:`compute_curve`). Its eval loss is recorded at points along the way: a *curve*.

A curve depends on the model, data, inner optimizer, seed and K (:func:`reference_key`), not on the outer
algorithm. Because its LR schedule ends at the curve's last point, a curve is only a fair reference near
that end (:data:`SPAN`): far before it, its learning rate has not decayed yet and its loss is not that of a
run of that length; where two curves' ends bracket a run's tokens, the reference comes from those ends
(:func:`between_ends`, :data:`MAX_END_GAP`). So the curves of one key form a ladder of lengths, and :func:`plan` picks the one that
covers a run's tokens, or says that one must be computed. Curves are looked up in the cache
(:func:`cache_dir`), where ``p2p-diloco swarm`` stores the curves it computes, then among the curves that ship
with the configs (:func:`bundled_dir`: ``configs/reference``, package data). ``scripts/bench_reference.py``
writes curves into ``results/reference``; those the bundled configs need are copied into ``configs/reference``.
Nothing is read from ``results/`` at run time (it is not installed).

Only the standard library is imported at module level (``p2p-diloco --help`` stays fast).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2p_diloco.core import resources

logger = logging.getLogger(__name__)

SPAN = (0.75, 1.1)
"""A curve ending at E tokens is the reference at T tokens when ``SPAN[0] * E <= T <= SPAN[1] * E``: inside
its last quarter (at 3/4 of the cosine the LR is 0.23 of its peak, at the end ``inner.min_lr_ratio`` = 0.1)
or up to 10% past its end (its last point is taken: slightly pessimistic for data-parallel)."""
MAX_END_GAP = 2.0
"""Two curves whose ends bracket a run's tokens, at most this ratio apart, give its reference from their ends
(:func:`between_ends`): each end is data-parallel training whose cosine ended there, as a time-budgeted run's own ends with its time
(``inner.lr_by_time``). Reading one curve inside its last quarter (:data:`SPAN`) is not that: on the bundled demo
curves a curve's end lies 2-5% above the longer curves at the same tokens (the LR's decay costs more than it gains this
early in training), so the main job's reference at 4.09M tokens read 1.506 off the 4.8M curve at 85% of its cosine
and, at 4.01M, 1.596 off the 3.7M curve's end 8% past it, where the ends bracketing either give 1.55: the
same run was +12.3% or +6.0% against data-parallel by which curve it fell on. The stored ends' losses are
close to linear in log tokens (a slope of 0.49-0.56 per e-fold from 2.0M to 4.8M)."""
CURVE_NAME_RE = re.compile(r"^dp-([0-9a-f]{16})(?:-(\d+))?\.json$")
"""``dp-<reference key>.json`` (the first committed curve) or ``dp-<reference key>-<tokens>.json``."""


def reference_key(cfg: Any) -> str:
    """What a data-parallel reference depends on: the model, data, inner optimizer, seed and number of
    replicas (not the outer algorithm, averaging or the step budget), as a 16-hex-digit hash."""
    from p2p_diloco.core.identity import inner_identity, model_identity, reference_data_identity

    d = cfg.to_dict()
    inner = {k: v for k, v in inner_identity(cfg.inner).items() if k != "total_steps"}
    blob = json.dumps({"model": model_identity(cfg.model), "data": reference_data_identity(cfg.data), "inner": inner, "seed": d["run"]["seed"],
                       "replicas": d["sim"]["learners"]}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """Where computed curves are kept: ``$P2P_DILOCO_CACHE/reference``, else
    ``$XDG_CACHE_HOME/p2p-diloco/reference``, else ``~/.cache/p2p-diloco/reference``."""
    if os.environ.get("P2P_DILOCO_CACHE"):
        return Path(os.environ["P2P_DILOCO_CACHE"]) / "reference"
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "p2p-diloco" / "reference"


def bundled_dir() -> Path:
    """The curves that ship with the configs (package data: ``configs/reference``)."""
    return resources.reference_dir()


def folders() -> list[Path]:
    """Where stored curves are looked up: the cache first (curves computed on this machine), then the bundled
    ones (:func:`load_curves` reads every folder; :func:`plan` picks among all of their curves)."""
    return [cache_dir(), bundled_dir()]


def curve_end(curve: dict[str, Any]) -> int:
    """The tokens of a curve's last point (where its LR schedule ends)."""
    return int(max(float(p["tokens"]) for p in curve["curve"]))


def load_curves(key: str, folders: Sequence[Path]) -> list[dict[str, Any]]:
    """Every curve for ``key`` in ``folders`` (``dp-<key>.json``, ``dp-<key>-<tokens>.json``), each with its
    ``path``; ValueError naming the file if one is not a curve for ``key``."""
    out = []
    for folder in folders:
        for path in sorted(folder.glob(f"dp-{key}*.json")) if folder.is_dir() else []:
            m = CURVE_NAME_RE.match(path.name)
            if not m or m.group(1) != key:
                continue
            ref = json.loads(path.read_text())
            if ref.get("reference_key") != key or not ref.get("curve"):
                raise ValueError(f"{path}: not a reference curve for reference key {key}")
            out.append({**ref, "path": resources.shown(path)})
    return out


def plan(ends: Sequence[int], tokens: int) -> tuple[int | None, str]:
    """Which curve is the reference at ``tokens``, given the curves' end tokens: (index into ``ends``, why),
    or (None, why) when none covers it (:data:`SPAN`) and one must be computed. Of those that cover it, the
    one ending nearest ``tokens`` (ratio), the longer on a tie."""
    if tokens <= 0:
        return None, f"no tokens to compare at ({tokens})"
    fits = [(abs(math.log(e / tokens)), -e, i) for i, e in enumerate(ends) if e > 0 and SPAN[0] * e <= tokens <= SPAN[1] * e]
    if fits:
        i = min(fits)[2]
        return i, f"the curve of {ends[i]:,} tokens covers {tokens:,}"
    if not ends:
        return None, "no curve for this model, data, optimizer and number of learners"
    shown = ", ".join(f"{e:,}" for e in sorted(ends))
    return None, (f"no curve covers {tokens:,} tokens (curves end at {shown}; one is the reference from "
                  f"{SPAN[0]:g}x to {SPAN[1]:g}x its length)")


def covered(ends: Sequence[int]) -> list[tuple[float, float]]:
    """The token ranges that curves ending at ``ends`` cover (:data:`SPAN`), overlapping or touching ones
    merged, in order: a run whose tokens lie in one of them finds its reference stored (:func:`plan`)."""
    ranges: list[tuple[float, float]] = []
    for lo, hi in sorted((SPAN[0] * e, SPAN[1] * e) for e in ends if e > 0):
        if ranges and lo <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], hi))
        else:
            ranges.append((lo, hi))
    return ranges


def reference_at(ref: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The curve's eval loss at ``tokens`` (linear between its points; its last point up to 10% past its end)."""
    from p2p_diloco.sim.curves import value_at

    points = sorted((float(p["tokens"]), float(p["eval_loss"])) for p in ref["curve"])
    loss = value_at(points, tokens)
    if loss is None:  # past the last point (plan() allows 10%)
        loss = points[-1][1]
    return {"path": ref["path"], "tokens": tokens, "eval_loss": loss, "command": ref.get("command"),
            "reference_tokens": int(points[-1][0]), "reference_final_eval_loss": points[-1][1]}


def bracketing(ends: Sequence[int], tokens: int) -> tuple[int, int] | None:
    """The curves whose ends lie nearest below and above ``tokens`` (indexes into ``ends``; ends equal where a
    curve ends exactly there), if at most :data:`MAX_END_GAP` apart; None otherwise."""
    below = [(e, -i) for i, e in enumerate(ends) if 0 < e <= tokens]  # on a tie the first folder's (the cache)
    above = [(e, i) for i, e in enumerate(ends) if e >= tokens]
    if not below or not above:
        return None
    (lo, i), (hi, j) = max(below), min(above)
    return (-i, j) if hi <= MAX_END_GAP * lo else None


def between_ends(low: dict[str, Any], high: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The reference at ``tokens`` from the final eval losses of two curves whose ends bracket it (:func:`bracketing`),
    linear in log tokens between them: an estimate of the curve a run of exactly ``tokens`` would compute, as
    :func:`reference_at` gives from one curve."""
    (e0, l0), (e1, l1) = (max((float(p["tokens"]), float(p["eval_loss"])) for p in c["curve"]) for c in (low, high))
    loss = l0 if e1 == e0 else l0 + (l1 - l0) * math.log(tokens / e0) / math.log(e1 / e0)
    return {"path": f"{low['path']} and {high['path']}", "tokens": tokens, "eval_loss": loss, "command": high.get("command"),
            "reference_tokens": tokens, "reference_final_eval_loss": loss, "between": [int(e0), int(e1)]}


def lookup(key: str, tokens: int, folders: Sequence[Path]) -> tuple[dict[str, Any] | None, str]:
    """The reference at ``tokens`` from the stored curves, or (None, why none covers it): where the curves' ends
    bracket ``tokens`` (:func:`bracketing`), from their ends (:func:`between_ends`), else read off the curve
    :func:`plan` picks."""
    curves = load_curves(key, folders)
    ends = [curve_end(c) for c in curves]
    i, why = plan(ends, tokens)
    if i is None:
        return None, why
    pair = bracketing(ends, tokens)
    if pair is None or ends[pair[0]] == ends[pair[1]]:  # (or a curve ends at ``tokens``: its end)
        return reference_at(curves[i], tokens), why
    low, high = (curves[k] for k in pair)
    return between_ends(low, high, tokens), f"the curves ending at {ends[pair[0]]:,} and {ends[pair[1]]:,} bracket {tokens:,}"


def steps_for(cfg: Any, tokens: int) -> int:
    """Data-parallel steps (of ``sim.learners`` x batch) that reach ``tokens``; at least the warm-up + 1."""
    per_step = cfg.sim.learners * cfg.inner.batch_size * cfg.model.block_size
    return max(cfg.inner.warmup_steps + 1, math.ceil(tokens / per_step))


def compute_curve(config: str | None, overrides: Sequence[str], tokens: int, eval_points: int = 12,
                  progress: bool = True, command: str | None = None) -> dict[str, Any]:
    """Train the data-parallel reference of ``tokens`` (rounded up to whole steps) in this process; its
    curve as stored (``dp-<key>-<tokens>.json``). ``progress``: a line on stderr at every eval point."""
    if tokens <= 0 or eval_points <= 0:
        raise ValueError(f"reference: tokens and eval points must be > 0, got {tokens} and {eval_points}")
    from p2p_diloco.core import data
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.identity import config_hash
    from p2p_diloco.sim import simulator as sim

    cfg = load_config(config, list(overrides))
    steps = steps_for(cfg, tokens)
    ref_cfg = load_config(config, [*overrides, f"inner.total_steps={steps}"])
    t0 = time.monotonic()
    splits = data.load_training_data(cfg, cfg.sim.learners)
    result = sim.run_reference(ref_cfg, splits, "data-parallel", eval_points=eval_points, progress=progress)
    return {
        "config": config, "overrides": list(overrides), "config_hash": config_hash(cfg),
        "reference_key": reference_key(cfg), "mode": "data-parallel",
        "replicas": cfg.sim.learners, "steps": steps, "tokens": result.tokens, "final_eval_loss": result.final_eval_loss,
        "curve": result.curve, "wall_s": round(time.monotonic() - t0, 1), "command": command,
    }


def save_curve(payload: dict[str, Any], folder: Path) -> Path:
    """Write a curve as ``folder/dp-<key>-<tokens>.json``; returns the path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"dp-{payload['reference_key']}-{payload['tokens']}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
