"""How much goes to stderr: warnings and errors, and with ``-v`` the INFO lines too (one per round, ...).

:func:`p2p_diloco.cli.common.setup_logging` sets the root logger's level from ``-v``; code that says more under
``-v`` asks :func:`verbose` (processes forked later, the averagers and the DHT, inherit the level). A failure that
our code handles -- retried next period, a round discarded -- is one warning line naming the exception
(:func:`log_handled`); its traceback is shown with ``-v`` only. Only the standard library is imported.
"""

from __future__ import annotations

import logging
import sys

MAX_LINE_CHARS = 400
"""A handled failure's exception text is cut here: one line, however long hivemind's message."""


def verbose() -> bool:
    """Whether ``-v`` is in effect: the root logger lets INFO through."""
    return logging.getLogger().isEnabledFor(logging.INFO)


def one_line(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """``text`` on one line (each run of whitespace, newlines included, becomes one space), cut at ``limit``."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def log_handled(logger: logging.Logger, message: str, *args: object) -> None:
    """Inside an ``except`` block of a failure the caller handles: ``message: <type>: <text>`` as one warning
    line; with ``-v`` the traceback too."""
    error = sys.exc_info()[1]
    what = f"{type(error).__name__}: {one_line(str(error))}" if error is not None else "no exception"
    logger.warning(message + ": %s", *args, what, exc_info=verbose(), stacklevel=2)  # the caller's line
