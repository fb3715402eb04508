"""`doctor`: why a join fails."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any, Callable

from p2p_diloco.cli.common import local_run, setup_logging
from p2p_diloco.cli.status import empty_snapshot
from p2p_diloco.core.console import out
from p2p_diloco.hivemind_ext.procguard import stop_process
from p2p_diloco.net.arguments import swarm_options

if TYPE_CHECKING:
    from p2p_diloco.net.records import LocalRun
    from p2p_diloco.net.runs import RunInfo

logger = logging.getLogger(__name__)


def cmd_doctor(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    from p2p_diloco.net.records import PeerRecord, check_join

    # --config (or --run-id alone): that run; else the run that is in the DHT, its config fetched and verified
    local = local_run(args) if args.config or (args.run_id and not args.overrides) else None
    opts = swarm_options(args, client_mode=True)
    from p2p_diloco.net.membership import (
        MAX_DHT_CLOCK_SKEW_S,
        ClockSkewError,
        JoinError,
        SwarmKeyError,
        read_swarm,
        skew_verdict,
        start_dht,
        tcp_probe,
    )
    from p2p_diloco.net.probes import measure_clock_skew

    failures = 0

    def report(ok: bool | None, what: str, fix: str = "") -> None:
        nonlocal failures
        tag = "ok  " if ok else "warn" if ok is None else "FAIL"
        failures += ok is False
        out(f"[{tag}] {what}" + (f" -- fix: {fix}" if fix and not ok else ""))

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
        from p2p_diloco.net.runconfig import read_runs

        runs, _rejected = read_runs(dht)
        if local is None:
            local = _doctor_run(args, dht, runs, report)
        snapshot = read_swarm(dht, local) if local is not None else empty_snapshot(dht)
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
    from p2p_diloco.core.config import PROTOCOL_VERSION
    from p2p_diloco.core.identity import config_hash
    from p2p_diloco.net.records import LocalRun
    from p2p_diloco.net.runconfig import fetch_config
    from p2p_diloco.net.runs import pick_run, primary_run

    visible = [r for r in runs if r.visible]
    if args.run_id or not visible:
        try:
            run = pick_run(runs, args.run_id)
        except ValueError as e:
            report(False, f"find the run: {e}", "start one (p2p-diloco bootstrap --config FILE, then join), "
                   "or pass --config FILE / --run-id ID")
            return None
    else:
        primary = primary_run(visible)
        assert primary is not None  # visible is not empty
        run = primary
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


