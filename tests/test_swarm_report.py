"""``p2p-diloco swarm``'s report: the data-parallel reference lookup (pure, no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2p_diloco.config import load_config
from p2p_diloco.swarm_run import load_reference, reference_at, reference_key

CURVE = [{"tokens": 0, "eval_loss": 5.5}, {"tokens": 1000, "eval_loss": 3.0}, {"tokens": 3000, "eval_loss": 2.0}]


def write(folder: Path, cfg_hash: str, **extra: object) -> Path:
    path = folder / f"dp-{cfg_hash}.json"
    path.write_text(json.dumps({"reference_key": cfg_hash, "curve": CURVE, "command": "python scripts/x.py", **extra}))
    return path


def test_reference_is_interpolated_at_the_swarms_tokens(tmp_path: Path) -> None:
    write(tmp_path, "abc")
    ref = load_reference("abc", tmp_path)
    assert ref is not None
    assert reference_at(ref, 1000)["eval_loss"] == pytest.approx(3.0)
    assert reference_at(ref, 2000)["eval_loss"] == pytest.approx(2.5)
    assert reference_at(ref, 3200)["eval_loss"] == pytest.approx(2.0)  # within 10% past the end: its last point
    beyond = reference_at(ref, 4000)
    assert beyond["eval_loss"] is None and "stops at 3,000 tokens" in beyond["why"]
    assert reference_at(ref, 0) is None


def test_missing_or_mismatched_reference(tmp_path: Path) -> None:
    assert load_reference("nothing", tmp_path) is None
    assert reference_at(None, 1000) is None
    write(tmp_path, "abc")
    (tmp_path / "dp-abc.json").rename(tmp_path / "dp-def.json")  # a file under another config's name
    with pytest.raises(ValueError, match="not a reference curve for reference key def"):
        load_reference("def", tmp_path)


def test_reference_key_follows_what_data_parallel_training_depends_on() -> None:
    base = reference_key(load_config(None, []))
    for outer_only in ("outer.sync_every=7", "outer.codec=fp16", "averaging.window_s=3.0", "inner.total_steps=77"):
        assert reference_key(load_config(None, [outer_only])) == base, outer_only
    for changes in ("model.n_embd=32", "inner.lr=0.01", "run.seed=3", "sim.learners=2", "data.max_bytes=100000"):
        assert reference_key(load_config(None, [changes])) != base, changes


def test_local_swarm_clears_a_previous_runs_logs(tmp_path: Path) -> None:
    from p2p_diloco.launcher import LocalSwarm

    logs = tmp_path / "logs"
    (logs / "baseline").mkdir(parents=True)
    for name in ("l0.jsonl", "l0.log", "boot.log", "baseline/l0.jsonl", "notes.txt"):
        (logs / name).write_text("old\n")
    with LocalSwarm(logs):
        pass
    left = sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file())
    assert left == ["baseline/l0.jsonl", "notes.txt"]  # its own folder's run files only; a nested run clears its own
