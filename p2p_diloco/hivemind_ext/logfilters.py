"""Filters on hivemind's loggers: an expected outcome that hivemind logs as an error, logged by us instead.

They match hivemind's logger names and message texts, which are internals of the release they were
read from (checked at import, :func:`~p2p_diloco.hivemind_ext.require_hivemind`): a reworded
message would silently stop being filtered.
"""

from __future__ import annotations

import logging

from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # the message text and logger name below are hivemind 1.1.12's

NO_GROUP_MESSAGE = "Averaging step failed: could not find a group"
"""hivemind's error when a round's matchmaking ended alone: for us an outcome, not a fault."""

AVERAGER_LOGGER = "hivemind.averaging.averager"
"""The logger hivemind's ``DecentralizedAverager`` reports a failed step on."""


class NoGroupIsNotAnError(logging.Filter):
    """Drops hivemind's ERROR + traceback for a round that found no group (a lone learner, a learner one
    version behind): the learner logs that round in one line, as discarded with this reason. Every other
    averaging failure keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.getMessage() == NO_GROUP_MESSAGE)


def quiet_expected_failures() -> None:
    """Install :class:`NoGroupIsNotAnError` on hivemind's averager logger, once; the averager processes
    forked afterwards inherit it."""
    hv = logging.getLogger(AVERAGER_LOGGER)
    if not any(isinstance(f, NoGroupIsNotAnError) for f in hv.filters):
        hv.addFilter(NoGroupIsNotAnError())
