"""Self-healing with real learners on 127.0.0.1 and deterministic faults (``join --fault``, p2p_diloco/faults.py).

1. kill -9 mid-all-reduce: the victim dies while reducing a part of fragment 0; the survivors
   discard that round (never half-apply), form the next rounds without it and end with identical
   anchors.
2. A donor killed mid-download: a newcomer's first donor (by the newcomer's own donor order) dies
   while sending fragment 0's state; the newcomer tries the next donor, rebases onto a verified
   state and ends with the survivor's anchors.
3. A round waiting for its group ends at once when cancelled (in process). (A graceful leave: the process side --
   SIGTERM, exit 0, the tombstone, nothing left -- is test_signals.py's, a round in flight at SIGINT
   test_signals_api.py's, and the others averaging on as a pair tests/unit/test_inprocess.py's.)
4. Resume: a learner killed with kill -9 while checkpointing every 0.5 s resumes from its newest
   complete checkpoint with the same hashes (weights, anchors) as saved, and trains on.

A straggler stalled mid-round beside two others (their rounds go on as a pair, their loops never wait, it comes
back) is tests/unit/test_inprocess.py's frozen learner; over hivemind, a stopped learner coming back is
test_straggler.py's, a member that dies mid-all-reduce case 1 here, and an averager stalled mid-all-reduce
test_signals_api.py's.

Every fault test checks that the fault fired (its "FAULT fired" line) and the survivors' state.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from procs import HEAVY, ProcGroup, start_bootstrap
from test_learner_swarm import TINY, events, final_summary, print_discards, start_learner, write_profile

from p2p_diloco.core.waiting import poll_until

pytestmark = pytest.mark.integration

EXIT_DEADLINE_S = 60.0
MATCHMAKING_DEADLINE_S = 60.0
"""Seconds a lone round may take to reach matchmaking (generous: a loaded machine)."""


def rounds(path: Path, outcome: str | None = None) -> list[dict[str, Any]]:
    return [e for e in events(path) if e["event"] == "round" and (outcome is None or e["outcome"] == outcome)]


def fired(proc: Any, spec: str) -> bool:
    return any(f"FAULT fired: {spec}" in line for _, line in proc.stderr)


def test_kill_mid_allreduce_survivors_discard_then_go_on(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, "paced")
    spec = "kill@while-reducing:fragment=0:at=3"  # the victim's 2nd round of fragment 0 with a remote part
    # the round the victim dies in lasts until the all-reduce timeout, and the fragment's next rounds wait for
    # it: a short timeout and enough steps after it, so that those rounds come even on a loaded machine (300: under
    # the suite's load the victim's rounds of fragment 0 once failed to match four times in 220, and it never died)
    common = ("--profile", str(profile), "--wait-peers", "3", "--steps", "300", "--linger", "15",
              "--set", "averaging.allreduce_timeout_s=12")
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY)
        survivors = {n: start_learner(procs, peers, n, tmp_path, "--shard", str(i), "--num-shards", "3", *common)
                     for i, n in enumerate(("s0", "s1"))}
        victim = start_learner(procs, peers, "victim", tmp_path, "--shard", "2", "--num-shards", "3", "--fault", spec, *common)
        assert victim.wait_exit(120) == -signal.SIGKILL, victim.output()
        finals = {n: final_summary(p) for n, p in survivors.items()}
        for p in survivors.values():
            assert p.wait_exit(EXIT_DEADLINE_S) == 0, p.output()
    assert fired(victim, spec), victim.output()
    victim_id = re.search(r"joined run \S+ as victim \((\w+)\)", victim.output()).group(1)  # type: ignore[union-attr]
    died_at = max(e["time"] for e in events(tmp_path / "victim.jsonl"))  # its last event: it died after it
    # the version of fragment 0 it died at: its rounds and downloads are logged when applied, and a round is
    # started only once the fragment's last one was applied, so it died in a round at this version
    died_in = max((e["version_after"] for e in events(tmp_path / "victim.jsonl")
                   if e.get("fragment") == 0 and "version_after" in e), default=0)
    discarded_after_death = 0
    for n, s in finals.items():
        print_discards(tmp_path / f"{n}.jsonl")
        f0 = [e for e in rounds(tmp_path / f"{n}.jsonl") if e["fragment"] == 0]
        print(f"{n}: f0 rounds {[(e['version'], e['group_size'], e['outcome']) for e in f0]}; versions {s['versions']}")
        after = [e for e in f0 if e["time"] > died_at]
        # the round the victim died in is never applied: no round with it commits at or after that version
        # (a survivor may log the round before, which the victim applied too, after the victim's last event)
        assert not [e for e in f0 if e["outcome"] == "committed" and victim_id in e.get("peers", [])
                    and e["version"] >= died_in], (died_in, f0)
        discarded_after_death += sum(e["outcome"] == "discarded" for e in after)
        # ... and the next rounds form without it
        assert any(e["group_size"] == 2 and e["outcome"] == "committed" for e in after), f0
    assert discarded_after_death >= 1  # a survivor was in the round the victim died in, and discarded it
    a, b = finals.values()
    assert a["anchor_hashes"] == b["anchor_hashes"] and a["versions"] == b["versions"], (a, b)


@HEAVY
def test_donor_killed_mid_download_newcomer_tries_the_next(tmp_path: Path) -> None:
    from p2p_diloco.averaging.decisions import donor_order
    from p2p_diloco.net.keys import load_or_create_identity

    profile = write_profile(tmp_path, "paced")
    ids = {n: load_or_create_identity(tmp_path / f"{n}.id").peer_id for n in ("e0", "e1", "late")}
    # the newcomer's first donor (equal ranks: its rendezvous order) is the one that dies serving fragment 0
    first = donor_order({ids["e0"]: 1.0, ids["e1"]: 1.0}, ids["late"], 0.0)[0]
    victim, survivor = ("e0", "e1") if first == ids["e0"] else ("e1", "e0")
    spec = "kill@serving-state:fragment=0"
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY)
        # the early pair trains, syncs, then stays to serve (versions final and equal: donor ranks tie); 200 steps so
        # that fragment 0's rounds commit even on a loaded machine (at 90 they once found no group, and the victim,
        # a version behind, was never asked)
        early = {n: start_learner(procs, peers, n, tmp_path, "--identity", str(tmp_path / f"{n}.id"), "--shard", str(i),
                                  "--num-shards", "3", "--profile", str(profile), "--wait-peers", "2", "--steps", "200", "--linger", "20",
                                  "--serve", "60", "-v",  # -v: the "serving" line is INFO
                                  *(("--fault", spec) if n == victim else ()))
                 for i, n in enumerate(("e0", "e1"))}
        for p in early.values():
            p.wait_for(r"serving our state to newcomers", timeout_s=150, stream="stderr")
        late = start_learner(procs, peers, "late", tmp_path, "--identity", str(tmp_path / "late.id"), "--shard", "2",
                             "--num-shards", "3", "--profile", str(profile), "--steps", "70", "--linger", "5",
                             "--set", "averaging.kept_rounds=0")  # downloads: no replay of the rounds it missed
        late_final = final_summary(late)
        assert late.wait_exit(EXIT_DEADLINE_S) == 0, late.output()
        assert early[victim].wait_exit(30) == -signal.SIGKILL, early[victim].output()
        early[survivor].send(signal.SIGTERM)  # no need to serve any longer
        survivor_final = final_summary(early[survivor], timeout_s=120)
        assert early[survivor].wait_exit(EXIT_DEADLINE_S) == 0, early[survivor].output()
    assert fired(early[victim], spec), early[victim].output()
    resyncs = [e for e in events(tmp_path / "late.jsonl") if e["event"] == "resync"]
    print("\n" + "\n".join(f"late resync f{e['fragment']}: {e['outcome']}, tried {e.get('donors_tried')}, "
                           f"failures {e.get('donor_failures')}, {e.get('duration_s')} s" for e in resyncs))
    f0 = [e for e in resyncs if e["fragment"] == 0 and e["outcome"] == "rebased"]
    assert f0, resyncs
    assert f0[0]["donors_tried"] == 2 and len(f0[0]["donor_failures"]) == 1, f0[0]
    assert f0[0]["donor_failures"][0].startswith(ids[victim][-8:]), (f0[0], ids)
    # verified state, then the newcomer holds exactly the survivor's anchors
    assert late_final["anchor_hashes"] == survivor_final["anchor_hashes"], (late_final, survivor_final)
    assert late_final["versions"] == survivor_final["versions"]


def test_cancel_ends_a_waiting_round_at_once(tmp_path: Path) -> None:
    """In process: a round waiting for its group ends within a poll period of cancel(), as 'cancelled'."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.averaging.plans import RoundPlan
    from p2p_diloco.averaging.runner import ExactAllReduceRunner
    from p2p_diloco.sync.fragment import Contribution
    from test_learner_faults import CFG, NAMES, SHAPES, swarm

    with swarm(tmp_path, (ExactAllReduceRunner,)) as (peer,):
        matchmaking = threading.Event()  # set once the round has asked its averager for a group
        step = peer.averager.step

        def step_and_tell(*args: Any, **kwargs: Any) -> Any:
            control = step(*args, **kwargs)
            matchmaking.set()
            return control

        peer.averager.step = step_and_tell
        contribution = Contribution(fragment=0, version=0, anchor_hash="0" * 16, tokens=100, steps=1, weight=100.0,
                                    tensors={n: torch.ones(SHAPES[n]) for n in NAMES}, norms={})
        future = peer.start_round(contribution, RoundPlan(get_dht_time() + 60.0, CFG.averaging.window_s,
                                                          due=get_dht_time()))
        assert matchmaking.wait(MATCHMAKING_DEADLINE_S), "the round never started matchmaking"
        assert not future.done()  # alone, scheduled a minute ahead: it waits for its group
        t0 = time.monotonic()
        peer.cancel()
        outcome = future.result(timeout=30)
        print(f"\ncancelled round ended {time.monotonic() - t0:.2f} s after cancel(): {outcome.reason}")
        assert not outcome.committed and "cancelled" in outcome.reason


def test_resume_after_kill_9_restores_the_saved_hashes(tmp_path: Path) -> None:
    from p2p_diloco.learner.checkpoint import list_checkpoints, load_checkpoint

    profile = write_profile(tmp_path, "paced", min_step_s=0.05)
    ckpt = tmp_path / "ckpt"
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY)
        first = start_learner(procs, peers, "solo", tmp_path, "--profile", str(profile), "--steps", "100000",
                              "--set", "inner.total_steps=300", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "0.5",
                              "-v")  # -v: "checkpoint saved" is INFO
        def three_saved() -> bool:  # three periodic checkpoints, then a crash (maybe in the middle of a save)
            assert first.popen.poll() is None, first.output()
            return sum("checkpoint saved" in line for _, line in first.stderr) >= 3

        poll_until(three_saved, 120, "solo: three periodic checkpoints", detail=first.output)
        first.kill_group(signal.SIGKILL)
        first.wait_exit(30)
        saved = load_checkpoint(ckpt)  # the newest complete one
        m = saved.manifest
        print(f"\nkilled after {len(list_checkpoints(ckpt))} kept checkpoints; newest {saved.path.name}: step {m['inner_step']}, "
              f"model {m['model_digest']}, anchors {m['anchor_hashes']}")
        resumed = start_learner(procs, peers, "solo2", tmp_path, "--profile", str(profile), "--steps",
                                str(m["inner_step"] + 20), "--set", "inner.total_steps=300", "--resume", str(ckpt),
                                "--linger", "2")
        line = resumed.wait_for(r"^resumed from (\S+): step (\d+), model (\w+), versions \[([\d, ]*)\], anchors (.*)$")
        final = final_summary(resumed)
        assert resumed.wait_exit(EXIT_DEADLINE_S) == 0, resumed.output()
    assert line.group(1) == str(saved.path)
    assert int(line.group(2)) == m["inner_step"] and line.group(3) == m["model_digest"]
    assert [int(v) for v in line.group(4).split(", ")] == m["versions"]
    assert line.group(5).split() == m["anchor_hashes"]
    assert final["resumed_from_step"] == m["inner_step"] and final["steps"] == m["inner_step"] + 20, final
    # the resumed run checkpointed into the same folder when it left (the one it resumed from is kept)
    assert load_checkpoint(ckpt).manifest["inner_step"] == m["inner_step"] + 20
    assert not [p for p in os.listdir(ckpt) if p.startswith(".tmp-")]
