"""The in-process simulator: exact reductions, weighting by progress, departures and rejoins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2p_diloco.core import data
from p2p_diloco.sim import simulator as sim
from p2p_diloco.core.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> Config:
    return load_config(ROOT / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def splits(tiny: Config) -> data.Splits:
    torch.set_num_threads(1)
    return data.split_corpus(data.load_corpus(tiny.data), tiny.sim.learners, tiny.data.eval_fraction)


def test_one_learner_with_identity_outer_step_is_plain_training(tiny: Config, splits: data.Splits) -> None:
    """outer lr 1, no momentum, alpha 0, fp32: anchor <- theta each round, so DiLoCo(K=1) == AdamW alone."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        "sim.learners=1", "outer.lr=1.0", "outer.momentum=0.0", "outer.alpha=0.0", "outer.overlap=0",
        "outer.codec=fp32", "outer.merge=mean", "outer.sync_every=5"])
    one = data.Splits(eval=splits.eval, shards=splits.shards[:1])
    diloco = sim.run(cfg, one, "diloco")
    single = sim.run(cfg, one, "single")
    assert diloco.tokens == single.tokens
    # fragment 0 at steps 5..40 (8 rounds), fragment 1 at 7..37 (7) plus its final flush
    assert diloco.rounds == 16
    assert abs(diloco.final_eval_loss - single.final_eval_loss) < 1e-4


def test_diloco_learns_and_saves_bytes(tiny: Config, splits: data.Splits) -> None:
    r = sim.run(tiny, splits, "diloco")
    assert r.curve[0]["eval_loss"] > 5.0  # untrained: about ln 256
    assert r.final_eval_loss < r.curve[0]["eval_loss"] - 1.5
    assert r.tokens == tiny.sim.learners * tiny.inner.total_steps * tiny.inner.batch_size * tiny.model.block_size
    assert r.contributed_tokens == r.tokens  # no failures: every token reached the anchors
    # H=10 and int4 (about 4.2 bits): roughly 10 * 32 / 4.2 = 76x fewer bytes than fp32 data-parallel
    assert 60 < r.dp_fp32_bytes / r.bytes_sent < 80


def test_stop_after_ticks_is_a_prefix_of_the_full_run(tiny: Config, splits: data.Splits) -> None:
    """A time-limited networked run stops early with the LR schedule of the full run: so does the simulator."""
    short = sim.Simulator(tiny, splits, stop_after_ticks=12).run()
    assert short.tokens == tiny.sim.learners * 12 * tiny.inner.batch_size * tiny.model.block_size
    assert all(m.total_steps == tiny.inner.total_steps for m in sim.Simulator(tiny, splits, stop_after_ticks=12).learners)
    assert short.final_eval_loss < short.curve[0]["eval_loss"]


def test_stop_after_ticks_past_the_schedule_goes_on_at_the_lr_floor(tiny: Config, splits: data.Splits) -> None:
    """A networked learner with no step cap trains past ``inner.total_steps`` (its LR at the floor): the
    simulator it is compared with must reach the same steps (it used to stop at the schedule's end)."""
    ticks = tiny.inner.total_steps + 7
    longer = sim.Simulator(tiny, splits, stop_after_ticks=ticks)
    assert all(m.total_steps == tiny.inner.total_steps for m in longer.learners)  # the schedule is unchanged
    r = longer.run()
    assert r.tokens == tiny.sim.learners * ticks * tiny.inner.batch_size * tiny.model.block_size
    assert all(m.steps == ticks for m in longer.learners)


def test_references(tiny: Config, splits: data.Splits) -> None:
    dp = sim.run(tiny, splits, "data-parallel")
    single = sim.run(tiny, splits, "single")
    assert dp.tokens == tiny.sim.learners * single.tokens
    assert dp.final_eval_loss < single.final_eval_loss  # 3x the data at the same steps


def test_slow_learner_weight_share_tracks_its_tokens(tiny: Config, splits: data.Splits) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["sim.speeds=[1.0, 1.0, 0.3333]"])
    r = sim.run(cfg, splits, "diloco")
    slow_share = sum(s[2] for s in r.weight_shares) / len(r.weight_shares)
    assert r.token_shares[2] == pytest.approx(1 / 7, rel=0.05)
    assert slow_share == pytest.approx(r.token_shares[2], rel=0.2)
    uniform = sim.run(load_config(ROOT / "configs" / "tiny.toml",
                                  ["sim.speeds=[1.0, 1.0, 0.3333]", "outer.weighting=uniform"]), splits, "diloco")
    assert sum(s[2] for s in uniform.weight_shares) / len(uniform.weight_shares) > 0.3


def test_leave_and_rejoin(tiny: Config, splits: data.Splits) -> None:
    events = [sim.Event(12, 2, "leave"), sim.Event(26, 2, "join")]
    r = sim.run(tiny, splits, "diloco", events=events)
    # rounds at ticks 15 and 20, 25 (fragments 1, 0, 1) happen without learner 2
    absent = [s for s in r.weight_shares if s[2] == 0.0]
    assert len(absent) >= 3
    assert r.weight_shares[-1][2] > 0  # it contributes again after rejoining
    assert r.contributed_tokens < r.tokens  # the work it had not synced when it left is lost
    assert torch.isfinite(torch.tensor(r.final_eval_loss)) and r.final_eval_loss < r.curve[0]["eval_loss"] - 1.0


def test_dropped_contributions_are_kept_for_the_next_round(tiny: Config, splits: data.Splits) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["sim.drop_prob=0.4"])
    r = sim.run(cfg, splits, "diloco")
    assert any(0 < sum(1 for w in s if w > 0) < 3 for s in r.weight_shares)  # some rounds lacked someone
    assert r.contributed_tokens == r.tokens  # a lost contribution is delivered later, not lost
    assert r.final_eval_loss < r.curve[0]["eval_loss"] - 1.0


def test_unknown_event_kind(tiny: Config, splits: data.Splits) -> None:
    with pytest.raises(ValueError, match="unknown event kind"):
        sim.run(tiny, splits, "diloco", events=[sim.Event(3, 0, "explode")])


def test_llama_tiny_trains_and_keeps_its_tied_embedding(splits: data.Splits) -> None:
    """configs/llama-tiny.toml (a transformers LlamaForCausalLM, tied embeddings): the loss falls, and the
    anchors written back into every replica keep the output head tied to the input embedding."""
    cfg = load_config(ROOT / "configs" / "llama-tiny.toml")
    s = sim.Simulator(cfg, splits)
    r = s.run()
    assert r.curve[0]["eval_loss"] > 5.0  # untrained: about ln 256
    assert r.final_eval_loss < r.curve[0]["eval_loss"] - 1.5
    assert r.rounds > 0 and r.contributed_tokens == r.tokens
    for model in [s.global_model, *(m.model for m in s.learners)]:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in s.anchor  # the shared tensor is averaged once, under its first name
    assert sum(f.numel for f in s.fragments) == sum(p.numel() for p in s.global_model.parameters())


def test_cli_sim_reports_json() -> None:
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "p2p_diloco.cli.main", "sim", "--config", str(ROOT / "configs" / "tiny.toml"),
                        "--set", "inner.total_steps=12", "--set", "inner.warmup_steps=2", "--set", "outer.sync_every=5",
                        "--quiet", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "diloco" and out["rounds"] > 0 and out["final_eval_loss"] < out["curve"][0]["eval_loss"]
    bad = subprocess.run([sys.executable, "-m", "p2p_diloco.cli.main", "sim", "--data", "/nonexistent/corpus"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "does not exist" in bad.stderr
