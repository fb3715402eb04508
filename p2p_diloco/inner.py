"""The inner optimizer: AdamW on a warm-up + cosine schedule, one step at a time.

Shared by the simulator, the data-parallel reference and the networked learner, so that all of
them train exactly the same way.
"""

from __future__ import annotations

import math

import torch

from p2p_diloco.config import InnerConfig


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to ``min_ratio * peak`` (step is 0-based)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def schedule_step(step: int, total: int, warmup: int, elapsed_s: float, budget_s: float) -> int:
    """The step at which to read the schedule of a run bounded by time as well as by steps.

    Without a time budget (``budget_s <= 0``) it is ``step``. With one, the cosine runs on whichever
    budget is used up faster: after the warm-up (always counted in steps), the schedule is at
    ``max(step, warmup + (total - warmup) * elapsed_s / budget_s)``, so a learner that will run out of
    time before its steps still ends its decay at the end of its time, whatever its speed.
    """
    if budget_s <= 0 or step < warmup:
        return step
    by_time = warmup + int((total - warmup) * min(1.0, max(0.0, elapsed_s) / budget_s))
    return max(step, by_time)


def build_optimizer(model: torch.nn.Module, cfg: InnerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
               step: int, total_steps: int, cfg: InnerConfig) -> float:
    """One AdamW step at the scheduled learning rate for 0-based ``step``; returns the training loss."""
    lr = lr_at(step, total_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
    for group in opt.param_groups:
        group["lr"] = lr
    x, y = batch
    _, loss = model(x, y)
    if loss is None:
        raise ValueError("the model returned no loss for a batch with targets")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return float(loss.detach())
