"""``p2p-diloco join``: run a learner unit in a swarm (inner steps + background fragment averaging).

Only the standard library is imported here; torch and hivemind load when the command runs, so
``p2p-diloco --help`` stays fast. Joining, the compatibility check (config hash, protocol) and the
graceful leave are the library's (:class:`p2p_diloco.engine.swarm.Swarm`), the loop a client of its engine.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from p2p_diloco.cli.common import (
    StopOnSignal,
    add_config_args,
    add_network_args,
    add_run_id_arg,
    check_writable_dir,
    check_writable_file,
    resolve_config,
    setup_logging,
)
from p2p_diloco.core import resources
from p2p_diloco.core.console import out
from p2p_diloco.learner.priority import JOINING_MAX_S
from p2p_diloco.net.arguments import swarm_options

logger = logging.getLogger(__name__)


def check_shard_flags(shard: int | None, num_shards: int | None) -> None:
    """The checks of ``--shard`` / ``--num-shards`` (they need no config)."""
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"--num-shards: must be >= 1, got {num_shards}")
    if shard is None and num_shards is not None:
        raise ValueError(f"--num-shards {num_shards}: only with --shard I (without --shard a learner samples the "
                         "whole training set in its own order)")
    if shard is not None and shard < 0:
        raise ValueError(f"--shard: must be >= 0, got {shard}")
    if shard is not None and num_shards is None:
        # the data layout of a networked learner is its own choice, never the simulator's sim.learners
        raise ValueError(f"--shard {shard}: give --num-shards N too (the number of shards the training set is "
                         "dealt into)")
    if shard is not None and num_shards is not None and shard >= num_shards:
        raise ValueError(f"--shard: must be in [0, {num_shards}) for {num_shards} shards, got {shard}")


def shard_count(shard: int | None, num_shards: int | None) -> int:
    """Shards the training set is dealt into: ``num_shards`` with an explicit ``--shard`` (both are required
    together), else 1 (the learner samples the whole set)."""
    check_shard_flags(shard, num_shards)
    return 1 if num_shards is None else num_shards


def cmd_join(args: argparse.Namespace) -> int:
    import time

    started_at = time.monotonic()
    setup_logging(args.verbose)  # without -v: warnings and errors only; the console lines (stdout) always
    from p2p_diloco.core.devices import check_precision, machine_device

    device = machine_device(args.device)  # --device cuda on a machine without one: one line, nothing started
    from p2p_diloco.engine.options import Profile
    from p2p_diloco.net.records import LocalRun

    # the flags first: a bad one fails before anything is looked up in the DHT
    profile = Profile.load(resources.find(args.profile, resources.PEERS)) if args.profile else Profile()
    check_shard_flags(args.shard, args.num_shards)
    for flag, value in (("--wait-peers", args.wait_peers), ("--serve", args.serve_s),
                        ("--eval-every", args.eval_every_s), ("--train-nice", args.train_nice),
                        ("--checkpoint-every", args.checkpoint_every_s), ("--linger", args.linger_s),
                        ("--final-wait", args.final_wait_s)):
        if value is not None and value < 0:
            raise ValueError(f"{flag}: must be >= 0, got {value}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps: must be >= 1, got {args.steps}")
    if args.max_time_s is not None and not args.max_time_s > 0:
        raise ValueError(f"--max-time: must be > 0 seconds, got {args.max_time_s:g} (leave it out for no limit)")
    if not args.view_period_s > 0:
        raise ValueError(f"--view-period: must be > 0 seconds, got {args.view_period_s}")
    if args.eval_batches < 1:
        raise ValueError(f"--eval-batches: must be >= 1, got {args.eval_batches}")
    if args.train_nice > 19:
        raise ValueError(f"--train-nice: must be at most 19 (the lowest CPU priority), got {args.train_nice}")
    from p2p_diloco.net.records import check_label

    check_label("--name", args.name)  # a name no record can hold: refused by every DHT node, after a long wait
    from p2p_diloco.core import faults

    armed = [faults.parse_fault(spec) for spec in args.faults]  # a bad spec fails before we join
    from p2p_diloco.engine import metrics

    metrics_specs = tuple(metrics.parse_metrics_spec(spec) for spec in args.metrics)
    metrics.check_available(metrics_specs)  # tensorboard missing: fail now, not after joining
    chosen = args.checkpoint_dir or args.resume
    checkpoint_dir = Path(chosen) if chosen else None
    # every path we will write is tried now: a folder we cannot write fails here, not at the first checkpoint
    if checkpoint_dir is not None:
        check_writable_dir(checkpoint_dir, "--checkpoint-dir" if args.checkpoint_dir else "--resume")
    if args.events:
        check_writable_file(Path(args.events), "--events")
    for spec in metrics_specs:
        if spec.kind == "tensorboard":
            check_writable_dir(spec.path, f"--metrics {spec.kind}:")
        elif spec.kind == "jsonl":
            check_writable_file(spec.path, f"--metrics {spec.kind}:")
    if args.lr_tokens is not None and args.lr_tokens < 1:
        raise ValueError(f"--lr-tokens: must be >= 1 tokens, got {args.lr_tokens} (leave it out for none)")
    if args.lr_schedule == "time" and not args.max_time_s:
        raise ValueError("--lr-schedule time: needs --max-time SECONDS")
    if args.checkpoint_every_s and checkpoint_dir is None:
        raise ValueError("--checkpoint-every: needs --checkpoint-dir DIR")
    cfg = resolve_config(args)  # --config, else the config of the run that is in the DHT (verified)
    check_precision(cfg.inner.precision, device)
    num_shards = shard_count(args.shard, args.num_shards)
    local = LocalRun.from_config(cfg)
    resume = None
    if args.resume:  # verified before we join: a bad checkpoint never reaches the swarm
        from p2p_diloco.learner.checkpoint import load_checkpoint

        resume = load_checkpoint(Path(args.resume), expect={"config_hash": local.config_hash, "run_id": local.run_id})
    from p2p_diloco.engine.options import check_supported, load_splits

    check_supported(cfg)
    from p2p_diloco.core.model import check_buildable

    check_buildable(cfg.model, device)  # a model that cannot be built, or does not fit this machine, fails here
    splits = load_splits(cfg, num_shards)  # missing, empty, binary or too small data fails here, before we join
    incarnation = time.time_ns()
    from p2p_diloco.engine.swarm import Swarm

    with StopOnSignal() as stop, Swarm.from_options(swarm_options(args, client_mode=False), cfg, name=args.name,
                                                    profile=profile.name) as swarm:
        from p2p_diloco.learner.loop import Learner
        from p2p_diloco.engine.options import LearnerOptions, SyncOptions

        sync = SyncOptions(
            events_path=Path(args.events) if args.events else None, metrics=metrics_specs,
            wait_peers=args.wait_peers or 0, linger_s=args.linger_s, final_wait_s=args.final_wait_s, serve_s=args.serve_s,
            view_period_s=args.view_period_s, blocking=args.blocking, max_time_s=args.max_time_s or 0.0,
            started_at=started_at,
        )
        opts = LearnerOptions(
            name=swarm.name, shard=args.shard, num_shards=num_shards, max_steps=args.steps or cfg.inner.total_steps,
            sync=sync, incarnation=incarnation,
            lr_by_time=args.lr_schedule == "time" or (args.lr_schedule is None and bool(args.max_time_s)),
            lr_tokens=args.lr_tokens or 0,
            checkpoint_dir=checkpoint_dir, checkpoint_every_s=args.checkpoint_every_s or 0.0,
            eval_every_s=args.eval_every_s, eval_batches=args.eval_batches, train_nice=args.train_nice,
            device=str(device),
        )
        make: type[Learner] = Learner
        if armed:  # before the averagers start: their processes are forked with the faults armed
            faults.arm(armed)
            out(f"faults armed: {', '.join(f.spec for f in armed)}")
            from p2p_diloco.learner.loop import FaultyLearner

            make = FaultyLearner  # the fault points wrap the loop and the transport: only here
        learner = make(cfg, profile, opts, swarm, splits=splits)
        try:
            if resume is not None:
                digest = learner.restore(resume)  # recomputed from what was restored, not copied
                out(f"resumed from {resume.path}: step {learner.step}, model {digest}, "
                     f"versions {[s.version for s in learner.slots]}, anchors {' '.join(s.anchor_hash for s in learner.slots)}")
            out(f"learner {swarm.name}: {learner.data_stream}, profile {profile.name}, "
                 f"{opts.max_steps} steps, {cfg.outer.fragments} fragments, codec {cfg.outer.codec}, "
                 f"device {opts.device} ({cfg.inner.precision})")
            summary: dict[str, Any] = learner.run(stop.event, stop.finish)
        finally:
            learner.close()
        out("final " + json.dumps(summary))
        ok = swarm.close()
        out(f"left run {local.run_id} ({stop.signal_name or 'done'}); tombstone {'published' if ok else 'NOT accepted'}")
    return 0


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """``--device``, shared with ``p2p-diloco sim``: a per-peer choice, not part of the run's config (hash)."""
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="where the model and the inner optimizer live: auto (the first CUDA GPU if there is one, "
                        "else the CPU), cpu, cuda or cuda:N (default: auto). Anchors, outer momentum and the outer "
                        "step stay fp32 on the CPU, so peers on different devices keep bit-identical anchors")


def add_parsers(subparsers: Any) -> None:
    """Register ``join`` on ``cli.build_parser``'s subparsers."""
    help = ("run a learner unit: inner AdamW steps on its own data stream, fragments averaged in the background with the "
            "live peers; SIGINT/SIGTERM leave gracefully (rounds in flight cancelled); SIGUSR1 finishes as --max-time "
            "does (the last progress averaged in final rounds, then the linger)")
    p = subparsers.add_parser("join", help=help, description=help)
    p.set_defaults(handler=cmd_join, identity=None)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log what happens (INFO) on stderr: a line per round, downloads, the sync clock, and the "
                        "tracebacks of failures that are handled (a round discarded, a retry). Without it, stderr "
                        "holds warnings and errors only (a failed round: one line); stdout shows the start, the "
                        "final summary and the leave either way")
    add_network_args(p, peers_required=True, listen=True)
    add_config_args(p)
    add_run_id_arg(p)
    p.add_argument("--name", default="", help="peer name shown by status (default: peer-<end of peer id>)")
    p.add_argument("--profile", metavar="FILE", help="peer profile (TOML: name, slowdown, min_step_s, threads): a "
                   "file, or a bundled profile by name (peers/half.toml, half, fast)")
    add_device_arg(p)
    p.add_argument("--shard", type=int, metavar="I",
                   help="train on data shard I of --num-shards disjoint shards of the training set (for benchmarks "
                        "that need fixed, reproducible data per learner). Default: no shard, random windows of the "
                        "whole training set in this learner's own order, seeded by the run seed, the peer id and "
                        "this start, so any number of learners see different data without coordinating")
    p.add_argument("--num-shards", dest="num_shards", type=int, metavar="N",
                   help="with --shard, required: the number of shards")
    p.add_argument("--steps", type=int, help="inner steps to run, >= 1 (default: inner.total_steps)")
    p.add_argument("--max-time", dest="max_time_s", type=float, metavar="SECONDS",
                   help="stop training this many seconds after this learner started (start-up and --wait-peers "
                        "count too), then leave (default: no limit)")
    p.add_argument("--lr-schedule", dest="lr_schedule", choices=("steps", "time"),
                   help="what the inner LR's warm-up + cosine runs over: steps (inner.total_steps) or time (the cosine "
                        "ends with --max-time if that comes first); default: time with --max-time, else steps")
    p.add_argument("--lr-tokens", dest="lr_tokens", type=int, metavar="N",
                   help="also end the inner LR's cosine once the swarm has trained N tokens, if that comes first "
                        "(every live learner's published count; p2p-diloco swarm sets it to its token budget, so a "
                        "swarm stopped there anneals as data-parallel training of those tokens does); default: none")
    p.add_argument("--blocking", action="store_true",
                   help="wait for each round before the next inner step (synchronous DiLoCo, a baseline for "
                        "benchmarks; the default never waits)")
    p.add_argument("--train-nice", dest="train_nice", type=int, default=5, metavar="N",
                   help="lower the training thread's CPU priority by N once it trains (default: 5), so that this "
                        "peer's networking is not starved; also our session's autogroup's, when this process leads "
                        "its session (as under p2p-diloco swarm), once it has joined (its first committed round, "
                        f"or {JOINING_MAX_S:.0f} s into training), so that a newcomer on the same machine is not; "
                        "0: no change")
    p.add_argument("--view-period", dest="view_period_s", type=float, default=3.0, metavar="SECONDS",
                   help="while training, read the swarm's records and sync clock this often (default: 3). Each read "
                        "is answered by every DHT node that holds the run's records, with all of them: at 1 s, "
                        "on a 4-peer swarm, more bytes than the pseudo-gradients")
    p.add_argument("--eval-every", dest="eval_every_s", type=float, default=0.0, metavar="SECONDS",
                   help="evaluate the global model on --eval-batches held-out batches this often while training, "
                        "as 'eval' events in --events (default: 0, only at the start and the end)")
    p.add_argument("--eval-batches", type=int, default=2, metavar="N",
                   help="held-out batches per --eval-every evaluation (default: 2; data.eval_batches: the whole "
                        "set, as at the end)")
    p.add_argument("--events", metavar="FILE", help="append one JSON line per round / resync to FILE")
    p.add_argument("--metrics", action="append", default=[], metavar="KIND:PATH",
                   help="also send the --events records to a metrics sink (repeatable): tensorboard:DIR writes "
                        "scalars (inner loss, eval loss, tokens/s, round outcomes, group sizes, bytes; x-axis: "
                        "inner step) for `tensorboard --logdir DIR`; jsonl:FILE is like --events; "
                        "prometheus:[HOST:]PORT serves their latest values at http://HOST:PORT/metrics for a "
                        "Prometheus scraper (HOST: 127.0.0.1, or 0.0.0.0 to be reachable from the network)")
    p.add_argument("--wait-peers", dest="wait_peers", type=int, metavar="N",
                   help="wait until N learners (us included) are live before the first step")
    p.add_argument("--serve", dest="serve_s", type=float, default=0.0, metavar="SECONDS",
                   help="after training and the linger, stay this long so newcomers can download our state "
                        "(default: 0, leave at once)")
    p.add_argument("--checkpoint-dir", dest="checkpoint_dir", metavar="DIR",
                   help="save checkpoints here (safetensors + manifest, atomic): when leaving, and every "
                        "--checkpoint-every seconds")
    p.add_argument("--checkpoint-every", dest="checkpoint_every_s", type=float, default=0.0, metavar="SECONDS",
                   help="seconds between checkpoints, written in the background (default: only when leaving)")
    p.add_argument("--resume", metavar="DIR", help="start from the newest complete checkpoint in DIR (checked against "
                   "the config hash); later checkpoints go there too unless --checkpoint-dir says otherwise")
    p.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC",
                   help="for tests and drills: fail at a chosen point, e.g. kill@while-reducing:fragment=0:at=2, "
                        "stall@inner-step:at=40:seconds=20 or raise@inner-step:at=3 (see p2p_diloco/faults.py)")
    p.add_argument("--linger", dest="linger_s", type=float, default=20.0, metavar="SECONDS",
                   help="after the final rounds, wait up to this long for the peers to agree (default: 20)")
    p.add_argument("--final-wait", dest="final_wait_s", type=float, default=25.0, metavar="SECONDS",
                   help="leaving, a fragment's final round goes only to a boundary on the sync clock within this "
                        "long of the end of training; one further off is skipped, its last progress unsynced "
                        "(default: 25; only a slow link's longer sync period skips any)")
