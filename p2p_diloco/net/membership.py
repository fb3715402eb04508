"""Swarm membership: start or join the DHT, publish signed peer records, read the swarm, decide membership.

The DHT *is* the swarm's memory; there is no server. A peer:

1. starts a hivemind DHT node (``start_dht``): loopback or a given LAN address, relay / auto-NAT /
   UPnP off, an RSA identity shared by libp2p and the record signer, and, for a private swarm, a
   shared-secret token authorizer (:class:`SwarmKeyAuthorizer`). Failures to join become one-line
   :class:`JoinError` messages that say what was tried and what to check, within a bounded time.
2. publishes its :class:`~p2p_diloco.net.records.PeerRecord` every ``ttl_s / 3`` seconds with
   ``expiration_time = now + ttl_s`` (:class:`RecordPublisher`), and a tombstone on a graceful leave.
3. reads the swarm (:func:`read_swarm`) and answers :meth:`Membership.is_member` for the averaging
   and state handlers (the DHT authorizer does not cover their RPCs; the remote peer id that
   libp2p reports there is authenticated, and records are owned by the same key).

hivemind 1.1.12 facts this relies on are in ``docs/design.md`` ("What hivemind 1.1.12 does here"); the ones found while
writing this module are marked "verified here".
"""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.core.logs import log_handled
from p2p_diloco.hivemind_ext import peerids, procguard
from p2p_diloco.hivemind_ext.dhtpipe import GuardedDHT
from p2p_diloco.hivemind_ext.peerids import peer_id_from_ed25519
from p2p_diloco.net.addresses import PeerAddress, host_multiaddr
from p2p_diloco.net.authorizer import MAX_DHT_CLOCK_SKEW_S, SwarmKeyAuthorizer
from p2p_diloco.net.keys import (
    Identity,
    peer_id_from_public_key,
)
from p2p_diloco.net.records import (
    ANNOUNCE_STATE,
    INDEX_KEYS,
    IndexEntry,
    LocalRun,
    PeerRecord,
    PeerView,
    adopt_majority,
    classify,
    merge_index,
    peer_schemas,
    index_key,
    run_key,
    run_keys,
    tombstone,
)
from p2p_diloco.net.nearest import READ_REPLICAS, RECORD_READ_REPLICAS, answer_values, get_nearest, store_nearest
from p2p_diloco.net.runs import RunInfo, runs_in_index
from p2p_diloco.net.signing import Ed25519Key, SigningKey, owner_public_key, signature_validators
from p2p_diloco.net.signing import owner_subkey as owner_subkey  # where the learner and averagers import it

logger = logging.getLogger(__name__)



class JoinError(ValueError):
    """Could not join the swarm; the message is one line saying what was tried and what to check."""


class SwarmKeyError(JoinError):
    """The initial peers answered at the network level but refused our DHT requests (or we theirs)."""


class ClockSkewError(JoinError):
    """An initial peer's clock differs from ours by more than the DHT tolerates (:data:`MAX_DHT_CLOCK_SKEW_S`)."""


@dataclass(frozen=True)
class SwarmOptions:
    """How this peer takes part in the DHT."""

    initial_peers: tuple[PeerAddress, ...] = ()
    """Validated multiaddrs of live peers; empty = start a new swarm (a bootstrap peer)."""
    host: str = "127.0.0.1"
    """Address to listen on: 127.0.0.1 (this machine), a LAN address, or 0.0.0.0 (then set announce)."""
    port: int = 0
    """TCP port to listen on; 0 = any free port (fine unless others must reach a fixed address)."""
    announce: tuple[str, ...] = ()
    """Multiaddrs to announce instead of the listening ones (explicit ports), e.g. /ip4/192.168.1.5/tcp/31337."""
    identity: Identity | None = None
    """Key file: stable peer id and record-signing key. None = a fresh key for this process."""
    check_identity_free: bool = True
    """Ask the initial peers whether our identity is already in use (hivemind starts a second daemon for
    it, ~0.3 s); pointless for a freshly generated key."""
    client_mode: bool = False
    """Take part without serving the DHT (status, doctor): others never route to us."""
    swarm_key: bytes | None = None
    """Shared secret of a private swarm (``keygen``); None = open swarm."""
    join_timeout_s: float = 10.0
    """Bound on starting the daemon and joining the initial peers."""
    rpc_timeout_s: float = 3.0
    """hivemind's ``wait_timeout``: how long one DHT request waits for an answer."""


# ---------------------------------------------------------------- joining


def owned_values(found: Any) -> dict[str, Any]:
    """The values of a ``dht.get(key, latest=True)`` result by the peer id of the owner-marker subkey each was
    stored under (signed: only that peer can have stored it); subkeys of any other kind are skipped."""
    owned: dict[str, Any] = {}
    for subkey, item in (found.value.items() if found is not None and isinstance(found.value, dict) else ()):
        peer = owner_peer_id(subkey)
        if peer is not None:
            owned[peer] = item.value
    return owned


def owner_peer_id(subkey: bytes) -> str | None:
    """The peer id of an owner-marker subkey, or None if it is not one."""
    owner = owner_public_key(subkey)
    if owner is None:
        return None
    kind, public = owner
    try:
        return peer_id_from_ed25519(public) if kind == "ed25519" else peer_id_from_public_key(public)
    except ValueError:
        return None


PROBE_TIMEOUT_S = 2.0
"""How long a TCP probe of a peer's address waits for the connection to open."""


def tcp_probe(addr: PeerAddress, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None if a TCP connection to the address opens, else why not, in words a user can act on."""
    try:
        with socket.create_connection((addr.host, addr.port), timeout=timeout_s):
            return None
    except TimeoutError:
        return (f"no answer within {timeout_s:g} s: the host is unreachable from here, or a firewall drops the "
                f"connection")
    except ConnectionRefusedError:
        return "connection refused: the host is up but nothing listens on that port"
    except OSError as e:
        return e.strerror or type(e).__name__


HANDSHAKE_FAILED = ("a TCP connection opened, but no libp2p peer of that id answered on it: is the /p2p/ peer id "
                    "current, and is it a p2p-diloco peer's port (not another program's, or a proxy's)?")
"""Why a join failed when the address's TCP port opens (:func:`tcp_probe` found nothing wrong)."""


def _tried(opts: SwarmOptions) -> str:
    return ", ".join(a.text for a in opts.initial_peers)


_HIVEMIND_SKEW_RE = re.compile(r"local:\s*(-?[\d.]+),\s*peer:\s*(-?[\d.]+)")


def clock_skew_in(text: str) -> float | None:
    """Our clock minus the peer's (s) from hivemind's bootstrap error "local time must be within 3
    seconds of others(local: L, peer: P)", or None if the text does not carry both times."""
    m = _HIVEMIND_SKEW_RE.search(text)
    return float(m.group(1)) - float(m.group(2)) if m else None


def skew_verdict(skew_s: float, ok_below_s: float = 1.0) -> bool | None:
    """``doctor``'s verdict on one measured clock offset: True (fine), None (works, but close to the
    DHT's limit), False (the DHT refuses this peer's records: above :data:`MAX_DHT_CLOCK_SKEW_S`)."""
    if abs(skew_s) <= ok_below_s:
        return True
    return None if abs(skew_s) < MAX_DHT_CLOCK_SKEW_S else False


def explain_join_failure(error: BaseException, opts: SwarmOptions) -> JoinError:
    """Turn what hivemind raised while joining into one line for a user (probes TCP to say more)."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    key_hint = "our --swarm-key" if opts.swarm_key else "a --swarm-key (the swarm may be private)"
    if "failed to connect to bootstrap peers" in text:
        parts = []
        for addr in opts.initial_peers:
            why = tcp_probe(addr)
            parts.append(f"{addr.text} ({HANDSHAKE_FAILED if why is None else why})")
        return JoinError(f"could not join: no initial peer reachable; tried {'; '.join(parts)}. "
                         f"Check that a peer runs at that address (p2p-diloco bootstrap prints it), the port and firewall.")
    if "none of the initial_peers responded" in text:
        return SwarmKeyError(f"could not join: swarm key mismatch: {_tried(opts)} answered but refused our DHT requests. "
                             f"Check {key_hint}: every peer needs the same secret file (p2p-diloco keygen), or none.")
    if "local time must be within" in text:
        skew_s = clock_skew_in(text)
        measured = (f"our clock is {abs(skew_s):.1f} s {'ahead of' if skew_s > 0 else 'behind'} an initial peer"
                    if skew_s is not None else text)
        return ClockSkewError(f"could not join: clock skew above {MAX_DHT_CLOCK_SKEW_S:.0f} s: {measured} "
                              f"(tried {_tried(opts)}). Synchronise both machines' clocks (NTP: timedatectl set-ntp true).")
    if isinstance(error, TimeoutError):
        return JoinError(f"could not join within {opts.join_timeout_s:.0f} s: tried {_tried(opts)}. "
                         f"Check that they are up (p2p-diloco doctor --initial-peers …) and not overloaded.")
    return JoinError(f"could not join: {text} (tried {_tried(opts) or 'no initial peers'})")


DHT_REPLICAS = 3
"""How many of the nodes nearest a key store each value (hivemind's default: 5), and how many a searched read keeps
(a read straight at the nearest nodes asks fewer: :data:`~p2p_diloco.net.nearest.READ_REPLICAS`). Every store
costs this many calls, each carrying the value: at 5, in a swarm of four
learners and a bootstrap, every value went to and came from every node (bench_control at N = 4: 3,649 -> 2,952 B/s
a learner at 3). Records, index entries and the clock are stored again within seconds to a minute; a vouch is
written at every commit and only the latest versions' are read: losing the three nodes that hold one between two
commits loses at most a download's check, which the next commit's vouches restore."""


def store(dht: Any, key: Any, value: Any, expiration_time: float, *, subkey: Any = None,
          return_future: bool = False) -> Any:
    """``dht.store``, straight to the nodes nearest ``key`` where this node knows the whole swarm
    (:func:`~p2p_diloco.net.nearest.store_nearest`), else by a search that keeps as many nearest nodes as a value is
    stored on (:data:`DHT_REPLICAS`): hivemind's search asks nodes that each answer with all they hold under the key
    -- a shard's records, a version's vouches -- so a searched store cost what a full read of the key did."""
    return dht.run_coroutine(partial(store_nearest, key, value, expiration_time, subkey), return_future=return_future)


def start_dht(opts: SwarmOptions, run_id: str | None, *, private_key: SigningKey | None = None) -> DHT:
    """Start this peer's DHT node and join ``opts.initial_peers``; raise :class:`JoinError` on failure.

    Records of ``run_id`` and the run index are schema-checked and signature-checked by this node
    (``run_id`` None: a client that does not know its run yet checks the index only).
    ``private_key`` signs our records; it must be the identity's key (pass None to use it).
    """
    if private_key is None:
        private_key = opts.identity.private_key() if opts.identity is not None else Ed25519Key.generate()
    # hivemind's authorizer signs every request with an RSA key (any: its token, not the key, proves the secret)
    rsa_key = private_key if isinstance(private_key, RSAPrivateKey) else RSAPrivateKey.process_wide()
    validators = [*signature_validators(private_key, rsa_key), *peer_schemas(run_id)]
    kwargs: dict[str, Any] = dict(
        host_maddrs=[host_multiaddr(opts.host, opts.port)],
        client_mode=opts.client_mode,
        use_relay=False,
        use_auto_relay=False,
        auto_nat=False,
        nat_port_map=False,
        wait_timeout=opts.rpc_timeout_s,
        num_replicas=DHT_REPLICAS,
        bootstrap_timeout=opts.rpc_timeout_s,
        startup_timeout=opts.join_timeout_s,
    )
    if opts.announce:
        kwargs["announce_maddrs"] = list(opts.announce)
    if opts.identity is not None:
        kwargs["identity_path"] = str(opts.identity.path)
        kwargs["check_if_identity_free"] = opts.check_identity_free
    if opts.swarm_key is not None:
        kwargs["authorizer"] = SwarmKeyAuthorizer(opts.swarm_key, rsa_key)
    procguard.install()  # the DHT process and its p2pd must not outlive us, even after kill -9
    peerids.install()  # hivemind's check that our identity is free reads RSA key files only
    t0 = time.monotonic()
    dht = GuardedDHT(  # survives a leaving averager's last request (see its module)
        initial_peers=[a.text for a in opts.initial_peers] or None,
        start=True,
        await_ready=False,
        record_validators=validators,
        **kwargs,
    )
    try:
        dht.wait_until_ready(timeout=opts.join_timeout_s)
    except BaseException as e:
        _stop_quietly(dht)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise explain_join_failure(e, opts) from None
    dht.run_coroutine(answer_values)
    logger.info("DHT up in %.2f s as %s (%s)", time.monotonic() - t0, dht.peer_id,
                "client" if opts.client_mode else "server")
    return dht


def _stop_quietly(dht: DHT) -> None:
    """Shut a DHT down after a failed start (its process may already have exited)."""
    stop_dht(dht)


def stop_dht(dht: DHT) -> None:
    """Shut our DHT process (and with it its ``p2pd``) down within bounded time (:func:`procguard.stop_process`)."""
    procguard.stop_process(dht, "DHT process")


def visible_addresses(dht: DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


# ---------------------------------------------------------------- reading the swarm


@dataclass(frozen=True)
class SwarmSnapshot:
    """What one read of the DHT showed."""

    now: float
    local: LocalRun
    """The run we looked at (with the majority config hash adopted if we had none)."""
    views: tuple[PeerView, ...]
    """Records of our run, plus foreign peers known from the index."""
    runs: dict[str, int]
    """Live peers per run id in this DHT (from the index; bootstraps aside)."""
    rejected: tuple[str, ...] = ()
    """One line per record dropped while reading (bad owner, bad schema)."""
    runs_detail: tuple[RunInfo, ...] = ()
    """Every run in the index (live ones first), when the index was read."""

    def live(self) -> list[PeerView]:
        return [v for v in self.views if v.status == "live"]


def read_entries(dht: DHT, keys: Sequence[str], parse: Callable[[Any], Any]) -> tuple[list[tuple[Any, float]], list[str]]:
    """One read of ``keys`` (the shards of one kind of record, or a single key): (record parsed by ``parse``,
    expiration time) per subkey whose owner published it, and one line per dropped subkey (bad schema,
    record of another peer id than its owner key)."""
    rejected: list[str] = []
    found = read_many(dht, keys)
    entries = _entries_across(found, keys, parse, rejected)
    for line in rejected:
        logger.warning("dropped a record under %s: %s", keys[0] if len(keys) == 1 else f"{len(keys)} keys", line)
    return entries, rejected


def _entries(result: Any, parse: Any, rejected: list[str]) -> list[tuple[Any, float]]:
    if result is None or not isinstance(result.value, dict):
        return []
    out = []
    for subkey, item in result.value.items():
        owner = owner_peer_id(subkey)
        try:
            record = parse(item.value)
        except ValueError as e:
            rejected.append(f"{owner or '?'}: {e}")
            continue
        if owner != record.peer_id:
            rejected.append(f"record of {record.peer_id} is owned by another key ({owner}); ignored")
            continue
        out.append((record, float(item.expiration_time)))
    return out


def _entries_across(found: dict[str, Any], keys: Sequence[str], parse: Any, rejected: list[str]) -> list[tuple[Any, float]]:
    """:func:`_entries` of each of ``keys`` in one :func:`read_many` result (the shards of one kind of record)."""
    return [e for key in keys for e in _entries(found.get(key), parse, rejected)]


READ_TIMEOUT_S = 60.0
"""A read of the DHT that has not answered in this long raises instead of waiting on: hivemind's
``run_coroutine`` waits forever when the DHT process is gone (killed, or dead of an error), which hung
``p2p-diloco swarm`` and made it deaf to Ctrl+C. A search of a live DHT ends well within it: every request it
makes has its own timeout."""


def read_many(dht: DHT, keys: Sequence[str], timeout_s: float = READ_TIMEOUT_S, *,
              replicas: int = READ_REPLICAS, replicas_of: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The latest value of each key (None where there is none), as ``dht.get(key, latest=True)`` returns it,
    from ``replicas`` of the nodes that store it (:func:`~p2p_diloco.net.nearest.get_nearest`): each node asked
    answers for every key it holds in one message, so ``k`` small keys cost about what one costs (what the
    learner's fast path reads every view period); ``replicas_of`` names other counts for some keys. Raises
    ``TimeoutError`` after ``timeout_s`` (:data:`READ_TIMEOUT_S`)."""
    unique = tuple(dict.fromkeys(keys))
    counts = tuple((replicas_of or {}).get(key, replicas) for key in unique)
    future = dht.run_coroutine(partial(get_nearest, unique, counts), return_future=True)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        alive = "alive" if dht.is_alive() else "dead"
        raise TimeoutError(f"a DHT read of {len(keys)} keys had no answer in {timeout_s:g} s "
                           f"(the DHT process is {alive})") from None


def read_swarm(dht: DHT, local: LocalRun, index: bool = True) -> SwarmSnapshot:
    """One read of the run's records and (``index``) the run index, classified at the current DHT time.
    A learner reading every second leaves the index out: it only needs its own run's records, and each
    read is a DHT search that every other peer's DHT process answers."""
    keys = run_keys(local.run_id)
    found = read_many(dht, keys + (INDEX_KEYS if index else ()), replicas=RECORD_READ_REPLICAS)  # every shard at once
    now = get_dht_time()
    rejected: list[str] = []
    run_entries = _entries_across(found, keys, PeerRecord.from_wire, rejected)
    local = adopt_majority(local, (r for r, _ in run_entries))
    views = classify(run_entries, local, now)
    index_entries = _entries_across(found, INDEX_KEYS if index else (), IndexEntry.from_wire, rejected)
    index_views = classify(index_entries, local, now)
    runs: dict[str, int] = {}
    for v in index_views:
        if v.status != "expired" and v.record.state not in ("left", ANNOUNCE_STATE):
            runs[v.record.run_id] = runs.get(v.record.run_id, 0) + 1
    for line in rejected:
        logger.warning("dropped a peer record: %s", line)
    return SwarmSnapshot(now, local, tuple(merge_index(views, index_views)), runs, tuple(rejected),
                         tuple(runs_in_index(index_entries, now)) if index else ())


def members_of(snapshot: SwarmSnapshot) -> frozenset[str]:
    """Peer ids allowed in our averaging / state handlers: live, compatible, owner-verified."""
    return frozenset(v.peer_id for v in snapshot.views if v.status == "live" and isinstance(v.record, PeerRecord))


class Membership:
    """``is_member(peer_id)`` for RPC handlers, from the DHT records, cached.

    A peer is a member when it has a live record of our run, compatible with us, whose signing
    key is the key behind ``peer_id``. The cache is refreshed every ``refresh_interval_s``, and
    sooner (at most every ``min_refresh_interval_s``) when an unknown peer asks, so a newcomer
    is admitted as soon as its first record is visible.
    """

    def __init__(self, dht: DHT, local: LocalRun, refresh_interval_s: float = 5.0,
                 min_refresh_interval_s: float = 1.0):
        self._dht, self._local = dht, local
        self.refresh_interval_s, self.min_refresh_interval_s = refresh_interval_s, min_refresh_interval_s
        self._members: frozenset[str] = frozenset()
        self._refreshed_at = -float("inf")
        self._lock = threading.Lock()

    def refresh(self) -> frozenset[str]:
        members = members_of(read_swarm(self._dht, self._local))
        with self._lock:
            self._members, self._refreshed_at = members, time.monotonic()
        return members

    def is_member(self, peer_id: PeerID | str) -> bool:
        pid = peer_id.to_base58() if isinstance(peer_id, PeerID) else str(peer_id)
        age = time.monotonic() - self._refreshed_at
        if age > self.refresh_interval_s or (pid not in self._members and age > self.min_refresh_interval_s):
            self.refresh()
        return pid in self._members


# ---------------------------------------------------------------- publishing


INDEX_TTL_FACTOR = 3.0
"""A run index entry lives this many record TTLs, and is stored again once a record TTL has passed (every third
heartbeat) or when it changes: it only says which run a peer is in and its state, and every store of it is
answered with its whole shard."""


def index_due(now: float, sent: tuple[float, IndexEntry] | None, entry: IndexEntry, ttl_s: float) -> bool:
    """Whether a publish stores the index entry too: the first time, when what it says changed (its time
    aside: a state change, a tombstone), or once ``ttl_s`` has passed since the last one (its lifetime is
    ``INDEX_TTL_FACTOR x ttl_s``, so two refreshes may be lost before it expires)."""
    return sent is None or replace(entry, time=0.0) != sent[1] or now - sent[0] >= ttl_s


KEEP_ALIVE_POLL_S = 1.0
"""Seconds between two looks of the record keep-alive at the thread it handed the heartbeat over to (is it still
running?)."""


class RecordPublisher:
    """Publishes this peer's record every ``ttl_s / 3`` s in a thread (:meth:`start`); a tombstone on :meth:`leave`.

    A record that is not refreshed disappears ``ttl_s`` after its last publication (crash, kill -9,
    lost network). The tombstone outlives it by ``tombstone_ttl_s`` so ``status`` can say who left.
    The thread is a keep-alive: it publishes only when nobody has for ``ttl_s / 3`` s, and not at all while the
    thread given to :meth:`hand_over` runs (the learner's status thread, which publishes on its own schedule).
    """

    def __init__(self, dht: DHT, private_key: SigningKey, record: PeerRecord,
                 ttl_s: float = 30.0, tombstone_ttl_s: float = 600.0, store_timeout_s: float = 10.0):
        if ttl_s <= 0 or tombstone_ttl_s < ttl_s:
            raise ValueError(f"ttl_s must be > 0 and tombstone_ttl_s >= ttl_s, got {ttl_s} and {tombstone_ttl_s}")
        self._dht = dht
        self._subkey = owner_subkey(private_key)
        self.ttl_s, self.tombstone_ttl_s, self.store_timeout_s = ttl_s, tombstone_ttl_s, store_timeout_s
        self._record = replace(record, ttl_s=float(ttl_s))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0
        self._index_sent: tuple[float, IndexEntry] | None = None
        """(DHT time, entry without its time) of the last index entry stored."""
        self._published_at = -math.inf
        """Monotonic time of the last publish begun, by any thread (the keep-alive counts from it)."""
        self._owner: threading.Thread | None = None
        """The thread that publishes the heartbeat while it runs (:meth:`hand_over`)."""

    @property
    def record(self) -> PeerRecord:
        with self._lock:
            return self._record

    def update(self, **changes: Any) -> None:
        """Change fields of the record; they go out with the next heartbeat."""
        with self._lock:
            self._record = replace(self._record, **changes)

    def publish(self, record: PeerRecord | None = None, ttl_s: float | None = None) -> bool:
        """Store the record now, and its index entry when :func:`index_due`; True if some DHT node accepted
        each store."""
        self._published_at = time.monotonic()
        now = get_dht_time()
        record = replace(record or self.record, time=now)
        index_ttl_s = ttl_s if ttl_s is not None else INDEX_TTL_FACTOR * self.ttl_s  # a tombstone's: its own
        ttl_s = ttl_s if ttl_s is not None else self.ttl_s
        futures = [store(self._dht, run_key(record.run_id, record.peer_id), record.to_wire(), now + ttl_s,
                         subkey=self._subkey, return_future=True)]
        entry = IndexEntry.of(record)
        indexed = index_due(now, self._index_sent, entry, ttl_s)
        if indexed:
            futures.append(store(self._dht, index_key(record.peer_id), entry.to_wire(), now + index_ttl_s,
                                 subkey=self._subkey, return_future=True))
        ok = all(bool(f.result(timeout=self.store_timeout_s)) for f in futures)
        if ok and indexed:  # a refused index entry goes out again with the next publish
            self._index_sent = (now, replace(entry, time=0.0))
        if not ok:
            self.failures += 1
            logger.warning("publishing the peer record was not accepted by any DHT node (attempt failures: %d); if this "
                           "persists, check this machine's clock (p2p-diloco doctor): nodes refuse records from a "
                           "clock more than %.0f s off", self.failures, MAX_DHT_CLOCK_SKEW_S)
        return ok

    def publish_within(self, deadline_s: float, retry_interval_s: float = 1.0,
                       record: PeerRecord | None = None, ttl_s: float | None = None) -> bool:
        """Publish, retrying for up to ``deadline_s`` s: the first store after a join can time out
        on a busy machine (every new peer's DHT is still filling its routing table)."""
        give_up_at = time.monotonic() + deadline_s
        while True:
            try:
                if self.publish(record, ttl_s):
                    return True
            except Exception as e:  # a timed-out store future: retried like a refusal
                self.failures += 1
                logger.warning("publishing the peer record failed (%s: %s); retrying", type(e).__name__, e)
            if time.monotonic() + retry_interval_s >= give_up_at:
                return False
            time.sleep(retry_interval_s)
            retry_interval_s = min(2 * retry_interval_s, 8.0)

    def start(self) -> None:
        """Start the keep-alive thread (a joined :class:`~p2p_diloco.engine.swarm.Swarm`'s, from join to leave)."""
        self._thread = threading.Thread(target=self._loop, name="record-publisher", daemon=True)
        self._thread.start()

    def hand_over(self, owner: threading.Thread) -> None:
        """The heartbeat is ``owner``'s while it runs: the keep-alive thread publishes nothing then (two threads
        would each store the record every period). When ``owner`` ends (stopped, or died on an error), the
        keep-alive takes the heartbeat back, a period after the last publish."""
        self._owner = owner

    def stop(self) -> None:
        """Stop the keep-alive thread without a tombstone (:meth:`leave` publishes one). Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.store_timeout_s)

    @property
    def period_s(self) -> float:
        return self.ttl_s / 3

    def beat(self) -> bool:
        """One heartbeat: publish, and on any error log it (one line; whole with -v) and carry on (the next beat retries)."""
        try:
            return self.publish()
        except Exception:  # a DHT hiccup must not end the heartbeat; the record survives until its TTL
            self.failures += 1
            log_handled(logger, "heartbeat failed; retrying in %.1f s", self.period_s)
            return False

    def _owned(self) -> bool:
        return self._owner is not None and self._owner.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(KEEP_ALIVE_POLL_S if self._owned() else
                                  max(0.0, self._published_at + self.period_s - time.monotonic())):
            if not self._owned() and time.monotonic() - self._published_at >= self.period_s:
                self.beat()

    def leave(self) -> bool:
        """Stop the heartbeat and publish a tombstone (state ``left``)."""
        self.stop()
        return self.publish_within(self.store_timeout_s, record=tombstone(self.record, get_dht_time()),
                                   ttl_s=self.tombstone_ttl_s)


