"""Pseudo-gradient codecs for the outer DiLoCo step: the maths, without hivemind.

Four codecs, chosen by name (``CODEC_NAMES``); bits per element on the wire, scales included:

- ``fp32``: the tensor as is, 32 bits.
- ``fp16``: IEEE half (values clamped to the fp16 range), 16 bits.
- ``int8``: blockwise absmax, levels -127..127, 8 + 32/128 = 8.25 bits.
- ``int4``: blockwise absmax, levels -7..7, two per byte, 4 + 32/128 = 4.25 bits.

This module holds what is pure maths: the blockwise quantizer and its buffer layout
(:class:`BlockwiseAbsmax`), wire sizes, the error bounds and error feedback. It imports torch and
numpy only, so the simulator's maths and the bounds are usable without a network stack. How these
codecs are plugged into hivemind's compression slots (and why ours replace hivemind's 8-bit ones)
is :mod:`p2p_diloco.hivemind_ext.compression`.

**Block layout.** Elements are quantized in blocks of ``BLOCK_SIZE`` consecutive elements of the
flattened tensor (the last block may be short), with one float32 scale ``s = absmax(block) / q``
per block (``q`` = 127 for int8, 7 for int4), values ``round(x / s)``.

**Error bound** (per element, see :func:`error_bound`), for a block with absmax ``a`` and a tensor
of dtype ``d``::

    |x - decode(encode(x))| <= a * (0.5 / q + 2**-20 + u_d) + 2**-120 + t_d

where ``u_d`` is the unit roundoff of ``d`` (2**-24 fp32, 2**-11 fp16, 2**-8 bf16; the decoded value
is cast back to ``d``), ``t_d`` half the smallest subnormal of ``d`` (2**-25 for fp16), ``2**-20``
covers float32 arithmetic, and ``2**-120`` covers blocks whose scale is a float32 subnormal.
For fp16: ``|x| * 2**-11 + 2**-25 + max(|x| - 65504, 0)`` (the codec clamps to the fp16 range);
fp32: 0.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Final

import numpy as np
import torch

from p2p_diloco.core.rejects import PeerDataError, Reason

CODEC_NAMES: Final[tuple[str, ...]] = ("fp32", "fp16", "int8", "int4")

BLOCK_SIZE: Final[int] = 128
"""Elements per quantization block (one float32 scale each) for int8 and int4."""

QUANTIZER_BITS: Final[dict[str, int]] = {"int8": 8, "int4": 4}
"""Bits per value of each blockwise quantizer, by codec name."""

HEADER: Final[struct.Struct] = struct.Struct("<4sBBHQ")
"""Buffer header: magic, format version, bits per value, block size, element count (little-endian)."""
MAGIC: Final[bytes] = b"P2DQ"
FORMAT_VERSION: Final[int] = 1
SCALE_BYTES: Final[int] = 4  # float32 scales
SUPPORTED_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""The dtypes the quantizers encode, by the name that goes on the wire."""
_FP32_MAX: Final[float] = torch.finfo(torch.float32).max
_ARITH_SLACK: Final[float] = 2.0**-20  # relative slack for float32 arithmetic (16 unit roundoffs)
_SUBNORMAL_SCALE_SLACK: Final[float] = 2.0**-120  # absolute slack when a block's scale is subnormal
_FP16_MAX: Final[float] = 65504.0


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _half_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def check_codec_name(name: str) -> None:
    """Raise a one-line ValueError naming the choices if ``name`` is not a codec."""
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")


class BlockwiseAbsmax:
    """Symmetric blockwise absmax quantizer with ``bits`` bits per value (8 or 4) and float32 scales.

    Per element, ``|x - decode(encode(x))| <= a * (0.5 / q + 2**-20 + u_d) + 2**-120 + t_d`` with ``a``
    the absmax of the element's block, ``q = 2**(bits-1) - 1`` and ``u_d``, ``t_d`` the unit roundoff
    and half the smallest subnormal of the tensor's dtype (see the module docstring).

    Buffer layout: a 16-byte header ``<4sBBHQ`` (magic ``P2DQ``, version 1, bits, block size, element
    count), ``ceil(n / block)`` little-endian float32 scales, then the codes: int8 as signed bytes in
    -127..127; int4 as nibbles ``code + 8`` in 1..15, element ``2k`` in the low nibble of byte ``k``
    (an odd tail is padded with code 0). The header lets a buffer from a foreign codec be refused
    rather than misread.

    :param bits: 8 or 4
    :param block_size: elements per block (1..65535)
    :param where: where this codec's buffers arrive, for error messages (e.g. a hivemind slot)
    """

    def __init__(self, bits: int, block_size: int, where: str = "") -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if not 1 <= block_size <= 0xFFFF:
            raise ValueError(f"block_size must be in 1..65535, got {block_size}")
        self.bits = bits
        self.block_size = block_size
        self.qmax = 2 ** (bits - 1) - 1
        self.name = f"int{bits}"
        self.where = where

    # --- sizes ---------------------------------------------------------------------------------
    def payload_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` elements (int4: two per byte)."""
        return numel if self.bits == 8 else (numel + 1) // 2

    def buffer_bytes(self, numel: int) -> int:
        """Exact ``len(buffer)`` of a compressed tensor with ``numel`` elements."""
        num_blocks = -(-numel // self.block_size)
        return HEADER.size + SCALE_BYTES * num_blocks + self.payload_bytes(numel)

    def rounded_bytes_per_value(self) -> float:
        """Bytes per value, scales included, rounded *up* to a power of two.

        Pessimistic on purpose: hivemind sizes its parts from it, and a power of two makes every part
        start on the block grid of the whole tensor (see :mod:`p2p_diloco.hivemind_ext.compression`).
        """
        bytes_per_value = self.bits / 8 + SCALE_BYTES / self.block_size
        return 2.0 ** math.ceil(math.log2(bytes_per_value))

    # --- encode --------------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor) -> tuple[str, bytes]:
        """(dtype name, buffer) of ``tensor``; raises ValueError for unsupported dtypes and non-finite values."""
        dtype_name = str(tensor.dtype).replace("torch.", "")
        if dtype_name not in SUPPORTED_DTYPES:
            raise ValueError(f"{self.name} codec supports float32/float16/bfloat16 tensors, got {tensor.dtype}")
        flat = tensor.detach().cpu().reshape(-1).to(torch.float32)
        numel = flat.numel()
        finite = torch.isfinite(flat)
        if not bool(finite.all()):
            bad = numel - int(finite.sum())
            raise ValueError(
                f"{self.name} codec: refusing to compress a tensor with {bad} non-finite value(s) (NaN/inf) "
                f"out of {numel}; sending them would poison every peer's average"
            )
        scales, codes = self._quantize(flat)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.bits, self.block_size, numel)
        return dtype_name, b"".join((header, scales.numpy().astype("<f4").tobytes(), self._pack(codes)))

    def _quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 values -> (float32 scale per block, int8 codes per element)."""
        numel = flat.numel()
        num_blocks = -(-numel // self.block_size)
        padded = torch.zeros(num_blocks * self.block_size, dtype=torch.float32)
        padded[:numel] = flat
        blocks = padded.view(num_blocks, self.block_size)
        scales = blocks.abs().amax(dim=1) / self.qmax if num_blocks else torch.zeros(0)
        # An all-zero block has scale 0: divide by 1 instead (its codes are 0 either way), no NaN.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / divisor[:, None]).clamp_(-self.qmax, self.qmax).to(torch.int8)
        return scales, codes.view(-1)[:numel]

    def _pack(self, codes: torch.Tensor) -> bytes:
        if self.bits == 8:
            return codes.numpy().tobytes()
        nibbles = (codes.to(torch.uint8) + 8) & 0xF  # -7..7 -> 1..15
        if nibbles.numel() % 2:
            nibbles = torch.cat((nibbles, torch.full((1,), 8, dtype=torch.uint8)))
        pairs = nibbles.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()

    # --- decode --------------------------------------------------------------------------------
    def decode(self, buffer: bytes, dtype_name: str, shape: Sequence[int]) -> torch.Tensor:
        """Decode a buffer made by :meth:`encode` (with the dtype name and shape sent beside it).

        Everything (header, dtype, shape vs element count, exact buffer length, finite non-negative
        scales, codes in range) is checked before the output is allocated, so a hostile peer cannot
        make us allocate more than its buffer's size; a decoded value that overflows the declared
        dtype (a huge scale with dtype float16) is refused too. Raises
        :class:`~p2p_diloco.core.rejects.PeerDataError` (a ``ValueError`` with a reason code).
        """
        if len(buffer) < HEADER.size:
            raise PeerDataError(Reason.MALFORMED,
                                f"{self.name} codec: buffer of {len(buffer)} bytes is shorter than the header")
        magic, version, bits, block_size, numel = HEADER.unpack_from(buffer)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise PeerDataError(
                Reason.BAD_VERSION if magic == MAGIC else Reason.MALFORMED,
                f"{self.name} codec: not a p2p_diloco quantized buffer (magic={magic!r}, version={version}); "
                f"is the sender using a different codec{' under ' + self.where if self.where else ''}?"
            )
        if bits != self.bits:
            raise PeerDataError(Reason.BAD_DTYPE,
                                f"{self.name} codec: buffer says {bits} bits, this slot decodes {self.bits}")
        if block_size < 1:
            raise PeerDataError(Reason.MALFORMED, f"{self.name} codec: block size must be >= 1, got {block_size}")
        if dtype_name not in SUPPORTED_DTYPES:
            raise PeerDataError(Reason.BAD_DTYPE, f"{self.name} codec: unsupported dtype {dtype_name!r}"[:200])
        shape = tuple(shape)
        if any(d < 0 for d in shape) or math.prod(shape) != numel:
            raise PeerDataError(Reason.BAD_SHAPE,
                                f"{self.name} codec: shape {shape} does not hold the header's {numel} elements"[:200])
        num_blocks = -(-numel // block_size)
        payload_bytes = self.payload_bytes(numel)
        expected = HEADER.size + SCALE_BYTES * num_blocks + payload_bytes
        if len(buffer) != expected:
            raise PeerDataError(
                Reason.MALFORMED,
                f"{self.name} codec: buffer has {len(buffer)} bytes, expected {expected} "
                f"for {numel} elements in blocks of {block_size}"
            )
        scales_np = np.frombuffer(buffer, dtype="<f4", count=num_blocks, offset=HEADER.size)
        scales = torch.from_numpy(scales_np.astype(np.float32))
        if not bool(torch.isfinite(scales).all()):
            raise PeerDataError(Reason.NON_FINITE, f"{self.name} codec: buffer holds negative or non-finite scales")
        if bool((scales < 0).any()):
            raise PeerDataError(Reason.MALFORMED, f"{self.name} codec: buffer holds negative or non-finite scales")
        payload_offset = HEADER.size + SCALE_BYTES * num_blocks
        raw = np.frombuffer(buffer, dtype=np.uint8, count=payload_bytes, offset=payload_offset)
        codes = self._unpack(torch.from_numpy(raw.copy()), numel)

        padded = torch.zeros(num_blocks * block_size, dtype=torch.float32)
        padded[:numel] = codes
        values = (padded.view(num_blocks, block_size) * scales[:, None]).view(-1)[:numel]
        values = values.clamp_(-_FP32_MAX, _FP32_MAX)  # q * s may round just past float32's max
        values = values.to(SUPPORTED_DTYPES[dtype_name])
        if values.dtype != torch.float32 and not bool(torch.isfinite(values).all()):
            raise PeerDataError(Reason.NON_FINITE,
                                f"{self.name} codec: scales overflow the declared dtype {dtype_name}")
        return values.reshape(shape)

    def _unpack(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        if self.bits == 8:
            codes = raw.view(torch.int8)
            if bool((codes == -128).any()):
                raise PeerDataError(Reason.MALFORMED, f"{self.name} codec: code -128 is outside the levels -127..127")
            return codes.to(torch.float32)
        nibbles = torch.stack((raw & 0xF, raw >> 4), dim=1).view(-1)
        if bool((nibbles == 0).any()):
            raise PeerDataError(Reason.MALFORMED,
                                f"{self.name} codec: nibble 0 is outside the levels 1..15 (codes -7..7)")
        return nibbles[:numel].to(torch.float32) - 8


_QUANTIZERS: Final[dict[str, BlockwiseAbsmax]] = {
    name: BlockwiseAbsmax(bits, BLOCK_SIZE) for name, bits in QUANTIZER_BITS.items()
}


@torch.no_grad()
def local_roundtrip(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the codec ``name`` turns ``tensor`` into, computed here without hivemind.

    Bit for bit what :func:`p2p_diloco.hivemind_ext.compression.roundtrip` (compress, then decode through
    hivemind's registry) returns -- tests pin it: fp32 is hivemind's ``NoCompression`` (a copy), fp16
    its ``Float16Compression`` (clamp to the fp16 range, cast to half and back; bfloat16 refused, as
    hivemind refuses it), int8/int4 our :class:`BlockwiseAbsmax`.
    """
    check_codec_name(name)
    tensor = tensor.detach().cpu()
    if name == "fp32":
        return tensor.clone()
    if name == "fp16":
        if not torch.is_floating_point(tensor) or tensor.dtype == torch.bfloat16:
            raise ValueError(f"the fp16 codec (hivemind's Float16Compression) does not support {tensor.dtype} tensors")
        half = tensor.to(torch.float32).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        return half.to(tensor.dtype)
    quantizer = _QUANTIZERS[name]
    dtype_name, buffer = quantizer.encode(tensor)
    return quantizer.decode(buffer, dtype_name, tensor.shape)


def bits_per_element(name: str, block_size: int | None = None) -> float:
    """Wire bits per element, scales included (headers and protobuf framing not included).

    ``block_size`` (int8/int4 only) defaults to ``BLOCK_SIZE``.
    """
    check_codec_name(name)
    if name in ("fp32", "fp16"):
        if block_size is not None:
            raise ValueError(f"block_size applies to int8/int4 only, not {name}")
        return 32.0 if name == "fp32" else 16.0
    block = BLOCK_SIZE if block_size is None else block_size
    if block < 1:
        raise ValueError(f"block_size must be >= 1, got {block}")
    return (8.0 if name == "int8" else 4.0) + 8.0 * SCALE_BYTES / block


# --- error bounds -------------------------------------------------------------------------------
def _beta(name: str, magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Monotone bound on the round-trip error of an element whose block absmax is ``magnitude``.

    For fp16 the "block" is the element itself; for fp32 the bound is 0.
    """
    if name == "fp32":
        return torch.zeros_like(magnitude)
    if name == "fp16":
        return magnitude * 2.0**-11 + 2.0**-25 + (magnitude - _FP16_MAX).clamp_min(0)
    qmax = 127 if name == "int8" else 7
    relative = 0.5 / qmax + _ARITH_SLACK + _unit_roundoff(dtype)
    return magnitude * relative + _SUBNORMAL_SCALE_SLACK + _half_subnormal(dtype)


def _window(name: str) -> int:
    return BLOCK_SIZE if name in QUANTIZER_BITS else 1


def error_bound(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Per-element bound (float64, same shape) on ``|tensor - roundtrip(name, tensor)|``.

    Uses the codec's real block layout (blocks of ``BLOCK_SIZE`` from element 0). Raises
    ValueError for non-finite input to int8/int4 (the codec would refuse it).
    """
    check_codec_name(name)
    flat = tensor.detach().reshape(-1).to(torch.float64).abs()
    if name in QUANTIZER_BITS:
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(f"{name} codec: no error bound for non-finite values (compress refuses them)")
        numel = flat.numel()
        num_blocks = -(-numel // BLOCK_SIZE)
        padded = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.float64)
        padded[:numel] = flat
        blocks = padded.view(num_blocks, BLOCK_SIZE)
        if num_blocks:
            blocks = blocks.amax(dim=1, keepdim=True).expand(num_blocks, BLOCK_SIZE)
        flat = blocks.reshape(-1)[:numel]
    return _beta(name, flat, tensor.dtype).reshape(tensor.shape)


def _window_max(values: torch.Tensor, window: int) -> torch.Tensor:
    """Upper bound on the absmax of any block of ``window`` consecutive elements holding element i.

    Such a block lies inside the aligned windows k-1, k, k+1 around i's aligned window k, so the max
    over those three is enough (O(n), whatever the part layout).
    """
    if window == 1 or values.numel() == 0:
        return values
    numel = values.numel()
    num_windows = -(-numel // window)
    padded = torch.zeros(num_windows * window, dtype=values.dtype)
    padded[:numel] = values
    local = padded.view(num_windows, window).amax(dim=1)
    neighbours = torch.nn.functional.pad(local, (1, 1))
    widest = torch.maximum(torch.maximum(neighbours[:-2], neighbours[1:-1]), neighbours[2:])
    return widest.repeat_interleave(window)[:numel]


def validate_group(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
    """Raise ValueError unless there is one finite weight >= 0 per tensor, some weight > 0, and every
    tensor has the shape and dtype of the first (what a weighted all-reduce needs)."""
    if len(tensors) == 0 or len(tensors) != len(weights):
        raise ValueError(
            f"need one weight per tensor and at least one tensor, got {len(tensors)} tensors, {len(weights)} weights"
        )
    first = tensors[0]
    for index, tensor in enumerate(tensors):
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise ValueError(
                f"tensor {index} is {tuple(tensor.shape)}/{tensor.dtype}, "
                f"tensor 0 is {tuple(first.shape)}/{first.dtype}"
            )
    for index, weight in enumerate(weights):
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight {index} is {weight}; weights must be finite and >= 0")
    if sum(float(w) for w in weights) <= 0:
        raise ValueError("all weights are zero: the weighted mean is undefined (hivemind would return NaN)")


def allreduce_error_bound(name: str, tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Per-element bound (float64) on ``|result_r - exact weighted mean|`` for every peer ``r``.

    Holds for any part layout and any order of peers in the group. Derivation, for an element of a
    part reduced by peer ``j`` and received by peer ``r`` (``x~`` = x after the codec, ``b_k`` =
    codec bound of ``x_k``, ``m`` = exact mean, ``W`` = sum of weights)::

        avg      = (w_j x_j + sum_{k!=j} w_k x~_k) / W        ->  |avg - m| <= E = sum_k w_k b_k / W
        result_r = x_r + codec(avg - x~_r)     (r != j)        ->  |result_r - m| <= E + b_r + b'_r
        result_j = x_j + (avg - x_j)                            ->  |result_j - m| <= E

    where ``b'_r`` is the codec bound of the returned delta, ``|avg - x~_r| <= |m - x_r| + E + b_r``.
    Block absmaxes are replaced by maxima over three aligned blocks around each element (holds for
    any part layout), and ``(2n + 8) * 2**-24`` of the magnitudes covers float32 accumulation.
    """
    check_codec_name(name)
    validate_group(tensors, weights)
    dtype = tensors[0].dtype
    window = _window(name)
    xs = torch.stack([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    if not bool(torch.isfinite(xs).all()):
        raise ValueError("no error bound for non-finite values")
    w = torch.tensor([float(v) for v in weights], dtype=torch.float64)
    mean = (w[:, None] * xs).sum(0) / w.sum()
    in_bound = torch.stack([_beta(name, _window_max(x.abs(), window), dtype) for x in xs])
    e_avg = (w[:, None] * in_bound).sum(0) / w.sum()
    delta = (mean - xs).abs() + e_avg + in_bound
    # the reducer's accumulator, hence every returned delta, is float32
    return_bound = torch.stack([_beta(name, _window_max(d, window), torch.float32) for d in delta])
    slack = (2 * len(tensors) + 8) * 2.0**-24 * (xs.abs().amax(0) + delta.amax(0))
    total = e_avg + (in_bound + return_bound).amax(0) + slack
    if dtype != torch.float32:  # the result is rounded to the tensors' dtype once more
        total = total + 2 * _unit_roundoff(dtype) * (mean.abs() + total) + _half_subnormal(dtype)
    return total.reshape(tensors[0].shape)


# --- error feedback -----------------------------------------------------------------------------
class ErrorFeedback:
    """Error feedback for a lossy codec: what the codec dropped this round is sent next round.

    ``encode(key, g)`` returns ``v = g + e`` (what to send) and keeps ``e <- v - roundtrip(v)``. Then
    ``sum_t decoded(v_t) = sum_t g_t + e_0 - e_T``: the running sum of what peers receive tracks the
    running sum of inputs, off by one residual, itself within :func:`error_bound` of the last ``v``.
    A failed compression (ValueError) leaves the residual unchanged. Residuals are kept in float32.
    With fp32 the residual stays zero. The round trip is :func:`local_roundtrip`, equal bit for bit
    to what peers decode.
    """

    def __init__(self, codec_name: str) -> None:
        check_codec_name(codec_name)
        self.codec_name = codec_name
        self._residuals: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def encode(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        residual = self._residuals.get(key)
        tensor = tensor.detach()
        if residual is not None and residual.shape != tensor.shape:
            raise ValueError(
                f"error feedback {key!r}: shape {tuple(tensor.shape)} != residual {tuple(residual.shape)}"
            )
        compensated = tensor.to(torch.float32) if residual is None else tensor.to(torch.float32) + residual
        to_send = compensated.to(tensor.dtype)
        new_residual = compensated - local_roundtrip(self.codec_name, to_send).to(torch.float32)
        self._residuals[key] = new_residual
        return to_send

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual carried for ``key`` (None before its first encode)."""
        return self._residuals.get(key)

    def reset(self, key: str | None = None) -> None:
        """Forget the residual of ``key``, or of every key when ``key`` is None."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)
