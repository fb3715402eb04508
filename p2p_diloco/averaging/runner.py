"""Our all-reduce runner and reducer (run in the averager process): exact part accounting, robust merge.

Every part a reducer receives is decoded strictly (:func:`decode_part`). A part that is malformed,
oversize, of the wrong shape or dtype, or comes with a weight that is not a finite number >= 0 gets its
sender banned, and the round fails as a whole (:meth:`ExactAllReduceRunner.completeness_problem`). A
part whose *only* fault is non-finite values (``Reason.NON_FINITE``: a NaN in a diverged member's
pseudo-gradient) is *left out* of that part's average instead -- as the simulator and
:func:`outer.robust_mean` do -- and the reducer still sends that sender the average, so its all-reduce
completes, it does not veto, and one member that sends NaN every round cannot block its groups' rounds.
The same holds for the reducer's own share of its own tensors. A part with no finite contribution at
all is returned as zeros (never NaN on the wire) and fails the round.

**The sender closes an answer stream, never the reducer.** hivemind's reducer returned from its handler right
after its last answer, which closed the stream from its side while the answers were still on their way; the
daemon then sometimes reset the stream, and a reset stream drops what the receiving daemon had not yet passed on:
on slow links the sender read the first parts and then a clean end (``peer ... sent 3 parts, but we expected 5``,
with every member alive, the reducer's own all-reduce complete, and a ``stream reset`` in the sender's daemon
log). Now the sender stops reading after the number of parts it expects and closes the stream, and the reducer,
having answered every part, keeps its side open until then (:meth:`ExactAllReduceRunner.rpc_aggregate_part`, at
most its ``reducer_timeout``): a reset after the sender has read everything loses nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from typing import Any, AsyncGenerator, AsyncIterator, Mapping, Sequence

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import (
    aiter_with_timeout,
    amap_in_executor,
    attach_event_on_finished,
)

from p2p_diloco.averaging.decisions import HIVEMIND_FRAMING_BYTES, completeness_problem
from p2p_diloco.core import outer
from p2p_diloco.core.rejects import PeerDataError, Reason, log_rejection
from p2p_diloco.hivemind_ext import require_hivemind
from p2p_diloco.hivemind_ext.compression import decode_part

require_hivemind(__name__)  # overrides AllReduceRunner's private methods and TensorPartReducer's internals

logger = logging.getLogger(__name__)

ANSWER_LINGER_S = 30.0
"""How long a reducer that answered every part keeps the stream open for its sender to close it, when the round
set no ``reducer_timeout`` (with one, that: a sender silent longer than it has failed us anyway)."""


async def first_messages(stream: AsyncIterator[Any], count: int) -> AsyncIterator[Any]:
    """The first ``count`` messages of ``stream`` and not one more: the reducer keeps its side open until we close
    ours, so waiting for the stream's end would wait out its linger."""
    if count <= 0:
        return
    async for message in stream:
        yield message
        count -= 1
        if count == 0:
            return


class NotInGroup(AllreduceException):
    """A member answered our parts with ``BAD_GROUP_ID``: it does not run this group's all-reduce (a group from the
    clock it saw differently: it went on without a member we heard from, or failed; its streams to us never come)."""


class _RobustPart:
    """Stands in for :class:`TensorPartReducer`'s accumulator of one part. hivemind calls
    ``add_(part, alpha=weight)`` once per sender it counts and then ``div_(total weight)``; we keep the
    parts and return :func:`outer.robust_mean` of them instead of the plain weighted mean."""

    def __init__(self, shape: torch.Size, rule: outer.Robust) -> None:
        self.shape, self.rule = shape, rule
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> "_RobustPart":
        self.parts.append(part)
        self.weights.append(float(alpha))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        if not self.parts:
            return torch.zeros(self.shape)
        return outer.robust_mean(self.parts, self.weights, self.rule)


class RobustTensorPartReducer(TensorPartReducer):
    """hivemind's reducer with a bounded influence per sender (``outer.robust``): each part is
    :func:`outer.robust_mean` of what the senders sent (non-finite parts left out, norms capped at
    ``clip_factor`` x the lower median, a trimmed mean with "trim"), weighted by the senders' *gathered*
    weights after :func:`outer.clip_to_median` -- the weights every member decodes with -- not by the weight a sender
    claims in its stream. One reducer computes each part and sends it to everyone, so all members
    still hold bit-identical results. hivemind's own bookkeeping (which sender counts for which part,
    bans, completion) is untouched: only the accumulator is replaced (hivemind 1.1.12 uses exactly
    ``add_`` and ``div_`` on it)."""

    def __init__(self, part_shapes: Sequence[torch.Size], sender_weights: Sequence[float], rule: outer.Robust) -> None:
        self.sender_weights = [float(w) for w in sender_weights]
        self.rule = rule
        super().__init__(part_shapes, len(self.sender_weights))

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _RobustPart(self.part_shapes[self.current_part_index], self.rule)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        return await super().accumulate_part(sender_index, part_index, tensor_part,
                                             weight=self.sender_weights[sender_index])


class ExactAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, except that reducers return ``codec(average)`` (the same bytes
    to every sender) instead of ``codec(average - x_sender)``, and every message sent or received is
    counted. The outputs are the averaged tensors, not deltas: :class:`FragmentAveragerProcess` copies them.
    With ``robust`` = (clipped gathered weight per peer, rule), parts are reduced by
    :class:`RobustTensorPartReducer`.
    """

    def __init__(self, *args: Any, counters: tuple[Any, Any], fragment: int | None = None,
                 robust: tuple[Mapping[Any, float], outer.Robust] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent, self._received = counters
        self.fragment = fragment
        self.reducer_failures: list[str] = []  # "peer: why" for each reducer that failed us, for the round's reason
        self.left_out: dict[Any, int] = {}
        """Parts with non-finite values that this reducer left out of their averages, per sender peer id."""
        self.empty_parts: set[int] = set()
        """Indices of parts whose every sender was left out (returned as zeros; the round fails)."""
        self._left_out_of_part: collections.Counter[int] = collections.Counter()
        if robust is not None:
            weights, rule = robust
            self.tensor_part_reducer: Any
            self.tensor_part_reducer.finished.set()  # hivemind's own reducer is replaced unused: no "0% received"
            self.tensor_part_reducer = RobustTensorPartReducer(
                tuple(part.shape for part in self.parts_for_local_averaging),
                [weights[peer] for peer in self.sender_peer_ids], rule)

    def _count(self, counter: Any, message: Any) -> None:
        with counter.get_lock():
            counter.value += message.ByteSize() + HIVEMIND_FRAMING_BYTES

    def _quantized(self, averaged: torch.Tensor, compression_type: int) -> tuple[Any, torch.Tensor]:
        message = serialize_torch_tensor(averaged, compression_type)
        return message, deserialize_torch_tensor(message)

    def _stand_in(self, part_index: int) -> tuple[torch.Tensor, float]:
        """What the reducer accumulates for a part that is left out: no influence on the average.

        hivemind's :class:`TensorPartReducer` adds ``weight * part`` and ``weight`` to its denominator,
        so zeros with weight 0.0 change neither. :class:`RobustTensorPartReducer` ignores the weight
        (it uses the gathered one), so it gets a NaN-filled part, which :func:`outer.robust_mean` leaves
        out -- out of the mean *and* out of the median its norm cap is taken from -- exactly as the
        simulator's robust reducer leaves out the non-finite part itself."""
        shape = self.tensor_part_reducer.part_shapes[part_index]
        if isinstance(self.tensor_part_reducer, RobustTensorPartReducer):
            return torch.full(shape, math.nan), 0.0
        return torch.zeros(shape), 0.0

    async def _ban_sender(self, peer_id: Any) -> None:
        """hivemind's ban, except when our handler of a sender whose every part is in is being cancelled: the sender
        closes its stream after reading our last answer (the module's docstring), which may cancel the handler before
        it saw the input end, and hivemind's handler bans on any exception -- the round was then "partial: 1 sender
        dropped" with every byte moved (the main job, groups from the clock and matchmaking alike). Its parts are all
        counted; nothing is left to wait for or to exclude. A ban for a refused part (one too many included) stands."""
        reducer, task = self.tensor_part_reducer, asyncio.current_task()
        if (task is not None and task.cancelling()
                and reducer.num_parts_received[self.sender_peer_ids.index(peer_id)] >= reducer.num_parts):
            logger.debug("fragment %s: sender %s ended its stream after its last part: not banned", self.fragment,
                         peer_id)
            return
        await super()._ban_sender(peer_id)

    def _leave_out(self, sender: Any, part_index: int, error: PeerDataError) -> None:
        """Count a left-out part of ``sender``; log it with its reason code once per sender per round."""
        if sender not in self.left_out:
            log_rejection(logger, "a tensor part (left out of its average)", sender, error)
        self.left_out[sender] = self.left_out.get(sender, 0) + 1
        self._left_out_of_part[part_index] += 1

    async def _reduce_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor | None,
                           weight: float) -> torch.Tensor:
        """Accumulate one sender's part (None: left out, see :meth:`_stand_in`) and return the part's average.

        If every sender still counted for the part was left out, hivemind's reducer would return 0/0 =
        NaN (it divides by the plain denominator, no epsilon): the part is returned as zeros instead, and
        recorded in ``empty_parts`` so that the round fails (:meth:`completeness_problem`)."""
        if tensor_part is None:
            tensor_part, weight = self._stand_in(part_index)
        reducer = self.tensor_part_reducer
        averaged = await reducer.accumulate_part(sender_index, part_index, tensor_part, weight=weight)
        left_out = self._left_out_of_part[part_index]
        if left_out and left_out >= sum(part_index < failed for failed in reducer.sender_failed_after):
            self.empty_parts.add(part_index)
            return torch.zeros_like(averaged)
        return averaged

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._count(self._sent, message)
            yield message

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            compression_type = container.compression.compression_type
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                part: torch.Tensor | None = tensor_part
                if not bool(torch.isfinite(tensor_part).all()):  # our own share is held to the same rule
                    self._leave_out(self.peer_id, part_index, PeerDataError(
                        Reason.NON_FINITE, f"our own part {part_index} holds NaN or infinite values"))
                    part = None
                averaged = await self._reduce_part(sender_index, part_index, part, self.weight)
                _, decoded = await asyncio.get_event_loop().run_in_executor(
                    None, self._quantized, averaged, compression_type)
                container.register_processed_part(peer_index, part_index, decoded)
            return
        try:  # as hivemind's, plus counting the received messages
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def decode(msg: averaging_pb2.AveragingData) -> torch.Tensor:
                if msg.code == averaging_pb2.BAD_GROUP_ID:
                    raise NotInGroup(f"{peer_id} sent BAD_GROUP_ID: it does not run this group's all-reduce")
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                self._count(self._received, msg)
                return deserialize_torch_tensor(msg.tensor_part)

            part_index, expected = 0, container.num_parts_by_peer[peer_index]
            try:  # we close the stream once we have read every part (see the module's docstring)
                async for averaged in amap_in_executor(decode, aiter_with_timeout(first_messages(stream, expected),
                                                                                  self.reducer_timeout),
                                                       max_prefetch=container.prefetch):
                    container.register_processed_part(peer_index, part_index, averaged)
                    part_index += 1
            finally:
                await self._close_answers(stream)
            if part_index != expected:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {expected}")
        except BaseException as e:
            why = "cancelled" if isinstance(e, asyncio.CancelledError) else f"{type(e).__name__}: {e}"[:200]
            self.reducer_failures.append(f"{str(peer_id)[-8:]}: {why}")
            # INFO: the round's failure names it (completeness_problem), in the one line it is logged with
            logger.info("fragment %s: the reducer %s failed us: %s", self.fragment, peer_id, why)
            container.register_failed_reducer(peer_index)
            if not isinstance(e, asyncio.CancelledError) and peer_id in self.sender_peer_ids:
                # the round is partial now and fails for all (completeness_problem): waiting out this member's parts
                # gains nothing -- and they may never come (BAD_GROUP_ID: it does not run this group; a broken pipe:
                # it answered so and closed the stream before we read it, or it died)
                await self._ban_sender(peer_id)
            raise

    async def _close_answers(self, stream: AsyncIterator[Any]) -> None:
        """Close our side of an answer stream (hivemind's reader closes the daemon's socket in its ``finally``)."""
        if not isinstance(stream, AsyncGenerator):
            return
        try:
            await stream.aclose()
        except RuntimeError as e:  # still being read by a task that is being cancelled: that task closes it
            logger.debug("fragment %s: answer stream closed by its reader instead: %s", self.fragment, e)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler; then, once every part was answered, the stream stays open until the sender closes it
        (hivemind cancels this handler when it does) or ``reducer_timeout`` passes: a stream closed by the reducer
        while its last answers were on their way could be reset and lose them (the module's docstring)."""
        answered = 0
        async for message in super().rpc_aggregate_part(stream, context):
            answered += message.code == averaging_pb2.AVERAGED_PART
            yield message
        if answered != self.tensor_part_reducer.num_parts:
            return
        linger_s = self.reducer_timeout if self.reducer_timeout is not None else ANSWER_LINGER_S
        closed_by_sender = True
        try:
            await asyncio.sleep(linger_s)
            closed_by_sender = False
            logger.info("fragment %s: sender %s did not close its stream within %s s of our last answer",
                        self.fragment, context.remote_id, linger_s)
        finally:
            self._answers_ended(closed_by_sender)

    def _answers_ended(self, closed_by_sender: bool) -> None:
        """Called once per answer stream that got every part: whether its sender closed it (as it should) or our
        linger ran out first. A hook for tests, which count them."""

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """As hivemind's, except that each part is decoded strictly (:func:`decode_part`: our codec's slot,
        the part's shape and dtype, exact buffer length, finite values; a finite non-negative weight).
        A part whose only fault is non-finite values is left out of its average (:meth:`_leave_out`) and
        the sender still gets the average back. Any other refusal is logged with the sender's peer id and
        a reason code, and the sender is banned -- the round then fails as a whole
        (:meth:`completeness_problem`), never half-applied."""
        part_index = 0
        loop = asyncio.get_event_loop()
        reducer, compression = self.tensor_part_reducer, self.tensor_part_container.compression
        sender = self.sender_peer_ids[sender_index]

        async def numbered() -> AsyncIterator[tuple[int, averaging_pb2.AveragingData]]:
            index = 0
            async for msg in stream:
                yield index, msg
                index += 1

        def receive(item: tuple[int, averaging_pb2.AveragingData]
                    ) -> tuple[torch.Tensor | PeerDataError, float, int]:
            """(the decoded part, or the NON_FINITE refusal of a part that is left out; weight; codec slot)."""
            index, msg = item
            self._count(self._received, msg)
            if index >= reducer.num_parts:
                raise PeerDataError(Reason.OVERSIZE, f"part {index} of only {reducer.num_parts}")
            if not math.isfinite(msg.weight) or msg.weight < 0:
                raise PeerDataError(Reason.NON_FINITE if not math.isfinite(msg.weight) else Reason.MALFORMED,
                                    f"weight {msg.weight} is not a finite number >= 0")
            local = self.parts_for_local_averaging[index]
            try:
                part = decode_part(msg.tensor_part, reducer.part_shapes[index], local.dtype,
                                   compression.compression_type)
            except PeerDataError as e:
                if e.reason is not Reason.NON_FINITE:  # slot, shape, dtype and length were checked before
                    raise  # finiteness, and a left-out part's contents are never used
                return e, msg.weight, msg.tensor_part.compression
            return part, msg.weight, msg.tensor_part.compression

        parts = amap_in_executor(receive, numbered(), max_prefetch=self.tensor_part_container.prefetch)
        try:
            while True:
                try:
                    tensor_part, weight, compression_type = await parts.__anext__()
                except StopAsyncIteration:
                    break
                except ValueError as e:  # banned: the round fails for everyone (completeness_problem)
                    log_rejection(logger, "a tensor part", sender, e)
                    await self._ban_sender(sender)
                    break
                except asyncio.TimeoutError:  # the finally below bans it; say why (it looks like a reducer fault)
                    logger.warning("fragment %s: sender %s silent for %s s after %d of %d parts: dropped from "
                                   "this round", self.fragment, sender, self.sender_timeout, part_index,
                                   reducer.num_parts)
                    raise
                part: torch.Tensor | None = None
                if isinstance(tensor_part, PeerDataError):  # non-finite values: left out, the round goes on
                    self._leave_out(sender, part_index, tensor_part)
                else:
                    part = tensor_part
                try:
                    averaged = await self._reduce_part(sender_index, part_index, part, weight)
                    part_index += 1
                except AllreduceException as e:  # BannedException included: this sender no longer counts
                    logger.info("fragment %s: stopped reducing sender %s after %d of %d parts: %s", self.fragment,
                                sender, part_index, reducer.num_parts, e)
                    break
                serialized, _ = await loop.run_in_executor(None, self._quantized, averaged, compression_type)
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self._count(self._sent, message)
                yield message
        finally:
            await parts.aclose()
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def cut_short(self, timeout_s: float) -> str:
        """Why an all-reduce cancelled at its ``timeout_s`` (hivemind's ``allreduce_timeout``) failed: the reducers
        whose averages had not all come back -- a member killed while it reduced, when our link to it has not yet
        broken. Also retrieves the exception hivemind's runner set on its own future when the cancellation went
        through it, which nobody else awaits (asyncio logged "Future exception was never retrieved")."""
        if self._future.done() and not self._future.cancelled():
            self._future.exception()
        container = self.tensor_part_container
        waiting = [i for i, parts in enumerate(container.num_parts_by_peer)
                   if container._outputs_registered_by_peer[i] < parts]
        problem = (f"partial all-reduce: not over within its timeout of {timeout_s:.1f} s, averages missing from "
                   f"{len(waiting)} of {len(container.num_parts_by_peer)} reducers")
        if self.reducer_failures:
            problem += f" [{'; '.join(self.reducer_failures)}]"
        return problem

    def completeness_problem(self) -> str | None:
        reducer = self.tensor_part_reducer
        expected = reducer.num_parts * reducer.num_senders
        problem = completeness_problem(self.tensor_part_container.total_size, self.tensor_part_container.failed_size,
                                       len(self.banned_senders), expected, sum(reducer.num_parts_received))
        if problem is None and self.empty_parts:
            problem = f"{len(self.empty_parts)} part(s) with no finite contribution from any sender"
        if problem is not None and self.reducer_failures:
            problem += f" [{'; '.join(self.reducer_failures)}]"
        return problem


