"""``scripts/wan/bench_wan.py``'s figures: each method's numbers at one rate from what its processes printed.

Pure functions of the runs' ``final`` lines, learner 0's ``eval`` events, the hosts' byte counters and the
data-parallel trajectory: time to the target (projected for data-parallel, measured for the learners), wire bytes per
token, utilization, the speed-ups over data-parallel beside the ideal bound, and the merge of a new rate into an
earlier result.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from p2p_diloco.sim.curves import crossing, value_at


def trajectory_summary(curve: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    """The trajectory run's rank-0 curve and its steps (and tokens) to ``target``."""
    pts = [(float(c["step"]), float(c["eval_loss"])) for c in curve]
    steps = crossing(pts, target)
    tokens_per_step = curve[-1]["tokens"] / curve[-1]["step"] if curve and curve[-1]["step"] else None
    return {"curve": list(curve), "target_loss": target, "steps_to_target": steps,
            "tokens_to_target": steps * tokens_per_step if steps is not None and tokens_per_step else None}



def dp_metrics(ranks: Sequence[dict[str, Any]], wire_tx: Sequence[int], compute_step_s: float,
               trajectory: dict[str, Any]) -> dict[str, Any]:
    """One rate's data-parallel figures from its ranks' ``final`` lines; the time to the target is the
    trajectory's steps to it x this rate's median step time (projected: see the module's text)."""
    r0 = next(r for r in ranks if r["rank"] == 0)
    step_s = statistics.median(r["median_step_s"] for r in ranks)
    tokens = r0["tokens"]  # all ranks together
    steps_to_target = trajectory.get("steps_to_target")
    return {
        "steps_per_host": r0["steps"], "tokens": tokens, "median_step_s": step_s, "train_s": r0["train_s"],
        "final_eval_loss": None,  # a few steps only: the trajectory holds data-parallel's losses
        "time_to_target_s": steps_to_target * step_s if steps_to_target is not None else None,
        "time_to_target_projected": True,
        "wire_bytes": sum(wire_tx), "wire_bytes_per_token": sum(wire_tx) / tokens if tokens else None,
        "utilization": compute_step_s / step_s if step_s > 0 else None,
        "tokens_per_s": tokens / r0["train_s"] if r0["train_s"] > 0 else None,
    }


def learner_metrics(finals: Sequence[dict[str, Any]], wire_tx: Sequence[int], evals: Sequence[dict[str, Any]],
                    trajectory: dict[str, Any]) -> dict[str, Any]:
    """One learner run's figures from the learners' ``final`` lines and learner 0's ``eval`` events (training
    seconds and loss of the global model), next to the data-parallel trajectory at the same tokens."""
    tokens = sum(f["tokens"] for f in finals)
    train_s = statistics.median(f["train_s"] for f in finals)
    final_loss = statistics.median(f["eval_loss_end"] for f in finals)
    pts = [(float(e["train_s"]), float(e["eval_loss"])) for e in evals if "train_s" in e and "eval_loss" in e]
    pts.append((train_s, final_loss))
    per_step = trajectory["curve"][-1]["tokens"] / trajectory["curve"][-1]["step"] if trajectory.get("curve") else 0
    dp_loss = value_at([(c["step"] * per_step, c["eval_loss"]) for c in trajectory.get("curve", [])], tokens)
    return {
        "steps_per_host": statistics.median(f["steps"] for f in finals), "tokens": tokens,
        # wall time per step, like data-parallel's (inner step + any time the loop was held up)
        "median_step_s": statistics.median(f["train_s"] / max(1, f["steps"]) for f in finals),
        "train_s": train_s, "final_eval_loss": final_loss,
        "time_to_target_s": crossing(sorted(pts), trajectory["target_loss"]) if trajectory else None,
        "eval_curve": pts,
        "dp_eval_loss_at_tokens": dp_loss,
        "vs_dp_at_tokens": final_loss / dp_loss - 1 if dp_loss else None,
        "wire_bytes": sum(wire_tx), "wire_bytes_per_token": sum(wire_tx) / tokens if tokens else None,
        "utilization": statistics.median(f["utilization"] for f in finals),
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "committed": [sum(f["committed"]) for f in finals], "discarded": [sum(f["discarded"]) for f in finals],
        "anchors_identical": len({tuple(f["anchor_hashes"]) for f in finals}) == 1,
        "app_bytes_sent": sum(f["bytes_sent"] for f in finals),
    }


def speedups(rows: dict[str, dict[str, Any]], compute_step_s: float) -> dict[str, Any]:
    """Each method's speed-up over data-parallel at one rate (time to target, and tokens per second), with
    the ideal bound (data-parallel step time / compute-only step time) and the share of it reached."""
    dp = rows.get("dp")
    if dp is None:
        return {}
    bound = dp["median_step_s"] / compute_step_s if compute_step_s > 0 else None
    out: dict[str, Any] = {"ideal_bound": bound}
    for name, row in rows.items():
        if name == "dp":
            continue
        tput = row["tokens_per_s"] / dp["tokens_per_s"] if row.get("tokens_per_s") and dp.get("tokens_per_s") else None
        ttt = (dp["time_to_target_s"] / row["time_to_target_s"]
               if row.get("time_to_target_s") and dp.get("time_to_target_s") else None)
        bytes_x = (dp["wire_bytes_per_token"] / row["wire_bytes_per_token"]
                   if row.get("wire_bytes_per_token") and dp.get("wire_bytes_per_token") else None)
        out[name] = {"throughput": tput, "time_to_target": ttt,
                     "share_of_bound": ttt / bound if ttt is not None and bound else None,
                     "fewer_wire_bytes_per_token": bytes_x}
    return out



def merge_results(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the rates of ``new`` added; at a rate both have, ``new``'s methods replace or join ``old``'s
    and the speed-ups are computed again (``old``'s compute-only step). Rates sorted."""
    compute_step_s = old.get("compute_only", {}).get("median_step_s", 0.0)
    rates = dict(old["rates"])
    for key, r in new["rates"].items():
        if key in rates:
            methods = {**rates[key]["methods"], **r["methods"]}
            r = {**rates[key], **r, "methods": methods, "speedups": speedups(methods, compute_step_s)}
        rates[key] = r
    out = {**old, "rates": dict(sorted(rates.items(), key=lambda kv: kv[1]["rate_mbit"]))}
    out["runs"] = [*old.get("runs", [old.get("started")]), new.get("started")]
    return out
