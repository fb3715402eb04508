"""Real processes on 127.0.0.1: bootstrap + heartbeat members, seen through ``status``.

Times are measured and printed (run with ``-s`` to see them), never asserted: the test machine
is shared. Deadlines are generous and explicit.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from procs import ProcGroup, StatusWatcher, live_names, start_bootstrap, start_member

pytestmark = pytest.mark.integration

TTL_S = 3.0
RECORD_FIELDS = {
    "run_id", "protocol_version", "config_hash", "software_version", "peer_id", "name", "profile", "addresses",
    "state", "inner_step", "tokens", "tokens_per_s", "fragment_versions", "last_sync_time", "bytes_sent",
    "bytes_received", "loss", "time", "ttl_s",
}


def test_members_appear_disappear_and_leave(tmp_path: Path) -> None:
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path)
        watcher = StatusWatcher(procs.cli("status", "--initial-peers", peers, "--watch", "--json", "--interval", "0.5",
                                    name="watch"))
        members = {name: start_member(procs, peers, name, ttl_s=TTL_S) for name in ("m1", "m2", "m3")}
        for m in members.values():
            m.wait_for(r"^joined run ")
        all_up = max(m.line_time(r"^joined run ") for m in members.values())
        snap, t_listed = watcher.until(lambda s: live_names(s) == {"m1", "m2", "m3"}, 60, "3 live members")
        print(f"\nstatus --watch listed all 3 members {max(0.0, t_listed - all_up):.1f} s after the last one joined")
        # every record field is in the JSON
        for p in snap["peers"]:
            assert RECORD_FIELDS <= set(p), RECORD_FIELDS - set(p)
        assert snap["summary"]["live"] == 3 and snap["summary"]["consensus"] is None  # heartbeats train nothing: "-"

        # a cold status call, separately: valid JSON with the same 3 members
        rc, proc, wall_s = procs.run("status", "--initial-peers", peers, "--json")
        assert rc == 0, proc.output()
        cold = json.loads(proc.stdout[-1][1])
        assert live_names(cold) == {"m1", "m2", "m3"}
        print(f"cold status: {wall_s:.1f} s wall (process start to exit); inside: {cold['timings_s']}")

        # kill -9 (the whole peer: CLI, DHT process, p2pd): gone within its TTL (+ heartbeat slack)
        t_kill = time.monotonic()
        members["m1"].kill_group(signal.SIGKILL)
        snap, t_gone = watcher.until(lambda s: "m1" not in live_names(s), TTL_S + 30, "m1 gone")
        print(f"kill -9: m1 disappeared from status {t_gone - t_kill:.1f} s after the kill (ttl {TTL_S:g} s)")
        assert live_names(snap) == {"m2", "m3"}
        assert "m1" not in {p["name"] for p in snap["peers"] if p["status"] == "left"}  # a crash is no graceful leave

        # SIGTERM: graceful leave, the tombstone says "left" at the next look
        members["m2"].send(signal.SIGTERM)
        assert members["m2"].wait_exit() == 0, members["m2"].output()
        members["m2"].wait_for(r"^left run .*tombstone published")
        t_left = time.monotonic()
        snap, t_seen = watcher.until(lambda s: any(p["name"] == "m2" and p["status"] == "left" for p in s["peers"]),
                                     30, "m2 left")
        print(f"SIGTERM: m2 shown as left {max(0.0, t_seen - t_left):.1f} s after it exited")
        assert live_names(snap) == {"m3"}
        assert [name for name, _, _ in snap["summary"]["left"]] == ["m2"]
