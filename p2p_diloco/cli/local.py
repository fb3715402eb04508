"""`swarm`: a local swarm of learner processes on this machine."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from p2p_diloco.core import resources
from p2p_diloco.core.config import override_arg  # standard library only: --help stays fast
from p2p_diloco.core.console import out
from p2p_diloco.core.tokenizer import loss_unit  # standard library only: --help stays fast
from p2p_diloco.engine.metrics import check_listen  # standard library only: --help stays fast
from p2p_diloco.local.launcher import NO_STEP_LIMIT, Child, LocalSwarm, unlimited_steps
from p2p_diloco.net.dashboard import parse_serve_address  # standard library only: --help stays fast
from p2p_diloco.local.run import (
    DEFAULT_CONFIG,
    DEFAULT_MINUTES,
    DEFAULT_PROFILES,
    EVAL_EVERY_S,
    FINISH_SLACK_S,
    LINGER_S,
    VIEW_PERIOD_S,
    Chaos,
    Ending,
    LiveView,
    TokenStop,
    began_training,
    build_report,
    compute_reference,
    ending,
    estimate_s,
    plot,
    reference_action,
    stored_reference,
    token_budget,
    write_report,
)

logger = logging.getLogger(__name__)


def cmd_swarm(args: argparse.Namespace) -> int:
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.identity import config_hash
    from p2p_diloco.sim.reference import curve_end, folders, load_curves, reference_key

    # resolved here (a bundled name becomes its path): the learners, the report and the reference all read this file
    config_path = str(resources.find(args.config, resources.CONFIGS) if args.config
                      else resources.bundled(resources.CONFIGS, DEFAULT_CONFIG))
    if args.peers < 2:
        raise ValueError(f"--peers: a swarm needs at least 2 learners, got {args.peers}")
    if args.minutes < 0:
        raise ValueError(f"--minutes: must be >= 0, got {args.minutes}")
    seconds = args.minutes * 60 if args.minutes > 0 else None
    # a time budget alone ends the training, whatever the machine's speed: no step cap, and the LR's
    # warm-up + cosine runs over the time (an explicit --set inner.total_steps=N still caps it)
    serve = parse_serve_address(args.serve, "--serve") if args.serve else None
    if serve is not None:  # a taken port fails here, before anything starts
        check_listen(serve, f"--serve {serve.host}:{serve.port}")
    overrides = unlimited_steps(args.overrides) if seconds else list(args.overrides)
    cfg = load_config(config_path, overrides)
    # ... up to a token budget: where the stored data-parallel curves end, so the reference is never computed
    ref_cfg = load_config(config_path, [*args.overrides, f"sim.learners={args.peers}"])  # K replicas: the swarm's
    ends = [curve_end(c) for c in load_curves(reference_key(ref_cfg), folders())]
    stop_tokens, stop_why = token_budget(args.max_tokens, seconds, ends)
    from p2p_diloco.core.devices import machine_device
    from p2p_diloco.core.model import check_buildable

    # every learner trains on this machine (--device auto): all of them must fit, before anything starts
    check_buildable(cfg.model, machine_device("auto"), args.peers, "--peers")
    profiles = ([resources.find(p, resources.PEERS) for p in args.profiles.split(",")] if args.profiles
                else [resources.bundled(resources.PEERS, p) for p in DEFAULT_PROFILES])
    from p2p_diloco.engine.options import Profile

    loaded = [Profile.load(p) for p in profiles]  # a bad profile fails before anything starts
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    step_capped = cfg.inner.total_steps < NO_STEP_LIMIT
    budget_tokens = args.peers * cfg.inner.total_steps * cfg.inner.batch_size * cfg.model.block_size if step_capped else None
    common = ["--config", config_path]
    common += [a for o in overrides for a in ("--set", o)]
    network = ["--swarm-key", args.swarm_key] if args.swarm_key else []
    budget = " or ".join(([f"{cfg.inner.total_steps} steps"] if step_capped else [])
                         + ([f"{args.minutes:g} min of training"] if seconds else []))
    out(f"swarm: {args.peers} learners ({', '.join(p.name for p in loaded)}), config {config_path} "
         f"(hash {config_hash(cfg)}), budget {budget} per learner"
         + ("" if step_capped else " (no step limit)")
         + (f", {stop_tokens:,} tokens in all ({stop_why})" if stop_tokens else "") + f"; output in {out_dir}")
    t0 = time.monotonic()
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    events: list[dict[str, Any]] = []
    finals: dict[str, dict[str, Any]] = {}
    endings: list[Ending] = []
    token_stop = TokenStop(stop_tokens, out_dir / "logs")
    try:
        with LocalSwarm(out_dir / "logs", grace_s=LINGER_S + 30) as swarm:
            peers = swarm.start_bootstrap("--host", args.host, *network, *common)
            out(f"bootstrap: {peers}")
            if serve is not None:  # `status --serve` beside the learners: the page of this run
                out(f"swarm: {swarm.start_page(serve.host, serve.port, *network)}")
            if args.host not in ("127.0.0.1", "localhost"):
                out(f"other machines join with: p2p-diloco join --initial-peers {peers} "
                     + " ".join(common + network))

            def start_learner(i: int, *, wait: int, max_time_s: float | None, suffix: str = "") -> Child:
                name = f"{loaded[i % len(loaded)].name}-{i}{suffix}"
                argv = ["join", "--initial-peers", peers, *common, *network, "--host", args.host, "--name", name,
                        "--profile", str(profiles[i % len(profiles)]), "--shard", str(i), "--num-shards",
                        str(args.peers), "--wait-peers", str(wait), "--linger", str(LINGER_S),
                        "--events", str(out_dir / "logs" / f"{name}.jsonl"), "--eval-every", f"{EVAL_EVERY_S:g}"]
                if max_time_s is not None:
                    argv += ["--max-time", f"{max_time_s:.1f}"]
                if stop_tokens:  # stopped at the token budget: its LR has annealed by then, as the reference's has
                    argv += ["--lr-tokens", str(stop_tokens)]
                return swarm.start(name, argv)

            learners = [start_learner(i, wait=args.peers, max_time_s=seconds) for i in range(args.peers)]
            chaos = Chaos(args.chaos, seconds or estimate_s(cfg), learners, start_learner, seconds, events,
                          lambda c: began_training(out_dir / "logs" / f"{c.name}.jsonl"))
            view = LiveView(args, cfg, peers, stop_tokens or budget_tokens, seconds)
            try:
                deadline = t0 + (seconds or 24 * 3600) + 120 + FINISH_SLACK_S
                while not stop.is_set() and time.monotonic() < deadline:
                    done = [c for c in swarm.learners() if not c.alive or c.final() is not None]
                    if len(done) == len(swarm.learners()):
                        break
                    if not token_stop.tick(swarm.learners(), list(chaos.killed), time.monotonic() - t0):
                        chaos.tick()  # once the learners finish, nobody is killed or restarted
                    view.update(time.monotonic() - t0, events)
                    stop.wait(VIEW_PERIOD_S)
            finally:
                view.close()
            if stop.is_set():
                out("swarm: interrupted; stopping every learner gracefully (they leave the swarm and report)")
            swarm.close()
            for c in swarm.learners():
                summary = c.final()
                if summary is not None:
                    finals[c.name] = summary
                elif c.name not in chaos.killed:
                    out(f"swarm: {c.name} ended without a final summary (exit {c.popen.poll()}); see {c.log_path}")
                endings.append(ending(c, t0, chaos))
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    report = build_report(cfg, config_path, args, finals, events, out_dir, time.monotonic() - t0, endings)
    report["token_budget"] = {"tokens": stop_tokens, "why": stop_why, "reached_s": token_stop.reached_s}
    tokens = report["tokens"]
    stored, why = stored_reference(ref_cfg, tokens)
    action, why = reference_action(stored is not None, why, tokens, args.no_reference, stop.is_set())
    if action == "use":
        report["reference"] = stored
    elif action == "compute":
        write_report(report, out_dir)  # on disk before the reference is computed (Ctrl+C there keeps it)
        try:
            report["reference"] = compute_reference(config_path, args, ref_cfg, tokens, why, time.monotonic() - t0)
        except KeyboardInterrupt:
            stop.set()
            out("data-parallel reference: interrupted; the report has none")
            report["reference"] = {"tokens": tokens, "eval_loss": None, "why": why + "; computing one was interrupted"}
    elif tokens > 0:
        report["reference"] = {"tokens": tokens, "eval_loss": None, "why": why}
    out(write_report(report, out_dir))
    try:
        plot(out_dir, loss_unit(cfg))
        out(f"swarm: wrote {out_dir}/summary.json, summary.md, loss.png, rounds.png")
    except Exception as e:  # plots are a convenience: the report is already on disk
        out(f"swarm: could not draw the plots ({type(e).__name__}: {e}); the report is in {out_dir}/summary.json")
    return 130 if stop.is_set() else 0


def add_parsers(subparsers: Any) -> None:
    """Register ``swarm`` on ``cli.build_parser``'s subparsers."""
    help = ("run a whole swarm here: a bootstrap peer and N learner processes with mixed profiles, a live view, "
            "and a report with plots; Ctrl+C stops everything cleanly")
    p = subparsers.add_parser("swarm", help=help, description=help)
    p.set_defaults(handler=cmd_swarm)
    p.add_argument("--peers", type=int, default=4, help="learner processes (default: 4)")
    p.add_argument("--profiles", metavar="FILES",
                   help="comma-separated peer profiles, used in turn: files, or names of bundled ones (fast, half); "
                        f"default: {','.join(DEFAULT_PROFILES)}")
    p.add_argument("--config", metavar="FILE",
                   help=f"run config: a file, or the name of a bundled one (e.g. tiny); default: {DEFAULT_CONFIG}")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[], type=override_arg,
                   help="override one config value (repeatable)")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                   help=f"training time of every learner, in minutes, however fast the machine (no step limit "
                        f"unless --set inner.total_steps=N; default: {DEFAULT_MINUTES:g}; 0 = the config's step "
                        "budget, inner.total_steps, however long that takes)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, metavar="N",
                   help="every learner finishes (as at --minutes) once together they have trained N tokens; default "
                        "with --minutes: the longest stored data-parallel curve's end, so that the report's reference is "
                        "read, never computed after the run; 0: no token budget")
    p.add_argument("--host", default="127.0.0.1", help="address the peers listen on (a LAN address lets other machines "
                   "join; default 127.0.0.1)")
    p.add_argument("--swarm-key", dest="swarm_key", metavar="FILE", help="private swarm: the key file from keygen")
    p.add_argument("--chaos", action="store_true", help="kill -9 one learner a third into the training (counted from "
                   "when every learner trains), restart it at half")
    p.add_argument("--out", default="runs/swarm", help="output folder for the report, plots and logs (default: runs/swarm)")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--no-reference", dest="no_reference", action="store_true",
                   help="when no stored data-parallel curve covers the run's tokens, do not compute one (computing "
                        "takes about a third of the training time on an idle 2-core machine; computed curves are cached in "
                        "~/.cache/p2p-diloco)")
    p.add_argument("--serve", metavar="[HOST:]PORT",
                   help="serve the run's page while it trains (p2p-diloco status --serve: peers, fragment versions, "
                        "loss and rounds charts, /api/status, /metrics); HOST: 127.0.0.1 (default) or 0.0.0.0 to be "
                        "reachable from the network")
