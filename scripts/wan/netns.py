#!/usr/bin/env python3
"""An emulated WAN on one machine: N learner hosts as Linux network namespaces on a private bridge.

Each host ``i`` is a network namespace ``p2pd-wan-h<i>`` holding one end of a veth pair
(``p2pd-wan-n<i>``, address ``10.77.0.<i+1>/24``); the other end (``p2pd-wan-v<i>``) is a port of
the bridge ``p2pd-wan-br`` in the root namespace. The bridge has no address and the namespaces have
no default route, so the hosts reach each other and nothing else: no traffic leaves the bridge, and
the host's own interfaces, routes and firewall are never touched.

Each host's link is rate-limited in both directions with a token bucket (``tc qdisc ... tbf``): on
the egress of its namespace end (what the host sends) and on the egress of its bridge port (what
it receives).

Latency (``--rtt-ms``): netem is not available on this kernel, so delaying TCP relays (``relay.py``) add
it, one per service port in each host. The service listens on its namespace's own loopback and announces
the relay on the host's bridge address, so every connection between two hosts crosses exactly one relay
(the dialled host's), which holds each chunk for RTT/2 each way. A ragged host (``--host-rtt-ms 3=300``)
has its own RTT; a pair gets the larger of its two, applied by the dialled relay by source address.
Only TCP to known ports is delayed: ports chosen at run time (gloo's pair connections) cannot be
relayed. With no RTT (the default) no relay runs: round trips stay at tens of microseconds.

Everything is created under the prefix ``p2pd-wan-`` and removed again on exit, on error and on
SIGINT/SIGTERM (:class:`Wan` is a context manager; :func:`handle_signals` turns both signals into
exceptions so that ``finally`` runs); ``python scripts/wan/netns.py --cleanup`` removes leftovers
of a run that was killed with SIGKILL, by that prefix only.

The plan (names, addresses, ``tc`` arguments, relay delays, listen arguments) is pure functions over a
frozen :class:`WanPlan`, tested in ``tests/unit/test_wan_plan.py``; only :class:`Wan` and :func:`cleanup`
run commands (as root). Only the standard library is imported here.

    sudo python scripts/wan/netns.py --check --rate-mbit 10 --rtt-ms 100     # build 2 hosts, measure, tear down
    sudo python scripts/wan/netns.py --check --hosts 3 --rtt-ms 100 --host-rtt-ms 2=300
    sudo python scripts/wan/netns.py --cleanup
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import selectors
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
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
MAX_RTT_MS = 20_000.0
"""Longest round trip a plan may ask for (twice the relay's longest delay)."""
SERVICE_HOST = "127.0.0.1"
"""Where a relayed service listens inside its host: that namespace's own loopback."""
RELAY = Path(__file__).resolve().parent / "relay.py"
RELAY_START_TIMEOUT_S = 20.0
"""A relay prints where it listens within this (a Python start on busy cores)."""
RELAY_STOP_GRACE_S = 5.0
"""SIGTERM to SIGKILL for a relay (it exits at once)."""
CHECK_PORT = 5599
"""The port of ``--check``'s measurement server in host 0."""
CHECK_PINGS = 21
"""Round trips measured by ``--check`` (after one more to warm up); the median is reported."""
CHECK_BULK_S = 5.0
"""Length of ``--check``'s one-way bulk transfer (6 MB at 10 Mbit/s)."""
CHECK_RTT_TOLERANCE = 0.2
"""``--check`` fails when a median round trip is more than this share away from the requested one."""


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
    rtt_ms: float = 0.0
    """Round trip between hosts added by the relays (ms); 0 = none, and no relay runs."""
    host_rtt_ms: tuple[tuple[int, float], ...] = ()
    """(host, ms): hosts with a round trip of their own instead of ``rtt_ms`` (a ragged host)."""

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
        for name, ms in [("rtt_ms", self.rtt_ms), *((f"host_rtt_ms of host {i}", v) for i, v in self.host_rtt_ms)]:
            if not 0 <= ms <= MAX_RTT_MS:  # also refuses NaN
                raise ValueError(f"{name} must be in [0, {MAX_RTT_MS:g}] ms, got {ms}")
        hosts = [i for i, _ in self.host_rtt_ms]
        if any(not 0 <= i < self.hosts for i in hosts) or len(set(hosts)) != len(hosts):
            raise ValueError(f"host_rtt_ms: host indices must be distinct and in [0, {self.hosts}), got {hosts}")

    @property
    def relayed(self) -> bool:
        """Whether relays add latency (some host has a round trip above 0)."""
        return self.rtt_ms > 0 or any(ms > 0 for _, ms in self.host_rtt_ms)


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


def parse_host_rtts(values: Iterable[str]) -> tuple[tuple[int, float], ...]:
    """``--host-rtt-ms`` values (``3=300``, repeatable or comma-separated) -> ((3, 300.0),); ValueError naming the
    bad item (the plan checks the ranges)."""
    out = []
    for item in (x for v in values for x in v.split(",") if x.strip()):
        host, sep, ms = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out.append((int(host), float(ms)))
        except ValueError:
            raise ValueError(f"--host-rtt-ms {item!r}: expected HOST=MS, e.g. 3=300") from None
    return tuple(out)


def host_rtt_ms(plan: WanPlan, i: int) -> float:
    """Host i's round trip: its own (``host_rtt_ms``) or the plan's."""
    return dict(plan.host_rtt_ms).get(i, plan.rtt_ms)


def pair_rtt_ms(plan: WanPlan, a: int, b: int) -> float:
    """The emulated round trip between hosts a and b: the larger of theirs; 0 within one host."""
    return 0.0 if a == b else max(host_rtt_ms(plan, a), host_rtt_ms(plan, b))


def relay_command(plan: WanPlan, i: int, port: int, python: str = sys.executable) -> list[str]:
    """The relay that host i runs for a service on ``port``: on its bridge address, to 127.0.0.1 of its own
    namespace, holding each chunk for half the round trip to whoever dials (by source address)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"relay port must be in [1, 65535], got {port}")
    cmd = [python, str(RELAY), "--listen", f"{host_address(plan, i)}:{port}", "--target", f"{SERVICE_HOST}:{port}",
           "--delay-ms", f"{host_rtt_ms(plan, i) / 2:g}"]
    for j in range(plan.hosts):
        cmd += ["--source-delay-ms", f"{host_address(plan, j)}={pair_rtt_ms(plan, i, j) / 2:g}"]
    return cmd


def listen_args(plan: WanPlan, i: int, port: int) -> list[str]:
    """``p2p-diloco`` listen options for a peer in host i: its bridge address when there is no latency (any port,
    as before); with relays, 127.0.0.1 and the fixed ``port`` behind the relay, announcing the relay's address."""
    if not plan.relayed:
        return ["--host", host_address(plan, i)]
    return ["--host", SERVICE_HOST, "--port", str(port), "--announce", f"/ip4/{host_address(plan, i)}/tcp/{port}"]


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
        self.relays: list[subprocess.Popen[str]] = []

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
        log.info("WAN up: %d hosts at %g Mbit/s each way, round trip %g ms%s (%s)", self.plan.hosts,
                 self.plan.rate_mbit, self.plan.rtt_ms,
                 "".join(f", host {i} {ms:g} ms" for i, ms in self.plan.host_rtt_ms), self.plan.subnet)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        relays, self.relays = self.relays, []
        for p in relays:  # before the namespaces go
            stop_group(p, grace_s=RELAY_STOP_GRACE_S)
            if p.stdout is not None:
                p.stdout.close()
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

    def start_relay(self, i: int, port: int) -> None:
        """Start host i's relay for a service on ``port`` (see :func:`relay_command`) and wait until it accepts;
        it runs until :meth:`close`. Only with latency in the plan: without, services listen on the bridge."""
        if not self.plan.relayed:
            raise WanError("start_relay: the plan has no latency (rtt_ms 0): services listen on the bridge directly")
        p = self.popen(i, relay_command(self.plan, i, port), stdout=subprocess.PIPE, text=True)
        self.relays.append(p)
        line = first_line(p, RELAY_START_TIMEOUT_S)
        if not line.startswith("listening on "):
            raise WanError(f"the relay of host {i} for port {port} did not start within {RELAY_START_TIMEOUT_S:.0f} s "
                           f"(exit code {p.poll()}, said {line.strip()!r})")

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


def first_line(p: subprocess.Popen[str], timeout_s: float) -> str:
    """The first line ``p`` writes to its stdout pipe, or "" if none comes within ``timeout_s`` (no busy wait)."""
    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        return p.stdout.readline() if sel.select(timeout=timeout_s) else ""


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


ECHO_SERVER = """\
import socket, sys, threading
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
def serve(c):
    with c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if c.recv(1) == b"p":  # ping-pong: echo each byte
            while b := c.recv(1):
                c.sendall(b)
        else:  # bulk: count bytes until the end of stream, then report them
            n = 0
            while b := c.recv(1 << 16):
                n += len(b)
            c.sendall(str(n).encode())
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
"""``--check``'s measurement server in host 0 (stdlib Python run with ``-c``): ping-pong or bulk per connection."""

PING_CLIENT = """\
import json, socket, sys, time
c, rtts = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60), []
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.sendall(b"p")
for _ in range(int(sys.argv[3]) + 1):
    t = time.monotonic()
    c.sendall(b"x")
    assert c.recv(1) == b"x"
    rtts.append((time.monotonic() - t) * 1e3)
print(json.dumps(rtts[1:]))
"""
"""Round trips of one byte, in ms (the first, which may pay for the connection's set-up, left out)."""

BULK_CLIENT = """\
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.sendall(b"b")
block, t = b"x" * (1 << 16), time.monotonic()
while time.monotonic() - t < float(sys.argv[3]):
    c.sendall(block)
c.shutdown(socket.SHUT_WR)
print(int(c.recv(64)), time.monotonic() - t)
"""
"""Sends for some seconds; payload bytes over the time until the server counted the last one."""


def _start_check_server(wan: Wan) -> subprocess.Popen[str]:
    host = SERVICE_HOST if wan.plan.relayed else wan.address(0)  # behind its relay, or on the bridge
    srv = wan.popen(0, [sys.executable, "-c", ECHO_SERVER, host, str(CHECK_PORT)],
                    stdout=subprocess.PIPE, text=True)
    if first_line(srv, RELAY_START_TIMEOUT_S).strip() != "ready":
        stop_group(srv, grace_s=2)
        raise WanError(f"--check: the measurement server in host 0 did not start (exit code {srv.poll()})")
    return srv


def measure(wan: Wan, pings: int = CHECK_PINGS, bulk_s: float = CHECK_BULK_S) -> dict[str, Any]:
    """Round trips from every other host to host 0 (median of ``pings``, with the expected value) and the rate
    of a one-way bulk transfer host 1 -> host 0 (payload Mbit/s, and wire bytes per payload byte)."""
    plan, target = wan.plan, [wan.address(0), str(CHECK_PORT)]
    srv = _start_check_server(wan)
    try:
        if plan.relayed:
            wan.start_relay(0, CHECK_PORT)
        pairs = []
        for j in range(1, plan.hosts):
            out = run_cmd(wan.command(j, [sys.executable, "-c", PING_CLIENT, *target, str(pings)]),
                          timeout_s=60 + pings * MAX_RTT_MS / 1e3)
            rtts = json.loads(out)
            pairs.append({"from": j, "to": 0, "requested_ms": pair_rtt_ms(plan, j, 0),
                          "median_ms": statistics.median(rtts), "min_ms": min(rtts), "max_ms": max(rtts)})
        before = wan.counters(1)
        out = run_cmd(wan.command(1, [sys.executable, "-c", BULK_CLIENT, *target, f"{bulk_s:g}"]),
                      timeout_s=bulk_s + 60)
        after = wan.counters(1)
    finally:
        stop_group(srv, grace_s=2)
    n, dt = out.split()
    sent = byte_delta(before, after)["tx_bytes"]
    return {"plan": asdict(plan), "rtt": pairs, "bulk": {
        "from": 1, "to": 0, "payload_bytes": int(n), "seconds": float(dt),
        "payload_mbit_s": int(n) * 8 / float(dt) / 1e6, "requested_mbit_s": plan.rate_mbit,
        "wire_bytes_per_payload_byte": sent / max(1, int(n))}}


def check_rtts(result: dict[str, Any], tolerance: float = CHECK_RTT_TOLERANCE) -> list[str]:
    """Round trips measured by :func:`measure` too far from the requested ones (only where latency was asked for:
    without it the round trip is whatever the bridge gives)."""
    return [f"host {p['from']} -> host {p['to']}: {p['median_ms']:.1f} ms measured, {p['requested_ms']:g} requested"
            for p in result["rtt"]
            if p["requested_ms"] > 0 and abs(p["median_ms"] - p["requested_ms"]) > tolerance * p["requested_ms"]]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--cleanup", action="store_true", help="remove every p2pd-wan-* namespace and link, then exit")
    p.add_argument("--check", action="store_true",
                   help="build the hosts, measure round trips and one bulk transfer, print them as JSON, tear down")
    p.add_argument("--hosts", type=int, default=2, help="hosts for --check (default: 2)")
    p.add_argument("--rate-mbit", "--rate", dest="rate", type=float, default=10.0,
                   help="Mbit/s per host link for --check (default: 10)")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="round trip between hosts added by relays, ms (default: 0 = none, no relays)")
    p.add_argument("--host-rtt-ms", action="append", default=[], metavar="HOST=MS",
                   help="a host with its own round trip, e.g. 3=300 (repeatable); a pair gets the larger of theirs")
    p.add_argument("--json", metavar="FILE", help="--check: also write the measurements to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.cleanup:
            ns, links = cleanup()
            print(f"removed {len(ns)} namespaces {ns} and {len(links)} links {links}")
            return 0
        if args.check:
            plan = WanPlan(hosts=max(2, args.hosts), rate_mbit=args.rate, rtt_ms=args.rtt_ms,
                           host_rtt_ms=parse_host_rtts(args.host_rtt_ms))
            with handle_signals(), Wan(plan) as wan:
                print(wan.qdisc(1))
                result = measure(wan)
            for pair in result["rtt"]:
                print(f"host {pair['from']} -> host {pair['to']}: round trip {pair['median_ms']:.2f} ms median "
                      f"({pair['min_ms']:.2f}-{pair['max_ms']:.2f}), {pair['requested_ms']:g} ms requested")
            bulk = result["bulk"]
            print(f"host 1 -> host 0: {bulk['payload_mbit_s']:.2f} Mbit/s of payload at a {plan.rate_mbit:g} Mbit/s "
                  f"limit ({bulk['wire_bytes_per_payload_byte']:.3f} wire bytes per payload byte)")
            print(json.dumps(result))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
            off = check_rtts(result)
            if off:
                print(f"wan: round trips off by more than {CHECK_RTT_TOLERANCE:.0%}: {'; '.join(off)}", file=sys.stderr)
                return 1
            return 0
        p.print_help()
        return 2
    except (WanError, ValueError, Interrupted) as e:
        print(f"wan: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
