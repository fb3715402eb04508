#!/usr/bin/env python3
"""Chaos against a local swarm: seeded kill -9 and SIGSTOP/SIGCONT of learners, restarts, and what it cost.

Starts a bootstrap peer and K ``p2p-diloco join`` learners (real processes on 127.0.0.1) for a fixed
training time and, on a seeded schedule (:func:`make_schedule`), every ~60 s either

* **kills** one learner with kill -9 of its whole process group (CLI, DHT and averager processes,
  p2pd) and starts it again after a down time, as the *same peer* (same ``--identity`` file, same
  ``--name``, ``--wait-peers 0``, ``--max-time`` = the training time left, so that it ends with the
  others): it resumes from its newest complete checkpoint (every learner checkpoints every
  ``--checkpoint-every`` seconds, default 15; 0 = restart afresh), downloads the fragments the live
  peers moved on and rejoins by itself; or
* **stops** one learner with SIGSTOP to its whole process group and SIGCONTs it after a while.

Every incarnation trains until the end of the window whatever the machine's speed: there is no step
cap (``--steps`` = ``launcher.NO_STEP_LIMIT``; the LR's warm-up + cosine still runs over
``inner.total_steps`` steps, then stays at its floor, so the baseline's ``--steps`` replays it). Never
more than one learner is down or stopped at a time, and nothing happens in the first ~45 s
(start-up) or the last 60 s (final rounds). Every action is logged with its time in
``chaos_events.jsonl``. Then, unless ``--no-baseline``, the same learners run again without chaos
for the same number of inner steps each (so on the same number of tokens), and the two global
models are compared.

Learner incarnations: learner ``l2`` is one peer (``--name l2``, one identity file) across restarts;
its processes are incarnations ``l2.0``, ``l2.1``, ... with their own log and events files
(``logs/l2.1.log``, ``logs/l2.1.jsonl``).

Reported (definitions; the pure functions below compute them and are unit-tested):

* **goodput** = tokens whose work reached the global model / tokens the allocated learner-time would
  have produced. *Reached the model*: for each incarnation and fragment f, the sum of ``tokens_sent``
  over its committed rounds of f (tokens of this learner in that round's contribution), averaged over
  the fragments; summed over incarnations. Work lost to a kill -9 (progress not yet committed), to
  discarded final rounds, or never done while down or stopped is what goodput misses. *Allocated*:
  every learner for the whole training window (the median ``train_s`` of the first incarnations that
  finished, i.e. ``--max-time``), at that learner's no-chaos throughput: baseline tokens / baseline
  ``train_s``; with ``--no-baseline``, the median tokens / ``train_s`` of the chaos run's incarnations
  that were neither restarted nor stopped (else tokens / ``stepping_s`` of all finished ones). On a
  2-core machine the survivors step faster while a learner is down (more CPU each), which pushes
  goodput up: read it with that in mind. Also per learner. Beside it, the **work share**: committed
  tokens / tokens processed (inner steps x tokens per step), which leaves the down time out.
* **goodput in learner-time** = (allocated learner-time - time down, starting up, stopped or gone after
  a learner's last incarnation ended early) / allocated
  learner-time x the work share (:func:`learner_time_goodput`): the issue's "share of allocated
  learner-time whose work reached the model" read literally. It needs no throughput from another run,
  so neither the survivors' windfall of CPU nor the machine's speed drifting between the chaos run and
  the baseline moves it (on this shared machine the baseline's speed differed by 7% between two runs
  of the same schedule, and the token goodput with it).
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

Baseline steps: each learner runs ``--steps`` = the inner steps of all its chaos incarnations; a killed
incarnation's steps are the largest ``step`` in its events file (steps after its last round or resync
are not counted: a slight under-count, at most one sync period per kill); a resumed incarnation counts
from the step it resumed at. Without checkpoints a restarted incarnation starts its learning-rate
schedule, AdamW state and data order at step 0 again; the baseline does not.

    python scripts/chaos.py                 # 4 learners x 10 minutes on demo.toml, a kill or stop every ~60 s, then the baseline
    python scripts/chaos.py --quick         # tiny.toml, 3 learners, 90 s, every ~20 s: checks the pipeline, not the numbers
    python scripts/chaos.py --render-only   # rewrite the page (README.md) from chaos.json
    python scripts/chaos.py --reanalyse     # analyse the run in chaos.json again: rewrite it, the page and the figure

Writes ``chaos.json``, ``README.md`` (the page), ``chaos.png`` (a timeline per learner) and
``chaos_events.jsonl`` into ``--out``; logs and round events of every incarnation go to ``--out/logs``.
"""

from __future__ import annotations

import json
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import _bench

from p2p_diloco.core.waiting import poll_until
from p2p_diloco.hivemind_ext.procguard import signal_session
from p2p_diloco.local.launcher import NO_STEP_LIMIT, START_TIMEOUT_S, Child, LocalSwarm, read_jsonl
from p2p_diloco.local.run import Ending, finished_together

TARGET_GOODPUT = 0.85
TARGET_STALL_S = 5.0
TARGET_EVAL_GAP = 0.03
"""Chaos eval loss may be at most this much (relative) above the baseline's."""
LINGER_S = 30.0
"""Learners' ``--linger``: after the final rounds, how long they wait for the peers to agree."""
WAIT_PEERS_TIMEOUT_S = 120.0
"""The learners' own limit on waiting for ``--wait-peers`` (``LearnerOptions.wait_peers_timeout_s``)."""
FINISH_SLACK_S = 300.0
"""After the training time: final rounds, linger, evaluation and exit."""
PROGRESS_PERIOD_S = 30.0
EXIT_GRACE_S = 15.0
"""After every learner printed its summary, how long they may take to leave (tombstone) and exit by themselves."""
TICK_S = 0.25
"""The harness's loop period: how late an action may be, at most."""
MIN_RESTART_TRAIN_S = 10.0
"""A restart with less training time than this left is skipped (the schedule keeps restarts earlier)."""
STARTUP_ALLOWANCE_S = 30.0
"""``join --max-time`` counts from the learner's start, start-up and the wait for peers included: the first
incarnations get the training window plus this (generous) allowance, so that they train at least until the
window's end; restarts get what is left until the same end (their own start-up is inside it)."""
STOP_TOLERANCE_S = 0.5
"""A stopped incarnation's stall within this of one of its stops may contain that stop."""
TOGETHER_WINDOW_S = LINGER_S + 30.0
"""Incarnations whose final summaries arrive within this of the last one finished together (the end state,
anchors, is compared among them): those training until the end linger up to ``LINGER_S``, then evaluate."""
RESUMED_RE = re.compile(r"^resumed from \S+: step (\d+)")
TRAINING_START_RE = re.compile(r"learners ready; starting together in (-?[\d.]+) s")
BENCH = _bench.Bench("chaos", "chaos", "Under chaos: kill -9, SIGSTOP and restarts", "scripts/chaos.py", """\
A bootstrap peer and K `p2p-diloco join` learners (real processes on 127.0.0.1; 4 x 10 minutes on
`configs/demo.toml` by default) train for a fixed time while a seeded schedule, every ~`--every` seconds, either
**kills** one learner with kill -9 of its whole process group and starts it again after a down time as the *same
peer* (same identity and name; it resumes from its newest checkpoint, taken every `--checkpoint-every` seconds,
downloads the fragments the live peers moved on and rejoins by itself), or **stops** one with SIGSTOP and SIGCONTs
it after a while. Never more than one learner is down or stopped at a time, and nothing happens in the first ~45 s
(start-up) or the last 60 s (final rounds). Every incarnation trains until the end of the window (no step cap). Then
the same learners run again without chaos for the same number of inner steps each (equal tokens): the baseline.

- **Goodput (tokens)**: tokens whose work reached the global model (each incarnation's `tokens_sent` over its
  committed rounds, averaged over fragments) / tokens the allocated learner-time (every learner for the whole
  window) would have produced at the no-chaos run's speed. The survivors step faster while one learner is down
  (they share the CPU), which pushes it up.
- **Goodput (learner-time)**: the share of allocated learner-time spent training (not down, starting up or stopped)
  x the share of that work which reached the model; it needs no throughput from another run.
- **Longest inner-loop stall** of a survivor (a SIGSTOPped incarnation's stall that may be the stop itself is left
  out); rounds committed / discarded and why; anchors identical among the incarnations that finished together; the
  global model's eval loss, chaos vs baseline at equal tokens.

Targets: goodput >= 85%, stall <= 5 s, eval loss within +3% of the baseline's.""")


# ---------------------------------------------------------------- the schedule (pure)


@dataclass(frozen=True)
class ChaosAction:
    """One disruption: at ``at_s`` (seconds after training started) ``victim`` is killed (kill -9, restarted
    after ``down_s``) or stopped (SIGSTOP, SIGCONT after ``down_s``)."""

    at_s: float
    victim: str
    kind: str
    """"kill" or "stop"."""
    down_s: float

    @property
    def end_s(self) -> float:
        return self.at_s + self.down_s


@dataclass(frozen=True)
class ScheduleParams:
    """Pacing of :func:`make_schedule` (seconds)."""

    every_s: float = 60.0
    jitter_s: float = 15.0
    stop_s: tuple[float, float] = (10.0, 30.0)
    """SIGSTOP lasts uniformly this long."""
    down_s: tuple[float, float] = (15.0, 45.0)
    """A killed learner is restarted after uniformly this long."""
    quiet_start_s: float = 45.0
    """No action before this (start-up, the first rounds)."""
    quiet_end_s: float = 60.0
    """Every action is over (restarted / continued) this long before the end (final rounds, linger)."""
    settle_s: float = 20.0
    """The next action comes at least this long after the previous one ended (a restart takes ~15 s to
    come back): so only one learner is down or stopped at a time."""


QUICK_SCHEDULE = ScheduleParams(every_s=20.0, jitter_s=4.0, stop_s=(4.0, 8.0), down_s=(5.0, 10.0), quiet_start_s=15.0,
                                quiet_end_s=35.0, settle_s=6.0)
"""``--quick`` (90 s): a stop and a kill whose restart still gets ~15 s of training after its ~20 s start-up."""


def make_schedule(seed: int, duration_s: float, learners: Sequence[str], every_s: float = 60.0, jitter_s: float = 15.0,
                  stop_s: tuple[float, float] = (10.0, 30.0), down_s: tuple[float, float] = (15.0, 45.0),
                  quiet_start_s: float = 45.0, quiet_end_s: float = 60.0, settle_s: float = 20.0) -> list[ChaosAction]:
    """The chaos actions of a run of ``duration_s``, deterministic for ``seed``.

    Actions come every ``every_s`` +- ``jitter_s``, none before ``quiet_start_s``; each must be over
    (restart or SIGCONT) ``quiet_end_s`` before the end, and the next starts at least ``settle_s`` after
    the previous ended, so at most one learner is down or stopped at any time. Kinds alternate in
    pairs of random order (half kills, half stops); the victim is random, never the previous one.
    """
    if not learners:
        raise ValueError("make_schedule: no learners to disrupt")
    if every_s <= 0 or jitter_s < 0 or jitter_s >= every_s:
        raise ValueError(f"make_schedule: need every_s > jitter_s >= 0, got every_s={every_s}, jitter_s={jitter_s}")
    for what, (lo, hi) in (("stop_s", stop_s), ("down_s", down_s)):
        if not 0 < lo <= hi:
            raise ValueError(f"make_schedule: {what} must be 0 < low <= high, got {(lo, hi)}")
    rng = random.Random(seed)
    actions: list[ChaosAction] = []
    counts = {"kill": 0, "stop": 0}
    nominal = 0.0
    while True:
        nominal += every_s
        at = max(nominal + rng.uniform(-jitter_s, jitter_s), quiet_start_s)
        if actions:
            at = max(at, actions[-1].end_s + settle_s)
        if counts["kill"] == counts["stop"]:
            kind = rng.choice(("kill", "stop"))
        else:
            kind = "kill" if counts["kill"] < counts["stop"] else "stop"
        lo, hi = stop_s if kind == "stop" else down_s
        length = rng.uniform(lo, hi)
        last_end = duration_s - quiet_end_s
        if at + lo > last_end:
            return actions
        length = min(length, last_end - at)  # the last action may be shortened to end in time
        candidates = [n for n in learners if not actions or n != actions[-1].victim] or list(learners)
        actions.append(ChaosAction(at, rng.choice(candidates), kind, length))
        counts[kind] += 1
        nominal = max(nominal, at)


def check_schedule(actions: Sequence[ChaosAction], duration_s: float, quiet_start_s: float, quiet_end_s: float) -> None:
    """ValueError if two actions overlap or one falls in the quiet edges (what :func:`make_schedule` promises)."""
    for a in actions:
        if a.at_s < quiet_start_s or a.end_s > duration_s - quiet_end_s:
            raise ValueError(f"chaos action {a} is outside [{quiet_start_s}, {duration_s - quiet_end_s}] s")
    for a, b in zip(actions, actions[1:]):
        if b.at_s < a.end_s:
            raise ValueError(f"chaos actions overlap: {a} and {b}")


# ---------------------------------------------------------------- the figures (pure)

REASON_CHARS = 160


def normalise_reason(reason: str) -> str:
    """A discard reason with what differs between rounds masked (:func:`_bench.normalise_reason`)."""
    return _bench.normalise_reason(reason, REASON_CHARS)


def failed_reasons(rounds: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """Discarded rounds counted by :func:`normalise_reason`, most frequent first."""
    counts = Counter(normalise_reason(str(r.get("reason", ""))) for r in rounds if r["outcome"] != "committed")
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


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


# ---------------------------------------------------------------- running the swarm


@dataclass
class Incarnation:
    """One process of a learner (``key`` = ``<learner>.<n>``); times in seconds since the harness started."""

    learner: str
    key: str
    shard: int
    child: Child
    events: Path
    spawned: float
    up: float | None = None
    """When it printed its ``learner ...`` line (built, about to train)."""
    ended: float | None = None
    end: str = "running"
    """"final" (printed its summary), "killed" (by us), "crashed" (exited without a summary), "running"."""
    stops: list[list[float | None]] = field(default_factory=list)
    """[SIGSTOP, SIGCONT] times."""


class ChaosRun:
    """Bootstrap + learners on a :class:`LocalSwarm`, the schedule executed on them, every action logged."""

    def __init__(self, swarm: LocalSwarm, config: str, overrides: list[str], learners: int, duration_s: float,
                 schedule: list[ChaosAction], events_log: IO[str], stop: threading.Event,
                 checkpoint_every_s: float = 0.0) -> None:
        self.swarm, self.config, self.overrides = swarm, config, overrides
        self.checkpoint_every_s = checkpoint_every_s
        """> 0: every learner checkpoints this often and a restart resumes (``--resume``); 0: restarts start afresh."""
        self.names = [f"l{i}" for i in range(learners)]
        self.duration_s, self.schedule, self.log, self.stop = duration_s, schedule, events_log, stop
        self.t_harness = time.monotonic()
        self.train0: float | None = None
        """Training start, in seconds since the harness started (the schedule's zero)."""
        self.train0_wall: float | None = None
        self.incarnations: list[Incarnation] = []
        self.current: dict[str, Incarnation] = {}
        self.startup_s = 15.0
        """Spawn to ``learner ...`` line, the longest seen so far (first incarnations, then restarts): a restart
        with less training time left than this plus ``MIN_RESTART_TRAIN_S`` is skipped."""
        self.end_at: float | None = None
        """When every incarnation's ``--max-time`` runs out (seconds since the harness started): the first ones'
        spawn + window + ``STARTUP_ALLOWANCE_S``; restarts are given what is left until then."""
        self.peers = ""
        self.interrupted = False

    # -- helpers
    def now(self) -> float:
        return time.monotonic() - self.t_harness

    def rel(self, t: float) -> float:
        """Harness seconds -> seconds since training started."""
        return t - (self.train0 or 0.0)

    def record(self, event: str, t: float, **fields: Any) -> None:
        row = {"event": event, "t": round(self.rel(t), 3), "time": round(time.time() - (self.now() - t), 3), **fields}
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()

    def say(self, line: str) -> None:
        t = self.rel(self.now()) if self.train0 is not None else self.now()
        print(f"chaos: [{t:5.0f} s] {line}", file=sys.stderr, flush=True)

    def spawn(self, name: str, *, wait_peers: int, max_time_s: float) -> Incarnation:
        n = sum(inc.learner == name for inc in self.incarnations)
        key, shard = f"{name}.{n}", self.names.index(name)
        logs = self.swarm.logs
        sets = [a for o in self.overrides for a in ("--set", o)]
        if self.checkpoint_every_s > 0:  # a restart resumes from its newest complete checkpoint, if any
            from p2p_diloco.learner.checkpoint import list_checkpoints

            folder = self.swarm.tmp / f"ckpt-{name}"
            resume = ["--resume", str(folder)] if folder.exists() and list_checkpoints(folder) else \
                ["--checkpoint-dir", str(folder)]
            sets += [*resume, "--checkpoint-every", f"{self.checkpoint_every_s:g}"]
        child = self.swarm.start(key, [
            "join", "--initial-peers", self.peers, "--config", self.config, *sets, "--name", name,
            "--identity", str(self.swarm.tmp / f"{name}.id"), "--shard", str(shard), "--num-shards", str(len(self.names)),
            "--wait-peers", str(wait_peers), "--max-time", f"{max_time_s:.1f}", "--lr-schedule", "steps",
            "--steps", str(NO_STEP_LIMIT), "--linger", str(LINGER_S),
            "--events", str(logs / f"{key}.jsonl")])
        inc = Incarnation(name, key, shard, child, logs / f"{key}.jsonl", self.now())
        self.incarnations.append(inc)
        self.current[name] = inc
        return inc

    # -- phases
    def start(self) -> None:
        """Bootstrap and the first incarnations; returns once they started training together."""
        sets = [a for o in self.overrides for a in ("--set", o)]
        self.peers = self.swarm.start_bootstrap("--config", self.config, *sets)
        self.end_at = self.now() + self.duration_s + STARTUP_ALLOWANCE_S
        for name in self.names:
            self.spawn(name, wait_peers=len(self.names), max_time_s=self.duration_s + STARTUP_ALLOWANCE_S)
        def training_started() -> bool:
            self._note_up()
            for inc in self.incarnations:
                if not inc.child.alive:
                    raise RuntimeError(f"chaos: {inc.key} exited while starting (code {inc.child.popen.poll()}); "
                                       f"see {inc.child.log_path}")
                m = TRAINING_START_RE.search(inc.child.log_path.read_text(errors="replace")) \
                    if inc.child.log_path.exists() else None
                if m and self.train0 is None:
                    self.train0 = self.now() + max(0.0, float(m.group(1)))
            if self.stop.is_set():
                raise RuntimeError("chaos: interrupted while the learners were starting")
            return self.train0 is not None

        poll_until(training_started, START_TIMEOUT_S + WAIT_PEERS_TIMEOUT_S,
                   f"chaos: the learners' start of training (see {self.swarm.logs})", interval_s=TICK_S)
        assert self.train0 is not None
        self.train0_wall = time.time() + (self.train0 - self.now())
        self.record("training_start", self.train0, learners=self.names, duration_s=self.duration_s)
        for inc in self.incarnations:
            self.record("spawn", inc.spawned, learner=inc.learner, incarnation=inc.key, pid=inc.child.popen.pid)
        ups = [inc.up - inc.spawned for inc in self.incarnations if inc.up is not None]
        if ups:
            self.startup_s = max(ups)
        self.say(f"{len(self.names)} learners training for {self.duration_s:.0f} s; start-up took "
                 f"{self.startup_s:.0f} s; {len(self.schedule)} chaos actions scheduled")

    def run(self) -> None:
        """Execute the schedule, then wait for every learner's end (``FINISH_SLACK_S`` after training)."""
        assert self.train0 is not None
        pending = [(a.at_s, "begin", a) for a in self.schedule] + [(a.end_s, "end", a) for a in self.schedule]
        pending.sort(key=lambda p: p[0])
        deadline = self.train0 + self.duration_s + FINISH_SLACK_S
        next_report = self.now() + PROGRESS_PERIOD_S
        all_final_at: float | None = None
        while True:
            now = self.now()
            self._note_up()
            self._note_exits()
            while pending and self.rel(now) >= pending[0][0]:
                _, phase, action = pending.pop(0)
                skip_end = self._begin(action) if phase == "begin" else self._end(action)
                if skip_end:
                    pending = [p for p in pending if p[2] is not action]
            if not pending and all(inc.end != "running" for inc in self.current.values()):
                break  # every learner has exited
            if not pending and all(inc.end != "running" or inc.child.final() is not None
                                   for inc in self.current.values()):
                all_final_at = now if all_final_at is None else all_final_at
                if now - all_final_at > EXIT_GRACE_S:
                    break  # summaries printed; the swarm stops what has not exited yet
            if self.stop.is_set():
                self.interrupted = True
                self.say("interrupted: stopping every learner")
                self.record("interrupted", now)
                break
            if now > deadline:
                self.say(f"the run overran its deadline ({self.duration_s + FINISH_SLACK_S:.0f} s after the start); "
                         "stopping every learner")
                self.record("deadline", now)
                break
            if now >= next_report:
                next_report += PROGRESS_PERIOD_S
                self._progress()
            time.sleep(TICK_S)

    def continue_stopped(self) -> None:
        """SIGCONT every incarnation still stopped (before the swarm stops them: a stopped one cannot leave)."""
        for inc in self.incarnations:
            if inc.stops and inc.stops[-1][1] is None:
                self._signal_group(inc, signal.SIGCONT)
                inc.stops[-1][1] = self.now()
                self.record("cont", self.now(), learner=inc.learner, incarnation=inc.key, why="cleanup")

    def finish(self) -> None:
        """After the swarm closed: how the incarnations still running then ended (the harness stopped them)."""
        for inc in self.incarnations:
            if inc.end == "running":
                inc.end = "final" if inc.child.final() is not None else "crashed"
                inc.ended = self.now()
                self.record("exit", inc.ended, learner=inc.learner, incarnation=inc.key, end=inc.end,
                            code=inc.child.popen.poll(), why="stopped when the swarm closed")

    # -- actions
    def _begin(self, a: ChaosAction) -> bool:
        """Kill or stop the victim; True if skipped (then its end is dropped too)."""
        inc = self.current[a.victim]
        if not inc.child.alive or inc.child.final() is not None:
            self.say(f"skip {a.kind} of {a.victim}: {inc.key} is not training")
            self.record("skip", self.now(), action=asdict(a), why=f"{inc.key} not training")
            return True
        if a.kind == "kill":
            inc.child.kill()
            inc.end, inc.ended = "killed", self.now()
            self.record("kill", inc.ended, learner=a.victim, incarnation=inc.key, pid=inc.child.popen.pid,
                        steps_seen=_max_step(read_jsonl(inc.events)), restart_in_s=a.down_s)
            self.say(f"kill -9 {a.victim} ({inc.key}, pid {inc.child.popen.pid}); restart in {a.down_s:.0f} s")
        else:
            self._signal_group(inc, signal.SIGSTOP)
            inc.stops.append([self.now(), None])
            self.record("stop", self.now(), learner=a.victim, incarnation=inc.key, pid=inc.child.popen.pid,
                        cont_in_s=a.down_s)
            self.say(f"SIGSTOP {a.victim} ({inc.key}, pid group {inc.child.popen.pid}) for {a.down_s:.0f} s")
        return False

    def _end(self, a: ChaosAction) -> bool:
        inc = self.current[a.victim]
        if a.kind == "stop":
            self._signal_group(inc, signal.SIGCONT)
            if inc.stops and inc.stops[-1][1] is None:
                inc.stops[-1][1] = self.now()
            self.record("cont", self.now(), learner=a.victim, incarnation=inc.key)
            self.say(f"SIGCONT {a.victim} ({inc.key})")
            return False
        assert self.train0 is not None and self.end_at is not None
        budget = self.end_at - self.now()  # --max-time counts the restart's own start-up too
        left = budget - self.startup_s
        if left < MIN_RESTART_TRAIN_S:
            self.record("skip", self.now(), action=asdict(a), why=f"only {left:.0f} s of training left")
            self.say(f"no restart of {a.victim}: only {left:.0f} s of training would be left")
            return False
        new = self.spawn(a.victim, wait_peers=0, max_time_s=budget)
        self.record("restart", new.spawned, learner=a.victim, incarnation=new.key, pid=new.child.popen.pid,
                    max_time_s=round(budget, 1))
        self.say(f"restart {a.victim} as {new.key} (same identity), about {left:.0f} s of training")
        return False

    def _signal_group(self, inc: Incarnation, sig: signal.Signals) -> None:
        """Signal the whole peer: its session (it leads one), whose helpers have process groups of their own."""
        if signal_session(inc.child.popen.pid, sig) == 0:
            self.record("signal_failed", self.now(), incarnation=inc.key, signal=sig.name, why="no such session")

    # -- watching
    def _note_up(self) -> None:
        for inc in self.incarnations:
            if inc.up is None and inc.child.find(r"^learner "):
                inc.up = self.now()
                if self.train0 is not None:
                    self.startup_s = max(self.startup_s, inc.up - inc.spawned)
                    self.record("up", inc.up, learner=inc.learner, incarnation=inc.key,
                                startup_s=round(inc.up - inc.spawned, 1))
                    self.say(f"{inc.key} is up after {inc.up - inc.spawned:.0f} s")

    def _note_exits(self) -> None:
        for inc in self.incarnations:
            if inc.end == "running" and not inc.child.alive:
                inc.ended = self.now()
                inc.end = "final" if inc.child.final() is not None else "crashed"
                self.record("exit", inc.ended, learner=inc.learner, incarnation=inc.key, end=inc.end,
                            code=inc.child.popen.poll())
                if inc.end == "crashed":
                    self.say(f"{inc.key} exited without a final summary (code {inc.child.popen.poll()}); "
                             f"see {inc.child.log_path}")

    def _progress(self) -> None:
        committed = discarded = 0
        for inc in self.incarnations:
            for e in read_jsonl(inc.events):
                if e.get("event") == "round":
                    committed += e["outcome"] == "committed"
                    discarded += e["outcome"] != "committed"
        live = [n for n, inc in self.current.items()
                if inc.end == "running" and inc.up is not None and not (inc.stops and inc.stops[-1][1] is None)]
        starting = [n for n, inc in self.current.items() if inc.end == "running" and inc.up is None]
        stopped = [n for n, inc in self.current.items() if inc.stops and inc.stops[-1][1] is None]
        down = [n for n, inc in self.current.items() if inc.end == "killed"]
        self.say(f"{len(live)}/{len(self.names)} live" + (f", stopped {' '.join(stopped)}" if stopped else "")
                 + (f", down {' '.join(down)}" if down else "") + (f", starting {' '.join(starting)}" if starting else "")
                 + f"; rounds {committed} committed, {discarded} discarded")

    def result(self) -> dict[str, Any]:
        """The raw record of the run (JSON): incarnations with their finals and compact round events."""
        assert self.train0 is not None and self.train0_wall is not None
        out = []
        for inc in self.incarnations:
            events = read_jsonl(inc.events)
            out.append({
                "learner": inc.learner, "key": inc.key, "shard": inc.shard, "pid": inc.child.popen.pid,
                "spawned_s": round(self.rel(inc.spawned), 2),
                "up_s": round(self.rel(inc.up), 2) if inc.up is not None else None,
                "ended_s": round(self.rel(inc.ended), 2) if inc.ended is not None else None,
                "end": inc.end, "exit_code": inc.child.popen.poll(),
                "stops": [[round(self.rel(a), 2) if a is not None else None, round(self.rel(b), 2) if b is not None else None]
                          for a, b in inc.stops],
                "final": inc.child.final(), "max_step": _max_step(events),
                "final_s": (round(self.rel(inc.child.final_at - self.t_harness), 2)
                            if inc.child.final_at is not None else None),
                "resumed_from_step": _resumed_step(inc.child),
                "rounds": compact_rounds(events, self.train0_wall),
                "resyncs": sum(e.get("event") == "resync" for e in events),
            })
        return {"incarnations": out, "schedule": [asdict(a) for a in self.schedule], "startup_s": self.startup_s,
                "train0_wall": self.train0_wall, "interrupted": self.interrupted}


def _resumed_step(child: Any) -> int | None:
    """The step an incarnation resumed from (its ``resumed from DIR: step N`` stdout line), None if it
    started afresh."""
    m = child.find(RESUMED_RE)
    return int(m.group(1)) if m else None


def _max_step(events: Sequence[dict[str, Any]]) -> int:
    return max((int(e["step"]) for e in events if isinstance(e.get("step"), int)), default=0)


def compact_rounds(events: Sequence[dict[str, Any]], t0_wall: float) -> list[dict[str, Any]]:
    """The round events an analysis needs: time since training start, fragment, version, outcome, reason, tokens."""
    return [{"t": round(e["time"] - t0_wall, 2), "fragment": e["fragment"], "version": e["version"],
             "outcome": e["outcome"], "reason": e.get("reason", ""), "tokens_sent": e.get("tokens_sent"),
             "group_size": e.get("group_size"), "step": e.get("step")}
            for e in events if e.get("event") == "round"]


def run_chaos(config: str, overrides: list[str], learners: int, duration_s: float, schedule: list[ChaosAction],
              out: Path, stop: threading.Event, checkpoint_every_s: float = 0.0) -> dict[str, Any]:
    """The chaos run; always stops every process it started (stopped ones are continued first)."""
    logs = out / "logs"
    with (out / "chaos_events.jsonl").open("w") as events_log, LocalSwarm(logs, grace_s=LINGER_S + 60) as swarm:
        run = ChaosRun(swarm, config, overrides, learners, duration_s, schedule, events_log, stop,
                       checkpoint_every_s=checkpoint_every_s)
        try:
            run.start()
            run.run()
        finally:
            run.continue_stopped()
            run._note_exits()
            swarm.close()
            run.finish()
    return run.result() | {"events": read_jsonl(out / "chaos_events.jsonl")}


def run_baseline(config: str, overrides: list[str], steps: dict[str, int], step_time_s: float, logs: Path,
                 stop: threading.Event) -> dict[str, Any]:
    """The same learners and shards without chaos, each for its ``steps`` (the chaos run's), started together.
    Early finishers linger until the last one is done, so the anchors agree at the end."""
    sets = [a for o in overrides for a in ("--set", o)]
    names = sorted(steps, key=lambda n: int(n[1:]))  # l0, l1, ...: the shard is the number
    spread_s = (max(steps.values()) - min(steps.values())) * step_time_s
    linger_s = LINGER_S + 1.5 * spread_s
    longest_s = max(steps.values()) * step_time_s
    with LocalSwarm(logs, grace_s=LINGER_S + 60) as swarm:
        peers = swarm.start_bootstrap("--config", config, *sets)
        for name in names:
            swarm.start(name, [
                "join", "--initial-peers", peers, "--config", config, *sets, "--name", name, "--shard", name[1:],
                "--num-shards", str(len(names)), "--wait-peers", str(len(names)), "--steps", str(max(1, steps[name])),
                "--linger", f"{linger_s:.0f}", "--events", str(logs / f"{name}.jsonl")])
        t0 = time.monotonic()
        limit_s = START_TIMEOUT_S + WAIT_PEERS_TIMEOUT_S + 2 * longest_s + linger_s + FINISH_SLACK_S
        next_report = t0 + PROGRESS_PERIOD_S
        error = None
        while True:
            pending = [c for c in swarm.learners() if c.final() is None]
            if not pending:
                break
            dead = [c for c in pending if not c.alive]
            if dead:
                error = f"{dead[0].name} exited without a final summary (code {dead[0].popen.poll()}); see {dead[0].log_path}"
            elif time.monotonic() - t0 > limit_s:
                error = f"the baseline overran its deadline of {limit_s:.0f} s; see {logs}"
            elif stop.is_set():
                error = "interrupted"
            if error:
                print(f"chaos: baseline: {error}", file=sys.stderr, flush=True)
                break
            if time.monotonic() >= next_report:
                next_report += PROGRESS_PERIOD_S
                progress = []
                for name in names:
                    events = read_jsonl(logs / f"{name}.jsonl")
                    progress.append(f"{name} step {_max_step(events)}/{steps[name]}")
                print(f"chaos: baseline [{time.monotonic() - t0:5.0f} s] " + "; ".join(progress), file=sys.stderr,
                      flush=True)
            time.sleep(1.0)
        swarm.close()
        finals = {c.name: f for c in swarm.learners() if (f := c.final()) is not None}
        final_s = {c.name: round(c.final_at - t0, 2) for c in swarm.learners() if c.final_at is not None}
        rounds = [r for name in names for r in compact_rounds(read_jsonl(logs / f"{name}.jsonl"), 0.0)]
        return {"finals": finals, "final_s": final_s, "steps": steps, "linger_s": linger_s, "rounds": rounds,
                "error": error, "wall_s": time.monotonic() - t0}


# ---------------------------------------------------------------- the report


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "FAIL")


def markdown(payload: dict[str, Any]) -> str:
    a = payload["analysis"]
    chaos = payload["chaos"]
    sched = chaos["schedule"]
    kills, stops = sum(s["kind"] == "kill" for s in sched), sum(s["kind"] == "stop" for s in sched)
    good, stall, v = a["goodput"], a["stall"], a["verdicts"]
    lines = [
        f"Chaos against a local swarm ({Path(payload['config']).name}, {len(a['learners'])} learners, "
        f"{payload['duration_s']:.0f} s of training, seed {payload['seed']}, {kills} kill -9 + restart and {stops} "
        f"SIGSTOP/SIGCONT, {'quick' if payload['quick'] else 'full'} run, "
        + (f"checkpoints every {payload['checkpoint_every_s']:g} s and restarts resume from them):"
           if payload.get("checkpoint_every_s") else "restarts start afresh):"),
        "",
        "| measure | result | target | verdict |",
        "|---|---|---|---|",
        f"| goodput (committed tokens / allocated learner-time at no-chaos tokens/s) | "
        f"{_pct(good['goodput'] if good else None)} | >= {100 * TARGET_GOODPUT:.0f}% | {_verdict(v['goodput'])} |",
        f"| goodput in learner-time (allocated learner-time spent training x share of its work that reached the model) | "
        f"{_pct(a.get('learner_time_goodput'))} | >= {100 * TARGET_GOODPUT:.0f}% | {_verdict(v.get('learner_time_goodput'))} |",
        f"| longest inner-loop stall of a survivor | {_secs(stall['survivors_max_s'])}"
        + (f" ({stall['survivors_max_at']})" if stall["survivors_max_at"] else "")
        + f" | <= {TARGET_STALL_S:g} s | {_verdict(v['stall'])} |",
        f"| longest stall overall (SIGSTOPped incarnations included) | {_secs(stall['overall_max_s'])}"
        + (f" ({stall['overall_max_at']})" if stall["overall_max_at"] else "") + " | - | |",
        f"| rounds committed / discarded (one per learner per round) | {a['rounds']['committed']} / "
        f"{a['rounds']['discarded']} | - | |",
    ]
    if a["eval_loss_chaos"] is not None and a["eval_loss_baseline"] is not None:
        lines.append(f"| eval loss of the global model, chaos vs no chaos at equal tokens | {a['eval_loss_chaos']:.4f} vs "
                     f"{a['eval_loss_baseline']:.4f} ({100 * a['eval_gap']:+.2f}%) | <= +{100 * TARGET_EVAL_GAP:.0f}% | "
                     f"{_verdict(v['eval'])} |")
    else:
        chaos_eval = f"{a['eval_loss_chaos']:.4f}" if a["eval_loss_chaos"] is not None else "n/a"
        lines.append(f"| eval loss of the global model, chaos vs no chaos at equal tokens | {chaos_eval} vs n/a | "
                     f"<= +{100 * TARGET_EVAL_GAP:.0f}% | n/a |")
    lines += ["", "| learner | incarnations | kills | stops | steps | rounds committed / discarded | max stall | goodput |",
              "|---|---|---|---|---|---|---|---|"]
    for name, p in a["per_learner"].items():
        lines.append(f"| {name} | {p['incarnations']} | {p['kills']} | {p['stops']} | {p['steps']} | {p['committed']} / "
                     f"{p['discarded']} | {_secs(p['max_stall_s'])} | {_pct(p['goodput'])} |")
    lines.append("")
    if good:
        lines.append(f"Goodput: {good['committed_tokens']:,} tokens reached the model of {good['allocated_tokens']:,} "
                     f"that {len(a['learners'])} learners x {good['train_wall_s']:.0f} s would have produced at their "
                     f"no-chaos rate ({a['rates_from']}); {a['tokens_chaos']:,} tokens were processed in all, "
                     f"{_pct(a['work_share'])} of them reached the model (lost: uncommitted work of killed incarnations "
                     "and discarded final rounds). Learners share the CPU, so the survivors step faster while one is "
                     "down: goodput above 100% is possible.")
        t = a.get("time_away")
        if t and t["ceiling"] is not None:
            lines.append(f"Time the chaos took away: {t['down_s']:.0f} learner-s down after kills, {t['startup_s']:.0f} "
                         f"learner-s of restarts starting up, {t['stopped_s']:.0f} learner-s stopped"
                         + (f", {t['gone_s']:.0f} learner-s after a learner's last incarnation ended before the window's "
                            "end" if t.get("gone_s") else "") + ": "
                         f"{_pct(t['away_share'])} of the {t['allocated_s']:.0f} allocated, so a perfect protocol would "
                         f"reach about {_pct(t['ceiling'])} under this schedule; goodput is "
                         f"{_pct(a.get('share_of_ceiling'))} of that ceiling.")
    else:
        lines.append("Goodput: n/a (no `tokens_sent` in the round events, or no throughput to compare with).")
    if stall["excluded"]:
        lines.append(f"Stalls left out (SIGSTOPped, the stall may be the stop): {', '.join(stall['excluded'])}.")
    if stall["reported_by"] == 0:
        lines.append("Stalls: n/a (no `max_stall_s` in the final summaries).")
    base = payload.get("baseline") or {}
    if base.get("finals"):
        lines.append(f"Baseline: the same learners without chaos, {a['tokens_baseline']:,} tokens "
                     f"({', '.join(f'{n} {s} steps' for n, s in sorted(base['steps'].items()))}); anchors identical at "
                     f"the end: chaos {_yes(a['anchors_identical_chaos'])}, baseline {_yes(a['anchors_identical_baseline'])}.")
    for title, end in (("chaos", a.get("end_chaos")), ("baseline", a.get("end_baseline"))):
        if end and end["together"]:
            lines.append(f"Anchors compared ({title}) among the {len(end['together'])} incarnations that finished "
                         f"together: {', '.join(end['together'])}: identical {_yes(end['identical'])}"
                         + (f"; left out: {'; '.join(f'{k} ({why})' for k, why in sorted(end['excluded'].items()))}"
                            if end["excluded"] else "") + ".")
    if base.get("error"):
        lines.append(f"Baseline incomplete: {base['error']}.")
    for title, rounds in (("chaos", a["rounds"]), ("baseline", a["baseline_rounds"])):
        if rounds and rounds["failed_reasons"]:
            lines.append(f"Discarded rounds ({title}):")
            lines += [f"- {count} x {reason}" for reason, count in rounds["failed_reasons"]]
    skipped = {(e["action"]["at_s"], e["action"]["victim"]): e["why"] for e in chaos.get("events", []) if e["event"] == "skip"}
    lines.append("Schedule: " + "; ".join(
        f"{s['at_s']:.0f} s {'kill -9' if s['kind'] == 'kill' else 'SIGSTOP'} {s['victim']} "
        f"({'restart' if s['kind'] == 'kill' else 'SIGCONT'} after {s['down_s']:.0f} s"
        + (f"; skipped: {skipped[(s['at_s'], s['victim'])]}" if (s["at_s"], s["victim"]) in skipped else "") + ")"
        for s in sched) + ".")
    for i in chaos["incarnations"]:
        if i["key"].endswith(".0"):
            continue
        f = i["final"]
        late = i["up_s"] is not None and i["up_s"] >= payload["duration_s"]
        lines.append(f"Restart {i['key']}: spawned at {i['spawned_s']:.0f} s, "
                     + (f"up at {i['up_s']:.0f} s (start-up {i['up_s'] - i['spawned_s']:.0f} s)" if i["up_s"] is not None
                        else "never up")
                     + (f", trained {f['train_s']:.0f} s, {f['steps']} steps, {sum(f['committed'])} rounds committed, "
                        f"{sum(f['discarded'])} discarded, {sum(f['resynced'])} fragment downloads" if f else f", {i['end']}")
                     + (" -- it came up after the training window ended, with no peer left to average with" if late else "")
                     + ".")
    crashed = [i["key"] for i in chaos["incarnations"] if i["end"] == "crashed"]
    if crashed:
        lines.append(f"Exited without a final summary (not killed by the harness): {', '.join(crashed)}.")
    if chaos.get("interrupted"):
        lines.append("The run was interrupted: the figures cover what there is.")
    return "\n".join(lines) + "\n"


def _yes(x: bool | None) -> str:
    return "n/a" if x is None else ("yes" if x else "NO")


def plot(payload: dict[str, Any], path: Path) -> None:
    """A timeline per learner: down (killed -> restarted incarnation up) and stopped intervals, rounds as dots."""
    learners = sorted({i["learner"] for i in payload["chaos"]["incarnations"]})
    with _bench.figure(path, 1, (12, 1.0 + 0.8 * len(learners))) as (ax,):
        _plot_timeline(payload, learners, ax)


def _plot_timeline(payload: dict[str, Any], learners: list[str], ax: Any) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    incs = payload["chaos"]["incarnations"]
    for row, name in enumerate(learners):
        mine = sorted((i for i in incs if i["learner"] == name), key=lambda i: i["spawned_s"])
        y = row * 10
        for k, inc in enumerate(mine):
            nxt = mine[k + 1] if k + 1 < len(mine) else None
            if inc["end"] == "killed" and inc["ended_s"] is not None:
                back = payload["duration_s"] if nxt is None else (nxt["up_s"] if nxt["up_s"] is not None else nxt["spawned_s"])
                ax.broken_barh([(inc["ended_s"], back - inc["ended_s"])], (y + 1, 8), color="tab:red", alpha=0.35)
                ax.plot([inc["ended_s"]], [y + 5], "x", color="tab:red", markersize=9)
            if k > 0:
                ax.plot([inc["spawned_s"]], [y + 5], "|", color="tab:red", markersize=14)
        for inc in mine:
            for a, b in inc["stops"]:
                if a is not None:
                    ax.broken_barh([(a, (b if b is not None else a) - a)], (y + 1, 8), color="tab:orange", alpha=0.5)
            ok = [r["t"] for r in inc["rounds"] if r["outcome"] == "committed"]
            bad = [r["t"] for r in inc["rounds"] if r["outcome"] != "committed"]
            ax.plot(ok, [y + 5] * len(ok), ".", color="tab:green", markersize=5)
            ax.plot(bad, [y + 5] * len(bad), "v", color="tab:gray", markersize=5)
    ax.axvline(payload["duration_s"], color="gray", linestyle="--", linewidth=1)
    ax.set_xlim(left=0)
    ax.set_yticks([row * 10 + 5 for row in range(len(learners))], learners)
    ax.set_xlabel("seconds since training started (dashed: end of training)")
    handles = [Rectangle((0, 0), 1, 1, color="tab:red", alpha=0.35), Rectangle((0, 0), 1, 1, color="tab:orange", alpha=0.5),
               Line2D([], [], marker=".", color="tab:green", linestyle=""),
               Line2D([], [], marker="v", color="tab:gray", linestyle="")]
    ax.legend(handles, ["kill -9 (x) -> restart (|) and up", "SIGSTOPped", "round committed", "round discarded"], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(learners) < 4 else -0.15), ncol=4)
    good = payload["analysis"]["goodput"]
    ax.set_title(f"chaos timeline (goodput {_pct(good['goodput'] if good else None)})")
    ax.grid(axis="y", visible=False)


def write(payload: dict[str, Any], out: Path) -> dict[str, Any]:
    """Analyses the run (into ``payload["analysis"]``), then writes its JSON, figure and page; returns what was
    written."""
    payload["analysis"] = analyse(payload)
    return _bench.publish(BENCH, out, payload, markdown, plot)


# ---------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, config="demo.toml",
                      quick="tiny.toml, 3 learners, 90 s, an action every ~20 s: checks the pipeline, not the numbers")
    p.add_argument("--learners", type=int, default=4, help="learner processes (default: 4)")
    p.add_argument("--minutes", type=float, default=10.0, help="training time of the chaos run, minutes (default: 10)")
    p.add_argument("--every", dest="every_s", type=float, default=60.0, metavar="SECONDS",
                   help="mean seconds between chaos actions (default: 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the chaos schedule (default: 0)")
    p.add_argument("--checkpoint-every", dest="checkpoint_every_s", type=float, default=15.0, metavar="SECONDS",
                   help="learners checkpoint this often and a killed one resumes from its checkpoint (default: 15; "
                        "0: restarts start afresh and download everything)")
    p.add_argument("--no-baseline", action="store_true", help="skip the no-chaos run (no eval comparison)")
    p.add_argument("--reanalyse", action="store_true",
                   help="analyse the run in --out/chaos.json again, then rewrite it, the page and the figure")
    args = p.parse_args(argv)
    out = args.out
    if args.reanalyse:
        write(BENCH.load(out), out)
        return 0
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    params = ScheduleParams(every_s=args.every_s)
    if args.quick:
        args.config, args.learners, args.minutes = str(_bench.ROOT / "configs" / "tiny.toml"), 3, 1.5
        args.overrides = ["inner.total_steps=100000", *args.overrides]
        params = QUICK_SCHEDULE
    if args.learners < 2 or args.minutes <= 0:
        p.error(f"need --learners >= 2 and --minutes > 0, got {args.learners} and {args.minutes}")
    from p2p_diloco.core.config import load_config

    cfg = load_config(args.config, args.overrides)  # a bad config fails here, before any process starts
    duration_s = 60.0 * args.minutes
    names = [f"l{i}" for i in range(args.learners)]
    schedule = make_schedule(args.seed, duration_s, names, params.every_s, params.jitter_s, params.stop_s, params.down_s,
                             params.quiet_start_s, params.quiet_end_s, params.settle_s)
    check_schedule(schedule, duration_s, params.quiet_start_s, params.quiet_end_s)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    print(f"chaos: {args.learners} learners x {duration_s:.0f} s on {args.config}, {len(schedule)} actions (seed "
          f"{args.seed}) -> {out}", file=sys.stderr, flush=True)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        chaos = run_chaos(args.config, args.overrides, args.learners, duration_s, schedule, out, stop,
                          checkpoint_every_s=args.checkpoint_every_s)
        payload: dict[str, Any] = {
            "config": args.config, "overrides": args.overrides, "quick": args.quick, "seed": args.seed,
            "duration_s": duration_s, "schedule_params": asdict(params), "checkpoint_every_s": args.checkpoint_every_s, "fragments": cfg.outer.fragments,
            "tokens_per_step": cfg.inner.batch_size * cfg.model.block_size, "chaos": chaos, "baseline": None}
        steps = steps_per_learner(chaos["incarnations"])
        print(f"chaos: chaos run done; steps per learner {steps}", file=sys.stderr, flush=True)
        if not args.no_baseline and not stop.is_set():
            most = max(steps.values()) or 1
            step_time_s = duration_s / most
            print(f"chaos: baseline without chaos, the same steps per learner (~{most * step_time_s:.0f} s)",
                  file=sys.stderr, flush=True)
            payload["baseline"] = run_baseline(args.config, args.overrides, steps, step_time_s, out / "logs" / "baseline",
                                               stop)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    write(payload, out)
    return 130 if stop.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
