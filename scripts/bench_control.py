#!/usr/bin/env python3
"""Control-plane bytes per peer against swarm size: N learners on 127.0.0.1, every hivemind RPC counted by purpose.

For each N, a bootstrap and N real ``p2p-diloco join`` learners run the whole control plane on a tiny model paced to
one step per second, default outer and averaging config; ``scripts/wan/rpc_tally`` tallies every hivemind RPC of
every process by purpose, over a window once all train (the page's method, in :data:`BENCH`, has it all).
Sizes run smallest first; the measured memory decides which larger sizes fit. Every process started is stopped when
its size ends, also on errors, SIGTERM and Ctrl+C; each learner has a ``--max-time`` deadline of its own besides.

    python scripts/bench_control.py                          # N = 4, 16, 64 (or the largest that fits), ~20 min
    python scripts/bench_control.py --n 4 16 32 --window-s 60
    python scripts/bench_control.py --quick                  # N = 3, 30 s window: checks the pipeline (~2 min)
    python scripts/bench_control.py --render-only            # rewrite the page (README.md) from control.json

Writes ``control.json``, ``README.md`` (the page) and ``control.png`` into ``--out`` (default results/control); logs,
events and the raw tallies (which hold absolute paths: never committed) go to ``--out/logs``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import _bench

from p2p_diloco.core.events import Event, RoundEvent, read_events
from p2p_diloco.core.waiting import poll_until
from p2p_diloco.local.launcher import NO_STEP_LIMIT, START_TIMEOUT_S, Child, LocalSwarm

log = logging.getLogger("bench.control")

TALLY_DIR = _bench.ROOT / "scripts" / "wan" / "rpc_tally"
"""The byte tally (``sitecustomize.py``) and its summary by purpose (``summarize.py``)."""
DEFAULT_SIZES = (4, 16, 64)
CANDIDATES = (4, 16, 32, 64)
"""The sizes a size that does not fit in memory may be replaced by (the largest that fits)."""
QUICK_SIZES = (3,)
STEP_S = 1.0
"""Every learner's inner step is padded to this (peer profile ``min_step_s``): the inner loop costs next to no CPU.
The clock schedule derives its sync period from it: H (25) x 1 s per fragment, a round every 25/F s."""
DEFAULT_WINDOW_S = 90.0
"""Bytes counted over this window: 3.6 sync periods, so every fragment has had 3 or 4 rounds."""
SETTLE_S = 30.0
"""After the last learner started training, before the window opens: one sync period (the first rounds of every
fragment, the clock's first publication) and then some."""
QUICK_WINDOW_S, QUICK_SETTLE_S = 30.0, 15.0
JOIN_TIMEOUT_S = 120.0
"""Each learner's ``--join-timeout``: learners importing torch together on 2 busy cores join slowly (default 10 s)."""
START_BATCH = 8
"""Learners started together; the next batch once these have joined the DHT (torch imports do not all collide).
No ``--wait-peers``: its 120 s wait for all N gave up at N = 32 here, and the window opens once all train anyway."""
JOIN_DEADLINE_S = 240.0
"""A batch's start to every one of its learners joined."""
STARTUP_BASE_S, STARTUP_PER_LEARNER_S = 120.0, 8.0
"""Deadline from the bootstrap's start to the last learner training: base + this per learner (2 busy cores)."""
MAX_TIME_SLACK_S = 120.0
"""Each learner's own ``--max-time`` is the whole schedule plus this: it ends by itself if this script dies."""
STOP_GRACE_S = 40.0
"""SIGTERM to SIGKILL: learners leave in parallel (tombstone, averagers shut down)."""
LINGER_S = 1.0
"""A learner's ``--linger`` when it is stopped (nothing is measured then)."""
POLL_S = 1.0
REASON_CHARS = 70
"""A discarded round's reason, numbers folded, is kept to this length (the page lists the commonest)."""
GIT_TIMEOUT_S = 30.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""``/proc`` CPU times are in these ticks per second."""
GIB, MIB = 2**30, 2**20
MEMORY_BUDGET_BYTES = 16 * GIB
"""What all learners of one size may use (sum of PSS); less if less than that plus the reserve is available."""
MEMORY_RESERVE_BYTES = 2 * GIB
"""Kept free of the machine's available memory, whatever the budget (other sessions share it)."""
MEMORY_MARGIN = 1.25
"""Memory per learner grows with N (more connections, records, group metadata): plan with this margin."""
PLOT_FLOOR_BPS = 100.0
"""The figure's floor (log scale): smaller rates are drawn on it, purposes that never reach it are left out."""
HEALTHY_SHARE = 0.5
"""A size whose swarm committed fewer than this share of the rounds that ended in its window was not averaging (on
this machine: CPU-starved, its matchmaking failing): its bytes are those of a broken swarm, and no growth is computed
from them."""
TARGET_BYTES_PER_S = 2000.0
"""The bar: control-plane bytes per second per peer at every N (2 kB/s)."""
TARGET_GROWTH = 1.5
"""The bar: control bytes/s per peer from N = 16 to N = 64 grow at most this much."""
VOUCHES = "anchor vouches (and the sync clock read with them)"
"""A purpose of our own beside ``summarize.PURPOSES``: every RPC naming a ``<prefix>_anchor_vN`` key (``summarize``
counts them under matchmaking, as their keys hold ``_frag``). The learner reads the vouches and the sync clock in one
``get_many``, whose RPCs are labelled with all its keys: those reads count here, not under the sync clock."""
PAYLOAD = "pseudo-gradients and state downloads"
"""The one purpose that is not control plane: the tensors themselves."""
TRAINING_LINE = "training from step"
"""The learner's log line when its inner loop starts (after ``--wait-peers``)."""
TINY_CONFIG = """\
# bench_control: a tiny model (about 20k parameters), four blocks for the default four fragments; outer and
# averaging sections at their defaults
[run]
run_id = "{run_id}"
seed = 0

[model]
n_layer = 4
n_head = 1
n_embd = 16
block_size = 16

[data]
max_bytes = 300_000
eval_batches = 1
eval_batch_size = 4

[inner]
batch_size = 4
warmup_steps = 5
"""
PROFILE = f"""\
name = "paced"
slowdown = 1.0
min_step_s = {STEP_S}
threads = 1
"""
BENCH = _bench.Bench("control", "control", "Control-plane bytes per peer against swarm size", "scripts/bench_control.py",
                     f"""\
For each N, a bootstrap peer and N `p2p-diloco join` learners on 127.0.0.1 (real processes: hivemind DHT, averagers,
all-reduce) run the learner's whole control plane -- peer records published and read, the sync clock, hivemind's
matchmaking, commit verdicts, state-sharing declarations, anchor vouches -- on a tiny model (4 layers, one per fragment, width 16,
block 16: about 20k parameters) whose inner steps are padded to {STEP_S:g} s (peer profile `min_step_s`): the inner loop costs next to no
CPU, the control plane is what runs. Outer and averaging config are the defaults (F=4, H=25, int4, clock schedule: a fragment every
25 x {STEP_S:g} s, any live peers): the control plane users get.

Every process (learners, their forked DHT and averager processes, the bootstrap) runs with `scripts/wan/rpc_tally` on
its `PYTHONPATH`: each hivemind RPC it *makes* is tallied, request and answer bytes (what the RPC carries, not the
libp2p and TCP framing), by the DHT key it serves, and each message it sends on a stream by its type; `summarize.py`
groups them by purpose (the `<prefix>_anchor_vN` keys are split out here as "{VOUCHES}": the learner reads the
vouches and the sync clock in one `get_many`, whose RPCs carry all its keys). The payload -- all-reduce
parts and state downloads -- is reported beside the control plane, not in it. Each byte is counted once, by the
caller: per peer = all processes' bytes (bootstrap included) / N.

Learners start in batches of {START_BATCH} (the next once these have joined the DHT) and train as soon as they have
looked at the swarm (no `--wait-peers`). Bytes are counted over a window (90 s by default) that opens {SETTLE_S:g} s
after the last learner started training (start-up, state downloads of late joiners and the first rounds are left
out): the difference of two snapshots of the tallies, which each process rewrites every 3 s. Memory is the sum of PSS
over each learner's processes (main, DHT, averagers, `p2pd`) at the end of the window; CPU is the user + system time
of the swarm's processes over the window, and the whole machine's busy time beside it (other work shares this
machine). A size whose swarm committed fewer than {HEALTHY_SHARE:.0%} of the rounds that ended in its window is
marked **not averaging**: its bytes are those of a broken (here: CPU-starved) swarm, and no growth is computed from
them. Sizes run smallest first; the memory of the largest size run so far
decides whether the next fits in 16 GiB (x {MEMORY_MARGIN:g} margin; less if the machine has less available); one that
does not is replaced by the largest of 4, 16, 32, 64 that does.

The bar: <= {TARGET_BYTES_PER_S / 1000:g} kB/s ({TARGET_BYTES_PER_S:,.0f} B/s) of control plane per peer at every N,
and at most {TARGET_GROWTH:g}x growth from N = 16 to N = 64.""")


# ---------------------------------------------------------------- the tallies


def load_summarize() -> ModuleType:
    """``scripts/wan/rpc_tally/summarize.py``, loaded by file (its folder is no package)."""
    spec = importlib.util.spec_from_file_location("rpc_tally_summarize", TALLY_DIR / "summarize.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{TALLY_DIR / 'summarize.py'}: cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summarize = load_summarize()
Counts = dict[str, list[int]]
"""``{rpc name: [calls, bytes sent, bytes received]}``, as ``summarize.summarize`` returns."""


def snapshot(root: Path) -> dict[str, Counts]:
    """Every process folder's tallies so far (``root/<process>/<pid>.json``), summed per folder; a folder with none
    written yet (its processes made no RPC, or have not dumped yet) maps to nothing."""
    return {folder.name: summarize.summarize(folder) if any(folder.glob("*.json")) else {}
            for folder in sorted(root.iterdir()) if folder.is_dir()}


def difference(end: Counts, start: Counts) -> Counts:
    """What was tallied between two snapshots of one folder."""
    out = {}
    for name, counts in end.items():
        before = start.get(name, [0, 0, 0])
        out[name] = [a - b for a, b in zip(counts, before)]
    return out


def add(totals: list[Counts]) -> Counts:
    out: Counts = {}
    for total in totals:
        for name, counts in total.items():
            out[name] = [a + b for a, b in zip(out.get(name, [0, 0, 0]), counts)]
    return out


def by_purpose(total: Counts) -> dict[str, dict[str, int]]:
    """Calls and bytes per purpose: ``summarize.by_purpose`` with the anchor vouches split out of matchmaking."""
    vouches = {n: c for n, c in total.items() if "_anchor_v" in n}
    out = summarize.by_purpose({n: c for n, c in total.items() if n not in vouches})
    out[VOUCHES] = {"calls": sum(c[0] for c in vouches.values()), "bytes": sum(c[1] + c[2] for c in vouches.values())}
    return out


def control_bytes(total: Counts) -> int:
    return sum(p["bytes"] for purpose, p in by_purpose(total).items() if purpose != PAYLOAD)


# ---------------------------------------------------------------- memory


def session_memory(child: Child) -> tuple[int, int]:
    """(PSS, RSS) in bytes of every live process of one child's session (main, DHT, averagers, p2pd)."""
    pss = rss = 0
    for pid, _ in child.session():
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except (FileNotFoundError, ProcessLookupError):  # it ended while we looked: it uses nothing now
            continue
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("Pss", "Rss"):
                kib = int(value.split()[0]) * 1024
                pss, rss = (pss + kib, rss) if key == "Pss" else (pss, rss + kib)
    return pss, rss


def session_cpu_s(child: Child) -> float:
    """CPU seconds (user + system) used so far by the live processes of one child's session."""
    ticks = 0
    for pid, _ in child.session():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # it ended while we looked: its time is lost to the sum
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ..., utime (12th), stime (13th)
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (``/proc/stat``)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values) - idle) / CLOCK_TICKS, sum(values) / CLOCK_TICKS


def mem_available() -> int:
    """The machine's available memory (``MemAvailable``), bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo: no MemAvailable line")


def memory_budget(available: int) -> int:
    """What one size's learners may use: the budget, or the available memory less the reserve if that is less."""
    return max(0, min(MEMORY_BUDGET_BYTES, available - MEMORY_RESERVE_BYTES))


def fits(n: int, per_learner: float | None, budget: int) -> str | None:
    """None when ``n`` learners of ``per_learner`` bytes each (None: not measured yet) fit in ``budget`` with the
    margin; else why not, in one line."""
    if per_learner is None:
        return None
    need = n * per_learner * MEMORY_MARGIN
    if need <= budget:
        return None
    return (f"needs ~{need / GIB:.1f} GiB ({n} x {per_learner / MIB:.0f} MiB PSS x {MEMORY_MARGIN:g}), "
            f"budget {budget / GIB:.1f} GiB")


def replacement(skipped: int, per_learner: float | None, budget: int, planned: list[int]) -> int | None:
    """The size to run in place of ``skipped`` (too big): the largest candidate below it that fits and is above
    every size already planned; None if there is none."""
    above = max(planned, default=0)
    options = [c for c in CANDIDATES if above < c < skipped and fits(c, per_learner, budget) is None]
    return max(options, default=None)


# ---------------------------------------------------------------- which code ran


def sources_digest() -> str:
    """A digest of the ``p2p_diloco`` sources the learners import (they run from this repository's folder)."""
    h = hashlib.sha256()
    package = _bench.ROOT / "p2p_diloco"
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def code_identity(label: str | None) -> dict[str, Any]:
    """Which code the learners ran: ``label`` (given), the git commit and the ``p2p_diloco`` files changed from it
    (when the repository is a git checkout), and the sources' digest."""
    ident: dict[str, Any] = {"label": label, "commit": None, "changed": [], "sources_sha256": sources_digest()}
    try:
        ident["commit"], ident["changed"] = _bench.git_revision(GIT_TIMEOUT_S)
    except (FileNotFoundError, subprocess.CalledProcessError):  # no git, or not a checkout (an export): the label says
        log.info("no git checkout at %s: the code is named by --code-label and its digest only", _bench.ROOT)
    return ident


# ---------------------------------------------------------------- one size


def write_run_files(folder: Path, n: int) -> tuple[Path, Path]:
    """The tiny config (its own run id per size) and the pacing profile, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config, profile = folder / "tiny.toml", folder / "paced.toml"
    config.write_text(TINY_CONFIG.format(run_id=f"control-n{n}"))
    profile.write_text(PROFILE)
    return config, profile


class Interrupted(RuntimeError):
    """SIGTERM: raised in the main thread so that every ``with`` block stops what it started."""


class Swarm(LocalSwarm):
    """:class:`LocalSwarm` whose cleanup no signal interrupts: a SIGINT or SIGTERM that comes while it stops
    everything is noted and raised once it is done (raised in the middle of it, one once left the bootstrap running;
    masking the signal in this thread does not help: Python runs handlers here whichever thread the kernel picks)."""

    def close(self) -> None:
        caught: list[int] = []
        held = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            super().close()
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)
        if caught:
            raise Interrupted(f"stopped by {signal.Signals(caught[0]).name} (after stopping every process)")


def start_tallied(swarm: LocalSwarm, name: str, args: list[str], tally: Path) -> Child:
    """A ``p2p-diloco`` child whose processes tally their RPCs into ``tally/<name>``; stopped with the swarm."""
    path = os.pathsep.join(p for p in (str(TALLY_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(swarm.env, PYTHONPATH=path, RPC_TALLY_OUT=str(tally / name))
    child = Child(name, args, swarm.logs / f"{name}.log", env)
    swarm.children.append(child)
    return child


def training(children: list[Child]) -> bool:
    """Whether every learner has started its inner loop; RuntimeError naming the log of one that exited."""
    for child in children:
        if not child.alive:
            raise RuntimeError(f"{child.name} exited (code {child.popen.returncode}) before training; see {child.log_path}")
    return all(child.log_path is not None and child.log_path.exists()
               and TRAINING_LINE in child.log_path.read_text(errors="replace") for child in children)


def rounds_in(events: list[list[Event]], t0: float, t1: float) -> dict[str, Any]:
    """Rounds each learner ended within [t0, t1] (wall clock, as the events' DHT time), and its step time there."""
    rounds = [e for ev in events for e in ev if isinstance(e, RoundEvent) and t0 <= e.time <= t1]
    steps_s = []
    for ev in events:
        inside = [e for e in ev if t0 <= e.time <= t1]
        if len(inside) >= 2 and inside[-1].step > inside[0].step:
            steps_s.append((inside[-1].time - inside[0].time) / (inside[-1].step - inside[0].step))
    committed = [e for e in rounds if e.committed]
    reasons = Counter(re.sub(r"\d+", "N", e.reason)[:REASON_CHARS] for e in rounds if not e.committed)
    return {"committed": len(committed), "discarded": len(rounds) - len(committed),
            "discard_reasons": [[reason, count] for reason, count in reasons.most_common(3)],
            "median_group_size": statistics.median(e.group_size for e in committed) if committed else None,
            "median_step_s": statistics.median(steps_s) if steps_s else None}


def run_size(n: int, window_s: float, settle_s: float, logs: Path) -> dict[str, Any]:
    """A bootstrap and ``n`` learners: their bytes by purpose over the window, memory, start-up time."""
    if logs.exists():  # a previous run's tallies and events must not mix in
        shutil.rmtree(logs)
    tally = logs / "tally"
    config, profile = write_run_files(logs, n)
    startup_deadline_s = STARTUP_BASE_S + STARTUP_PER_LEARNER_S * n
    max_time_s = startup_deadline_s + settle_s + window_s + MAX_TIME_SLACK_S
    t0 = time.monotonic()
    with Swarm(logs, grace_s=STOP_GRACE_S) as swarm:
        boot = start_tallied(swarm, "boot", ["bootstrap", "--identity", str(swarm.tmp / "boot.id"), "--config",
                                             str(config)], tally)
        peers = boot.wait_for(r"^initial peers: (\S+)", START_TIMEOUT_S).group(1)
        t_boot = time.monotonic() - t0
        names = [f"l{i}" for i in range(n)]
        learners: list[Child] = []
        for first in range(0, n, START_BATCH):
            batch = [start_tallied(swarm, name, [
                "join", "--initial-peers", peers, "--config", str(config), "--name", name, "--profile", str(profile),
                "--steps", str(NO_STEP_LIMIT), "--max-time", f"{max_time_s:g}", "--join-timeout", f"{JOIN_TIMEOUT_S:g}",
                "--linger", f"{LINGER_S:g}", "--events", str(logs / f"{name}.jsonl"),
            ], tally) for name in names[first:first + START_BATCH]]
            for child in batch:
                child.wait_for(r"^joined run ", JOIN_DEADLINE_S)
            learners += batch
        log.info("N=%d: bootstrap up after %.0f s, all %d learners joined after %.0f s", n, t_boot, n,
                 time.monotonic() - t0)
        poll_until(lambda: training(learners), startup_deadline_s - (time.monotonic() - t0),
                   f"N={n}: every learner training", POLL_S, detail=lambda: f"see the logs in {logs}")
        t_training = time.monotonic() - t0
        log.info("N=%d: all training after %.0f s; settling %.0f s, then counting %.0f s", n, t_training, settle_s,
                 window_s)
        time.sleep(settle_s)  # a fixed settle time, by design: what follows it is what is measured
        start, w0, wall0 = snapshot(tally), time.monotonic(), time.time()
        cpu0, machine0 = sum(session_cpu_s(c) for c in [boot, *learners]), machine_cpu()
        time.sleep(window_s)  # the measured window
        end, w1, wall1 = snapshot(tally), time.monotonic(), time.time()
        cpu1, machine1 = sum(session_cpu_s(c) for c in [boot, *learners]), machine_cpu()
        memory = {c.name: session_memory(c) for c in [boot, *learners]}
        alive = sum(c.alive for c in learners)
        available, load = mem_available(), os.getloadavg()
        log.info("N=%d: window closed (%d of %d learners alive); stopping everything", n, alive, n)
    wall_s = time.monotonic() - t0
    seconds = w1 - w0
    per_process = {name: difference(end[name], start.get(name, {})) for name in end}
    total = add(list(per_process.values()))
    purposes = by_purpose(total)
    top = sorted(total.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:12]
    learner_control = [control_bytes(per_process.get(name, {})) / seconds for name in names]
    pss = [memory[name][0] for name in names]
    return {
        "n": n, "alive_at_end": alive, "window_s": round(seconds, 2), "settle_s": settle_s,
        "startup": {"bootstrap_s": round(t_boot, 1), "all_training_s": round(t_training, 1)},
        "wall_s": round(wall_s, 1),
        "control_bps_per_peer": round(sum(p["bytes"] for k, p in purposes.items() if k != PAYLOAD) / seconds / n, 1),
        "payload_bps_per_peer": round(purposes[PAYLOAD]["bytes"] / seconds / n, 1),
        "purposes": {k: {"bps_per_peer": round(p["bytes"] / seconds / n, 1),
                         "calls_per_s_per_peer": round(p["calls"] / seconds / n, 3)} for k, p in purposes.items()},
        "learner_control_bps": {"min": round(min(learner_control), 1), "median": round(statistics.median(learner_control), 1),
                                "max": round(max(learner_control), 1)},
        "bootstrap_control_bps": round(control_bytes(per_process.get("boot", {})) / seconds, 1),
        "top_rpcs": [{"rpc": name, "bps_per_peer": round((c[1] + c[2]) / seconds / n, 1),
                      "calls_per_s_per_peer": round(c[0] / seconds / n, 3)} for name, c in top],
        "rounds": rounds_in([read_events(logs / f"{name}.jsonl") for name in names], wall0, wall1),
        "memory": {"pss_per_learner_mib": round(statistics.mean(pss) / MIB, 1),
                   "rss_per_learner_mib": round(statistics.mean(memory[name][1] for name in names) / MIB, 1),
                   "pss_all_gib": round(sum(m[0] for m in memory.values()) / GIB, 2),
                   "bootstrap_pss_mib": round(memory["boot"][0] / MIB, 1),
                   "available_at_end_gib": round(available / GIB, 1)},
        "loadavg_1min_at_end": round(load[0], 2),
        "cpu": {"swarm_cores": round((cpu1 - cpu0) / seconds, 2),
                "machine_busy_cores": round((machine1[0] - machine0[0]) / seconds, 2),
                "machine_cores": os.cpu_count()},
    }


# ---------------------------------------------------------------- the sizes


def bench(sizes: list[int], window_s: float, settle_s: float, out: Path, quick: bool,
          code_label: str | None = None) -> dict[str, Any]:
    """Every size that fits, smallest first; what was skipped and why."""
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "code": code_identity(code_label),
        "params": {"sizes_requested": sizes, "window_s": window_s, "settle_s": settle_s, "step_s": STEP_S,
                   "quick": quick, "memory_budget_gib": MEMORY_BUDGET_BYTES / GIB, "memory_margin": MEMORY_MARGIN,
                   "target_bps_per_peer": TARGET_BYTES_PER_S, "target_growth": TARGET_GROWTH,
                   "config": TINY_CONFIG.format(run_id="control-n<N>"), "profile": PROFILE},
        "runs": [], "skipped": [],
    }
    per_learner: float | None = None
    planned: list[int] = []
    for n in sorted(set(sizes)):
        budget = memory_budget(mem_available())
        why = fits(n, per_learner, budget)
        run_n, note = n, ""
        if why is not None:
            result["skipped"].append({"n": n, "reason": why})
            log.info("N=%d skipped: %s", n, why)
            alternative = replacement(n, per_learner, budget, planned)
            if alternative is None or alternative in sizes:
                continue
            run_n, note = alternative, f"in place of {n}"
            log.info("N=%d runs %s", run_n, note)
        planned.append(run_n)
        row = run_size(run_n, window_s, settle_s, out / "logs" / f"n{run_n}")
        row["note"] = note
        row["code_changed"] = sources_digest() != result["code"]["sources_sha256"]  # edited while it ran: mixed code
        result["runs"].append(row)
        per_learner = row["memory"]["pss_per_learner_mib"] * MIB
        log.info("N=%d: control %.0f B/s per peer, payload %.0f B/s per peer, %.0f MiB PSS per learner, %.0f s",
                 run_n, row["control_bps_per_peer"], row["payload_bps_per_peer"], row["memory"]["pss_per_learner_mib"],
                 row["wall_s"])
        _bench.publish(BENCH, out, {**result, "wall_s": round(time.monotonic() - t0, 1)}, markdown, plot,
                       echo=False)  # what was measured survives an interrupted run
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return _bench.publish(BENCH, out, result, markdown, plot)


# ---------------------------------------------------------------- the page


def control_purposes(result: dict[str, Any]) -> list[str]:
    """Every control-plane purpose, in ``summarize``'s order, ours last."""
    first = result["runs"][0]["purposes"] if result["runs"] else {}
    return [p for p in first if p != PAYLOAD]


def healthy(row: dict[str, Any]) -> bool:
    """Whether the swarm of one size was averaging over its window (see :data:`HEALTHY_SHARE`)."""
    rounds = row["rounds"]["committed"] + row["rounds"]["discarded"]
    return rounds > 0 and row["rounds"]["committed"] >= HEALTHY_SHARE * rounds


def verdict(result: dict[str, Any]) -> list[str]:
    """The bar, against what was measured; sizes whose swarm was not averaging say so and set no growth."""
    runs = result["runs"]
    if not runs:
        return ["Nothing was measured."]
    over = [r for r in runs if r["control_bps_per_peer"] > TARGET_BYTES_PER_S]
    lines = [f"- <= {TARGET_BYTES_PER_S:,.0f} B/s of control plane per peer at every N: **"
             + ("not met" if over else "met") + "**: "
             + ", ".join(f"N = {r['n']} {r['control_bps_per_peer']:,.0f} B/s "
                         f"({r['control_bps_per_peer'] / TARGET_BYTES_PER_S:.0f}x the bar"
                         + ("" if healthy(r) else ", swarm not averaging") + ")" for r in runs) + "."]
    by_n = {r["n"]: r for r in runs}
    largest = max(by_n)
    if 16 not in by_n or largest <= 16:
        return [*lines, "- Growth from N = 16 to N = 64: not measured (needs N = 16 and a larger N)."]
    broken = [by_n[n] for n in (16, largest) if not healthy(by_n[n])]
    scope = "" if largest == 64 else " (N = 64 was not run; the bar is for 16 to 64)"
    growth = by_n[largest]["control_bps_per_peer"] / by_n[16]["control_bps_per_peer"]
    if broken:
        why = "; ".join(f"at N = {r['n']} {r['rounds']['committed']} of {r['rounds']['committed'] + r['rounds']['discarded']} "
                        f"rounds committed" for r in broken)
        return [*lines, f"- Growth from N = 16 to N = {largest}: **not measurable on this machine** ({why}: the swarm "
                        f"was not averaging, its bytes are a broken swarm's; the ratio would be {growth:.2f}x){scope}."]
    ok = growth <= TARGET_GROWTH
    return [*lines, f"- Growth from N = 16 to N = {largest}: **{growth:.2f}x** (bar <= {TARGET_GROWTH:g}x: "
                    f"**{'met' if ok else 'not met'}**){scope}."]


def cpu_cell(row: dict[str, Any]) -> str:
    """CPU cores used over the window by the swarm and by the whole machine, and the load average at its end."""
    cpu = row["cpu"]
    return (f"{cpu['swarm_cores']:.2f} / {cpu['machine_busy_cores']:.2f} of {cpu['machine_cores']} "
            f"(load {row['loadavg_1min_at_end']:.0f})")


def code_line(code: dict[str, Any]) -> str:
    """The code the learners ran, in a few words."""
    parts = [code["label"]] if code.get("label") else []
    if code.get("commit"):
        changed = code.get("changed", [])
        parts.append(f"commit {code['commit']}" + (f" with {len(changed)} changed files in p2p_diloco/ "
                                                   f"({', '.join(changed)})" if changed else ""))
    parts.append(f"sources digest {code['sources_sha256']}")
    return "; ".join(parts)


def markdown(result: dict[str, Any]) -> str:
    """The per-N table, control plane by purpose, the bar, and which sizes ran."""
    p, runs = result["params"], result["runs"]
    lines = [f"{'Quick run (checks the pipeline, not the numbers): ' if p['quick'] else ''}"
             f"Steps padded to {p['step_s']:g} s, {p['settle_s']:g} s settle, then a {p['window_s']:g} s window; "
             f"whole benchmark {result.get('wall_s', 0) / 60:.1f} min. Code: {code_line(result['code'])}.", "",
             "| N | control B/s per peer | top 3 purposes, B/s per peer | payload B/s per peer | busiest learner, "
             "control B/s | rounds in window: committed / discarded (median group) | s per step | CPU cores: swarm / "
             "whole machine | PSS per learner | start-up (all training) | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        control = {k: v for k, v in r["purposes"].items() if k != PAYLOAD}
        top = sorted(control.items(), key=lambda kv: -kv[1]["bps_per_peer"])[:3]
        rd = r["rounds"]
        group = "-" if rd["median_group_size"] is None else f"{rd['median_group_size']:g}"
        step = "-" if rd["median_step_s"] is None else f"{rd['median_step_s']:.2f} s"
        alive = "" if r["alive_at_end"] == r["n"] else f" ({r['alive_at_end']} alive at the end)"
        alive += " (**the code changed while it ran**)" if r.get("code_changed") else ""
        alive += "" if healthy(r) else " (**not averaging**)"
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(
            f"| {r['n']}{note}{alive} | **{r['control_bps_per_peer']:,.0f}** | "
            + "; ".join(f"{k}: {v['bps_per_peer']:,.0f}" for k, v in top)
            + f" | {r['payload_bps_per_peer']:,.0f} | {r['learner_control_bps']['max']:,.0f} | "
            f"{rd['committed']} / {rd['discarded']} ({group}) | {step} | {cpu_cell(r)} | "
            f"{r['memory']['pss_per_learner_mib']:.0f} MiB | "
            f"{r['startup']['all_training_s']:.0f} s | {r['wall_s'] / 60:.1f} min |")
    discards = [f"N = {r['n']}: " + "; ".join(f"{reason} ({count})" for reason, count in r["rounds"]["discard_reasons"])
                for r in runs if r["rounds"]["discard_reasons"]]
    if discards:
        lines += ["", "Discarded rounds in the window, the commonest reasons (numbers folded to N):", "",
                  *[f"- {d}" for d in discards]]
    lines += ["", "## The bar", "", *verdict(result), ""]
    if runs:
        ns = [r["n"] for r in runs]
        lines += ["## Control plane by purpose", "", "Bytes per second per peer (calls per second per peer).", "",
                  "| purpose | " + " | ".join(f"N = {n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
        for purpose in control_purposes(result):
            lines.append(f"| {purpose} | " + " | ".join(
                f"{r['purposes'][purpose]['bps_per_peer']:,.0f} ({r['purposes'][purpose]['calls_per_s_per_peer']:.2f})"
                for r in runs) + " |")
        lines.append("| **control plane, all** | " + " | ".join(f"**{r['control_bps_per_peer']:,.0f}**" for r in runs)
                     + " |")
        lines.append(f"| {PAYLOAD} (not control) | " + " | ".join(f"{r['payload_bps_per_peer']:,.0f}" for r in runs) + " |")
        big = runs[-1]
        lines += ["", f"The busiest RPCs at N = {big['n']} (DHT keys with hashes and versions folded, B/s per peer):", "",
                  "| RPC | B/s per peer | calls/s per peer |", "|---|---|---|"]
        lines += [f"| `{t['rpc']}` | {t['bps_per_peer']:,.0f} | {t['calls_per_s_per_peer']:.2f} |" for t in big["top_rpcs"]]
        lines += ["", "Per size: the busiest learner's own calls (control B/s: min / median / max), the bootstrap's, "
                  "and memory (sum over every process of the run, and per learner).", "",
                  "| N | learners' control B/s (min / median / max) | bootstrap control B/s | PSS per learner | RSS per "
                  "learner | PSS, all processes | available at the end |",
                  "|---|---|---|---|---|---|---|"]
        for r in runs:
            lc, m = r["learner_control_bps"], r["memory"]
            lines.append(f"| {r['n']} | {lc['min']:,.0f} / {lc['median']:,.0f} / {lc['max']:,.0f} | "
                         f"{r['bootstrap_control_bps']:,.0f} | {m['pss_per_learner_mib']:.0f} MiB | "
                         f"{m['rss_per_learner_mib']:.0f} MiB | {m['pss_all_gib']:.2f} GiB | "
                         f"{m['available_at_end_gib']:.1f} GiB |")
    lines += ["", "## Sizes", "", f"Requested: {', '.join(str(n) for n in p['sizes_requested'])}; run: "
              + (", ".join(str(r["n"]) + (f" ({r['note']})" if r.get("note") else "") for r in runs) or "none") + "."]
    lines += [f"- N = {s['n']} skipped: {s['reason']}." for s in result["skipped"]]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Control bytes/s per peer against N (log x), total and by purpose, the payload beside it, the bar drawn."""
    runs = result["runs"]
    if not runs:
        return
    ns = [r["n"] for r in runs]
    with _bench.figure(path, 1, (9, 5)) as (ax,):
        totals = [r["control_bps_per_peer"] for r in runs]
        ax.plot(ns, totals, "k-o", linewidth=2.5, label="control plane, all")
        for r, total in zip(runs, totals):
            if not healthy(r):  # a broken swarm's bytes: marked where they are drawn
                ax.annotate("not averaging", (r["n"], total), textcoords="offset points", xytext=(0, 9), ha="center",
                            fontsize=8, color="tab:red")
        for purpose in control_purposes(result):
            ys = [r["purposes"][purpose]["bps_per_peer"] for r in runs]
            if any(y >= PLOT_FLOOR_BPS for y in ys):
                ax.plot(ns, [max(y, PLOT_FLOOR_BPS) for y in ys], marker=".", linewidth=1, label=purpose)
        ax.plot(ns, [max(r["payload_bps_per_peer"], PLOT_FLOOR_BPS) for r in runs], color="grey", linestyle=":",
                marker="s", label=f"{PAYLOAD} (not control)")
        ax.axhline(TARGET_BYTES_PER_S, color="tab:red", linestyle="--", label=f"bar: {TARGET_BYTES_PER_S:,.0f} B/s per peer")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(PLOT_FLOOR_BPS / 1.5, 3 * max(max(totals), TARGET_BYTES_PER_S))  # room for the labels above
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("learners N (127.0.0.1)")
        ax.set_ylabel(f"bytes/s per peer (below {PLOT_FLOOR_BPS:g}: drawn at {PLOT_FLOOR_BPS:g})")
        ax.set_title(f"Control-plane bytes per peer against N (steps of {result['params']['step_s']:g} s, "
                     f"{result['params']['window_s']:g} s window)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(f"stopped by {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, quick=f"N = {QUICK_SIZES[0]}, {QUICK_WINDOW_S:g} s window, {QUICK_SETTLE_S:g} s "
                                           "settle: checks the pipeline (about 2 min)")
    p.add_argument("--n", type=int, nargs="+", metavar="N",
                   help=f"swarm sizes, smallest first (default: {' '.join(map(str, DEFAULT_SIZES))}; a size that does "
                        "not fit in memory is replaced by the largest of 4 16 32 64 that does)")
    p.add_argument("--window-s", type=float, help=f"seconds of counting per size (default: {DEFAULT_WINDOW_S:g})")
    p.add_argument("--code-label", help="names the code the learners run, on the page (default: none; the git commit "
                                        "and changed files, when there is a checkout, are recorded anyway)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    out = args.out.resolve()  # the children get absolute paths
    sizes = args.n or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    window_s = args.window_s or (QUICK_WINDOW_S if args.quick else DEFAULT_WINDOW_S)
    settle_s = QUICK_SETTLE_S if args.quick else SETTLE_S
    if min(sizes) < 2 or window_s < 10:
        print(f"bench_control: sizes must be >= 2 (averaging needs peers) and --window-s >= 10, got {sizes} and "
              f"{window_s:g}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupted)  # Ctrl+C raises KeyboardInterrupt, which cleans up the same way
    try:
        bench(sizes, window_s, settle_s, out, args.quick, args.code_label)
    except (RuntimeError, ValueError) as e:  # a learner that died, a deadline missed: everything is stopped already
        print(f"bench_control: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
