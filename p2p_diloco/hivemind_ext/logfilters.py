"""Filters on hivemind's loggers: an expected outcome that hivemind logs as an error, logged by us instead.

They match hivemind's logger names, the functions that log (``record.funcName``) and message texts, which are
internals of the release they were read from (checked at import, :func:`~p2p_diloco.hivemind_ext.require_hivemind`):
a reworded message or a renamed function would silently stop being filtered.

Without ``-v`` (:func:`p2p_diloco.core.logs.verbose`) a failed averaging step -- a peer killed with kill -9
mid-round, one that stalls -- is one WARN line, not hivemind's two ERRORs with their tracebacks and its partition
warnings: our host discards the round and the learner logs it (:mod:`p2p_diloco.averaging.host`). With ``-v``
hivemind's records pass as it wrote them. An exception that is not how a peer's failure looks (a bug in our
code, perhaps) always keeps its traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Mapping

from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from p2p_diloco.core.logs import one_line, verbose
from p2p_diloco.core.rejects import PeerDataError
from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # the message text, logger and function names below are hivemind 1.1.12's

NO_GROUP_MESSAGE = "Averaging step failed: could not find a group"
"""hivemind's error when a round's matchmaking ended alone: for us an outcome, not a fault."""

AVERAGER_LOGGER = "hivemind.averaging.averager"
"""The logger hivemind's ``DecentralizedAverager`` reports a failed step on."""

DROP = ""
"""An action of :data:`QUIET`: the record is left out (without ``-v``)."""

QUIET: Mapping[str, Mapping[str, str]] = {
    AVERAGER_LOGGER: {
        # logger.exception(e), then set on the step: the host discards the round with the reason
        "_step": "averaging round failed, discarded",
        # logger.exception(e), then raised to _step, which logs the same failure again (unless we cancelled it)
        "_aggregate_with_group": DROP,
    },
    # "Reducer: received 83.3% of input tensors", "Averaging: received 79.2% results": a partial all-reduce,
    # which our completeness check fails (the _step line above names the cause)
    "hivemind.averaging.partition": {"finalize": DROP},
    # "Handler failed with the exception:" + traceback: a peer's request that failed (it died, it was banned);
    # "Exception while receiving requests:" + traceback: a peer's stream cut mid-message (killed with kill -9 while
    # it sent us a part: ConnectionResetError; more likely since an all-reduce sends each span in several parts)
    "hivemind.p2p.p2p_daemon": {"_process_stream": "a peer's request failed",
                                "_handle_stream": "a peer's stream broke"},
}
"""Logger -> hivemind function that logs there -> the one-line prefix its records get without ``-v`` (``DROP``:
left out). Records of other functions pass unchanged."""

PEER_FAILURES = (AllreduceException, MatchmakingException, TimeoutError, ConnectionError, EOFError,
                 asyncio.CancelledError, asyncio.InvalidStateError, concurrent.futures.InvalidStateError,
                 P2PDaemonError, P2PHandlerError, PeerDataError)
"""How a peer's failure reaches an averager (hivemind's exceptions, the transport's, our decoders' refusals)."""


def expected_failure(error: BaseException | None) -> bool:
    """Whether ``error`` and every exception it was raised from are :data:`PEER_FAILURES`."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if not isinstance(error, PEER_FAILURES):
            return False
        seen.add(id(error))
        error = error.__cause__ if error.__cause__ is not None else (
            None if error.__suppress_context__ else error.__context__)
    return True


class NoGroupIsNotAnError(logging.Filter):
    """Drops hivemind's ERROR + traceback for a round that found no group (a lone learner, a learner one
    version behind): the learner logs that round in one line, as discarded with this reason, even with ``-v``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.getMessage() == NO_GROUP_MESSAGE)


class HandledFailureInOneLine(logging.Filter):
    """Without ``-v``: each record of a function named in ``actions`` that carries an expected failure
    (:func:`expected_failure`) becomes one WARN line, ``<prefix>: <message>``, without traceback, or is dropped
    (prefix ``DROP``); so are the records of ``DROP`` functions that carry no exception."""

    def __init__(self, actions: Mapping[str, str]) -> None:
        super().__init__()
        self.actions = dict(actions)

    def filter(self, record: logging.LogRecord) -> bool:
        prefix = self.actions.get(record.funcName)
        if prefix is None or verbose():
            return True
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and not expected_failure(error):
            return True  # not how a peer's failure looks: whole, with its traceback
        if prefix == DROP:
            return False
        if error is None:
            return True
        text = record.getMessage()
        if str(error) not in text:
            text = f"{text} {type(error).__name__}: {error}"
        record.msg, record.args = f"{prefix}: {one_line(text)}", None
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.exc_info, record.exc_text = None, None
        return True


def quiet_expected_failures() -> None:
    """Install :class:`NoGroupIsNotAnError` and :class:`HandledFailureInOneLine` on hivemind's loggers, once;
    the averager processes forked afterwards inherit them."""
    hv = logging.getLogger(AVERAGER_LOGGER)
    if not any(isinstance(f, NoGroupIsNotAnError) for f in hv.filters):
        hv.addFilter(NoGroupIsNotAnError())
    for name, actions in QUIET.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, HandledFailureInOneLine) for f in target.filters):
            target.addFilter(HandledFailureInOneLine(actions))
