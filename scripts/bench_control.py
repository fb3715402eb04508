#!/usr/bin/env python3
"""Control-plane bytes per peer against swarm size: N learners on 127.0.0.1, every hivemind RPC counted by purpose.

For each N, a bootstrap and N real ``p2p-diloco join`` learners run the whole control plane on a tiny model paced to
one step per second, default outer and averaging config; ``scripts/wan/rpc_tally`` tallies every hivemind RPC of
every process by purpose, over a window once all train (the page's method, in :data:`BENCH`, has it all).
Sizes run smallest first; the measured memory decides which larger sizes fit. Every process started is stopped when
its size ends, also on errors, SIGTERM and Ctrl+C; each learner has a ``--max-time`` deadline of its own besides.
Beside it: the tallies (``_tally.py``), the sizes that fit (``bench_control_sizes.py``), its page (``*_page.py``).

    python scripts/bench_control.py                          # N = 4, 16, 64 (or the largest that fits), ~20 min
    python scripts/bench_control.py --n 4 16 32 --window-s 60
    python scripts/bench_control.py --quick                  # N = 3, 30 s window: checks the pipeline (~2 min)
    python scripts/bench_control.py --render-only            # rewrite the page (README.md) from control.json

Writes ``control.json``, ``README.md`` (the page) and ``control.png`` into ``--out`` (default results/control); logs,
events and the raw tallies (which hold absolute paths: never committed) go to ``--out/logs``.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _bench
import _machine
import _swarm
import _tally
from _machine import GIB, MIB
from _tally import PAYLOAD, VOUCHES
from bench_control_page import HEALTHY_SHARE, TARGET_BYTES_PER_S, TARGET_GROWTH, markdown, plot
from bench_control_sizes import MEMORY_BUDGET_BYTES, MEMORY_MARGIN, fits, memory_budget, replacement

from p2p_diloco.core.events import read_events
from p2p_diloco.core.waiting import poll_until
from p2p_diloco.local.launcher import NO_STEP_LIMIT, START_TIMEOUT_S, Child

log = logging.getLogger("bench.control")

DEFAULT_SIZES = (4, 16, 64)
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
"""A discarded round's reason, peer ids, hashes and numbers masked, is kept to this length (the page lists the
commonest)."""
GIT_TIMEOUT_S = 30.0
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



def write_run_files(folder: Path, n: int) -> tuple[Path, Path]:
    """The tiny config (its own run id per size) and the pacing profile, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config, profile = folder / "tiny.toml", folder / "paced.toml"
    config.write_text(TINY_CONFIG.format(run_id=f"control-n{n}"))
    profile.write_text(PROFILE)
    return config, profile



def run_size(n: int, window_s: float, settle_s: float, logs: Path, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """A bootstrap and ``n`` learners (each with the config ``overrides``, ``KEY=VALUE``): their bytes by purpose over
    the window, memory, start-up time."""
    if logs.exists():  # a previous run's tallies and events must not mix in
        shutil.rmtree(logs)
    tally = logs / "tally"
    config, profile = write_run_files(logs, n)
    startup_deadline_s = STARTUP_BASE_S + STARTUP_PER_LEARNER_S * n
    max_time_s = startup_deadline_s + settle_s + window_s + MAX_TIME_SLACK_S
    t0 = time.monotonic()
    with _swarm.Swarm(logs, grace_s=STOP_GRACE_S) as swarm:
        boot = _tally.start_tallied(swarm, "boot", ["bootstrap", "--identity", str(swarm.tmp / "boot.id"), "--config",
                                             str(config)], tally)
        peers = boot.wait_for(r"^initial peers: (\S+)", START_TIMEOUT_S).group(1)
        t_boot = time.monotonic() - t0
        names = [f"l{i}" for i in range(n)]
        learners: list[Child] = []
        for first in range(0, n, START_BATCH):
            batch = [_tally.start_tallied(swarm, name, [
                "join", "--initial-peers", peers, "--config", str(config), "--name", name, "--profile", str(profile),
                "--steps", str(NO_STEP_LIMIT), "--max-time", f"{max_time_s:g}", "--join-timeout", f"{JOIN_TIMEOUT_S:g}",
                "--linger", f"{LINGER_S:g}", "--events", str(logs / f"{name}.jsonl"),
                *(a for kv in overrides for a in ("--set", kv)),
            ], tally) for name in names[first:first + START_BATCH]]
            for child in batch:
                child.wait_for(r"^joined run ", JOIN_DEADLINE_S)
            learners += batch
        log.info("N=%d: bootstrap up after %.0f s, all %d learners joined after %.0f s", n, t_boot, n,
                 time.monotonic() - t0)
        poll_until(lambda: _swarm.training(learners), startup_deadline_s - (time.monotonic() - t0),
                   f"N={n}: every learner training", POLL_S, detail=lambda: f"see the logs in {logs}")
        t_training = time.monotonic() - t0
        log.info("N=%d: all training after %.0f s; settling %.0f s, then counting %.0f s", n, t_training, settle_s,
                 window_s)
        time.sleep(settle_s)  # a fixed settle time, by design: what follows it is what is measured
        start, w0, wall0 = _tally.snapshot(tally), time.monotonic(), time.time()
        cpu0, machine0 = sum(_machine.session_cpu_s(c) for c in [boot, *learners]), _machine.machine_cpu()
        time.sleep(window_s)  # the measured window
        end, w1, wall1 = _tally.snapshot(tally), time.monotonic(), time.time()
        cpu1, machine1 = sum(_machine.session_cpu_s(c) for c in [boot, *learners]), _machine.machine_cpu()
        memory = {c.name: _machine.session_memory(c) for c in [boot, *learners]}
        alive = sum(c.alive for c in learners)
        available, load = _machine.mem_available(), os.getloadavg()
        log.info("N=%d: window closed (%d of %d learners alive); stopping everything", n, alive, n)
    wall_s = time.monotonic() - t0
    seconds = w1 - w0
    per_process = {name: _tally.difference(end[name], start.get(name, {})) for name in end}
    total = _tally.add(list(per_process.values()))
    purposes = _tally.by_purpose(total)
    top = sorted(total.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:12]
    learner_control = [_tally.control_bytes(per_process.get(name, {})) / seconds for name in names]
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
        "bootstrap_control_bps": round(_tally.control_bytes(per_process.get("boot", {})) / seconds, 1),
        "top_rpcs": [{"rpc": name, "bps_per_peer": round((c[1] + c[2]) / seconds / n, 1),
                      "calls_per_s_per_peer": round(c[0] / seconds / n, 3)} for name, c in top],
        "rounds": _swarm.rounds_in([read_events(logs / f"{name}.jsonl") for name in names], wall0, wall1,
                                   REASON_CHARS),
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



def bench(sizes: list[int], window_s: float, settle_s: float, out: Path, quick: bool,
          code_label: str | None = None, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every size that fits, smallest first; what was skipped and why."""
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "code": _bench.code_identity(code_label, GIT_TIMEOUT_S),
        "params": {"sizes_requested": sizes, "window_s": window_s, "settle_s": settle_s, "step_s": STEP_S,
                   "quick": quick, "memory_budget_gib": MEMORY_BUDGET_BYTES / GIB, "memory_margin": MEMORY_MARGIN,
                   "target_bps_per_peer": TARGET_BYTES_PER_S, "target_growth": TARGET_GROWTH,
                   "config": TINY_CONFIG.format(run_id="control-n<N>"), "profile": PROFILE,
                   "overrides": list(overrides)},
        "runs": [], "skipped": [],
    }
    per_learner: float | None = None
    planned: list[int] = []
    for n in sorted(set(sizes)):
        budget = memory_budget(_machine.mem_available())
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
        row = run_size(run_n, window_s, settle_s, out / "logs" / f"n{run_n}", overrides)
        row["note"] = note
        row["code_changed"] = _bench.sources_digest() != result["code"]["sources_sha256"]  # edited while it ran: mixed code
        result["runs"].append(row)
        per_learner = row["memory"]["pss_per_learner_mib"] * MIB
        log.info("N=%d: control %.0f B/s per peer, payload %.0f B/s per peer, %.0f MiB PSS per learner, %.0f s",
                 run_n, row["control_bps_per_peer"], row["payload_bps_per_peer"], row["memory"]["pss_per_learner_mib"],
                 row["wall_s"])
        _bench.publish(BENCH, out, {**result, "wall_s": round(time.monotonic() - t0, 1)}, markdown, plot,
                       echo=False)  # what was measured survives an interrupted run
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return _bench.publish(BENCH, out, result, markdown, plot)



def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, quick=f"N = {QUICK_SIZES[0]}, {QUICK_WINDOW_S:g} s window, {QUICK_SETTLE_S:g} s "
                                           "settle: checks the pipeline (about 2 min)")
    p.add_argument("--n", type=int, nargs="+", metavar="N",
                   help=f"swarm sizes, smallest first (default: {' '.join(map(str, DEFAULT_SIZES))}; a size that does "
                        "not fit in memory is replaced by the largest of 4 16 32 64 that does)")
    p.add_argument("--window-s", type=float, help=f"seconds of counting per size (default: {DEFAULT_WINDOW_S:g})")
    p.add_argument("--code-label", help="names the code the learners run, on the page (default: none; the git commit "
                                        "and changed files, when there is a checkout, are recorded anyway)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every learner, e.g. averaging.matchmaking=clock (repeatable; named on "
                        "the page)")
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
    _swarm.raise_on_sigterm()
    try:
        bench(sizes, window_s, settle_s, out, args.quick, args.code_label, tuple(args.overrides))
    except (RuntimeError, ValueError) as e:  # a learner that died, a deadline missed: everything is stopped already
        print(f"bench_control: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
