"""A member joined to a run: DHT, identity, publisher (what `heartbeat` and a learner hold)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from p2p_diloco.core.console import out
from p2p_diloco.core.logs import log_handled
from p2p_diloco.hivemind_ext.procguard import stop_process

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config
    from p2p_diloco.net.membership import SwarmOptions, SwarmSnapshot
    from p2p_diloco.net.records import LocalRun
    from p2p_diloco.net.runconfig import RunAnnouncer

logger = logging.getLogger(__name__)


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
def joined_run(opts: "SwarmOptions", name: str | None, local: "LocalRun", num_fragments: int, *, ttl_s: float,
               state: str = "idle", profile: str = "", cfg: "Config | None" = None) -> Iterator[Joined]:
    """Join ``local``'s run as a member (shared by ``heartbeat`` and the learner's ``join``).

    Starts the DHT (a fresh private identity unless ``opts.identity``), named ``name`` (default ``peer-`` + the
    peer id's last 6 characters), refuses to go on if the run's
    live peers disagree with our config hash or protocol (:func:`records.check_join`) or if another live peer
    holds ``name`` (:func:`check_name_free`), publishes our
    first record and, given the run's ``cfg``, our config record (refreshed every
    ``CONFIG_REFRESH_FACTOR x ttl_s``: how a joiner without a config finds it) and prints the
    ``joined run`` line. On exit the DHT is shut down; a graceful
    leave (tombstone) is the caller's ``joined.publisher.leave()``.
    """
    from p2p_diloco.net.membership import (
        RecordPublisher,
        read_swarm,
        start_dht,
        visible_addresses,
    )
    from p2p_diloco.net.records import PeerRecord, check_join, check_label

    check_label("name", name or "")
    check_label("profile", profile)
    ephemeral = opts.identity is None
    if ephemeral:  # no --identity: a fresh key, written to a private temp file so libp2p uses it too
        opts = ephemeral_identity(opts)
    assert opts.identity is not None
    key = opts.identity.private_key()
    try:
        dht = start_dht(opts, local.run_id, private_key=key)
    except BaseException:
        if ephemeral:
            remove_ephemeral(opts)
        raise
    announcer = None
    try:
        peer_id = dht.peer_id.to_base58()
        snapshot = read_swarm(dht, local)
        ok, reason = check_join(snapshot.views, local, peer_id)
        if not ok:
            if cfg is not None:  # other data or tokenizer: say so, naming both fingerprints
                from p2p_diloco.net.runconfig import explain_refusal

                reason = explain_refusal(dht, cfg, snapshot.views, reason)
            raise ValueError(reason)
        if name:  # an explicit --name; the generated one ends with our own peer id
            check_name_free(dht, local, name, peer_id, snapshot)
        name = name or f"peer-{peer_id[-6:]}"
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
                out(f"note: foreign peer {v.record.name} ({v.peer_id}): {v.reason}")
        out(f"joined run {local.run_id} as {name} ({peer_id}); config hash {local.config_hash}; "
             f"{len(snapshot.live())} other live peers; heartbeat every {ttl_s / 3:.1f} s, ttl {ttl_s:g} s")
        for m in record.addresses:
            out(f"listening: {m}")
        with leave_on_failure(publisher):
            yield Joined(dht, publisher, opts, snapshot, peer_id, name, key)
    finally:
        if announcer is not None:
            announcer.stop()
        stop_process(dht, "DHT process")
        if ephemeral:
            remove_ephemeral(opts)


def check_name_free(dht: Any, local: "LocalRun", name: str, peer_id: str, snapshot: "SwarmSnapshot",
                    poll_s: float = 0.5) -> None:
    """Raise ``ValueError`` (one line; exit code 2) if a live peer of the run other than us (another peer id) holds
    ``name`` (:func:`records.name_holder`). A live record need not be a live peer: one killed without a goodbye
    leaves it for a TTL. So the holder must prove it is there: its record is read again every ``poll_s`` seconds
    until its next heartbeat is due (a peer publishes every ``ttl_s / 3`` s), plus one more period of slack.
    Refreshed: the name is taken. Gone, a tombstone, or not refreshed by then: a note, and the name is ours.
    Two peers that start at the same moment do not see each other (neither has published yet)."""
    import time

    from hivemind.utils import get_dht_time

    from p2p_diloco.net.membership import read_swarm
    from p2p_diloco.net.records import name_holder

    first = name_holder(snapshot.views, name, peer_id)
    if first is None:
        return
    refresh_by = first.time + 2 * first.ttl_s / 3  # DHT time: a heartbeat period after its last, and one of slack
    while get_dht_time() < refresh_by:
        time.sleep(poll_s)
        holder = name_holder(read_swarm(dht, local, index=False).views, name, peer_id)
        if holder is None:  # it left (tombstone) or its record expired
            return
        if holder.time > first.time:
            raise ValueError(f"name {name!r}: already taken by live peer {holder.peer_id[-8:]} (pick another name, "
                             f"or give none for a generated one)")
    out(f"note: name {name!r}: the record of peer {first.peer_id[-8:]} that holds it was not refreshed for "
        f"{get_dht_time() - first.time:.0f} s (a stopped peer's); taking the name")


def _publish_config(dht: Any, key: Any, cfg: "Config", peer_id: str, ttl_s: float) -> "RunAnnouncer":
    """A member's config record: published once now, then every ``CONFIG_REFRESH_FACTOR x ttl_s`` in a
    thread (stored for ``CONFIG_TTL_FACTOR x ttl_s``); returns the running announcer."""
    from p2p_diloco.net.runconfig import (
        CONFIG_REFRESH_FACTOR,
        CONFIG_TTL_FACTOR,
        RunAnnouncer,
        config_record,
    )

    announcer = RunAnnouncer(dht, key, config_record(cfg, peer_id, 0.0), config_refresh_s=CONFIG_REFRESH_FACTOR * ttl_s,
                             config_ttl_s=CONFIG_TTL_FACTOR * ttl_s)
    try:
        ok = announcer.publish_config()
    except Exception:  # a store that timed out: not fatal (the bootstrap or other members have it); retried
        log_handled(logger, "publishing our config record failed; retrying in the background")
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
            out(f"leaving after an error ({type(e).__name__}); tombstone {'published' if ok else 'NOT accepted'}")
        raise


def ephemeral_identity(opts: "SwarmOptions") -> "SwarmOptions":
    """``opts`` with a fresh identity in a private temp folder (removed by :func:`remove_ephemeral`)."""
    import dataclasses
    import tempfile

    from p2p_diloco.net.keys import load_or_create_identity

    folder = Path(tempfile.mkdtemp(prefix="p2p-diloco-id-"))  # mode 0700
    identity = load_or_create_identity(folder / "identity.key")
    return dataclasses.replace(opts, identity=identity, check_identity_free=False)


def remove_ephemeral(opts: "SwarmOptions") -> None:
    assert opts.identity is not None
    opts.identity.path.unlink(missing_ok=True)
    opts.identity.path.parent.rmdir()
