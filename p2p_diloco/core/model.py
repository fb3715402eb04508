"""A small byte-level GPT (nanoGPT-style): vocabulary 256, so no tokenizer and nothing to download.

With the default config (4 blocks, width 128, context 128) it has about 0.86M parameters and
trains on one CPU thread. ``[model] kind = "hf"`` builds a transformers causal LM instead
(:mod:`p2p_diloco.core.hfmodel`); :func:`build_model` and :func:`lm_loss` serve both, and fragments come from
the model's structure (:func:`p2p_diloco.core.fragments.block_map`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2p_diloco.core.config import ConfigError, ModelConfig

VOCAB_SIZE = 256
FP32_BYTES = 4
DEVICE_COPIES = 4
"""fp32 copies of the parameters a learner keeps where it trains: the weights, their gradients, AdamW's two moments."""
HOST_COPIES = 2
"""...and on the CPU, whatever the device: the anchors and the outer Nesterov momentum (activations come on top:
the estimate of :func:`check_buildable` is a lower bound)."""
TRAINING_COPIES = DEVICE_COPIES + HOST_COPIES


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class ByteGPT(nn.Module):
    """Decoder-only transformer over bytes; ``forward(idx, targets)`` returns (logits, loss)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2 / nanoGPT
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps early activations small
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc_out.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))
        return logits, loss


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model of ``cfg.kind``; the same seed gives the same initial weights on every peer (they must share
    the first anchor). An hf model comes from :mod:`p2p_diloco.core.hfmodel` (transformers is imported only then)."""
    if cfg.kind == "hf":
        from p2p_diloco.core import hfmodel

        return hfmodel.build(cfg, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ByteGPT(cfg)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) of ``model`` reading ``x`` against targets ``y``.

    Our batches come already shifted (``y[:, t] = x[:, t + 1]``), so an HF causal LM is asked for logits
    only: its ``labels=`` would shift again. The one loss of the inner step, evaluation and the simulator.
    """
    if isinstance(unwrapped(model), ByteGPT):
        _, loss = model(x, y)  # through the wrapper, if any: DDP syncs gradients in its forward/backward
        if loss is None:
            raise ValueError("the model returned no loss for a batch with targets")
        return loss
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel / DataParallel or ``torch.compile`` wrapper."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model


def vocab_size(cfg: ModelConfig) -> int:
    """Token ids the model reads: 256 bytes for byte-gpt, the config's ``vocab_size`` for hf."""
    if cfg.kind == "hf":
        from p2p_diloco.core import hfmodel

        return hfmodel.check(cfg).vocab_size
    return VOCAB_SIZE


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The model's structure on the meta device (shapes, no memory); a ConfigError naming the key if it cannot be
    built (:func:`p2p_diloco.core.hfmodel.meta_build`)."""
    if cfg.kind == "hf":
        from p2p_diloco.core import hfmodel

        return hfmodel.meta_build(cfg)
    with torch.device("meta"):
        return ByteGPT(cfg)


def available_ram() -> int:
    """Bytes of memory this machine can give a new process without swapping: Linux's ``MemAvailable`` (free memory
    plus what the page cache would give back), else the free pages."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def human_size(n: float) -> str:
    """``23 GiB``, ``1.5 TiB``: binary units, two significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.2g} {unit}" if n < 10 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _count(n: int) -> str:
    return f"{n:,}" if n < 1e9 else f"{n:.2g}".replace("e+", "e")


def check_buildable(cfg: ModelConfig, device: torch.device | None = None, replicas: int = 1, replicas_what: str = "") -> int:
    """Before a learner joins (or a simulation or a local swarm starts): the model can be built (on the meta
    device, :func:`meta_model`) and, with ``device``, ``replicas`` learners of it fit this machine's memory:
    :data:`DEVICE_COPIES` fp32 copies on ``device`` and :data:`HOST_COPIES` on the CPU per learner (all
    :data:`TRAINING_COPIES` in RAM on a CPU device); ``replicas_what`` names where the count comes from. A
    ConfigError naming the key otherwise. Returns the parameter count (tied tensors counted once)."""
    model = meta_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device is None:
        return n
    if cfg.kind == "hf":
        from p2p_diloco.core import hfmodel

        key = hfmodel.check(cfg).source
    else:
        key = "model"
    learners = f" for {replicas} learners ({replicas_what})" if replicas > 1 else ""
    per_copy = n * FP32_BYTES * replicas
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if DEVICE_COPIES * per_copy > free:
            raise ConfigError(f"{key}: the model has {_count(n)} parameters, about {human_size(DEVICE_COPIES * per_copy)} "
                              f"on {device} to train{learners} (weights, gradients, AdamW moments); {device} has "
                              f"{human_size(free)} free")
        host_copies, what = HOST_COPIES, "anchors, outer momentum"
    else:
        host_copies, what = TRAINING_COPIES, "weights, gradients, AdamW moments, anchors, outer momentum"
    ram = available_ram()
    if host_copies * per_copy > ram:
        raise ConfigError(f"{key}: the model has {_count(n)} parameters, about {human_size(host_copies * per_copy)} "
                          f"to train{learners} ({what}); this machine has {human_size(ram)} available")
    return n
