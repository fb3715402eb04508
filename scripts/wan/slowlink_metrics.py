"""``scripts/wan/bench_slowlink.py``'s cases, figures and page: pure functions of what the learners wrote.

A case's row (:func:`case_metrics`) is computed from the learners' ``final`` lines and events alone, so the page
(:func:`table`) and the figure (:func:`plot`) can be drawn again from ``slowlink.json`` with nothing run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import _bench  # scripts/wan/_bench.py: scripts/_bench.py

BENCH = _bench.Bench("slowlink", "slowlink", "Slow links: rounds, anchors and catch-up where the link is the bottleneck",
                     "scripts/wan/bench_slowlink.py", """\
`scripts/wan/netns.py` makes each of 4 hosts a Linux network namespace on a private bridge; each host's link is a
token bucket (`tc ... tbf`) in both directions with the case's rate and queue depth (tbf `latency`: the longest a
packet may wait before it is dropped; 1 s is as deep as many home routers' buffers), and, where given, a round trip
added by delaying relays. A bootstrap in host 0 and one `p2p-diloco join` learner per host run `configs/demo.toml`
for 150 s of training.

- **committed**: the learners' fragment rounds that committed, of all they ended (each learner counts its own).
- **anchors**: whether all four ended with the same anchor hash on every fragment.
- **downloads**: fragment state downloads the learners made; *timed out*: donors that timed out on one.
- **comm/compute**: link time of one int4 all-reduce of every fragment (2(1 - 1/n) x the payload each way, at the
  rate) over the sync period the learners ran: above 1 the link cannot carry a sync per period.
- **replayed**: rounds a learner that fell behind applied from its peers' kept averages instead of downloading.
- **period / bound**: the sync period the learners ran over 1.5 x max(H x the median step, the link time of one sync
  of every fragment at the rate): at most 1 is the goal.
- **eval loss**: the learners' median held-out loss at their final anchors (the fastest link of a run is its
  near-loopback reference).
- **end after limit s**: the latest learner's final line, seconds after its `--max-time` ran out.
""")

MAX_CASE_RATE_MBIT = 1000.0
PERIOD_BOUND_FACTOR = 1.5
"""The goal: a realized period at most this many times max(H x the median step, one sync's link time)."""


@dataclass(frozen=True)
class Case:
    """One link: rate each way (Mbit/s), the bucket's queue depth (ms) and an added round trip (ms, 0: none)."""

    rate_mbit: float
    queue_ms: float
    rtt_ms: float = 0.0

    @property
    def label(self) -> str:
        rtt = f"-rtt{self.rtt_ms:g}" if self.rtt_ms else ""
        return f"{self.rate_mbit:g}mbit-q{self.queue_ms:g}{rtt}"


@dataclass(frozen=True)
class Pause:
    """Stop host ``host``'s learner ``at_s`` after its first contribution, for ``for_s`` seconds."""

    host: int
    at_s: float
    for_s: float


def parse_cases(text: str) -> list[Case]:
    """``RATE:QUEUE_MS[:RTT_MS],...``; ValueError naming the bad entry."""
    cases = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        try:
            values = [float(v) for v in parts]
        except ValueError:
            values = []
        if len(values) not in (2, 3) or not 0 < values[0] <= MAX_CASE_RATE_MBIT or values[1] <= 0 or (
                len(values) == 3 and values[2] < 0):
            raise ValueError(f"--cases: {item!r} is not RATE_MBIT:QUEUE_MS[:RTT_MS] with 0 < rate <= "
                             f"{MAX_CASE_RATE_MBIT:g}, queue > 0 and round trip >= 0")
        cases.append(Case(*values))
    if not cases:
        raise ValueError("--cases: give at least one RATE_MBIT:QUEUE_MS[:RTT_MS]")
    return cases


def parse_pause(text: str, hosts: int) -> Pause:
    """``HOST:AT_S:FOR_S``; ValueError naming what is wrong."""
    try:
        host, at_s, for_s = text.split(":")
        pause = Pause(int(host), float(at_s), float(for_s))
    except ValueError:
        raise ValueError(f"--pause: {text!r} is not HOST:AT_SECONDS:FOR_SECONDS") from None
    if not 0 <= pause.host < hosts or pause.at_s < 0 or pause.for_s <= 0:
        raise ValueError(f"--pause: host must be in [0, {hosts}), AT >= 0 and FOR > 0, got {text!r}")
    return pause


def sync_link_s(numel: int, codec: str, hosts: int, rate_mbit: float) -> float:
    """Link seconds of one all-reduce of every fragment at the nominal rate."""
    from p2p_diloco.averaging.linktime import allreduce_bytes, payload_bytes

    return allreduce_bytes(payload_bytes(numel, codec), hosts) / (rate_mbit * 1e6 / 8)


def comm_compute(numel: int, codec: str, hosts: int, rate_mbit: float, period_s: float) -> float:
    """Link seconds of one all-reduce of every fragment over the sync period (NaN without a period)."""
    if not period_s or period_s <= 0:
        return float("nan")
    return sync_link_s(numel, codec, hosts, rate_mbit) / period_s


def period_bound_s(sync_every: int, step_s: float, link_s: float) -> float:
    """The period the issue allows: :data:`PERIOD_BOUND_FACTOR` x max(H x the median step, one sync's link time)."""
    return PERIOD_BOUND_FACTOR * max(sync_every * step_s, link_s)


def model_numel(config: str, overrides: Sequence[str]) -> tuple[int, str, int]:
    """The config's parameter count (built on the meta device: no memory), its codec and H (``outer.sync_every``)."""
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.model import count_parameters, meta_model

    cfg = load_config(config, overrides)
    return count_parameters(meta_model(cfg.model)), cfg.outer.codec, cfg.outer.sync_every


def case_metrics(case: Case, config: str, overrides: Sequence[str], finals: Sequence[dict[str, Any]],
                 events: Sequence[Sequence[dict[str, Any]]], wire: Sequence[int], pause: Pause | None,
                 paused: dict[str, float]) -> dict[str, Any]:
    """One case's row from the learners' finals and events (in host order) and each host's bytes sent."""
    committed = sum(sum(f["committed"]) for f in finals)
    discarded = sum(sum(f["discarded"]) for f in finals)
    hashes = [tuple(f["anchor_hashes"]) for f in finals]
    same = [len({h[k] for h in hashes}) == 1 for k in range(len(hashes[0]))]
    resyncs = [e for evs in events for e in evs if e.get("event") == "resync"]
    timeouts = sum(sum("timed out" in d for d in e.get("donor_failures") or ()) for e in resyncs)
    timeouts += sum(1 for e in resyncs if e.get("outcome") == "failed" and "Timeout" in str(e.get("reason", "")))
    replays = [e for evs in events for e in evs if e.get("event") == "replay"]
    periods = [f["sync_period_s"] for f in finals if f.get("sync_period_s")]
    period = statistics.median(periods) if periods else 0.0
    numel, codec, sync_every = model_numel(config, overrides)
    step_times = [f["train_s"] / f["steps"] for f in finals if f.get("steps") and f.get("train_s")]
    step_s = statistics.median(step_times) if step_times else 0.0
    link_s = sync_link_s(numel, codec, len(finals), case.rate_mbit)
    bound = period_bound_s(sync_every, step_s, link_s)
    evals = [f["eval_loss_end"] for f in finals if f.get("eval_loss_end") is not None]
    allreduce = [e["allreduce_s"] for evs in events for e in evs
                 if e.get("event") == "round" and e.get("outcome") == "committed" and e.get("allreduce_s")]
    firsts = [f["first_contribution_s"] for f in finals if f.get("first_contribution_s") is not None]
    parts = [e["part_bytes"] for evs in events for e in evs
             if e.get("event") == "round" and e.get("outcome") == "committed" and e.get("part_bytes")]
    row: dict[str, Any] = {
        "case": case.label, "rate_mbit": case.rate_mbit, "queue_ms": case.queue_ms, "rtt_ms": case.rtt_ms,
        "rounds": committed + discarded, "committed": committed, "discarded": discarded,
        "committed_share": committed / (committed + discarded) if committed + discarded else 0.0,
        "anchors_identical": all(same), "fragments_identical": sum(same), "fragments": len(same),
        "downloads": len(resyncs), "downloads_applied": sum(1 for e in resyncs if "version_after" in e),
        "download_timeouts": timeouts,
        "download_bytes": sum(int(e.get("bytes", 0) or 0) for e in resyncs),
        "replayed_rounds": sum(int(e.get("rounds", 0) or 0) for e in replays),
        "replay_bytes": sum(int(e.get("bytes", 0) or 0) for e in replays),
        "sync_period_s": period, "numel": numel, "codec": codec,
        "comm_compute": comm_compute(numel, codec, len(finals), case.rate_mbit, period),
        "sync_every": sync_every, "median_step_s": step_s, "sync_link_s": link_s, "period_bound_s": bound,
        "period_over_bound": period / bound if bound > 0 and period > 0 else None,
        "eval_loss_end": evals,
        "median_allreduce_s": statistics.median(allreduce) if allreduce else None,
        "median_part_bytes": statistics.median(parts) if parts else None,
        "first_contribution_s": firsts, "wire_tx_per_host": list(wire),
        "steps": [f["steps"] for f in finals], "tokens": sum(f["tokens"] for f in finals),
        "per_learner": [{"committed": f["committed"], "discarded": f["discarded"], "versions": f["versions"],
                         "anchor_hashes": f["anchor_hashes"]} for f in finals],
    }
    if pause is not None:
        host = pause.host
        after = [e for e in events[host] if e.get("time", 0) >= paused.get("continued", 0)]
        row["pause"] = {**paused, "host": host, "for_s": pause.for_s,
                        "replayed_rounds": sum(int(e.get("rounds", 0) or 0) for e in after if e.get("event") == "replay"),
                        "replay_bytes": sum(int(e.get("bytes", 0) or 0) for e in after if e.get("event") == "replay"),
                        "downloads": sum(1 for e in after if e.get("event") == "resync"),
                        "download_bytes": sum(int(e.get("bytes", 0) or 0) for e in after if e.get("event") == "resync"),
                        "full_state_bytes": 2 * 4 * numel}
    return row


def _median(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _f(v: Any, spec: str) -> str:
    return "—" if v is None or v != v else format(v, spec)


FINAL_WAIT_NOTE = "by the end of the run's time and its finishing slack"


def table(payload: dict[str, Any]) -> str:
    lines = ["| link | committed | anchors | downloads (timed out) | replayed | comm/compute | period s | period / bound | "
             "median all-reduce s | first contribution s | eval loss | end after limit s | wire MB/host |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["cases"]:
        rtt = f", {r['rtt_ms']:g} ms RTT" if r["rtt_ms"] else ""
        firsts = r["first_contribution_s"]
        lines.append(
            f"| {r['rate_mbit']:g} Mbit/s, {r['queue_ms']:g} ms queue{rtt} | {r['committed']}/{r['rounds']} "
            f"({100 * r['committed_share']:.0f}%) | {'identical' if r['anchors_identical'] else 'differ'} "
            f"({r['fragments_identical']}/{r['fragments']}) | {r['downloads']} ({r['download_timeouts']}) | "
            f"{r['replayed_rounds']} | {_f(r['comm_compute'], '.2f')} | {_f(r['sync_period_s'], '.1f')} | "
            f"{_f(r.get('period_over_bound'), '.2f')} | {_f(r['median_allreduce_s'], '.1f')} | "
            f"{_f(statistics.median(firsts) if firsts else None, '.1f')} | {_f(_median(r.get('eval_loss_end')), '.3f')} | "
            f"{_f(max(r['end_after_limit_s']) if r.get('end_after_limit_s') else None, '.0f')} | "
            f"{statistics.median(r['wire_tx_per_host']) / 1e6:.1f} |")
    notes = []
    ref = max(payload["cases"], key=lambda r: r["rate_mbit"], default=None)
    if ref is not None and _median(ref.get("eval_loss_end")) and len(payload["cases"]) > 1:
        base = _median(ref["eval_loss_end"])
        gaps = [f"{r['rate_mbit']:g} Mbit/s {100 * (_median(r['eval_loss_end']) / base - 1):+.1f}%"
                for r in payload["cases"] if r is not ref and _median(r.get("eval_loss_end"))]
        notes.append(f"- eval loss against the fastest link of the run ({ref['rate_mbit']:g} Mbit/s, {base:.3f}): "
                     + ", ".join(gaps))
    for r in payload["cases"]:
        if r.get("pause"):
            p = r["pause"]
            notes.append(f"- {r['case']}: learner {p['host']} paused {p['for_s']:g} s; afterwards it replayed "
                         f"{p['replayed_rounds']} rounds ({p['replay_bytes'] / 1e3:.0f} kB) and made "
                         f"{p['downloads']} downloads ({p['download_bytes'] / 1e3:.0f} kB), against "
                         f"{p['full_state_bytes'] / 1e6:.2f} MB for a full download of every fragment.")
        if r.get("stopped_late"):
            notes.append(f"- {r['case']}: {', '.join(r['stopped_late'])} had no final line {FINAL_WAIT_NOTE} and "
                         f"got SIGTERM (a round or download still in flight)")
        if r["discard_reasons"]:
            top = "; ".join(f"{n} × {k}" for k, n in list(r["discard_reasons"].items())[:3])
            notes.append(f"- {r['case']} discarded: {top}")
    code = _bench.code_line(payload["code"]) if payload.get("code") else ""
    code += "".join(f" `--set {kv}`" for kv in payload.get("params", {}).get("overrides") or ())
    return "\n".join([*lines, "", *notes, "", code]).strip() + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    rows = payload["cases"]
    with _bench.figure(path, ncols=2, size=(10.0, 4.0)) as (ax, bx):
        labels = [r["case"] for r in rows]
        ax.bar(labels, [100 * r["committed_share"] for r in rows], color="tab:blue")
        ax.axhline(90, color="grey", ls="--", lw=1)
        ax.set_ylabel("rounds committed (%)")
        ax.set_ylim(0, 105)
        bx.bar(labels, [r["comm_compute"] for r in rows], color="tab:orange")
        bx.axhline(1, color="grey", ls="--", lw=1)
        bx.set_ylabel("communication / compute")
        for a in (ax, bx):
            a.tick_params(axis="x", rotation=30)
