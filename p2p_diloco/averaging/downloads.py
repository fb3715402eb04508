"""State downloads, the newcomer's side: hivemind's ``load_state_from_peers`` has no size cap, no check before it
returns, and tries every declared peer, behind us or not. Ours tries the donors of
:func:`~p2p_diloco.averaging.decisions.donor_order` in turn, caps and checks every payload before it is decoded, drops
a donor silent past the link's deadline (never one that progresses), and refuses an anchor that no peer but its
donor vouched for.

The donors are the live learners the caller's view holds, ranked by what it saw them hold: no averager declares
itself a donor in the DHT (hivemind's state-sharing declarations were a store at every commit and a read before
each download, about 8% of a learner's control-plane bytes, and a departed learner's stayed until it expired).

A mixin of :class:`~p2p_diloco.averaging.process.FragmentAveragerProcess` (it runs in the averager process).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import msgpack
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.averaging.decisions import (
    MAX_DONORS_TRIED,
    VOUCH_POLL_S,
    VOUCH_WAIT_S,
    donor_order,
    sharing_priority,
    state_size_cap,
    vouch_key,
    vouchers,
)
from p2p_diloco.averaging.linktime import STATE_CHUNK_BYTES, DownloadTimeouts
from p2p_diloco.averaging.transfer import decode_state_metadata, parse_state
from p2p_diloco.core.rejects import PeerDataError, Reason, log_rejection, reason_of
from p2p_diloco.core.replay import (
    MAX_KEPT_ROUNDS,
    KeptRound,
    PackedRound,
    RoundStep,
    chain,
    keep,
    pack_exact,
    parse_rounds,
    rounds_payload,
)
from p2p_diloco.hivemind_ext import require_hivemind
from p2p_diloco.hivemind_ext.compression import decode_part

require_hivemind(__name__)  # reads the averager's private matchmaking state (its group key's prefix)

logger = logging.getLogger(__name__)

MAX_REPLAY_REQUEST_BYTES = 64
"""A replay request is msgpack ``[version, anchor hash]``: about 20 bytes."""


class StateDownloads:
    """The averager's side of a state download (mixed into the averager process class)."""

    # what the averager (hivemind's DecentralizedAverager, our subclass) provides
    _outer_pipe: Any
    _matchmaking: Any
    _p2p: Any
    dht: Any
    peer_id: Any
    prefix: str
    fragment: int | None
    layout: tuple[Sequence[str], Mapping[str, torch.Size]] | None
    state_compression: Any
    get_stub: Callable[..., Any]
    _refuse: Callable[..., Any]
    _kept: list[PackedRound]
    """The rounds we committed last, packed (:meth:`keep_round`)."""

    def keep_round(self, kept: KeptRound, limit: int) -> None:
        """(host) Keep a round we committed, to serve it to peers that replay (:func:`rpc_replay_rounds`): packed in
        this averager's process, the newest ``limit`` kept. Never waits."""
        assert self.layout is not None, "keep_round needs the fragment's layout"
        merged = [kept.merged[n].detach().cpu() for n in self.layout[0]]
        self._outer_pipe.send(("_keep_round", [], dict(step=RoundStep(kept.version, kept.base_hash, kept.anchor_hash),
                                                        merged=merged, limit=limit)))

    async def _keep_round(self, step: RoundStep, merged: Sequence[torch.Tensor], limit: int) -> None:
        packed = await asyncio.get_event_loop().run_in_executor(None, lambda: tuple(pack_exact(t) for t in merged))
        self._kept = keep(self._kept, PackedRound(step.version, step.base_hash, step.anchor_hash, packed), limit)

    async def rpc_replay_rounds(self, request: averaging_pb2.JoinRequest,
                                context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The rounds we kept that take a peer at the rank in ``request.gather`` (msgpack ``[version, anchor hash]``)
        forward (:func:`~p2p_diloco.core.replay.chain`), as :func:`~p2p_diloco.core.replay.rounds_payload` in
        chunks; only to members of our run, nothing for a malformed request."""
        if await self._refuse(context, "replayed rounds"):
            return
        try:
            version, anchor = msgpack.unpackb(request.gather[:MAX_REPLAY_REQUEST_BYTES], raw=False)
            ours = (int(version), str(anchor))
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return
        data = rounds_payload(chain(self._kept, ours))
        for start in range(0, len(data), STATE_CHUNK_BYTES):
            yield averaging_pb2.DownloadData(metadata=data[start:start + STATE_CHUNK_BYTES])

    def download_state(self, ours: tuple[int, str], donors: Mapping[str, tuple[int, str]],
                       timeouts: DownloadTimeouts, replay: bool = True) -> MPFuture:
        """(host) Download a state ahead of ``ours`` from ``donors`` (base58 peer id -> the (version, anchor hash) the
        caller saw it hold) in :func:`donor_order`, trying the next on any failure (a donor silent for
        ``timeouts.silence_s`` has failed; one that progresses is never cut off). With ``replay``, the best donor is
        first asked for the rounds it kept from ``ours`` (:meth:`_replay_from`); if they lead to a vouched anchor
        ahead of ours, they are the result instead. The future's result is ``(FetchedState | None, attempts, bytes
        received from all donors, replayed rounds)``."""
        future: MPFuture = MPFuture()
        priorities = {peer: sharing_priority(*rank) for peer, rank in donors.items()}
        self._outer_pipe.send(("_download_state", [], dict(future=future, ours=ours, priorities=priorities,
                                                            silence_s=timeouts.silence_s, replay=replay)))
        return future

    async def _download_state(self, future: MPFuture, ours: tuple[int, str], priorities: Mapping[str, float],
                              silence_s: float, replay: bool = True) -> None:
        attempts: list[tuple[str, str, float]] = []  # (donor, "ok" or why not, seconds)
        received = [0]  # wire bytes from every donor, counted as they arrive (an aborted stream's too)
        try:
            assert self.layout is not None and self.fragment is not None, "download_state needs fragment and layout"
            names, shapes = self.layout
            cap = state_size_cap([shapes[n] for n in names])
            expected = [shapes[n] for n in names] * 2  # the anchor then the momentum, in names order
            order = donor_order(priorities, self.peer_id.to_base58(), sharing_priority(*ours),
                                self.fragment)[:MAX_DONORS_TRIED]
            rounds = await self._replay_from(order[0], ours, cap, silence_s, received) if replay and order else []
            if rounds:
                future.set_result((None, attempts, received[0], rounds))
                return
            for donor in order:
                t0 = time.monotonic()
                try:
                    metadata, tensors = await self._download_from(PeerID.from_base58(donor), cap, expected,
                                                                  silence_s, received)
                    fetched = await asyncio.get_event_loop().run_in_executor(
                        None, parse_state, metadata, tensors, self.fragment, names, shapes, ours)
                    if fetched is None:
                        raise ValueError("its state is not ahead of ours (our view of it was stale)")
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
                future.set_result((fetched, attempts, received[0], []))
                return
            future.set_result((None, attempts, received[0], []))
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    async def _replay_from(self, donor: str, ours: tuple[int, str], cap_bytes: int, silence_s: float,
                           counted: list[int]) -> list[KeptRound]:
        """The rounds ``donor`` kept from ``ours``, checked (:func:`~p2p_diloco.core.replay.parse_rounds`) and their
        last anchor vouched for by a peer other than the donor; empty when it kept none from ``ours``, or on any
        failure (logged: the caller downloads the state instead). Adds what arrives to ``counted[0]``."""
        assert self.layout is not None
        names, shapes = self.layout
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(donor), namespace=self.prefix)
            request = averaging_pb2.JoinRequest(gather=msgpack.packb(list(ours)))
            stream = await asyncio.wait_for(stub.rpc_replay_rounds(request), timeout=silence_s)
            parts: list[bytes] = []
            got = 0
            async for message in self._donor_parts(stream, silence_s):
                parts.append(message.metadata)
                got += len(message.metadata)
                counted[0] += len(message.metadata)
                if got > cap_bytes * MAX_KEPT_ROUNDS:
                    raise PeerDataError(Reason.OVERSIZE, f"the donor sent more than {MAX_KEPT_ROUNDS} states' bytes")
            rounds = await asyncio.get_event_loop().run_in_executor(None, parse_rounds, b"".join(parts), names,
                                                                    shapes, ours)
            if rounds:
                await self._check_vouched(*rounds[-1].rank, donor)
            return rounds
        except Exception as e:  # no replay from this donor: the state is downloaded instead
            why = (f"timed out (silent for {silence_s:.1f} s)" if isinstance(e, asyncio.TimeoutError)
                   else f"{reason_of(e)}: {e}" if isinstance(e, PeerDataError) else f"{type(e).__name__}: {e}")
            logger.warning("fragment %s: replaying the rounds from %s failed (%s); downloading the state instead",
                           self.fragment, donor, why[:200])
            return []

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
        if metadata is None:
            raise PeerDataError(Reason.MALFORMED, "the donor sent no state")
        if parts:  # the stream ended: a last tensor shorter than its shape is a cut transfer, not bad data
            got = sum(len(part.buffer) for part in parts)
            want = 4 * math.prod(expected[len(tensors)]) if len(tensors) < len(expected) else 0
            if 0 < got < want and parts[0].dtype == "float32":
                raise PeerDataError(Reason.TRUNCATED, f"the donor's stream ended inside tensor {len(tensors) + 1} of "
                                                      f"{len(expected)} ({got} of its {want} bytes)")
            tensors.append(decode(parts))
        if len(tensors) < len(expected):
            raise PeerDataError(Reason.TRUNCATED, f"the donor's stream ended after {len(tensors)} of {len(expected)} "
                                                  "tensors")
        return metadata, tensors

    def _donor_parts(self, stream: AsyncIterator[Any], silence_s: float) -> AsyncIterator[Any]:
        """A donor's state stream, each message within ``silence_s`` of the last (or :class:`asyncio.TimeoutError`)."""
        return aiter_with_timeout(stream, timeout=silence_s)
