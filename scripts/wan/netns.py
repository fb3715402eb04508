#!/usr/bin/env python3
"""An emulated WAN on one machine: N learner hosts as Linux network namespaces on a private bridge.

Each host ``i`` is a network namespace ``p2pd-wan-h<i>`` holding one end of a veth pair
(``p2pd-wan-n<i>``, address ``10.77.0.<i+1>/24``); the other end (``p2pd-wan-v<i>``) is a port of
the bridge ``p2pd-wan-br`` in the root namespace. The bridge has no address and the namespaces have
no default route, so the hosts reach each other and nothing else: no traffic leaves the bridge, and
the host's own interfaces, routes and firewall are never touched.

Each host's link is rate-limited in both directions with a token bucket (``tc qdisc ... tbf``): on
the egress of its namespace end (what the host sends) and on the egress of its bridge port (what
it receives). netem is not available on this machine, so there is **no latency emulation**: the
round trip between hosts stays at loopback-like tens of microseconds, plus queueing in the bucket.

Everything is created under the prefix ``p2pd-wan-`` and removed again on exit, on error and on
SIGINT/SIGTERM (:class:`Wan` is a context manager; :func:`handle_signals` turns both signals into
exceptions so that ``finally`` runs); ``python scripts/wan/netns.py --cleanup`` removes leftovers
of a run that was killed with SIGKILL, by that prefix only.

The plan (names, addresses, ``tc`` arguments) is pure functions over a frozen :class:`WanPlan`,
tested in ``tests/test_wan_plan.py``; only :class:`Wan` and :func:`cleanup` run commands (as root).
Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger("wan.netns")

PREFIX = "p2pd-wan-"
"""Every namespace, link and bridge this harness creates starts with this (and nothing else does)."""
IFNAME_MAX = 15
"""Linux interface names are at most 15 characters (IFNAMSIZ - 1)."""
MAX_HOSTS = 64
MIN_RATE_MBIT = 0.1
MAX_RATE_MBIT = 10_000.0
COMMAND_TIMEOUT_S = 20.0
"""Upper bound on one ``ip``/``tc`` command."""
MTU_FRAME_BYTES = 1514
"""One full Ethernet frame at MTU 1500 (what the bucket must hold at least)."""


class WanError(RuntimeError):
    """A set-up, command or clean-up failure, reported as one line."""


# ---------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class WanPlan:
    """N hosts on one bridge, each link limited to ``rate_mbit`` in each direction."""

    hosts: int
    """Number of learner hosts (network namespaces)."""
    rate_mbit: float
    """Per-host link rate in Mbit/s (10^6 bit/s), the same in both directions."""
    subnet: str = "10.77.0.0/24"
    """Private IPv4 subnet of the bridge; host i gets the (i+1)-th address."""
    burst_ms: float = 5.0
    """Token-bucket depth in milliseconds of traffic at the rate (at least 10 full frames)."""
    queue_ms: float = 100.0
    """Longest a packet may wait in the bucket's queue before it is dropped (tbf ``latency``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in [1, {MAX_HOSTS}], got {self.hosts}")
        if not MIN_RATE_MBIT <= self.rate_mbit <= MAX_RATE_MBIT:
            raise ValueError(f"rate_mbit must be in [{MIN_RATE_MBIT}, {MAX_RATE_MBIT}], got {self.rate_mbit}")
        try:
            net = ipaddress.IPv4Network(self.subnet, strict=True)
        except ValueError as e:
            raise ValueError(f"subnet must be an IPv4 network such as 10.77.0.0/24, got {self.subnet!r} ({e})") from None
        if not net.is_private or net.is_loopback or net.is_link_local:
            raise ValueError(f"subnet must be a private range (10/8, 172.16/12, 192.168/16), got {self.subnet}")
        if net.num_addresses - 2 < self.hosts:
            raise ValueError(f"subnet {self.subnet} has room for {net.num_addresses - 2} hosts, not {self.hosts}")
        if self.burst_ms <= 0:
            raise ValueError(f"burst_ms must be > 0, got {self.burst_ms}")
        if self.queue_ms <= 0:
            raise ValueError(f"queue_ms must be > 0, got {self.queue_ms}")


def bridge_name() -> str:
    return f"{PREFIX}br"


def netns_name(i: int) -> str:
    """The namespace of host i."""
    return f"{PREFIX}h{i}"


def inner_if(i: int) -> str:
    """Host i's end of its veth pair, inside its namespace."""
    return _ifname(f"{PREFIX}n{i}")


def outer_if(i: int) -> str:
    """Host i's bridge port (the other end of its veth pair), in the root namespace."""
    return _ifname(f"{PREFIX}v{i}")


def _ifname(name: str) -> str:
    if len(name) > IFNAME_MAX:
        raise ValueError(f"interface name {name!r} is longer than {IFNAME_MAX} characters")
    return name


def host_address(plan: WanPlan, i: int) -> str:
    """Host i's IPv4 address (no prefix length)."""
    if not 0 <= i < plan.hosts:
        raise ValueError(f"host index must be in [0, {plan.hosts}), got {i}")
    net = ipaddress.IPv4Network(plan.subnet)
    return str(net.network_address + 1 + i)


def host_cidr(plan: WanPlan, i: int) -> str:
    return f"{host_address(plan, i)}/{ipaddress.IPv4Network(plan.subnet).prefixlen}"


def burst_bytes(plan: WanPlan) -> int:
    """Bucket depth: ``burst_ms`` of traffic at the rate, but at least 10 full frames."""
    return max(10 * MTU_FRAME_BYTES, round(plan.rate_mbit * 1e6 / 8 * plan.burst_ms / 1e3))


def tbf_args(plan: WanPlan, dev: str) -> list[str]:
    """``tc`` arguments that put a token bucket of the plan's rate on ``dev``'s egress."""
    rate_kbit = round(plan.rate_mbit * 1000)  # tc reads "kbit" as 1000 bit/s
    return ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_kbit}kbit",
            "burst", str(burst_bytes(plan)), "latency", f"{plan.queue_ms:g}ms"]


def setup_commands(plan: WanPlan) -> list[list[str]]:
    """Every command that builds the plan, in order (each runs as root, none touches anything unprefixed)."""
    br = bridge_name()
    cmds: list[list[str]] = [
        ["ip", "link", "add", br, "type", "bridge"],
        ["ip", "link", "set", br, "up"],
    ]
    for i in range(plan.hosts):
        ns, inner, outer = netns_name(i), inner_if(i), outer_if(i)
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns],
            ["ip", "link", "set", outer, "master", br],
            ["ip", "link", "set", outer, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", host_cidr(plan, i), "dev", inner],
            ["ip", "-n", ns, "link", "set", inner, "up"],
            ["tc", "-n", ns, *tbf_args(plan, inner)],  # what host i sends
            ["tc", *tbf_args(plan, outer)],  # what host i receives
        ]
    return cmds


def exec_prefix(i: int) -> list[str]:
    """Prefix a command with this to run it inside host i."""
    return ["ip", "netns", "exec", netns_name(i)]


def leftovers(netns_list: Sequence[str], links: Sequence[str]) -> tuple[list[str], list[str]]:
    """The namespaces and root-namespace links of ours (by prefix) among those listed; bridge last."""
    ours_ns = sorted(n for n in netns_list if n.startswith(PREFIX))
    ours_links = sorted((n for n in links if n.startswith(PREFIX)), key=lambda n: (n == bridge_name(), n))
    return ours_ns, ours_links


def parse_netns_list(text: str) -> list[str]:
    """Names from ``ip netns list`` (lines like ``name (id: 3)`` or ``name``)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def parse_link_names(ip_json: str) -> list[str]:
    """Interface names from ``ip -j link show``."""
    return [entry["ifname"] for entry in json.loads(ip_json or "[]")]


def byte_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Counter differences; a counter that went backwards (interface recreated) is an error."""
    out = {}
    for key, value in after.items():
        d = value - before.get(key, 0)
        if d < 0:
            raise WanError(f"byte counter {key} went backwards ({before.get(key)} -> {value}): was the link recreated?")
        out[key] = d
    return out


# ---------------------------------------------------------------- root actions


def run_cmd(cmd: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """Run one ``ip``/``tc`` command; WanError with its stderr if it fails (and ``check``)."""
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise WanError(f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f} s") from None
    if check and res.returncode != 0:
        raise WanError(f"`{' '.join(cmd)}` failed (exit {res.returncode}): {res.stderr.strip()}")
    return res.stdout


def cleanup() -> tuple[list[str], list[str]]:
    """Remove every root-namespace link and namespace whose name starts with ``p2pd-wan-``; returns them.

    The bridge ports go first (deleting a veth end deletes its peer inside the namespace), then the
    bridge, then the namespaces."""
    ns, links = leftovers(parse_netns_list(run_cmd(["ip", "netns", "list"])),
                          parse_link_names(run_cmd(["ip", "-j", "link", "show"])))
    errors = []
    for cmd in [["ip", "link", "delete", name] for name in links] + [["ip", "netns", "delete", name] for name in ns]:
        try:
            run_cmd(cmd)
        except WanError as e:
            errors.append(str(e))
    ns_after, links_after = leftovers(parse_netns_list(run_cmd(["ip", "netns", "list"])),
                                      parse_link_names(run_cmd(["ip", "-j", "link", "show"])))
    if ns_after or links_after:
        raise WanError(f"clean-up left {ns_after + links_after} behind: {'; '.join(errors) or 'no error reported'}")
    return ns, links


class Wan:
    """The hosts of a :class:`WanPlan`, built on entry and torn down on exit (whatever happened)."""

    def __init__(self, plan: WanPlan) -> None:
        self.plan = plan
        self.up = False

    def __enter__(self) -> Wan:
        if os.geteuid() != 0:
            raise WanError("the WAN harness needs root (network namespaces, veth, bridge, tc)")
        ns, links = leftovers(parse_netns_list(run_cmd(["ip", "netns", "list"])),
                              parse_link_names(run_cmd(["ip", "-j", "link", "show"])))
        if ns or links:
            raise WanError(f"leftovers of an earlier run: {ns + links}; remove them with "
                           f"`python scripts/wan/netns.py --cleanup` (is another run going on?)")
        self.up = True  # from here on, anything partly built is removed on exit
        try:
            for cmd in setup_commands(self.plan):
                run_cmd(cmd)
        except BaseException:
            self.close()
            raise
        log.info("WAN up: %d hosts at %g Mbit/s each way (%s)", self.plan.hosts, self.plan.rate_mbit, self.plan.subnet)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self.up:
            self.up = False
            removed_ns, removed_links = cleanup()
            log.info("WAN down: removed %d namespaces, %d links", len(removed_ns), len(removed_links))

    def address(self, i: int) -> str:
        return host_address(self.plan, i)

    def command(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run inside host i."""
        return [*exec_prefix(i), *cmd]

    def popen(self, i: int, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside host i in its own session (stop it with :func:`stop_group`)."""
        return subprocess.Popen(self.command(i, cmd), start_new_session=True, **kw)

    def counters(self, i: int) -> dict[str, int]:
        """Host i's interface byte counters, read inside its namespace (``tx_bytes``: what it sent)."""
        path = f"/sys/class/net/{inner_if(i)}/statistics"
        out = run_cmd(self.command(i, ["cat", f"{path}/tx_bytes", f"{path}/rx_bytes"])).split()
        if len(out) != 2:
            raise WanError(f"unexpected byte counters of host {i}: {out!r}")
        return {"tx_bytes": int(out[0]), "rx_bytes": int(out[1])}

    def all_counters(self) -> list[dict[str, int]]:
        return [self.counters(i) for i in range(self.plan.hosts)]

    def qdisc(self, i: int) -> str:
        """``tc qdisc show`` of host i's inner interface (for the record)."""
        return run_cmd(["tc", "-n", netns_name(i), "qdisc", "show", "dev", inner_if(i)]).strip()


def stop_group(p: subprocess.Popen[Any], grace_s: float) -> int | None:
    """Stop a process started with a new session: SIGTERM to the leader only (a learner leaves gracefully
    and stops its own helpers), then after ``grace_s`` SIGKILL to its whole group (what it started may
    outlive it)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)
    return p.returncode


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; raised so that every ``finally`` (teardown) runs."""


@contextmanager
def handle_signals() -> Iterator[None]:
    """Within this block SIGINT and SIGTERM raise :class:`Interrupted` (teardown still runs)."""
    def _raise(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------- CLI


def measure_throughput(wan: Wan, seconds: float) -> dict[str, float]:
    """Host 1 sends to host 0 over TCP for ``seconds``; returns Mbit/s of payload (a check of the bucket)."""
    port = 5599
    server = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{wan.address(0)}',{port}));s.listen(1);c,_=s.accept();n=0;t=time.monotonic()\n"
              "while (b:=c.recv(1<<16)): n+=len(b)\n"
              "print(n, time.monotonic()-t)")
    client = ("import socket,time;s=socket.create_connection(('%s',%d),timeout=10);b=b'x'*(1<<16);t=time.monotonic()\n"
              "while time.monotonic()-t<%f: s.sendall(b)\n"
              "s.close()") % (wan.address(0), port, seconds)
    srv = wan.popen(0, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        before = wan.counters(1)
        run_cmd(wan.command(1, [sys.executable, "-c", client]), timeout_s=seconds + 30)
        out, _ = srv.communicate(timeout=seconds + 30)
        after = wan.counters(1)
    finally:
        stop_group(srv, grace_s=2)
    n, dt = out.split()
    sent = byte_delta(before, after)["tx_bytes"]
    return {"payload_mbit_s": int(n) * 8 / float(dt) / 1e6, "wire_tx_bytes": sent, "payload_bytes": int(n)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cleanup", action="store_true", help="remove every p2pd-wan-* namespace and link, then exit")
    p.add_argument("--hosts", type=int, default=2, help="hosts for --check (default: 2)")
    p.add_argument("--rate", type=float, default=10.0, help="Mbit/s per host link for --check (default: 10)")
    p.add_argument("--check", action="store_true", help="build the hosts, measure one TCP stream, tear down")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.cleanup:
            ns, links = cleanup()
            print(f"removed {len(ns)} namespaces {ns} and {len(links)} links {links}")
            return 0
        if args.check:
            with handle_signals(), Wan(WanPlan(hosts=max(2, args.hosts), rate_mbit=args.rate)) as wan:
                print(wan.qdisc(1))
                res = measure_throughput(wan, seconds=5.0)
                print(f"host 1 -> host 0: {res['payload_mbit_s']:.2f} Mbit/s of payload at a {args.rate:g} Mbit/s "
                      f"limit ({res['wire_tx_bytes'] / max(1, res['payload_bytes']):.3f} wire bytes per payload byte)")
            return 0
        p.print_help()
        return 2
    except (WanError, ValueError, Interrupted) as e:
        print(f"wan: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
