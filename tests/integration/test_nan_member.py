"""A member that sends non-finite parts every round must not block its groups' rounds (issue 21, item 5b).

A reducer leaves a part whose only fault is NaN/inf values out of that part's average, still sends the
sender the average (so its all-reduce completes and it does not veto), counts the exclusion
(``ExactAllReduceRunner.left_out``) and logs it once per sender. Malformed parts still ban their sender
and fail the round. A part with no finite contribution at all comes back as zeros and fails the round.

The reducer path is driven in-process with a fake p2p (as in ``test_fuzz_decoders.py``); the rounds run
on 3 real DHTs + 3 fragment averagers on 127.0.0.1. With the int4/int8 codecs an honest sender cannot
even encode NaN (our quantizer refuses non-finite values, so its own all-reduce fails); only a crafted
buffer with a NaN block scale carries it -- the in-process case "int8 NaN scale" below. So the rounds use
fp32, which carries NaN as it is.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import multiprocessing as mp
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from averagers import averaging_swarm, run_round
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.core import outer
from p2p_diloco.core.config import load_config
from p2p_diloco.hivemind_ext.compression import get_codec, link_part_bytes

pytestmark = pytest.mark.integration

# ---------------------------------------------------------------- the reducer path, in-process


class _FakeP2P:
    def __init__(self, peer_id: PeerID) -> None:
        self.peer_id = peer_id


OURS, THEIRS = PeerID(b"\x00\x05peerA"), PeerID(b"\x00\x05peerB")
OUR_WEIGHT, THEIR_WEIGHT = 1.0, 2.0
REDUCE_DEADLINE_S = 10.0


def _runner(codec: str, ours: torch.Tensor, robust: bool) -> ExactAllReduceRunner:
    """A reducer of every part of a 3000-element tensor, with us and THEIRS as senders (no network)."""
    counters = (mp.Value(ctypes.c_longlong, 0), mp.Value(ctypes.c_longlong, 0))
    rule = ({OURS: OUR_WEIGHT, THEIRS: THEIR_WEIGHT}, outer.Robust(clip_factor=2.0)) if robust else None
    return ExactAllReduceRunner(
        p2p=_FakeP2P(OURS), servicer_type=ExactAllReduceRunner, prefix=None, group_id=b"g", tensors=[ours],
        weight=OUR_WEIGHT, ordered_peer_ids=[OURS, THEIRS], peer_fractions=(1.0, 0.0), counters=counters,
        compression=get_codec(codec), part_size_bytes=1024, robust=rule)


def _messages(codec: str, parts: list[torch.Tensor]) -> list[averaging_pb2.AveragingData]:
    return [averaging_pb2.AveragingData(tensor_part=get_codec(codec).compress(p, CompressionInfo.from_tensor(p)),
                                        weight=THEIR_WEIGHT) for p in parts]


Messages = list[averaging_pb2.AveragingData]


async def _reduce(codec: str, ours: torch.Tensor, robust: bool, theirs: Callable[[ExactAllReduceRunner], Messages]
                  ) -> tuple[ExactAllReduceRunner, list[torch.Tensor], list[torch.Tensor]]:
    """Our own share through the runner's local path, THEIRS' parts (``theirs(runner)``) through the
    reducer; returns (the runner, our parts as they were, the averages THEIRS gets back, decoded). The
    runner is built inside the event loop: hivemind's reducer makes its first future at construction."""
    runner = _runner(codec, ours, robust)
    our_parts = [p.clone() for p in runner.parts_for_local_averaging]
    messages = theirs(runner)

    async def stream() -> AsyncIterator[averaging_pb2.AveragingData]:
        for m in messages:
            yield m

    local = asyncio.create_task(runner._communicate_with_peer(OURS))
    answered = [deserialize_torch_tensor(m.tensor_part) async for m in runner._accumulate_parts_streaming(stream(), 1)]
    await asyncio.wait_for(local, REDUCE_DEADLINE_S)
    return runner, our_parts, answered


def _nan_scale(messages: list[averaging_pb2.AveragingData]) -> None:
    """A well-formed int8 buffer of part 1 whose block scales are NaN (what a NaN tensor would need)."""
    buffer = bytearray(messages[1].tensor_part.buffer)
    header = 16  # p2p_diloco.core.codecs.HEADER.size
    buffer[header:header + 4] = struct.pack("<f", math.nan)
    messages[1].tensor_part.buffer = bytes(buffer)


def _nan_value(parts: list[torch.Tensor]) -> None:
    """One NaN in part 1 (fp16 clamps infinities to its range before encoding, but NaN passes)."""
    parts[1] = parts[1].clone()
    parts[1][7] = math.nan


LEFT_OUT_CASES: dict[str, tuple[str, Callable[[list[torch.Tensor]], None] | None,
                                Callable[[list[averaging_pb2.AveragingData]], None] | None]] = {
    # a part whose only fault is non-finite values: (codec, poison the parts, poison the messages)
    "fp32 NaN value": ("fp32", _nan_value, None),
    "fp16 NaN value": ("fp16", _nan_value, None),
    "int8 NaN scale": ("int8", None, _nan_scale),
}


@pytest.mark.parametrize("robust", [False, True], ids=["mean", "robust"])
@pytest.mark.parametrize("case", sorted(LEFT_OUT_CASES))
def test_the_reducer_leaves_out_a_non_finite_part_and_answers_every_part(
        case: str, robust: bool, caplog: pytest.LogCaptureFixture) -> None:
    codec, poison_parts, poison_messages = LEFT_OUT_CASES[case]
    gen = torch.Generator().manual_seed(0)
    sent: list[torch.Tensor] = []

    def theirs(runner: ExactAllReduceRunner) -> Messages:
        sent.extend(torch.randn(s, generator=gen) for s in runner.tensor_part_reducer.part_shapes)
        if poison_parts is not None:
            poison_parts(sent)
        messages = _messages(codec, sent)
        if poison_messages is not None:
            poison_messages(messages)
        return messages

    with caplog.at_level(logging.WARNING, logger="p2p_diloco.averaging"):
        runner, ours, answered = asyncio.run(_reduce(codec, torch.randn(3000, generator=gen), robust, theirs))

    assert THEIRS not in runner.banned_senders
    assert len(answered) == runner.tensor_part_reducer.num_parts  # the sender gets every average back
    assert runner.completeness_problem() is None, runner.completeness_problem()
    assert runner.left_out == {THEIRS: 1} and not runner.empty_parts
    assert caplog.text.count(f"rejected a tensor part (left out of its average) from {THEIRS}: non-finite: ") == 1
    # the left-out part's average is our part alone, through the codec; the others average both senders
    codec_of = get_codec(codec)
    assert torch.equal(answered[1], codec_of.extract(codec_of.compress(ours[1], CompressionInfo.from_tensor(ours[1]))))
    assert all(bool(torch.isfinite(a).all()) for a in answered)
    if codec == "fp32":
        total = OUR_WEIGHT + THEIR_WEIGHT
        assert torch.allclose(answered[0], (OUR_WEIGHT * ours[0] + THEIR_WEIGHT * sent[0]) / total, atol=1e-6)


def _all_nan(runner: ExactAllReduceRunner) -> Messages:
    return _messages("fp32", [torch.full(s, math.nan) for s in runner.tensor_part_reducer.part_shapes])


@pytest.mark.parametrize("robust", [False, True], ids=["mean", "robust"])
def test_a_sender_whose_every_part_is_left_out_still_gets_every_average(robust: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    runner, ours, answered = asyncio.run(_reduce("fp32", torch.randn(3000, generator=gen), robust, _all_nan))
    assert runner.left_out == {THEIRS: len(ours)} and runner.completeness_problem() is None
    assert len(answered) == len(ours) and all(torch.equal(a, o) for a, o in zip(answered, ours))  # ours alone


@pytest.mark.parametrize("robust", [False, True], ids=["mean", "robust"])
def test_a_part_without_any_finite_contribution_is_zeros_and_fails_the_round(robust: bool) -> None:
    """Every sender of every part is left out (our own tensor is NaN too): hivemind's reducer would divide
    0 by a zero denominator (NaN, and a NaN the int codecs could not even encode); we answer zeros and
    the round fails -- a group whose every member sent NaN has nothing to commit."""
    runner, ours, answered = asyncio.run(_reduce("fp32", torch.full((3000,), math.nan), robust, _all_nan))
    assert len(answered) == len(ours) and all(torch.equal(a, torch.zeros(a.shape)) for a in answered)
    assert runner.left_out == {OURS: len(ours), THEIRS: len(ours)}
    assert runner.empty_parts == set(range(len(ours)))
    assert "no finite contribution" in (runner.completeness_problem() or "")


# ---------------------------------------------------------------- real rounds with a NaN member

FIRED = mp.Value(ctypes.c_int, 0)  # shared with the forked averager processes
LEFT_OUT = mp.Value(ctypes.c_int, 0)  # parts left out, summed over every member's reducer
PARTS = mp.Value(ctypes.c_int, 0)  # parts reduced, summed over every member's reducer
EMPTY = mp.Value(ctypes.c_int, 0)
# six equal tensors, cut in parts of link_part_bytes (two per tensor here, no link measured) and dealt to reducers by
# position (every peer reduces some parts)
NAMES = tuple(f"blocks.{i}.fc.weight" for i in range(6))
SHAPES = {n: torch.Size([64, 32]) for n in NAMES}


def parts_of_a_round(members: int, slowest_Bps: float = 0.0) -> int:
    """The parts an fp32 round of NAMES among ``members`` is cut in, as every member's runner cuts them (sized for the
    slowest member's measured link: 0.0, none measured)."""
    tensors = [torch.zeros(SHAPES[n]) for n in NAMES]
    codec = get_codec("fp32")
    container = TensorPartContainer(tensors, [1.0] * members, compression=codec,
                                    part_size_bytes=link_part_bytes(tensors, codec, members, slowest_Bps))
    return sum(container.num_parts_by_peer)
TOKENS = (2560, 1280, 3840)
ROUND_DEADLINE_S = 60.0
NAN_MEMBER = 0


def _config(robust: str) -> Any:
    return load_config(None, ["run.run_id=nan-member", "model.n_layer=2", "outer.fragments=2", "outer.merge=\"mean\"",
                              "outer.codec=\"fp32\"", f"outer.robust=\"{robust}\"", "averaging.window_s=1.5",
                              "averaging.commit_timeout_s=3.0", "averaging.next_chunk_timeout_s=2.0",
                              "averaging.allreduce_timeout_s=10.0"])


def _add(counter: Any, value: int) -> None:
    with counter.get_lock():
        counter.value += value


class Counting(ExactAllReduceRunner):
    """Reports what this reducer left out into the shared counters once its all-reduce is done."""

    def completeness_problem(self) -> str | None:
        _add(LEFT_OUT, sum(self.left_out.values()))
        _add(PARTS, self.tensor_part_reducer.num_parts)
        _add(EMPTY, len(self.empty_parts))
        return super().completeness_problem()


class SendsNaN(Counting):
    """A member whose tensors are all NaN every round (a diverged replica that skips its local check):
    NaN in every part it sends, and in its own share as a reducer."""

    def __init__(self, *args: Any, tensors: Any, **kwargs: Any) -> None:
        for t in tensors:
            t.fill_(math.nan)
        _add(FIRED, 1)
        super().__init__(*args, tensors=tensors, **kwargs)


@pytest.mark.parametrize("robust", ["none", "clip"])
def test_a_member_sending_nan_every_round_does_not_block_the_rounds(tmp_path: Path, robust: str) -> None:
    cfg = _config(robust)
    for counter in (FIRED, LEFT_OUT, PARTS, EMPTY):
        counter.value = 0
    runners = tuple(SendsNaN if i == NAN_MEMBER else Counting for i in range(3))
    with averaging_swarm(tmp_path, cfg, NAMES, SHAPES, runners) as peers:
        gen = torch.Generator().manual_seed(0)
        for round_index in range(2):  # consecutive rounds: the NaN member is not banned from the next
            tensors = [{n: torch.randn(SHAPES[n], generator=gen) for n in NAMES} for _ in peers]
            fired, left_out, parts = FIRED.value, LEFT_OUT.value, PARTS.value
            outcomes = run_round(peers, tensors, cfg, TOKENS, ROUND_DEADLINE_S)
            for o in outcomes:
                print(f"\nround {round_index}: committed={o.committed} group={o.group_size} {o.reason}")
            assert FIRED.value == fired + 1, "the fault did not fire"
            assert all(o.committed and o.group_size == 3 for o in outcomes), [o.reason for o in outcomes]
            # every part had exactly one sender left out -- the NaN member -- across the three reducers
            assert PARTS.value - parts == LEFT_OUT.value - left_out == parts_of_a_round(3)
            assert EMPTY.value == 0
            honest = [i for i in range(3) if i != NAN_MEMBER]
            total = sum(TOKENS[i] for i in honest)
            merged = [o.merged for o in outcomes]
            assert merged[0] is not None
            for n in NAMES:
                assert all(m is not None and torch.equal(m[n], merged[0][n]) for m in merged), n  # bit-identical
                exact = sum(tensors[i][n] * (TOKENS[i] / total) for i in honest)
                assert torch.allclose(merged[0][n], exact, rtol=1e-5, atol=1e-6), n  # fp32: up to rounding


def test_the_parts_are_sized_for_the_slowest_members_link(tmp_path: Path) -> None:
    """Each member's measured link goes in its round metadata; every member cuts the all-reduce in parts no shorter
    than a tenth of a second on the slowest one's: one slow member keeps the small pipelined parts for the group, a
    group of fast links gets hivemind's (a part a tensor here). Both rounds commit with the same average everywhere."""
    cfg = _config("none")
    PARTS.value = 0
    pipelined, fast = parts_of_a_round(3), parts_of_a_round(3, 1e9)
    assert pipelined > fast, (pipelined, fast)  # the test tells them apart
    with averaging_swarm(tmp_path, cfg, NAMES, SHAPES, (Counting,) * 3) as peers:
        gen = torch.Generator().manual_seed(1)
        for links, expected in (((1e9, 31_250.0, 1e9), pipelined), ((1e9, 2e9, 1e9), fast)):
            tensors = [{n: torch.randn(SHAPES[n], generator=gen) for n in NAMES} for _ in peers]
            parts = PARTS.value
            outcomes = run_round(peers, tensors, cfg, TOKENS, ROUND_DEADLINE_S, links=links)
            assert all(o.committed and o.group_size == 3 for o in outcomes), [o.reason for o in outcomes]
            assert PARTS.value - parts == expected, (links, PARTS.value - parts, expected)
            first = outcomes[0].merged
            assert first is not None
            assert all(o.merged is not None and torch.equal(o.merged[n], first[n]) for o in outcomes for n in NAMES)


class SendsWrongShape(ExactAllReduceRunner):
    """As a sender, declare one extra element in every part it sends to another reducer (malformed)."""

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            size = [*message.tensor_part.size]
            message.tensor_part.ClearField("size")
            message.tensor_part.size.extend([size[0] + 1, *size[1:]])
            _add(FIRED, 1)
            yield message


def test_a_malformed_part_still_bans_its_sender_and_fails_the_round(tmp_path: Path) -> None:
    cfg = _config("none")
    FIRED.value = 0
    with averaging_swarm(tmp_path, cfg, NAMES, SHAPES, (SendsWrongShape, ExactAllReduceRunner,
                                                        ExactAllReduceRunner)) as peers:
        gen = torch.Generator().manual_seed(2)
        tensors = [{n: torch.randn(SHAPES[n], generator=gen) for n in NAMES} for _ in peers]
        outcomes = run_round(peers, tensors, cfg, TOKENS, ROUND_DEADLINE_S)
    for o in outcomes:
        print(f"\nmalformed sender: committed={o.committed} {o.reason}")
    assert FIRED.value >= 1, "the fault did not fire"
    assert not any(o.committed for o in outcomes), [o.reason for o in outcomes]
    # the honest reducers banned it: their rounds name a sender dropped mid-round
    assert all("1 sender(s) dropped mid-round" in o.reason for o in outcomes[1:]), [o.reason for o in outcomes]
