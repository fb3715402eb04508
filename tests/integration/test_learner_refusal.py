"""A learner with another config hash, or without the private swarm's key, is refused at join; the
running learner does not notice (it keeps training, then leaves gracefully on SIGTERM). Times printed,
not asserted."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from procs import ProcGroup
from test_learner_swarm import TINY, final_summary, write_profile

pytestmark = pytest.mark.integration


def test_incompatible_or_keyless_learners_are_refused(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, "paced")
    with ProcGroup(tmp_path) as procs:
        rc, proc, _ = procs.run("keygen", "--out", "swarm.secret")
        assert rc == 0, proc.output()
        boot = procs.cli("bootstrap", "--identity", str(tmp_path / "boot.id"), "--config", TINY, "--swarm-key",
                         "swarm.secret", name="boot")
        peers = boot.wait_for(r"^initial peers: (\S+)").group(1)
        member = procs.cli("join", "--initial-peers", peers, "--config", TINY, "--swarm-key", "swarm.secret",
                           "--name", "member", "--profile", str(profile), "--steps", "100000", "--max-time", "120",
                           "--linger", "1", "-v", name="member")  # -v: its round lines (INFO) are awaited below
        member.wait_for(r"^learner member: ")

        other_config = procs.cli("join", "--initial-peers", peers, "--config", TINY, "--swarm-key", "swarm.secret",
                                 "--set", "outer.lr=0.6", "--name", "other-config", name="other-config")
        keyless = procs.cli("join", "--initial-peers", peers, "--config", TINY, "--name", "keyless", name="keyless")
        for proc, expected in ((other_config, "config hash differs"), (keyless, "swarm key mismatch")):
            assert proc.wait_exit(90) == 2, proc.output()
            errors = [line for _, line in proc.stderr if line.startswith("p2p-diloco:")]
            assert len(errors) == 1 and expected in errors[0], proc.output()
            assert not any(line.startswith("learner ") for _, line in proc.stdout), proc.output()
            print(f"\n{proc.name}: refused {proc.stderr[-1][0] - proc.started_at:.1f} s after start: {errors[0]}")

        member.wait_for(r"round f\d v0 discarded", timeout_s=90, stream="stderr")  # alone: its rounds find no group
        member.send(signal.SIGTERM)  # graceful leave: the loop stops, a final line, a tombstone
        summary = final_summary(member, timeout_s=60)
        assert member.wait_exit(30) == 0, member.output()
        member.wait_for(r"^left run tiny \(SIGTERM\); tombstone published")
        # alone, it trained on and its rounds found no group (discarded, never applied alone)
        assert summary["steps"] > 0 and sum(summary["committed"]) == 0 and sum(summary["discarded"]) >= 1, summary
        assert summary["versions"] == [0, 0] and summary["blocked_share"] < 0.05, summary
