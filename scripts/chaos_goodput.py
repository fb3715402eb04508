"""``scripts/chaos.py``'s goodput: how much of the allocated learner-time's work reached the global model (pure).

Two figures, both from a run's raw record (``chaos.json``'s ``chaos`` and ``baseline``), over the incarnations of
every learner (``l2.0``, ``l2.1``, ...: one peer across restarts):

* **goodput** = tokens whose work reached the global model / tokens the allocated learner-time would
  have produced. *Reached the model*: for each incarnation and fragment f, the sum of ``tokens_sent``
  over its committed rounds of f (tokens of this learner in that round's contribution), averaged over
  the fragments; summed over incarnations (:func:`committed_tokens`). Work lost to a kill -9 (progress
  not yet committed), to discarded final rounds, or never done while down or stopped is what goodput
  misses. *Allocated*: every learner for the whole training window (the median ``train_s`` of the first
  incarnations that finished, i.e. ``--max-time``), at that learner's no-chaos throughput: baseline
  tokens / baseline ``train_s``; with ``--no-baseline``, :func:`chaos_rates`. On a 2-core machine the
  survivors step faster while a learner is down (more CPU each), which pushes goodput up: read it with
  that in mind. Also per learner. Beside it, the **work share**: committed tokens / tokens processed
  (inner steps x tokens per step), which leaves the down time out.
* **goodput in learner-time** = (allocated learner-time - time down, starting up, stopped or gone after
  a learner's last incarnation ended early: :func:`time_away`) / allocated learner-time x the work share
  (:func:`learner_time_goodput`): the issue's "share of allocated learner-time whose work reached the
  model" read literally. It needs no throughput from another run, so neither the survivors' windfall of
  CPU nor the machine's speed drifting between the chaos run and the baseline moves it (on this shared
  machine the baseline's speed differed by 7% between two runs of the same schedule, and the token
  goodput with it).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def committed_tokens(rounds: Sequence[dict[str, Any]], fragments: int) -> float | None:
    """Tokens of one incarnation whose work reached the model: per fragment the sum of ``tokens_sent``
    over its committed rounds, averaged over the ``fragments``; None if a committed round lacks
    ``tokens_sent`` (learners older than that field)."""
    per_fragment = [0.0] * fragments
    for r in rounds:
        if r["outcome"] != "committed":
            continue
        if r.get("tokens_sent") is None:
            return None
        per_fragment[int(r["fragment"])] += float(r["tokens_sent"])
    return sum(per_fragment) / fragments


def goodput(incarnations: Sequence[dict[str, Any]], rates: dict[str, float], train_wall_s: float,
            fragments: int) -> dict[str, Any] | None:
    """Goodput overall and per learner (see the module docstring): committed tokens (:func:`committed_tokens`
    of every incarnation) / (``train_wall_s`` x the learner's no-chaos tokens/s ``rates[learner]``).
    None when a learner's rate or an incarnation's ``tokens_sent`` is unknown."""
    done: dict[str, float] = {}
    for inc in incarnations:
        tokens = committed_tokens(inc["rounds"], fragments)
        if tokens is None:
            return None
        done[inc["learner"]] = done.get(inc["learner"], 0.0) + tokens
    if not done or any(name not in rates for name in done) or train_wall_s <= 0:
        return None
    allocated = {name: train_wall_s * rates[name] for name in done}
    per_learner = {name: {"committed_tokens": round(done[name]), "allocated_tokens": round(allocated[name]),
                          "goodput": done[name] / allocated[name] if allocated[name] > 0 else None}
                   for name in sorted(done)}
    total_allocated = sum(allocated.values())
    return {"goodput": sum(done.values()) / total_allocated if total_allocated > 0 else None,
            "committed_tokens": round(sum(done.values())), "allocated_tokens": round(total_allocated),
            "train_wall_s": train_wall_s, "per_learner": per_learner}


def time_away(incarnations: Sequence[dict[str, Any]], window_s: float, learners: int) -> dict[str, Any]:
    """Learner-time the chaos itself took away, inside the training window ``[0, window_s]`` (seconds since
    the harness started): *down* (from a kill to the restart's spawn), *start-up* (spawn to training again,
    or to the window's end if it never got there), *stopped* (SIGSTOP to SIGCONT) and *gone* (from the end
    of a learner's last incarnation to the window's end: killed with no restart, crashed, or finished early).
    ``ceiling`` is the goodput a perfect protocol would reach under this schedule (1 - away / allocated),
    ignoring that the others step faster meanwhile."""
    def clip(a: float, b: float | None) -> float:
        return max(0.0, min(window_s, window_s if b is None else b) - max(0.0, a))

    by_learner: dict[str, list[dict[str, Any]]] = {}
    for inc in incarnations:
        by_learner.setdefault(inc["learner"], []).append(inc)
    down = startup = stopped = gone = 0.0
    for incs in by_learner.values():
        incs = sorted(incs, key=lambda i: int(i["key"].rsplit(".", 1)[1]))
        for prev, inc in zip(incs, incs[1:]):
            if prev.get("ended_s") is not None:
                down += clip(prev["ended_s"], inc["spawned_s"])
            startup += clip(inc["spawned_s"], inc.get("up_s"))
        for inc in incs:
            stopped += sum(clip(a, b) for a, b in inc.get("stops", []))
        if incs and incs[-1].get("ended_s") is not None:
            gone += clip(incs[-1]["ended_s"], None)
    allocated = learners * window_s
    away = down + startup + stopped + gone
    return {"down_s": down, "startup_s": startup, "stopped_s": stopped, "gone_s": gone, "away_s": away,
            "allocated_s": allocated,
            "away_share": away / allocated if allocated > 0 else None,
            "ceiling": 1.0 - away / allocated if allocated > 0 else None}


def learner_time_goodput(ceiling: float | None, work_share: float | None) -> float | None:
    """Goodput in learner-time: the share of the allocated learner-time spent training (``ceiling`` of
    :func:`time_away`: not down, starting up or stopped) times the share of the work done in it that reached
    the model (``work_share``: committed / processed tokens). Unlike the token goodput it does not divide by
    a throughput measured in another run, so the survivors' extra CPU while one learner is down and the
    machine's speed drifting between the two runs do not move it; None if either is unknown."""
    if ceiling is None or work_share is None:
        return None
    return ceiling * work_share


def chaos_rates(incarnations: Sequence[dict[str, Any]], learners: Sequence[str]) -> tuple[dict[str, float], str]:
    """No-baseline fallback for the no-chaos tokens/s, one rate for every learner: the median tokens /
    ``train_s`` of first incarnations that were never stopped (and so ran the whole window undisturbed
    by the chaos, only slowed or sped by the others'), else the median tokens / ``stepping_s`` of all
    finished incarnations. Returns (rates, how)."""
    clean = [inc["final"] for inc in incarnations
             if inc.get("final") and inc["key"].endswith(".0") and not inc.get("stops") and inc["final"]["train_s"] > 0]
    if clean:
        rate = statistics.median(f["tokens"] / f["train_s"] for f in clean)
        return {n: rate for n in learners}, f"median tokens/train_s of {len(clean)} undisturbed chaos learner(s)"
    finals = [inc["final"] for inc in incarnations if inc.get("final") and inc["final"]["stepping_s"] > 0]
    if finals:
        rate = statistics.median(f["tokens"] / f["stepping_s"] for f in finals)
        return {n: rate for n in learners}, f"median tokens/stepping_s of {len(finals)} chaos incarnation(s)"
    return {}, "no throughput known"

