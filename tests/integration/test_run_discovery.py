"""Real processes on 127.0.0.1: a peer given no config finds the run that is there.

``bootstrap --config configs/tiny.toml`` announces run ``tiny`` and publishes its config; a
``heartbeat`` given only the address fetches that config (hash verified) and joins ``tiny``;
``status`` given only the address shows it. With a second run in the same DHT, a config-less
join is refused with one line that lists both runs, and ``--run-id`` picks one. Times are
printed (``-s``), never asserted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from procs import ProcGroup, live_names, start_member

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.toml")
DEMO = str(REPO / "configs" / "demo.toml")


def test_a_peer_without_config_finds_the_run_that_is_there(tmp_path: Path) -> None:
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.identity import config_hash

    tiny_hash = config_hash(load_config(TINY))
    with ProcGroup(tmp_path) as procs:
        boot = procs.cli("bootstrap", "--identity", str(tmp_path / "boot.id"), "--config", TINY, name="boot")
        peers = boot.wait_for(r"^initial peers: (\S+)").group(1)
        boot.wait_for(rf"^run tiny \(config hash {tiny_hash}\) announced in the DHT$")
        pasted = boot.wait_for(r"^  p2p-diloco join (.+)$").group(1)
        assert pasted == f"--initial-peers {peers}", pasted  # works when pasted: no --config needed
        boot.wait_for(r"^  p2p-diloco status --initial-peers \S+$")

        member = start_member(procs, peers, "m1")  # heartbeat with no --config
        member.wait_for(rf"^config: fetched run tiny \(hash {tiny_hash}\) from the DHT$")
        member.wait_for(rf"^joined run tiny as m1 \(\w+\); config hash {tiny_hash}; 0 other live peers")

        # a second run announced in the same DHT, while status (no flags) looks at the one that is live
        boot2 = procs.cli("bootstrap", "--identity", str(tmp_path / "boot2.id"), "--config", DEMO,
                          "--initial-peers", peers, name="boot2")
        rc, status, wall_s = procs.run("status", "--initial-peers", peers, "--json")
        assert rc == 0, status.output()
        [line] = [line for _, line in status.stdout]
        snap = json.loads(line)
        assert snap["run_id"] == "tiny" and snap["config_hash"] == tiny_hash, snap
        assert live_names(snap) == {"m1"} and snap["summary"]["live"] == 1 and snap["summary"]["consensus"] is None, snap
        tiny = next(r for r in snap["runs_detail"] if r["run_id"] == "tiny")
        assert (tiny["live"], tiny["announced"]) == (1, 1), snap["runs_detail"]  # the bootstrap is no member
        print(f"\nstatus without flags: {wall_s:.1f} s wall; runs {[r['run_id'] for r in snap['runs_detail']]}")

        boot2.wait_for(r"^run demo \(config hash \w+\) announced in the DHT$")
        other = start_member(procs, peers, "m2", "--run-id", "demo")
        other.wait_for(r"^config: fetched run demo ")
        other.wait_for(r"^joined run demo as m2 ")

        # two live runs: a config-less join is refused with one line listing them (exit 2)
        rc, lost, wall_s = procs.run("heartbeat", "--initial-peers", peers, "--name", "lost")
        assert rc == 2, lost.output()
        errors = [line for _, line in lost.stderr if line.startswith("p2p-diloco:")]
        assert len(errors) == 1, lost.output()
        assert re.fullmatch(r"p2p-diloco: error: runs in this DHT: demo \(1 live, announced by a bootstrap\), "
                            r"tiny \(1 live, announced by a bootstrap\); pick one with --run-id ID or --config FILE",
                            errors[0]), errors[0]
        assert not any(line.startswith("joined run") for _, line in lost.stdout), lost.output()
        print(f"refused after {wall_s:.1f} s: {errors[0]}")
