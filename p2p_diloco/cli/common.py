"""``p2p-diloco`` swarm subcommands: ``bootstrap``, ``heartbeat``, ``status``, ``keygen``, ``doctor``.

Only the standard library is imported here; hivemind (and through it torch) is imported inside
the handlers, so ``p2p-diloco --help`` stays fast. Handlers return an exit code and raise
``ValueError`` (one line) for user errors, which ``cli.main`` prints and turns into exit code 2.

DHT layout (see :mod:`p2p_diloco.net.records`): each run's records live under
``p2p-diloco.run.<run_id>_peers_<shard>`` (``RECORD_SHARDS`` shards by peer id) and its config under
``p2p-diloco.run.<run_id>_config``; the well-known keys ``p2p-diloco_runs_<shard>`` index every peer of
every run (and bootstraps' announcements),
so ``status`` lists other runs sharing the DHT and shows their peers as foreign, and a peer given no
config finds the run that is there (:mod:`p2p_diloco.net.runconfig`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2p_diloco.core.config import override_arg  # standard library only: --help stays fast
from p2p_diloco.core.console import out
from p2p_diloco.core.resources import bundled_names  # importlib.resources only: --help stays fast
from p2p_diloco.net.arguments import swarm_options

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config
    from p2p_diloco.net.records import LocalRun

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_IDENTITY = "~/.p2p-diloco/bootstrap.id"
DEFAULT_SWARM_KEY = "swarm.secret"
DEFAULT_TTL_S = 30.0
MIN_WATCH_INTERVAL_S = 0.5
"""``status --watch --interval``: the shortest refresh period (seconds)."""


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="run config: a TOML file, or the name of a bundled one ("
                   f"{', '.join(bundled_names('configs'))}); its run id and hash identify the run")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[], type=override_arg,
                   help="override one config value, e.g. --set run.run_id=myrun (repeatable)")


def add_run_id_arg(p: argparse.ArgumentParser) -> None:
    """``--run-id`` of a member (``join``, ``heartbeat``): which run of the DHT to fetch the config of."""
    p.add_argument("--run-id", dest="run_id", metavar="ID",
                   help="without --config: join this run of the DHT (its config is fetched from its peers); "
                        "default: the only run that is live (or announced by a bootstrap) there")


def add_network_args(p: argparse.ArgumentParser, *, peers_required: bool, listen: bool) -> None:
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


HIVEMIND_LOGLEVEL_ENV = "HIVEMIND_LOGLEVEL"
"""hivemind's own handler takes its level from this variable when hivemind is first imported (default INFO)."""


def setup_logging(verbose: bool) -> None:
    """Log on stderr warnings and errors, and with ``-v`` INFO too (the learner's line per round, ...); what a
    command prints on stdout (``out``) is not logging and always shows.

    hivemind's loggers, which have a handler of their own, follow: at least as much as ours is shown
    (``HIVEMIND_LOGLEVEL`` may ask for more, e.g. DEBUG). The root logger's level is set even when it has
    handlers already (``basicConfig`` then does nothing): it is what :func:`p2p_diloco.core.logs.verbose` reads.
    """
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    asked = logging.getLevelNamesMapping().get(os.environ.get(HIVEMIND_LOGLEVEL_ENV, "").strip().upper())
    if asked is None or asked > level:
        if "hivemind.utils.logging" in sys.modules:  # imported already (an in-process caller): its level, then
            logging.getLogger("hivemind").setLevel(level)
        else:  # read by hivemind when it is first imported; the processes it forks inherit the level
            os.environ[HIVEMIND_LOGLEVEL_ENV] = "INFO" if verbose else "WARNING"


def local_run(args: argparse.Namespace, *, observer: bool = False) -> "LocalRun":
    """The run we belong to / look at.

    With a config (``--config``/``--set``, or the defaults when not ``observer``) peers are
    compared with it. An observer without one (``status``, optionally ``--run-id``) adopts the
    run's majority protocol version and config hash, so it shows the odd ones out as foreign.
    """
    from p2p_diloco.core.config import PROTOCOL_VERSION, load_config
    from p2p_diloco.net.records import LocalRun

    run_id = getattr(args, "run_id", None)
    if (run_id or observer) and not args.config and not args.overrides:
        from p2p_diloco.core.version import VERSION as __version__

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
    what the run's peers announce (:mod:`p2p_diloco.net.runconfig`); ``--set`` applies on top (the join
    check then compares the result with the live peers as usual). Never the built-in defaults: they
    would be another run. Errors are one line (``ValueError``).
    """
    from p2p_diloco.core.config import load_config
    from p2p_diloco.core.identity import config_hash

    run_id = getattr(args, "run_id", None)
    if args.config:
        cfg = load_config(args.config, args.overrides)
        if run_id and run_id != cfg.run.run_id:
            raise ValueError(f"--run-id {run_id!r} contradicts the config's run.run_id {cfg.run.run_id!r}; "
                             f"give one of them")
        return cfg
    from p2p_diloco.net.runconfig import lookup_config

    cfg, run = lookup_config(swarm_options(args, client_mode=True), run_id, args.overrides)
    out(f"config: fetched run {run.run_id} (hash {run.config_hash}) from the DHT"
         + (f"; with --set: hash {config_hash(cfg)}" if args.overrides else ""))
    return cfg


class StopOnSignal:
    """SIGINT/SIGTERM set an event (graceful leave) instead of raising in the middle of a DHT call; a
    second one exits at once (``128 + signal``), without the leave: the helper processes die with us
    (:mod:`p2p_diloco.hivemind_ext.procguard`) and our record expires after its TTL.

    SIGUSR1 sets :attr:`finish` instead: a learner ends its training as if ``--max-time`` ran out (its last
    progress handed off in final rounds, then the linger), where SIGTERM cancels the rounds in flight."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.finish = threading.Event()
        self.signal_name = ""

    def __enter__(self) -> "StopOnSignal":
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        self._old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._finish)
        return self

    def _finish(self, signum: int, _frame: Any) -> None:
        self.finish.set()
        os.write(2, b"p2p-diloco: SIGUSR1: finishing: final rounds, then the linger (SIGTERM to leave at once)\n")

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


def check_writable_dir(path: Path, what: str) -> None:
    """Before joining: ``path`` is (or can be made) a folder we can write a file in; otherwise ValueError naming
    ``what`` (a flag). Tried for real, not by mode bits: root passes every permission check, not /proc's."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write there ({e.strerror or e})") from None


def check_writable_file(path: Path, what: str) -> None:
    """Before joining: ``path`` can be written (its folder made, the file opened for appending; nothing in it is
    changed); otherwise ValueError naming ``what``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write it ({e.strerror or e})") from None
