"""Hugging Face ``Trainer`` on a Llama, its progress averaged with a p2p-diloco swarm by a callback.

    pip install 'p2p-diloco[hf]'   # the Trainer needs accelerate
    python examples/hf_trainer.py --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER --config llama-tiny --seconds 60

The Trainer runs its own loop (its AdamW, schedule and logging); :class:`DiLoCoCallback` calls ``diloco.step``
after every optimizer step and runs the final rounds when training ends.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from p2p_diloco import SyncOptions, Swarm, build_model, load_config, training_batches
from p2p_diloco.integrations.hf import DiLoCoCallback


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token windows of the run's data; the model shifts ``labels`` itself."""

    def __init__(self, cfg, seed: int, count: int) -> None:  # type: ignore[no-untyped-def]
        batches = training_batches(cfg, seed=seed)
        self.rows = torch.cat([next(batches)[0] for _ in range(count // cfg.inner.batch_size + 1)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class StopAfter(TrainerCallback):
    """Ends training ``seconds`` after it began."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.end = seconds, 0.0

    def on_train_begin(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.end = time.monotonic() + self.seconds

    def on_step_end(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        control.should_training_stop = time.monotonic() >= self.end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of live peers of the run")
    p.add_argument("--config", default="llama-tiny", help="the run's config: a TOML file or a bundled name")
    p.add_argument("--seconds", type=float, default=60.0, help="train this long")
    p.add_argument("--max-steps", type=int, default=100_000, help="at most this many optimizer steps")
    p.add_argument("--wait-peers", type=int, default=0, help="start with this many learners (us included)")
    p.add_argument("--name", default="", help="our name in the swarm")
    p.add_argument("--seed", type=int, default=2, help="the order of our data (each peer its own)")
    args = p.parse_args()
    cfg = load_config(args.config)
    with Swarm.join(args.initial_peers, cfg, name=args.name) as swarm, tempfile.TemporaryDirectory() as out:
        i = cfg.inner
        targs = TrainingArguments(output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=i.batch_size,
                                  learning_rate=i.lr, weight_decay=i.weight_decay, adam_beta1=i.beta1,
                                  adam_beta2=i.beta2, warmup_steps=i.warmup_steps, logging_steps=5,
                                  save_strategy="no", report_to=[], use_cpu=True, seed=args.seed,
                                  dataloader_num_workers=0)
        callback = DiLoCoCallback(swarm, SyncOptions(wait_peers=args.wait_peers, linger_s=30.0))
        trainer = Trainer(model=build_model(cfg), args=targs, callbacks=[callback, StopAfter(args.seconds)],
                          train_dataset=Windows(cfg, args.seed, 4096))
        try:
            trainer.train()
        finally:
            callback.close()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert callback.diloco is not None
        print("final " + json.dumps({"name": swarm.name, "peer_id": swarm.peer_id, "steps": trainer.state.global_step, "first_loss": losses[0],
                                     "last_loss": losses[-1], "versions": callback.diloco.versions,
                                     "anchor_hashes": callback.diloco.anchor_hashes}), flush=True)


if __name__ == "__main__":
    main()
