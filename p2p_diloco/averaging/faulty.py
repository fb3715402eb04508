"""The averaging side's fault points (``p2p-diloco join --fault``, :mod:`p2p_diloco.core.faults`): subclasses of the
runner, the averager process and the host that hit their points and otherwise do exactly what their parents do.

They are built only when faults are armed (:class:`p2p_diloco.engine.faulty.FaultyNetwork`, before the averager
processes are forked, so those inherit the armed faults); the production classes hold no fault code. Points:

- ``while-sending`` (:class:`FaultyRunner`, averager process): after the first part went out to a reducer;
- ``while-reducing`` (:class:`FaultyRunner`): after the first part of a remote sender was reduced, before its
  average is sent back;
- ``serving-state`` / ``fetching-state`` (:class:`FaultyAveragerProcess`): after the first chunk of a state download
  we serve / receive;
- ``reading-verdicts`` (:class:`FaultyAveragerHost`, the learner's process): each read of a round's verdicts; a
  ``blind`` fault makes the read come back empty. With groups from the clock (:class:`FaultyAveragerProcess`): each
  verdict a member sends us; a ``blind`` fault drops it (answered, never kept);
- ``serving-offers`` (:class:`FaultyAveragerProcess`): each request for our offer to a group from the clock; a
  ``blind`` fault answers that we have none (the others' offers still reach us: members that see the group
  differently).
"""

from __future__ import annotations

from typing import Any, AsyncIterator  # typing's: hivemind reads a handler's stream types by their typing name

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from p2p_diloco.averaging.host import FragmentAveragerHost
from p2p_diloco.averaging.process import FragmentAveragerProcess
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.core import faults


class FaultyRunner(ExactAllReduceRunner):
    """:class:`ExactAllReduceRunner` with the ``while-sending`` and ``while-reducing`` points."""

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in faults.after_first(super()._generate_input_for_peer(peer_index), "while-sending",
                                                self.fragment):
            yield message

    async def _reduce_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor | None,
                           weight: float) -> torch.Tensor:
        averaged = await super()._reduce_part(sender_index, part_index, tensor_part, weight)
        if part_index == 0 and self.sender_peer_ids[sender_index] != self.peer_id:  # our own share does not count
            faults.hit("while-reducing", self.fragment)
        return averaged


class FaultyAveragerProcess(FragmentAveragerProcess):
    """:class:`FragmentAveragerProcess` with the ``serving-state`` and ``fetching-state`` points, under the same RPC
    handler names (hivemind names them after the servicer's class): everyone else's averagers still answer it."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return FragmentAveragerProcess._get_handle_name(namespace, method_name)

    # hivemind derives the handler's protobufs from these annotations, at run time
    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in faults.after_first(super().rpc_download_state(request, context), "serving-state",
                                                self.fragment):
            yield message

    def _donor_parts(self, stream: AsyncIterator[Any], silence_s: float) -> AsyncIterator[Any]:
        return faults.after_first(super()._donor_parts(stream, silence_s), "fetching-state", self.fragment)

    async def rpc_group_verdict(self, request: averaging_pb2.JoinRequest,
                                context: P2PContext) -> averaging_pb2.MessageFromLeader:
        if faults.hit("reading-verdicts", self.fragment):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)  # taken, never kept
        return await super().rpc_group_verdict(request, context)

    async def rpc_group_offer(self, request: averaging_pb2.JoinRequest,
                              context: P2PContext) -> averaging_pb2.MessageFromLeader:
        if faults.hit("serving-offers", self.fragment):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        return await super().rpc_group_offer(request, context)


class FaultyAveragerHost(FragmentAveragerHost):
    """:class:`FragmentAveragerHost` over a :class:`FaultyAveragerProcess` and (unless told another runner) a
    :class:`FaultyRunner`, with the ``reading-verdicts`` point."""

    averager_class = FaultyAveragerProcess

    def __init__(self, *args: Any, runner_class: type[ExactAllReduceRunner] = FaultyRunner, **kwargs: Any) -> None:
        super().__init__(*args, runner_class=runner_class, **kwargs)

    def _read_verdicts(self, key: str) -> tuple[Any, float]:
        found, read_s = super()._read_verdicts(key)  # the read's seconds (our RTT sample) exclude a stall here
        return (None if faults.hit("reading-verdicts", self.fragment) else found), read_s
