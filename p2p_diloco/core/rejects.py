"""Why a decoder refused data from a peer: a small vocabulary of reason codes, and the one log line.

Every decoder of peer data (peer records, gathered round metadata, tensor parts, state downloads)
raises :class:`PeerDataError` -- a ``ValueError`` with a one-line message and a :class:`Reason` --
and whoever called it logs ``rejected <what> from <peer id>: <reason>: <detail>``
(:func:`log_rejection`), drops that peer from the round or the download, and keeps running.
Pure: imports neither torch nor hivemind.
"""

from __future__ import annotations

import logging
from enum import Enum


class Reason(str, Enum):
    OVERSIZE = "oversize"
    """More bytes, elements, items or characters than the receiver allows (refused before allocating)."""
    BAD_SHAPE = "bad-shape"
    """A tensor's declared or decoded shape is not the one expected."""
    BAD_DTYPE = "bad-dtype"
    """A tensor's dtype or compression slot is not the one expected."""
    NON_FINITE = "non-finite"
    """NaN or infinity where only finite numbers are allowed."""
    BAD_VERSION = "bad-version"
    """A version (fragment version, format version) that is negative, malformed or unknown."""
    BAD_HASH = "bad-hash"
    """Content that does not match the hash the peer announced for it."""
    UNVOUCHED = "unvouched"
    """A downloaded anchor that no peer other than its donor has signed for (see ``averaging.decisions.vouchers``)."""
    TRUNCATED = "truncated"
    """A stream that ended inside what it declared (its sender died, closed or was cut off mid-transfer): a failed
    transfer, the same as a peer gone silent, not bad data."""
    MALFORMED = "malformed"
    """Anything else: wrong types, missing or unknown keys, undecodable bytes."""

    def __str__(self) -> str:
        return self.value


MAX_MESSAGE_CHARS = 300
"""A refusal's message quotes the peer's data: cut, and control characters escaped, to keep it one line."""


class PeerDataError(ValueError):
    """A decoder refused a peer's data; ``str(e)`` is the one-line reason, ``e.reason`` its code."""

    def __init__(self, reason: Reason, message: str) -> None:
        line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message[:MAX_MESSAGE_CHARS])
        super().__init__(line if len(message) <= MAX_MESSAGE_CHARS else line + "...")
        self.reason = reason


def reason_of(error: BaseException) -> Reason:
    """The reason code of a refusal (``malformed`` for any exception that carries none)."""
    return error.reason if isinstance(error, PeerDataError) else Reason.MALFORMED


def log_rejection(logger: logging.Logger, what: str, peer: object, error: BaseException) -> None:
    """``rejected <what> from <peer id>: <reason>: <detail>`` at warning level."""
    logger.warning("rejected %s from %s: %s: %s", what, peer, reason_of(error), error)
