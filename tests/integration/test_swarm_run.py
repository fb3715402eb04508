"""``p2p-diloco swarm``: the one-command local swarm runs to the end and reports; Ctrl+C stops every
process it started and still writes the report. Real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from procs import HEAVY, ProcGroup

from p2p_diloco.core.config import load_config
from p2p_diloco.core.waiting import poll_until
from p2p_diloco.local.launcher import read_jsonl

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")


def profiles(tmp: Path) -> str:
    paths = []
    for name, slowdown in (("quick", 1.0), ("slower", 2.0)):
        path = tmp / f"{name}.toml"
        path.write_text(f'name = "{name}"\nslowdown = {slowdown}\nmin_step_s = 0.05\nthreads = 1\n')
        paths.append(str(path))
    return ",".join(paths)


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc), whatever its session."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_swarm_runs_to_the_end_and_reports(tmp_path: Path) -> None:
    """A step budget (--minutes 0); no stored data-parallel curve for tiny.toml: one is computed for the
    run's tokens after it, cached (not under results/), and the summary has the figure. Three learners on the
    step schedule: each averages every fragment, its "last sync" is its last committed round's DHT time, the
    last group of each fragment holds one anchor, and all end with identical anchors."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    with ProcGroup(tmp_path) as procs:
        procs.env["P2P_DILOCO_CACHE"] = str(cache)
        rc, proc, wall_s = procs.run("swarm", "--peers", "3", "--config", TINY, "--set", "inner.total_steps=120",
                                     "--minutes", "0", "--profiles", profiles(tmp_path), "--out", str(out), "--plain", timeout_s=300)
        assert rc == 0, proc.output()
    report = json.loads((out / "summary.json").read_text())
    print(f"\nswarm: {wall_s:.0f} s; eval {report['eval_loss_start']:.3f} -> {report['eval_loss_end']:.3f}; "
          f"rounds {report['rounds_committed']} committed, {report['rounds_discarded']} discarded")
    assert sorted(report["learners"]) == ["quick-0", "quick-2", "slower-1"]
    assert report["anchors_identical"] and report["eval_loss_end"] < report["eval_loss_start"] - 0.5
    assert report["rounds_committed"] >= 6 and report["bytes_saved_vs_dp_fp32"] > 1
    slow, fast = report["learners"]["slower-1"], report["learners"]["quick-0"]
    assert slow["steps"] == fast["steps"] == 120  # a step budget: the slower one takes longer
    assert report["finished_together"] == ["quick-0", "quick-2", "slower-1"] and report["excluded"] == {}
    logs = {n: [json.loads(line) for line in (out / "logs" / f"{n}.jsonl").read_text().splitlines()]
            for n in report["learners"]}
    committed = {n: [e for e in log if e["event"] == "round" and e["outcome"] == "committed"] for n, log in logs.items()}
    for n, f in report["learners"].items():
        print(f"{n}: committed {f['committed']} discarded {f['discarded']} resynced {f['resynced']}; blocked "
              f"{100 * f['blocked_share']:.2f}%")
        assert all(c >= 1 for c in f["committed"]), f  # every learner averaged every fragment
        # what `status` shows as "last sync": the DHT time of its last committed round
        assert 0 <= max(e["time"] for e in committed[n]) - f["last_sync_time"] < 1.0, f
    # the last committed group of each fragment: its members hold the same anchor after it
    by_peer = {f["peer_id"]: n for n, f in report["learners"].items()}
    for fragment in range(len(fast["versions"])):
        last = {n: [e for e in rounds if e["fragment"] == fragment][-1] for n, rounds in committed.items()}
        group = max(last.values(), key=lambda e: e["version_after"])
        members = [by_peer[p] for p in group["peers"] if p in by_peer]
        assert len(members) >= 2 and len({last[m]["anchor_hash"] for m in members}) == 1, (group, last)
    ref = report["reference"]
    assert ref["eval_loss"] is not None and ref["tokens"] == report["tokens"], ref
    assert ref["reference_tokens"] >= report["tokens"] and ref["computed_s"] > 0, ref
    assert [p.name for p in (cache / "reference").iterdir()] == [Path(ref["path"]).name]
    assert "computing one for this run" in proc.output()
    for png in ("loss.png", "rounds.png"):
        assert (out / png).stat().st_size > 1000
    assert "held-out eval loss of the global model" in (out / "summary.md").read_text()
    assert any(line.startswith("[") and "live" in line for _, line in proc.stdout), proc.output()  # plain view


def test_a_swarm_stopped_at_its_token_budget_ends_its_lr_schedule_there(tmp_path: Path) -> None:
    """--max-tokens stops every learner long before --minutes: their inner LR's cosine ends at the swarm's token
    budget (each learner reads the others' published counts, --lr-tokens), not with the time, so they stop at the
    schedule's floor as data-parallel training of those tokens does. By the time alone the LR would still be near
    its peak: the learners of the main job once stopped at 8.4M tokens 60% into their cosine."""
    out, budget = tmp_path / "run", 500_000  # over a minute: the learners read each other's records every 30 s
    with ProcGroup(tmp_path) as procs:
        procs.env["P2P_DILOCO_CACHE"] = str(tmp_path / "cache")
        rc, proc, wall_s = procs.run("swarm", "--peers", "2", "--config", TINY, "--minutes", "5", "--max-tokens",
                                     str(budget), "--no-reference", "--profiles", profiles(tmp_path), "--out", str(out),
                                     "--plain", timeout_s=480)
        assert rc == 0, proc.output()
    report = json.loads((out / "summary.json").read_text())
    inner = load_config(TINY).inner
    lrs = {n: (f["lr"], f["train_s"], f["tokens"]) for n, f in report["learners"].items()}
    print(f"\ntoken budget {budget:,}: {report['tokens']:,} tokens in {wall_s:.0f} s; (lr, train_s, tokens) {lrs}")
    assert report["tokens"] >= 0.9 * budget and len(lrs) == 2, lrs
    for lr, train_s, _ in lrs.values():
        assert train_s < 0.6 * 5 * 60, lrs  # the tokens ended the run, not the time
        assert lr <= inner.lr * (inner.min_lr_ratio + 0.1), lrs  # annealed: 80% of the cosine or more


def test_ctrl_c_stops_every_process_and_still_reports(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with ProcGroup(tmp_path) as procs:
        procs.env["P2P_DILOCO_CACHE"] = str(tmp_path / "cache")
        swarm = procs.cli("swarm", "--peers", "2", "--config", TINY, "--set", "inner.total_steps=100000",
                          "--profiles", profiles(tmp_path), "--out", str(out), "--plain", name="swarm")
        swarm.wait_for(r"^\[\s*\d+ s\] 2 live", timeout_s=120)
        # ... and both have stepped (a round of theirs ended): under the suite's load the records show "live" before
        # the first step, and a Ctrl+C at "2 live" once ended two learners that had trained nothing
        logs = [out / "logs" / f"{name}.jsonl" for name in ("quick-0", "slower-1")]
        poll_until(lambda: all(any(e.get("event") == "round" for e in read_jsonl(p)) for p in logs),
                   120, "a round of each learner", 0.2, detail=swarm.output)
        started = descendants(swarm.pid)
        assert len(started) >= 3 * 2, started  # bootstrap + 2 learners, each with a DHT process and a p2pd
        t0 = time.monotonic()
        swarm.send(signal.SIGINT)
        assert swarm.wait_exit(120) == 130, swarm.output()
        print(f"\nCtrl+C: the swarm exited {time.monotonic() - t0:.1f} s later; it had {len(started)} processes")
        # hivemind's helpers follow the process that started them when it dies (the parent-death signal): on a
        # loaded machine one may take a moment after the swarm's exit
        poll_until(lambda: not any(alive(pid) for pid in started), 15, "every process of the swarm gone", 0.1,
                   detail=lambda: "processes left behind: " + ", ".join(
                       f"{pid} ({Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r})" for pid in started if alive(pid)))
    report = json.loads((out / "summary.json").read_text())
    assert len(report["learners"]) == 2 and all(f["steps"] > 0 for f in report["learners"].values())
    assert "interrupted: not computed" in report["reference"]["why"]  # Ctrl+C: no reference computed after it


@HEAVY
def test_chaos_kills_a_learner_and_it_rejoins(tmp_path: Path) -> None:
    """--chaos: kill -9 of the last learner at 1/3 of the training, a new one in its place at 1/2; the new one
    downloads the current anchors (it is behind on every fragment: a late joiner, from version 0) and takes part
    in rounds again. A time
    budget: every learner trains until the end, far past tiny.toml's 40 steps (no step cap), and the anchors
    are compared among those that finished together; the killed one is left out, with why."""
    out = tmp_path / "run"
    # a fixed period: rounds commit from the start, so the learner restarted at half-time is behind on every fragment
    # (a derived period waits for measured step times, and under the suite's load nothing had committed by then). The
    # chaos counts from when every learner trains, and the run is 90 s, not 60: under load start-up took 38 s, and the
    # chaos counted from the launch had restarted the learner before the swarm's first round (nothing to catch up on).
    # Groups from the clock (the default) on 5 s periods: a boundary every 2.5 s, so the new learner's downloads often
    # land a version behind, and it must see at once who got ahead (it once chased the swarm and committed nothing)
    clock = ("--set", "averaging.schedule=clock", "--set", "averaging.window_max_s=2.0", "--set",
             "averaging.window_s=1.5", "--set", "averaging.sync_period_s=5.0")
    with ProcGroup(tmp_path) as procs:
        procs.env["P2P_DILOCO_CACHE"] = str(tmp_path / "cache")
        # --no-reference: the data-parallel reference is the step-budget test's; computing it took a third as long again
        rc, proc, wall_s = procs.run("swarm", "--peers", "3", "--config", TINY, *clock, "--minutes", "1.5", "--chaos",
                                     "--no-reference", "--profiles", profiles(tmp_path), "--out", str(out), "--plain",
                                     timeout_s=300)
        assert rc == 0, proc.output()
    report = json.loads((out / "summary.json").read_text())
    whats = [e["what"] for e in report["chaos_events"]]
    print(f"\nchaos: {whats}; learners {sorted(report['learners'])}; {wall_s:.0f} s")
    assert whats == ["kill -9 quick-2", "restart quick-2-rejoined"], whats
    assert sorted(report["learners"]) == ["quick-0", "quick-2-rejoined", "slower-1"]  # the killed one never reported
    back = report["learners"]["quick-2-rejoined"]
    assert min(back["resynced"]) >= 1 and sum(back["committed"]) >= 1, (
        {k: back[k] for k in ("versions", "committed", "discarded", "resynced", "steps", "train_s")},
        report["chaos_events"])
    # a fresh learner in a running swarm: its first catch-up of each fragment -- a download, or a replay of the rounds
    # a peer kept from version 0 -- rebased it from version 0
    logged = [json.loads(line) for line in (out / "logs" / "quick-2-rejoined.jsonl").read_text().splitlines()]
    firsts = {f: next(e for e in logged if e["event"] in ("resync", "replay") and e["fragment"] == f)
              for f in range(len(back["versions"]))}
    assert all(e["outcome"] == "rebased" and e["version"] == 0 < e["version_after"] for e in firsts.values()), firsts
    assert report["anchors_identical"], {n: f["anchor_hashes"] for n, f in report["learners"].items()}
    assert report["finished_together"] == ["quick-0", "quick-2-rejoined", "slower-1"], report["excluded"]
    assert report["excluded"]["quick-2"].startswith("killed by --chaos (kill -9) at "), report["excluded"]
    assert report["reference"]["eval_loss"] is None, report["reference"]  # --no-reference: none computed
    steps = {n: f["steps"] for n, f in report["learners"].items()}
    assert min(steps.values()) > 40, steps  # tiny.toml's inner.total_steps no longer ends a timed run
