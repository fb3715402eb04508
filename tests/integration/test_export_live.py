"""The tests of ``tests/unit/test_export.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

import json
from pathlib import Path
import pytest
import torch
from p2p_diloco.core.config import load_config
from test_export import LLAMA_TINY, TOLERANCE, _batch, _export, _reference_logits

pytestmark = pytest.mark.integration


def test_a_swarm_checkpoint_exports_and_its_events_reach_tensorboard(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Two real learners on llama-tiny with --checkpoint-dir and --metrics tensorboard:DIR: the final checkpoint
    records the config, exports without --config, and the export is the anchors the learner ended with."""

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    from procs import ProcGroup, start_bootstrap

    from p2p_diloco.learner.checkpoint import load_checkpoint

    paced = tmp_path / "paced.toml"  # 40 steps in >= 6 s: rounds and evaluations happen while training
    paced.write_text('name = "paced"\nslowdown = 1.0\nmin_step_s = 0.15\nthreads = 1\n')
    with ProcGroup(tmp_path) as procs:
        peers = start_bootstrap(procs, tmp_path, "--config", str(LLAMA_TINY))
        learners = {n: procs.cli("join", "--initial-peers", peers, "--config", str(LLAMA_TINY), "--name", n,
                                 "--wait-peers", "2", "--linger", "10", "--eval-every", "1", "--profile", str(paced),
                                 "--checkpoint-dir", str(tmp_path / f"ckpt-{n}"),
                                 "--events", str(tmp_path / f"{n}.jsonl"), "--metrics", f"tensorboard:{tmp_path / n}",
                                 name=n) for n in ("a", "b")}
        finals = {n: json.loads(p.wait_for(r"^final (\{.*\})$", timeout_s=240).group(1)) for n, p in learners.items()}
        for p in learners.values():
            assert p.wait_exit(60) == 0, p.output()
    ckpt = load_checkpoint(tmp_path / "ckpt-a")
    assert ckpt.manifest["anchor_hashes"] == finals["a"]["anchor_hashes"] and "config" in ckpt.manifest
    rc, _, err = _export(capsys, "--checkpoint", str(tmp_path / "ckpt-a"), "--out", str(tmp_path / "out"))
    assert rc == 0, err
    cfg = load_config(LLAMA_TINY)
    anchors = {k[len("anchor/"):]: t for k, t in ckpt.tensors.items() if k.startswith("anchor/")}
    x = _batch(cfg)
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
        got = exported(input_ids=x).logits
    diff = (got - _reference_logits(cfg, anchors, x)).abs().max().item()
    print(f"\nswarm checkpoint export: max abs logit difference {diff:.3g}; finals {finals['a']['committed']}")
    assert diff <= TOLERANCE
    acc = EventAccumulator(str(tmp_path / "a"))
    acc.Reload()
    committed = acc.Scalars("rounds/committed")
    assert committed[-1].value == sum(finals["a"]["committed"])
    assert {"train/loss", "eval/loss", "rounds/group_size", "comm/bytes_sent"} <= set(acc.Tags()["scalars"])

