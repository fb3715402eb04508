"""``scripts/chaos.py``'s analysis: every reported figure from a run's raw record (pure, unit-tested).

:func:`analyse` reads ``chaos.json`` less its ``analysis`` and returns that ``analysis``: the goodput figures
(:mod:`chaos_goodput`) and

* **longest inner-loop stall** of a survivor: the largest ``max_stall_s`` (longest single wait of
  the inner loop between two steps, from each learner's final summary) over the incarnations that
  printed one, leaving out a SIGSTOPped incarnation whose stall is at least as long as one of its
  stops (that stall may *be* the stop: the chaos itself). The largest over all incarnations is
  reported too.
* **rounds failed and why**: discarded round events (one per learner per round) grouped by
  :func:`normalise_reason` (peer ids, hashes and numbers masked), per run.
* **anchors identical at the end**, among the incarnations that finished together (final summaries within
  ``TOGETHER_WINDOW_S`` of the last one; :func:`end_state`), which are named, and the others with why
  (killed and restarted as ..., exited without a summary, left early).
* **eval loss** of the global model at the end: the median ``eval_loss_end`` of the finished
  incarnations holding the most advanced anchors (highest fragment versions; normally all of them,
  anchors are identical at the end), chaos vs baseline, as a relative difference.

Baseline steps (:func:`steps_per_learner`): each learner runs ``--steps`` = the inner steps of all its chaos
incarnations; a killed incarnation's steps are the largest ``step`` in its events file (steps after its last
round or resync are not counted: a slight under-count, at most one sync period per kill); a resumed incarnation
counts from the step it resumed at. Without checkpoints a restarted incarnation starts its learning-rate
schedule, AdamW state and data order at step 0 again; the baseline does not.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

import _bench
from chaos_goodput import chaos_rates, goodput, learner_time_goodput, time_away
from chaos_run import LINGER_S

from p2p_diloco.local.run import Ending, finished_together

TARGET_GOODPUT = 0.85
TARGET_STALL_S = 5.0
TARGET_EVAL_GAP = 0.03
"""Chaos eval loss may be at most this much (relative) above the baseline's."""
STOP_TOLERANCE_S = 0.5
"""A stopped incarnation's stall within this of one of its stops may contain that stop."""
TOGETHER_WINDOW_S = LINGER_S + 30.0
"""Incarnations whose final summaries arrive within this of the last one finished together (the end state,
anchors, is compared among them): those training until the end linger up to ``LINGER_S``, then evaluate."""
REASON_CHARS = 160


def normalise_reason(reason: str) -> str:
    """A discard reason with what differs between rounds masked (:func:`_bench.normalise_reason`)."""
    return _bench.normalise_reason(reason, REASON_CHARS)


def failed_reasons(rounds: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """Discarded rounds counted by :func:`normalise_reason`, most frequent first."""
    counts = Counter(normalise_reason(str(r.get("reason", ""))) for r in rounds if r["outcome"] != "committed")
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))



def survivor_stall(incarnations: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The longest inner-loop stall (``max_stall_s`` of the final summaries): over the survivors, i.e.
    leaving out a SIGSTOPped incarnation whose stall is at least as long as one of its stops (then the
    stall may be the stop itself), and over every incarnation. ``None`` values: not reported."""
    survivors: list[tuple[float, str]] = []
    overall: list[tuple[float, str]] = []
    excluded: list[str] = []
    for inc in incarnations:
        final = inc.get("final")
        stall = final.get("max_stall_s") if final else None
        if stall is None:
            continue
        overall.append((float(stall), inc["key"]))
        stops = [b - a for a, b in inc.get("stops", []) if b is not None]
        if stops and stall >= min(stops) - STOP_TOLERANCE_S:
            excluded.append(inc["key"])
        else:
            survivors.append((float(stall), inc["key"]))
    top, worst = max(survivors, default=None), max(overall, default=None)
    return {"survivors_max_s": top[0] if top else None, "survivors_max_at": top[1] if top else None,
            "overall_max_s": worst[0] if worst else None, "overall_max_at": worst[1] if worst else None,
            "excluded": excluded, "reported_by": len(overall)}


def incarnation_steps(inc: dict[str, Any]) -> int:
    """Inner steps of one incarnation: its final summary's, else (killed) the largest ``step`` in its events."""
    final = inc.get("final")
    steps = int(final["steps"]) if final else int(inc.get("max_step", 0))
    return max(0, steps - int(inc.get("resumed_from_step") or 0))  # a resumed one counts from its checkpoint


def steps_per_learner(incarnations: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Each learner's inner steps summed over its incarnations (the baseline's ``--steps``)."""
    out: dict[str, int] = {}
    for inc in incarnations:
        out[inc["learner"]] = out.get(inc["learner"], 0) + incarnation_steps(inc)
    return out


def final_model_eval(finals: Sequence[dict[str, Any]]) -> float | None:
    """Eval loss of the global model at the end: median ``eval_loss_end`` of the summaries holding the most
    advanced anchors (highest total fragment version); None if there are none."""
    if not finals:
        return None
    top = max(sum(f["versions"]) for f in finals)
    return statistics.median(f["eval_loss_end"] for f in finals if sum(f["versions"]) == top)


def incarnation_endings(incarnations: Sequence[dict[str, Any]]) -> list[Ending]:
    """How each incarnation ended, for :func:`p2p_diloco.local.run.finished_together`: when its final summary
    arrived (``final_s``; records without it: ``ended_s``), or why it has none."""
    out = []
    for inc in incarnations:
        if inc.get("final"):
            at = inc.get("final_s") if inc.get("final_s") is not None else inc.get("ended_s")
            out.append(Ending(inc["key"], float(at) if at is not None else None, "no end time recorded"))
            continue
        if inc.get("end") == "killed":
            n = int(inc["key"].rsplit(".", 1)[1])
            later = [i["key"] for i in incarnations if i["learner"] == inc["learner"]
                     and int(i["key"].rsplit(".", 1)[1]) == n + 1]
            when = f" at {inc['ended_s']:.0f} s" if inc.get("ended_s") is not None else ""
            why = f"killed (kill -9){when}, " + (f"restarted as {later[0]}" if later else "not restarted")
        elif inc.get("end") == "crashed":
            why = f"exited without a final summary (code {inc.get('exit_code')})"
        else:
            why = "no final summary"
        out.append(Ending(inc["key"], None, why))
    return out


def end_state(finals: dict[str, dict[str, Any]], endings: Sequence[Ending]) -> dict[str, Any]:
    """Are the anchors identical at the end, among the incarnations that finished together (and which they
    are; the others with why): ``{"identical", "together", "excluded"}``; ``identical`` None without finals."""
    together, excluded = finished_together(endings, TOGETHER_WINDOW_S)
    hashes = {tuple(finals[k]["anchor_hashes"]) for k in together if k in finals}
    return {"identical": len(hashes) == 1 if hashes else None, "together": together, "excluded": excluded}



def analyse(payload: dict[str, Any]) -> dict[str, Any]:
    """Every reported figure from a run's raw record (``chaos.json`` less its ``analysis``)."""
    chaos, base = payload["chaos"], payload.get("baseline") or {}
    incs: list[dict[str, Any]] = chaos["incarnations"]
    fragments = int(payload["fragments"])
    learners = sorted({inc["learner"] for inc in incs})
    rounds = [r for inc in incs for r in inc["rounds"]]
    chaos_finals = [inc["final"] for inc in incs if inc.get("final")]
    first = [inc["final"]["train_s"] for inc in incs if inc.get("final") and inc["key"].endswith(".0")]
    train_wall_s = statistics.median(first) if first else float(payload["duration_s"])
    base_finals: dict[str, dict[str, Any]] = base.get("finals") or {}
    if base_finals and all(base_finals.get(n, {}).get("train_s", 0) > 0 for n in learners):
        rates = {n: base_finals[n]["tokens"] / base_finals[n]["train_s"] for n in learners}
        rates_from = "baseline tokens / train_s of each learner"
    else:
        rates, rates_from = chaos_rates(incs, learners)
    good = goodput(incs, rates, train_wall_s, fragments) if rates else None
    base_rounds = base.get("rounds") or []
    chaos_eval, base_eval = final_model_eval(chaos_finals), final_model_eval(list(base_finals.values()))
    chaos_end = end_state({inc["key"]: inc["final"] for inc in incs if inc.get("final")}, incarnation_endings(incs))
    base_times: dict[str, float] = base.get("final_s") or {}
    base_end = end_state(base_finals, [Ending(n, base_times.get(n, 0.0)) for n in base_finals])
    gap = chaos_eval / base_eval - 1 if chaos_eval is not None and base_eval else None
    stall = survivor_stall(incs)
    tokens_per_step = int(payload["tokens_per_step"])
    per_learner = {}
    for name in learners:
        mine = [inc for inc in incs if inc["learner"] == name]
        stalls = [inc["final"].get("max_stall_s") for inc in mine if inc.get("final")]
        steps = sum(incarnation_steps(i) for i in mine)
        per_learner[name] = {
            "incarnations": len(mine), "steps": steps,
            "tokens_processed": steps * tokens_per_step,
            "committed": sum(r["outcome"] == "committed" for i in mine for r in i["rounds"]),
            "discarded": sum(r["outcome"] != "committed" for i in mine for r in i["rounds"]),
            "kills": sum(i["end"] == "killed" for i in mine), "stops": sum(len(i["stops"]) for i in mine),
            "max_stall_s": max((s for s in stalls if s is not None), default=None),
            "goodput": good["per_learner"][name]["goodput"] if good else None,
        }
    processed = sum(p["tokens_processed"] for p in per_learner.values())
    away = time_away(incs, float(payload["duration_s"]), len(learners))
    work_share = good["committed_tokens"] / processed if good and processed else None
    time_good = learner_time_goodput(away["ceiling"], work_share)
    verdicts = {
        "goodput": None if not good or good["goodput"] is None else good["goodput"] >= TARGET_GOODPUT,
        "learner_time_goodput": None if time_good is None else time_good >= TARGET_GOODPUT,
        "stall": None if stall["survivors_max_s"] is None else stall["survivors_max_s"] <= TARGET_STALL_S,
        "eval": None if gap is None else gap <= TARGET_EVAL_GAP,
    }
    return {
        "learners": learners, "train_wall_s": train_wall_s, "rates_tokens_per_s": rates, "rates_from": rates_from,
        "goodput": good, "stall": stall, "per_learner": per_learner,
        "rounds": {"committed": sum(r["outcome"] == "committed" for r in rounds),
                   "discarded": sum(r["outcome"] != "committed" for r in rounds),
                   "failed_reasons": failed_reasons(rounds)},
        "baseline_rounds": {"committed": sum(r["outcome"] == "committed" for r in base_rounds),
                            "discarded": sum(r["outcome"] != "committed" for r in base_rounds),
                            "failed_reasons": failed_reasons(base_rounds)} if base_rounds else None,
        "eval_loss_chaos": chaos_eval, "eval_loss_baseline": base_eval, "eval_gap": gap,
        "anchors_identical_chaos": chaos_end["identical"], "end_chaos": chaos_end,
        "anchors_identical_baseline": base_end["identical"], "end_baseline": base_end,
        "tokens_chaos": processed,
        "time_away": away,
        "share_of_ceiling": good["goodput"] / away["ceiling"] if good and good["goodput"] and away["ceiling"] else None,
        "work_share": work_share,
        "learner_time_goodput": time_good,
        "tokens_baseline": sum(f["tokens"] for f in base_finals.values()) if base_finals else None,
        "verdicts": verdicts,
    }

