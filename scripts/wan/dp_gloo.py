#!/usr/bin/env python3
"""Data-parallel training of the project's byte GPT with torch.distributed (gloo): the conventional baseline.

One process per host (``--rank``, ``--world-size``, ``--master-addr``): every rank trains the same
model (``p2p_diloco.core.model``, same seed) on its own shard of the embedded corpus with the learners'
per-host batch (``inner.batch_size`` x ``model.block_size``), and the gradients are all-reduced
every step by :class:`torch.nn.parallel.DistributedDataParallel` (gloo, fp32, bucketed and
overlapped with the backward pass, as DDP does). The global batch is world-size x the per-host
batch: the data-parallel reference of ``p2p_diloco.sim.simulator.run_reference``, spread over hosts.
The AdamW step and its warm-up + cosine schedule are ``p2p_diloco.core.inner.train_step``, over
``inner.total_steps`` whatever budget stops the run.

``--compute-only`` runs the same loop with no process group and no all-reduce: started on every
host at once, it measures the step time under the same CPU contention without the network, so
``step time / compute-only step time`` is the ideal speed-up of a method that hides the network.

Rank 0 evaluates the held-out loss every ``--eval-every`` steps (the others wait at a barrier;
evaluation and the barrier are not counted in step times or in the training time). Every rank
prints one ``final {json}`` line (and writes it to ``--json``): per-step times, the eval curve,
tokens, training time.

    python scripts/wan/dp_gloo.py --rank 0 --world-size 4 --master-addr 10.77.0.1 --ifname p2pd-wan-n0 --steps 20
    python scripts/wan/dp_gloo.py --compute-only --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"

log = logging.getLogger("wan.dp_gloo")

DEFAULT_PORT = 29577
PROGRESS_EVERY = 5
"""Steps between progress lines on stderr (with -v)."""


@dataclass(frozen=True)
class DpParams:
    """One rank of a data-parallel run."""

    config: str
    """Run config (TOML): model, data, inner optimizer, batch; ``inner.total_steps`` sets the schedule."""
    overrides: tuple[str, ...] = ()
    """``--set KEY=VALUE`` overrides of the config."""
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    ifname: str = ""
    """Network interface gloo uses (GLOO_SOCKET_IFNAME); empty = gloo's choice."""
    compute_only: bool = False
    """No process group, no all-reduce: the step time without the network."""
    steps: int = 0
    """Steps to run; 0 = ``inner.total_steps``."""
    max_time_s: float = 0.0
    """Stop after this much training time (eval excluded); 0 = no limit. All ranks stop at the same step."""
    eval_every: int = 50
    """Steps between held-out evaluations (rank 0); 0 = only at the start and the end."""
    threads: int = 1
    """torch threads per rank (several hosts share this machine's cores)."""
    timeout_s: float = 600.0
    """Upper bound on joining the process group and on any one collective (gloo timeout)."""
    shard: int = -1
    """Data shard; -1 = the rank."""
    num_shards: int = 0
    """Shards the corpus is dealt into; 0 = the world size (the config's sim.learners with --compute-only)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.compute_only and self.world_size != 1:
            raise ValueError("--compute-only runs without a process group: leave --world-size at 1")
        if self.steps < 0 or self.eval_every < 0 or self.max_time_s < 0:
            raise ValueError(f"steps, eval_every and max_time_s must be >= 0, got {self.steps}, {self.eval_every}, "
                             f"{self.max_time_s}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")


def should_stop(step: int, steps: int, train_s: float, max_time_s: float) -> bool:
    """Rank 0's decision after ``step`` steps (broadcast so that all ranks stop together)."""
    return step >= steps or (max_time_s > 0 and train_s >= max_time_s)


def is_eval_step(step: int, steps: int, eval_every: int) -> bool:
    return step == steps or (eval_every > 0 and step % eval_every == 0)


def time_to_target(curve: Sequence[dict[str, float]], target: float) -> float | None:
    """Training seconds at the first evaluation at or below ``target`` (None if never reached)."""
    return next((p["train_s"] for p in curve if p["eval_loss"] <= target), None)


def summarize_steps(step_s: Sequence[float], skip: int = 2) -> dict[str, float]:
    """Median / mean step time, leaving out the first ``skip`` steps (gloo connections, allocator warm-up)."""
    body = list(step_s[skip:]) or list(step_s)
    if not body:
        return {"median_step_s": float("nan"), "mean_step_s": float("nan")}
    return {"median_step_s": statistics.median(body), "mean_step_s": statistics.fmean(body)}


def run(p: DpParams) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from p2p_diloco.core import data
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.inner import build_optimizer, train_step
    from p2p_diloco.core.model import build_model, count_parameters

    cfg = load_config(p.config, p.overrides)
    torch.set_num_threads(p.threads)
    distributed = not p.compute_only and p.world_size > 1
    if distributed:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = p.master_addr, str(p.master_port)
        if p.ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = p.ifname
        dist.init_process_group("gloo", rank=p.rank, world_size=p.world_size,
                                timeout=datetime.timedelta(seconds=p.timeout_s))
    try:
        num_shards = p.num_shards or (cfg.sim.learners if p.compute_only else p.world_size)
        shard = p.rank if p.shard < 0 else p.shard
        splits = data.split_corpus(data.load_corpus(cfg.data), num_shards, cfg.data.eval_fraction)
        model = build_model(cfg.model, cfg.run.seed)
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
        opt = build_optimizer(model, cfg.inner)
        it = data.batches(splits.shards[shard], cfg.inner.batch_size, cfg.model.block_size,
                          seed=cfg.run.seed * 1000 + shard)
        eval_set = data.eval_batches(splits.eval, cfg.data.eval_batches, cfg.data.eval_batch_size, cfg.model.block_size)
        steps = p.steps or cfg.inner.total_steps
        world = p.world_size if distributed else 1
        tokens_per_step = world * cfg.inner.batch_size * cfg.model.block_size
        curve: list[dict[str, float]] = []
        step_s: list[float] = []
        train_s = 0.0
        eval_s = 0.0

        def evaluate(step: int) -> None:
            nonlocal eval_s
            t = time.monotonic()
            if p.rank == 0:
                curve.append({"step": step, "tokens": step * tokens_per_step, "train_s": train_s,
                              "eval_loss": data.evaluate(model, eval_set)})
                log.info("step %d train %.1f s eval_loss %.4f", step, train_s, curve[-1]["eval_loss"])
            if distributed:
                dist.barrier()
            eval_s += time.monotonic() - t

        evaluate(0)
        step = 0
        stop = False
        t_wall = time.monotonic()
        while not stop:
            t = time.monotonic()
            train_step(net, opt, next(it), step, cfg.inner.total_steps, cfg.inner)
            step += 1
            dt = time.monotonic() - t
            step_s.append(dt)
            train_s += dt
            if step % PROGRESS_EVERY == 0:
                log.info("step %d %.3f s (train %.1f s)", step, dt, train_s)
            stop = should_stop(step, steps, train_s, p.max_time_s)
            if distributed and p.max_time_s > 0:  # rank 0's clock decides, so every rank stops at the same step
                flag = torch.tensor([1.0 if stop else 0.0])
                dist.broadcast(flag, src=0)
                stop = bool(flag.item())
            if stop or is_eval_step(step, steps, p.eval_every):
                evaluate(step)
        wall_s = time.monotonic() - t_wall
        n_params = count_parameters(model)
        summary = {
            "mode": "compute-only" if p.compute_only else "data-parallel",
            "rank": p.rank, "world_size": world, "shard": shard, "num_shards": num_shards,
            "steps": step, "tokens": step * tokens_per_step, "tokens_per_step": tokens_per_step,
            "n_params": n_params,
            # gloo's ring all-reduce: each rank sends 2 (n-1)/n of the fp32 gradients per step
            "allreduce_payload_bytes_per_step": 2 * (world - 1) / world * 4 * n_params if distributed else 0.0,
            "train_s": train_s, "eval_s": eval_s, "wall_s": wall_s,
            **summarize_steps(step_s),
            "step_s": [round(s, 4) for s in step_s],
            "curve": curve,
            "final_eval_loss": curve[-1]["eval_loss"] if curve else None,
            "params": asdict(p),
        }
        return summary
    finally:
        if distributed:
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config (default: configs/demo.toml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--ifname", default="", help="interface for gloo (GLOO_SOCKET_IFNAME)")
    ap.add_argument("--compute-only", action="store_true", help="no process group, no all-reduce")
    ap.add_argument("--steps", type=int, default=0, help="steps to run (default: inner.total_steps)")
    ap.add_argument("--max-time", type=float, default=0.0, metavar="SECONDS", help="training-time budget (0 = none)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                    help="gloo timeout: joining the group and any one collective")
    ap.add_argument("--shard", type=int, default=-1)
    ap.add_argument("--num-shards", type=int, default=0)
    ap.add_argument("--json", default="", metavar="PATH", help="also write the final summary here")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr,
                        format=f"[rank {a.rank}] %(message)s")
    try:
        params = DpParams(config=a.config, overrides=tuple(a.overrides), rank=a.rank, world_size=a.world_size,
                          master_addr=a.master_addr, master_port=a.master_port, ifname=a.ifname,
                          compute_only=a.compute_only, steps=a.steps, max_time_s=a.max_time, eval_every=a.eval_every,
                          threads=a.threads, timeout_s=a.timeout, shard=a.shard, num_shards=a.num_shards)
    except ValueError as e:
        print(f"dp_gloo: {e}", file=sys.stderr)
        return 2
    summary = run(params)
    line = json.dumps(summary)
    if a.json:
        Path(a.json).write_text(line + "\n")
    print(f"final {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
