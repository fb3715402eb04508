"""Stragglers come back to the one model, whatever the swarm's size (real learners on 127.0.0.1).

A learner stopped with SIGSTOP (``kill -STOP PID``, as a user pausing a job or a machine that swaps) freezes
between posting its verdict and reading the others'. Its partner gives up on the round when the commit timeout
passes; the straggler, woken, used to read every "ok" and commit alone: a version only it held, which nobody
else could vouch for, so in a swarm of two no download was ever accepted and the swarm stayed split for good.
Now a member that gives up replaces its "ok" with a veto (the late member discards too), and one that gave up
keeps the round's result: if a peer still turns out to hold exactly that result, it commits it too
(``late_commit``), with no download and no third peer.

1. SIGSTOP one learner of two for 8 s and, once it is back, for 18 s (past its record's 12 s TTL): after each
   SIGCONT, within 3 rounds of each fragment, the straggler holds the version and anchor the others hold (a
   round with them, a download, a late commit), and it averages with every learner again; the learners are then
   finished with SIGUSR1 (final rounds, the linger) and all end at the same versions with identical anchors,
   every final line's consensus distance 0 (what identical anchors make it). A learner frozen in a swarm of three
   is tested on the in-process network (tests/unit/test_inprocess.py): the same come-back, without three
   processes' start-up.
2. The late-commit path, forced: one of two learners is blind to the others' verdicts for a while
   (``blind@reading-verdicts``), so its partner commits while it gives up; it then commits the same round late
   and both end identical.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from procs import HEAVY, Proc, ProcGroup, start_bootstrap
from test_learner_swarm import TINY, events, final_summary

from p2p_diloco.core.config import load_config
from p2p_diloco.core.waiting import WaitTimeout, poll_until

pytestmark = pytest.mark.integration

BEFORE_STOP_S = 5.0
"""Seconds of training (after every learner's first committed round) before the straggler is stopped."""
AFTER_BACK_S = 5.0
"""Seconds the learners train on once the straggler is back in every fragment's rounds, before they finish."""
FIRST_ROUND_DEADLINE_S = 100.0
"""Start-up, the wait for peers and every learner's first committed round, on a loaded 2-core machine."""
BACK_DEADLINE_S = 90.0
"""From SIGCONT to the straggler's first round with every learner on each fragment (the round it froze in ends
at its 33 s limit first)."""
BETWEEN_PAUSES_S = 8.0
"""Seconds from one SIGCONT to the next SIGSTOP when a learner is paused twice."""
MAX_TIME_S = 600.0
"""The learners' --max-time, a bound only: the test ends them with SIGUSR1 (finish) once it has seen its rounds."""
EXIT_DEADLINE_S = 120.0
TTL_S = 12.0
"""The records' lifetime in the SIGSTOP test (the default's 30 s made its longer pause 40 s)."""
FRAGMENTS = load_config(TINY).outer.fragments


def start(procs: ProcGroup, peers: str, name: str, tmp: Path, n: int, *extra: str) -> Proc:
    return procs.cli("join", "--initial-peers", peers, "--config", TINY, "--name", name, "--events",
                     str(tmp / f"{name}.jsonl"), "--wait-peers", str(n), "--max-time", str(MAX_TIME_S),
                     "--steps", "1000000", "--set", "inner.total_steps=1000000", "--linger", "20", *extra, name=name)


def committed_rounds(path: Path) -> list[dict[str, Any]]:
    return [e for e in events(path) if e["event"] == "round" and e["outcome"] == "committed"] if path.exists() else []


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def finish(learners: dict[str, Proc]) -> dict[str, dict[str, Any]]:
    """SIGUSR1 to every learner (final rounds, the linger, the final line, exit 0); their final lines."""
    for p in learners.values():
        p.send(signal.SIGUSR1)
    finals = {nm: final_summary(p, timeout_s=EXIT_DEADLINE_S) for nm, p in learners.items()}
    for p in learners.values():
        assert p.wait_exit(EXIT_DEADLINE_S) == 0, p.output()
    assert all(any("SIGUSR1: finishing" in line for _, line in p.stderr) for p in learners.values())
    return finals


def check_identical(finals: dict[str, dict[str, Any]]) -> None:
    for n, s in finals.items():
        print(f"\n{n}: versions {s['versions']} anchors {s['anchor_hashes']} committed {s['committed']} discarded "
              f"{s['discarded']} resynced {s['resynced']} late {s['late_commits']} distance {s['consensus_distance']}")
    assert len({tuple(s["versions"]) for s in finals.values()}) == 1, finals
    assert len({tuple(s["anchor_hashes"]) for s in finals.values()}) == 1, finals
    # identical anchors: a learner that still saw live peers at the end states distance 0, never a stale figure
    for s in finals.values():
        assert all(d in (0.0, None) for d in s["consensus_distance"]), s
    assert any(s["consensus_distance"] == [0.0] * len(s["versions"]) for s in finals.values()), finals


def back_after(tmp: Path, names: list[str], victim: str, resumed: float) -> list[tuple[int, list[dict[str, Any]]]] | None:
    """Per fragment, once the straggler is back after SIGCONT: (rounds it tried before it held the version and
    anchor every other learner holds -- through a round with them, a download or a late commit --, its events
    after SIGCONT), provided it has also committed a round with every learner since; None while not so far on
    some fragment (or a partner has not logged that commit yet)."""
    log = [e for e in events(tmp / f"{victim}.jsonl") if e["time"] > resumed]
    out = []
    for f in range(FRAGMENTS):
        held = [{(e["version_after"], e["anchor_hash"]) for e in committed_rounds(tmp / f"{other}.jsonl")
                 if e["fragment"] == f} for other in names if other != victim]
        ours = [e for e in log if e.get("fragment") == f and e["event"] in ("round", "resync", "late_commit")]
        back = next((i for i, e in enumerate(ours) if (e["event"] != "round" or e["outcome"] == "committed")
                     and all((e["version_after"], e["anchor_hash"]) in h for h in held)), None)
        together = any(e["event"] == "round" and e["outcome"] == "committed" and e["group_size"] == len(names)
                       for e in ours)
        if back is None or not together:
            return None
        out.append((sum(e["event"] == "round" for e in ours[:back]), ours))
    return out


def check_back_within_3_rounds(tmp: Path, names: list[str], victim: str, resumed: float, what: str,
                               detail: Callable[[], str]) -> None:
    """After SIGCONT, on every fragment, the straggler held what the others hold before its 4th round (the round
    it froze in counts as one), and it averages with every learner again."""
    found = poll_until(lambda: back_after(tmp, names, victim, resumed), BACK_DEADLINE_S, what, detail=detail)
    for f, (tried, ours) in enumerate(found):
        print(f"fragment {f}: the straggler after SIGCONT "
              f"{[(e['event'], e.get('outcome'), e.get('reason', '')[:50]) for e in ours[:4]]}; back after {tried} rounds")
        assert tried < 3, ours[:tried + 2]


@HEAVY
def test_a_stopped_learner_comes_back_to_the_one_model(tmp_path: Path) -> None:
    n, pauses = 2, (8.0, TTL_S + 6.0)  # the second past the record's lifetime: the partner sees it gone
    names = [f"l{i}" for i in range(n)]
    victim = names[-1]
    ttl = ("--set", f"averaging.record_ttl_s={TTL_S:g}")
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY, *ttl)
        learners = {nm: start(procs, peers, nm, tmp_path, n, *ttl) for nm in names}
        poll_until(lambda: all(committed_rounds(tmp_path / f"{nm}.jsonl") for nm in names), FIRST_ROUND_DEADLINE_S,
                   "every learner's first committed round", detail=lambda: learners[victim].output())
        time.sleep(BEFORE_STOP_S)
        pid = learners[victim].pid
        for i, stop_s in enumerate(pauses):
            learners[victim].send(signal.SIGSTOP)
            poll_until(lambda: process_state(pid) == "T", 10, f"{victim} stopped")  # the fault took effect
            time.sleep(stop_s)
            assert process_state(pid) == "T", "the straggler was not stopped for the whole pause"
            learners[victim].send(signal.SIGCONT)
            resumed = time.time()
            check_back_within_3_rounds(tmp_path, names, victim, resumed, f"{victim} back after a {stop_s:g} s pause",
                                       learners[victim].output)
            time.sleep(BETWEEN_PAUSES_S if i + 1 < len(pauses) else AFTER_BACK_S)
        finals = finish(learners)
    check_identical(finals)


@HEAVY
def test_a_member_that_gave_up_on_a_round_its_partner_committed_commits_it_late(tmp_path: Path) -> None:
    spec = "blind@reading-verdicts:fragment=0:at=6:seconds=8"  # a few rounds in; longer than the commit timeout
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY)
        a = start(procs, peers, "a", tmp_path, 2)
        b = start(procs, peers, "b", tmp_path, 2, "--fault", spec)

        def committed_late_then_again() -> bool:
            log = events(tmp_path / "b.jsonl") if (tmp_path / "b.jsonl").exists() else []
            late = [e["time"] for e in log if e["event"] == "late_commit"]
            return bool(late) and any(e["event"] == "round" and e["outcome"] == "committed" and e["fragment"] == 0
                                      and e["time"] > late[0] for e in log)

        # the fault fires a few rounds in; without a late commit the assertions below say what happened instead
        with contextlib.suppress(WaitTimeout):
            poll_until(committed_late_then_again, FIRST_ROUND_DEADLINE_S + 60, "b's late commit and a round after it")
        finals = finish({"a": a, "b": b})
    assert any(f"FAULT fired: {spec}" in line for _, line in b.stderr), b.output()
    late = [e for e in events(tmp_path / "b.jsonl") if e["event"] == "late_commit"]
    print(f"\nlate commits of b: {late}")
    assert late and all(e["fragment"] == 0 and e["version_after"] == e["version"] + 1 for e in late), late
    # the round b committed late is one a committed on time, with the same result
    a_commits = {(e["version"], e["anchor_hash"]) for e in committed_rounds(tmp_path / "a.jsonl") if e["fragment"] == 0}
    assert {(e["version"], e["anchor_hash"]) for e in late} <= a_commits, (late, a_commits)
    assert finals["b"]["late_commits"][0] == len(late)
    check_identical(finals)
