"""kill -9 of a peer's main process takes its hivemind DHT process and p2pd down with it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from procs import ORPHAN_DEADLINE_S, ProcGroup, start_bootstrap, start_member

pytestmark = pytest.mark.integration

REAP_TIMEOUT_S = 10.0
"""How long the killed main process may take to be reaped."""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")
def test_kill_9_of_main_process_leaves_no_orphans(tmp_path: Path, procs: ProcGroup) -> None:
    peers = start_bootstrap(procs, tmp_path)
    member = start_member(procs, peers, "victim")
    member.wait_for(r"^joined run ")
    tree = member.session()
    names = [comm for _, comm in tree]
    assert len(tree) >= 3 and "p2pd" in names, tree  # main process, DHT process, p2pd
    os.kill(member.pid, signal.SIGKILL)  # only the main process, as a crash or the OOM killer would
    member.popen.wait(timeout=REAP_TIMEOUT_S)
    member.wait_no_process_left(ORPHAN_DEADLINE_S)  # the kernel's PDEATHSIG takes the helpers down
