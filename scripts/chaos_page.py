"""``scripts/chaos.py``'s page: the method text, the tables (``README.md``) and the timeline figure (``chaos.png``).

Both are drawn from ``chaos.json`` alone (its ``analysis``: ``chaos_analysis.analyse``), so ``--render-only`` and
``--replot`` give what the run wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _bench
from chaos_analysis import TARGET_EVAL_GAP, TARGET_GOODPUT, TARGET_STALL_S

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
        f"Chaos against a local swarm ({Path(payload['config']).name}"
        + "".join(f" `--set {kv}`" for kv in payload.get("overrides") or ()) + f", {len(a['learners'])} learners, "
        f"{payload['duration_s']:.0f} s of training, seed {payload['seed']}, {kills} kill -9 + restart and {stops} "
        f"SIGSTOP/SIGCONT, {'quick' if payload['quick'] else 'full'} run, "
        + (f"checkpoints every {payload['checkpoint_every_s']:g} s and restarts resume from them"
           if payload.get("checkpoint_every_s") else "restarts start afresh")
        + (f"; {_bench.code_line(payload['code'])}):" if payload.get("code") else "):"),  # runs before 2026-12-05: none
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

