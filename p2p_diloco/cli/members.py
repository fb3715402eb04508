"""`bootstrap`, `heartbeat` and `keygen`: the commands of members that do not train (and the swarm secret)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from p2p_diloco.cli.common import (
    DEFAULT_BOOTSTRAP_IDENTITY,
    DEFAULT_SWARM_KEY,
    DEFAULT_TTL_S,
    MIN_WATCH_INTERVAL_S,
    StopOnSignal,
    add_config_args,
    add_network_args,
    add_run_id_arg,
    resolve_config,
    setup_logging,
)
from p2p_diloco.cli.doctor import cmd_doctor
from p2p_diloco.cli.status import cmd_status
from p2p_diloco.core.console import out
from p2p_diloco.core.logs import log_handled
from p2p_diloco.hivemind_ext.procguard import stop_process
from p2p_diloco.net.arguments import swarm_options
from p2p_diloco.net.joined import joined_run
from p2p_diloco.net.report import CONSENSUS

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config
    from p2p_diloco.net.membership import SwarmOptions
    from p2p_diloco.net.runconfig import RunAnnouncer

logger = logging.getLogger(__name__)

SIGNAL_POLL_S = 0.5
"""A bootstrap's main thread wakes this often while it waits to be stopped, so that a signal one of hivemind's threads
received runs our handler (signal handlers run on the main thread, and only once it runs)."""


# ---------------------------------------------------------------- bootstrap


def cmd_bootstrap(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    from p2p_diloco.core.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_id = cfg.run.run_id
    opts = swarm_options(args, client_mode=False, default_identity=DEFAULT_BOOTSTRAP_IDENTITY)
    from p2p_diloco.net.keys import swarm_key_fingerprint
    from p2p_diloco.net.keptport import remember_port, with_kept_port

    keep_port = opts.port == 0 and opts.identity is not None  # no --port: the one of our last start, if still free
    if keep_port:
        opts = with_kept_port(opts)
    from p2p_diloco.net.membership import start_dht, visible_addresses

    with StopOnSignal() as stop:
        dht = start_dht(opts, run_id, private_key=opts.identity.private_key() if opts.identity else None)
        announcer = None
        try:
            maddrs = visible_addresses(dht)
            if keep_port and maddrs:
                assert opts.identity is not None
                remember_port(opts.identity.path, maddrs[0])
            peers = ",".join(maddrs)
            key = f" --swarm-key {args.swarm_key}" if args.swarm_key else ""
            out(f"peer id: {dht.peer_id}")
            if opts.identity is not None:
                out(f"identity: {opts.identity.path}")
            if opts.swarm_key is not None:
                out(f"private swarm, key fingerprint {swarm_key_fingerprint(opts.swarm_key)}")
            for m in maddrs:
                out(f"listening: {m}")
            out(f"initial peers: {peers}")
            announcer = _announce_run(dht, opts, cfg)
            for line in join_instructions(peers, key, args.config, args.overrides):
                out(line)
            if opts.host == "127.0.0.1":
                out("(listening on 127.0.0.1: only this machine can join; use --host <LAN address> for a LAN swarm)")
            out("ready; Ctrl+C to stop")
            # in short waits: a signal that one of hivemind's threads receives runs our handler only once the main
            # thread wakes (SIGTERM to the process group left a bootstrap waiting, handler never run, past 60 s)
            while not stop.event.wait(SIGNAL_POLL_S):
                pass
            out(f"stopping ({stop.signal_name})")
        finally:
            if announcer is not None:
                announcer.stop()
            stop_process(dht, "DHT process")
    return 0


def join_instructions(peers: str, key: str, config: str | None, overrides: list[str]) -> list[str]:
    """What ``bootstrap`` prints after its addresses: a join command that works when pasted (the run's
    config comes from the DHT), the same with the config file as an alternative, the status command."""
    import shlex

    lines = ["join from another machine or terminal with (the run's config comes from the DHT):",
             f"  p2p-diloco join --initial-peers {peers}{key}"]
    if config or overrides:
        local = " ".join([f"--config {shlex.quote(config)}"] if config else []) + "".join(
            f" --set {shlex.quote(o)}" for o in overrides)
        lines.append(f"  # or, with the config file on that machine: p2p-diloco join --initial-peers {peers}{key} "
                     f"{local.strip()}")
    lines += ["look at the run with:", f"  p2p-diloco status --initial-peers {peers}{key}"]
    return lines


def _announce_run(dht: Any, opts: "SwarmOptions", cfg: "Config") -> "RunAnnouncer":
    """A bootstrap's announcement of its run (index entry in state ``bootstrap``, never a member) and its
    config record, published now and then refreshed in a thread; returns the running announcer."""
    from p2p_diloco import __version__
    from p2p_diloco.core.config import PROTOCOL_VERSION
    from p2p_diloco.core.identity import config_hash
    from p2p_diloco.net.records import ANNOUNCE_STATE, IndexEntry
    from p2p_diloco.net.runconfig import (
        ANNOUNCE_TTL_S,
        BOOTSTRAP_CONFIG_REFRESH_S,
        CONFIG_TTL_FACTOR,
        RunAnnouncer,
        config_record,
    )

    assert opts.identity is not None  # a bootstrap always has one (DEFAULT_BOOTSTRAP_IDENTITY)
    peer_id = dht.peer_id.to_base58()
    entry = IndexEntry(run_id=cfg.run.run_id, protocol_version=PROTOCOL_VERSION, config_hash=config_hash(cfg),
                       software_version=__version__, peer_id=peer_id, name="bootstrap", state=ANNOUNCE_STATE, time=0.0)
    announcer = RunAnnouncer(dht, opts.identity.private_key(), config_record(cfg, peer_id, 0.0),
                             config_refresh_s=BOOTSTRAP_CONFIG_REFRESH_S, config_ttl_s=CONFIG_TTL_FACTOR * ANNOUNCE_TTL_S,
                             announcement=entry, announce_ttl_s=ANNOUNCE_TTL_S)
    try:
        ok = announcer.publish_all()
    except Exception:  # a store that timed out: the thread retries at once
        log_handled(logger, "announcing the run failed; retrying in the background")
        ok = False
    announcer.start(published=ok)
    out(f"run {cfg.run.run_id} (config hash {entry.config_hash}) announced in the DHT" +
         ("" if ok else " (not accepted yet: retrying in the background)"))
    return announcer


def cmd_heartbeat(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    from p2p_diloco.net.records import LocalRun

    if args.ttl_s <= 0:
        raise ValueError(f"--ttl: must be > 0 s, got {args.ttl_s}")
    cfg = resolve_config(args)
    local = LocalRun.from_config(cfg)
    with StopOnSignal() as stop, joined_run(swarm_options(args, client_mode=False), args.name, local, cfg.outer.fragments, ttl_s=args.ttl_s,
                                             profile=args.profile, cfg=cfg) as joined:
        from p2p_diloco.net.membership import read_swarm
        from p2p_diloco.net.probes import check_split

        publisher = joined.publisher
        split_every = max(1, int(args.split_check_every))
        beats = 0
        while not stop.event.wait(publisher.period_s):
            publisher.beat()
            beats += 1
            if beats % split_every == 0:
                report = check_split(joined.dht, read_swarm(joined.dht, local), joined.opts.initial_peers)
                if report.missing:
                    out(f"warning: split swarm suspected: {len(report.missing)} known peers were not in our routing "
                         f"table; re-joined {len(report.healed)}")
        ok = publisher.leave()
        out(f"left run {local.run_id} ({stop.signal_name}); tombstone {'published' if ok else 'NOT accepted'}")
    return 0


# ---------------------------------------------------------------- keygen


def cmd_keygen(args: argparse.Namespace) -> int:
    if args.identity:
        from p2p_diloco.net.keys import load_or_create_identity

        if Path(args.identity).expanduser().exists():
            raise ValueError(f"{args.identity} already exists; it is a peer identity and stays (delete it to make a new one)")
        folder = Path(args.identity).expanduser().parent
        if not folder.is_dir():
            raise ValueError(f"--identity {args.identity}: folder {folder} does not exist; create it first or choose "
                             "another path")
        identity = load_or_create_identity(args.identity)
        out(f"wrote identity {identity.path} (mode 0600); peer id {identity.peer_id}")
        return 0
    from p2p_diloco.net.keys import write_swarm_key

    fingerprint = write_swarm_key(args.out)
    out(f"wrote swarm key {args.out} (mode 0600, fingerprint {fingerprint})")
    out(f"copy it to every peer of the swarm (e.g. scp {args.out} host:), then pass --swarm-key {args.out}")
    return 0


# ---------------------------------------------------------------- registration


def add_parsers(subparsers: Any) -> None:
    """Register the swarm subcommands on ``cli.build_parser``'s subparsers."""
    def add(name: str, help: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = subparsers.add_parser(name, help=help, description=help)
        p.set_defaults(handler=handler)
        p.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO) on stderr")
        return p

    p = add("bootstrap", "run a DHT-only peer that others join through; announces its run (--config, default: the "
            "built-in defaults) and publishes its config in the DHT; prints its addresses and the join command",
            cmd_bootstrap)
    add_network_args(p, peers_required=False, listen=True)
    add_config_args(p)
    p.set_defaults(identity=None)
    p.epilog = (f"Default identity: {DEFAULT_BOOTSTRAP_IDENTITY} (a stable peer id across restarts). Without --port the "
                "port it listened on is kept beside the identity (<identity>.port) and used again at the next start, "
                "so its whole address stays valid (a WARNING and a new port if that one is taken). The bootstrap is "
                "never a member of its run: it only makes the run and its config findable, so that joiners need no "
                "--config.")

    p = add("heartbeat", "join a run as a stand-in member that only publishes its peer record "
            "(until the learner lands); SIGINT/SIGTERM leave gracefully", cmd_heartbeat)
    add_network_args(p, peers_required=True, listen=True)
    add_config_args(p)
    add_run_id_arg(p)
    p.add_argument("--name", default="", help="peer name shown by status (default: peer-<end of peer id>)")
    p.add_argument("--profile", default="", help="peer profile name (kind of machine)")
    p.add_argument("--ttl", dest="ttl_s", metavar="SECONDS", type=float, default=DEFAULT_TTL_S,
                   help=f"record lifetime; published every ttl/3 s (default: {DEFAULT_TTL_S:g})")
    p.add_argument("--split-check-every", type=int, default=5, metavar="N",
                   help="check for a split swarm every N heartbeats (default: 5)")

    p = add("status", "show a run's live peers and swarm summary (joins as a client; works from any machine)",
            cmd_status)
    add_network_args(p, peers_required=True, listen=False)
    add_config_args(p)
    p.add_argument("--run-id", dest="run_id",
                   help="run to look at (default: with --config its run.run_id, else every run of the DHT, the one "
                   "with the most live peers in full); without --config/--set the run's majority config hash is "
                   "taken as the reference and the others are shown as foreign")
    p.add_argument("--json", action="store_true", help="print one JSON object per read")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl+C")
    p.add_argument("--interval", dest="interval_s", type=float, default=2.0, metavar="SECONDS",
                   help=f"refresh period with --watch or --serve, at least {MIN_WATCH_INTERVAL_S:g} (default: 2)")
    p.add_argument("--serve", metavar="[HOST:]PORT",
                   help="serve a page of the run that refreshes itself (peers, fragment versions, loss and rounds "
                        "charts), /api/status (= --json) and /metrics (Prometheus) until Ctrl+C; HOST: 127.0.0.1 "
                        "(default) or 0.0.0.0 to be reachable from the network")
    p.epilog = (f"{CONSENSUS} Departed peers (their tombstones) are listed as left, "
                "whatever config they had. Records live under the DHT keys p2p-diloco.run.<run_id>_peers_<0-15> (16 "
                "shards by peer id; configs under ..._config); the keys p2p-diloco_runs_<0-15> index every peer of every "
                "run (and bootstraps' announcements), so other runs sharing the DHT are listed and their live peers "
                "shown as foreign.")

    p = add("keygen", "write a new swarm secret for a private swarm (or, with --identity, a peer identity key)",
            cmd_keygen)
    p.add_argument("--out", default=DEFAULT_SWARM_KEY, help=f"swarm key file to write (default: {DEFAULT_SWARM_KEY}; never overwritten)")
    p.add_argument("--identity", metavar="FILE", help="write a peer identity key to FILE instead")

    p = add("doctor", "diagnose joining a swarm: reachability, swarm key, compatibility, clock skew; suggests fixes",
            cmd_doctor)
    add_network_args(p, peers_required=True, listen=False)
    add_config_args(p)
    p.add_argument("--run-id", dest="run_id", help="check this run without its config (default: with --config its "
                   "run.run_id, else the run that is in the DHT, with its config fetched from there)")
