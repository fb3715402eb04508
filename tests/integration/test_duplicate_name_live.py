"""The tests of ``tests/unit/test_duplicate_name.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

from pathlib import Path
import pytest
from procs import ProcGroup, start_bootstrap, start_member

pytestmark = pytest.mark.integration


def test_a_second_member_with_a_taken_name_exits_2_with_one_line(tmp_path: Path, procs: ProcGroup) -> None:
    peers = start_bootstrap(procs, tmp_path)
    first = start_member(procs, peers, "dup", ttl_s=3.0)
    holder = first.wait_for(r"^joined run \S+ as dup \((\w+)\)").group(1)
    rc, second, _ = procs.run("heartbeat", "--initial-peers", peers, "--name", "dup", "--ttl", "3")
    errors = [line for _, line in second.stderr if line.startswith("p2p-diloco: error:")]
    assert rc == 2, second.output()
    assert errors == [f"p2p-diloco: error: name 'dup': already taken by live peer {holder[-8:]} (pick another name, "
                      f"or give none for a generated one)"], second.output()
    assert not any(line.startswith("joined run") for _, line in second.stdout), second.output()

