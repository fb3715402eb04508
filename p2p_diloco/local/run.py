"""``p2p-diloco swarm``: a whole swarm on this machine (or a LAN) in one command.

Starts one bootstrap peer and N learner units as separate processes (``p2p-diloco bootstrap`` and
``p2p-diloco join``), with a mix of peer profiles so that weighting by progress is visible, shows
the swarm live (the ``status`` table and a progress bar to the time budget, or to the token budget
with ``--minutes 0``; plain lines when stdout is not a terminal), and at the end writes a report into
``--out``: ``summary.json``, the table it prints, and PNG plots (training loss per peer over time;
group sizes and weight shares per round). ``--chaos`` kills one learner (kill -9) a third into the training
(from when every learner trains) and starts it again at half time (:mod:`p2p_diloco.local.chaos`, as
``scripts/chaos.py`` does): it leaves, the others go on, it rejoins by downloading the current anchors. Ctrl+C
stops every process cleanly (learners leave gracefully) and still writes what there is.

With a time budget (``--minutes``, the default) every learner trains for that long whatever the
machine's speed: there is no step limit, so no learner leaves early; but all of them finish together once
they have trained as many tokens as the longest stored data-parallel curve (:func:`token_budget`,
``--max-tokens``), so that a fast machine does not outrun the stored curves. The report compares the end state
(anchors, eval loss) among the learners that finished together and names the others with the reason;
and it always has the data-parallel reference at the run's tokens: from a stored curve that covers them
(:mod:`p2p_diloco.sim.reference`; the curves bundled for the default config cover every speed from a
twentieth of a 2-core machine's up), else computed here after the run and cached (``--no-reference`` skips that).

Only the standard library is imported at module level (``p2p-diloco --help`` stays fast).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_diloco.core.console import out
from p2p_diloco.core.events import EvalEvent, RoundEvent, TrainingEvent, read_events
from p2p_diloco.local.chaos import Applied, ChaosAction, ChaosDriver, one_kill
from p2p_diloco.local.launcher import Child

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = "demo.toml"
"""The bundled run config a swarm trains by default (:mod:`p2p_diloco.core.resources`)."""
DEFAULT_PROFILES = ("fast.toml", "half.toml")
"""The bundled peer profiles a swarm's learners take in turn by default: a fast and a half-speed one, so that
weighting by progress is visible."""
VIEW_PERIOD_S = 2.0
PLAIN_PERIOD_S = 15.0
LINGER_S = 30.0
DEFAULT_MINUTES = 6.5
"""Training time by default: with start-up, the final rounds and the evaluation, the main job takes
about 7.5 minutes on a 2-core machine (all learners share it), and with the install under 10 minutes
on a fresh clone (7 minutes took 10 min 4 s there). With the token budget and the bundled curves no reference
is computed after it: 7 min 5 s on a 2-core machine shared with other test runs (3.2M tokens, issue 47)."""
EVAL_EVERY_S = 30.0
"""Learners evaluate the global model on 2 held-out batches this often (the eval-loss-over-time plot)."""
FINISH_SLACK_S = 300.0
"""After the training budget: final rounds, linger, evaluation and exit of every learner."""
REFERENCE_TOKENS_PER_S_2_CORES = 18_000.0
"""Data-parallel reference training on demo.toml, one process alone on a 2-core machine (2.0M tokens in 110 s,
evaluations included); four learner processes train about 6,300 tokens/s there, so computing a reference
takes about a third of the training time -- and several times longer beside other jobs (4.8M tokens took
1733 s at nice 10 beside other test runs). Only for the estimate printed first."""
EVENTS_TAIL_BYTES = 65_536
"""How much of the end of a learner's events file :func:`last_tokens` reads (an event is one line of < 4 kB)."""
EVENTS_HEAD_BYTES = 65_536
"""How much of the start of a learner's events file :func:`began_training` reads."""
REFERENCE_EVAL_POINTS = 8
"""Evaluations along a reference computed for a run: at 1/8 steps, so a later run within the curve's last
quarter (``reference.SPAN``) interpolates between points, and evaluation costs little beside training."""
TOGETHER_WINDOW_S = LINGER_S + 30.0
"""Learners whose final summaries arrive within this of the last one finished together: learners that end
their training at the same time linger up to ``LINGER_S`` for the last rounds to agree, then evaluate."""


def write_report(report: dict[str, Any], out: Path) -> str:
    """``summary.json`` and ``summary.md``; returns the table."""
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    table = render_report(report)
    (out / "summary.md").write_text(table)
    return table


def ending(c: Child, t0: float, chaos: Chaos) -> Ending:
    """How learner ``c`` ended, in seconds since the swarm started."""
    if c.final_at is not None:
        return Ending(c.name, round(c.final_at - t0, 1))
    if c.name in chaos.killed:
        return Ending(c.name, None, f"killed by --chaos (kill -9) at {chaos.killed[c.name]:.0f} s")
    return Ending(c.name, None, f"exited without a final summary (exit code {c.popen.poll()})")


def reference_action(stored: bool, why: str, tokens: int, no_reference: bool, interrupted: bool) -> tuple[str, str]:
    """What the report's data-parallel reference comes from: ``use`` the stored curve that covers the run's
    ``tokens``, ``compute`` one for the run, or ``none`` (no tokens, ``--no-reference``, or a run stopped by
    Ctrl+C: not worth the wait); with why (``why``: why no stored curve covers them)."""
    if stored:
        return "use", why
    if tokens <= 0:
        return "none", "the learners trained no tokens"
    if no_reference:
        return "none", why + "; --no-reference: not computed"
    if interrupted:
        return "none", why + "; the run was interrupted: not computed"
    return "compute", why


def stored_reference(cfg: Any, tokens: int) -> tuple[dict[str, Any] | None, str]:
    """The reference at ``tokens`` from the cached and bundled curves, or (None, why none covers it)."""
    from p2p_diloco.sim.reference import folders, lookup, reference_key

    return lookup(reference_key(cfg), tokens, folders())


def compute_reference(config_path: str | None, args: argparse.Namespace, cfg: Any, tokens: int, why: str,
                       run_s: float) -> dict[str, Any]:
    """Train the data-parallel reference of ``tokens`` here (progress lines on stderr), cache its curve
    (:func:`p2p_diloco.sim.reference.cache_dir`) and read it at ``tokens``."""
    from p2p_diloco.sim.reference import (
        cache_dir,
        compute_curve,
        reference_at,
        save_curve,
        steps_for,
    )

    overrides = [*args.overrides, f"sim.learners={args.peers}"]
    out(f"data-parallel reference: {why}; computing one for this run: {steps_for(cfg, tokens)} steps of "
         f"{args.peers} x {cfg.inner.batch_size} x {cfg.model.block_size} tokens in this process (about "
         f"{tokens / REFERENCE_TOKENS_PER_S_2_CORES / 60:.1f} min on an idle 2-core machine; the learners trained for "
         f"{args.minutes:g} min), a progress line at every 1/{REFERENCE_EVAL_POINTS}; Ctrl+C skips it, "
         "--no-reference skips it next time")
    command = "python scripts/bench_reference.py " + " ".join(
        [*(["--config", config_path] if config_path else []), *(a for o in overrides for a in ("--set", o)),
         "--tokens", str(tokens)])
    payload = compute_curve(config_path, overrides, tokens, eval_points=REFERENCE_EVAL_POINTS, progress=True,
                            command=command)
    path = save_curve(payload, cache_dir())
    out(f"data-parallel reference: eval loss {payload['final_eval_loss']:.4f} after {payload['tokens']:,} tokens, "
         f"{payload['wall_s']:.0f} s; cached in {path}")
    shown = {**payload, "path": str(path)}
    return reference_at(shown, tokens) | {"computed_s": payload["wall_s"]}


def token_budget(max_tokens: int | None, seconds: float | None, ends: Sequence[int]) -> tuple[int | None, str]:
    """The tokens at which every learner of the swarm finishes (:class:`TokenStop`), or None, with why.
    ``--max-tokens`` (``max_tokens``) when given, 0 for none. By default, with a time budget (``seconds``), the
    longest stored data-parallel curve's end (``ends``: the run's curves, cached and bundled): a machine fast
    enough to train more in its time would outrun the stored curves and compute its reference after the run.
    The learners train on a little while they finish, up to 10% past it, which that curve still covers
    (``reference.SPAN``); the shorter ones cover a slower machine (for the bundled configs a unit test pins it).
    With a step budget alone the steps fix the tokens: none."""
    if max_tokens is not None:
        if max_tokens < 0:
            raise ValueError(f"--max-tokens: must be >= 0, got {max_tokens} (0: no token budget)")
        return (max_tokens, "--max-tokens") if max_tokens else (None, "--max-tokens 0")
    if seconds is None:
        return None, "the step budget fixes the tokens"
    if not ends:
        return None, "no stored data-parallel curve for this run"
    return max(ends), "the longest stored data-parallel curve: the report reads its reference, never computes one"


def last_tokens(path: Path) -> int:
    """The training tokens of the last event in a learner's ``--events`` file (0: none yet), read from its tail
    (:data:`EVENTS_TAIL_BYTES`): the swarm looks every :data:`VIEW_PERIOD_S`. A line that is not JSON is skipped,
    as :func:`~p2p_diloco.core.events.read_events` does: the last one may still be being written."""
    if not path.exists():
        return 0
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - EVENTS_TAIL_BYTES))
        tail = f.read().decode(errors="replace")
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("tokens"), int):
            return int(record["tokens"])
    return 0


def began_training(path: Path) -> bool:
    """Whether a learner's ``--events`` file holds its ``training`` event (:class:`~p2p_diloco.core.events.
    TrainingEvent`), read from its head (:data:`EVENTS_HEAD_BYTES`): the learner logs it before its first step, so
    only the downloads it made while waiting for peers come before it."""
    if not path.exists():
        return False
    with path.open("rb") as f:
        head = f.read(EVENTS_HEAD_BYTES).decode(errors="replace")
    for line in head.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last one may still be being written
        if isinstance(record, dict) and record.get("event") == TrainingEvent.KIND:
            return True
    return False


class TokenStop:
    """The swarm's token budget: once its learners' events say they have trained ``budget`` tokens together
    (those the report counts: not the ones killed by ``--chaos``), or will have by the next look at the rate
    since the last one, every learner gets SIGUSR1 and finishes as at its time budget -- final rounds, linger,
    evaluation -- so all of them finish together. Looking ahead keeps the overshoot to the steps between two events
    (a round's) and those until the signal is seen, not all that a fast machine trains between two looks."""

    def __init__(self, budget: int | None, logs: Path) -> None:
        self.budget, self.logs = budget, logs
        self.reached_s: float | None = None
        """When the budget was reached, in seconds since the swarm started; None: not (yet)."""
        self._last: tuple[float, int] | None = None
        """The previous look: (seconds since the swarm started, tokens)."""

    def tick(self, learners: Sequence[Child], killed: Sequence[str], elapsed_s: float) -> bool:
        """Look at the learners' tokens (called every ``VIEW_PERIOD_S``); True once the budget is reached."""
        if self.budget is None or self.reached_s is not None:
            return self.reached_s is not None
        tokens = sum(last_tokens(self.logs / f"{c.name}.jsonl") for c in learners if c.name not in killed)
        ahead = 0  # what they train until the next look, at the rate since the last one (as far apart)
        if self._last is not None and elapsed_s > self._last[0]:
            ahead = max(0, tokens - self._last[1])
        self._last = (elapsed_s, tokens)
        if tokens + ahead < self.budget:
            return False
        self.reached_s = elapsed_s
        for c in learners:
            if c.alive and c.final() is None:
                c.signal(signal.SIGUSR1)
        out(f"swarm: {tokens:,} tokens trained at {elapsed_s:.0f} s, the token budget of {self.budget:,}: every "
            "learner finishes now, as at its time budget")
        return True


def estimate_s(cfg: Any) -> float:
    """A rough run length for the chaos schedule when the budget is in steps (0.5 s per step)."""
    return cfg.inner.total_steps * 0.5


class Chaos:
    """``--chaos``: the last learner killed (kill -9 of its process group) a third into the training and started
    again at half, as a new learner ``<name>-rejoined`` that downloads the current anchors and rejoins: the
    schedule :func:`~p2p_diloco.local.chaos.one_kill` on the :class:`~p2p_diloco.local.chaos.ChaosDriver`
    that ``scripts/chaos.py`` uses too. Each step goes into ``events`` (the report's ``chaos_events``).

    The schedule counts from when every live learner has begun training (``began_training``), not from the
    launch: start-up and the wait for peers took 38 s of a one-minute run on a loaded 2-core machine, and a kill
    at a third of the launch's minute hit a learner that had not trained yet, its restart a swarm that had not
    committed a round (nothing to catch up on). With a time budget (``seconds``) the training is what is left of
    it then; with a step budget, ``run_s``."""

    def __init__(self, enabled: bool, run_s: float, learners: Sequence[Child], start_learner: Callable[..., Child],
                 seconds: float | None, events: list[dict[str, Any]],
                 began_training: Callable[[Child], bool]) -> None:
        self.t0 = time.monotonic()
        """The swarm's start: the events' and kills' times count from here."""
        self.enabled, self.run_s, self.began_training = enabled, run_s, began_training
        self.learners, self.start_learner, self.seconds, self.events = list(learners), start_learner, seconds, events
        self.trained_from_s: float | None = None
        """When every live learner had begun training (seconds since :attr:`t0`): the schedule's zero."""
        self.killed: dict[str, float] = {}
        """The learners killed, by name, with when (seconds since :attr:`t0`)."""
        self.driver = ChaosDriver([], self._victim, self._restart, self._applied)
        """Empty until the training begins; then :func:`~p2p_diloco.local.chaos.one_kill`'s schedule."""

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def tick(self) -> None:
        """Apply what is due (called every ``VIEW_PERIOD_S``); until every live learner trains, nothing is."""
        elapsed = self.elapsed_s()
        if self.trained_from_s is None:
            live = [c for c in self.learners if c.alive]
            if not self.enabled or not live or not all(self.began_training(c) for c in live):
                return
            self.trained_from_s = elapsed
            run_s = self.run_s if self.seconds is None else self.seconds - elapsed
            if run_s <= 0:
                out(f"chaos: nothing done: every learner began training at {elapsed:.0f} s, past the time budget")
                return
            victim = self.learners[-1].name
            self.driver = ChaosDriver(one_kill(run_s, victim), self._victim, self._restart, self._applied)
            out(f"chaos: every learner trains at {elapsed:.0f} s: kill -9 {victim} at {elapsed + run_s / 3:.0f} s, "
                f"restart at {elapsed + run_s / 2:.0f} s")
        self.driver.tick(elapsed - self.trained_from_s)

    def _victim(self, name: str) -> Child:
        return next(c for c in self.learners if c.name == name)

    def _restart(self, action: ChaosAction) -> Child:
        left = None if self.seconds is None else max(10.0, self.seconds - self.elapsed_s())
        index = self.learners.index(self._victim(action.victim))
        return self.start_learner(index, wait=0, max_time_s=left, suffix="-rejoined")

    def _applied(self, a: Applied) -> None:
        elapsed = self.elapsed_s()
        if a.what == "kill":
            self.killed[a.child.name] = elapsed
            what = f"kill -9 {a.child.name}"
            out(f"chaos: kill -9 {a.child.name} at {elapsed:.0f} s")
        elif a.what == "restart":
            what = f"restart {a.child.name}"
            out(f"chaos: restarted {a.child.name} at {elapsed:.0f} s; it downloads the current anchors and rejoins")
        else:  # "skip": the victim was not training when its kill was due (nothing else is scheduled)
            what = f"skipped {a.action.kind if a.phase == 'begin' else 'restart'} of {a.action.victim}: {a.why}"
            out(f"chaos: {what} at {elapsed:.0f} s")
        self.events.append({"t": elapsed, "event": "chaos", "what": what})


class LiveView:
    """The live view: the ``status`` table and a progress bar (rich on a terminal, plain lines otherwise)."""

    def __init__(self, args: argparse.Namespace, cfg: Any, peers: str, budget_tokens: int | None,
                 seconds: float | None) -> None:
        from p2p_diloco.net.arguments import swarm_options
        from p2p_diloco.net.records import LocalRun

        self.budget_tokens, self.seconds = budget_tokens, seconds
        self.local = LocalRun.from_config(cfg)
        self.rich = sys.stdout.isatty() and not args.plain
        ns = argparse.Namespace(initial_peers=[peers], swarm_key=args.swarm_key, join_timeout_s=30.0)
        self.dht: Any = None
        try:
            from p2p_diloco.net.membership import start_dht

            self.dht = start_dht(swarm_options(ns, client_mode=True), self.local.run_id)
        except Exception as e:  # the view is optional: the swarm runs and reports without it
            out(f"swarm: no live view ({type(e).__name__}: {e})")
        self.live: Any = None
        self.last_plain = -math.inf
        self.train_started_s: float | None = None
        """When the view first saw tokens trained (seconds since the swarm started): the time budget's zero."""

    def update(self, elapsed_s: float, events: list[dict[str, Any]]) -> None:
        if self.dht is None:
            return
        if not self.dht.is_alive():  # its reads would wait out their timeout every period
            out("swarm: the live view's DHT process is gone: no more view lines (the learners train on)")
            self.dht = None
            return
        from p2p_diloco.net.membership import read_swarm
        from p2p_diloco.net.report import consensus_text, snapshot_json

        try:
            data = snapshot_json(read_swarm(self.dht, self.local), {})
        except Exception as e:  # a DHT hiccup: skip this refresh
            logger.warning("swarm view: reading the DHT failed: %s", e)
            return
        s = data["summary"]
        tokens = sum(p.get("tokens", 0) for p in data["peers"] if p["kind"] == "PeerRecord" and p["status"] in ("live", "left"))
        if tokens > 0 and self.train_started_s is None:
            self.train_started_s = elapsed_s
        share, budget = progress(elapsed_s, self.train_started_s, self.seconds, tokens, self.budget_tokens)
        line = (f"[{elapsed_s:5.0f} s] {s['live']} live, {budget}, {100 * share:.0f}% done, "
                f"{s['tokens_per_s']:.0f} tokens/s, consensus {consensus_text(s)}")
        if self.rich:
            from rich.console import Group
            from rich.live import Live
            from rich.progress_bar import ProgressBar
            from rich.text import Text

            from p2p_diloco.net.report import render_rich

            chaos = [Text(f"chaos: {e['what']} at {e['t']:.0f} s") for e in events]
            renderable = Group(render_rich(data), ProgressBar(total=1.0, completed=share, width=60), Text(line), *chaos)
            if self.live is None:
                self.live = Live(renderable, refresh_per_second=2, transient=False)
                self.live.start()
            else:
                self.live.update(renderable)
        elif elapsed_s - self.last_plain >= PLAIN_PERIOD_S:
            self.last_plain = elapsed_s
            versions = " ".join(f"f{f['fragment']}=v{f['top_version']}" for f in s["fragments"])
            losses = [p["loss"] for p in data["peers"] if p["status"] == "live" and isinstance(p.get("loss"), float)]
            loss = f", loss {statistics.median(losses):.3f}" if losses else ""
            out(f"{line}, {versions}{loss}")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
        if self.dht is not None:
            self.dht.shutdown()


def progress(elapsed_s: float, train_started_s: float | None, seconds: float | None, tokens: int,
             budget_tokens: int | None) -> tuple[float, str]:
    """The live view's share done and its budget text. With a time budget it is the training time so far
    (from ``train_started_s``, when tokens were first seen) over ``seconds``, whatever the tokens (a fast
    machine trains more of them); with a step budget only, ``tokens`` over ``budget_tokens``; with both
    (``--set inner.total_steps=N`` and ``--minutes``), whichever is further."""
    shares, parts = [], [f"{tokens:,}" + (f"/{budget_tokens:,}" if budget_tokens else "") + " tokens"]
    if budget_tokens:
        shares.append(min(1.0, tokens / budget_tokens))
    if seconds:
        trained_s = 0.0 if train_started_s is None else max(0.0, elapsed_s - train_started_s)
        shares.append(min(1.0, trained_s / seconds))
        parts.append(f"{min(trained_s, seconds):.0f}/{seconds:.0f} s trained")
    return max(shares, default=0.0), ", ".join(parts)


@dataclass(frozen=True)
class Ending:
    """How one learner process ended, for the report."""

    name: str
    final_s: float | None
    """When its final summary arrived, in seconds since the run started; None: it printed none."""
    why_no_final: str = ""
    """Without a final summary: why (killed by the chaos, exited with code N, ...)."""


def finished_together(endings: Sequence[Ending], window_s: float) -> tuple[list[str], dict[str, str]]:
    """The learners that finished together -- printed their final summary within ``window_s`` of the last
    one, so trained until the end and lingered for the last rounds together -- sorted by name; and every
    other learner with the reason it is left out of comparisons of the end state (anchors, eval loss)."""
    if window_s < 0:
        raise ValueError(f"window_s: must be >= 0, got {window_s}")
    last = max((e.final_s for e in endings if e.final_s is not None), default=None)
    together, excluded = [], {}
    for e in sorted(endings, key=lambda e: e.name):
        if e.final_s is None:
            excluded[e.name] = e.why_no_final or "no final summary"
        elif last is not None and e.final_s < last - window_s:
            excluded[e.name] = (f"left at {e.final_s:.0f} s, {last - e.final_s:.0f} s before the last learner "
                                f"finished (more than {window_s:.0f} s before)")
        else:
            together.append(e.name)
    return together, excluded


def build_report(cfg: Any, config_path: str | None, args: argparse.Namespace, finals: dict[str, dict[str, Any]],
                 events: list[dict[str, Any]], out: Path, wall_s: float,
                 endings: Sequence[Ending] = ()) -> dict[str, Any]:
    """The run's figures (pure apart from reading the learners' event files), without the data-parallel
    reference (``reference``: None; the caller looks it up or computes it). The end state (anchors, eval
    loss) is compared among the learners that finished together (:func:`finished_together`; all learners
    with a final summary if ``endings`` is empty)."""
    from p2p_diloco.core.identity import config_hash
    from p2p_diloco.core.tokenizer import loss_unit
    from p2p_diloco.sim.simulator import dp_fp32_bytes

    n_params = _n_params(cfg)
    tokens = sum(f["tokens"] for f in finals.values())
    sent = sum(f["bytes_sent"] for f in finals.values())
    dp_bytes = dp_fp32_bytes(tokens, cfg, n_params, learners=max(1, len(finals)))
    rounds = [e for p in sorted((out / "logs").glob("*.jsonl")) for e in read_events(p) if isinstance(e, RoundEvent)]
    together, excluded = finished_together(endings, TOGETHER_WINDOW_S) if endings else (sorted(finals), {})
    end = [finals[n] for n in together if n in finals]
    return {
        "config": config_path, "overrides": list(args.overrides), "config_hash": config_hash(cfg),
        "peers": args.peers, "chaos": args.chaos, "wall_s": round(wall_s, 1), "model_params": n_params,
        "minutes": args.minutes, "loss_unit": loss_unit(cfg),
        "learners": finals,
        "tokens": tokens,
        "finished_together": together, "excluded": excluded,
        "eval_loss_start": statistics.median(f["eval_loss_start"] for f in finals.values()) if finals else None,
        "eval_loss_end": statistics.median(f["eval_loss_end"] for f in end) if end else None,
        "anchors_identical": len({tuple(f["anchor_hashes"]) for f in end}) == 1 if end else None,
        "bytes_sent": sent, "dp_fp32_bytes": dp_bytes, "bytes_saved_vs_dp_fp32": dp_bytes / sent if sent else None,
        "median_utilization": statistics.median(f["utilization"] for f in finals.values()) if finals else None,
        "rounds_committed": sum(e.committed for e in rounds),
        "rounds_discarded": sum(not e.committed for e in rounds),
        "discard_reasons": _top_reasons(e.reason for e in rounds if not e.committed),
        "chaos_events": events,
        "reference": None,
    }


def _top_reasons(reasons: Any, top: int = 5) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for r in reasons:
        counts[r[:80]] = counts.get(r[:80], 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])[:top]


def _n_params(cfg: Any) -> int:
    from p2p_diloco.core.model import build_model

    return sum(p.numel() for p in build_model(cfg.model, cfg.run.seed).parameters())


def render_report(r: dict[str, Any]) -> str:
    lines = ["| learner | steps | tokens | utilization | blocked | rounds committed / discarded | eval loss |",
             "|---|---|---|---|---|---|---|"]
    for name, f in sorted(r["learners"].items()):
        lines.append(f"| {name} | {f['steps']} | {f['tokens']:,} | {100 * f['utilization']:.1f}% | "
                     f"{100 * f['blocked_share']:.2f}% | {sum(f['committed'])} / {sum(f['discarded'])} | "
                     f"{f['eval_loss_end']:.4f} |")
    lines.append("")
    unit = r.get("loss_unit", "nats")  # a report from before the unit was recorded: its tokenizer is not known
    if r["eval_loss_end"] is not None:
        saved = r["bytes_saved_vs_dp_fp32"]
        together = r.get("finished_together", sorted(r["learners"]))
        lines.append(f"held-out eval loss of the global model: {r['eval_loss_start']:.3f} -> {r['eval_loss_end']:.4f} "
                     f"{unit} after {r['tokens']:,} tokens; anchors identical on the {len(together)} learners that "
                     f"finished together ({', '.join(together)}): {'yes' if r['anchors_identical'] else 'NO'}")
        for name, why in sorted(r.get("excluded", {}).items()):
            lines.append(f"  left out of that comparison: {name} ({why})")
        ref = r.get("reference")
        if ref and ref.get("eval_loss") is not None:
            gap = r["eval_loss_end"] / ref["eval_loss"] - 1
            how = (f"computed for this run in {ref['computed_s'] / 60:.1f} min, cached in {ref['path']}"
                   if ref.get("computed_s") is not None else f"from {ref['path']}")
            curve = (f"between the ends of curves of {ref['between'][0]:,} and {ref['between'][1]:,} tokens"
                     if ref.get("between") else f"a curve of {ref['reference_tokens']:,} tokens")
            lines.append(f"data-parallel reference (fp32 gradients averaged every step, same model) at the same tokens: "
                         f"{ref['eval_loss']:.4f} {unit}; ours {100 * gap:+.1f}% ({how}, {curve})")
        elif ref:
            lines.append(f"data-parallel reference: none at {ref['tokens']:,} tokens ({ref['why']}); make one with "
                         f"python scripts/bench_reference.py --config {r['config'] or 'FILE'} --tokens {ref['tokens']}")
        if r["rounds_committed"] + r["rounds_discarded"]:
            lines.append(f"bytes sent {r['bytes_sent'] / 1e6:.2f} MB vs {r['dp_fp32_bytes'] / 1e6:.0f} MB for fp32 "
                         f"data-parallel on the same tokens" + (f" ({saved:.0f}x fewer)" if saved else ""))
        else:  # nothing was averaged: 0 bytes against data-parallel's would compare nothing
            lines.append("no round ran: no bytes to compare")
        lines.append(f"median utilization {100 * r['median_utilization']:.1f}%; rounds {r['rounds_committed']} committed, "
                     f"{r['rounds_discarded']} discarded; wall {r['wall_s']:.0f} s")
        budget = r.get("token_budget") or {}  # a report from before token budgets has none
        if budget.get("reached_s") is not None:
            lines.append(f"token budget {budget['tokens']:,} ({budget['why']}) reached at {budget['reached_s']:.0f} s: "
                         "every learner finished then, before its time budget")
    for reason, count in r["discard_reasons"]:
        lines.append(f"  discarded x{count}: {reason}")
    for e in r["chaos_events"]:
        lines.append(f"chaos at {e['t']:.0f} s: {e['what']}")
    return "\n".join(lines) + "\n"


def plot(out: Path, unit: str) -> None:
    """``loss.png``: training loss per learner over time (in ``unit``, :func:`~p2p_diloco.core.tokenizer.loss_unit`);
    ``rounds.png``: group size and weight share per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = sorted((out / "logs").glob("*.jsonl"))
    series = {p.stem: [e for e in read_events(p) if isinstance(e, RoundEvent)] for p in logs}
    t0 = min((e.time for es in series.values() for e in es), default=0.0)
    evals = {p.stem: [e for e in read_events(p) if isinstance(e, EvalEvent)] for p in logs}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, es) in enumerate(series.items()):
        color = f"C{i % 10}"
        pts = [(e.time - t0, e.eval_loss) for e in evals.get(name, []) if math.isfinite(e.eval_loss)]
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=f"{name}: eval (global model)", markersize=3)
        pts = [(e.time - t0, e.loss) for e in es if e.loss is not None]
        if pts:
            ax.plot(*zip(*pts), ".", color=color, alpha=0.35, label=f"{name}: training loss", markersize=2)
    ax.set_ylabel(f"loss ({unit})")
    _finish(plt, fig, [(ax, "held-out eval loss of the global model per learner (2 batches), and training loss")],
            out / "loss.png")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, es in series.items():
        done = [e for e in es if e.committed]
        a1.plot([e.time - t0 for e in done], [e.group_size for e in done], "o", label=name, markersize=3)
        a2.plot([e.time - t0 for e in done], [e.own_share for e in done], "o", label=name, markersize=3)
    _finish(plt, fig, [(a1, "group size of each committed round"), (a2, "own weight share in each committed round")],
            out / "rounds.png")


def _finish(plt: Any, fig: Any, axes: list[tuple[Any, str]], path: Path) -> None:
    for ax, title in axes:
        ax.set_title(title)
        ax.set_xlabel("seconds since the first round")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run with no round has nothing to label (matplotlib would warn)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


