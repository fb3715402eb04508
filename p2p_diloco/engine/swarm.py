"""A joined swarm as a library object: :meth:`Swarm.join` (or :meth:`Swarm.bootstrap`) -> membership, clock and
records of one run, held until :meth:`Swarm.close` leaves it gracefully.

The same join as ``p2p-diloco join`` (:func:`~p2p_diloco.net.joined.joined_run`): the DHT with our identity, the
compatibility check against the run's live peers (config hash, protocol, ``name``), our record and our config
record published, a tombstone when we leave. Every argument is checked before anything starts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config
    from p2p_diloco.net.joined import Joined
    from p2p_diloco.net.membership import SwarmOptions
    from p2p_diloco.net.records import LocalRun

logger = logging.getLogger(__name__)


class Swarm:
    """One run joined as a member: ``joined`` (DHT, identity, record publisher), ``local`` (our config hash,
    protocol) and ``membership`` (the private swarm's member check; None in an open swarm)."""

    def __init__(self, config: Config, local: LocalRun, joined: Joined, membership: Any,
                 stack: contextlib.ExitStack) -> None:
        self.config, self.local, self.joined, self.membership = config, local, joined, membership
        self._stack = stack
        self.closed = False

    @classmethod
    def join(cls, initial_peers: Iterable[str], config: Config | str | Path | None = None, *, run_id: str | None = None,
             name: str = "", swarm_key: bytes | str | Path | None = None, identity: str | Path | None = None,
             host: str = "127.0.0.1", port: int = 0, announce: Iterable[str] = (), join_timeout_s: float = 10.0,
             profile: str = "") -> Swarm:
        """Join the run that ``initial_peers`` (multiaddrs of any live peers, ``/ip4/…/tcp/…/p2p/…``) are in;
        none starts a new swarm (:meth:`bootstrap`).

        ``config``: the run's config (a :class:`~p2p_diloco.core.config.Config`, or a TOML file or bundled name
        for :func:`~p2p_diloco.core.config.load_config`); None fetches the config of the run in the DHT (``run_id``
        picks one when several are there) and verifies it against the hash its peers announce. ``swarm_key``:
        a private swarm's secret (its bytes, or the file ``p2p-diloco keygen`` wrote); ``identity``: a key file
        for a stable peer id (created if missing, in a folder that exists; default a fresh key). Raises
        ``TypeError`` (one line, naming the argument) for an argument of the wrong type, and ``ValueError`` (one
        line) for a bad value, a run that refuses us (another config hash, a name taken) or peers that cannot be
        reached."""
        _check_types(config=config, run_id=run_id, name=name, swarm_key=swarm_key, identity=identity, host=host,
                     port=port, join_timeout_s=join_timeout_s, profile=profile)
        initial_peers, announce = _multiaddrs("initial_peers", initial_peers), _multiaddrs("announce", announce)
        opts = _swarm_options(initial_peers, swarm_key, identity, host, port, announce, join_timeout_s)
        return cls._join(opts, config, run_id, name, profile)

    @classmethod
    def bootstrap(cls, config: Config | str | Path, **kwargs: Any) -> Swarm:
        """Start a new swarm as its first member (no initial peers); the others join at :attr:`addresses`.
        Takes :meth:`join`'s keyword arguments."""
        return cls.join((), config, **kwargs)

    @classmethod
    def from_options(cls, opts: SwarmOptions, config: Config, *, name: str = "", profile: str = "") -> Swarm:
        """Join with checked :class:`~p2p_diloco.net.membership.SwarmOptions` (``p2p-diloco join``'s)."""
        return cls._join(opts, config, None, name, profile)

    @classmethod
    def _join(cls, opts: SwarmOptions, config: Config | str | Path | None, run_id: str | None, name: str,
              profile: str) -> Swarm:
        from p2p_diloco.core.config import Config, load_config
        from p2p_diloco.net.joined import joined_run
        from p2p_diloco.net.records import LocalRun, check_label

        check_label("name", name)
        check_label("profile", profile)
        if config is None:
            from p2p_diloco.net.runconfig import lookup_config

            cfg, _run = lookup_config(opts, run_id)
        else:
            cfg = config if isinstance(config, Config) else load_config(config)
            if run_id and run_id != cfg.run.run_id:
                raise ValueError(f"run_id {run_id!r} contradicts the config's run.run_id {cfg.run.run_id!r}")
        local = LocalRun.from_config(cfg)
        stack = contextlib.ExitStack()
        try:
            joined = stack.enter_context(joined_run(opts, name, local, cfg.outer.fragments, ttl_s=cfg.averaging.record_ttl_s,
                                                    state="joining", profile=profile, cfg=cfg))
            membership = None
            if opts.swarm_key is not None:  # our averaging / state handlers are not covered by the DHT authorizer
                from p2p_diloco.net.membership import Membership

                membership = Membership(joined.dht, local)
            # our record stays alive from here to close(), however long the model and the data take to build: a
            # record not refreshed for 2/3 of its TTL lets another peer take our name; DiLoCo's status thread takes
            # the heartbeat over while it runs (RecordPublisher.hand_over)
            joined.publisher.start()
            stack.callback(joined.publisher.stop)
        except BaseException:
            stack.close()
            raise
        return cls(cfg, local, joined, membership, stack)

    # -------------------------------------------------------------- what a user reads

    @property
    def peer_id(self) -> str:
        return self.joined.peer_id

    @property
    def name(self) -> str:
        return self.joined.name

    @property
    def addresses(self) -> list[str]:
        """Our multiaddrs (with ``/p2p/<peer id>``): what another peer passes to :meth:`join`."""
        from p2p_diloco.net.membership import visible_addresses

        return [str(a) for a in visible_addresses(self.joined.dht)]

    @property
    def run_id(self) -> str:
        return self.local.run_id

    # -------------------------------------------------------------- leaving

    def close(self, *, leave: bool = True) -> bool:
        """Leave the run: publish our tombstone (``leave``; peers then see us gone at once, not after a TTL)
        and stop the DHT. Returns whether a DHT node accepted the tombstone (False without ``leave``)."""
        if self.closed:
            return False
        self.closed = True
        try:
            return bool(self.joined.publisher.leave()) if leave else False
        finally:
            self._stack.close()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        """Leaving the block closes the swarm; after an error, the join's own guard publishes the tombstone (and says
        so) before the error propagates."""
        if kind is None or self.closed:
            self.close()
            return
        self.closed = True
        self._stack.__exit__(kind, error, tb)


_ARGUMENT_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "config": ((str, Path), "a Config, a TOML file's path, a bundled config's name, or None"),
    "run_id": ((str,), "a str or None"),
    "name": ((str,), "a str"),
    "swarm_key": ((bytes, str, Path), "bytes (the secret), the path of a key file, or None"),
    "identity": ((str, Path), "the path of a key file, or None"),
    "host": ((str,), "a str (an IP address or a host name)"),
    "port": ((int,), "an int (0: any free port)"),
    "join_timeout_s": ((int, float), "a number of seconds"),
    "profile": ((str,), "a str"),
}
"""What each of :meth:`Swarm.join`'s arguments may be (None too where the words say so; a ``config`` may also be a
:class:`~p2p_diloco.core.config.Config`), and the words a ``TypeError`` says it with."""


def _check_types(**arguments: Any) -> None:
    """Raise ``TypeError`` (one line, naming the argument and what it must be) for an argument of
    :meth:`Swarm.join` of the wrong type: ``config=42`` is a wrong type, not a bad config (bools are no numbers)."""
    from p2p_diloco.core.config import Config

    for name, value in arguments.items():
        types, what = _ARGUMENT_TYPES[name]
        if value is None and "None" in what or name == "config" and isinstance(value, Config):
            continue
        if not isinstance(value, types) or isinstance(value, bool):
            raise TypeError(f"{name}: must be {what}, got {type(value).__name__} {value!r:.60}")


def _multiaddrs(name: str, value: Any) -> list[str]:
    """``value`` (one multiaddr, or an iterable of them) as a list; ``TypeError`` (one line) for anything else."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) and not isinstance(
        value, (bytes, dict)) else None
    if items is None or not all(isinstance(i, str) for i in items):
        raise TypeError(f"{name}: must be multiaddrs (a list of str, or one str), got {type(value).__name__} "
                        f"{value!r:.60}")
    return items


def _swarm_options(initial_peers: Iterable[str], swarm_key: bytes | str | Path | None, identity: str | Path | None,
                   host: str, port: int, announce: Iterable[str], join_timeout_s: float) -> SwarmOptions:
    """The checked :class:`~p2p_diloco.net.membership.SwarmOptions` of :meth:`Swarm.join`'s arguments (before
    hivemind is imported: bad input fails fast)."""
    from p2p_diloco.net.addresses import check_port_free, host_multiaddr, parse_announce_address, parse_initial_peers

    peers = list(initial_peers) if not isinstance(initial_peers, str) else [initial_peers]
    initial = parse_initial_peers(peers, "initial_peers") if peers else ()
    host_multiaddr(host, port)
    ann = tuple(parse_announce_address(a) for a in announce)
    if announce and port == 0:
        raise ValueError("announce needs a fixed port (the announced port must be the one we listen on)")
    if port != 0:
        check_port_free(host, port)
    if not join_timeout_s > 0:
        raise ValueError(f"join_timeout_s: must be > 0, got {join_timeout_s}")
    from p2p_diloco.net.keys import load_or_create_identity, read_swarm_key
    from p2p_diloco.net.membership import SwarmOptions

    key = swarm_key if isinstance(swarm_key, bytes) or swarm_key is None else read_swarm_key(swarm_key)
    if identity is not None and not Path(identity).expanduser().parent.is_dir():  # a typo'd folder: not made silently
        raise ValueError(f"identity {identity}: folder {Path(identity).expanduser().parent} does not exist (the key "
                         "file is created if missing, its folder is not)")
    return SwarmOptions(initial_peers=initial, host=host, port=port, announce=ann,
                        identity=load_or_create_identity(identity) if identity is not None else None,
                        swarm_key=key, join_timeout_s=join_timeout_s)
