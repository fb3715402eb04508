"""Where p2p_diloco reaches into hivemind beyond its public API, and the version check that guards it.

Modules here use hivemind's private names or patch its modules (its compression registry, its p2pd
client, its logger's messages, its daemon's process launch). Such code was read against one hivemind
release, and a change there rarely fails loudly: a renamed private method we override is simply
never called, a reworded log message is no longer filtered, and hivemind swallows most errors inside
an all-reduce. So each module that touches private names calls :func:`require_hivemind` -- at its
import, or when it patches -- and refuses to run on another release.

Raise, not warn: ``pyproject.toml`` pins ``hivemind==1.1.12``, so another version means a broken
install, and running on it could let anchors diverge silently between peers. Whoever is porting to a
new hivemind sets ``P2P_DILOCO_ALLOW_HIVEMIND_MISMATCH=1`` (:data:`ALLOW_MISMATCH_ENV`) to turn the
error into a logged warning.

The deep subclasses of hivemind's averager and all-reduce runner (:mod:`p2p_diloco.averaging.process`,
:mod:`p2p_diloco.averaging.runner`) override private methods too; they call the same check at import.

Only the standard library is imported here (the CLI imports this package before hivemind).
"""

from __future__ import annotations

import functools
import logging
import os

WRITTEN_FOR = "1.1.12"
"""The hivemind release whose private names and internals this package was written against."""

ALLOW_MISMATCH_ENV = "P2P_DILOCO_ALLOW_HIVEMIND_MISMATCH"
"""Set to ``1`` to warn instead of raise on another hivemind release (for porting work only)."""

logger = logging.getLogger(__name__)


class HivemindVersionError(ImportError):
    """The installed hivemind is not the release that code using its private names was written for."""


@functools.cache
def installed_hivemind_version() -> str | None:
    """The installed hivemind's version from its package metadata (None: not installed).

    Read from the metadata, not ``hivemind.__version__``: that would import hivemind's package
    ``__init__``, which :func:`~p2p_diloco.hivemind_ext.lazyimports.light_hivemind_import` skips.
    """
    from importlib import metadata  # only when asked: keeps this package's import cheap for the CLI

    try:
        return metadata.version("hivemind")
    except metadata.PackageNotFoundError:
        return None


def require_hivemind(user: str, installed: str | None = None) -> None:
    """Raise :class:`HivemindVersionError` (one line naming both versions) unless the installed
    hivemind is :data:`WRITTEN_FOR`; with :data:`ALLOW_MISMATCH_ENV` set to ``1``, log a warning instead.

    :param user: the module that depends on hivemind's internals (for the message), e.g. ``__name__``
    :param installed: the installed version (default: read from hivemind's package metadata)
    """
    version = installed_hivemind_version() if installed is None else installed
    if version == WRITTEN_FOR:
        return
    found = f"hivemind {version} is installed" if version is not None else "hivemind is not installed"
    message = (f"{user} uses hivemind internals written for hivemind {WRITTEN_FOR}, but {found}; "
               f"run `pip install hivemind=={WRITTEN_FOR}` (the version pinned in pyproject.toml)")
    if os.environ.get(ALLOW_MISMATCH_ENV) == "1":
        logger.warning("%s (continuing: %s=1)", message, ALLOW_MISMATCH_ENV)
        return
    raise HivemindVersionError(message)
