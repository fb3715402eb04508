"""A library learner that calls ``diloco.step(tokens=1.5)`` in the middle of a run, beside a ``p2p-diloco join``
learner: the call raises ``TypeError`` and counts nothing, so no malformed round metadata reaches the wire, and the
CLI learner's rounds with it keep committing (before the fix, every one of its rounds was discarded: "gathered
tokens must be a non-negative int, got 2561.5")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from procs import ProcGroup, start_bootstrap
from test_api_examples import clock_config
from test_learner_swarm import events, final_summary, write_profile

pytestmark = pytest.mark.integration

TRAIN_S = 40.0
"""Seconds each learner trains: about 5 rounds of each fragment at the clock's 8 s period."""
REFUSE_AFTER_S = 12.0
"""Seconds into its training at which the library learner makes the bad call (rounds have committed by then)."""
DEADLINE_S = 180.0
"""Start to the ``final`` line, generous: start-up, training, final rounds and the linger on a shared machine."""

LEARNER = """
import json, sys, time
import torch
import torch.nn.functional as F
from p2p_diloco import DiLoCo, SyncOptions, Swarm, build_model, load_config, training_batches

peers, config, train_s, refuse_after_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
cfg = load_config(config)
torch.set_num_threads(1)
refused = None
with Swarm.join([peers], cfg, name="api") as swarm:
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    batches = training_batches(cfg, seed=3)
    with DiLoCo(model, opt, swarm, SyncOptions(wait_peers=2, linger_s=30.0)) as diloco:
        diloco.start()
        t0 = time.monotonic()
        while time.monotonic() < t0 + train_s:
            x, y = next(batches)
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diloco.step(tokens=x.numel(), loss=loss.detach())
            if refused is None and time.monotonic() > t0 + refuse_after_s:
                tokens_before = diloco.tokens
                try:
                    diloco.step(tokens=1.5)
                except TypeError as e:
                    refused = {"error": str(e), "time": diloco.dht_time(), "versions": diloco.versions,
                               "tokens_unchanged": diloco.tokens == tokens_before}
                    print("refused " + json.dumps(refused), flush=True)
            time.sleep(0.05)  # paced like the CLI learner's profile
print("final " + json.dumps({"peer_id": swarm.peer_id, "versions": diloco.versions,
                             "anchor_hashes": diloco.anchor_hashes, "refused": refused}), flush=True)
"""


def test_a_float_token_count_is_refused_and_the_peers_rounds_keep_committing(tmp_path: Path) -> None:
    config = clock_config(tmp_path)
    profile = write_profile(tmp_path, "paced", min_step_s=0.05)
    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", str(config))
        cli = procs.cli("join", "--initial-peers", peers, "--config", str(config), "--name", "cli",
                        "--events", str(tmp_path / "cli.jsonl"), "--profile", str(profile), "--wait-peers", "2",
                        "--max-time", str(TRAIN_S + 10), "--linger", "30", name="cli")
        api = procs.start([sys.executable, str(script), peers, str(config), str(TRAIN_S), str(REFUSE_AFTER_S)],
                          name="api")
        finals = {n: final_summary(p, timeout_s=DEADLINE_S) for n, p in (("cli", cli), ("api", api))}
        for p in (cli, api):
            assert p.wait_exit(60) == 0, p.output()
    refused = finals["api"]["refused"]
    assert refused is not None, "the library learner never made the bad call"
    assert refused["error"].startswith("tokens must be a non-negative int, got float 1.5"), refused
    assert refused["tokens_unchanged"], refused
    rounds = [e for e in events(tmp_path / "cli.jsonl") if e["event"] == "round"]
    after = [e for e in rounds if e["time"] > refused["time"]]
    with_api = [e for e in after if e["outcome"] == "committed" and finals["api"]["peer_id"] in e["peers"]]
    assert len(with_api) >= 2, f"the CLI learner's rounds with the library learner stopped committing: {after}"
    malformed = [e for e in rounds if "gathered" in str(e.get("reason", ""))]
    assert not malformed, malformed
    assert finals["cli"]["versions"] == finals["api"]["versions"], finals
    assert finals["cli"]["anchor_hashes"] == finals["api"]["anchor_hashes"], finals
