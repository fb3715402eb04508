"""Real learners on 127.0.0.1: bootstrap + ``p2p-diloco join`` processes on ``configs/tiny.toml``, and the helpers
the other process tests share.

A 3x slower learner (swarm-clock schedule, the period derived by one learner and published in the DHT): its weight
share equals its token share (+-20%) and the fast learners are never blocked waiting for it.

(Three learners on the step schedule -- each averages every fragment, identical anchors, the last group's members
hold one anchor, "last sync" is the last committed round -- are test_swarm_run.py's main-job test; a Hugging Face
Llama's rounds are the in-process engines' of tests/unit/test_inprocess.py, and its learners over hivemind
tests/integration/test_export_live.py's. A late joiner -- behind on every fragment, it downloads anchor + outer
state from the running swarm, rebases, takes part in rounds and ends with the others' anchors -- is
test_swarm_run.py's chaos test over hivemind, and the rejoin of tests/unit/test_inprocess.py on the engines.)

Figures are printed (``-s``); only loose bounds are asserted (the machine is shared).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from procs import HEAVY, ProcGroup, Proc, start_bootstrap

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
CONFIG = ("--config", TINY, "--set", "inner.total_steps=300", "--set", "outer.sync_every=30")
"""start_learner's default: tiny, 300 steps, H = 30 (10 rounds of each fragment)."""
RUN_DEADLINE_S = 150.0  # start to "final" line, generous: the machine is shared with benchmarks
START_ALLOWANCE_S = 15
"""Added to a test's --max-time, which counts from the learner's start: start-up (imports, averagers) and the
wait for peers take about this long on a busy 2-core machine, and the training time is what the test sizes."""


def write_profile(tmp: Path, name: str, slowdown: float = 1.0, min_step_s: float = 0.1) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(f'name = "{name}"\nslowdown = {slowdown}\nmin_step_s = {min_step_s}\nthreads = 1\n')
    return path


def start_learner(procs: ProcGroup, peers: str, name: str, tmp: Path, *extra: str,
                  config: tuple[str, ...] = CONFIG) -> Proc:
    return procs.cli("join", "--initial-peers", peers, *config, "--name", name, "--events", str(tmp / f"{name}.jsonl"),
                     *extra, name=name)


def final_summary(proc: Proc, timeout_s: float = RUN_DEADLINE_S) -> dict[str, Any]:
    line = proc.wait_for(r"^final (\{.*\})$", timeout_s=timeout_s).group(1)
    return json.loads(line)


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def print_discards(path: Path) -> None:
    for e in events(path):
        if e["event"] == "round" and e["outcome"] != "committed":
            print(f"  {path.stem} discarded f{e['fragment']} v{e['version']} at step {e['step']}: {e['reason']}")


@HEAVY
def test_slow_learner_weight_share_follows_its_tokens(tmp_path: Path) -> None:
    """Swarm-clock schedule: a 3x slower learner meets the fast ones at the same DHT-time boundaries and
    brings fewer tokens; its weight share is its token share (+-20%), and nobody waits for it."""
    fast = write_profile(tmp_path, "fast")
    slow = write_profile(tmp_path, "slow", slowdown=3.0)
    # the derived clock (groups from the clock, the default on the clock's schedule): no window floor, the period is
    # the work's. When the slow learner leads the clock, it derives the first period from its own first steps alone:
    # it retunes once it reads the others. 30 s of training: in 20 s a round lost under the suite's load (a reducer
    # starved of CPU) left the slow learner without a commit of one fragment
    clock = ("--set", "averaging.schedule=clock", "--set", "averaging.window_max_s=2.0", "--set",
             "averaging.window_s=1.5", "--set", "inner.total_steps=200", "--steps", "100000",
             "--max-time", str(30 + START_ALLOWANCE_S), "--wait-peers", "3", "--linger", "15")
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY)
        learners = {n: start_learner(procs, peers, n, tmp_path, "--profile", str(prof), "--shard", str(i),
                                     "--num-shards", "3", *clock)
                    for i, (n, prof) in enumerate((("f0", fast), ("f1", fast), ("s", slow)))}
        finals = {n: final_summary(p) for n, p in learners.items()}
        for p in learners.values():
            assert p.wait_exit(30) == 0, p.output()

    total_tokens = sum(s["tokens"] for s in finals.values())
    for n, s in finals.items():
        # rounds where all three met: each brought the tokens of the same period of swarm time
        rounds = [e for e in events(tmp_path / f"{n}.jsonl") if e["event"] == "round" and e["outcome"] == "committed"
                  and e["group_size"] == 3]
        own = sum(e["own_share"] * sum(e["weights"]) for e in rounds)
        weight_share = own / sum(sum(e["weights"]) for e in rounds)
        token_share = s["tokens"] / total_tokens
        print(f"\n{n}: {s['steps']} steps, token share {token_share:.3f}, weight share {weight_share:.3f} over "
              f"{len(rounds)} rounds (committed {s['committed']}, discarded {s['discarded']}); blocked "
              f"{100 * s['blocked_share']:.2f}%, utilization {100 * s['utilization']:.1f}%")
        print_discards(tmp_path / f"{n}.jsonl")
        # every fragment met; a round may be discarded as partial under CPU contention (2 of 4 of one fragment
        # were, on a 2-core CI machine), so the bar is rounds in all, not two of each
        assert all(c >= 1 for c in s["committed"]) and sum(s["committed"]) >= 3, s
        if n == "s":
            assert abs(weight_share - token_share) <= 0.2 * token_share, (n, weight_share, token_share)
        else:  # the fast ones never wait for the slow one (which would block them for tens of percent; the snapshot at
            # each hand-off and the merges block them a little: 2.6% once under the suite's load, where 2% was the bar)
            assert s["blocked_share"] < 0.05, s
    assert finals["s"]["tokens"] < 0.5 * finals["f0"]["tokens"]
    # one learner (the smallest peer id) derived the clock; everyone ran on it
    leaders = [n for n in finals if any(e["event"] == "clock" for e in events(tmp_path / f"{n}.jsonl"))]
    leader = min(finals, key=lambda n: finals[n]["peer_id"])
    assert leaders == [leader], (leaders, leader)
    published = [e for e in events(tmp_path / f"{leader}.jsonl") if e["event"] == "clock"]
    # the period depends on the measured step times; the leader may retune near the end, after a follower's last
    # read of the clock: every follower ends on a period the leader published, and the leader on its latest. Which
    # period the leader derives from which step times is the clock's unit tests' (tests/unit/test_clock.py)
    periods = {e["period_s"] for e in published}
    assert all(s["sync_period_s"] in periods for s in finals.values()), (periods, finals)
    assert finals[leader]["sync_period_s"] == published[-1]["period_s"], (published, finals[leader])
    assert all(0 < p < math.inf for p in periods), periods
    assert len({tuple(s["anchor_hashes"]) for s in finals.values()}) == 1, finals
