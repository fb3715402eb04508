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


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")
def test_kill_9_of_main_process_leaves_no_orphans(tmp_path: Path) -> None:
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path)
        member = start_member(procs, peers, "victim")
        member.wait_for(r"^joined run ")
        tree = member.session()
        names = [comm for _, comm in tree]
        assert len(tree) >= 3 and "p2pd" in names, tree  # main process, DHT process, p2pd
        os.kill(member.pid, signal.SIGKILL)  # only the main process, as a crash or the OOM killer would
        member.popen.wait(timeout=10)
        deadline = time.monotonic() + ORPHAN_DEADLINE_S
        left = member.session()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = member.session()
        assert not left, f"orphans after kill -9 of the main process: {left}"
