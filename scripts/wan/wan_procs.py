"""``scripts/wan/bench_wan.py``'s processes in the emulated hosts: data-parallel ranks, a bootstrap and learners.

:class:`Procs` starts processes inside the hosts (``netns.Wan.popen``) and stops them all on exit, leaders first with
SIGTERM so that learners leave together, then each process group. :func:`run_dp` and :func:`run_learners` are one
run of a method on every host: what the processes printed (their ``final`` lines) and each host's bytes sent.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

import _bench  # scripts/wan/_bench.py: scripts/_bench.py
import netns  # scripts/wan/netns.py, stdlib only
from wan_params import (BOOT_PORT, FINISH_SLACK_S, LEARNER_PORT, START_SLACK_S, TRAJECTORY_STEP_S, BenchParams,
                        method_overrides)

from p2p_diloco.hivemind_ext.procguard import die_with_parent
from p2p_diloco.local.launcher import NO_STEP_LIMIT

HERE = Path(__file__).resolve().parent
ROOT = _bench.ROOT

log = logging.getLogger("wan.bench")

STOP_GRACE_S = 30.0
"""SIGTERM to SIGKILL for a process still running when its run ends."""
POLL_S = 1.0
LINGER_S = 20.0
"""A learner's --linger: after its final rounds, how long it waits for its peers to agree."""
FINAL_RE = re.compile(r"^final (\{.*\})$", re.M)
PEERS_RE = re.compile(r"^initial peers: (\S+)$", re.M)


class Procs:
    """Processes started inside the hosts; all stopped (leader SIGTERM, then group SIGKILL) on exit."""

    def __init__(self, wan: netns.Wan, logs: Path) -> None:
        self.wan = wan
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[Any], Any, Any]] = []
        self.started_at: dict[str, float] = {}
        """Each process's start (epoch seconds)."""
        self.final_at: dict[str, float] = {}
        """When each learner's final line was first seen (epoch seconds, within :data:`POLL_S`)."""
        self.tmp = Path(tempfile.mkdtemp(prefix="p2pdw-", dir="/tmp"))  # short: p2pd's unix sockets live here
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.tmp))

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self, name: str, host: int, cmd: Sequence[str]) -> subprocess.Popen[Any]:
        out = (self.logs / f"{name}.out").open("w")
        err = (self.logs / f"{name}.log").open("w")
        p = self.wan.popen(host, cmd, stdout=out, stderr=err, env=self.env, cwd=str(ROOT), preexec_fn=die_with_parent)
        self.procs.append((name, p, out, err))
        self.started_at[name] = time.time()
        return p

    def output(self, name: str) -> str:
        return (self.logs / f"{name}.out").read_text(errors="replace")

    def wait_for(self, name: str, rx: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        p = next(p for n, p, _, _ in self.procs if n == name)
        deadline = time.monotonic() + timeout_s
        while True:
            m = rx.search(self.output(name))
            if m:
                return m
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no line matching {rx.pattern!r} within {timeout_s:.0f} s "
                                   f"(exit code {p.poll()}); see {self.logs / name}.log")
            time.sleep(POLL_S)

    def wait_finals(self, names: Sequence[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        """Every named process's ``final`` JSON line; RuntimeError if one exits without it or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            finals = {n: FINAL_RE.search(self.output(n)) for n in names}
            for n, found in finals.items():
                if found:
                    self.final_at.setdefault(n, time.time())
            if all(finals.values()):
                return {n: json.loads(m.group(1)) for n, m in finals.items() if m}
            dead = [n for n, p, _, _ in self.procs if n in names and not finals[n] and p.poll() is not None]
            if dead or time.monotonic() > deadline:
                what = f"{dead[0]} exited without a final line" if dead else f"no final lines within {timeout_s:.0f} s"
                raise RuntimeError(f"{what}; see the logs in {self.logs}")
            time.sleep(POLL_S)

    def finals_or_stop(self, names: Sequence[str], timeout_s: float, grace_s: float) -> tuple[dict[str, Any], list[str]]:
        """:meth:`wait_finals`, but a learner still without its final line after ``timeout_s`` gets SIGTERM (it
        cancels what is in flight and leaves) and ``grace_s`` more; returns the finals and the names stopped so."""
        try:
            return self.wait_finals(names, timeout_s), []
        except RuntimeError:
            late = [n for n in names if not FINAL_RE.search(self.output(n))]
            if any(p.poll() is not None for n, p, _, _ in self.procs if n in late):
                raise  # one exited without a final line: nothing to stop
        for n, p, _, _ in self.procs:
            if n in late:
                log.warning("%s: no final line %.0f s after start; SIGTERM", n, timeout_s)
                p.send_signal(signal.SIGTERM)
        return self.wait_finals(names, grace_s), late

    def close(self) -> None:
        for _, p, _out, _err in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # SIGTERM to every leader first, so they leave together
        for name, p, out, err in self.procs:
            code = netns.stop_group(p, grace_s=STOP_GRACE_S)
            out.close()
            err.close()
            log.debug("%s exited with %s", name, code)
        self.procs = []
        shutil.rmtree(self.tmp, ignore_errors=True)


def _dp_cmd(p: BenchParams, wan: netns.Wan, i: int, mode: str, json_path: Path) -> list[str]:
    """Host i's ``dp_gloo.py`` for ``mode``: ``compute`` (no all-reduce), ``trajectory`` (evaluated every
    ``trajectory_eval_every`` steps) or ``rate`` (step times only)."""
    sets = [a for o in p.overrides for a in ("--set", o)]
    cmd = [sys.executable, str(HERE / "dp_gloo.py"), "--config", p.config, *sets, "--json", str(json_path), "-v"]
    if mode == "compute":
        return [*cmd, "--steps", str(p.compute_steps), "--compute-only", "--shard", str(i), "--num-shards",
                str(p.hosts), "--eval-every", "0"]
    cmd += ["--rank", str(i), "--world-size", str(p.hosts), "--master-addr", wan.address(0), "--ifname",
            netns.inner_if(i)]
    if mode == "trajectory":
        return [*cmd, "--steps", str(p.trajectory_steps), "--eval-every", str(p.trajectory_eval_every)]
    return [*cmd, "--steps", str(p.steps or NO_STEP_LIMIT), "--max-time", str(p.dp_max_time_s), "--eval-every", "0"]


def run_dp(p: BenchParams, wan: netns.Wan, logs: Path, tag: str, mode: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Data-parallel (``mode`` as in :func:`_dp_cmd`) on every host; the ranks' finals and each host's bytes sent."""
    budget = {"compute": 2.0 * p.compute_steps, "trajectory": TRAJECTORY_STEP_S * p.trajectory_steps,
              "rate": p.dp_max_time_s}[mode]
    before = wan.all_counters()
    with Procs(wan, logs) as procs:
        names = [f"{tag}-r{i}" for i in range(p.hosts)]
        for i, name in enumerate(names):
            procs.start(name, i, _dp_cmd(p, wan, i, mode, logs / f"{name}.json"))
        finals = procs.wait_finals(names, timeout_s=START_SLACK_S + budget + FINISH_SLACK_S)
    after = wan.all_counters()
    wire = [netns.byte_delta(b, a)["tx_bytes"] for b, a in zip(before, after)]
    return [finals[n] for n in names], wire


def run_learners(p: BenchParams, wan: netns.Wan, logs: Path, tag: str,
                 method: str) -> tuple[list[dict[str, Any]], list[int], list[dict[str, Any]]]:
    """A bootstrap peer in host 0 and one ``p2p-diloco join`` learner per host; their finals, bytes sent,
    and learner 0's ``eval`` events (the global model on the whole held-out set every ``eval_every_s``)."""
    sets = [a for o in [*p.overrides, *method_overrides(method, p.hosts), f"run.run_id=wan-{method}"]
            for a in ("--set", o)]
    cli = [sys.executable, "-m", "p2p_diloco.cli.main"]
    before = wan.all_counters()
    with Procs(wan, logs) as procs:
        procs.start(f"{tag}-boot", 0, [*cli, "bootstrap", *netns.listen_args(wan.plan, 0, BOOT_PORT), "--identity",
                                       str(procs.tmp / "boot.id"), "--config", p.config, *sets])
        peers = procs.wait_for(f"{tag}-boot", PEERS_RE, START_SLACK_S).group(1)
        names = [f"{tag}-l{i}" for i in range(p.hosts)]
        for name in names:  # learners append to their events files: an earlier run's must not mix in
            (logs / f"{name}.jsonl").unlink(missing_ok=True)
        for i, name in enumerate(names):
            evals = ["--eval-every", f"{p.eval_every_s:g}", "--eval-batches", str(EVAL_ALL)] if i == 0 else []
            procs.start(name, i, learner_command(wan.plan, i, peers, p.config, sets, logs / f"{name}.jsonl",
                                                 steps=p.steps, max_time_s=p.max_time_s,
                                                 extra=[*evals, *(["--blocking"] if method == "blocking" else [])]))
        finals = procs.wait_finals(names, timeout_s=START_SLACK_S + p.max_time_s + FINISH_SLACK_S)
    after = wan.all_counters()
    wire = [netns.byte_delta(b, a)["tx_bytes"] for b, a in zip(before, after)]
    events = logs / f"{names[0]}.jsonl"
    evals_l0 = [e for e in map(json.loads, events.read_text().splitlines() if events.exists() else [])
                if e.get("event") == "eval"]
    return [finals[n] for n in names], wire, evals_l0


def learner_command(plan: netns.WanPlan, i: int, peers: str, config: str, sets: Sequence[str], events: Path, *,
                    steps: int, max_time_s: float, extra: Sequence[str] = ()) -> list[str]:
    """Host i's ``p2p-diloco join``: learner ``l<i>`` on data shard i of ``plan.hosts``, waiting for them all, for
    ``max_time_s`` of training (and at most ``steps``, 0: no cap), its events into ``events``."""
    return [sys.executable, "-m", "p2p_diloco.cli.main", "join", "--initial-peers", peers,
            *netns.listen_args(plan, i, LEARNER_PORT), "--config", config, *sets, "--name", f"l{i}", "--shard", str(i),
            "--num-shards", str(plan.hosts), "--wait-peers", str(plan.hosts), "--steps", str(steps or NO_STEP_LIMIT),
            "--max-time", str(max_time_s), "--lr-schedule", "steps", "--linger", str(LINGER_S), "--events", str(events),
            *extra]


def discard_reasons(logs: Path, tag: str, hosts: int) -> dict[str, int]:
    """The learners' discarded rounds by reason, peer ids, hashes and numbers masked (a round counts once per
    learner)."""
    found: collections.Counter[str] = collections.Counter()
    for i in range(hosts):
        path = logs / f"{tag}-l{i}.jsonl"
        for e in map(json.loads, path.read_text().splitlines() if path.exists() else []):
            if e.get("event") == "round" and e.get("outcome") != "committed":
                found[_bench.normalise_reason(str(e.get("reason", "")), REASON_CHARS)] += 1
    return dict(found.most_common())


REASON_CHARS = 90
"""A discarded round's reason is kept to this length (its exception and the first words of its message)."""

EVAL_ALL = 1_000_000
"""``--eval-batches`` for the whole held-out set (the learner evaluates at most all of it), as data-parallel does."""
