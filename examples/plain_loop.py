"""A plain PyTorch loop on a Hugging Face Llama, its progress averaged with a p2p-diloco swarm.

    python examples/plain_loop.py --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER --config llama-tiny --seconds 60

The loop is the one anyone writes (batch, forward, loss, backward, AdamW step); ``diloco.step`` after it hands
the due fragments' pseudo-gradients to the swarm in the background and applies the rounds that came back.
Leaving the ``with`` block runs the final rounds and waits for the peers to agree.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from p2p_diloco import DiLoCo, SyncOptions, Swarm, build_model, load_config, training_batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of live peers of the run")
    p.add_argument("--config", default="llama-tiny", help="the run's config: a TOML file or a bundled name")
    p.add_argument("--seconds", type=float, default=60.0, help="train this long")
    p.add_argument("--wait-peers", type=int, default=0, help="start with this many learners (us included)")
    p.add_argument("--name", default="", help="our name in the swarm")
    p.add_argument("--seed", type=int, default=1, help="the order of our batches (each peer its own)")
    args = p.parse_args()
    cfg = load_config(args.config)
    torch.manual_seed(args.seed)
    with Swarm.join(args.initial_peers, cfg, name=args.name) as swarm:
        model = build_model(cfg)  # the run's seeded start: every peer begins from the same weights
        i = cfg.inner
        opt = torch.optim.AdamW(model.parameters(), lr=i.lr, betas=(i.beta1, i.beta2), weight_decay=i.weight_decay)
        batches = training_batches(cfg, seed=args.seed)
        losses = []
        with DiLoCo(model, opt, swarm, SyncOptions(wait_peers=args.wait_peers, linger_s=30.0)) as diloco:
            diloco.start()  # looks at the swarm (downloads what a peer is ahead on), waits for --wait-peers
            end, step = time.monotonic() + args.seconds, 0
            while time.monotonic() < end:
                x, y = next(batches)
                logits = model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                diloco.step(tokens=x.numel(), loss=loss.detach())
                losses.append(loss.item())
                if step % 50 == 0:
                    print(f"step {step}: loss {losses[-1]:.3f}, fragment versions {diloco.versions}", flush=True)
                step += 1
        print("final " + json.dumps({"name": swarm.name, "peer_id": swarm.peer_id, "steps": len(losses), "first_loss": losses[0],
                                     "last_loss": sum(losses[-5:]) / len(losses[-5:]), "versions": diloco.versions,
                                     "anchor_hashes": diloco.anchor_hashes}), flush=True)


if __name__ == "__main__":
    main()
