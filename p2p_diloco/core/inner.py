"""The inner optimizer: AdamW on a warm-up + cosine schedule, one step at a time.

Shared by the simulator, the data-parallel reference and the networked learner, so that all of
them train exactly the same way.

:class:`AdamW` does the arithmetic of ``torch.optim.AdamW`` on CPU (its single-tensor path), bit for
bit (``tests/unit/test_inner.py`` compares them), but without ``torch.optim``'s import of ``torch._dynamo``
on first use: 1.7 s on an idle machine and 2-4 s on a busy one, on the path from a learner's start
to its first contribution. On a CUDA device the inner optimizer is torch's fused AdamW instead (there the
start-up is dominated by CUDA itself, and one fused kernel beats a loop over parameters); the forward pass
and the loss run under bf16 autocast with ``inner.precision = "bf16"`` (:mod:`p2p_diloco.core.devices`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from p2p_diloco.core.config import InnerConfig
from p2p_diloco.core.devices import autocast
from p2p_diloco.core.model import lm_loss


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to ``min_ratio * peak`` (step is 0-based)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def schedule_step(step: int, total: int, warmup: int, spent: float) -> int:
    """The step at which to read the schedule of a run bounded by more than its steps.

    ``spent`` is the share of the tightest other budget used up so far (the time of ``--max-time``, the swarm's
    tokens of ``--lr-tokens``; 0 with none). After the warm-up (always counted in steps) the schedule is at
    ``max(step, warmup + (total - warmup) * spent)``, so a learner that will run out of another budget before its
    steps still ends its decay when that budget ends, whatever its speed.
    """
    if spent <= 0 or step < warmup:
        return step
    by_budget = warmup + int((total - warmup) * min(1.0, spent))
    return max(step, by_budget)


def swarm_tokens(own: int, others: Iterable[tuple[int, float, float]], now: float, horizon_s: float) -> int:
    """The tokens a swarm has trained: ours and each other learner's last published count (``others``: tokens,
    the time it was published, its tokens/s), extrapolated at its rate to ``now`` for at most ``horizon_s`` (a record
    that stopped being refreshed is not counted on forever)."""
    return own + int(sum(t + rate * min(horizon_s, max(0.0, now - at)) for t, at, rate in others))


class AdamW:
    """AdamW with decoupled weight decay and bias correction, as ``torch.optim.AdamW(params, lr, betas,
    eps, weight_decay)`` computes it on CPU tensors (no amsgrad, no maximize), with the parts of its
    interface we use: ``param_groups`` (set ``"lr"`` there), ``state`` (per parameter: ``step``, a
    float32 0-d tensor, ``exp_avg``, ``exp_avg_sq``; popping a parameter's entry restarts its moments),
    ``zero_grad`` and ``step``."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        for name, value, low in (("lr", lr, 0.0), ("eps", eps, 0.0), ("weight_decay", weight_decay, 0.0)):
            if not value >= low:
                raise ValueError(f"AdamW {name}: must be >= {low}, got {value}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW betas: each must be in [0, 1), got {betas}")
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(params), "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state.get(p)
                if not state:
                    state = self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                grad, exp_avg, exp_avg_sq, step_t = p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]
                step_t += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)


InnerOptimizer = AdamW | torch.optim.AdamW
"""Our AdamW on a CPU, torch's fused AdamW on a CUDA device: the same update, the same ``param_groups`` / ``state``."""
CPU = torch.device("cpu")


def build_optimizer(model: torch.nn.Module, cfg: InnerConfig, device: torch.device = CPU) -> InnerOptimizer:
    """The inner AdamW of ``model``, whose parameters are on ``device``: torch's fused AdamW on CUDA (one kernel
    for all parameters), else :class:`AdamW` (torch's own would import torch._dynamo at the first step)."""
    betas = (cfg.beta1, cfg.beta2)
    if device.type == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay, fused=True)
    return AdamW(model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)


def train_step(model: torch.nn.Module, opt: InnerOptimizer, batch: tuple[torch.Tensor, torch.Tensor],
               step: int, total_steps: int, cfg: InnerConfig, device: torch.device = CPU) -> torch.Tensor:
    """One AdamW step at the scheduled learning rate for 0-based ``step``; returns the training loss, a detached
    0-dim tensor on ``device``: reading it (``float(loss)``) waits for the device, so a caller does that only when
    it logs or publishes the loss, not every step.

    ``model`` and ``opt`` live on ``device``; the batch (on the CPU) is moved there. With ``cfg.precision``
    "bf16" the forward pass and the loss run under bf16 autocast; the backward pass and the update are fp32."""
    lr = lr_at(step, total_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
    for group in opt.param_groups:
        group["lr"] = lr
    x, y = batch
    if device.type != "cpu":
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with autocast(device, cfg.precision):
        loss = lm_loss(model, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss.detach()
