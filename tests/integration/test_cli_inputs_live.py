"""The tests of ``tests/unit/test_cli_inputs.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

import json
from pathlib import Path
import pytest
from procs import ProcGroup, start_bootstrap
from test_cli_inputs import TINY

pytestmark = pytest.mark.integration


def test_a_learner_that_fails_after_joining_publishes_its_tombstone(tmp_path: Path, procs: ProcGroup) -> None:
    """A real learner fails after joining (an injected error at its 3rd inner step, as a bug would): it
    publishes its tombstone before its DHT stops, so the run shows it as left at once (not live for a TTL,
    turning the next joiner away), and nothing of it is left running."""
    spec = "raise@inner-step:at=3"
    peers = start_bootstrap(procs, tmp_path, "--config", TINY)
    doomed = procs.cli("join", "--initial-peers", peers, "--config", TINY, "--name", "doomed", "--linger", "1",
                       "--fault", spec, name="doomed")
    assert doomed.wait_exit(180) == 1, doomed.output()
    assert any(f"FAULT fired: {spec}" in line for _, line in doomed.stderr), doomed.output()
    doomed.wait_for(r"^leaving after an error \(FaultInjected\); tombstone published", timeout_s=1)
    doomed.wait_no_process_left()
    rc, status, _ = procs.run("status", "--initial-peers", peers, "--config", TINY, "--json", timeout_s=90)
    assert rc == 0, status.output()
    data = json.loads(status.stdout[-1][1])
    states = [p["status"] for p in data["peers"] if p["name"] == "doomed"]
    assert states == ["left"], data["peers"]

