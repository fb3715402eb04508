"""``scripts/wan/bench_wan.py``'s page: its method, the table per rate and method, the rounds, and the figure.

Drawn from ``wan.json`` alone (``--render-only`` calls it with nothing run).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _bench  # scripts/wan/_bench.py: scripts/_bench.py
from wan_params import METHODS

BENCH = _bench.Bench("wan", "wan", "Emulated WAN: data-parallel, blocking DiLoCo and ours on slow links",
                     "scripts/wan/bench_wan.py", """\
`scripts/wan/netns.py` makes each of N hosts (4 here) a Linux network namespace on a private bridge, with no default
route; each host's link is limited by a token bucket (`tc qdisc ... tbf`) in both directions. Latency only with
`--rtt-ms` (netem is not available here): the learners then listen behind a delaying TCP relay in each host
(`scripts/wan/relay.py`), and data-parallel, whose gloo connections cannot be relayed, is not run. Without it round
trips stay below a millisecond, which favours data-parallel training. On the same hosts, model (`configs/demo.toml`, 16 x 128 bytes per host per step), data shards and seeds,
three methods:

- `dp`: `scripts/wan/dp_gloo.py`, torch.distributed gloo DDP, fp32 gradients all-reduced every step;
- `blocking`: our learner with `join --blocking` (the inner loop waits for each round), F=1, tau=0, alpha=0, every
  round needing all 4 peers (OpenDiLoCo-style);
- `decoupled`: our learner with its default config (F=4, tau=1, int4, any live peers).

How each figure is measured:

- **Ideal bound** at a rate = data-parallel's step time there / the compute-only step time (the same loop with no
  all-reduce, all hosts at once: the same CPU contention).
- **Data-parallel's time to the target is projected**: its loss after k steps does not depend on the link, only its
  step time does, so a *trajectory* run on an unlimited link gives the steps to the target once, and at each rate
  data-parallel runs only long enough for its step time; time to target = steps x step time.
- **The learners are measured at every rate**: `--max-time` of training; learner 0 evaluates the global model on the
  whole held-out set every `--eval-every` seconds, and the time to the target is read off that curve, linear between
  evaluations.
- Wire bytes: the `tx_bytes` of every host's interface (all traffic: DHT, headers, retransmissions).
- "Data-parallel at equal tokens": the trajectory's eval loss at the learners' total tokens; "—" where those are
  beyond the trajectory.

Rates are measured one run at a time and merged into one table (`--merge`).""")



def fmt(v: Any, spec: str, none: str = "—") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def latency_text(params: dict[str, Any]) -> str:
    """The page's sentence on latency, from the run's parameters (results older than ``rtt_ms`` had none)."""
    rtt, ragged = params.get("rtt_ms", 0.0), [tuple(x) for x in params.get("host_rtt_ms", ())]
    if not rtt and not any(ms for _, ms in ragged):
        return ("**no latency emulation** (netem is not available): round trips stay sub-millisecond, so these "
                "figures favour data-parallel.")
    extra = "".join(f", host {i} at {ms:g} ms" for i, ms in ragged)
    return (f"round trips of {rtt:g} ms between hosts{extra} (a pair gets the larger of its two), added by a delaying "
            "TCP relay in front of each learner (netem is not available).")


def render_md(result: dict[str, Any]) -> str:
    p = result["params"]
    c = result.get("compute_only", {})
    t = result.get("trajectory", {})
    target = p["target_loss"]
    last = t["curve"][-1] if t.get("curve") else {}
    lines = [
        f"Emulated WAN: {p['hosts']} hosts, {Path(p['config']).name}, learners {p['max_time_s']:g} s of training.",
        "",
        "Per-host links limited with tc tbf in both directions; " + latency_text(p),
        f"Compute-only step (all hosts at once, no all-reduce): {fmt(c.get('median_step_s'), '.3f')} s. "
        f"Data-parallel trajectory (unlimited link): {fmt(t.get('steps_to_target'), '.1f')} steps "
        f"({fmt((t.get('tokens_to_target') or 0) / 1e6 or None, '.2f')}M tokens) to eval loss {target:g}; "
        f"{fmt(last.get('eval_loss'), '.4f')} after {last.get('step', '—')} steps.",
        f"Data-parallel's time to {target:g} at each rate is projected: those steps x the step time measured "
        "at that rate. The learners' is measured (the global model evaluated every "
        f"{p.get('eval_every_s', 0):g} s on the whole held-out set).",
        "",
        f"| Mbit/s | method | s/step | tokens (M) | time to {target:g} (s) | eval loss | data-parallel at "
        "equal tokens | wire B/token | fewer bytes | utilization | speed-up to target | ideal bound | share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in result["rates"].items():
        sp = r["speedups"]
        for method, row in r["methods"].items():
            s = sp.get(method, {}) if method != "dp" else {}
            ttt = fmt(row["time_to_target_s"], ".0f") + (" (projected)" if row.get("time_to_target_projected") else "")
            vs = row.get("vs_dp_at_tokens")
            at_tokens = (f"{fmt(row.get('dp_eval_loss_at_tokens'), '.4f')} ({fmt(100 * vs if vs is not None else None, '+.1f')}%)"
                         if method != "dp" else "—")
            lines.append(
                f"| {key} | {method} | {fmt(row['median_step_s'], '.3f')} | {fmt(row['tokens'] / 1e6, '.2f')} | "
                f"{ttt} | {fmt(row['final_eval_loss'], '.4f')} | {at_tokens} | "
                f"{fmt(row['wire_bytes_per_token'], '.1f')} | {fmt(s.get('fewer_wire_bytes_per_token'), '.0f')}× | "
                f"{fmt(row['utilization'], '.1%')} | {fmt(s.get('time_to_target'), '.2f')}× | "
                f"{fmt(sp.get('ideal_bound'), '.2f')}× | {fmt(s.get('share_of_bound'), '.0%')} |")
    rounds = [(key, method, row) for key, r in result["rates"].items() for method, row in r["methods"].items()
              if "committed" in row]
    if rounds:
        lines += ["", "Rounds (summed over the learners; a round counts once per learner):", ""]
    for key, method, row in rounds:
        done, lost = sum(row["committed"]), sum(row["discarded"])
        why = "; ".join(f"{n}: {reason}" for reason, n in row.get("discard_reasons", {}).items())
        lines.append(f"- {key} Mbit/s, {method}: {done} of {done + lost} committed ({done / max(1, done + lost):.1%})"
                     + (f"; discarded by reason: {why}" if why else ""))
    lines += ["", "Wire bytes: every host's interface tx_bytes over the run (all traffic: gradients or pseudo-"
              "gradients, DHT, TCP/IP headers as handed to the interface with segmentation offload). "
              "Share: speed-up to target / ideal bound.", ""]
    return "\n".join(lines)


COLORS = {"dp": "tab:blue", "blocking": "tab:orange", "decoupled": "tab:green"}


def plot(result: dict[str, Any], path: Path) -> None:
    """Time to the target and speed-ups against the link rate, and the eval curves against tokens (nothing without
    a measured rate)."""
    if not result["rates"]:
        return
    with _bench.figure(path, 3, (16, 4.2)) as (ax1, ax2, ax3):
        _plot_rates(result, ax1, ax2)
        _plot_curves(result, ax3)


def _plot_rates(result: dict[str, Any], ax1: Any, ax2: Any) -> None:
    rates = list(result["rates"].values())
    for method in METHODS:
        pts = [(r["rate_mbit"], r["methods"][method]) for r in rates if method in r["methods"]]
        if not pts:
            continue
        tt = [(x, m["time_to_target_s"]) for x, m in pts if m.get("time_to_target_s")]
        if tt:
            ax1.plot(*zip(*tt), marker="o", color=COLORS[method], label=method + (" (projected)" if method == "dp" else ""))
        if method != "dp":
            sp = [(r["rate_mbit"], r["speedups"].get(method, {}).get("time_to_target")) for r in rates]
            sp = [(x, y) for x, y in sp if y]
            if sp:
                ax2.plot(*zip(*sp), marker="o", color=COLORS[method], label=method)
    bound = [(r["rate_mbit"], r["speedups"].get("ideal_bound")) for r in rates]
    bound = [(x, y) for x, y in bound if y]
    if bound:
        ax2.plot(*zip(*bound), color="grey", linestyle="--", label="ideal bound")
    ax1.set_title(f"time to eval loss {result['params']['target_loss']:g} (s)")
    ax2.set_title("speed-up over data-parallel (time to target)")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_yscale("log")
        rtt = result["params"].get("rtt_ms", 0.0)
        ax.set_xlabel(f"per-host link (Mbit/s), round trip {rtt:g} ms" if rtt else "per-host link (Mbit/s), no added latency")
        ax.legend(fontsize=8)


def _plot_curves(result: dict[str, Any], ax3: Any) -> None:
    t = result.get("trajectory", {})
    if t.get("curve"):
        ax3.plot([c["tokens"] / 1e6 for c in t["curve"]], [c["eval_loss"] for c in t["curve"]], "k-",
                 label="data-parallel (trajectory)")
    for key, r in result["rates"].items():
        for method in ("blocking", "decoupled"):
            m = r["methods"].get(method)
            if m and m.get("eval_curve") and m.get("tokens_per_s"):
                ax3.plot([x * m["tokens_per_s"] / 1e6 for x, _ in m["eval_curve"]], [y for _, y in m["eval_curve"]],
                         linestyle=":" if method == "blocking" else "-", alpha=0.7, label=f"{method} {key} Mbit/s")
    target = result["params"]["target_loss"]
    ax3.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax3.set_title("held-out eval loss vs tokens (learners: approx. tokens)")
    ax3.set_xlabel("tokens (M), all hosts")
    ax3.set_ylim(top=min(3.5, ax3.get_ylim()[1]))
    ax3.legend(fontsize=6)
