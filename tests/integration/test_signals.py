"""Every way a person or a service manager stops a peer ends it, leaves nothing running and, where it
had time, publishes its tombstone. Real processes on 127.0.0.1: a bootstrap, learners on the tiny config.

The four paths: SIGINT to the foreground group (Ctrl+C in a terminal), SIGTERM to the group
(``timeout``, ``kill -- -PGID``, service managers), SIGTERM to the main process (``kill PID``), and
SIGKILL to the main process (a crash, the OOM killer). Exit codes: a graceful leave exits 0; SIGKILL
is -9 and publishes nothing (the record expires after its TTL).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Iterator

import pytest

from procs import ProcGroup, Proc, start_bootstrap, start_member

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")]

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
LEAVE_DEADLINE_S = 60.0
"""Generous (a busy 2-core machine): by hand, Ctrl+C ends a learner within a few seconds."""
SIGINT_IGNORED = 1 << (signal.SIGINT - 1)


def ignored_signals(pid: int) -> int:
    """The process's ignored-signal mask (``SigIgn`` in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn line for pid {pid}")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProcGroup, str, Path]]:
    tmp = tmp_path_factory.mktemp("signals")
    with ProcGroup(tmp) as procs:
        yield procs, start_bootstrap(procs, tmp, "--config", TINY), tmp


def start_training_learner(procs: ProcGroup, peers: str, name: str) -> Proc:
    learner = procs.cli("join", "--initial-peers", peers, "--config", TINY, "--name", name, "--steps", "1000000",
                        "--linger", "2", name=name)
    learner.wait_for(r"^learner \S+: ")  # printed once the averagers run: hivemind has touched SIGINT by now
    assert len(learner.session()) >= 3, learner.session()  # main process, DHT process, p2pd, averagers
    return learner


PATHS = {
    # how: (signal, to the group?)
    "sigint-to-group": (signal.SIGINT, True),
    "sigterm-to-group": (signal.SIGTERM, True),
    "sigterm-to-main": (signal.SIGTERM, False),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_learner_stopped_by_a_signal_leaves_gracefully_and_leaves_nothing(swarm: tuple[ProcGroup, str, Path],
                                                                            path: str) -> None:
    procs, peers, _ = swarm
    sig, to_group = PATHS[path]
    learner = start_training_learner(procs, peers, path)
    # hivemind's averager start sets SIGINT to SIG_IGN in the learner's own process: we put our handler back
    assert not ignored_signals(learner.pid) & SIGINT_IGNORED, "the learner ignores SIGINT: Ctrl+C would not stop it"
    if to_group:
        learner.kill_group(sig)
    else:
        learner.send(sig)
    rc = learner.wait_exit(LEAVE_DEADLINE_S)
    assert rc == 0, f"graceful leave exits 0, got {rc}\n{learner.output()}"
    assert learner.wait_for(rf"^left run tiny \({sig.name}\); tombstone published", timeout_s=1)
    learner.wait_no_process_left()
    assert "Traceback" not in "\n".join(line for _, line in learner.stderr), learner.output()


def test_a_learner_killed_with_sigkill_leaves_nothing(swarm: tuple[ProcGroup, str, Path]) -> None:
    procs, peers, _ = swarm
    learner = start_training_learner(procs, peers, "sigkill-to-main")
    learner.send(signal.SIGKILL)  # the main process only, as the OOM killer would
    rc = learner.wait_exit(LEAVE_DEADLINE_S)
    assert rc == -signal.SIGKILL
    assert not any("tombstone" in line for _, line in learner.stdout), "a killed process publishes nothing"
    learner.wait_no_process_left()


@pytest.mark.parametrize("command", ["bootstrap", "heartbeat"])
def test_sigterm_to_the_group_ends_bootstrap_and_heartbeat(swarm: tuple[ProcGroup, str, Path], command: str) -> None:
    procs, peers, tmp = swarm
    if command == "bootstrap":
        peer = procs.cli("bootstrap", "--config", TINY, "--identity", str(tmp / "boot2.id"), name="boot2")
        peer.wait_for(r"^ready")
    else:
        peer = start_member(procs, peers, "hb", "--config", TINY)
        peer.wait_for(r"^joined run ")
    assert len(peer.session()) >= 3, peer.session()  # main process, DHT process, p2pd
    peer.kill_group(signal.SIGTERM)
    rc = peer.wait_exit(LEAVE_DEADLINE_S)
    assert rc == 0, f"{command}: exit {rc}\n{peer.output()}"
    if command == "heartbeat":
        assert peer.wait_for(r"^left run tiny \(SIGTERM\); tombstone published", timeout_s=1)
        rc, look, _ = procs.run("status", "--initial-peers", peers, "--config", TINY, "--json")
        assert rc == 0, look.output()
        snapshot = json.loads(look.stdout[-1][1])
        assert {"hb": "left"}.items() <= {p["name"]: p["status"] for p in snapshot["peers"]}.items(), snapshot
    peer.wait_no_process_left()
