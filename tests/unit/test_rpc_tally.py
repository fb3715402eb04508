"""``scripts/wan/rpc_tally``: the byte tally of hivemind RPCs by DHT key, in a real 2-node DHT, and its
summary by purpose."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


START_TIMEOUT_S = 120.0
"""Two DHTs (each a process with its p2pd) start, store and get: 10-30 s on a busy 2-core machine."""
TALLY_DEADLINE_S = 60.0
"""The tallies are written every 3 s by each DHT process: generous on a busy machine."""

TALLY = Path(__file__).resolve().parents[2] / "scripts" / "wan" / "rpc_tally"

spec = importlib.util.spec_from_file_location("rpc_tally_summarize", TALLY / "summarize.py")
assert spec is not None and spec.loader is not None
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)

TWO_NODES = """
import os
import sys
import time
import hivemind
from hivemind.utils import get_dht_time
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
try:
    assert second.store("tally_probe_key", "x" * 1000, get_dht_time() + 60)
    found = first.get("tally_probe_key", latest=True)
    assert found is not None and found.value == "x" * 1000
    print("stored and found", flush=True)
    while not os.path.exists(sys.argv[1]):  # until the test has seen the tallies (written every 3 s)
        time.sleep(0.1)
finally:
    second.shutdown()
    first.shutdown()
"""


def probe_tallied(out: Path) -> dict[str, list[int]] | None:
    """The summed tallies once they show the probe's value going out in a store and back in a find."""
    if not list(out.glob("*.json")):
        return None
    total = summarize.summarize(out)
    stored = total.get("call:rpc_store store tally_probe_key")
    found = [v for k, v in total.items() if k.startswith("call:rpc_find get tally_probe_key")]
    return total if stored is not None and stored[1] > 1000 and sum(v[2] for v in found) > 1000 else None


def test_without_the_output_variable_nothing_is_patched(tmp_path: Path) -> None:
    code = "import hivemind.dht.node as n; print(n.DHTNode.get_many.__qualname__)"
    env = {k: v for k, v in os.environ.items() if k != "RPC_TALLY_OUT"} | {"PYTHONPATH": str(TALLY)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "DHTNode.get_many"


def test_names_are_grouped_by_purpose() -> None:
    total = {
        "stream_send": [3, 900, 0],
        "call:rpc_find get p2p-diloco.run.demo_peers": [4, 40, 4000],
        "call:rpc_find store p2p-diloco.run.demo_peers": [4, 40, 4000],
        "call:rpc_store store p2p-diloco.run.demo_peers": [4, 1200, 40],
        "call:rpc_find store p2p-diloco_runs": [2, 20, 500],
        "call:rpc_find get demo_sync_clock": [1, 10, 100],
        "call:rpc_find get demo_frag0_commit_f0_vN_H": [1, 10, 90],
        "call:rpc_store store demo_frag0.all_averagers": [1, 50, 5],
        "call:rpc_find get demo_frag0.H": [1, 10, 20],
        "call:rpc_ping ?": [1, 5, 5],
        "call:rpc_values get p2p-diloco.run.demo_peers": [2, 20, 2000],  # a read at the nodes that hold the key
        "call:rpc_group_decision ?": [1, 100, 900],
        "call:rpc_group_verdict ?": [2, 30, 30],
    }
    purposes = summarize.by_purpose(total)
    assert purposes["pseudo-gradients and state downloads"] == {"calls": 3, "bytes": 900}
    assert purposes["swarm reads (peer records)"] == {"calls": 6, "bytes": 6060}
    assert purposes["group offers, decisions and verdicts"] == {"calls": 3, "bytes": 1060}
    assert purposes["our record published"] == {"calls": 8, "bytes": 5280}
    assert purposes["run index entry published"] == {"calls": 2, "bytes": 520}
    assert purposes["sync clock reads"]["bytes"] == 110
    assert purposes["commit verdicts"]["bytes"] == 100
    assert purposes["state-sharing declarations"]["bytes"] == 55
    assert purposes["matchmaking (hivemind)"]["bytes"] == 30
    assert purposes[summarize.OTHER] == {"calls": 1, "bytes": 10}
    assert sum(p["bytes"] for p in purposes.values()) == sum(v[1] + v[2] for v in total.values())


def test_an_empty_folder_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tallies"):
        summarize.summarize(tmp_path)
    assert summarize.main([str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())
