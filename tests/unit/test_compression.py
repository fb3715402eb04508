"""Pure tests of the pseudo-gradient codecs (no network): golden values, bounds, sizes, edge cases."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import warnings

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartContainer
from hivemind.compression import (
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.core.codecs import (
    BLOCK_SIZE, CODEC_NAMES, ErrorFeedback, allreduce_error_bound, bits_per_element, error_bound, local_roundtrip,
)
from p2p_diloco.hivemind_ext.compression import (
    MIN_PART_BYTES, PARTS_PER_SPAN, BlockwiseAbsmaxQuantization, get_codec, link_part_bytes, pipelined_part_bytes,
    roundtrip,
    simulate_allreduce, simulate_allreduce_per_peer,
)

QUANTIZERS = ("int8", "int4")
CHILD_TIMEOUT_S = 120.0  # a fresh interpreter importing torch on a busy machine
HIVEMIND_FRAMING_BYTES = 9  # hivemind's P2P.send_protobuf: 8-byte length + 1-byte marker per message


def compress(name: str, tensor: torch.Tensor) -> runtime_pb2.Tensor:
    return get_codec(name).compress(tensor, CompressionInfo.from_tensor(tensor))


# --- golden values ------------------------------------------------------------------------------
def test_int8_golden_buffer_and_values() -> None:
    x = torch.tensor([1.0, -0.5, 0.25, 0.0])
    # scale = fl32(1/127) = 0x3c010204; codes round(x*127) = 127, -64 (-63.5 ties to even), 32, 0
    expected = bytes.fromhex("50324451" "01" "08" "8000" "0400000000000000" "0402013c" "7fc02000")
    assert compress("int8", x).buffer == expected
    scale = np.float32(1) / np.float32(127)
    expected_values = torch.tensor([127, -64, 32, 0], dtype=torch.float32) * torch.tensor(scale)
    assert torch.equal(roundtrip("int8", x), expected_values)


def test_int4_golden_buffer_and_values() -> None:
    x = torch.tensor([1.0, -0.5, 0.25, 0.1])
    # scale = fl32(1/7) = 0x3e124925 (rounded up, so -0.5/scale = -3.4999998 -> -3);
    # codes 7, -3, 2, 1 -> nibbles 15, 5, 10, 9 -> bytes 0x5f, 0x9a (element 2k in the low nibble)
    expected = bytes.fromhex("50324451" "01" "04" "8000" "0400000000000000" "2549123e" "5f9a")
    assert compress("int4", x).buffer == expected
    scale = np.float32(1) / np.float32(7)
    expected_values = torch.tensor([7, -3, 2, 1], dtype=torch.float32) * torch.tensor(scale)
    assert torch.equal(roundtrip("int4", x), expected_values)


def test_int4_two_blocks_have_their_own_scales() -> None:
    x = torch.arange(BLOCK_SIZE + 2, dtype=torch.float32)  # block 0: 0..127, block 1: 128, 129
    y = roundtrip("int4", x)
    assert y[BLOCK_SIZE - 3 :].tolist() == pytest.approx([127.0, 127.0, 127.0, 129.0, 129.0])
    assert y[0].item() == 0.0
    scales = np.frombuffer(compress("int4", x).buffer, dtype="<f4", count=2, offset=16)
    assert scales.tolist() == pytest.approx([127 / 7, 129 / 7])


def test_fp_codecs_are_hivemind_own() -> None:
    assert isinstance(get_codec("fp32"), NoCompression)
    assert isinstance(get_codec("fp16"), Float16Compression)
    x = torch.tensor([1.0, 1.0 + 2.0**-12, -3.0])
    assert torch.equal(roundtrip("fp32", x), x)
    assert roundtrip("fp16", x).tolist() == [1.0, 1.0, -3.0]


# --- registration in hivemind ------------------------------------------------------------------
def test_quantizers_registered_in_hivemind_slots() -> None:
    assert _BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] is get_codec("int8")
    assert _BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] is get_codec("int4")
    assert _BASE_COMPRESSION_TYPES["NONE"] is get_codec("fp32")
    assert _BASE_COMPRESSION_TYPES["FLOAT16"] is get_codec("fp16")
    x = torch.randn(300)
    for name in QUANTIZERS:  # hivemind's own deserializer finds our codec by the message's slot
        assert torch.equal(deserialize_torch_tensor(compress(name, x)), roundtrip(name, x))


@pytest.mark.parametrize("codec_class", [Uniform8BitQuantization, Quantile8BitQuantization])
def test_hivemind_8bit_codecs_still_broken_under_numpy2(codec_class: type) -> None:
    """Pins why we wrote our own: if this starts failing, hivemind (or NumPy) fixed the trap."""
    x = torch.randn(1000)
    codec = codec_class()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantize_per_tensor, which Uniform8Bit uses
        message = codec.compress(x, CompressionInfo.from_tensor(x))
    with pytest.raises(TypeError, match="0-dimensional"):
        codec.extract(message)


def test_unknown_codec_name_is_one_clear_line() -> None:
    with pytest.raises(ValueError) as info:
        get_codec("int3")
    message = str(info.value)
    assert "\n" not in message and "int3" in message and "int4" in message
    with pytest.raises(ValueError):
        bits_per_element("bf16")
    with pytest.raises(ValueError):
        ErrorFeedback("fp8")


# --- sizes --------------------------------------------------------------------------------------
def test_bits_per_element() -> None:
    assert bits_per_element("fp32") == 32.0
    assert bits_per_element("fp16") == 16.0
    assert bits_per_element("int8") == 8.25
    assert bits_per_element("int4") == 4.25
    assert bits_per_element("int4", block_size=64) == 4.5
    with pytest.raises(ValueError):
        bits_per_element("fp16", block_size=64)
    with pytest.raises(ValueError):
        bits_per_element("int8", block_size=0)


@pytest.mark.parametrize("numel", [0, 1, 2, 127, 128, 129, 1001])
def test_buffer_size_is_exact(numel: int) -> None:
    for name, bits in (("int8", 8), ("int4", 4)):
        codec = get_codec(name)
        assert isinstance(codec, BlockwiseAbsmaxQuantization)
        buffer = compress(name, torch.randn(numel)).buffer
        payload = numel if bits == 8 else (numel + 1) // 2
        assert len(buffer) == codec.buffer_bytes(numel) == 16 + 4 * math.ceil(numel / BLOCK_SIZE) + payload


def _wire_bytes_of_one_sender(name: str, tensor: torch.Tensor, part_size_bytes: int) -> int:
    """Bytes hivemind writes to send ``tensor`` to one reducer: split as hivemind splits it, each part a
    full ``AveragingData`` message (protobuf framing, weight, group id on the first) plus hivemind's
    9-byte stream framing."""
    codec = get_codec(name)
    container = TensorPartContainer([tensor], (1.0,), compression=codec, part_size_bytes=part_size_bytes)
    total = 0
    for index, part in enumerate(container.get_raw_input_parts(0)):
        serialized = codec.compress(part, CompressionInfo.from_tensor(part))
        message = averaging_pb2.AveragingData(tensor_part=serialized, weight=1.5)
        if index == 0:
            message.code, message.group_id = averaging_pb2.PART_FOR_AVERAGING, b"g" * 32
        total += message.ByteSize() + HIVEMIND_FRAMING_BYTES
    container.finalize()
    return total


@pytest.mark.parametrize("part_size_bytes", [2**12, 2**16, DEFAULT_PART_SIZE_BYTES])
def test_wire_bytes_ratio_including_framing(part_size_bytes: int) -> None:
    tensor = torch.randn(2**18 + 12345, generator=torch.Generator().manual_seed(7))
    fp32 = _wire_bytes_of_one_sender("fp32", tensor, part_size_bytes)
    ratios = {name: _wire_bytes_of_one_sender(name, tensor, part_size_bytes) / fp32 for name in CODEC_NAMES}
    assert ratios["fp16"] == pytest.approx(0.5, abs=2e-3)
    assert ratios["int8"] <= 0.27
    assert ratios["int4"] <= 0.14
    assert ratios["int4"] >= 4.25 / 32  # sanity: framing cannot make it smaller than the payload


def test_hivemind_parts_start_on_the_block_grid() -> None:
    """estimate_compression_ratio makes hivemind's parts multiples of BLOCK_SIZE, so compressing the
    parts one by one (the network) equals compressing the whole tensor (local roundtrip)."""
    tensor = torch.randn(3 * 2**13 + 77) * torch.linspace(0.01, 10, 3 * 2**13 + 77)
    for name in QUANTIZERS:
        codec = get_codec(name)
        container = TensorPartContainer([tensor], (1.0, 1.0), compression=codec, part_size_bytes=2**13)
        parts = container.get_raw_input_parts(0) + container.get_raw_input_parts(1)
        container.finalize()
        assert len(parts) > 2
        assert all(len(part) % BLOCK_SIZE == 0 for part in parts[:-1])
        assert all(codec.buffer_bytes(len(part)) <= 2**13 for part in parts)
        by_part = torch.cat([deserialize_torch_tensor(compress(name, part)) for part in parts])
        assert torch.equal(by_part, roundtrip(name, tensor))


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("group_size", [2, 4, 7])
def test_pipelined_parts_split_each_span_in_a_few_parts_on_the_block_grid(name: str, group_size: int) -> None:
    """A demo-sized fragment (several tensors, 210k values): every member's span is cut in PARTS_PER_SPAN to twice
    that many parts (one part each with hivemind's 512 kB), each part on the block grid, so compressing part by
    part still equals compressing the whole tensor (a part off the grid would quantize other blocks)."""
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (128 * 512, 512 * 128, 65_536, 12_288)]
    codec = get_codec(name)
    size = pipelined_part_bytes(tensors, codec, group_size)
    assert size & (size - 1) == 0 and MIN_PART_BYTES <= size < DEFAULT_PART_SIZE_BYTES
    container = TensorPartContainer(tensors, [1.0] * group_size, compression=codec, part_size_bytes=size)
    spans = [container.get_raw_input_parts(j) for j in range(group_size)]
    container.finalize()
    assert all(PARTS_PER_SPAN - 1 <= len(parts) <= 2 * PARTS_PER_SPAN + len(tensors) for parts in spans), \
        [len(parts) for parts in spans]
    by_part = torch.cat([deserialize_torch_tensor(compress(name, part)) for parts in spans for part in parts])
    assert torch.equal(by_part, torch.cat([roundtrip(name, t) for t in tensors]))


def test_pipelined_parts_are_bounded() -> None:
    """A large fragment keeps hivemind's 512 kB parts (a part is a message); a tiny one gets the smallest part."""
    codec = get_codec("int4")
    assert pipelined_part_bytes([torch.zeros(50_000_000)], codec, 4) == DEFAULT_PART_SIZE_BYTES
    assert pipelined_part_bytes([torch.zeros(1000)], codec, 4) == MIN_PART_BYTES
    assert pipelined_part_bytes([torch.zeros(1000)], codec, 0) == MIN_PART_BYTES  # no group: no division by zero
    # the same on every member: a function of the shapes, the codec and the group alone
    assert pipelined_part_bytes([torch.zeros(210_000)], codec, 4) == pipelined_part_bytes([torch.ones(210_000)], codec, 4)


@pytest.mark.parametrize("group_size", [2, 4])
def test_parts_from_the_link_are_pipelined_on_slow_links_and_hivemind_s_on_fast_ones(group_size: int) -> None:
    """The slowest member's measured link sets a floor on a part (a tenth of a second on it): unknown (0) or slow,
    the pipelined parts; a few hundred kB/s (loopback, CPU-bound), a span in a part or two (hivemind's 512 kB caps
    it); in between, a power of two that grows with the link."""
    codec = get_codec("int4")
    demo = [torch.zeros(n) for n in (128 * 512, 512 * 128, 65_536, 12_288)]
    pipelined = pipelined_part_bytes(demo, codec, group_size)
    assert link_part_bytes(demo, codec, group_size, 0.0) == pipelined  # a member has not measured its link
    assert link_part_bytes(demo, codec, group_size, math.nan) == pipelined
    assert link_part_bytes(demo, codec, group_size, 31_250.0) == pipelined  # 0.25 Mbit/s
    sizes = [link_part_bytes(demo, codec, group_size, bps) for bps in (62_500, 250_000, 800_000, 1e8, 1e12)]
    assert sizes == sorted(sizes) and all(s & (s - 1) == 0 for s in sizes) and sizes[-1] == DEFAULT_PART_SIZE_BYTES
    assert link_part_bytes(demo, codec, group_size, 250_000.0) == 16_384  # 2 Mbit/s: 25 kB in a tenth of a second
    loopback = link_part_bytes(demo, codec, group_size, 800_000.0)
    container = TensorPartContainer(demo, [1.0] * group_size, compression=codec, part_size_bytes=loopback)
    assert all(len(container.get_raw_input_parts(j)) <= len(demo) for j in range(group_size))  # a part a tensor


# --- error bound --------------------------------------------------------------------------------
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@st.composite
def finite_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype_name = draw(st.sampled_from(sorted(_DTYPES)))
    width = 16 if dtype_name == "float16" else 32
    values = draw(
        hnp.arrays(
            np.float32,
            st.integers(0, 3 * BLOCK_SIZE + 5),
            elements=st.floats(allow_nan=False, allow_infinity=False, width=width),
        )
    )
    scale = draw(st.sampled_from([1.0, 1e-30, 1e30])) if dtype_name != "float16" else 1.0
    tensor = torch.from_numpy(values) * scale
    return tensor.to(_DTYPES[dtype_name])


@settings(max_examples=80, deadline=None)
@given(tensor=finite_tensors(), name=st.sampled_from(CODEC_NAMES))
def test_roundtrip_error_within_stated_bound(tensor: torch.Tensor, name: str) -> None:
    if name == "fp16" and tensor.dtype == torch.bfloat16:
        return  # hivemind's Float16Compression refuses bf16 (pinned below)
    if not bool(torch.isfinite(tensor).all()):
        return  # scaling by 1e30 overflowed to inf: covered by the non-finite tests
    decoded = roundtrip(name, tensor)
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    assert bool(torch.isfinite(decoded).all())
    error = (decoded.double() - tensor.double()).abs()
    assert bool((error <= error_bound(name, tensor)).all())


def test_error_bound_formula_int4() -> None:
    x = torch.tensor([7.0, -1.0, 0.5] + [0.0] * (BLOCK_SIZE - 3) + [0.0, 0.0])  # second block all zero
    bound = error_bound("int4", x)
    assert bound[0].item() == pytest.approx(7.0 * (0.5 / 7 + 2**-20 + 2**-24), rel=1e-12, abs=1e-30)
    assert bool((bound[:BLOCK_SIZE] == bound[0]).all())
    assert bound[BLOCK_SIZE:].max().item() < 1e-36  # zero block: only the subnormal slack


def test_bound_is_tight_enough_to_mean_something() -> None:
    """The int4 bound is about half a quantization step: a random tensor comes close to it."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    ratio = (roundtrip("int4", x) - x).abs().double() / error_bound("int4", x)
    assert 0.9 < ratio.max().item() <= 1.0


# --- edge cases ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("shape", [(0,), (0, 3), (), (1,), (3,), (2, 65), (129,)])
def test_zero_empty_and_odd_shapes(name: str, shape: tuple[int, ...]) -> None:
    zeros = torch.zeros(shape)
    decoded = roundtrip(name, zeros)
    assert decoded.shape == zeros.shape and torch.equal(decoded, zeros)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    decoded = roundtrip(name, values)
    assert decoded.shape == values.shape
    assert bool(((decoded - values).abs().double() <= error_bound(name, values)).all())


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_keep_their_dtype(name: str, dtype: torch.dtype) -> None:
    x = (torch.randn(301, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    decoded = roundtrip(name, x)
    assert decoded.dtype == dtype
    assert bool(((decoded.double() - x.double()).abs() <= error_bound(name, x)).all())


def test_fp16_codec_refuses_bf16_like_hivemind() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        roundtrip("fp16", torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        local_roundtrip("fp16", torch.ones(4, dtype=torch.bfloat16))


# --- the maths without hivemind -----------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(tensor=finite_tensors(), name=st.sampled_from(CODEC_NAMES))
def test_local_roundtrip_is_bitwise_what_hivemind_decodes(tensor: torch.Tensor, name: str) -> None:
    """core.codecs.local_roundtrip (used by ErrorFeedback, no hivemind) == compress + hivemind's decoder."""
    if name == "fp16" and tensor.dtype == torch.bfloat16:
        return  # both refuse it (pinned above)
    if not bool(torch.isfinite(tensor).all()) and name in QUANTIZERS:
        return  # both refuse it (test_non_finite_input_is_refused)
    local, network = local_roundtrip(name, tensor), roundtrip(name, tensor)
    assert local.dtype == network.dtype and local.shape == network.shape
    as_int = torch.int32 if local.dtype == torch.float32 else torch.int16
    assert torch.equal(local.contiguous().view(as_int), network.contiguous().view(as_int))  # bit for bit


def test_the_codec_maths_import_no_hivemind() -> None:
    code = ("import sys; import p2p_diloco.core.codecs as c, torch; "
            "x = torch.randn(300); c.ErrorFeedback('int4').encode('w', x); c.local_roundtrip('fp16', x); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hivemind'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_input_is_refused(name: str, bad: float, dtype: torch.dtype) -> None:
    x = torch.ones(200, dtype=dtype)
    x[150] = bad
    with pytest.raises(ValueError, match="non-finite"):
        compress(name, x)
    with pytest.raises(ValueError, match="non-finite"):
        error_bound(name, x)


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("tensor", [torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.int32)])
def test_unsupported_dtypes_are_refused(name: str, tensor: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="supports float32/float16/bfloat16"):
        compress(name, tensor)


def test_huge_values_do_not_overflow() -> None:
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([fmax, -fmax, fmax / 3, 1.0])
    for name in QUANTIZERS:
        decoded = roundtrip(name, x)
        assert bool(torch.isfinite(decoded).all())
        assert bool(((decoded.double() - x.double()).abs() <= error_bound(name, x)).all())


# --- malformed buffers --------------------------------------------------------------------------
def _mutated(name: str, mutate: object) -> runtime_pb2.Tensor:
    message = compress(name, torch.randn(300, generator=torch.Generator().manual_seed(4)))
    mutate(message)  # type: ignore[operator]
    return message


def _set_buffer(message: runtime_pb2.Tensor, buffer: bytes) -> None:
    message.buffer = buffer


def _patch_header(message: runtime_pb2.Tensor, **fields: int | bytes) -> None:
    magic, version, bits, block, numel = struct.unpack_from("<4sBBHQ", message.buffer)
    values = dict(magic=magic, version=version, bits=bits, block=block, numel=numel) | fields
    header = struct.pack("<4sBBHQ", *values.values())
    message.buffer = header + message.buffer[16:]


def _patch_bytes(message: runtime_pb2.Tensor, offset: int, value: bytes) -> None:
    buffer = bytearray(message.buffer)
    buffer[offset : offset + len(value)] = value
    message.buffer = bytes(buffer)


MALFORMED = {
    "empty": lambda m: _set_buffer(m, b""),
    "short header": lambda m: _set_buffer(m, m.buffer[:10]),
    "bad magic": lambda m: _patch_header(m, magic=b"XXXX"),
    "bad version": lambda m: _patch_header(m, version=9),
    "block size 0": lambda m: _patch_header(m, block=0),
    "numel vs shape": lambda m: _patch_header(m, numel=301),
    "huge numel": lambda m: _patch_header(m, numel=2**60),
    "shape vs numel": lambda m: m.size.__setitem__(0, 299),
    "truncated": lambda m: _set_buffer(m, m.buffer[:-1]),
    "trailing byte": lambda m: _set_buffer(m, m.buffer + b"\x00"),
    "nan scale": lambda m: _patch_bytes(m, 16, struct.pack("<f", float("nan"))),
    "inf scale": lambda m: _patch_bytes(m, 20, struct.pack("<f", float("inf"))),
    "negative scale": lambda m: _patch_bytes(m, 16, struct.pack("<f", -1.0)),
    "dtype": lambda m: setattr(m, "dtype", "float64"),
    "dtype garbage": lambda m: setattr(m, "dtype", "int8; rm -rf"),
}


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_buffers_raise_value_error(name: str, case: str) -> None:
    message = _mutated(name, MALFORMED[case])
    with pytest.raises(ValueError):
        get_codec(name).extract(message)
    with pytest.raises(ValueError):
        deserialize_torch_tensor(message)  # the path hivemind takes


def test_out_of_range_codes_raise_value_error() -> None:
    int8 = _mutated("int8", lambda m: _patch_bytes(m, 16 + 4 * 3, b"\x80"))  # code -128
    with pytest.raises(ValueError, match="-128"):
        get_codec("int8").extract(int8)
    int4 = _mutated("int4", lambda m: _patch_bytes(m, 16 + 4 * 3 + 5, b"\x80"))  # low nibble 0
    with pytest.raises(ValueError, match="nibble"):
        get_codec("int4").extract(int4)


def test_slots_do_not_cross_decode() -> None:
    """An int8 buffer arriving in the int4 slot (or a foreign codec's buffer) is refused, not misread."""
    message = compress("int8", torch.randn(10))
    with pytest.raises(ValueError, match="8 bits"):
        get_codec("int4").extract(message)
    foreign = NoCompression().compress(torch.randn(10), CompressionInfo.from_tensor(torch.randn(10)))
    with pytest.raises(ValueError, match="magic"):
        get_codec("int4").extract(foreign)


# --- error feedback -----------------------------------------------------------------------------
def test_error_feedback_running_sum_tracks_inputs() -> None:
    generator = torch.Generator().manual_seed(5)
    feedback = ErrorFeedback("int4")
    sum_inputs = torch.zeros(1000, dtype=torch.float64)
    sum_decoded_with = torch.zeros(1000, dtype=torch.float64)
    sum_decoded_without = torch.zeros(1000, dtype=torch.float64)
    for _ in range(60):
        gradient = torch.randn(1000, generator=generator) * 0.1 + 0.01  # small bias: errors accumulate
        sent = feedback.encode("w", gradient)
        sum_inputs += gradient.double()
        sum_decoded_with += roundtrip("int4", sent).double()
        sum_decoded_without += roundtrip("int4", gradient).double()
        residual = feedback.residual("w")
        assert residual is not None
        # the residual is one round-trip error of what was sent: bounded, it never accumulates
        assert bool((residual.double().abs() <= error_bound("int4", sent)).all())
        # sum of decoded == sum of inputs - current residual (up to float32 rounding)
        drift = sum_decoded_with - (sum_inputs - residual.double())
        assert drift.abs().max().item() < 1e-4
    drift_with = (sum_decoded_with - sum_inputs).abs().max().item()
    drift_without = (sum_decoded_without - sum_inputs).abs().max().item()
    assert drift_with <= error_bound("int4", sent).max().item()
    assert drift_without > 3 * drift_with


def test_error_feedback_keys_reset_and_failures() -> None:
    feedback = ErrorFeedback("int8")
    first = torch.randn(50)
    assert torch.equal(feedback.encode("a", first), first)  # nothing carried yet
    feedback.encode("b", torch.randn(7))
    kept = feedback.residual("a")
    assert kept is not None
    bad = torch.ones(50)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        feedback.encode("a", bad)
    assert torch.equal(feedback.residual("a"), kept)  # a failed encode changes nothing
    with pytest.raises(ValueError, match="shape"):
        feedback.encode("a", torch.randn(51))
    feedback.reset("a")
    assert feedback.residual("a") is None and feedback.residual("b") is not None
    feedback.reset()
    assert feedback.residual("b") is None


def test_error_feedback_fp32_is_a_no_op() -> None:
    feedback = ErrorFeedback("fp32")
    for _ in range(3):
        x = torch.randn(20)
        assert torch.equal(feedback.encode("k", x), x)
    assert not bool(feedback.residual("k").any())


# --- simulated all-reduce -----------------------------------------------------------------------
def _exact_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    return sum(w * t.double() for w, t in zip(weights, tensors)) / sum(weights)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("weights", [[1.0, 2.0, 0.5], [3.0, 0.0, 1.0, 1.0], [1.0]])
def test_simulated_allreduce_within_bound(name: str, weights: list[float]) -> None:
    generator = torch.Generator().manual_seed(6)
    tensors = [torch.randn(10_000, generator=generator) * (i + 1) for i in range(len(weights))]
    exact = _exact_mean(tensors, weights)
    bound = allreduce_error_bound(name, tensors, weights)
    results = simulate_allreduce_per_peer(name, tensors, weights, part_size_bytes=2**12)
    assert len(results) == len(weights)
    for result in results:
        assert result.shape == tensors[0].shape and result.dtype == tensors[0].dtype
        assert bool(((result.double() - exact).abs() <= bound).all())
    assert torch.equal(simulate_allreduce(name, tensors, weights, part_size_bytes=2**12), results[0])
    last = simulate_allreduce(name, tensors, weights, part_size_bytes=2**12, peer=len(weights) - 1)
    assert torch.equal(last, results[-1])
    if name == "fp32":
        assert (results[0].double() - exact).abs().max().item() < 1e-5
    elif len(weights) > 1:  # lossy codecs: peers get (slightly) different results, as on the network
        assert not torch.equal(results[0], results[1])


@pytest.mark.parametrize("part_size_bytes", [3000, 777])
def test_allreduce_bound_holds_when_parts_are_off_the_block_grid(part_size_bytes: int) -> None:
    """A part size that is not a power of two puts blocks off the whole-tensor grid: still bounded."""
    generator = torch.Generator().manual_seed(8)
    envelope = torch.linspace(0.0, 5.0, 5000) ** 3  # magnitudes change fast across blocks
    tensors = [torch.randn(5000, generator=generator) * envelope for _ in range(3)]
    weights = [1.0, 0.25, 2.0]
    exact = _exact_mean(tensors, weights)
    for name in QUANTIZERS:
        bound = allreduce_error_bound(name, tensors, weights)
        for result in simulate_allreduce_per_peer(name, tensors, weights, part_size_bytes=part_size_bytes):
            assert bool(((result.double() - exact).abs() <= bound).all())


def test_simulated_allreduce_reducer_keeps_its_share_exact() -> None:
    """Peer j's result on the share j reduces is the average itself: its own part is never encoded."""
    tensors = [torch.full((6000,), 7.0), torch.full((6000,), 21.0)]  # scales 1 and 3: int4-exact
    results = simulate_allreduce_per_peer("int4", tensors, [1.0, 1.0], part_size_bytes=2**12)
    # 2 peers, 6000 elements in parts of 4096 values: peer 0 reduces part 0, peer 1 part 1
    assert torch.equal(results[0][:4096], torch.full((4096,), 14.0))
    assert torch.equal(results[1][4096:], torch.full((6000 - 4096,), 14.0))


def test_simulated_allreduce_guards() -> None:
    tensors = [torch.ones(10), torch.ones(10)]
    with pytest.raises(ValueError, match="all weights are zero"):
        simulate_allreduce("int4", tensors, [0.0, 0.0])
    with pytest.raises(ValueError, match="all weights are zero"):
        allreduce_error_bound("int4", tensors, [0.0, 0.0])
    with pytest.raises(ValueError, match="weight 1"):
        simulate_allreduce("int4", tensors, [1.0, -1.0])
    with pytest.raises(ValueError, match="weight 0"):
        simulate_allreduce("int4", tensors, [float("nan"), 1.0])
    with pytest.raises(ValueError, match="one weight per tensor"):
        simulate_allreduce("int4", tensors, [1.0])
    with pytest.raises(ValueError, match="tensor 1"):
        simulate_allreduce("int4", [torch.ones(10), torch.ones(11)], [1.0, 1.0])
    with pytest.raises(ValueError, match="peer"):
        simulate_allreduce("int4", tensors, [1.0, 1.0], peer=2)
    with pytest.raises(ValueError, match="non-finite"):
        simulate_allreduce("int4", [torch.ones(10), torch.full((10,), float("nan"))], [1.0, 1.0])
