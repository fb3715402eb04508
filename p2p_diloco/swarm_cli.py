"""``p2p-diloco`` swarm subcommands: ``bootstrap``, ``heartbeat``, ``status``, ``keygen``, ``doctor``.

Only the standard library is imported here; hivemind (and through it torch) is imported inside
the handlers, so ``p2p-diloco --help`` stays fast. Handlers return an exit code and raise
``ValueError`` (one line) for user errors, which ``cli.main`` prints and turns into exit code 2.

DHT layout (see :mod:`p2p_diloco.records`): each run's records live under
``p2p-diloco.run.<run_id>_peers`` and its config under ``p2p-diloco.run.<run_id>_config``; the
well-known key ``p2p-diloco_runs`` indexes every peer of every run (and bootstraps' announcements),
so ``status`` lists other runs sharing the DHT and shows their peers as foreign, and a peer given no
config finds the run that is there (:mod:`p2p_diloco.runconfig`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from p2p_diloco.procguard import stop_process  # stdlib only: --help stays fast

if TYPE_CHECKING:
    from p2p_diloco.config import Config
    from p2p_diloco.records import LocalRun, RunInfo
    from p2p_diloco.runconfig import RunAnnouncer
    from p2p_diloco.swarm import SwarmOptions, SwarmSnapshot

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_IDENTITY = "~/.p2p-diloco/bootstrap.id"
DEFAULT_SWARM_KEY = "swarm.secret"
DEFAULT_TTL_S = 30.0
MIN_WATCH_INTERVAL_S = 0.5
"""``status --watch --interval``: the shortest refresh period (seconds)."""


# ---------------------------------------------------------------- arguments


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="run config (TOML); its run id and hash identify the run")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config value, e.g. --set run.run_id=myrun (repeatable)")


def _add_run_id_arg(p: argparse.ArgumentParser) -> None:
    """``--run-id`` of a member (``join``, ``heartbeat``): which run of the DHT to fetch the config of."""
    p.add_argument("--run-id", dest="run_id", metavar="ID",
                   help="without --config: join this run of the DHT (its config is fetched from its peers); "
                        "default: the only run that is live (or announced by a bootstrap) there")


def _add_network_args(p: argparse.ArgumentParser, *, peers_required: bool, listen: bool) -> None:
    p.add_argument("--initial-peers", dest="initial_peers", metavar="MADDR", action="append",
                   default=[], required=peers_required,
                   help="multiaddr of a live peer, /ip4/HOST/tcp/PORT/p2p/PEER_ID (repeatable, or comma-separated)")
    p.add_argument("--swarm-key", dest="swarm_key", metavar="FILE",
                   help="shared secret of a private swarm (from p2p-diloco keygen); every peer needs the same file")
    p.add_argument("--join-timeout", dest="join_timeout_s", metavar="SECONDS", type=float, default=10.0,
                   help="give up joining after this many seconds (default: 10)")
    if listen:
        p.add_argument("--host", default="127.0.0.1",
                       help="address to listen on: 127.0.0.1 (this machine, default), a LAN address, or 0.0.0.0 with --announce")
        p.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port)")
        p.add_argument("--announce", metavar="MADDR", action="append", default=[],
                       help="address others should dial, with an explicit port, e.g. /ip4/192.168.1.5/tcp/31337 (repeatable)")
        p.add_argument("--identity", metavar="FILE", help="key file for a stable peer id (created with mode 0600 if missing)")


def _light_hivemind_import() -> None:
    """Make ``import hivemind.dht`` skip ``hivemind/__init__`` in this CLI process.

    hivemind's package ``__init__`` imports the averager, MoE and optimizer stacks (scipy among
    them): ~0.6 s of a ~3 s import, on every ``status``. We register the package with its real
    ``__path__`` but without running ``__init__``; the first attribute looked up on the package
    itself (``from hivemind import X``) runs the real ``__init__`` then, so nothing breaks later.
    torch is still imported (``hivemind.utils.mpfuture`` needs it): that is the other ~2 s.
    """
    if "hivemind" in sys.modules:
        return
    import importlib.util
    import types

    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return  # not installed as a plain package: import it the normal way
    module = types.ModuleType("hivemind")
    module.__spec__, module.__file__ = spec, spec.origin
    module.__path__ = list(spec.submodule_search_locations)
    loaded: list[bool] = []

    def __getattr__(name: str) -> Any:
        submodule = sys.modules.get(f"hivemind.{name}")
        if submodule is not None:  # `import hivemind.a.b as x` looks up hivemind.a while it is still loading
            return submodule
        if loaded or name.startswith("__"):
            raise AttributeError(f"module 'hivemind' has no attribute {name!r}")
        loaded.append(True)
        logger.debug("hivemind.%s requested: running hivemind/__init__ now", name)
        exec(compile(Path(spec.origin).read_text(), spec.origin, "exec"), module.__dict__)
        return getattr(module, name)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules["hivemind"] = module


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _swarm_options(args: argparse.Namespace, *, client_mode: bool, default_identity: str | None = None) -> "SwarmOptions":
    from p2p_diloco.addresses import check_port_free, host_multiaddr, parse_announce_address, parse_initial_peers

    initial = parse_initial_peers(args.initial_peers)  # before importing hivemind: bad input fails fast
    host, port = getattr(args, "host", "127.0.0.1"), getattr(args, "port", 0)
    host_multiaddr(host, port)  # validates --host / --port before anything starts
    announce = tuple(parse_announce_address(a) for a in getattr(args, "announce", []))
    if host in ("0.0.0.0", "::") and not announce:
        raise ValueError(f"--host {host}: listening on all interfaces needs --announce /ip4/<LAN address>/tcp/<port> "
                         f"so that others know where to dial")
    if announce and port == 0:
        raise ValueError("--announce needs a fixed --port (the announced port must be the one we listen on)")
    if port != 0:
        check_port_free(host, port)  # libp2p would share a taken port silently (SO_REUSEPORT)
    from p2p_diloco.identity import read_swarm_key

    swarm_key = read_swarm_key(args.swarm_key) if args.swarm_key else None  # before an identity file is created
    _light_hivemind_import()
    from p2p_diloco.identity import load_or_create_identity
    from p2p_diloco.swarm import SwarmOptions

    identity_path = getattr(args, "identity", None) or default_identity
    identity = load_or_create_identity(identity_path) if identity_path else None
    if args.join_timeout_s <= 0:
        raise ValueError(f"--join-timeout: must be > 0 s, got {args.join_timeout_s}")
    return SwarmOptions(
        initial_peers=initial, host=host, port=port, announce=announce, identity=identity,
        client_mode=client_mode, swarm_key=swarm_key,
        join_timeout_s=args.join_timeout_s,
    )


def _local_run(args: argparse.Namespace, *, observer: bool = False) -> "LocalRun":
    """The run we belong to / look at.

    With a config (``--config``/``--set``, or the defaults when not ``observer``) peers are
    compared with it. An observer without one (``status``, optionally ``--run-id``) adopts the
    run's majority protocol version and config hash, so it shows the odd ones out as foreign.
    """
    from p2p_diloco.config import PROTOCOL_VERSION, load_config
    from p2p_diloco.records import LocalRun

    run_id = getattr(args, "run_id", None)
    if (run_id or observer) and not args.config and not args.overrides:
        from p2p_diloco import __version__

        return LocalRun(run_id or load_config().run.run_id, PROTOCOL_VERSION, "", __version__)
    cfg = load_config(args.config, args.overrides)
    local = LocalRun.from_config(cfg)
    if run_id and run_id != local.run_id:
        raise ValueError(f"--run-id {run_id!r} contradicts the config's run.run_id {local.run_id!r}; give one of them")
    return local


def resolve_config(args: argparse.Namespace) -> "Config":
    """The config a member (``join``, ``heartbeat``) runs with.

    ``--config FILE`` (and ``--set``): as given. Without it, the config of the run that is in the DHT:
    a short client-mode look-up (a fresh key, any port) reads the run index, picks the run
    (:func:`records.pick_run`, or ``--run-id``), fetches its config and keeps it only if it hashes to
    what the run's peers announce (:mod:`p2p_diloco.runconfig`); ``--set`` applies on top (the join
    check then compares the result with the live peers as usual). Never the built-in defaults: they
    would be another run. Errors are one line (``ValueError``).
    """
    import dataclasses

    from p2p_diloco.config import config_hash, load_config

    run_id = getattr(args, "run_id", None)
    if args.config:
        cfg = load_config(args.config, args.overrides)
        if run_id and run_id != cfg.run.run_id:
            raise ValueError(f"--run-id {run_id!r} contradicts the config's run.run_id {cfg.run.run_id!r}; "
                             f"give one of them")
        return cfg
    opts = _swarm_options(args, client_mode=True)
    opts = dataclasses.replace(opts, identity=None, check_identity_free=False, port=0, announce=())
    from p2p_diloco.records import pick_run
    from p2p_diloco.runconfig import fetch_config, read_runs
    from p2p_diloco.swarm import start_dht

    dht = start_dht(opts, None)
    try:
        runs, _rejected = read_runs(dht)
        run = pick_run(runs, run_id)
        cfg, _record = fetch_config(dht, run, args.overrides)
    finally:
        stop_process(dht, "DHT process")
    _out(f"config: fetched run {run.run_id} (hash {run.config_hash}) from the DHT"
         + (f"; with --set: hash {config_hash(cfg)}" if args.overrides else ""))
    return cfg


class _StopOnSignal:
    """SIGINT/SIGTERM set an event (graceful leave) instead of raising in the middle of a DHT call; a
    second one exits at once (``128 + signal``), without the leave: the helper processes die with us
    (:mod:`p2p_diloco.procguard`) and our record expires after its TTL."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name = ""

    def __enter__(self) -> "_StopOnSignal":
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.event.is_set():
            # os.write, not print: a handler may run while the main thread is inside a print
            os.write(2, f"p2p-diloco: {name} again: exiting now, without a graceful leave\n".encode())
            os._exit(128 + signum)
        self.signal_name = name
        self.event.set()
        os.write(2, f"p2p-diloco: {name}: leaving gracefully ({name} again to exit at once)\n".encode())

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def _out(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------- bootstrap


def cmd_bootstrap(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    from p2p_diloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_id = cfg.run.run_id
    opts = _swarm_options(args, client_mode=False, default_identity=DEFAULT_BOOTSTRAP_IDENTITY)
    from p2p_diloco.swarm import start_dht, swarm_key_fingerprint, visible_addresses

    with _StopOnSignal() as stop:
        dht = start_dht(opts, run_id, private_key=opts.identity.private_key() if opts.identity else None)
        announcer = None
        try:
            maddrs = visible_addresses(dht)
            peers = ",".join(maddrs)
            key = f" --swarm-key {args.swarm_key}" if args.swarm_key else ""
            _out(f"peer id: {dht.peer_id}")
            if opts.identity is not None:
                _out(f"identity: {opts.identity.path}")
            if opts.swarm_key is not None:
                _out(f"private swarm, key fingerprint {swarm_key_fingerprint(opts.swarm_key)}")
            for m in maddrs:
                _out(f"listening: {m}")
            _out(f"initial peers: {peers}")
            announcer = _announce_run(dht, opts, cfg)
            for line in join_instructions(peers, key, args.config, args.overrides):
                _out(line)
            if opts.host == "127.0.0.1":
                _out("(listening on 127.0.0.1: only this machine can join; use --host <LAN address> for a LAN swarm)")
            _out("ready; Ctrl+C to stop")
            stop.event.wait()
            _out(f"stopping ({stop.signal_name})")
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
    from p2p_diloco.config import PROTOCOL_VERSION, config_hash
    from p2p_diloco.records import ANNOUNCE_STATE, IndexEntry
    from p2p_diloco.runconfig import (
        ANNOUNCE_TTL_S, BOOTSTRAP_CONFIG_REFRESH_S, CONFIG_TTL_FACTOR, RunAnnouncer, config_record,
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
        logger.exception("announcing the run failed; retrying in the background")
        ok = False
    announcer.start(published=ok)
    _out(f"run {cfg.run.run_id} (config hash {entry.config_hash}) announced in the DHT" +
         ("" if ok else " (not accepted yet: retrying in the background)"))
    return announcer


# ---------------------------------------------------------------- heartbeat (stand-in member)


@dataclass(frozen=True)
class Joined:
    """A peer that joined a run: its DHT, its record publisher, and what it saw when joining."""

    dht: Any
    publisher: Any
    opts: "SwarmOptions"
    snapshot: "SwarmSnapshot"
    peer_id: str
    name: str
    private_key: Any


@contextlib.contextmanager
def joined_run(args: argparse.Namespace, local: "LocalRun", num_fragments: int, *, ttl_s: float,
               state: str = "idle", profile: str = "", cfg: "Config | None" = None) -> Iterator[Joined]:
    """Join ``local``'s run as a member (shared by ``heartbeat`` and the learner's ``join``).

    Starts the DHT (a fresh private identity unless ``--identity``), refuses to go on if the run's
    live peers disagree with our config hash or protocol (:func:`records.check_join`), publishes our
    first record and, given the run's ``cfg``, our config record (refreshed every
    ``CONFIG_REFRESH_FACTOR x ttl_s``: how a joiner without a config finds it) and prints the
    ``joined run`` line. On exit the DHT is shut down; a graceful
    leave (tombstone) is the caller's ``joined.publisher.leave()``.
    """
    from p2p_diloco.records import PeerRecord, check_join

    opts = _swarm_options(args, client_mode=False)
    from p2p_diloco.swarm import RecordPublisher, read_swarm, start_dht, visible_addresses

    ephemeral = opts.identity is None
    if ephemeral:  # no --identity: a fresh key, written to a private temp file so libp2p uses it too
        opts = _ephemeral_identity(opts)
    assert opts.identity is not None
    key = opts.identity.private_key()
    try:
        dht = start_dht(opts, local.run_id, private_key=key)
    except BaseException:
        if ephemeral:
            _remove_ephemeral(opts)
        raise
    announcer = None
    try:
        peer_id = dht.peer_id.to_base58()
        snapshot = read_swarm(dht, local)
        ok, reason = check_join(snapshot.views, local, peer_id)
        if not ok:
            if cfg is not None:  # other data or tokenizer: say so, naming both fingerprints
                from p2p_diloco.runconfig import explain_refusal

                reason = explain_refusal(dht, cfg, snapshot.views, reason)
            raise ValueError(reason)
        name = args.name or f"peer-{peer_id[-6:]}"
        record = PeerRecord(
            run_id=local.run_id, protocol_version=local.protocol_version, config_hash=local.config_hash,
            software_version=local.software_version, peer_id=peer_id, name=name, profile=profile,
            addresses=tuple(visible_addresses(dht)), state=state, fragment_versions=(0,) * num_fragments,
        )
        publisher = RecordPublisher(dht, key, record, ttl_s=ttl_s)
        if not publisher.publish_within(deadline_s=opts.join_timeout_s * 3):
            raise ValueError(f"could not publish our peer record within {opts.join_timeout_s * 3:.0f} s: "
                             "no DHT node accepted it (see the log above)")
        if cfg is not None:
            announcer = _publish_config(dht, key, cfg, peer_id, ttl_s)
        for v in snapshot.views:
            if v.status == "foreign":
                _out(f"note: foreign peer {v.record.name} ({v.peer_id}): {v.reason}")
        _out(f"joined run {local.run_id} as {name} ({peer_id}); config hash {local.config_hash}; "
             f"{len(snapshot.live())} other live peers; heartbeat every {ttl_s / 3:.1f} s, ttl {ttl_s:g} s")
        for m in record.addresses:
            _out(f"listening: {m}")
        with leave_on_failure(publisher):
            yield Joined(dht, publisher, opts, snapshot, peer_id, name, key)
    finally:
        if announcer is not None:
            announcer.stop()
        stop_process(dht, "DHT process")
        if ephemeral:
            _remove_ephemeral(opts)


def _publish_config(dht: Any, key: Any, cfg: "Config", peer_id: str, ttl_s: float) -> "RunAnnouncer":
    """A member's config record: published once now, then every ``CONFIG_REFRESH_FACTOR x ttl_s`` in a
    thread (stored for ``CONFIG_TTL_FACTOR x ttl_s``); returns the running announcer."""
    from p2p_diloco.runconfig import CONFIG_REFRESH_FACTOR, CONFIG_TTL_FACTOR, RunAnnouncer, config_record

    announcer = RunAnnouncer(dht, key, config_record(cfg, peer_id, 0.0), config_refresh_s=CONFIG_REFRESH_FACTOR * ttl_s,
                             config_ttl_s=CONFIG_TTL_FACTOR * ttl_s)
    try:
        ok = announcer.publish_config()
    except Exception:  # a store that timed out: not fatal (the bootstrap or other members have it); retried
        logger.exception("publishing our config record failed; retrying in the background")
        ok = False
    announcer.start(published=ok)
    return announcer


@contextlib.contextmanager
def leave_on_failure(publisher: Any) -> Iterator[None]:
    """A peer that fails after joining still leaves: it publishes its tombstone (``publisher.leave()``,
    bounded by the publisher's store timeout) before the error propagates and the DHT shuts down. Else
    its record stays live for a TTL, and its config hash turns the next joiner away."""
    try:
        yield
    except BaseException as e:
        try:
            ok = publisher.leave()
        except Exception as leave_error:  # the original error is the one to report; this one is logged
            logger.error("could not publish our tombstone after %s: %s: %s", type(e).__name__,
                         type(leave_error).__name__, leave_error)
        else:
            _out(f"leaving after an error ({type(e).__name__}); tombstone {'published' if ok else 'NOT accepted'}")
        raise


def cmd_heartbeat(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    from p2p_diloco.records import LocalRun

    if args.ttl_s <= 0:
        raise ValueError(f"--ttl: must be > 0 s, got {args.ttl_s}")
    cfg = resolve_config(args)
    local = LocalRun.from_config(cfg)
    with _StopOnSignal() as stop, joined_run(args, local, cfg.outer.fragments, ttl_s=args.ttl_s,
                                             profile=args.profile, cfg=cfg) as joined:
        from p2p_diloco.swarm import check_split, read_swarm

        publisher = joined.publisher
        split_every = max(1, int(args.split_check_every))
        beats = 0
        while not stop.event.wait(publisher.period_s):
            publisher.beat()
            beats += 1
            if beats % split_every == 0:
                report = check_split(joined.dht, read_swarm(joined.dht, local), joined.opts.initial_peers)
                if report.missing:
                    _out(f"warning: split swarm suspected: {len(report.missing)} known peers were not in our routing "
                         f"table; re-joined {len(report.healed)}")
        ok = publisher.leave()
        _out(f"left run {local.run_id} ({stop.signal_name}); tombstone {'published' if ok else 'NOT accepted'}")
    return 0


def _ephemeral_identity(opts: "SwarmOptions") -> "SwarmOptions":
    """``opts`` with a fresh identity in a private temp folder (removed by :func:`_remove_ephemeral`)."""
    import dataclasses
    import tempfile

    from p2p_diloco.identity import load_or_create_identity

    folder = Path(tempfile.mkdtemp(prefix="p2p-diloco-id-"))  # mode 0700
    identity = load_or_create_identity(folder / "identity.key")
    return dataclasses.replace(opts, identity=identity, check_identity_free=False)


def _remove_ephemeral(opts: "SwarmOptions") -> None:
    assert opts.identity is not None
    opts.identity.path.unlink(missing_ok=True)
    opts.identity.path.parent.rmdir()


# ---------------------------------------------------------------- status


def snapshot_json(snapshot: "SwarmSnapshot", timings_s: dict[str, float]) -> dict[str, Any]:
    """One read as JSON: the run looked at (``run_id`` "" when the DHT holds no run), its peers and summary;
    ``runs`` (live peers per run), ``runs_detail`` (every run of the index, live ones first) and
    ``config_mismatch`` (one line when our own config's hash is not the run's; else "")."""
    from p2p_diloco.records import config_mismatch, summarize

    local = snapshot.local
    return {
        "run_id": local.run_id,
        "config_hash": local.config_hash,
        "protocol_version": local.protocol_version,
        "dht_time": snapshot.now,
        "timings_s": {k: round(v, 3) for k, v in timings_s.items()},
        "summary": summarize(snapshot.views, local.run_id).to_json(),
        "peers": [
            {"status": v.status, "reason": v.reason, "expiration_time": v.expiration_time,
             "kind": type(v.record).__name__, **asdict(v.record)}
            for v in snapshot.views
        ],
        "runs": snapshot.runs,
        "rejected": list(snapshot.rejected),
        "runs_detail": [r.to_json() for r in snapshot.runs_detail],
        "config_mismatch": config_mismatch(snapshot.views, local),
    }


def _fmt_age(now: float, t: float) -> str:
    if t <= 0:
        return "never"
    s = max(0.0, now - t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _rows(data: dict[str, Any]) -> list[list[str]]:
    now = data["dht_time"]
    rows = []
    for p in data["peers"]:
        if p["status"] not in ("live", "foreign"):
            continue
        full = p["kind"] == "PeerRecord"
        frags = ",".join(str(v) for v in p.get("fragment_versions", [])) if full else ""
        loss = p.get("loss")
        rows.append([
            p["name"], p["peer_id"][-8:], p["status"] if p["status"] != "live" else p["state"],
            str(p.get("inner_step", "")) if full else "", str(p.get("tokens", "")) if full else "",
            f"{p['tokens_per_s']:.0f}" if full else "", frags or "-",
            _fmt_age(now, p["last_sync_time"]) if full else "",
            f"{p['bytes_sent'] / 1e6:.1f}/{p['bytes_received'] / 1e6:.1f}" if full else "",
            f"{loss:.3f}" if isinstance(loss, float) else "-", _fmt_age(now, p["time"]),
        ])
    return rows


HEADER = ["name", "peer", "state", "step", "tokens", "tok/s", "fragments", "last sync", "MB out/in", "loss", "seen"]


def _summary_lines(data: dict[str, Any]) -> list[str]:
    s = data["summary"]
    def one(f: dict[str, Any]) -> str:
        fork = f" {f['anchors']} anchors" if f.get("anchors", 0) > 1 else ""
        dist = f" dist {f['distance']:.1e}" if f.get("distance", 0.0) > 0 else ""
        return f"f{f['fragment']}=v{f['top_version']}({f['agreeing']}/{s.get('trainers', s['live'])}{fork}{dist})"

    frag = " ".join(one(f) for f in s["fragments"]) or "-"
    lines = [
        f"run {data['run_id']}: {s['live']} live peers, {s['tokens_per_s']:.0f} tokens/s, {s['tokens']} tokens; "
        f"fragments {frag}; consensus {'yes' if s['consensus'] else 'NO'}" if data["run_id"] else
        "no run in this DHT: no live peer, and no bootstrap announces one",
    ]
    ours = next((r for r in data.get("runs_detail", []) if r["run_id"] == data["run_id"]), None)
    if ours is not None and ours["announced"]:
        lines[0] += f" (announced by {ours['announced']} bootstrap(s))"
    if data.get("config_mismatch"):
        lines.append(f"note: {data['config_mismatch']}")
    for name, pid, t in s["left"]:
        lines.append(f"left: {name} ({pid[-8:]}) {_fmt_age(data['dht_time'], t)}")
    for name, pid, reason in s["foreign"]:
        lines.append(f"foreign: {name} ({pid[-8:]}): {reason}")
    others = {r: n for r, n in data["runs"].items() if r != data["run_id"]}
    details = [r for r in data.get("runs_detail", []) if r["run_id"] != data["run_id"]]
    for r in details:  # one line per other run, live ones first
        extra = "".join([f", announced by {r['announced']} bootstrap(s)" if r["announced"] else "",
                         f", {r['left']} left" if r["left"] else ""])
        lines.append(f"other run {r['run_id']}: {r['live']} live{extra}, config hash {r['config_hash'] or '-'} "
                     f"(p2p-diloco status --run-id {r['run_id']})")
    if others and not details:
        lines.append("other runs in this DHT: " + ", ".join(f"{r} ({n} peers)" for r, n in sorted(others.items())))
    for line in data["rejected"]:
        lines.append(f"rejected record: {line}")
    return lines


def render_plain(data: dict[str, Any]) -> str:
    rows = [HEADER] + _rows(data)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(rows) == 1:
        table.append("(no live peers)")
    return "\n".join(table + _summary_lines(data))


def _render_rich(data: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"p2p-diloco run {data['run_id']}", title_justify="left")
    for h in HEADER:
        table.add_column(h, justify="right" if h in ("step", "tokens", "tok/s", "loss") else "left")
    for row in _rows(data):
        table.add_row(*row, style="red" if row[2] == "foreign" else None)
    return Group(table, *(Text(line) for line in _summary_lines(data)))


def cmd_status(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    if not args.interval_s >= MIN_WATCH_INTERVAL_S:
        raise ValueError(f"--interval {args.interval_s:g}: must be at least {MIN_WATCH_INTERVAL_S:g} s (each refresh "
                         "is a DHT read answered by every peer)")
    t0 = time.monotonic()
    # --config (or --run-id alone): that run, as today; --set alone: the run's fetched config with the overrides;
    # nothing: every run of the DHT, the primary one (most live peers) in full
    fixed = _local_run(args, observer=True) if args.config or (args.run_id and not args.overrides) else None
    opts = _swarm_options(args, client_mode=True)
    from p2p_diloco.swarm import read_swarm, start_dht

    timings = {"import": time.monotonic() - t0}
    use_rich = sys.stdout.isatty() and not args.json
    with _StopOnSignal() as stop:
        t1 = time.monotonic()
        dht = start_dht(opts, fixed.run_id if fixed is not None else None)
        timings["join"] = time.monotonic() - t1
        try:
            snapshot = None
            while True:
                t2 = time.monotonic()
                if fixed is None and args.overrides:
                    fixed = _fetched_local_run(args, dht)
                local = fixed or _primary_local_run(dht, snapshot)
                snapshot = read_swarm(dht, local) if local is not None else _empty_snapshot(dht)
                timings["read"] = time.monotonic() - t2
                data = snapshot_json(snapshot, timings)
                if args.json:
                    _out(json.dumps(data))
                elif use_rich:
                    from rich.console import Console

                    console = Console()
                    if args.watch:
                        console.clear()
                    console.print(_render_rich(data))
                else:
                    _out(render_plain(data) + ("\n" if args.watch else ""))
                if not args.watch or stop.event.wait(args.interval_s):
                    break
        finally:
            stop_process(dht, "DHT process")
    return 0


def _fetched_local_run(args: argparse.Namespace, dht: Any) -> "LocalRun":
    """An observer's run with ``--set`` but no ``--config``: the run that is there (or ``--run-id``), its
    config fetched from the DHT and verified, the overrides on top."""
    from p2p_diloco.records import LocalRun, pick_run
    from p2p_diloco.runconfig import fetch_config, read_runs

    runs, _rejected = read_runs(dht)
    cfg, _record = fetch_config(dht, pick_run(runs, args.run_id), args.overrides)
    return LocalRun.from_config(cfg)


def _primary_local_run(dht: Any, last: "SwarmSnapshot | None") -> "LocalRun | None":
    """An observer without a run: the primary run of the DHT (:func:`records.primary_run`), from the runs
    the last read showed (or a read of the index), with no config hash (the run's majority is adopted)."""
    from p2p_diloco import __version__
    from p2p_diloco.config import PROTOCOL_VERSION
    from p2p_diloco.records import LocalRun, primary_run
    from p2p_diloco.runconfig import read_runs

    runs = list(last.runs_detail) if last is not None and last.runs_detail else read_runs(dht)[0]
    primary = primary_run(runs)
    return LocalRun(primary.run_id, PROTOCOL_VERSION, "", __version__) if primary is not None else None


def _empty_snapshot(dht: Any) -> "SwarmSnapshot":
    """What a look at a DHT that holds no run shows."""
    from hivemind.utils import get_dht_time

    from p2p_diloco import __version__
    from p2p_diloco.config import PROTOCOL_VERSION
    from p2p_diloco.records import LocalRun
    from p2p_diloco.swarm import SwarmSnapshot

    return SwarmSnapshot(get_dht_time(), LocalRun("", PROTOCOL_VERSION, "", __version__), (), {})


# ---------------------------------------------------------------- keygen


def cmd_keygen(args: argparse.Namespace) -> int:
    if args.identity:
        from p2p_diloco.identity import load_or_create_identity

        if Path(args.identity).expanduser().exists():
            raise ValueError(f"{args.identity} already exists; it is a peer identity and stays (delete it to make a new one)")
        folder = Path(args.identity).expanduser().parent
        if not folder.is_dir():
            raise ValueError(f"--identity {args.identity}: folder {folder} does not exist; create it first or choose "
                             "another path")
        identity = load_or_create_identity(args.identity)
        _out(f"wrote identity {identity.path} (mode 0600); peer id {identity.peer_id}")
        return 0
    from p2p_diloco.identity import write_swarm_key

    fingerprint = write_swarm_key(args.out)
    _out(f"wrote swarm key {args.out} (mode 0600, fingerprint {fingerprint})")
    _out(f"copy it to every peer of the swarm (e.g. scp {args.out} host:), then pass --swarm-key {args.out}")
    return 0


# ---------------------------------------------------------------- doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    from p2p_diloco.records import PeerRecord, check_join

    # --config (or --run-id alone): that run; else the run that is in the DHT, its config fetched and verified
    local = _local_run(args) if args.config or (args.run_id and not args.overrides) else None
    opts = _swarm_options(args, client_mode=True)
    from p2p_diloco.swarm import (
        MAX_DHT_CLOCK_SKEW_S, ClockSkewError, JoinError, SwarmKeyError, measure_clock_skew, read_swarm, skew_verdict,
        start_dht, tcp_probe,
    )

    failures = 0

    def report(ok: bool | None, what: str, fix: str = "") -> None:
        nonlocal failures
        tag = "ok  " if ok else "warn" if ok is None else "FAIL"
        failures += ok is False
        _out(f"[{tag}] {what}" + (f" -- fix: {fix}" if fix and not ok else ""))

    for addr in opts.initial_peers:
        why = tcp_probe(addr)
        report(why is None, f"reach {addr.text}: " + ("TCP port open" if why is None else why),
               "start a peer there (p2p-diloco bootstrap), check host, port and firewall, "
               "and copy the address exactly as the peer printed it")
    try:
        dht = start_dht(opts, local.run_id if local is not None else None)
    except SwarmKeyError as e:
        fix = ("pass the swarm's secret with --swarm-key FILE" if opts.swarm_key is None
               else "use the same --swarm-key file as the swarm's peers (compare the fingerprints they print)")
        report(False, f"join the DHT: {e}", fix)
        return 1
    except ClockSkewError as e:
        report(False, f"join the DHT: {e}", "synchronise clocks with NTP on both machines (timedatectl set-ntp true)")
        return 1
    except JoinError as e:
        report(False, f"join the DHT: {e}", "see the reachability lines above")
        return 1
    try:
        report(True, f"join the DHT as a client ({'private swarm' if opts.swarm_key else 'open swarm'})")
        from p2p_diloco.runconfig import read_runs

        runs, _rejected = read_runs(dht)
        if local is None:
            local = _doctor_run(args, dht, runs, report)
        snapshot = read_swarm(dht, local) if local is not None else _empty_snapshot(dht)
        live = snapshot.live()
        if local is not None:
            left = sum(v.status == 'left' for v in snapshot.views)
            others = [r for r in runs if r.live and r.run_id != local.run_id]
            if live or not others:
                report(True if live else None, f"run {local.run_id}: {len(live)} live peers, {left} left recently",
                       "start peers of this run (p2p-diloco join), or check --config/--set/--run-id")
            else:  # we look at an empty run while another one is live: the wrong run
                report(False, f"run {local.run_id}: 0 live peers, {left} left recently; runs in this DHT: "
                       f"{', '.join(r.describe() for r in runs if r.visible)}",
                       "leave --config/--set out to check the run that is there, or pass --run-id ID")
        foreign = [v for v in snapshot.views if v.status == "foreign"]
        for v in foreign:
            report(None, f"foreign peer {v.record.name} ({v.peer_id}): {v.reason}",
                   "start every peer of a run with the same config and the same p2p-diloco version")
        if local is not None and local.config_hash and not live:
            report(None, "compatibility with the run: not checked: it has no live peers",
                   "check again once peers of the run are live")
        elif local is not None and local.config_hash:
            ok, reason = check_join(snapshot.views, local, "")
            report(ok, "compatibility with the run: " + (reason or "protocol version and config hash match"),
                   "use the run's config (same --config/--set) and p2p-diloco version")
        versions = {v.record.software_version for v in live}
        if len(versions) > 1:
            report(None, f"software versions differ among live peers: {', '.join(sorted(versions))}",
                   "upgrade all peers to the same p2p-diloco version")
        for line in snapshot.rejected:
            report(None, f"rejected record: {line}", "a peer publishes malformed or forged records")
        peers: dict[str, list[str]] = {a.peer_id: [a.text.split('/p2p/')[0]] for a in opts.initial_peers if a.peer_id}
        for v in live:
            if isinstance(v.record, PeerRecord):
                peers.setdefault(v.peer_id, [m.split("/p2p/")[0] for m in v.record.addresses])
        for pid, skew, error in measure_clock_skew(dht, peers):
            if skew is None:
                report(False, f"clock of {pid}: no answer ({error})", "check that the peer is alive and reachable")
            else:
                report(skew_verdict(skew),
                       f"clock of {pid}: {skew:+.3f} s from ours (the DHT needs < {MAX_DHT_CLOCK_SKEW_S:.0f} s)",
                       "synchronise clocks with NTP on both machines (timedatectl set-ntp true)")
    finally:
        stop_process(dht, "DHT process")
    return 1 if failures else 0


def _doctor_run(args: argparse.Namespace, dht: Any, runs: list["RunInfo"],
                report: Callable[..., None]) -> "LocalRun | None":
    """``doctor`` without ``--config``: the run that is in the DHT (``--run-id``, else the primary one),
    its config fetched and verified as a joiner would; each finding a report line. None: no run to check."""
    from p2p_diloco import __version__
    from p2p_diloco.config import PROTOCOL_VERSION, config_hash
    from p2p_diloco.records import LocalRun, pick_run, primary_run
    from p2p_diloco.runconfig import fetch_config

    visible = [r for r in runs if r.visible]
    if args.run_id or not visible:
        try:
            run = pick_run(runs, args.run_id)
        except ValueError as e:
            report(False, f"find the run: {e}", "start one (p2p-diloco bootstrap --config FILE, then join), "
                   "or pass --config FILE / --run-id ID")
            return None
    else:
        run = primary_run(visible)
        assert run is not None
        if len([r for r in visible if r.live]) > 1 or (not run.live and len(visible) > 1):
            report(None, f"several runs in this DHT: {', '.join(r.describe() for r in visible)}; checking {run.run_id}",
                   "pass --run-id ID (or --config FILE) to check another one; a join without either is refused")
    try:
        cfg, record = fetch_config(dht, run, args.overrides)
    except ValueError as e:
        report(False, f"config of run {run.run_id} from the DHT: {e}", "pass --config FILE with the run's config")
        return LocalRun(run.run_id, PROTOCOL_VERSION, "", __version__)
    report(True, f"config of run {run.run_id} fetched from the DHT (published by {record.peer_id}): hash "
           f"{run.config_hash} verified" + (f"; with --set: hash {config_hash(cfg)}" if args.overrides else ""))
    return LocalRun.from_config(cfg)


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
    _add_network_args(p, peers_required=False, listen=True)
    _add_config_args(p)
    p.set_defaults(identity=None)
    p.epilog = (f"Default identity: {DEFAULT_BOOTSTRAP_IDENTITY} (a stable peer id across restarts). The bootstrap is "
                "never a member of its run: it only makes the run and its config findable, so that joiners need no "
                "--config.")

    p = add("heartbeat", "join a run as a stand-in member that only publishes its peer record "
            "(until the learner lands); SIGINT/SIGTERM leave gracefully", cmd_heartbeat)
    _add_network_args(p, peers_required=True, listen=True)
    _add_config_args(p)
    _add_run_id_arg(p)
    p.add_argument("--name", default="", help="peer name shown by status (default: peer-<end of peer id>)")
    p.add_argument("--profile", default="", help="peer profile name (kind of machine)")
    p.add_argument("--ttl", dest="ttl_s", metavar="SECONDS", type=float, default=DEFAULT_TTL_S,
                   help=f"record lifetime; published every ttl/3 s (default: {DEFAULT_TTL_S:g})")
    p.add_argument("--split-check-every", type=int, default=5, metavar="N",
                   help="check for a split swarm every N heartbeats (default: 5)")

    p = add("status", "show a run's live peers and swarm summary (joins as a client; works from any machine)",
            cmd_status)
    _add_network_args(p, peers_required=True, listen=False)
    _add_config_args(p)
    p.add_argument("--run-id", dest="run_id",
                   help="run to look at (default: with --config its run.run_id, else every run of the DHT, the one "
                   "with the most live peers in full); without --config/--set the run's majority config hash is "
                   "taken as the reference and the others are shown as foreign")
    p.add_argument("--json", action="store_true", help="print one JSON object per read")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl+C")
    p.add_argument("--interval", dest="interval_s", type=float, default=2.0, metavar="SECONDS",
                   help=f"refresh period with --watch, at least {MIN_WATCH_INTERVAL_S:g} (default: 2)")
    p.epilog = ("Records live under the DHT key p2p-diloco.run.<run_id>_peers (configs under ..._config); the key "
                "p2p-diloco_runs indexes every peer of every run (and bootstraps' announcements), so other runs sharing "
                "the DHT are listed and their peers shown as foreign.")

    p = add("keygen", "write a new swarm secret for a private swarm (or, with --identity, a peer identity key)",
            cmd_keygen)
    p.add_argument("--out", default=DEFAULT_SWARM_KEY, help=f"swarm key file to write (default: {DEFAULT_SWARM_KEY}; never overwritten)")
    p.add_argument("--identity", metavar="FILE", help="write a peer identity key to FILE instead")

    p = add("doctor", "diagnose joining a swarm: reachability, swarm key, compatibility, clock skew; suggests fixes",
            cmd_doctor)
    _add_network_args(p, peers_required=True, listen=False)
    _add_config_args(p)
    p.add_argument("--run-id", dest="run_id", help="check this run without its config (default: with --config its "
                   "run.run_id, else the run that is in the DHT, with its config fetched from there)")
