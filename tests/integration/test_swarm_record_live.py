"""A joined :class:`~p2p_diloco.Swarm` keeps its record alive on its own (issue 49): a user builds the model and
loads the data after joining, which may take longer than a record's TTL, before ``DiLoCo.start()`` starts the
status thread. Its name must stay its own all that time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from procs import ProcGroup

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECORD_TTL_S = 9.0
"""The run's record TTL (30 s in llama-tiny; shortened so that the test sits out two of them in 20 s)."""
IDLE_S = 2 * RECORD_TTL_S + 2
"""Seconds the first Swarm sits joined without a DiLoCo: past two record TTLs."""

IDLE_SWARM = """
import json, sys, time
from hivemind.utils import get_dht_time
from p2p_diloco import Swarm, load_config
from p2p_diloco.net.membership import read_swarm

cfg = load_config(sys.argv[1], [f"averaging.record_ttl_s={sys.argv[3]}"])
with Swarm.bootstrap(cfg, name="idle") as first:
    time.sleep(float(sys.argv[2]))  # building the model, loading the data
    with Swarm.join(first.addresses, cfg, name="watcher") as watcher:
        ages = {v.record.name: round(get_dht_time() - v.record.time, 1)
                for v in read_swarm(watcher.joined.dht, watcher.local).live()}
    try:
        Swarm.join(first.addresses, cfg, name="idle").close()
        refusal = None
    except ValueError as e:
        refusal = str(e)
    print("result " + json.dumps({"ages": ages, "refusal": refusal, "ttl_s": cfg.averaging.record_ttl_s}), flush=True)
"""


def test_a_swarm_left_idle_keeps_its_record_fresh_and_its_name(tmp_path: Path) -> None:
    script = tmp_path / "idle_swarm.py"
    script.write_text(IDLE_SWARM)
    with ProcGroup(tmp_path) as procs:
        proc = procs.start([sys.executable, str(script), str(REPO / "configs" / "llama-tiny.toml"), str(IDLE_S),
                            str(RECORD_TTL_S)],
                           name="idle")
        seen = json.loads(proc.wait_for(r"^result (\{.*\})$", timeout_s=IDLE_S + 120).group(1))
        assert proc.wait_exit(30) == 0, proc.output()
    print(seen)
    assert "idle" in seen["ages"], seen  # still live as another peer reads the run after two TTLs
    assert seen["ages"]["idle"] <= seen["ttl_s"] / 3 + 5, seen  # refreshed about every ttl/3 s
    assert seen["refusal"] is not None and "name 'idle': already taken by live peer" in seen["refusal"], seen
