"""The tests of ``tests/unit/test_bootstrap_port.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

import signal
from pathlib import Path
import pytest
from procs import ProcGroup, start_bootstrap
from p2p_diloco.net.keptport import port_file

pytestmark = pytest.mark.integration


KEPT_PORT_TAKEN = "cannot listen again on port"
"""with_kept_port's WARNING: something else took the kept port while the bootstrap was down."""


def test_a_restarted_bootstrap_keeps_its_address(tmp_path: Path, procs: ProcGroup) -> None:
    """A restart with the same identity file listens on the same port, so the whole address others pasted still
    works. Another process on this busy machine (a test beside this one) may take the port while the bootstrap is
    down -- an OS-chosen port is in the range connections draw their own ports from; such a restart must say so
    (a WARNING) and then keep its new address at the next restart. Up to three restarts: at least one whose kept
    port stayed free, and every one either kept its address or said why not."""
    address = start_bootstrap(procs, tmp_path)  # identity tmp_path/boot.id, no --port
    kept = 0
    for _ in range(3):
        boot = procs.procs[-1]
        assert port_file(tmp_path / "boot.id").read_text().strip() == address.split("/tcp/")[1].split("/")[0]
        boot.send(signal.SIGTERM)
        assert boot.wait_exit() == 0, boot.output()
        boot.wait_no_process_left()  # its p2pd released the port
        again = start_bootstrap(procs, tmp_path)  # the same identity file
        if again == address:
            kept += 1
            break
        procs.procs[-1].wait_for(KEPT_PORT_TAKEN, 10.0, stream="stderr")  # a new address only with the reason said
        address = again
    assert kept == 1, "every restart found its kept port taken"
