"""kill -9 of a peer's main process takes its hivemind DHT process and p2pd down with it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from procs import ProcGroup, start_bootstrap, start_member

pytestmark = pytest.mark.integration

ORPHAN_DEADLINE_S = 20.0


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every live (non-zombie) process in a process group, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            found.append((int(entry.name), comm))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")
def test_kill_9_of_main_process_leaves_no_orphans(tmp_path: Path) -> None:
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path)
        member = start_member(procs, peers, "victim")
        member.wait_for(r"^joined run ")
        tree = _group_members(member.pgid)
        names = [comm for _, comm in tree]
        assert len(tree) >= 3 and "p2pd" in names, tree  # main process, DHT process, p2pd
        os.kill(member.pid, signal.SIGKILL)  # only the main process, as a crash or the OOM killer would
        member.popen.wait(timeout=10)
        deadline = time.monotonic() + ORPHAN_DEADLINE_S
        left = _group_members(member.pgid)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _group_members(member.pgid)
        assert not left, f"orphans after kill -9 of the main process: {left}"
