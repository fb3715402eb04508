"""The tests of ``tests/unit/test_rpc_tally.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

import sys
from pathlib import Path
import pytest
from p2p_diloco.core.waiting import poll_until
from procs import EXIT_TIMEOUT_S, ProcGroup
from test_rpc_tally import START_TIMEOUT_S, TALLY, TALLY_DEADLINE_S, TWO_NODES, probe_tallied, summarize

pytestmark = pytest.mark.integration


def test_a_real_dht_store_and_get_are_tallied_by_key(tmp_path: Path, procs: ProcGroup) -> None:
    out, stop = tmp_path / "tally", tmp_path / "stop"
    env = dict(procs.env, RPC_TALLY_OUT=str(out), PYTHONPATH=str(TALLY))
    proc = procs.start([sys.executable, "-c", TWO_NODES, str(stop)], "two-nodes", env)  # killed with its DHTs
    proc.wait_for(r"^stored and found$", timeout_s=START_TIMEOUT_S)
    # the value went out in the store request and came back in the find's answer
    poll_until(lambda: probe_tallied(out), TALLY_DEADLINE_S, "the probe's store and find in the tallies",
               detail=lambda: f"tallies so far: {summarize.summarize(out) if list(out.glob('*.json')) else 'none'}")
    stop.touch()
    assert proc.wait_exit(EXIT_TIMEOUT_S) == 0, proc.output()

