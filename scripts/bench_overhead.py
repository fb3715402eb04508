#!/usr/bin/env python3
"""Overhead benchmark: a learner's inner steps/s against a plain PyTorch loop of the same model, in one run.

Both arms train the same Hugging Face Llama (3.5M parameters: hidden 256, 4 layers, vocabulary 256,
context 128, batch 8) from the same initial weights, on the same precomputed batches, with the same
precision, warm-up + cosine learning rate and gradient clipping, and the same number of torch threads:

- **plain**: ``model(input_ids).logits``, cross-entropy, ``zero_grad``, ``backward``, ``clip_grad_norm_``,
  ``torch.optim.AdamW`` -- the loop anyone would write;
- **learner**: :meth:`p2p_diloco.learner.loop.Learner.train_once`, exactly what a learner's loop runs per step:
  the inner step (our AdamW, the schedule, pacing), then the engine's ``DiLoCo.step`` -- counters, finished
  rounds collected, catch-up checks, which fragments are due (``averaging.schedule = "steps"``), each
  due fragment's pseudo-gradient computed on the host and handed off, the result applied (an outer
  Nesterov step, alpha-mixed into the weights) and an event written. Only the network is replaced: the
  averagers are stand-ins whose rounds commit at once with our own pseudo-gradient as the group's (no
  DHT, no averager processes, no status thread).

The arms alternate in short blocks (plain, learner, learner, plain, ...) so that the noise of a shared
machine hits both; each block's steps/s is measured. The headline ratio is the median over block pairs of
learner / plain (each pair measured back to back, so a load change between pairs cancels); the medians of
each arm's steps/s, and their ratio, are reported beside it. Writes
``overhead.json``, ``README.md`` (the page) and ``overhead.png`` into ``--out`` (default ``results/overhead``).

    python scripts/bench_overhead.py                # about 2 minutes on 2 idle cores: threads 1 and 2
    python scripts/bench_overhead.py --quick        # a smoke run on a tiny Llama (seconds): checks the pipeline
    python scripts/bench_overhead.py --render-only  # rewrite the page (README.md) from overhead.json
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable
from unittest import mock

import _bench
import _machine
import torch
import torch.nn.functional as F
from bench_overhead_page import TARGET, markdown, plot

from p2p_diloco.averaging.plans import RoundOutcome, RoundPlan
from p2p_diloco.sync.fragment import Contribution
from p2p_diloco.core import data, outer
from p2p_diloco.core.config import Config, load_config
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.devices import autocast, machine_device
from p2p_diloco.core.inner import lr_at
from p2p_diloco.core.model import build_model, count_parameters
from p2p_diloco.engine import options
from p2p_diloco.learner import loop
from p2p_diloco.transport import hivemind

LLAMA_3M = ["model.block_size=128", "model.hf_config.hidden_size=256", "model.hf_config.intermediate_size=768",
            "model.hf_config.num_hidden_layers=4", "model.hf_config.num_attention_heads=4",
            "model.hf_config.num_key_value_heads=4", "model.hf_config.max_position_embeddings=128"]
"""On configs/llama-tiny.toml: a Llama of 3.5M parameters."""
COMMON = ["inner.batch_size=8", "inner.total_steps=1000", "inner.warmup_steps=10", "outer.sync_every=10",
          "outer.fragments=2", "averaging.schedule=steps"]
"""Both sizes: batch 8; a fragment due every 5 steps (H = 10, 2 fragments), so handing off and applying rounds
is part of what the learner arm pays for."""
BENCH = _bench.Bench("overhead", "overhead", "Learner overhead against a plain PyTorch loop", "scripts/bench_overhead.py", """\
Both arms train the same Hugging Face Llama (3.5M parameters: hidden 256, 4 layers, vocabulary 256, context 128,
batch 8; `configs/llama-tiny.toml` with overrides) from the same initial weights, on the same precomputed batches,
with the same precision, warm-up + cosine learning rate, gradient clipping and number of torch threads:

- **plain**: `model(input_ids).logits`, cross-entropy, `zero_grad`, `backward`, `clip_grad_norm_`,
  `torch.optim.AdamW` -- the loop anyone would write;
- **learner**: `Learner.train_once`, exactly what a learner's loop runs per step: the inner step, then its
  bookkeeping -- finished rounds collected, catch-up checks, which fragments are due (a fragment every 5 steps),
  each due fragment's pseudo-gradient computed and handed off, the result applied (an outer Nesterov step,
  alpha-mixed into the weights) and an event written. Only the network is replaced: the averagers are stand-ins
  whose rounds commit at once with the learner's own pseudo-gradient as the group's.

The arms alternate in short blocks (plain, learner, learner, plain, ...) so that the noise of a shared machine hits
both. The headline is the median over block pairs of learner / plain steps/s (each pair measured back to back);
each arm's median steps/s and their ratio are reported beside it. The bar (issue 19): at least 0.95 x the plain
loop's steps/s at every thread count.""")


class IdleAveraging:
    """Stands in for :class:`p2p_diloco.averaging.host.FragmentAveragerHost` without a network: every round commits at
    once, the merged pseudo-gradient being the learner's own (a group of one), so the learner's loop applies a
    real outer step."""

    prefix = "bench_f0"

    def __init__(self, cfg: Config, index: int, *_args: Any, **_kwargs: Any) -> None:
        self.cfg, self.index = cfg, index

    def start_background(self) -> None:
        pass

    def wait_ready(self, timeout_s: float) -> None:
        pass

    def vouch(self, version: int, anchor: str) -> None:
        pass

    def keep_round(self, kept: Any) -> None:
        pass

    def cancel(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def bytes_total(self) -> tuple[int, int]:
        return 0, 0

    def start_round(self, contribution: Contribution, plan: RoundPlan) -> "Future[RoundOutcome]":
        c, o = contribution, self.cfg.outer
        merged = outer.decode_merged(c.tensors, [c.norms], [c.weight], o.merge)
        done: Future[RoundOutcome] = Future()
        done.set_result(RoundOutcome(fragment=self.index, version=c.version, committed=True,
                                     reason="benchmark: a group of one", group_size=1, own_share=1.0,
                                     weights=(c.weight,), finished_at=time.monotonic(), merged=merged))
        return done


def bench_config(quick: bool, precision: str) -> Config:
    return load_config(_bench.ROOT / "configs" / "llama-tiny.toml",
                       [*([] if quick else LLAMA_3M), *COMMON, f"inner.precision={precision}"])


def make_batches(cfg: Config, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed random batches (the speed does not depend on the text), shared by both arms."""
    gen = torch.Generator().manual_seed(0)
    t = cfg.model.block_size
    windows = [torch.randint(0, 256, (cfg.inner.batch_size, t + 1), generator=gen) for _ in range(count)]
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]


def plain_loop(cfg: Config, device: torch.device, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """The plain PyTorch loop, one step per call."""
    model = build_model(cfg.model, cfg.run.seed).to(device)
    i = cfg.inner
    opt = torch.optim.AdamW(model.parameters(), lr=i.lr, betas=(i.beta1, i.beta2), weight_decay=i.weight_decay,
                            fused=device.type == "cuda")
    cycle = itertools.cycle(batches)
    step = itertools.count()

    def one() -> None:
        x, y = next(cycle)
        x, y = x.to(device), y.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(next(step), i.total_steps, i.warmup_steps, i.lr, i.min_lr_ratio)
        with autocast(device, i.precision):
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
        opt.step()
        float(loss.detach())
    return one


def learner_loop(cfg: Config, device: torch.device, threads: int, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 events: Path) -> tuple[Callable[[], None], loop.Learner]:
    """A :class:`~p2p_diloco.learner.loop.Learner` without a network (:class:`IdleAveraging`), one ``train_once``
    per call."""
    stream = torch.cat([x.reshape(-1) for x, _ in batches])
    splits = data.Splits(eval=stream, shards=(stream,))
    joined = SimpleNamespace(dht=None, private_key=None, peer_id="bench-peer", name="bench", snapshot=None,
                             publisher=SimpleNamespace(update=lambda **_kw: None))
    local = SimpleNamespace(run_id=cfg.run.run_id, config_hash=config_hash(cfg))
    swarm = SimpleNamespace(config=cfg, joined=joined, local=local, membership=None)
    opts = options.LearnerOptions(name="bench", shard=None, num_shards=1, max_steps=10**9,
                                  sync=options.SyncOptions(events_path=events), train_nice=0, device=str(device))
    with mock.patch.object(hivemind, "FragmentAveragerHost", IdleAveraging):
        unit = loop.Learner(cfg, options.Profile(name="bench", threads=threads), opts, swarm, splits=splits)
    unit.batches = itertools.cycle(batches)  # the same batches as the plain loop
    d = unit.diloco
    d.view.swarm_reads = 1  # as if the status thread had looked at the swarm: due fragments are handed off
    d.training = True
    d.t_start = time.monotonic()
    return unit.train_once, unit


def timed(step: Callable[[], None], n: int, device: torch.device) -> float:
    """Steps per second of ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / (time.perf_counter() - t0)


def measure(cfg: Config, device: torch.device, threads: int, blocks: int, steps: int, warmup: int,
            batches: list[tuple[torch.Tensor, torch.Tensor]], workdir: Path) -> dict[str, Any]:
    torch.set_num_threads(threads)
    plain = plain_loop(cfg, device, batches)
    own, unit = learner_loop(cfg, device, threads, batches, workdir / f"events-{threads}.jsonl")
    torch.set_num_threads(threads)  # the learner set it too; the same for both arms
    for _ in range(warmup):
        plain()
        own()
    rates: dict[str, list[float]] = {"plain": [], "learner": []}
    for b in range(blocks):
        order = ("plain", "learner") if b % 2 == 0 else ("learner", "plain")
        for arm in order:
            rates[arm].append(timed(plain if arm == "plain" else own, steps, device))
    committed = sum(s.committed for s in unit.slots)
    unit.close()
    med = {arm: statistics.median(r) for arm, r in rates.items()}
    pairs = [lr / pr for pr, lr in zip(rates["plain"], rates["learner"])]
    return {
        "threads": threads, "blocks": blocks, "steps_per_block": steps, "warmup_steps": warmup,
        "plain_steps_per_s": rates["plain"], "learner_steps_per_s": rates["learner"],
        "plain_median": med["plain"], "learner_median": med["learner"],
        "ratio": statistics.median(pairs), "ratio_of_medians": med["learner"] / med["plain"], "pair_ratios": pairs,
        "learner_rounds_committed": committed, "learner_steps": unit.step,
    }


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__, BENCH, quick="a tiny Llama, few blocks: checks the pipeline, not the numbers")
    p.add_argument("--threads", type=int, nargs="+", default=None, help="torch thread counts (default: 1 2)")
    p.add_argument("--blocks", type=int, default=None, help="timed blocks per arm (default: 20; --quick 3)")
    p.add_argument("--steps", type=int, default=None, help="steps per block (default: 4; --quick 3)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="inner.precision of both arms")
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (default: cpu)")
    args = p.parse_args(argv)
    if _bench.rerender(args, BENCH, markdown, plot):
        return 0
    try:
        device = machine_device(args.device)
    except ValueError as e:
        print(f"bench_overhead: error: {e}", file=sys.stderr)
        return 2
    threads = args.threads or ([1] if args.quick else [1, 2])
    blocks = args.blocks or (3 if args.quick else 20)
    steps = args.steps or (3 if args.quick else 4)
    if min(threads) < 1 or blocks < 1 or steps < 1:
        print("bench_overhead: error: --threads, --blocks and --steps must be >= 1", file=sys.stderr)
        return 2
    cfg = bench_config(args.quick, args.precision)
    batches = make_batches(cfg, 16)
    h = cfg.model.hf_config
    assert isinstance(h, dict)
    model = {"description": f"Llama hidden {h['hidden_size']} x {h['num_hidden_layers']} layers, vocab {h['vocab_size']}",
             "parameters": count_parameters(build_model(cfg.model, cfg.run.seed)), "batch": cfg.inner.batch_size,
             "block_size": cfg.model.block_size}
    print(f"bench_overhead: {model['description']} ({model['parameters'] / 1e6:.2f}M), threads {threads}, {blocks} "
          f"blocks x {steps} steps per arm, {args.precision} on {device}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    start_load = _machine.load_average()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for n in threads:
            r = measure(cfg, device, n, blocks, steps, warmup=2, batches=batches, workdir=Path(tmp))
            print(f"  {n} thread(s): plain {r['plain_median']:.3f} steps/s, learner {r['learner_median']:.3f} steps/s, "
                  f"ratio {r['ratio']:.3f}", file=sys.stderr, flush=True)
            results.append(r)
    payload = {
        "quick": args.quick, "device": str(device), "precision": args.precision, "model": model,
        "blocks": blocks, "steps_per_block": steps, "target_ratio": TARGET, "results": results,
        "ratio_min": min(r["ratio"] for r in results), "load_average_start": start_load,
        "load_average_end": _machine.load_average(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "wall_s": round(time.monotonic() - t0, 1),
        "command": "python scripts/bench_overhead.py" + (" --quick" if args.quick else ""),
    }
    if not all(math.isfinite(r["ratio"]) for r in results):
        print("bench_overhead: error: a ratio is not finite", file=sys.stderr)
        return 1
    _bench.publish(BENCH, args.out, payload, markdown, plot)
    print(f"bench_overhead: done in {payload['wall_s']:.0f} s; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
