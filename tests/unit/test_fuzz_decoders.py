"""Property-based fuzzing of every decoder of peer data (hypothesis, bounded examples, in-process).

For each decoder -- peer records and index entries (and the DHT schema validators), gathered round
metadata, compressed tensor parts (our int8/int4 and hivemind's fp32/fp16 as we receive them), state
download payloads (the stream, its msgpack metadata, the parsed state) -- arbitrary and mutated inputs
must either decode to a valid object or raise ``PeerDataError`` (a ``ValueError`` with a reason code):
never another exception, never a hang, never an allocation sized by what the peer *declares* rather
than what it sent. Valid inputs round-trip. One test drives the live reducer path
(``ExactAllReduceRunner._accumulate_parts_streaming``) with a fake p2p: a refused part bans its sender,
is logged with the sender's peer id and a reason code, and the round is reported partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import resource
import struct
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import torch
from hivemind.compression import CompressionInfo, NoCompression
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from p2p_diloco.core.codecs import local_roundtrip
from p2p_diloco.core.replay import pack_exact, unpack_exact
from p2p_diloco.averaging.decisions import (
    MAX_STATE_METADATA_BYTES,
    META_FIELDS,
    RoundMeta,
    anchor_hash,
    parse_gathered,
)
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.host import FetchedState
from p2p_diloco.averaging.process import FragmentAveragerProcess
from p2p_diloco.averaging.transfer import decode_state_metadata, parse_state, state_payload
from p2p_diloco.core.codecs import CODEC_NAMES
from p2p_diloco.hivemind_ext.compression import decode_part, get_codec, roundtrip
from p2p_diloco.net.records import INDEX_KEYS, MAX_INT, STATES, IndexEntry, PeerRecord, peer_schemas, run_keys
from p2p_diloco.core.rejects import PeerDataError, Reason

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Bounded: the whole file runs in well under 15 s on a 2-core machine (hypothesis costs ~5 ms an example)."""

# ---------------------------------------------------------------- strategies

SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=40)
           | st.binary(max_size=40))
KEYS = st.text(max_size=20) | st.integers(-5, 5) | st.binary(max_size=8)
NESTED = st.one_of(SCALARS, st.lists(SCALARS, max_size=5), st.dictionaries(KEYS, SCALARS, max_size=5))
VALUES = st.one_of(NESTED, st.lists(NESTED, max_size=4), st.dictionaries(KEYS, NESTED, max_size=4))
"""What msgpack can carry (and a little more: ints beyond 64 bits), nested two deep (``st.recursive`` is
several times slower to draw)."""


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> dict[str, Any]:
    """``valid`` with one to three fields replaced by arbitrary values, deleted, or added."""
    d = dict(valid)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(("replace", "replace", "delete", "add")))
        if op == "add" or not d:
            d[draw(st.text(max_size=12))] = draw(VALUES)
        else:
            key = draw(st.sampled_from(sorted(d)))
            if op == "delete":
                del d[key]
            else:
                d[key] = draw(VALUES)
    return d


FINITE_NONNEG = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False)
WIRE_INT = st.integers(0, MAX_INT)


def short_text(n: int) -> st.SearchStrategy[str]:
    return st.text(max_size=n)


RECORDS = st.builds(
    PeerRecord,
    run_id=short_text(64), protocol_version=WIRE_INT, config_hash=short_text(64), software_version=short_text(32),
    peer_id=short_text(128), name=short_text(64), profile=short_text(64),
    addresses=st.lists(short_text(256), max_size=4).map(tuple), state=st.sampled_from(STATES),
    inner_step=WIRE_INT, tokens=WIRE_INT, tokens_per_s=FINITE_NONNEG, step_time_s=FINITE_NONNEG,
    fragment_versions=st.lists(WIRE_INT, max_size=4).map(tuple),
    anchor_hashes=st.lists(st.from_regex(r"[0-9a-f]{0,16}", fullmatch=True), max_size=4).map(tuple),
    consensus_distance=st.lists(FINITE_NONNEG, max_size=4).map(tuple), last_sync_time=FINITE_NONNEG,
    bytes_sent=WIRE_INT, bytes_received=WIRE_INT,
    loss=st.none() | st.floats(allow_nan=False, allow_infinity=False), time=FINITE_NONNEG,
    ttl_s=st.floats(min_value=0.0, exclude_min=True, allow_nan=False, allow_infinity=False),
)
VALID_RECORD = PeerRecord(run_id="run-a", protocol_version=1, config_hash="c" * 16, software_version="0.1.0",
                          peer_id="QmPeer", name="a", fragment_versions=(3, 4), anchor_hashes=("ab" * 8, "cd" * 8),
                          consensus_distance=(0.0, 0.1), loss=2.5, time=10.0)
VALID_META = RoundMeta(fragment=1, version=3, anchor="a" * 16, config="c" * 16, tokens=2560, steps=10, weight=2560.0,
                       due=100.0, norms=(0.5,))
METAS = st.builds(
    RoundMeta, fragment=WIRE_INT, version=WIRE_INT, anchor=short_text(64), config=short_text(64), tokens=WIRE_INT,
    steps=WIRE_INT, weight=st.floats(allow_nan=False, allow_infinity=False),
    due=st.floats(allow_nan=False, allow_infinity=False),
    norms=st.lists(st.floats(min_value=0.0, max_value=2.0**100, width=32, allow_nan=False, allow_infinity=False), max_size=4).map(tuple),
    link=st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
)


def decodes_or_refuses(decode: Any, *args: Any) -> Any:
    """``decode(*args)``; a refusal must be a PeerDataError with a reason code and a one-line message."""
    try:
        return decode(*args)
    except PeerDataError as e:
        assert isinstance(e.reason, Reason)
        assert "\n" not in str(e) and 0 < len(str(e)) <= 400, str(e)
        return e


# ---------------------------------------------------------------- peer records


@FUZZ
@given(value=VALUES | mutated(VALID_RECORD.to_wire()) | mutated(IndexEntry.of(VALID_RECORD).to_wire()))
def test_peer_records_and_index_entries_decode_or_refuse(value: Any) -> None:
    got = decodes_or_refuses(PeerRecord.from_wire, value)
    if isinstance(got, PeerRecord):
        assert PeerRecord.from_wire(got.to_wire()) == got
    got = decodes_or_refuses(IndexEntry.from_wire, value)
    if isinstance(got, IndexEntry):
        assert IndexEntry.from_wire(got.to_wire()) == got


@FEW
@given(record=RECORDS)
def test_peer_record_round_trips(record: PeerRecord) -> None:
    wire = record.to_wire()
    assert msgpack.unpackb(msgpack.packb(wire), raw=False) == wire  # msgpack-safe as stored
    assert PeerRecord.from_wire(wire) == record
    assert IndexEntry.from_wire(IndexEntry.of(record).to_wire()) == IndexEntry.of(record)


def test_record_refusals_carry_reason_codes() -> None:
    wire = VALID_RECORD.to_wire()
    cases = {
        Reason.OVERSIZE: [{**wire, "name": "x" * 65}, {**wire, "fragment_versions": [0] * 1025},
                          {**wire, "tokens": MAX_INT + 1}],
        Reason.NON_FINITE: [{**wire, "loss": math.nan}, {**wire, "time": math.inf},
                            {**wire, "consensus_distance": [0.0, math.nan]}],
        Reason.MALFORMED: [{1: 2}, [wire], {**wire, "extra": 1}, {**wire, "state": "dancing"},
                           {**wire, "inner_step": True}],
    }
    for reason, values in cases.items():
        for value in values:
            with pytest.raises(PeerDataError) as info:
                PeerRecord.from_wire(value)
            assert info.value.reason == reason, (value, info.value)


VALIDATORS = peer_schemas("run-a")
DHT_KEYS = {index: DHTID.generate(source=INDEX_KEYS[0] if index else run_keys("run-a")[0]).to_bytes()
            for index in (False, True)}


@FEW
@given(subkey=VALUES, value=VALUES | mutated(VALID_RECORD.to_wire()), index=st.booleans())
def test_dht_schema_validators_answer_a_bool(subkey: Any, value: Any, index: bool) -> None:
    """hivemind's SchemaValidator raises TypeError for a msgpack list/dict subkey; ours refuses it."""
    try:
        record = DHTRecord(DHT_KEYS[index], MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), 0.0)
    except (TypeError, ValueError, OverflowError):
        assume(False)  # not msgpack-able (e.g. an int beyond 64 bits): cannot reach a validator
    for validator in VALIDATORS:
        assert validator.validate(record) in (True, False)


def test_dht_schema_validators_accept_valid_records_and_refuse_list_subkeys() -> None:
    owner = MSGPackSerializer.dumps(b"[owner:ssh-rsa AAAA]")
    for index, value in ((False, VALID_RECORD.to_wire()), (True, IndexEntry.of(VALID_RECORD).to_wire())):
        good = DHTRecord(DHT_KEYS[index], owner, MSGPackSerializer.dumps(value), 0.0)
        assert all(v.validate(good) for v in VALIDATORS)
        odd = DHTRecord(DHT_KEYS[index], MSGPackSerializer.dumps([1, 2]), MSGPackSerializer.dumps(value), 0.0)
        assert not all(v.validate(odd) for v in VALIDATORS)  # (each validator lets keys of the other pass)


# ---------------------------------------------------------------- gathered metadata


@FUZZ
@given(value=VALUES | mutated(dict(zip(META_FIELDS, VALID_META.to_wire()))).map(lambda d: list(d.values())))
def test_round_meta_decodes_or_refuses(value: Any) -> None:
    got = decodes_or_refuses(RoundMeta.from_wire, value)
    if isinstance(got, RoundMeta):
        assert RoundMeta.from_wire(got.to_wire()) == got
        assert all(math.isfinite(x) for x in (got.weight, got.due, got.link, *got.norms)) and got.link >= 0


@FEW
@given(meta=METAS)
def test_round_meta_round_trips(meta: RoundMeta) -> None:
    wire = meta.to_wire()
    assert RoundMeta.from_wire(msgpack.unpackb(msgpack.packb(wire), raw=False)) == meta


def test_round_meta_reason_codes_and_the_member_is_named(caplog: pytest.LogCaptureFixture) -> None:
    wire = VALID_META.to_wire()

    def changed(**fields: object) -> list[object]:
        return [fields.get(name, v) for name, v in zip(META_FIELDS, wire)]

    for value, reason in ((changed(weight=math.nan), Reason.NON_FINITE),
                          (changed(version=-1), Reason.BAD_VERSION),
                          (changed(tokens=2**64), Reason.OVERSIZE), (changed(weight=10**400), Reason.OVERSIZE),
                          (changed(norms=bytes(4 * 70_000)), Reason.OVERSIZE),
                          (changed(norms=struct.pack("<f", math.nan)), Reason.NON_FINITE),
                          ([*wire, 2], Reason.MALFORMED), (changed(due=True), Reason.MALFORMED),
                          (changed(link=-5.0), Reason.MALFORMED), (changed(link=math.nan), Reason.NON_FINITE),
                          (dict(zip(META_FIELDS, wire)), Reason.MALFORMED)):
        with pytest.raises(PeerDataError) as info:
            RoundMeta.from_wire(value)
        assert info.value.reason == reason, (value, info.value)
    assert parse_gathered({"QmGood": wire}) == [VALID_META]
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.averaging"), pytest.raises(PeerDataError) as info:
        parse_gathered({"QmGood": wire, "QmBad": changed(due=math.inf)})
    assert str(info.value).startswith("QmBad: non-finite: ")
    assert "rejected gathered metadata from QmBad: non-finite: gathered due" in caplog.text


# ---------------------------------------------------------------- compressed tensor parts

SHAPE = (300,)
SLOT = {name: get_codec(name).compression_type for name in CODEC_NAMES}
DTYPES = st.sampled_from(("float32", "float16", "bfloat16", "float64", "int8", "int64", "complex64", "bool", "object",
                          "U99999999", "V1000000", "", "float32; rm -rf")) | st.text(max_size=12)


def _compressed(name: str, seed: int, shape: tuple[int, ...] = SHAPE) -> runtime_pb2.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return get_codec(name).compress(x, CompressionInfo.from_tensor(x))


@st.composite
def mutated_parts(draw: st.DrawFn) -> tuple[str, runtime_pb2.Tensor]:
    name = draw(st.sampled_from(CODEC_NAMES))
    message = _compressed(name, draw(st.integers(0, 3)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(("flip", "truncate", "extend", "size", "dtype", "slot", "header", "nan")))
        buffer = bytearray(message.buffer)
        if op == "flip" and buffer:
            i = draw(st.integers(0, len(buffer) - 1))
            buffer[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del buffer[draw(st.integers(0, len(buffer))):]
        elif op == "extend":
            buffer += draw(st.binary(min_size=1, max_size=64))
        elif op == "size":
            message.ClearField("size")
            message.size.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
        elif op == "dtype":
            message.dtype = draw(DTYPES)
        elif op == "slot":
            message.compression = draw(st.sampled_from(list(runtime_pb2.CompressionType.values())))
        elif op == "header" and len(buffer) >= 16:
            buffer[8:16] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))  # the quantizers' element count
        elif op == "nan" and len(buffer) >= 20:
            i = draw(st.integers(0, len(buffer) - 4))
            buffer[i:i + 4] = struct.pack("<f", draw(st.sampled_from((math.nan, math.inf, -math.inf))))
        message.buffer = bytes(buffer)
    return name, message


@st.composite
def arbitrary_parts(draw: st.DrawFn) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        compression=draw(st.sampled_from(list(runtime_pb2.CompressionType.values()))),
        size=draw(st.lists(st.integers(0, 2**32 - 1), max_size=4) | st.just(list(SHAPE))),
        dtype=draw(DTYPES), buffer=draw(st.binary(max_size=700)), requires_grad=draw(st.booleans()))


def _check_part(got: Any, shape: tuple[int, ...] = SHAPE) -> None:
    if isinstance(got, torch.Tensor):
        assert tuple(got.shape) == shape and got.dtype == torch.float32 and bool(torch.isfinite(got).all())


@FUZZ
@given(case=mutated_parts() | st.tuples(st.sampled_from(CODEC_NAMES), arbitrary_parts()))
def test_a_part_decodes_or_refuses(case: tuple[str, runtime_pb2.Tensor]) -> None:
    name, message = case
    _check_part(decodes_or_refuses(decode_part, message, SHAPE, torch.float32, SLOT[name]))
    if name in ("int8", "int4") and message.compression == SLOT[name]:  # the codec on its own
        got = decodes_or_refuses(get_codec(name).extract, message)
        if isinstance(got, torch.Tensor):
            assert got.numel() * 4 <= 2 * len(message.buffer) * 4 + 64  # sized by the buffer, not the header
            assert bool(torch.isfinite(got).all())


@FEW
@given(name=st.sampled_from(CODEC_NAMES), seed=st.integers(0, 2**16), numel=st.integers(0, 700),
       scale=st.sampled_from((1e-30, 1.0, 1e30)))
def test_valid_parts_round_trip(name: str, seed: int, numel: int, scale: float) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    message = get_codec(name).compress(x, CompressionInfo.from_tensor(x))
    got = decode_part(message, (numel,), torch.float32, SLOT[name])
    assert torch.equal(got, roundtrip(name, x))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_huge_declared_sizes_are_refused_before_allocating(name: str) -> None:
    """A tiny buffer that declares 2**28 elements (1 GiB of float32) or 10**12: refused at once, and the
    process's peak memory does not move -- whether the receiver expects that shape or not."""
    small = _compressed(name, 0, (4,))
    huge = (2**14, 2**14)
    lying = runtime_pb2.Tensor()
    lying.CopyFrom(small)
    lying.ClearField("size")
    lying.size.extend(huge)
    if name in ("int8", "int4"):  # make the header agree with the declared shape
        lying.buffer = small.buffer[:8] + struct.pack("<Q", 2**28) + small.buffer[16:]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for expected in (huge, (4,), (10**6, 10**6)):
        with pytest.raises(PeerDataError) as info:
            decode_part(lying, expected, torch.float32, SLOT[name])
        assert info.value.reason in (Reason.BAD_SHAPE, Reason.MALFORMED), info.value
    if name in ("int8", "int4"):
        with pytest.raises(PeerDataError, match="buffer has"):
            get_codec(name).extract(lying)
    hostile_fp16 = runtime_pb2.Tensor()
    hostile_fp16.CopyFrom(_compressed("fp16", 0, (4,)))
    hostile_fp16.dtype = "U99999999"  # hivemind's fp16 decoder would allocate 400 MB per element
    with pytest.raises(PeerDataError) as info:
        decode_part(hostile_fp16, (4,), torch.float32, SLOT["fp16"])
    assert info.value.reason == Reason.BAD_DTYPE
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib < 64 * 1024


def test_part_reason_codes() -> None:
    int8 = _compressed("int8", 1)
    nan_scale = runtime_pb2.Tensor()
    nan_scale.CopyFrom(int8)
    nan_scale.buffer = int8.buffer[:16] + struct.pack("<f", math.nan) + int8.buffer[20:]
    fp32 = _compressed("fp32", 1)
    nan_fp32 = runtime_pb2.Tensor()
    nan_fp32.CopyFrom(fp32)
    nan_fp32.buffer = struct.pack("<f", math.nan) + fp32.buffer[4:]
    longer = runtime_pb2.Tensor()
    longer.CopyFrom(fp32)
    longer.buffer = fp32.buffer + b"\0" * 4
    f16 = get_codec("int8").compress(torch.ones(4, dtype=torch.float16), CompressionInfo.from_tensor(torch.ones(4)))
    overflow = runtime_pb2.Tensor()
    overflow.CopyFrom(f16)
    overflow.buffer = f16.buffer[:16] + struct.pack("<f", 1e30) + f16.buffer[20:]  # finite scale, inf in float16
    cases = [
        (nan_scale, "int8", Reason.NON_FINITE), (nan_fp32, "fp32", Reason.NON_FINITE),
        (longer, "fp32", Reason.OVERSIZE), (int8, "int4", Reason.BAD_DTYPE), (fp32, "fp16", Reason.BAD_DTYPE),
    ]
    for message, slot, reason in cases:
        with pytest.raises(PeerDataError) as info:
            decode_part(message, SHAPE, torch.float32, SLOT[slot])
        assert info.value.reason == reason, (slot, info.value)
    with pytest.raises(PeerDataError) as info:
        get_codec("int8").extract(overflow)
    assert info.value.reason == Reason.NON_FINITE


# ---------------------------------------------------------------- the live reducer path


class _FakeP2P:
    def __init__(self, peer_id: PeerID) -> None:
        self.peer_id = peer_id


OURS, THEIRS = PeerID(b"\x00\x05peerA"), PeerID(b"\x00\x05peerB")


async def _reduce(codec: str, messages: list[averaging_pb2.AveragingData] | None,
                  mutate: Any = None) -> tuple[ExactAllReduceRunner, int]:
    """Run our reducer over a remote sender's parts (and our own), no network; returns (runner, parts answered)."""
    counters = (mp.Value(ctypes.c_longlong, 0), mp.Value(ctypes.c_longlong, 0))
    runner = ExactAllReduceRunner(
        p2p=_FakeP2P(OURS), servicer_type=ExactAllReduceRunner, prefix=None, group_id=b"g",
        tensors=[torch.randn(3000, generator=torch.Generator().manual_seed(0))], weight=1.0,
        ordered_peer_ids=[OURS, THEIRS], peer_fractions=(1.0, 0.0), counters=counters,
        compression=get_codec(codec), part_size_bytes=1024)
    if messages is None:
        gen = torch.Generator().manual_seed(1)
        parts = [torch.randn(s, generator=gen) for s in runner.tensor_part_reducer.part_shapes]
        messages = [averaging_pb2.AveragingData(
            tensor_part=get_codec(codec).compress(p, CompressionInfo.from_tensor(p)), weight=2.0) for p in parts]
    if mutate is not None:
        mutate(messages)

    async def stream() -> AsyncIterator[averaging_pb2.AveragingData]:
        for m in messages:
            yield m

    async def local() -> None:
        for i, part in enumerate(runner.parts_for_local_averaging):
            await runner.tensor_part_reducer.accumulate_part(0, i, part, weight=1.0)

    ours = asyncio.create_task(local())
    answered = 0
    async for _ in runner._accumulate_parts_streaming(stream(), 1):
        answered += 1
    await asyncio.wait_for(ours, 10)
    return runner, answered


def _set(index: int, **fields: Any) -> Any:
    def mutate(messages: list[averaging_pb2.AveragingData]) -> None:
        for key, value in fields.items():
            if key == "weight":
                messages[index].weight = value
            elif key == "size":
                messages[index].tensor_part.ClearField("size")
                messages[index].tensor_part.size.extend(value)
            else:
                setattr(messages[index].tensor_part, key, value)
    return mutate


REDUCER_CASES = {
    # a NaN scale is non-finite values only: left out, not banned (tests/integration/test_nan_member.py)
    "negative scale": ("int8", _set(1, buffer=b"P2DQ\x01\x08\x80\x00" + struct.pack("<Q", 512)
                                    + struct.pack("<4f", -1.0, 1.0, 1.0, 1.0) + b"\x01" * 512),
                       Reason.MALFORMED),
    "one element (would broadcast)": ("fp32", _set(2, size=[1], buffer=struct.pack("<f", 1e6)), Reason.BAD_SHAPE),
    "wrong dtype": ("fp16", _set(0, dtype="U99999999"), Reason.BAD_DTYPE),
    "another codec": ("int4", _set(0, compression=SLOT["fp32"]), Reason.BAD_DTYPE),
    "nan weight": ("fp32", _set(3, weight=math.nan), Reason.NON_FINITE),
    "an extra part": ("int8", lambda m: m.append(m[0]), Reason.OVERSIZE),
}


@pytest.mark.parametrize("case", sorted(REDUCER_CASES))
def test_the_reducer_bans_a_sender_whose_part_is_refused(case: str, caplog: pytest.LogCaptureFixture) -> None:
    codec, mutate, reason = REDUCER_CASES[case]
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.averaging"):
        runner, _ = asyncio.run(_reduce(codec, None, mutate))
    assert THEIRS in runner.banned_senders
    assert "dropped mid-round" in (runner.completeness_problem() or "")
    assert f"rejected a tensor part from {THEIRS}: {reason.value}: " in caplog.text, caplog.text


def test_a_sender_whose_every_part_is_in_is_not_banned_when_its_stream_ends_badly() -> None:
    """Its stream may end with a cancellation once it closes it after our last answer (hivemind's handler then bans
    on any exception): every part is counted, so the round stays complete; a sender short of a part is banned."""
    async def ban_while_cancelled(runner: ExactAllReduceRunner) -> None:
        async def handler() -> None:  # as hivemind's: the sender's close cancels it, it bans in its except clause
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                await runner._ban_sender(THEIRS)
                raise
        task = asyncio.create_task(handler())
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    runner, answered = asyncio.run(_reduce("int8", None))
    asyncio.run(ban_while_cancelled(runner))
    assert answered == runner.tensor_part_reducer.num_parts
    assert THEIRS not in runner.banned_senders and runner.completeness_problem() is None
    short, _ = asyncio.run(_reduce("int8", None, lambda m: m.pop()))  # its last part never came
    asyncio.run(ban_while_cancelled(short))
    assert THEIRS in short.banned_senders and "dropped mid-round" in (short.completeness_problem() or "")
    asyncio.run(runner._ban_sender(THEIRS))  # not while cancelled (a refused part: one too many): it stands
    assert THEIRS in runner.banned_senders


def test_the_reducer_accepts_valid_parts() -> None:
    for codec in CODEC_NAMES:
        runner, answered = asyncio.run(_reduce(codec, None))
        assert answered == runner.tensor_part_reducer.num_parts and runner.completeness_problem() is None


@FEW
@given(case=mutated_parts(), index=st.integers(0, 5))
def test_the_reducer_survives_any_part(case: tuple[str, runtime_pb2.Tensor], index: int) -> None:
    name, message = case

    def mutate(messages: list[averaging_pb2.AveragingData]) -> None:
        messages[index % len(messages)].tensor_part.CopyFrom(message)

    runner, answered = asyncio.run(_reduce(name, None, mutate))
    if THEIRS not in runner.banned_senders:  # the mutation left a valid part of that shape: all answered
        assert answered == runner.tensor_part_reducer.num_parts


def test_an_allreduce_cut_at_its_timeout_names_the_reducers_it_waited_on() -> None:
    """hivemind cancels an all-reduce at its timeout, and its runner sets the cancellation on a future nobody awaits
    ("Future exception was never retrieved" on stderr); the reason then said nothing ("Unable to run All-Reduce: ").
    Cut with our reducer's averages in and the other's missing: that reducer is named, the future's error read."""
    async def cut() -> tuple[str, ExactAllReduceRunner]:
        counters = (mp.Value(ctypes.c_longlong, 0), mp.Value(ctypes.c_longlong, 0))
        runner = ExactAllReduceRunner(
            p2p=_FakeP2P(OURS), servicer_type=ExactAllReduceRunner, prefix=None, group_id=b"g",
            tensors=[torch.zeros(3000)], weight=1.0, ordered_peer_ids=[OURS, THEIRS], peer_fractions=(0.5, 0.5),
            counters=counters, part_size_bytes=1024)
        container = runner.tensor_part_container
        for i in range(container.num_parts_by_peer[0]):  # our own reducer answered every part
            container.register_processed_part(0, i, torch.zeros(1))
        runner.finalize(exception=asyncio.CancelledError())  # what its run() does when the cancellation comes
        return runner.cut_short(12.0), runner

    problem, runner = asyncio.run(cut())
    assert problem == "partial all-reduce: not over within its timeout of 12.0 s, averages missing from 1 of 2 reducers"
    assert not runner._future._log_traceback  # type: ignore[attr-defined]  # read: asyncio will not log it


# ---------------------------------------------------------------- state downloads

NAMES = ("a", "b")
SHAPES = {"a": torch.Size([3, 4]), "b": torch.Size([5])}


def _state(version: int = 7, seed: int = 0, momentum: bool = True) -> tuple[dict[str, Any], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    anchor = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    moments = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} if momentum else {}
    return state_payload(1, version, anchor, moments, NAMES)


TENSORS = st.lists(
    st.builds(lambda shape, dtype, fill: torch.full(shape, fill).to(dtype),
              st.sampled_from(((3, 4), (5,), (4, 3), (), (0,))),
              st.sampled_from((torch.float32, torch.float64, torch.float16, torch.int32)),
              st.sampled_from((0.5, math.nan, math.inf, 1e30))),
    max_size=5)
OURS_STATE = st.tuples(st.integers(0, 9), st.sampled_from(("", "0" * 16, "f" * 16)))


@FUZZ
@given(metadata=VALUES | mutated(_state()[0]), tensors=TENSORS | st.just(_state()[1]), ours=OURS_STATE)
def test_a_state_payload_parses_or_refuses(metadata: Any, tensors: list[torch.Tensor], ours: tuple[int, str]) -> None:
    got = decodes_or_refuses(parse_state, metadata, tensors, 1, NAMES, SHAPES, ours)
    if isinstance(got, FetchedState):
        assert got.anchor_hash == anchor_hash(got.anchor) and got.version >= ours[0]
        assert all(bool(torch.isfinite(t).all()) for t in (*got.anchor.values(), *got.momentum.values()))


@FEW
@given(version=st.integers(1, MAX_INT), seed=st.integers(0, 100), momentum=st.booleans())
def test_a_state_payload_round_trips(version: int, seed: int, momentum: bool) -> None:
    metadata, tensors = _state(version, seed, momentum)
    metadata = decode_state_metadata(MSGPackSerializer.dumps(metadata))  # as a donor sends it
    got = parse_state(metadata, tensors, 1, NAMES, SHAPES, (0, ""))
    assert got is not None and got.version == version
    assert all(torch.equal(got.anchor[n], tensors[i]) for i, n in enumerate(NAMES))
    assert (got.momentum != {}) == momentum


@FUZZ
@given(blob=st.binary(max_size=200) | VALUES.map(lambda v: msgpack.packb(v, default=repr))
       | st.binary(min_size=1, max_size=8).map(lambda b: msgpack.packb(msgpack.ExtType(0x40, b))))
def test_state_metadata_decodes_or_refuses(blob: bytes) -> None:
    got = decodes_or_refuses(decode_state_metadata, blob)
    if not isinstance(got, PeerDataError):
        assert repr(msgpack.unpackb(blob, raw=False)) == repr(got)  # (repr: NaN != NaN)


def test_state_reason_codes() -> None:
    metadata, tensors = _state()
    cases = [
        ({**metadata, "version": -1}, tensors, Reason.BAD_VERSION),
        ({**metadata, "version": True}, tensors, Reason.BAD_VERSION),
        ({**metadata, "anchor": "0" * 16}, tensors, Reason.BAD_HASH),
        (metadata, [tensors[0].double(), *tensors[1:]], Reason.BAD_DTYPE),
        (metadata, [tensors[0].T.contiguous(), *tensors[1:]], Reason.BAD_SHAPE),
        (metadata, [*tensors[:3], tensors[3] * math.nan], Reason.NON_FINITE),
        (metadata, [*tensors, tensors[0]], Reason.OVERSIZE),
        ({**metadata, "extra": 1}, tensors, Reason.MALFORMED),
    ]
    for meta, ts, reason in cases:
        with pytest.raises(PeerDataError) as info:
            parse_state(meta, ts, 1, NAMES, SHAPES, (0, ""))
        assert info.value.reason == reason, (meta, info.value)
    with pytest.raises(PeerDataError) as info:
        decode_state_metadata(b"\x90" * (MAX_STATE_METADATA_BYTES + 1))
    assert info.value.reason == Reason.OVERSIZE


class _FakeDonor:
    """Enough of a FragmentAveragerProcess for :meth:`FragmentAveragerProcess._download_from` to stream from a message list."""

    prefix, fragment, next_chunk_timeout, _p2p = "frag", 1, 5.0, None
    state_compression = NoCompression()
    _donor_parts = FragmentAveragerProcess._donor_parts

    def __init__(self, messages: list[averaging_pb2.DownloadData]) -> None:
        self.messages = messages

    def get_stub(self, _p2p: Any, _peer: Any, namespace: str) -> _FakeDonor:
        return self

    async def rpc_download_state(self, _request: Any) -> AsyncIterator[averaging_pb2.DownloadData]:
        async def stream() -> AsyncIterator[averaging_pb2.DownloadData]:
            for m in self.messages:
                yield m
        return stream()


def _donor_stream(seed: int = 0) -> list[averaging_pb2.DownloadData]:
    """What hivemind's rpc_download_state sends for our state: metadata with the first chunk, 16-byte chunks."""
    metadata, tensors = _state(seed=seed)
    messages, blob = [], MSGPackSerializer.dumps(metadata)
    for t in tensors:
        for part in split_for_streaming(NoCompression().compress(t, CompressionInfo.from_tensor(t)), 16):
            messages.append(averaging_pb2.DownloadData(tensor_part=part, metadata=blob))
            blob = b""
    return messages


def _download(messages: list[averaging_pb2.DownloadData], cap: int = 1 << 16) -> Any:
    expected = [SHAPES[n] for n in NAMES] * 2
    fake: Any = _FakeDonor(messages)
    counted = [0]
    result = asyncio.run(FragmentAveragerProcess._download_from(fake, "donor", cap, expected, 5.0, counted))
    assert counted[0] == sum(len(m.metadata) + m.tensor_part.ByteSize() for m in messages)
    return result


@st.composite
def mutated_streams(draw: st.DrawFn) -> list[averaging_pb2.DownloadData]:
    messages = _donor_stream(draw(st.integers(0, 3)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(("drop", "duplicate", "metadata", "part", "append")))
        i = draw(st.integers(0, len(messages) - 1)) if messages else 0
        if op == "drop" and messages:
            del messages[i]
        elif op == "duplicate" and messages:
            messages.insert(i, messages[i])
        elif op == "metadata" and messages:
            blob = draw(st.binary(max_size=64) | VALUES.map(lambda v: msgpack.packb(v, default=repr)))
            messages[i] = averaging_pb2.DownloadData(tensor_part=messages[i].tensor_part, metadata=blob)
        elif op == "part" and messages:
            messages[i] = averaging_pb2.DownloadData(tensor_part=draw(arbitrary_parts()), metadata=messages[i].metadata)
        else:
            messages.append(averaging_pb2.DownloadData(tensor_part=draw(arbitrary_parts())))
    return messages


@FUZZ
@given(messages=mutated_streams(), cap=st.sampled_from((1 << 16, 300)))
def test_a_state_download_stream_decodes_or_refuses(messages: list[averaging_pb2.DownloadData], cap: int) -> None:
    got = decodes_or_refuses(_download, messages, cap)
    if not isinstance(got, PeerDataError):
        metadata, tensors = got
        assert len(tensors) <= 2 * len(NAMES)
        for t, shape in zip(tensors, [SHAPES[n] for n in NAMES] * 2):
            assert t.shape == shape and t.dtype == torch.float32 and bool(torch.isfinite(t).all())
        decodes_or_refuses(parse_state, metadata, tensors, 1, NAMES, SHAPES, (0, ""))


def test_a_state_download_stream_round_trips_and_lies_are_refused() -> None:
    metadata, tensors = _download(_donor_stream())
    got = parse_state(metadata, tensors, 1, NAMES, SHAPES, (0, ""))
    assert got is not None and all(torch.equal(got.anchor[n], _state()[1][i]) for i, n in enumerate(NAMES))
    with pytest.raises(PeerDataError) as info:
        _download(_donor_stream(), cap=200)
    assert info.value.reason == Reason.OVERSIZE
    whole = _donor_stream()
    first_tensor = next(i for i, m in enumerate(whole) if i and m.tensor_part.dtype)  # where the second tensor starts
    for cut, says in ((1, "ended inside tensor 1 of"), (first_tensor, "ended after 1 of")):  # a donor cut off
        with pytest.raises(PeerDataError) as info:
            _download(whole[:cut])
        assert info.value.reason == Reason.TRUNCATED and says in str(info.value), info.value
    lying = _donor_stream()
    lying[0].tensor_part.ClearField("size")
    lying[0].tensor_part.size.extend([10**6, 10**6])  # declares 4 TB; sends 48 bytes
    with pytest.raises(PeerDataError) as info:
        _download(lying)
    assert info.value.reason == Reason.BAD_SHAPE


# ---------------------------------------------------------------- replayed rounds

STEPPED_VALID = pack_exact(local_roundtrip("int4", torch.randn(300, generator=torch.Generator().manual_seed(5))))


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(STEPPED_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.integers(0, 3))
def test_a_replayed_tensor_unpacks_or_refuses(flips: list[tuple[int, int]], cut: int) -> None:
    """A kept round's packed tensor (stepped, as an int4 round packs) with bytes replaced or cut: the same count of
    float32 values back, or a refusal with a reason code; never another exception."""
    data = bytearray(STEPPED_VALID)
    for at, byte in flips:
        data[at] = byte
    got = decodes_or_refuses(unpack_exact, bytes(data[:len(data) - cut]), (300,))
    assert isinstance(got, PeerDataError) or (got.dtype == torch.float32 and got.shape == (300,))
