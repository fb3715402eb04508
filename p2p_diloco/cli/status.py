"""`status`: the swarm's state from any address."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from p2p_diloco.cli.common import (
    MIN_WATCH_INTERVAL_S,
    StopOnSignal,
    local_run,
    setup_logging,
)
from p2p_diloco.core.console import out
from p2p_diloco.hivemind_ext.procguard import stop_process
from p2p_diloco.net.dashboard import parse_serve_address
from p2p_diloco.net.arguments import swarm_options
from p2p_diloco.net.report import render_plain, render_rich, snapshot_json

if TYPE_CHECKING:
    from p2p_diloco.net.dashboard import ServeAddress
    from p2p_diloco.net.membership import SwarmSnapshot
    from p2p_diloco.net.records import LocalRun

logger = logging.getLogger(__name__)


def cmd_status(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    if not args.interval_s >= MIN_WATCH_INTERVAL_S:
        raise ValueError(f"--interval {args.interval_s:g}: must be at least {MIN_WATCH_INTERVAL_S:g} s (each refresh "
                         "is a DHT read answered by every peer)")
    serve = parse_serve_address(args.serve, "--serve") if args.serve else None  # before anything starts
    t0 = time.monotonic()
    # --config (or --run-id alone): that run, as today; --set alone: the run's fetched config with the overrides;
    # nothing: every run of the DHT, the primary one (most live peers) in full
    fixed = local_run(args, observer=True) if args.config or (args.run_id and not args.overrides) else None
    opts = swarm_options(args, client_mode=True)
    from p2p_diloco.net.membership import read_swarm, start_dht

    timings = {"import": time.monotonic() - t0}
    use_rich = sys.stdout.isatty() and not args.json and serve is None
    server = None
    if serve is not None:  # bound before the DHT starts: a taken port fails at once, with one line
        from p2p_diloco.cli.serve import StatusServer

        server = StatusServer(serve, refresh_s=args.interval_s)
    with StopOnSignal() as stop:
        t1 = time.monotonic()
        try:
            dht = start_dht(opts, fixed.run_id if fixed is not None else None)
        except BaseException:
            if server is not None:
                server.close()
            raise
        timings["join"] = time.monotonic() - t1
        try:
            if server is not None:
                server.start()
                out(serving_line(server.address))
            snapshot = None
            while True:
                t2 = time.monotonic()
                if fixed is None and args.overrides:
                    fixed = _fetched_local_run(args, dht)
                local = fixed or _primary_local_run(dht, snapshot)
                snapshot = read_swarm(dht, local) if local is not None else empty_snapshot(dht)
                timings["read"] = time.monotonic() - t2
                data = snapshot_json(snapshot, timings)
                if server is not None:
                    server.update(data)
                elif args.json:
                    out(json.dumps(data))
                elif use_rich:
                    from rich.console import Console

                    console = Console()
                    if args.watch:
                        console.clear()
                    console.print(render_rich(data))
                else:
                    out(render_plain(data) + ("\n" if args.watch else ""))
                if not (args.watch or server is not None) or stop.event.wait(args.interval_s):
                    break
        finally:
            if server is not None:
                server.close()
            stop_process(dht, "DHT process")
    return 0


def serving_line(address: "ServeAddress") -> str:
    """What ``status --serve`` (and ``swarm --serve``) prints once the page is up: where, and who can reach it."""
    reach = ("listening on every interface: reachable from the network" if address.public
             else "this machine only")
    return f"serving the swarm's page at {address.url()} (/api/status, /metrics); {reach}"


def _fetched_local_run(args: argparse.Namespace, dht: Any) -> "LocalRun":
    """An observer's run with ``--set`` but no ``--config``: the run that is there (or ``--run-id``), its
    config fetched from the DHT and verified, the overrides on top."""
    from p2p_diloco.net.records import LocalRun
    from p2p_diloco.net.runconfig import fetch_config, read_runs
    from p2p_diloco.net.runs import pick_run

    runs, _rejected = read_runs(dht)
    cfg, _record = fetch_config(dht, pick_run(runs, args.run_id), args.overrides)
    return LocalRun.from_config(cfg)


def _primary_local_run(dht: Any, last: "SwarmSnapshot | None") -> "LocalRun | None":
    """An observer without a run: the primary run of the DHT (:func:`records.primary_run`), from the runs
    the last read showed (or a read of the index), with no config hash (the run's majority is adopted)."""
    from p2p_diloco import __version__
    from p2p_diloco.core.config import PROTOCOL_VERSION
    from p2p_diloco.net.records import LocalRun
    from p2p_diloco.net.runconfig import read_runs
    from p2p_diloco.net.runs import primary_run

    runs = list(last.runs_detail) if last is not None and last.runs_detail else read_runs(dht)[0]
    primary = primary_run(runs)
    return LocalRun(primary.run_id, PROTOCOL_VERSION, "", __version__) if primary is not None else None


def empty_snapshot(dht: Any) -> "SwarmSnapshot":
    """What a look at a DHT that holds no run shows."""
    from hivemind.utils import get_dht_time

    from p2p_diloco import __version__
    from p2p_diloco.core.config import PROTOCOL_VERSION
    from p2p_diloco.net.membership import SwarmSnapshot
    from p2p_diloco.net.records import LocalRun

    return SwarmSnapshot(get_dht_time(), LocalRun("", PROTOCOL_VERSION, "", __version__), (), {})


