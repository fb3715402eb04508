#!/usr/bin/env python3
"""Slow links: a swarm of learner hosts where the link, not the compute, is the bottleneck.

Each case is a link: a rate (Mbit/s each way), the depth of the token bucket's queue (tbf ``latency``: 1 s is as
deep as many home routers' buffers) and optionally a round trip (added by relays, ``netns.py``). For each, N hosts
(network namespaces, ``netns.py``) run a bootstrap in host 0 and one ``p2p-diloco join`` learner per host on the
config (``configs/demo.toml``) for ``--max-time`` seconds of training. What is reported per case:

- **rounds committed** of all the learners' fragment rounds (a round counts once per learner), and the discarded
  ones by reason;
- **anchors identical**: whether every learner ended with the same anchor hash on every fragment;
- **state downloads**: every fragment download the learners made, and how many donors *timed out* on one;
- **communication / compute**: the link time of one all-reduce of every fragment (int4 payload, butterfly:
  2(1 - 1/n) of it each way, :mod:`p2p_diloco.averaging.linktime`) over the sync period the learners ran;
- wire bytes each host sent (its interface's ``tx_bytes``: all traffic).

With ``--pause HOST:AT:FOR`` one learner's whole process group is stopped (SIGSTOP) ``AT`` seconds into training
for ``FOR`` seconds and then continued: how it catches up (replayed rounds, downloads, their bytes) is reported.

    sudo python scripts/wan/bench_slowlink.py                                   # the five cases, ~25 min
    sudo python scripts/wan/bench_slowlink.py --cases 0.5:1000 --pause 3:40:60 --out results/slowlink-pause
    python scripts/wan/bench_slowlink.py --render-only

Writes ``slowlink.json``, ``slowlink.png`` and ``README.md`` into ``--out`` (default ``results/slowlink``), the
processes' output into ``--out/logs``. The figures are computed in ``slowlink_metrics.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _bench  # scripts/wan/_bench.py: scripts/_bench.py
import netns  # scripts/wan/netns.py, stdlib only
from slowlink_metrics import BENCH, Case, Pause, case_metrics, parse_cases, parse_pause, plot, table
from wan_params import BOOT_PORT, FINISH_SLACK_S, START_SLACK_S, relay_endpoints
from wan_procs import PEERS_RE, Procs, discard_reasons, learner_command

log = logging.getLogger("wan.slowlink")

DEFAULT_CASES = "0.25:1000,0.5:1000,1:1000,2:1000,0.5:100:100"
"""rate Mbit/s : queue ms [: round trip ms], the issue's five links."""


def run_case(case: Case, args: Any, logs: Path, pause: Pause | None) -> dict[str, Any]:
    """One case: the hosts on its link, the swarm on them, what it did."""
    plan = netns.WanPlan(hosts=args.hosts, rate_mbit=case.rate_mbit, queue_ms=case.queue_ms, rtt_ms=case.rtt_ms)
    tag = case.label
    sets = [a for o in [*args.overrides, f"run.run_id=slow-{tag}"] for a in ("--set", o)]
    paused: dict[str, float] = {}
    with netns.Wan(plan) as wan:
        qdisc = wan.qdisc(0)
        if plan.relayed:
            for host, port in relay_endpoints(args.hosts):
                wan.start_relay(host, port)
        before = wan.all_counters()
        with Procs(wan, logs) as procs:
            procs.start(f"{tag}-boot", 0, [sys.executable, "-m", "p2p_diloco.cli.main", "bootstrap",
                                           *netns.listen_args(plan, 0, BOOT_PORT), "--identity",
                                           str(procs.tmp / "boot.id"), "--config", args.config, *sets])
            peers = procs.wait_for(f"{tag}-boot", PEERS_RE, START_SLACK_S).group(1)
            names = [f"{tag}-l{i}" for i in range(args.hosts)]
            started = time.time()
            for i, name in enumerate(names):
                (logs / f"{name}.jsonl").unlink(missing_ok=True)
                procs.start(name, i, learner_command(plan, i, peers, args.config, sets, logs / f"{name}.jsonl",
                                                     steps=0, max_time_s=args.max_time))
            if pause is not None:
                paused = _pause(procs, names[pause.host], pause, logs / f"{names[pause.host]}.jsonl")
            finals, stopped = procs.finals_or_stop(names, START_SLACK_S + args.max_time + FINISH_SLACK_S,
                                                   grace_s=FINISH_SLACK_S)
        after = wan.all_counters()
    wire = [netns.byte_delta(b, a)["tx_bytes"] for b, a in zip(before, after)]
    events = [[json.loads(line) for line in (logs / f"{n}.jsonl").read_text().splitlines()] for n in names]
    row = case_metrics(case, args.config, args.overrides, [finals[n] for n in names], events, wire, pause, paused)
    row.update(qdisc=qdisc, started=started, discard_reasons=discard_reasons(logs, tag, args.hosts),
               stopped_late=[n.removeprefix(f"{tag}-") for n in stopped],
               end_after_limit_s=[procs.final_at[n] - procs.started_at[n] - args.max_time for n in names])
    return row


def _pause(procs: Procs, name: str, pause: Pause, events: Path) -> dict[str, float]:
    """Stop learner ``name``'s process group ``pause.at_s`` after its training starts, for ``pause.for_s``; the wall
    times (epoch seconds) it was stopped and continued."""
    p = next(p for n, p, _, _ in procs.procs if n == name)
    deadline = time.monotonic() + START_SLACK_S
    while not (events.exists() and '"first_contribution"' in events.read_text()):  # training, and in the swarm
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} made no first contribution within {START_SLACK_S:.0f} s: nothing to pause")
        time.sleep(1.0)
    time.sleep(pause.at_s)
    stopped = time.time()
    os.killpg(p.pid, signal.SIGSTOP)
    log.info("SIGSTOP %s for %.0f s", name, pause.for_s)
    try:
        time.sleep(pause.for_s)
    finally:
        os.killpg(p.pid, signal.SIGCONT)
    log.info("SIGCONT %s", name)
    return {"stopped": stopped, "continued": time.time()}


def main(argv: list[str] | None = None) -> int:
    ap = _bench.parser(__doc__, BENCH, config="demo.toml")
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"links, comma-separated RATE_MBIT:QUEUE_MS[:RTT_MS] (default: {DEFAULT_CASES})")
    ap.add_argument("--hosts", type=int, default=4, help="learner hosts (default: 4)")
    ap.add_argument("--max-time", type=float, default=150.0, metavar="SECONDS",
                    help="training time of each case (default: 150)")
    ap.add_argument("--pause", default=None, metavar="HOST:AT:FOR",
                    help="stop host HOST's learner AT s after its first contribution, for FOR s (every case)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="slowlink: %(message)s")
    if _bench.rerender(args, BENCH, table, plot):
        return 0
    try:
        cases = parse_cases(args.cases)
        pause = parse_pause(args.pause, args.hosts) if args.pause else None
        if args.hosts < 2 or args.max_time <= 0:
            raise ValueError(f"--hosts must be >= 2 and --max-time > 0, got {args.hosts} and {args.max_time}")
    except ValueError as e:
        print(f"bench_slowlink: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench_slowlink: network namespaces need root (run it with sudo)", file=sys.stderr)
        return 2
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"params": {"cases": [asdict(c) for c in cases], "hosts": args.hosts,
                                          "config": args.config, "overrides": args.overrides,
                                          "max_time_s": args.max_time, "pause": asdict(pause) if pause else None},
                               "code": _bench.code_identity(None, timeout_s=10.0), "cases": []}
    with netns.handle_signals():
        for case in cases:
            log.info("%s: %d hosts, %.0f s of training", case.label, args.hosts, args.max_time)
            row = run_case(case, args, logs, pause)
            payload["cases"].append(row)
            log.info("%s: %d/%d rounds committed (%.0f%%), anchors %s, %d downloads timed out, comm/compute %.2f",
                     case.label, row["committed"], row["rounds"], 100 * row["committed_share"],
                     "identical" if row["anchors_identical"] else "DIFFER", row["download_timeouts"],
                     row["comm_compute"])
            BENCH.save(out, payload)  # an interrupted sweep keeps what it measured
    _bench.publish(BENCH, out, payload, table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
