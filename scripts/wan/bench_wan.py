#!/usr/bin/env python3
"""Emulated-WAN benchmark: data-parallel (gloo), blocking DiLoCo and p2p-diloco on rate-limited hosts.

For each link rate, N hosts are built as network namespaces on a private bridge (``netns.py``: a
token bucket on each host's link, both directions; latency only with ``--rtt-ms``, added by delaying
TCP relays in front of the learners since netem is missing here; data-parallel's gloo connections
cannot be relayed, so ``dp`` runs only without latency), and on the same hosts, model, data and seeds
it runs:

- ``dp``: data-parallel with torch.distributed gloo, gradients all-reduced every step
  (``dp_gloo.py``, one rank per host) -- conventional synchronization;
- ``blocking``: our learner as OpenDiLoCo-style DiLoCo: ``join --blocking`` (the inner loop waits for
  each round), one fragment, no overlap (tau = 0), no alpha-mixing, every round needs all N peers
  (``averaging.min_group_size = target_group_size = N``);
- ``decoupled``: our learner with the config as it is (F fragments, tau, int4, any live peers).

Once, before the rates (reused by ``--merge``):

- ``compute``: the data-parallel loop with no all-reduce on all hosts at once (the same CPU
  contention, no network). Data-parallel step time / compute-only step time is the *ideal bound* on
  any speed-up over data-parallel at that rate, reported next to every speed-up.
- ``trajectory``: data-parallel on an unlimited link, evaluated every ``--trajectory-eval-every``
  steps: its eval loss per step. Data-parallel's loss after k steps does not depend on the link (the
  same math, seeds and data), only its step time does; so at each rate data-parallel runs only long
  enough for its step time (``--dp-max-time``), and its **time to the target is projected**: steps to
  the target on the trajectory x the step time measured at that rate. Running it to the target at
  2 Mbit/s would take hours.

The learners run for real at every rate (``--max-time`` of training, with no step cap unless ``--steps``:
a fast machine must not end them early); learner 0 evaluates the global
model on the whole held-out set every ``--eval-every`` seconds, which gives their time to the target.

Reported per rate and method: median step time, tokens, time to ``--target-loss`` (linear between
evaluations), the final held-out eval loss and the data-parallel trajectory's loss at the same tokens,
bytes on the wire per token (every host's interface ``tx_bytes`` over the run, all traffic included:
DHT, headers, retransmissions), learner utilization (share of training time spent in inner steps; for
data-parallel compute-only step / step), and the speed-up over data-parallel in time to the target,
next to the ideal bound and its share of it.

    sudo python scripts/wan/bench_wan.py --rates 10                    # compute-only, trajectory, then 10 Mbit/s (<= 30 min)
    for r in 2 5 50 200; do sudo python scripts/wan/bench_wan.py --rates $r --merge; done   # the other rates
    sudo python scripts/wan/bench_wan.py --methods dp --max-time 60 --trajectory-steps 20   # a smoke run
    sudo python scripts/wan/bench_wan.py --rates 10 --methods blocking,decoupled --rtt-ms 100 --host-rtt-ms 3=300 \
        --out results/wan-rtt                                              # learners at 100 ms, host 3 at 300 ms
    python scripts/wan/bench_wan.py --render-only                         # rewrite the page (README.md) from wan.json
    sudo python scripts/wan/netns.py --cleanup                            # leftovers of a run killed by SIGKILL

Writes ``wan.json``, ``README.md`` (the page) and ``wan.png`` into ``--out`` (default ``results/wan``); every
process's output goes to ``--out/logs``. Everything started is stopped, and every namespace and
link removed, on exit, on error and on SIGINT/SIGTERM.

Beside it: the plan (``wan_params.py``), the processes in the hosts (``wan_procs.py``), the figures
(``wan_metrics.py``) and the page (``wan_page.py``).
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import _bench  # scripts/wan/_bench.py: scripts/_bench.py
import netns  # scripts/wan/netns.py, stdlib only
from dp_gloo import summarize_steps  # imports torch lazily
from wan_metrics import dp_metrics, learner_metrics, merge_results, speedups, trajectory_summary
from wan_page import BENCH, fmt, plot, render_md
from wan_params import METHODS, TRAJECTORY_RATE_MBIT, BenchParams, merge_check, relay_endpoints, worst_case_s
from wan_procs import discard_reasons, run_dp, run_learners

log = logging.getLogger("wan.bench")


def bench(p: BenchParams) -> dict[str, Any]:
    """The plan: compute-only and trajectory once (or the merged result's), then every rate's methods; the result
    is written after each rate, so an interrupted sweep keeps what it measured."""
    out = Path(p.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"params": asdict(p), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "latency_emulation": p.plan(p.rates_mbit[0]).relayed, "rates": {}}
    previous: dict[str, Any] | None = None
    if p.merge:
        previous = json.loads((out / "wan.json").read_text())
        merge_check(previous["params"], p)
    t0 = time.monotonic()
    if previous is not None:
        result["compute_only"] = previous["compute_only"]
        result["trajectory"] = previous["trajectory"]
    else:
        with netns.Wan(netns.WanPlan(hosts=p.hosts, rate_mbit=TRAJECTORY_RATE_MBIT)) as wan:
            ranks, _ = run_dp(p, wan, logs, "compute", "compute")
            compute_step_s = statistics.median(summarize_steps(r["step_s"])["median_step_s"] for r in ranks)
            result["compute_only"] = {"median_step_s": compute_step_s, "steps": p.compute_steps,
                                      "per_rank": [r["median_step_s"] for r in ranks]}
            log.info("compute-only: %.3f s per step (%d hosts at once)", compute_step_s, p.hosts)
            ranks, _ = run_dp(p, wan, logs, "trajectory", "trajectory")
            r0 = next(r for r in ranks if r["rank"] == 0)
            result["trajectory"] = {**trajectory_summary(r0["curve"], p.target_loss),
                                    "median_step_s": r0["median_step_s"], "rate_mbit": TRAJECTORY_RATE_MBIT}
        _write(out, result)
    compute_step_s = result["compute_only"]["median_step_s"]
    trajectory = result["trajectory"]
    log.info("trajectory: %s steps to %g; final %.4f after %d steps", fmt(trajectory["steps_to_target"], ".1f"),
             p.target_loss, trajectory["curve"][-1]["eval_loss"], trajectory["curve"][-1]["step"])
    for rate in p.rates_mbit:
        plan = p.plan(rate)
        rows: dict[str, dict[str, Any]] = {}
        with netns.Wan(plan) as wan:
            qdisc = wan.qdisc(0)
            if plan.relayed:  # they outlive each method's processes, as a link would
                for host, port in relay_endpoints(p.hosts):
                    wan.start_relay(host, port)
            for method in p.methods:
                tag = f"{rate:g}mbit-{method}"
                if method == "dp":
                    log.info("dp: %d hosts at %g Mbit/s, %.0f s", p.hosts, rate, p.dp_max_time_s)
                    ranks, wire = run_dp(p, wan, logs, tag, "rate")
                    rows[method] = dp_metrics(ranks, wire, compute_step_s, trajectory)
                else:
                    log.info("%s: %d hosts at %g Mbit/s, %.0f s", method, p.hosts, rate, p.max_time_s)
                    finals, wire, evals = run_learners(p, wan, logs, tag, method)
                    rows[method] = learner_metrics(finals, wire, evals, trajectory)
                    rows[method]["discard_reasons"] = discard_reasons(logs, tag, p.hosts)
                rows[method]["wire_tx_per_host"] = wire
                log.info("%s at %g Mbit/s: %s", method, rate, _brief(rows[method]))
        result["rates"][f"{rate:g}"] = {"rate_mbit": rate, "plan": asdict(plan), "qdisc": qdisc, "methods": rows,
                                        "speedups": speedups(rows, compute_step_s)}
        # a partial result survives an interrupted benchmark
        _write(out, merge_results(previous, result) if previous is not None else result)
    result["wall_s"] = time.monotonic() - t0
    if previous is not None:
        result = merge_results(previous, result)
    _write(out, result)
    return result


def _brief(row: dict[str, Any]) -> str:
    return (f"{row['steps_per_host']} steps/host, {row['median_step_s']:.3f} s/step, eval "
            f"{fmt(row['final_eval_loss'], '.4f')}, to target {fmt(row['time_to_target_s'], '.0f')} s, "
            f"{row['wire_bytes_per_token'] or 0:.1f} wire B/token, utilization {row['utilization'] or 0:.1%}")



def _write(out: Path, result: dict[str, Any]) -> None:
    """The result so far (after every rate: an interrupted sweep keeps what it measured)."""
    _bench.publish(BENCH, out, result, render_md, plot, indent=1, echo=False)


def main(argv: Sequence[str] | None = None) -> int:
    d = BenchParams.__dataclass_fields__
    ap = _bench.parser(__doc__, BENCH, config="demo.toml")
    ap.add_argument("--rates", default="10", help="per-host Mbit/s, comma-separated (default: 10)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"some of {', '.join(METHODS)}")
    ap.add_argument("--hosts", type=int, default=d["hosts"].default)
    ap.add_argument("--steps", type=int, default=d["steps"].default,
                    help="cap on inner steps per host (default: 0 = none, the training time alone ends each run)")
    ap.add_argument("--max-time", type=float, default=d["max_time_s"].default, metavar="SECONDS",
                    help="training time of each learner run (default: %(default)s)")
    ap.add_argument("--dp-max-time", type=float, default=d["dp_max_time_s"].default, metavar="SECONDS",
                    help="training time of each rate's data-parallel run (step times only; default: %(default)s)")
    ap.add_argument("--eval-every", type=float, default=d["eval_every_s"].default, metavar="SECONDS",
                    help="learner 0 evaluates the global model this often (default: %(default)s)")
    ap.add_argument("--trajectory-steps", type=int, default=d["trajectory_steps"].default,
                    help="data-parallel steps on an unlimited link (default: %(default)s)")
    ap.add_argument("--trajectory-eval-every", type=int, default=d["trajectory_eval_every"].default,
                    help="steps between the trajectory's evaluations (default: %(default)s)")
    ap.add_argument("--target-loss", type=float, default=d["target_loss"].default,
                    help="eval loss (nats/byte) for the time to target (default: %(default)s)")
    ap.add_argument("--compute-steps", type=int, default=d["compute_steps"].default)
    ap.add_argument("--budget-min", type=float, default=d["budget_s"].default / 60, help="refuse longer plans")
    ap.add_argument("--rtt-ms", type=float, default=d["rtt_ms"].default, metavar="MS",
                    help="round trip between hosts, added by relays in front of the learners (default: 0 = none; "
                         "not with dp)")
    ap.add_argument("--host-rtt-ms", action="append", default=[], metavar="HOST=MS",
                    help="a host with its own round trip, e.g. 3=300 (repeatable); a pair gets the larger of theirs")
    ap.add_argument("--merge", action="store_true",
                    help="add these rates to --out/wan.json (same parameters; its compute-only step and trajectory)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if _bench.rerender(a, BENCH, render_md, plot):
        return 0
    try:
        params = BenchParams(rates_mbit=tuple(float(x) for x in a.rates.split(",")),
                             methods=tuple(m.strip() for m in a.methods.split(",")), hosts=a.hosts, config=a.config,
                             overrides=tuple(a.overrides), steps=a.steps, max_time_s=a.max_time,
                             dp_max_time_s=a.dp_max_time, eval_every_s=a.eval_every,
                             trajectory_steps=a.trajectory_steps, trajectory_eval_every=a.trajectory_eval_every,
                             target_loss=a.target_loss, budget_s=a.budget_min * 60, out=str(a.out),
                             compute_steps=a.compute_steps, merge=a.merge, rtt_ms=a.rtt_ms,
                             host_rtt_ms=netns.parse_host_rtts(a.host_rtt_ms))
    except ValueError as e:
        print(f"bench_wan: {e}", file=sys.stderr)
        return 2
    log.info("worst case %.1f min", worst_case_s(params) / 60)
    try:
        with netns.handle_signals():
            result = bench(params)
    except netns.Interrupted as e:
        print(f"bench_wan: interrupted ({e}); processes stopped, namespaces removed", file=sys.stderr)
        return 130
    except (netns.WanError, RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"bench_wan: {e}", file=sys.stderr)
        return 1
    print(render_md(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
