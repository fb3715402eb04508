"""The run's config in the DHT: published by the peers of a run, fetched by a peer that has none.

A peer started without ``--config`` does not fall back to the built-in defaults (another run): it
reads the run index (:func:`read_runs`), picks the run that is there (:func:`records.pick_run`: the
only live one, else the only one a bootstrap announces; several or none is an error that lists
them), fetches that run's config records and keeps one only if its config, validated exactly as a
local file is, hashes to what the run's peers announce (:func:`config_from_records`).

Publishing (:class:`RunAnnouncer`): ``bootstrap`` and every member (``join``, ``heartbeat``) store
their resolved config under ``config_key(run_id)`` (subkey: their owner marker, so it is signed)
once at start and then every ``CONFIG_REFRESH_FACTOR x ttl`` with an expiration of
``CONFIG_TTL_FACTOR x ttl``: about 1.1 KB now and then, while peer records go out every ttl/3. A
bootstrap also announces its run in the index (state ``bootstrap``, every ``ANNOUNCE_TTL_S / 3``):
it makes the run visible before any learner exists, and is never one of its members.

Only the standard library and :mod:`p2p_diloco.core.config` / :mod:`p2p_diloco.net.records` are imported at
module level; the DHT functions import hivemind when called.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Iterable, Sequence

from p2p_diloco.core.config import (
    Config,
    ConfigError,
    load_config_data,
)
from p2p_diloco.core.identity import config_hash, pin_data
from p2p_diloco.core.logs import log_handled
from p2p_diloco.net.records import INDEX_KEYS, IndexEntry, RunConfigRecord, config_key, index_key
from p2p_diloco.net.runs import RunInfo, runs_in_index

logger = logging.getLogger(__name__)

CONFIG_REFRESH_FACTOR = 10.0
"""A peer republishes its config record every this many record TTLs (the config never changes; the
record only has to outlive the peer's own expiration)."""
CONFIG_TTL_FACTOR = 30.0
"""A config record expires this many record TTLs after its publication (three refresh periods)."""
ANNOUNCE_TTL_S = 30.0
"""Lifetime of a bootstrap's announcement in the index, republished every third of it (s)."""
BOOTSTRAP_CONFIG_REFRESH_S = CONFIG_REFRESH_FACTOR * ANNOUNCE_TTL_S
"""How often a bootstrap republishes its config record (s)."""


def config_text(cfg: Config) -> str:
    """The config as canonical JSON, with the data pinned (:func:`p2p_diloco.core.identity.pin_data`: the dataset
    fingerprint and the tokenizer hash filled in from our data), so that a peer without our data computes
    the same :func:`p2p_diloco.core.identity.config_hash` from it, and checks its own data against the pins."""
    return json.dumps(pin_data(cfg).to_dict(), sort_keys=True, separators=(",", ":"))


def config_record(cfg: Config, peer_id: str, now: float) -> RunConfigRecord:
    """Our config record for ``cfg`` (pure)."""
    from p2p_diloco.core.version import VERSION as __version__
    from p2p_diloco.core.config import PROTOCOL_VERSION

    return RunConfigRecord(run_id=cfg.run.run_id, config_hash=config_hash(cfg), protocol_version=PROTOCOL_VERSION,
                           software_version=__version__, peer_id=peer_id, config=config_text(cfg), time=float(now))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a config may hold")


def config_from_record(record: RunConfigRecord, expected_hash: str, overrides: Sequence[str] = ()) -> Config:
    """The config a record holds, validated as a local file is, if it hashes to ``expected_hash`` (what the
    run's peers announce), with ``--set`` ``overrides`` applied on top; else a one-line ``ValueError``."""
    return load_config_data(verified_config_data(record, expected_hash), overrides)


def verified_config_data(record: RunConfigRecord, expected_hash: str) -> dict[str, Any]:
    """The parsed config of a record, after checking that it is a valid config (as a local file must be)
    of the record's run that hashes to ``expected_hash``; else a one-line ``ValueError``."""
    where = f"the config of run {record.run_id} fetched from the DHT (published by {record.peer_id})"
    try:
        data = json.loads(record.config, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{where} is not valid JSON ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} is not a table of sections (got {type(data).__name__})")
    try:
        base = load_config_data(data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if base.run.run_id != record.run_id:
        raise ValueError(f"refused {where}: it is the config of run {base.run.run_id!r}")
    actual = config_hash(base)
    if actual != expected_hash:
        raise ValueError(f"refused {where}: it hashes to {actual}, but the run's peers announce {expected_hash}")
    return data


def config_from_records(records: Iterable[tuple[RunConfigRecord, float]], run: RunInfo, now: float,
                        overrides: Sequence[str] = ()) -> tuple[Config, RunConfigRecord]:
    """Pick, verify and load the config of ``run`` from its config records (pure).

    Candidates are the unexpired records of the run that claim the hash its peers announce
    (``run.config_hash``), newest first; the first whose config verifies wins (a record that claims
    the hash but holds another config is refused and logged). None there, or none that verifies: a
    one-line ``ValueError`` that says what to pass instead.
    """
    expected = run.config_hash
    if not expected:
        raise ValueError(f"run {run.run_id}: none of its peers announces a config hash; pass --config FILE "
                         f"with the run's config")
    candidates = sorted((r for r, expiration in records
                         if expiration >= now and r.run_id == run.run_id and r.config_hash == expected),
                        key=lambda r: -r.time)
    if not candidates:
        raise ValueError(f"run {run.run_id}: no peer publishes its config (hash {expected}) in the DHT; pass "
                         f"--config FILE with the run's config")
    refusals: list[str] = []
    for record in candidates:
        try:
            data = verified_config_data(record, expected)
        except ValueError as e:
            refusals.append(str(e))
            logger.warning("%s", refusals[-1])
            continue
        return load_config_data(data, overrides), record  # an error now is our own --set's: it names the key
    if len(refusals) == 1:
        raise ValueError(refusals[0])
    raise ValueError(f"{refusals[0]} (and {len(refusals) - 1} more config records of the run refused)")


def data_mismatch(run_cfg: Config, ours: Config) -> str:
    """Why our data cannot train with the run whose (pinned) config is ``run_cfg``: one line naming both
    fingerprints (or both tokenizer hashes), or "" when ours match (pure but for reading our own data)."""
    from p2p_diloco.core import datasource, tokenizer

    theirs = run_cfg.data
    if theirs.fingerprint:
        mine = datasource.fingerprint(ours.data)
        if ours.data.fingerprint:  # our config pins it too: that is what we hash with (check_local holds us to it)
            mine = datasource.Fingerprint(ours.data.fingerprint, f"pinned by our config; {mine.where}")
        if mine.digest != theirs.fingerprint:
            return (f"data fingerprint differs: yours {mine.digest} ({mine.where}), the run's {theirs.fingerprint}; "
                    f"every peer needs the same files")
    if theirs.tokenizer_hash:
        mine_tok = ours.data.tokenizer_hash or tokenizer.tokenizer_hash(ours.data.tokenizer)
        if mine_tok != theirs.tokenizer_hash:
            return (f"tokenizer differs: yours {mine_tok} (data.tokenizer {ours.data.tokenizer}), the run's "
                    f"{theirs.tokenizer_hash}; every peer needs the same tokenizer")
    return ""


def explain_refusal(dht: Any, cfg: Config, views: Iterable[Any], reason: str) -> str:
    """A refusal to join (:func:`records.check_join`) made specific: when the run's config (fetched from the
    DHT for the hash most of its live peers announce) differs from ours in the data or the tokenizer, the
    line that names both fingerprints; else ``reason`` as it is."""
    from collections import Counter

    from hivemind.utils import get_dht_time

    from p2p_diloco.net.membership import read_entries

    hashes = Counter(v.record.config_hash for v in views if v.record.run_id == cfg.run.run_id
                     and v.status in ("live", "foreign") and v.record.state != "left")
    if not hashes:
        return reason
    run = RunInfo(cfg.run.run_id, live=sum(hashes.values()), config_hashes=dict(hashes))
    entries, _rejected = read_entries(dht, (config_key(run.run_id),), RunConfigRecord.from_wire)
    try:
        run_cfg, _record = config_from_records(entries, run, get_dht_time())
    except ValueError as e:  # no config record to compare with: the plain reason is all we can say
        logger.info("cannot compare our data with the run's: %s", e)
        return reason
    line = data_mismatch(run_cfg, cfg)
    return f"refused by run {cfg.run.run_id!r}: {line}" if line else reason


# ---------------------------------------------------------------- reading the DHT


def read_runs(dht: Any) -> tuple[list[RunInfo], list[str]]:
    """Every run in the DHT's index (live ones first) and one line per index entry dropped."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.net.membership import read_entries

    entries, rejected = read_entries(dht, INDEX_KEYS, IndexEntry.from_wire)
    return runs_in_index(entries, get_dht_time()), rejected


def fetch_config(dht: Any, run: RunInfo, overrides: Sequence[str] = ()) -> tuple[Config, RunConfigRecord]:
    """Read ``run``'s config records and return the verified config (``overrides`` applied) and its record."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.net.membership import read_entries

    entries, _rejected = read_entries(dht, (config_key(run.run_id),), RunConfigRecord.from_wire)
    return config_from_records(entries, run, get_dht_time(), overrides)


def lookup_config(opts: Any, run_id: str | None = None, overrides: Sequence[str] = ()) -> tuple[Config, RunInfo]:
    """The verified config of the run in the DHT that ``opts`` (a :class:`~p2p_diloco.net.membership.SwarmOptions`)
    reach: a short client-mode look-up with a fresh key on any port reads the run index, picks the run
    (:func:`~p2p_diloco.net.runs.pick_run`, or ``run_id``) and fetches its config (:func:`fetch_config`). Errors are
    one line (``ValueError``)."""
    from p2p_diloco.hivemind_ext.procguard import stop_process
    from p2p_diloco.net.membership import start_dht
    from p2p_diloco.net.runs import pick_run

    opts = replace(opts, client_mode=True, identity=None, check_identity_free=False, port=0, announce=())
    dht = start_dht(opts, None)
    try:
        runs, _rejected = read_runs(dht)
        run = pick_run(runs, run_id)
        cfg, _record = fetch_config(dht, run, overrides)
    finally:
        stop_process(dht, "DHT process")
    return cfg, run


# ---------------------------------------------------------------- publishing


class RunAnnouncer:
    """Publishes our config record (and, for a bootstrap, its announcement in the run index) in a thread.

    The config record goes out at :meth:`start` and then every ``config_refresh_s``, stored for
    ``config_ttl_s``; the announcement, if any, every ``announce_ttl_s / 3``, stored for
    ``announce_ttl_s``. A failed store is logged and retried at the next period.
    """

    def __init__(self, dht: Any, private_key: Any, record: RunConfigRecord, *, config_refresh_s: float,
                 config_ttl_s: float, announcement: IndexEntry | None = None, announce_ttl_s: float = ANNOUNCE_TTL_S,
                 store_timeout_s: float = 10.0):
        if not 0 < config_refresh_s < config_ttl_s or announce_ttl_s <= 0:
            raise ValueError(f"need 0 < config_refresh_s < config_ttl_s and announce_ttl_s > 0, got "
                             f"{config_refresh_s}, {config_ttl_s} and {announce_ttl_s}")
        from p2p_diloco.net.membership import owner_subkey

        self._dht, self._subkey = dht, owner_subkey(private_key)
        self.record, self.announcement = record, announcement
        self.config_refresh_s, self.config_ttl_s = config_refresh_s, config_ttl_s
        self.announce_ttl_s, self.store_timeout_s = announce_ttl_s, store_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def publish_config(self) -> bool:
        """Store our config record now; True if some DHT node accepted it."""
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        record = replace(self.record, time=now)
        return self._store(config_key(record.run_id), record.to_wire(), now + self.config_ttl_s, "config record")

    def publish_announcement(self) -> bool:
        """Store our announcement in the run index now (a bootstrap's); True if some DHT node accepted it."""
        from hivemind.utils import get_dht_time

        assert self.announcement is not None
        now = get_dht_time()
        entry = replace(self.announcement, time=now)
        return self._store(index_key(entry.peer_id), entry.to_wire(), now + self.announce_ttl_s, "run announcement")

    def publish_all(self) -> bool:
        ok = self.publish_config()
        return (self.publish_announcement() if self.announcement is not None else True) and ok

    def _store(self, key: str, value: dict[str, Any], expiration: float, what: str) -> bool:
        from p2p_diloco.net.membership import store

        ok = bool(store(self._dht, key, value, expiration, subkey=self._subkey, return_future=True)
                  .result(timeout=self.store_timeout_s))
        if not ok:
            self.failures += 1
            logger.warning("publishing our %s was not accepted by any DHT node (failures so far: %d)", what,
                           self.failures)
        return ok

    def start(self, *, published: bool = False) -> None:
        """Publish in a thread: at once (unless ``published``: the caller just did), then periodically."""
        self._thread = threading.Thread(target=self._loop, args=(published,), name="run-announcer", daemon=True)
        self._thread.start()

    def _loop(self, published: bool) -> None:
        now = time.monotonic()
        next_config = now + self.config_refresh_s if published else now
        period = self.announce_ttl_s / 3
        next_announce = now + period if published or self.announcement is None else now
        while True:
            due = min(next_config, next_announce) if self.announcement is not None else next_config
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            now = time.monotonic()
            try:
                if now >= next_config:
                    next_config = now + self.config_refresh_s
                    self.publish_config()
                if self.announcement is not None and now >= next_announce:
                    next_announce = now + period
                    self.publish_announcement()
            except Exception:  # a DHT hiccup must not end the thread: logged (whole with -v), retried next period
                self.failures += 1
                log_handled(logger, "publishing the run's config / announcement failed; retrying later")

    def stop(self) -> None:
        """Stop the thread (waits for a store in flight, at most ``store_timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.store_timeout_s)
