"""The process side of a fragment's averager: a hivemind DecentralizedAverager subclass."""

from __future__ import annotations

import asyncio
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
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from p2p_diloco.averaging.downloads import StateDownloads
from p2p_diloco.averaging.fixed_groups import FixedGroupMeeting
from p2p_diloco.averaging.group_leader import GroupLeading
from p2p_diloco.averaging.decisions import (
    RoundMeta,
    commit_key,
)
from p2p_diloco.averaging.linktime import RoundTimeouts
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.verdicts import GroupVerdicts
from p2p_diloco.core import outer
from p2p_diloco.core.logs import log_handled
from p2p_diloco.core.replay import PackedRound
from p2p_diloco.hivemind_ext import require_hivemind
from p2p_diloco.hivemind_ext.compression import link_part_bytes

require_hivemind(__name__)  # overrides DecentralizedAverager's private methods, reads its private state

logger = logging.getLogger(__name__)

GROUP_READ_MIN_S = 0.5
"""hivemind's matchmaking re-reads its group key as fast as the DHT answers while it has no leader to try:
measured on loopback, over a hundred reads a second per averager during each round's window, each answered with
every averager declared under the key -- the largest share of a learner's control-plane bytes. An averager reads
it at most once per this many seconds (a follower finds its leader at most this much later)."""


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


class FragmentAveragerProcess(StateDownloads, GroupLeading, GroupVerdicts, FixedGroupMeeting, DecentralizedAverager):
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
        self.early_verdicts = mp.Value(ctypes.c_longlong, 0)
        """Rounds whose verdict went out as the all-reduce ended and was the host's (:meth:`early_verdict`), counted
        in the averager process."""
        self.last_part_bytes = mp.Value(ctypes.c_longlong, 0)
        """The part size (bytes) the last all-reduce was cut in (:func:`link_part_bytes`); the host sets 0 before a
        round and reads it after."""
        self.last_allreduce_s = mp.Value(ctypes.c_double, math.nan)
        """Seconds the last all-reduce ran (group formed to done or failed), timed in the averager process: the
        host sets NaN before a round and reads it after (the link's throughput, :mod:`linktime`)."""
        self.last_allreduce_end = mp.Value(ctypes.c_double, math.nan)
        """When the last all-reduce that ended well ended (``time.monotonic()``, the same clock in every process of
        this machine): the host times its result's way back from it."""
        self.last_meet_s = mp.Value(ctypes.c_double, math.nan)
        """Seconds the last step took to find or meet its group, timed in the averager process (NaN: none found)."""
        self.membership = membership
        self.state_provider = state_provider
        self.fragment = fragment
        self.layout = layout
        """(names, shapes) of the fragment's tensors: what a downloaded state is checked against."""
        self.robust = robust
        """The robust merge rule (:func:`outer.robust_rule`): our reducer bounds each sender's influence."""
        self._kept: list[PackedRound] = []  # the rounds we serve to peers that replay (StateDownloads.keep_round)
        self.init_fixed_groups()
        self.init_group_verdicts()
        self.init_group_leading()
        super().__init__(*args, **kwargs)

    def _run_internal(self) -> None:
        """(averager process) hivemind's, once torch's thread pool is rebuilt on this thread. A forked process's
        first thread to need the pool rebuilds the one it inherited, and another that needs it meanwhile gets none:
        two of hivemind's executor threads compressing a round's first parts at once raised "Invalid thread pool!"
        (torch 2.13), the part was never sent and the round lost on every member (a main-job run, 2 of its 16
        averager processes). Here no other thread runs torch yet."""
        torch.set_num_threads(torch.get_num_threads())
        super()._run_internal()

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        """hivemind's, without its hops through a thread pool between a group's meeting and its all-reduce (5 ms
        median, 13 ms mean of a main-job round, 4 learners on 2 cores): the split of the vector is computed here when
        no member states a bandwidth (ours never do: an even split, no linear program to keep off the loop), and the
        tensors' lock, which the host holds only while it copies a round's tensors, is taken at once when free."""
        loop = asyncio.get_running_loop()
        lock = self.lock_averaged_tensors
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            user_gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_gathered_bytes)))
            download = [b if AveragingMode(m) != AveragingMode.CLIENT else 0.0 for b, m in zip(bandwidths, mode_ids)]
            if any(download):  # a stated bandwidth (None: not stated)
                fractions = await loop.run_in_executor(None, load_balance_peers, self.total_size, download,
                                                       min_vector_size)
            else:
                fractions = load_balance_peers(self.total_size, download, min_vector_size)
            if not lock.acquire(block=False):
                acquiring = loop.run_in_executor(None, lock.acquire)
                try:
                    await asyncio.shield(acquiring)
                except asyncio.CancelledError:  # the thread still takes the lock: give it back then
                    acquiring.add_done_callback(lambda _: lock.release())
                    raise
            try:
                await self._run_allreduce_inplace_(self._averaged_tensors, group_info, peer_fractions=fractions,
                                                   **kwargs)
            finally:
                lock.release()
            return user_gathered
        except BaseException as e:  # as hivemind's: its _step reads every failure as this exception
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        try:
            metas = self._gathered_metas(group_info)
            robust = self._robust_weights(group_info, metas)
        except ValueError as e:  # every member parses the same gathered data, so every member refuses
            self._running_groups[group_id].cancel()
            raise AllreduceException(f"refusing the round: {e}") from None
        slowest = min((m.link for m in metas), default=0.0)  # the same on every member: the same gathered data
        kwargs["part_size_bytes"] = link_part_bytes(tensors, self.allreduce_kwargs["compression"],
                                                    len(group_info.peer_ids), slowest)
        self.last_part_bytes.value = kwargs["part_size_bytes"]
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
        except asyncio.CancelledError:
            # hivemind's step cancels us at its all-reduce timeout, and its _aggregate_with_group turns the
            # cancellation into "Unable to run All-Reduce: " (no reason): say which reducers we still waited on
            problem = runner.cut_short(self._allreduce_timeout)
            await self._post_veto(group_info, f"AllreduceException: {problem}")
            raise AllreduceException(problem) from None
        except BaseException as e:
            # our step() will raise and the host will not know the group: post the veto from here, so
            # the members whose all-reduce looked fine stop waiting for our verdict at once
            await self._post_veto(group_info, f"{type(e).__name__}: {e}")
            raise
        finally:
            self.last_allreduce_s.value = time.monotonic() - t0
        self.last_updated = get_dht_time()
        self.last_allreduce_end.value = time.monotonic()
        self.early_verdict(group_info, metas, tensors)

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
        self.stop_leading()
        for future in list(self._running_groups.values()):
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()

    async def _declare_for_download_periodically(self) -> None:
        """Declares nothing: hivemind stores each averager's state-sharing priority in the DHT at start, at every
        change of it and every ``declare_state_period``, for its own ``load_state_from_peers``; ours downloads from
        the donors the learner's view ranks (:mod:`.downloads`), so those stores would only cost bytes."""

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

    def _gathered_metas(self, group_info: GroupInfo) -> list[RoundMeta]:
        """Every member's round metadata, in the group's order (raises ValueError on a malformed one: the host logs
        who sent it)."""
        metas = []
        for blob in group_info.gathered:
            _bandwidth, _mode, user = self.serializer.loads(blob)
            metas.append(RoundMeta.from_wire(self.serializer.loads(user)))
        return metas

    def _robust_weights(self, group_info: GroupInfo,
                        metas: Sequence[RoundMeta]) -> tuple[dict[Any, float], outer.Robust] | None:
        """(each member's gathered weight after :func:`outer.clip_to_median`, the rule), or None when the
        robust merge is off: what our reducer weighs each sender's parts with."""
        if not self.robust.active:
            return None
        weights = outer.clip_to_median([m.weight for m in metas], self.robust.clip_factor)
        return dict(zip(group_info.peer_ids, weights)), self.robust

    async def _post_veto(self, group_info: GroupInfo, reason: str) -> None:
        fixed = self.fixed_group(group_info.group_id)
        if fixed is not None:  # a group from the clock: straight to its members (never raises; one missed waits it out)
            self._verdict_box(fixed.verdict_id)[0][self.peer_id.to_base58()] = reason[:300]
            await self._send_verdict(fixed.verdict_id, fixed.peer_ids, reason, self._matchmaking.request_timeout)
            return
        if self.report_subkey is None:
            return
        try:
            peers = [str(pid) for pid in group_info.peer_ids]
            metas = []
            for blob in group_info.gathered:
                _bandwidth, _mode, user = self.serializer.loads(blob)
                metas.append(RoundMeta.from_wire(self.serializer.loads(user)))
            key = commit_key(self.prefix, dict(zip(peers, metas)))
            from p2p_diloco.net.membership import store

            await store(self.dht, key, reason[:300], get_dht_time() + 120, subkey=self.report_subkey,
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

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        if self.state_provider is None:
            raise RuntimeError("this averager shares no state (no state_provider)")
        metadata, tensors = self.state_provider()
        return metadata, tensors, None


