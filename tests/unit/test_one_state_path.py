"""One state path (issue 47): a ``p2p-diloco join`` checkpoint is the weights, the inner optimizer's state and
:meth:`DiLoCo.state_dict`, restored through :meth:`DiLoCo.load_state_dict`; a library loop saves and resumes the
same format (:func:`p2p_diloco.learner.checkpoint.save` / :func:`~p2p_diloco.learner.checkpoint.resume`). Here
each restores the other's, bit for bit: the join learner of ``scripts/bench_overhead.py`` (the real loop, rounds
that commit at once) and the plain loop of ``test_engine.py``."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_diloco import build_model
from p2p_diloco.learner import checkpoint
from scripts_loader import load_script
from test_engine import engine, train

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_script("bench_overhead.py", "bench_overhead")


def same_unit(params_a: dict[str, torch.Tensor], opt_a: Any, params_b: dict[str, torch.Tensor], opt_b: Any) -> None:
    assert params_a.keys() == params_b.keys()
    for n in params_a:
        assert torch.equal(params_a[n].detach(), params_b[n].detach()), n
        sa, sb = opt_a.state.get(params_a[n], {}), opt_b.state.get(params_b[n], {})
        assert sa.keys() == sb.keys() and sa, n
        assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa), n


def test_a_join_checkpoint_resumes_a_plain_loop_and_a_plain_loops_checkpoint_resumes_join(bench: Any,
                                                                                          tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = bench.bench_config(True, "fp32")
    batches = bench.make_batches(cfg, 4)
    step, unit = bench.learner_loop(cfg, CPU, 1, batches, tmp_path / "events.jsonl")
    for _ in range(22):
        step()
    assert all(s.version >= 1 and s.state.momentum for s in unit.slots)
    joined_root = tmp_path / "join"
    checkpoint.save_checkpoint(joined_root, unit.step, *unit.checkpoint_state())  # what join's Checkpointer writes

    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    for d in engine(cfg, model, opt):
        ckpt = checkpoint.resume(d, opt, joined_root)
        assert ckpt.step == unit.step
        assert (d.versions, d.anchor_hashes, d.inner_step, d.tokens) == (
            [s.version for s in unit.slots], [s.anchor_hash for s in unit.slots], unit.step, unit.tokens)
        assert [(s.since_tokens, s.since_steps) for s in d.slots] == [(s.since_tokens, s.since_steps)
                                                                      for s in unit.slots]
        same_unit(unit.params, unit.opt, d.params, opt)

        train(d, model, opt, itertools.cycle(batches), steps=5)  # the plain loop goes on, then saves
        plain_root = checkpoint.save(d, opt, tmp_path / "plain")
        assert plain_root.parent == tmp_path / "plain"
        _, other = bench.learner_loop(cfg, CPU, 1, batches, tmp_path / "events-2.jsonl")
        digest = other.restore(checkpoint.load_checkpoint(tmp_path / "plain"))
        assert digest == checkpoint.model_digest(d.params)
        assert (other.diloco.versions, other.diloco.anchor_hashes, other.step, other.tokens) == (
            d.versions, d.anchor_hashes, d.inner_step, d.tokens)
        same_unit(d.params, opt, other.params, other.opt)
        assert all(s.restored for s in other.slots)
        other.close()
    unit.close()


def test_a_checkpoint_that_does_not_verify_applies_nothing(bench: Any, tmp_path: Path) -> None:
    """Anchors that do not hash to the manifest's are refused before anything is applied or advertised."""
    cfg = bench.bench_config(True, "fp32")
    batches = bench.make_batches(cfg, 4)
    step, unit = bench.learner_loop(cfg, CPU, 1, batches, tmp_path / "events.jsonl")
    for _ in range(22):
        step()
    tensors, meta = unit.checkpoint_state()
    meta = {**meta, "anchor_hashes": ["0" * 16] * len(unit.slots)}
    checkpoint.save_checkpoint(tmp_path / "bad", unit.step, tensors, meta)
    _, other = bench.learner_loop(cfg, CPU, 1, batches, tmp_path / "events-2.jsonl")
    before = (other.diloco.versions, other.diloco.anchor_hashes, other.step)
    with pytest.raises(ValueError, match="do not hash to its manifest's anchor_hashes"):
        other.restore(checkpoint.load_checkpoint(tmp_path / "bad"))
    assert (other.diloco.versions, other.diloco.anchor_hashes, other.step) == before
    other.close()
    unit.close()
