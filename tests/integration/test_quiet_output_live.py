"""The tests of ``tests/unit/test_quiet_output.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

import json
import logging
import math
import re
import signal
from pathlib import Path
import pytest
import torch
from procs import ProcGroup, start_bootstrap
from test_learner_swarm import TINY, events, write_profile
from p2p_diloco.core.waiting import poll_until
from test_quiet_output import SLOWED, SlowReducer

pytestmark = pytest.mark.integration


def test_a_round_cancelled_mid_allreduce_leaves_no_unretrieved_exception(tmp_path: Path) -> None:
    """What SIGTERM does to a round whose all-reduce runs: the host cancels the step, the all-reduce then succeeds
    and hivemind sets the cancelled step's result -- an InvalidStateError that asyncio logged as "Task exception
    was never retrieved" in the averager process (on its stderr: here a log file it inherits)."""
    from hivemind.utils import get_dht_time
    from test_learner_faults import CFG, NAMES, SHAPES, swarm

    from p2p_diloco.averaging.plans import RoundPlan
    from p2p_diloco.sync.fragment import Contribution

    log = tmp_path / "averagers.log"
    handler = logging.FileHandler(log)  # before the averagers fork: they log there too
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        with swarm(tmp_path, (SlowReducer, SlowReducer)) as (leaving, staying):
            start = get_dht_time() + CFG.averaging.window_s
            rounds = []
            for peer, tokens in ((leaving, 100), (staying, 200)):
                contribution = Contribution(fragment=0, version=0, anchor_hash="0" * 16, tokens=tokens, steps=10,
                                            weight=float(tokens), tensors={n: torch.ones(SHAPES[n]) for n in NAMES},
                                            norms={})
                rounds.append(peer.start_round(contribution, RoundPlan(start, CFG.averaging.window_s,
                                                                       due=get_dht_time())))
            poll_until(lambda: SLOWED.value >= 1, 60, "an all-reduce running")
            leaving.cancel()  # what a SIGTERM does
            assert "cancelled" in rounds[0].result(timeout=30).reason
            poll_until(lambda: not math.isnan(leaving.averager.last_allreduce_s.value), 60,
                       "the cancelled round's all-reduce over")
            assert not rounds[1].result(timeout=30).committed  # the leaver withdrew: nobody commits it
        # the averagers are shut down now (their last task replaced, so a stray exception would have been logged)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    text = log.read_text()
    assert "never retrieved" not in text and "InvalidStateError" not in text, text


def test_a_learner_without_v_after_a_kill_9_and_a_sigterm(tmp_path: Path) -> None:
    """Three learners; one is killed with kill -9 while it reduces a part, so the survivors' round fails. The
    quiet survivor (no -v) says so in one WARN line: no INFO line, no ERROR, no traceback; the other (-v) shows
    its round lines. Both then leave on SIGTERM without a traceback."""
    profile = write_profile(tmp_path, "paced")
    common = ("--config", TINY, "--profile", str(profile), "--wait-peers", "3", "--steps", "100000", "--linger", "5",
              "--set", "averaging.allreduce_timeout_s=12")
    spec = "kill@while-reducing:fragment=0"
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", TINY)
        learners = {n: procs.cli("join", "--initial-peers", peers, "--name", n, "--shard", str(i), "--num-shards", "3",
                                 "--events", str(tmp_path / f"{n}.jsonl"), *common, *extra, name=n)
                    for i, (n, extra) in enumerate((("quiet", ()), ("loud", ("-v",)), ("victim", ("--fault", spec))))}
        assert learners["victim"].wait_exit(120) == -signal.SIGKILL, learners["victim"].output()
        quiet, loud = learners["quiet"], learners["loud"]
        quiet.wait_for(r"averaging round failed, discarded: .*partial all-reduce", timeout_s=60, stream="stderr")
        for p in (quiet, loud):
            p.send(signal.SIGTERM)
        for p in (quiet, loud):
            assert p.wait_exit(60) == 0, p.output()
    assert any(f"FAULT fired: {spec}" in line for _, line in learners["victim"].stderr)
    err = {n: [line for _, line in learners[n].stderr] for n in ("quiet", "loud")}
    # what stdout always shows
    finals = [line for _, line in quiet.stdout if line.startswith("final {")]
    assert len(finals) == 1 and json.loads(finals[0][len("final "):])["name"] == "quiet", quiet.output()
    assert any(e["event"] == "round" and e["outcome"] == "discarded" for e in events(tmp_path / "quiet.jsonl"))
    # without -v: warnings only, the failed round in one line, nothing else about it
    failed = [line for line in err["quiet"] if "averaging round failed" in line]
    assert failed and all(" [WARN] " in line for line in failed), err["quiet"]
    assert not [line for line in err["quiet"] if " INFO " in line or re.search(r"round f\d", line)], err["quiet"]
    # the ERROR level, not the word: a failed round's warning may quote a peer's INTERNAL_ERROR answer
    assert not [line for line in err["quiet"] if re.search(r"\[ERROR\]| ERROR ", line) or "Traceback" in line
                or re.search(r"received [\d.]+%", line)], err["quiet"]
    assert all(line.startswith("p2p-diloco: SIGTERM") or " [WARN] " in line or " WARNING " in line
               for line in err["quiet"]), err["quiet"]
    # with -v: the round lines (hivemind's tracebacks too: test_a_failed_round_is_one_warning_line_and_whole_with_v)
    assert any(" INFO p2p_diloco.engine.rounds: round f" in line for line in err["loud"]), err["loud"]
    # SIGTERM: no asyncio or thread traceback on either
    for n, lines in err.items():
        text = "\n".join(lines)
        assert "never retrieved" not in text and "Exception in thread" not in text, f"{n}:\n{text}"

