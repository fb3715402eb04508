"""Peer records: what each peer publishes in the DHT, the schema every node enforces, and the pure
decisions taken from them (compatible? live, left or foreign? what does the swarm look like?).

Layout in the DHT (documented in ``status --help`` too):

* ``run_key(run_id, peer_id)`` = ``"p2p-diloco.run.<run_id>_peers_<shard>"``, the peer's shard of
  :data:`RECORD_SHARDS` (:func:`record_shard`, a hash of its peer id): one subkey per peer, the subkey being
  ``RSASignatureValidator``'s owner marker ``b"[owner:<ssh-rsa public key>]"``; the value is the
  full :class:`PeerRecord` as a plain dict, stored with ``expiration_time = now + ttl_s``.
  A graceful leave stores the same record with ``state="left"`` and a longer expiration: a
  tombstone that says who left and when.
* ``index_key(peer_id)`` = ``"p2p-diloco_runs_<shard>"`` (:data:`INDEX_KEYS`, the same shards): the same
  owners, with a small :class:`IndexEntry` each
  (run id, protocol, config hash, name, state). It lets ``status`` list every run in a DHT and
  show peers of *other* runs as foreign (their full records live under their own run key, which
  a node of our run cannot validate because DHT keys are hashed). A ``bootstrap`` peer publishes an
  entry in state ``bootstrap`` there too: it announces its run (so that a joiner without a config
  finds it before any learner exists) but is never a member (no record under the run key).
* ``config_key(run_id)`` = ``"p2p-diloco.run.<run_id>_config"``: the same owners, each with a
  :class:`RunConfigRecord` (the resolved config as canonical JSON, at most :data:`MAX_CONFIG_CHARS`
  characters, and its hash), stored for ``CONFIG_TTL_FACTOR x ttl_s``: how a joiner without
  ``--config`` gets the run's config (:mod:`p2p_diloco.net.runconfig` verifies its hash).

Records and index entries are sharded because hivemind answers every search of a key -- a store's
search for the nodes to store on as well -- with *all* of its subkeys: with one key for everyone, each
heartbeat of each peer fetched every record in the swarm, and a swarm's publishing grew with N squared.

Every node validates these keys with ``SchemaValidator`` (the pydantic.v1 models below; strict
types, bounded sizes, no NaN) behind ``RSASignatureValidator`` (only the key's owner may write its
subkey). Everything here except :func:`peer_schemas` is pure and imports no hivemind.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Dict, Iterable, Iterator, Literal, Mapping, Optional

from pydantic.v1 import (
    BaseModel,
    Extra,
    ValidationError,
    confloat,
    conint,
    conlist,
    constr,
    create_model,
    validator,
)

from p2p_diloco.core.rejects import PeerDataError, Reason

logger = logging.getLogger(__name__)

STATES = ("joining", "idle", "training", "averaging", "syncing", "leaving", "left")
"""``idle``: a member that publishes but does not train (the ``heartbeat`` stand-in, monitors);
``left``: the tombstone of a graceful leave."""
ANNOUNCE_STATE = "bootstrap"
"""The state of a bootstrap peer's index entry: it announces a run and is never one of its members."""
INDEX_STATES = STATES + (ANNOUNCE_STATE,)
STEPPING_STATES = ("training", "averaging")
"""States of learners that take inner steps: their records' step times and token rates are current."""

RUN_KEY_PREFIX = "p2p-diloco.run."
INDEX_PREFIX = "p2p-diloco"
RECORD_SHARDS = 4
"""Peer records and index entries are spread over this many DHT keys each, by a hash of the peer id: a store
(heartbeat) costs what one shard holds (N / 4 records), a full read of the swarm is one batched search
of all the shards. Every node asked answers for each key with its nearest neighbours too, whether it holds the key
or not: at 16 shards those lists were most of a full read's bytes (a learner of four read 16 mostly empty keys)."""
INDEX_KEYS = tuple(f"{INDEX_PREFIX}_runs_{shard}" for shard in range(RECORD_SHARDS))
RSA_OWNER_RE = re.compile(rb"^\[owner:(.+?)\]$", re.S)
"""A subkey that is exactly hivemind's RSA owner marker (``RSASignatureValidator.PUBLIC_KEY_FORMAT``; a test
pins it)."""
ED25519_OWNER_PATTERN = rb"\[ed25519:([A-Za-z0-9+/]{43}=)\]"
"""An Ed25519 owner marker, its base64 public key as the group (:mod:`p2p_diloco.net.signing`)."""
OWNER_MARKER_RE = re.compile(rb"^(?:\[owner:(.+?)\]|" + ED25519_OWNER_PATTERN + rb")$", re.S)
"""A subkey that is exactly an owner marker of either kind, RSA or Ed25519 (:mod:`p2p_diloco.net.signing`):
what the schemas accept as a peer's subkey."""

MAX_NAME_CHARS = 64
"""Longest run id, peer name or profile label a record may hold (:func:`check_label`)."""
MAX_ADDRESSES = 16
MAX_ADDRESS_CHARS = 256
MAX_FRAGMENTS = 1024
MAX_INT = 2**63 - 1
"""Largest integer a record may hold (msgpack's int64; larger ones are refused as oversize)."""
MAX_CONFIG_CHARS = 16384
"""Largest config text a config record may hold (a resolved config is about 1,100 characters)."""


def check_label(what: str, value: str) -> None:
    """Raise ``ValueError`` (one line) if ``value`` (a peer's ``name`` or ``profile``) is longer than a record may
    hold: checked before joining, since a record the schema refuses is refused by every DHT node, and the publisher
    retries it for ``3 x join_timeout_s`` with warnings about our clock."""
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{what}: at most {MAX_NAME_CHARS} characters (a peer record's limit), got {len(value):,}")


def run_key_prefix(run_id: str) -> str:
    return f"{RUN_KEY_PREFIX}{run_id}"


def record_shard(peer_id: str) -> int:
    """Which of the :data:`RECORD_SHARDS` keys holds this peer's record and index entry (stable across runs)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % RECORD_SHARDS


def run_keys(run_id: str) -> tuple[str, ...]:
    """The DHT keys of a run's peer records, one per shard (SchemaValidator fields ``peers_<shard>`` under
    ``run_key_prefix``)."""
    return tuple(f"{run_key_prefix(run_id)}_peers_{shard}" for shard in range(RECORD_SHARDS))


def run_key(run_id: str, peer_id: str) -> str:
    """The DHT key that holds ``peer_id``'s record in ``run_id`` (its shard's)."""
    return run_keys(run_id)[record_shard(peer_id)]


def index_key(peer_id: str) -> str:
    """The DHT key that holds ``peer_id``'s run index entry (its shard's)."""
    return INDEX_KEYS[record_shard(peer_id)]


def config_key(run_id: str) -> str:
    """The DHT key of a run's config records (SchemaValidator field ``config`` under ``run_key_prefix``)."""
    return f"{run_key_prefix(run_id)}_config"


# ---------------------------------------------------------------- the record (pure data)


@dataclass(frozen=True)
class PeerRecord:
    """One peer's self-description, refreshed every ``ttl_s / 3`` seconds."""

    run_id: str
    protocol_version: int
    config_hash: str
    software_version: str
    peer_id: str
    """Base58 libp2p peer id; must match the owner key (checked by ``Membership``)."""
    name: str
    profile: str = ""
    """Peer profile name (kind of machine), empty if none."""
    addresses: tuple[str, ...] = ()
    state: str = "joining"
    inner_step: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    """Wall time per inner step since the learner started training (0 = not measured yet): what the sync
    clock's period is derived from (stable, unlike a windowed tokens/s)."""
    sync_link_s: float = 0.0
    """Link seconds one sync of every fragment takes this learner, from what its rounds measured (0 = not measured
    yet): the sync clock's period is kept above it (:func:`~p2p_diloco.net.clock.derive_period`)."""
    fragment_versions: tuple[int, ...] = ()
    """Outer-step count of each fragment's anchor, by fragment index."""
    anchor_hashes: tuple[str, ...] = ()
    """Hash of each fragment's anchor (16 hex digits; equal iff bit-identical), by fragment index."""
    consensus_distance: tuple[float, ...] = ()
    """Per fragment, ``||ours - theirs|| / ||theirs||`` of the last fork we healed (two anchors at the same
    version); 0.0 until one was seen."""
    last_sync_time: float = 0.0
    """DHT time of the last completed fragment sync; 0 = never."""
    bytes_sent: int = 0
    bytes_received: int = 0
    loss: float | None = None
    """Latest training loss; None when unknown (NaN is not representable: peers would reject it)."""
    time: float = 0.0
    """DHT time when this record was published (for a tombstone: when the peer left)."""
    ttl_s: float = 30.0
    """Heartbeat TTL the peer uses: its record expires this long after ``time``."""

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack-safe dict (lists, str keys, python floats) as stored in the DHT."""
        d = asdict(self)
        d["addresses"] = list(self.addresses)
        d["fragment_versions"] = list(self.fragment_versions)
        d["anchor_hashes"] = list(self.anchor_hashes)
        d["consensus_distance"] = [float(x) for x in self.consensus_distance]
        for k in ("tokens_per_s", "step_time_s", "sync_link_s", "last_sync_time", "time", "ttl_s"):
            d[k] = float(d[k])
        if self.loss is not None:
            d["loss"] = float(self.loss) if math.isfinite(self.loss) else None
        return d

    @classmethod
    def from_wire(cls, value: Any) -> "PeerRecord":
        """Parse a stored value, strictly (raises :class:`~p2p_diloco.core.rejects.PeerDataError`, a
        ``ValueError`` with a one-line reason and a reason code)."""
        m = _parse(PeerRecordModel, value, "peer record")
        d = m.dict()
        d["addresses"] = tuple(d["addresses"])
        for k in ("fragment_versions", "anchor_hashes", "consensus_distance"):
            d[k] = tuple(d[k])
        return cls(**d)


@dataclass(frozen=True)
class IndexEntry:
    """The small per-peer entry under its shard of :data:`INDEX_KEYS` (:func:`index_key`)."""

    run_id: str
    protocol_version: int
    config_hash: str
    software_version: str
    peer_id: str
    name: str
    state: str
    time: float

    @classmethod
    def of(cls, record: PeerRecord) -> "IndexEntry":
        return cls(**{f.name: getattr(record, f.name) for f in fields(cls)})

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["time"] = float(d["time"])
        return d

    @classmethod
    def from_wire(cls, value: Any) -> "IndexEntry":
        """Parse a stored value, strictly (raises :class:`~p2p_diloco.core.rejects.PeerDataError`)."""
        return cls(**_parse(IndexEntryModel, value, "index entry").dict())

    @property
    def announces(self) -> bool:
        """A bootstrap peer's entry: it makes its run visible but is no member of it."""
        return self.state == ANNOUNCE_STATE


@dataclass(frozen=True)
class RunConfigRecord:
    """A run's resolved config as one peer publishes it under :func:`config_key`."""

    run_id: str
    config_hash: str
    """The hash the publisher computed (:func:`p2p_diloco.core.identity.config_hash`); a reader recomputes it."""
    protocol_version: int
    software_version: str
    peer_id: str
    """Base58 peer id of the publisher; must match the owner key (checked when read)."""
    config: str
    """The config as canonical JSON (``json.dumps(cfg.to_dict(), sort_keys=True)``), at most
    :data:`MAX_CONFIG_CHARS` characters."""
    time: float = 0.0
    """DHT time of publication."""

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["time"] = float(d["time"])
        return d

    @classmethod
    def from_wire(cls, value: Any) -> "RunConfigRecord":
        """Parse a stored value, strictly (raises :class:`~p2p_diloco.core.rejects.PeerDataError`)."""
        return cls(**_parse(RunConfigModel, value, "config record").dict())


_OVERSIZE_ERRORS = frozenset({"value_error.any_str.max_length", "value_error.list.max_items",
                              "value_error.number.not_le"})


def _parse(model: type[BaseModel], value: Any, what: str) -> Any:
    """``model.parse_obj(value)``, every failure a :class:`PeerDataError` with a one-line reason."""
    if not isinstance(value, Mapping):
        raise PeerDataError(Reason.MALFORMED, f"{what} must be a dict, got {type(value).__name__}")
    if not all(isinstance(k, str) for k in value):  # pydantic would raise TypeError: keywords must be strings
        raise PeerDataError(Reason.MALFORMED, f"invalid {what}: its keys must be strings")
    try:
        return model.parse_obj(value)
    except ValidationError as e:
        err = e.errors()[0]
        raise PeerDataError(_reason(err, value), f"invalid {what}: {_first_error(err)}") from None


def _first_error(err: Mapping[str, Any]) -> str:
    return f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"


def _reason(err: Mapping[str, Any], value: Any) -> Reason:
    if err["type"] in _OVERSIZE_ERRORS:
        return Reason.OVERSIZE
    offending: Any = value
    for part in err["loc"]:  # the offending input itself: a NaN fails ``ge=0`` before it fails finiteness
        try:
            offending = offending[part]
        except (KeyError, IndexError, TypeError):
            offending = None
            break
    if err["type"] == "value_error.number.not_finite_number" or (
            isinstance(offending, float) and not math.isfinite(offending)):
        return Reason.NON_FINITE
    return Reason.MALFORMED


# ---------------------------------------------------------------- the schema (pydantic.v1, for SchemaValidator)

_Name = constr(strict=True, max_length=MAX_NAME_CHARS)
_NonNegInt = conint(strict=True, ge=0, le=MAX_INT)
_NonNegFloat = confloat(strict=True, ge=0.0, allow_inf_nan=False)


class OwnerKey(bytes):
    """A subkey that is exactly an owner marker, ``[ed25519:<public key>]`` or hivemind's RSA
    ``[owner:<public key>]`` (strict bytes; :mod:`p2p_diloco.net.signing`)."""

    @classmethod
    def __get_validators__(cls) -> Iterator[Callable[[Any], bytes]]:
        yield cls.validate

    @classmethod
    def validate(cls, value: Any) -> bytes:
        if not isinstance(value, bytes) or OWNER_MARKER_RE.match(value) is None:
            raise ValueError("subkey must be an owner marker b'[ed25519:<public key>]' or b'[owner:<public key>]'")
        return value


def _check_state(value: str) -> str:
    if value not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}")
    return value


def _check_index_state(value: str) -> str:
    if value not in INDEX_STATES:
        raise ValueError(f"state must be one of {', '.join(INDEX_STATES)}")
    return value


class PeerRecordModel(BaseModel):
    run_id: _Name
    protocol_version: _NonNegInt
    config_hash: constr(strict=True, max_length=64)
    software_version: constr(strict=True, max_length=32)
    peer_id: constr(strict=True, max_length=128)
    name: _Name
    profile: _Name
    addresses: conlist(constr(strict=True, max_length=MAX_ADDRESS_CHARS), max_items=MAX_ADDRESSES)
    state: constr(strict=True, max_length=16)
    inner_step: _NonNegInt
    tokens: _NonNegInt
    tokens_per_s: _NonNegFloat
    step_time_s: _NonNegFloat
    sync_link_s: _NonNegFloat = 0.0  # a record without it (an older peer's) is valid: not measured
    fragment_versions: conlist(_NonNegInt, max_items=MAX_FRAGMENTS)
    anchor_hashes: conlist(constr(strict=True, regex=r"^[0-9a-f]{0,16}$"), max_items=MAX_FRAGMENTS)
    consensus_distance: conlist(_NonNegFloat, max_items=MAX_FRAGMENTS)
    last_sync_time: _NonNegFloat
    bytes_sent: _NonNegInt
    bytes_received: _NonNegInt
    loss: Optional[confloat(strict=True, allow_inf_nan=False)]
    time: _NonNegFloat
    ttl_s: confloat(strict=True, gt=0.0, allow_inf_nan=False)

    _state = validator("state", allow_reuse=True)(_check_state)

    class Config:
        extra = Extra.forbid


class IndexEntryModel(BaseModel):
    run_id: _Name
    protocol_version: _NonNegInt
    config_hash: constr(strict=True, max_length=64)
    software_version: constr(strict=True, max_length=32)
    peer_id: constr(strict=True, max_length=128)
    name: _Name
    state: constr(strict=True, max_length=16)
    time: _NonNegFloat

    _state = validator("state", allow_reuse=True)(_check_index_state)

    class Config:
        extra = Extra.forbid


class RunConfigModel(BaseModel):
    run_id: _Name
    config_hash: constr(strict=True, max_length=64)
    protocol_version: _NonNegInt
    software_version: constr(strict=True, max_length=32)
    peer_id: constr(strict=True, max_length=128)
    config: constr(strict=True, max_length=MAX_CONFIG_CHARS)
    time: _NonNegFloat

    class Config:
        extra = Extra.forbid


RunPeersSchema = create_model("RunPeersSchema", config=(Dict[OwnerKey, RunConfigModel], ...),
                              **{f"peers_{shard}": (Dict[OwnerKey, PeerRecordModel], ...) for shard in range(RECORD_SHARDS)})
"""The keys under :func:`run_key_prefix`: the config records and the peer records' shards."""
RunIndexSchema = create_model("RunIndexSchema", **{f"runs_{shard}": (Dict[OwnerKey, IndexEntryModel], ...)
                                                   for shard in range(RECORD_SHARDS)})
"""The keys under :data:`INDEX_PREFIX`: the run index's shards."""


def peer_schemas(run_id: str | None) -> list[Any]:
    """The record validators every node of ``run_id`` installs (imports hivemind); ``None`` (a node that
    does not know its run yet: ``status``, ``doctor``) installs only the run index's."""
    from hivemind.dht.schema import SchemaValidator

    class StrictSchemaValidator(SchemaValidator):
        """hivemind's, except that a record it cannot even inspect is refused instead of raising (1.1.12
        raises ``TypeError`` for a msgpack list or dict as subkey, which makes the DHT request fail)."""

        def validate(self, record: Any) -> bool:
            try:
                return bool(super().validate(record))
            except Exception as e:
                logger.debug("refused a DHT record that hivemind's schema validator could not inspect: %r", e)
                return False

    index = StrictSchemaValidator(RunIndexSchema, allow_extra_keys=True, prefix=INDEX_PREFIX)
    if run_id is None:
        return [index]
    return [StrictSchemaValidator(RunPeersSchema, allow_extra_keys=True, prefix=run_key_prefix(run_id)), index]


# ---------------------------------------------------------------- pure decisions


@dataclass(frozen=True)
class LocalRun:
    """What a local peer must agree on with the swarm."""

    run_id: str
    protocol_version: int
    config_hash: str
    software_version: str

    @classmethod
    def from_config(cls, cfg: Any) -> "LocalRun":
        from p2p_diloco.core.version import VERSION as __version__
        from p2p_diloco.core.config import PROTOCOL_VERSION
        from p2p_diloco.core.identity import config_hash

        return cls(cfg.run.run_id, PROTOCOL_VERSION, config_hash(cfg), __version__)


def adopt_majority(local: LocalRun, records: Iterable[PeerRecord | IndexEntry]) -> LocalRun:
    """For an observer without the run's config (``status --run-id``): take the protocol version and
    config hash most of the run's non-departed peers publish. ``local`` is returned unchanged if
    it has a config hash or nobody of its run is there."""
    if local.config_hash:
        return local
    counts = Counter((r.protocol_version, r.config_hash) for r in records
                     if r.run_id == local.run_id and r.state != "left")
    if not counts:
        return local
    (protocol_version, config_hash), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    return replace(local, protocol_version=protocol_version, config_hash=config_hash)


def is_compatible(record: PeerRecord | IndexEntry, local: LocalRun) -> tuple[bool, str]:
    """May ``record``'s peer train with us? Returns (ok, one-line reason; "" when identical)."""
    if record.run_id != local.run_id:
        return False, f"run id differs: theirs {record.run_id!r}, ours {local.run_id!r}"
    if record.protocol_version != local.protocol_version:
        return False, (f"protocol version differs: theirs {record.protocol_version}, ours {local.protocol_version} "
                       f"(their p2p-diloco {record.software_version}, ours {local.software_version})")
    if record.config_hash != local.config_hash:
        return False, f"config hash differs: theirs {record.config_hash}, ours {local.config_hash}"
    if record.software_version != local.software_version:
        return True, f"software version differs (theirs {record.software_version}, ours {local.software_version}); protocol matches"
    return True, ""


Status = Literal["live", "left", "foreign", "expired"]


@dataclass(frozen=True)
class PeerView:
    """A record as seen at one moment: its classification and why."""

    record: PeerRecord | IndexEntry
    expiration_time: float
    status: Status
    reason: str = ""

    @property
    def peer_id(self) -> str:
        return self.record.peer_id


def classify(entries: Iterable[tuple[PeerRecord | IndexEntry, float]], local: LocalRun, now: float) -> list[PeerView]:
    """Classify (record, expiration time) pairs at DHT time ``now``.

    expired: its expiration passed (a DHT cache may still hold it); left: a tombstone, whatever the
    config, protocol or run it had (a departed peer disturbs nobody: it is not foreign, and the join check
    and ``doctor`` do not warn about it); foreign: incompatible with ``local``; live: everything else.
    One view per peer id: the newest record wins (a peer that restarted with a new subkey keeps one row).
    """
    newest: dict[str, tuple[PeerRecord | IndexEntry, float]] = {}
    for record, expiration in entries:
        old = newest.get(record.peer_id)
        if old is None or record.time > old[0].time:
            newest[record.peer_id] = (record, expiration)
    views = []
    for record, expiration in newest.values():
        ok, reason = is_compatible(record, local)
        if expiration < now:
            views.append(PeerView(record, expiration, "expired", f"expired {now - expiration:.1f} s ago"))
        elif record.state == "left":
            views.append(PeerView(record, expiration, "left", f"left at {record.time:.1f}"))
        elif not ok:
            views.append(PeerView(record, expiration, "foreign", reason))
        else:
            views.append(PeerView(record, expiration, "live", reason))
    views.sort(key=lambda v: (natural_key(v.record.name), v.peer_id))
    return views


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders the numbers inside a peer name by value: l2 before l10 (the launcher names peers
    l0, l1, ... and a swarm of more than ten is listed in that order)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def merge_index(views: list[PeerView], index_views: list[PeerView]) -> list[PeerView]:
    """Add foreign peers known only from the index (other runs, or records not yet visible) to ``views``.
    A bootstrap's announcement is no peer of any run, and a tombstone known only from the index (another run's
    departed peer: the run index counts it) none of ours: both are left out."""
    known = {v.peer_id for v in views}
    extra = [v for v in index_views if v.peer_id not in known and v.status in ("foreign",)
             and v.record.state != ANNOUNCE_STATE]
    return sorted(views + extra, key=lambda v: (v.status != "live", natural_key(v.record.name), v.peer_id))


def check_join(views: Iterable[PeerView], local: LocalRun, own_peer_id: str) -> tuple[bool, str]:
    """Compatibility check at join: refuse if the run has live peers and none of them agrees with us.

    Only peers of our run id count (other runs may share a DHT). If some live peers agree with us,
    we join and the disagreeing ones are someone else's problem (they show as foreign).
    """
    same_run = [v for v in views if v.peer_id != own_peer_id and v.record.run_id == local.run_id
                and v.status in ("live", "foreign") and v.record.state != "left"]
    if not same_run or any(v.status == "live" for v in same_run):
        return True, ""
    for attr, what, fix in (
        ("protocol_version", "protocol version", "install the p2p-diloco version the run uses"),
        ("config_hash", "config hash", "start with the run's config (same --config/--set as its peers) "
                                       "or choose another run.run_id"),
    ):
        theirs = Counter(getattr(v.record, attr) for v in same_run)
        ours = getattr(local, attr)
        if ours not in theirs:
            value, count = theirs.most_common(1)[0]
            return False, (f"refused by run {local.run_id!r}: {what} differs: ours {ours}, "
                           f"the run's {value} ({count} of {len(same_run)} live peers); {fix}")
    return False, f"refused by run {local.run_id!r}: incompatible with its {len(same_run)} live peers"


def name_holder(views: Iterable[PeerView], name: str, own_peer_id: str) -> PeerRecord | None:
    """The record of the live peer of our run, other than us, that carries ``name`` (``join --name``), or None.
    Tombstones, expired records and foreign peers hold no name; our own earlier record (same peer id) neither."""
    for v in views:
        if (v.status == "live" and isinstance(v.record, PeerRecord) and v.record.name == name
                and v.peer_id != own_peer_id):
            return v.record
    return None


def tombstone(record: PeerRecord, now: float) -> PeerRecord:
    """The record a peer stores when it leaves gracefully."""
    return replace(record, state="left", time=now, tokens_per_s=0.0)
