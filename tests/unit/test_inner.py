"""The inner schedule (warm-up + cosine by steps, and the time-budgeted variant the swarm uses) and our
AdamW, which must be torch.optim.AdamW bit for bit without importing torch._dynamo."""

from __future__ import annotations

import math
from typing import Any

import pytest

from p2p_diloco.core.inner import lr_at, schedule_step, swarm_tokens


def test_lr_warmup_then_cosine_golden() -> None:
    assert lr_at(0, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 100, 10, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 100, 10, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(55, 100, 10, 1.0, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(500, 100, 10, 1.0, 0.1) == pytest.approx(0.1)  # past the end: stays at the floor


def test_schedule_step_without_another_budget_is_the_step() -> None:
    for step in (0, 5, 50, 5000):
        assert schedule_step(step, 1000, 50, spent=0.0) == step


def test_schedule_step_follows_whichever_budget_runs_out_first() -> None:
    # warm-up is always counted in steps, however much of the other budget is gone
    assert schedule_step(10, 1000, 50, spent=0.75) == 10
    # a slow learner: half its time gone, few steps done -> the schedule is halfway through the decay
    assert schedule_step(100, 1050, 50, spent=0.5) == 550
    # at the end of its budget the decay is complete, whatever its speed; past it, it stays complete
    assert schedule_step(120, 1050, 50, spent=1.0) == 1050
    assert schedule_step(120, 1050, 50, spent=2.25) == 1050
    # a fast learner that runs out of steps first keeps the step-based schedule
    assert schedule_step(900, 1050, 50, spent=0.25) == 900


def test_schedule_step_is_monotone_in_the_budget_and_steps() -> None:
    prev = -1
    for k in range(0, 41):
        at = schedule_step(60, 1000, 50, spent=k / 40)
        assert at >= prev
        prev = at
    assert prev == 1000


def test_swarm_tokens_extrapolates_each_record_for_a_while() -> None:
    others = [(1000, 10.0, 50.0), (400, 12.0, 0.0)]  # (tokens, published at, tokens/s)
    assert swarm_tokens(300, [], 20.0, horizon_s=30.0) == 300  # alone: our own
    # 4 s after the first was published it has trained 200 more; the second is idle
    assert swarm_tokens(300, others, 14.0, horizon_s=30.0) == 300 + 1200 + 400
    # a record that was not refreshed counts its rate for the horizon only
    assert swarm_tokens(300, others, 100.0, horizon_s=30.0) == 300 + 1000 + 1500 + 400
    # a record from our future (clocks apart) is not taken back
    assert swarm_tokens(0, others, 5.0, horizon_s=30.0) == 1400


def _tiny_model() -> Any:
    from p2p_diloco.core.config import ModelConfig
    from p2p_diloco.core.model import build_model

    return build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16), seed=0)


def test_our_adamw_is_torch_adamw_bit_for_bit() -> None:
    """Same model, same batches, grad clipping, a schedule on param_groups' lr, moments dropped for some
    parameters midway (as a local drop does): every weight and moment identical after every step."""
    import torch

    from p2p_diloco.core.config import InnerConfig
    from p2p_diloco.core.inner import build_optimizer, train_step

    cfg = InnerConfig(lr=3e-2, warmup_steps=3, total_steps=40, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)
    ours_model, ref_model = _tiny_model(), _tiny_model()
    ours = build_optimizer(ours_model, cfg)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        x = torch.randint(0, 256, (4, 16), generator=gen)
        y = torch.randint(0, 256, (4, 16), generator=gen)
        assert train_step(ours_model, ours, (x, y), step, 40, cfg) == train_step(ref_model, ref, (x, y), step, 40, cfg)
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), step
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours.state[a][key], ref.state[b][key]), (step, key)
                assert ours.state[a][key].dtype == ref.state[b][key].dtype
        if step == 20:  # restart the moments of the first two parameters in both
            for a, b in list(zip(ours_model.parameters(), ref_model.parameters()))[:2]:
                ours.state.pop(a)
                ref.state.pop(b)


def test_our_adamw_rejects_bad_hyperparameters() -> None:
    from p2p_diloco.core.inner import AdamW

    params = list(_tiny_model().parameters())
    for kwargs, what in (({"lr": -1.0}, "AdamW lr"), ({"lr": 1e-3, "betas": (0.9, 1.0)}, "AdamW betas"),
                         ({"lr": 1e-3, "eps": float("nan")}, "AdamW eps"),
                         ({"lr": 1e-3, "weight_decay": -0.1}, "AdamW weight_decay")):
        with pytest.raises(ValueError, match=what):
            AdamW(params, **kwargs)


def test_training_does_not_import_torch_dynamo() -> None:
    """What a learner does before its first contribution (model, optimizer, steps) leaves torch._dynamo
    unimported: that import alone costs 1.7 s on an idle machine (run in a fresh interpreter)."""
    import subprocess
    import sys

    code = """
import sys, torch
from p2p_diloco.core.config import InnerConfig, ModelConfig
from p2p_diloco.core.inner import build_optimizer, train_step
from p2p_diloco.core.model import build_model
model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16), seed=0)
opt = build_optimizer(model, InnerConfig())
x = torch.randint(0, 256, (2, 16))
for step in range(3):
    train_step(model, opt, (x, x), step, 10, InnerConfig())
print("dynamo imported" if "torch._dynamo" in sys.modules else "dynamo not imported")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "dynamo not imported", out.stdout
