"""``scripts/chaos.py``'s chaos run: a bootstrap peer and K learners on a :class:`LocalSwarm`, a schedule executed
on them, every action logged.

The schedule and its execution are :mod:`p2p_diloco.local.chaos` (the same driver ``p2p-diloco swarm --chaos``
uses): a kill is kill -9 of the learner's whole process group and session (CLI, DHT and averager processes,
p2pd), and the learner starts again after its down time as the *same peer* (same ``--identity`` file, same
``--name``, ``--wait-peers 0``, ``--max-time`` = the training time left, so that it ends with the others): it
resumes from its newest complete checkpoint (with ``checkpoint_every_s`` > 0), downloads the fragments the live
peers moved on and rejoins by itself. A stop is SIGSTOP to the whole peer, SIGCONT after a while.

Learner incarnations: learner ``l2`` is one peer (``--name l2``, one identity file) across restarts; its
processes are incarnations ``l2.0``, ``l2.1``, ... with their own log and events files (``logs/l2.1.log``,
``logs/l2.1.jsonl``). Every action is logged with its time in ``chaos_events.jsonl``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from chaos_record import Incarnation, incarnation_record, max_step

from p2p_diloco.core.waiting import poll_until
from p2p_diloco.local.chaos import Applied, ChaosAction, ChaosDriver
from p2p_diloco.local.launcher import NO_STEP_LIMIT, START_TIMEOUT_S, Child, LocalSwarm, read_jsonl

LINGER_S = 30.0
"""Learners' ``--linger``: after the final rounds, how long they wait for the peers to agree."""
WAIT_PEERS_TIMEOUT_S = 120.0
"""The learners' own limit on waiting for ``--wait-peers`` (``LearnerOptions.wait_peers_timeout_s``)."""
FINISH_SLACK_S = 300.0
"""After the training time: final rounds, linger, evaluation and exit."""
PROGRESS_PERIOD_S = 30.0
"""How often a progress line goes to stderr."""
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
TRAINING_START_RE = re.compile(r"learners ready; starting together in (-?[\d.]+) s")


class ChaosRun:
    """Bootstrap + learners on a :class:`LocalSwarm`, the schedule executed on them by a :class:`ChaosDriver`,
    every action logged (``events_log``) and told on stderr."""

    def __init__(self, swarm: LocalSwarm, config: str, overrides: list[str], learners: int, duration_s: float,
                 schedule: list[ChaosAction], events_log: IO[str], stop: threading.Event,
                 checkpoint_every_s: float = 0.0) -> None:
        self.swarm, self.config, self.overrides = swarm, config, overrides
        self.checkpoint_every_s = checkpoint_every_s
        """> 0: every learner checkpoints this often and a restart resumes (``--resume``); 0: restarts start afresh."""
        self.names = [f"l{i}" for i in range(learners)]
        self.duration_s, self.schedule, self.log, self.stop = duration_s, schedule, events_log, stop
        self.driver = ChaosDriver(schedule, lambda name: self.current[name].child, self._restart, self._applied)
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
        inc = Incarnation(name, key, shard, child, logs / f"{key}.jsonl", self.now(), max_time_s)
        self.incarnations.append(inc)
        self.current[name] = inc
        return inc

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
                log = inc.child.log_path  # a Child's stderr goes to its log file
                m = TRAINING_START_RE.search(log.read_text(errors="replace")) if log and log.exists() else None
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
        deadline = self.train0 + self.duration_s + FINISH_SLACK_S
        next_report = self.now() + PROGRESS_PERIOD_S
        all_final_at: float | None = None
        while True:
            now = self.now()
            self._note_up()
            self._note_exits()
            self.driver.tick(self.rel(now))
            if self.driver.done and all(inc.end != "running" for inc in self.current.values()):
                break  # every learner has exited
            if self.driver.done and all(inc.end != "running" or inc.child.final() is not None
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

    def finish(self) -> None:
        """After the swarm closed: how the incarnations still running then ended (the harness stopped them)."""
        for inc in self.incarnations:
            if inc.end == "running":
                inc.end = "final" if inc.child.final() is not None else "crashed"
                inc.ended = self.now()
                self.record("exit", inc.ended, learner=inc.learner, incarnation=inc.key, end=inc.end,
                            code=inc.child.popen.poll(), why="stopped when the swarm closed")

    # -- actions (the driver applies them; these restart and log)
    def _restart(self, a: ChaosAction) -> Child | str:
        """The killed victim again, as the same peer with the training time left; or why not."""
        assert self.end_at is not None
        budget = self.end_at - self.now()  # --max-time counts the restart's own start-up too
        left = budget - self.startup_s
        if left < MIN_RESTART_TRAIN_S:
            return f"only {left:.0f} s of training left"
        return self.spawn(a.victim, wait_peers=0, max_time_s=budget).child

    def _applied(self, ap: Applied) -> None:
        a, now = ap.action, self.now()
        inc = next(i for i in self.incarnations if i.child is ap.child)
        pid = inc.child.popen.pid
        if ap.what == "skip":
            self.record("skip", now, action=asdict(a), why=ap.why)
            self.say(f"skip {a.kind if ap.phase == 'begin' else 'restart'} of {a.victim}: {ap.why}")
        elif ap.what == "kill":
            inc.end, inc.ended = "killed", now
            self.record("kill", now, learner=a.victim, incarnation=inc.key, pid=pid,
                        steps_seen=max_step(read_jsonl(inc.events)), restart_in_s=a.down_s)
            self.say(f"kill -9 {a.victim} ({inc.key}, pid {pid}); restart in {a.down_s:.0f} s")
        elif ap.what == "stop":
            inc.stops.append([now, None])
            self.record("stop", now, learner=a.victim, incarnation=inc.key, pid=pid, cont_in_s=a.down_s)
            self.say(f"SIGSTOP {a.victim} ({inc.key}, pid group {pid}) for {a.down_s:.0f} s")
        elif ap.what == "cont":
            if inc.stops and inc.stops[-1][1] is None:
                inc.stops[-1][1] = now
            self.record("cont", now, learner=a.victim, incarnation=inc.key, **({"why": ap.why} if ap.why else {}))
            self.say(f"SIGCONT {a.victim} ({inc.key})" + (f" ({ap.why})" if ap.why else ""))
        elif ap.what == "restart":
            self.record("restart", inc.spawned, learner=a.victim, incarnation=inc.key, pid=pid,
                        max_time_s=round(inc.max_time_s, 1))
            self.say(f"restart {a.victim} as {inc.key} (same identity), about "
                     f"{inc.max_time_s - self.startup_s:.0f} s of training")
        if ap.reached == 0:
            self.record("signal_failed", now, incarnation=inc.key, signal="SIGSTOP" if ap.what == "stop" else "SIGCONT",
                        why="no such session")

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
            run.driver.continue_stopped()  # before the swarm stops them: a stopped learner cannot leave
            run._note_exits()
            swarm.close()
            run.finish()
    assert run.train0 is not None and run.train0_wall is not None
    return {"incarnations": [incarnation_record(inc, run.train0, run.t_harness, run.train0_wall)
                             for inc in run.incarnations],
            "schedule": [asdict(a) for a in schedule], "startup_s": run.startup_s, "train0_wall": run.train0_wall,
            "interrupted": run.interrupted, "events": read_jsonl(out / "chaos_events.jsonl")}
