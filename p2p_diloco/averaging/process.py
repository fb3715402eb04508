"""The process side of a fragment's averager: a hivemind DecentralizedAverager subclass."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import time
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.averaging.fixed_groups import FixedGroupMeeting
from p2p_diloco.averaging.decisions import (
    MAX_DONORS_TRIED,
    VOUCH_POLL_S,
    VOUCH_WAIT_S,
    RoundMeta,
    commit_key,
    donor_order,
    sharing_priority,
    state_size_cap,
    vouch_key,
    vouchers,
)
from p2p_diloco.averaging.linktime import DownloadTimeouts, RoundTimeouts
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.transfer import decode_state_metadata, parse_state
from p2p_diloco.core import outer
from p2p_diloco.core.logs import log_handled
from p2p_diloco.core.rejects import PeerDataError, Reason, log_rejection, reason_of
from p2p_diloco.hivemind_ext import require_hivemind
from p2p_diloco.hivemind_ext.compression import decode_part

require_hivemind(__name__)  # overrides DecentralizedAverager's private methods, reads its private state

logger = logging.getLogger(__name__)

GROUP_READ_MIN_S = 0.5
"""hivemind's matchmaking re-reads its group key as fast as the DHT answers while it has no leader to try:
measured on loopback, over a hundred reads a second per averager during each round's window, each answered with
every averager declared under the key -- the largest share of a learner's control-plane bytes. An averager reads
it at most once per this many seconds (a follower finds its leader at most this much later)."""


def declared_priorities(found: Any) -> dict[str, float]:
    """The state-sharing priorities declared under a fragment's ``all_averagers`` key (a DHT read), by base58 peer
    id; a malformed declaration is skipped, not trusted."""
    priorities: dict[str, float] = {}
    for subkey, item in (found.value.items() if found is not None and isinstance(found.value, dict) else ()):
        with contextlib.suppress(Exception):
            if isinstance(item.value, (int, float)) and not isinstance(item.value, bool):
                priorities[PeerID(subkey).to_base58()] = float(item.value)
    return priorities


def throttled(read: Callable[..., Any], min_interval_s: float) -> Callable[..., Any]:
    """``read`` (an async function) called at most once per ``min_interval_s``: a call that comes sooner first
    sleeps out the rest of the interval."""
    last = [-math.inf]

    async def call(*args: Any, **kwargs: Any) -> Any:
        wait_s = last[0] + min_interval_s - time.monotonic()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        last[0] = time.monotonic()
        return await read(*args, **kwargs)

    call.throttled = True  # type: ignore[attr-defined]
    return call


class FragmentAveragerProcess(FixedGroupMeeting, DecentralizedAverager):
    """One fragment's averager: exact all-reduce, completeness check, members-only handlers, state sharing.

    ``state_provider`` (host process) returns ``(metadata, tensors)`` for :meth:`get_current_state`:
    the fragment's anchor and outer momentum, so a peer that is behind can catch up.
    """

    def __init__(self, *args: Any, membership: Any = None,
                 state_provider: Callable[[], tuple[dict[str, Any], list[torch.Tensor]]] | None = None,
                 runner_class: type[ExactAllReduceRunner] = ExactAllReduceRunner, report_subkey: bytes | None = None,
                 fragment: int | None = None, layout: tuple[Sequence[str], Mapping[str, torch.Size]] | None = None,
                 robust: outer.Robust = outer.NO_ROBUST, **kwargs: Any) -> None:
        # the runner is chosen per instance (tests and averaging/faulty.py pass subclasses); a subclass of this
        # class must keep hivemind's handler names, which carry the servicer's class name (FaultyAveragerProcess)
        self.runner_class = runner_class
        self.report_subkey: bytes | None = report_subkey
        self.bytes_sent = mp.Value(ctypes.c_longlong, 0)
        self.bytes_received = mp.Value(ctypes.c_longlong, 0)
        self.refused = mp.Value(ctypes.c_longlong, 0)
        """Requests our handlers refused (non-members), counted in the averager process."""
        self.last_allreduce_s = mp.Value(ctypes.c_double, math.nan)
        """Seconds the last all-reduce ran (group formed to done or failed), timed in the averager process: the
        host sets NaN before a round and reads it after (the link's throughput, :mod:`linktime`)."""
        self.membership = membership
        self.state_provider = state_provider
        self.fragment = fragment
        self.layout = layout
        """(names, shapes) of the fragment's tensors: what a downloaded state is checked against."""
        self.robust = robust
        """The robust merge rule (:func:`outer.robust_rule`): our reducer bounds each sender's influence."""
        self.init_fixed_groups()
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        try:
            robust = self._robust_weights(group_info)
        except ValueError as e:  # every member parses the same gathered data, so every member refuses
            self._running_groups[group_id].cancel()
            raise AllreduceException(f"refusing the round: {e}") from None
        runner = self.runner_class(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, counters=(self.bytes_sent, self.bytes_received),
            fragment=self.fragment, robust=robust, **kwargs)
        assert group_id in self._running_groups, f"group {group_id!r} was not registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            raise AllreduceException("fragment averagers never run as auxiliaries")
        t0 = time.monotonic()
        try:
            # the outputs are averages (not deltas); tensors are our private buffers, so a failure leaves
            # garbage there that nobody reads: the host reads them only after step() succeeded
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)
            problem = runner.completeness_problem()
            if problem is not None:
                raise AllreduceException(problem)
        except BaseException as e:
            # our step() will raise and the host will not know the group: post the veto from here, so
            # the members whose all-reduce looked fine stop waiting for our verdict at once
            await self._post_veto(group_info, f"{type(e).__name__}: {e}")
            raise
        finally:
            self.last_allreduce_s.value = time.monotonic() - t0
        self.last_updated = get_dht_time()

    async def _step(self, *, step: StepControl, future_for_init: MPFuture) -> None:
        """hivemind's step, without the exception it re-raises once the step holds its outcome: nobody awaits
        this task, and asyncio logged "Task exception was never retrieved" for it. At SIGTERM above all: the
        host cancels a step whose all-reduce is running (:meth:`FragmentAveragerHost.cancel`), and when the
        all-reduce ends hivemind sets the cancelled step's result, which raises concurrent.futures'
        InvalidStateError (hivemind catches asyncio's, another class). The host reads the outcome from the step."""
        try:
            await super()._step(step=step, future_for_init=future_for_init)
        except Exception as e:
            if not step.done():
                raise
            logger.debug("fragment %s: the step ended after its outcome was set (%s: %s)", self.fragment,
                         type(e).__name__, e)

    async def _shutdown(self, timeout: float | None) -> None:
        """As hivemind's, which calls ``finalize()`` on the values of ``_running_groups`` -- futures of runners,
        not runners -- and so raised AttributeError (a traceback on stderr) when stopped with a round in flight,
        as at SIGTERM: the runners that started are cancelled (their peers are told), the others' futures too."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in list(self._running_groups.values()):
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()

    # -- per-round timeouts (:mod:`linktime`): hivemind reads these attributes afresh for every round
    def set_round_timeouts(self, timeouts: RoundTimeouts) -> MPFuture:
        """(host) Use ``timeouts`` from the next round on; the future's result is what the averager process then
        holds (:meth:`round_timeouts`). Sent on the control pipe before the round's step, so applied before it."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_round_timeouts", [], dict(future=future, timeouts=timeouts)))
        return future

    async def _set_round_timeouts(self, future: MPFuture, timeouts: RoundTimeouts) -> None:
        try:
            self.allreduce_kwargs.update(sender_timeout=timeouts.sender_timeout_s,
                                         reducer_timeout=timeouts.reducer_timeout_s)  # each runner gets them
            self._allreduce_timeout = timeouts.allreduce_timeout_s  # the bound _step puts on _aggregate_with_group
            self.next_chunk_timeout = timeouts.sender_timeout_s  # hivemind's own load_state_from_peers (unused by us)
            self._matchmaking.request_timeout = timeouts.request_timeout_s  # join requests
            keys = self._matchmaking.group_key_manager  # built in this process by hivemind's run(): wrapped once
            if not getattr(keys.get_averagers, "throttled", False):
                keys.get_averagers = throttled(keys.get_averagers, GROUP_READ_MIN_S)
            future.set_result(self.round_timeouts())
        except BaseException as e:
            future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def round_timeouts(self) -> dict[str, float]:
        """(averager process) The timeouts hivemind will use for the next round, read back from its attributes."""
        return {"request_timeout_s": self._matchmaking.request_timeout,
                "sender_timeout_s": self.allreduce_kwargs["sender_timeout"],
                "reducer_timeout_s": self.allreduce_kwargs["reducer_timeout"],
                "allreduce_timeout_s": self._allreduce_timeout, "next_chunk_timeout_s": self.next_chunk_timeout}

    def _robust_weights(self, group_info: GroupInfo) -> tuple[dict[Any, float], outer.Robust] | None:
        """(each member's gathered weight after :func:`outer.clip_to_median`, the rule), or None when the
        robust merge is off: what our reducer weighs each sender's parts with."""
        if not self.robust.active:
            return None
        metas = []
        for blob in group_info.gathered:
            _bandwidth, _mode, user = self.serializer.loads(blob)
            metas.append(RoundMeta.from_wire(self.serializer.loads(user)))  # the host logs who sent bad metadata
        weights = outer.clip_to_median([m.weight for m in metas], self.robust.clip_factor)
        return dict(zip(group_info.peer_ids, weights)), self.robust

    async def _post_veto(self, group_info: GroupInfo, reason: str) -> None:
        if self.report_subkey is None:
            return
        try:
            peers = [str(pid) for pid in group_info.peer_ids]
            metas = []
            for blob in group_info.gathered:
                _bandwidth, _mode, user = self.serializer.loads(blob)
                metas.append(RoundMeta.from_wire(self.serializer.loads(user)))
            key = commit_key(self.prefix, dict(zip(peers, metas)))
            await self.dht.store(key, reason[:300], get_dht_time() + 120, subkey=self.report_subkey,
                                 return_future=True)
        except Exception:  # the veto is an optimisation: silence vetoes too, after commit_timeout_s
            log_handled(logger, "could not post our veto for a failed round")

    async def _refuse(self, context: P2PContext, what: str) -> bool:
        """True if a swarm key is in use and the remote peer is not a member (logged once per request)."""
        if self.membership is None:
            return False
        loop = asyncio.get_event_loop()
        allowed = await loop.run_in_executor(None, self.membership.is_member, context.remote_id)
        if not allowed:
            with self.refused.get_lock():
                self.refused.value += 1
            logger.warning("refused %s from %s: not a member of the run", what, context.remote_id)
        return not allowed

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if await self._refuse(context, "a join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        if await self._refuse(context, "tensor parts"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if await self._refuse(context, "a state download"):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    # -- state download (the newcomer's side; hivemind's load_state_from_peers has no size cap, no
    #    check before it returns, and tries every declared peer, behind us or not)
    def download_state(self, ours: tuple[int, str], timeouts: DownloadTimeouts) -> MPFuture:
        """(host) Download a state ahead of ``ours`` from the donors of :func:`donor_order`, trying the next on
        any failure (a donor silent for ``timeouts.silence_s`` has failed; one that progresses is never cut off);
        the future's result is ``(FetchedState | None, attempts, bytes received from all donors)``."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_download_state", [], dict(future=future, ours=ours, silence_s=timeouts.silence_s)))
        return future

    async def _download_state(self, future: MPFuture, ours: tuple[int, str], silence_s: float) -> None:
        attempts: list[tuple[str, str, float]] = []  # (donor, "ok" or why not, seconds)
        received = [0]  # wire bytes from every donor, counted as they arrive (an aborted stream's too)
        try:
            assert self.layout is not None and self.fragment is not None, "download_state needs fragment and layout"
            names, shapes = self.layout
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            priorities = declared_priorities(await self.dht.get(key, latest=True, return_future=True))
            cap = state_size_cap([shapes[n] for n in names])
            expected = [shapes[n] for n in names] * 2  # the anchor then the momentum, in names order
            for donor in donor_order(priorities, self.peer_id.to_base58(), sharing_priority(*ours))[:MAX_DONORS_TRIED]:
                t0 = time.monotonic()
                try:
                    metadata, tensors = await self._download_from(PeerID.from_base58(donor), cap, expected,
                                                                  silence_s, received)
                    fetched = await asyncio.get_event_loop().run_in_executor(
                        None, parse_state, metadata, tensors, self.fragment, names, shapes, ours)
                    if fetched is None:
                        raise ValueError("its state is not ahead of ours (its declaration was stale)")
                    await self._check_vouched(fetched.version, fetched.anchor_hash, donor)
                except Exception as e:  # this donor failed us (died, stalled, sent too much or bad data): the next
                    if isinstance(e, PeerDataError):  # it sent something our checks refuse
                        why = f"{reason_of(e)}: {e}"
                        log_rejection(logger, f"fragment {self.fragment}'s state download", donor, e)
                    else:
                        why = (f"timed out (silent for {silence_s:.1f} s)" if isinstance(e, asyncio.TimeoutError)
                               else f"{type(e).__name__}: {e}")
                        logger.warning("fragment %s: state download from %s failed (%s); trying the next donor",
                                       self.fragment, donor, why[:200])
                    attempts.append((donor, why[:200], time.monotonic() - t0))
                    continue
                attempts.append((donor, "ok", time.monotonic() - t0))
                future.set_result((fetched, attempts, received[0]))
                return
            future.set_result((None, attempts, received[0]))
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    async def _check_vouched(self, version: int, anchor: str, donor: str) -> None:
        """Refuse (:class:`PeerDataError`, ``unvouched``) a downloaded anchor that no peer but its donor has
        signed for under :func:`vouch_key` (re-read for up to ``VOUCH_WAIT_S``: the other committers' entries
        may land just after the donor's state)."""
        from p2p_diloco.net.membership import owned_values

        deadline = time.monotonic() + VOUCH_WAIT_S
        while True:
            signed = owned_values(await self.dht.get(vouch_key(self.prefix, version), latest=True, return_future=True))
            if vouchers(signed, anchor) - {donor}:
                return
            if time.monotonic() >= deadline:
                raise PeerDataError(Reason.UNVOUCHED, f"state download: no peer other than the donor signed anchor "
                                                      f"{anchor} at v{version} ({len(signed)} signed that version)")
            await asyncio.sleep(VOUCH_POLL_S)

    async def _download_from(self, donor: Any, cap_bytes: int, expected: Sequence[torch.Size], silence_s: float,
                             counted: list[int]) -> tuple[Any, list[torch.Tensor]]:
        """Stream a donor's state: at most ``cap_bytes`` in all, each part within ``silence_s`` of the last (the
        first within ``silence_s`` of the request); each tensor must be an uncompressed float32 tensor of the
        ``expected`` shape (checked before it is decoded, :func:`decode_part`). Adds what arrives to ``counted[0]``."""
        stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
        stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout=silence_s)
        metadata, received = None, 0
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []

        def decode(parts: list[Any]) -> torch.Tensor:
            if len(tensors) >= len(expected):
                raise PeerDataError(Reason.OVERSIZE, f"the donor sent more than the {len(expected)} tensors expected")
            return decode_part(combine_from_streaming(parts), expected[len(tensors)], torch.float32,
                               self.state_compression.compression_type)

        async for message in self._donor_parts(stream, silence_s):
            size = len(message.metadata) + message.tensor_part.ByteSize()
            received += size
            counted[0] += size
            if received > cap_bytes:
                raise PeerDataError(Reason.OVERSIZE,
                                    f"the donor sent more than the {cap_bytes} bytes this fragment's state takes")
            if message.metadata:
                if metadata is not None:
                    raise PeerDataError(Reason.MALFORMED, "the donor sent its metadata twice")
                metadata = decode_state_metadata(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype starts the next tensor
                tensors.append(decode(parts))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(decode(parts))
        if metadata is None:
            raise PeerDataError(Reason.MALFORMED, "the donor sent no state")
        return metadata, tensors

    def _donor_parts(self, stream: AsyncIterator[Any], silence_s: float) -> AsyncIterator[Any]:
        """A donor's state stream, each message within ``silence_s`` of the last (or :class:`asyncio.TimeoutError`)."""
        return aiter_with_timeout(stream, timeout=silence_s)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        if self.state_provider is None:
            raise RuntimeError("this averager shares no state (no state_provider)")
        metadata, tensors = self.state_provider()
        return metadata, tensors, None


