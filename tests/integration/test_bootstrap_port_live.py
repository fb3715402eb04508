"""The tests of ``tests/unit/test_bootstrap_port.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

import signal
from pathlib import Path
import pytest
from procs import ProcGroup, start_bootstrap
from p2p_diloco.net.keptport import port_file

pytestmark = pytest.mark.integration


def test_a_restarted_bootstrap_keeps_its_address(tmp_path: Path, procs: ProcGroup) -> None:
    first = start_bootstrap(procs, tmp_path)  # identity tmp_path/boot.id, no --port
    boot = procs.procs[-1]
    assert port_file(tmp_path / "boot.id").read_text().strip() == first.split("/tcp/")[1].split("/")[0]
    boot.send(signal.SIGTERM)
    assert boot.wait_exit() == 0, boot.output()
    boot.wait_no_process_left()  # its p2pd released the port
    again = start_bootstrap(procs, tmp_path)  # the same identity file
    assert again == first, (first, again)

