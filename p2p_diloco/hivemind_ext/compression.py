"""The pseudo-gradient codecs as hivemind compression classes, and all-reduces simulated with them.

The maths (blockwise quantizer, buffer layout, bounds, error feedback) is
:mod:`p2p_diloco.core.codecs`; here the codecs are plugged into hivemind. fp32 and fp16 are
hivemind's own ``NoCompression`` (slot ``NONE``) and ``Float16Compression`` (slot ``FLOAT16``);
int8 and int4 are our :class:`BlockwiseAbsmaxQuantization` in slots ``BLOCKWISE_8BIT`` and
``UNIFORM_8BIT``.

**Why our own quantizers.** hivemind 1.1.12's 8-bit codecs are unusable here:
``Uniform8BitQuantization`` and ``Quantile8BitQuantization`` call
``int(np.frombuffer(buffer, count=1))`` in ``extract``, which raises under NumPy 2, and inside an
all-reduce that error is swallowed (``step()`` returns with the local tensors untouched);
``BlockwiseQuantization`` needs bitsandbytes, which is absent (and GPU-oriented). There is no 4-bit
codec at all. So int8 and int4 are written here (STYLE.md rule 10: own code only where the library
is broken or absent); fp32 and fp16 stay hivemind's own.

**Why we take over hivemind slots.** hivemind deserializes a part by looking up the *name* of
``runtime_pb2.CompressionType`` in ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``
(a private name: this module checks the hivemind version at import), and a reducer compresses the
deltas it sends back with ``serialize_torch_tensor(delta, part.compression)`` -- i.e. with the
*registered instance of that slot*, not with the sender's codec object. The enum has no free value,
so each quantizer must own one slot, and the slot's registered instance must be configured exactly
like the sender's codec. Registration happens at import of this module; hivemind's averagers are
forked processes, so importing this module before creating them is enough. Our buffers start with a
16-byte header, so a buffer from a foreign codec in the same slot is rejected with ``ValueError``
rather than misread.

**Parts on the block grid.** ``estimate_compression_ratio`` rounds the bytes per value *up* to a
power of two, so hivemind's ``part_size_values = part_size_bytes / (element_size * ratio)`` is a
power of two (a multiple of ``BLOCK_SIZE``) whenever ``part_size_bytes`` is: every part then starts
on the block grid of the whole tensor, and a local :func:`roundtrip` of the whole tensor equals what
the network does to it (needed for exact error feedback). Parts then hold about half of
``part_size_bytes`` -- still "up to", as hivemind asks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Final

import torch
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartContainer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression import serialization as _hm_serialization
from hivemind.compression.serialization import (
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

from p2p_diloco.core.codecs import (
    BLOCK_SIZE,
    CODEC_NAMES,
    QUANTIZER_BITS,
    BlockwiseAbsmax,
    ErrorFeedback,
    allreduce_error_bound,
    bits_per_element,
    check_codec_name,
    error_bound,
    local_roundtrip,
    validate_group,
)
from p2p_diloco.core.rejects import PeerDataError, Reason
from p2p_diloco.hivemind_ext import require_hivemind

require_hivemind(__name__)  # _register() fills hivemind's private _BASE_COMPRESSION_TYPES

__all__ = [  # the pure names are re-exported: callers that simulate codecs need only this module
    "BLOCK_SIZE", "CODEC_NAMES", "BlockwiseAbsmaxQuantization", "ErrorFeedback", "allreduce_error_bound",
    "bits_per_element", "decode_part", "error_bound", "get_codec", "local_roundtrip", "roundtrip",
    "simulate_allreduce", "simulate_allreduce_per_peer",
]

logger = logging.getLogger(__name__)

_HIVEMIND_SLOT: Final[dict[str, str]] = {
    "fp32": "NONE",
    "fp16": "FLOAT16",
    "int8": "BLOCKWISE_8BIT",  # hivemind's needs bitsandbytes (absent)
    "int4": "UNIFORM_8BIT",  # hivemind's is broken under NumPy 2; no 4-bit slot exists
}


class BlockwiseAbsmaxQuantization(BlockwiseAbsmax, CompressionBase):
    """:class:`~p2p_diloco.core.codecs.BlockwiseAbsmax` as a hivemind compression: the buffer goes in
    ``runtime_pb2.Tensor.buffer``, beside the tensor's dtype name and shape.

    :param bits: 8 or 4
    :param block_size: elements per block (1..65535)
    :param compression_type: the hivemind slot this instance is registered under
    """

    def __init__(self, bits: int, block_size: int, compression_type: int) -> None:
        super().__init__(bits, block_size, where=f"hivemind slot {runtime_pb2.CompressionType.Name(compression_type)}")
        self.compression_type = compression_type

    def __repr__(self) -> str:
        slot = runtime_pb2.CompressionType.Name(self.compression_type)
        return f"{self.__class__.__name__}(bits={self.bits}, block_size={self.block_size}, slot={slot})"

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Bytes per value rounded up to a power of two, over the element size (see module docstring).

        Pessimistic on purpose: it makes hivemind's part size a power of two, so parts start on the
        block grid of the whole tensor.
        """
        element_size = torch.empty((), dtype=info.descriptor.dtype).element_size()
        return self.rounded_bytes_per_value() / element_size

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        """Quantize ``tensor``; raises ValueError for unsupported dtypes and non-finite values."""
        dtype_name, buffer = self.encode(tensor)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=buffer,
            size=tensor.shape,
            dtype=dtype_name,
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode a message made by :meth:`compress`; raises
        :class:`~p2p_diloco.core.rejects.PeerDataError` on any malformed input (see
        :meth:`~p2p_diloco.core.codecs.BlockwiseAbsmax.decode`: nothing is allocated before it is checked)."""
        return self.decode(serialized_tensor.buffer, serialized_tensor.dtype, tuple(serialized_tensor.size))


def decode_part(message: runtime_pb2.Tensor, shape: Sequence[int], dtype: torch.dtype,
                compression_type: int) -> torch.Tensor:
    """Decode a tensor (or tensor part) a peer sent where one of ``shape`` and ``dtype`` compressed in
    hivemind slot ``compression_type`` is expected; raises :class:`~p2p_diloco.core.rejects.PeerDataError`.

    The declared slot, shape and dtype and the buffer's exact length are checked *before* anything is
    decoded, so nothing larger than the expected tensor is ever allocated -- hivemind's own fp32/fp16
    decoders trust the declared dtype and shape (fp16 with a declared dtype ``"U99999999"`` allocates
    400 MB per element; a one-element part would broadcast over a reducer's whole accumulator).
    The decoded tensor must be finite.
    """
    slot = runtime_pb2.CompressionType.Name(compression_type)
    got_slot = runtime_pb2.CompressionType.Name(message.compression) \
        if message.compression in runtime_pb2.CompressionType.values() else str(message.compression)
    if got_slot != slot:
        raise PeerDataError(Reason.BAD_DTYPE, f"tensor compressed in slot {got_slot}, expected {slot}")
    declared = tuple(message.size)
    if declared != tuple(shape):
        raise PeerDataError(Reason.BAD_SHAPE, f"tensor of shape {declared}, expected {tuple(shape)}"[:200])
    dtype_name = str(dtype).replace("torch.", "")
    if message.dtype != dtype_name:
        raise PeerDataError(Reason.BAD_DTYPE, f"tensor of dtype {message.dtype!r}, expected {dtype_name}"[:200])
    numel = math.prod(shape)
    codec = _hm_serialization._BASE_COMPRESSION_TYPES[slot]
    if isinstance(codec, BlockwiseAbsmaxQuantization):
        sizes = {codec.buffer_bytes(numel)}
    elif slot == "FLOAT16":
        sizes = {2 * numel}
    elif slot == "NONE":
        element_size = torch.empty((), dtype=dtype).element_size()
        sizes = {element_size * numel, 4 * numel} if dtype == torch.bfloat16 else {element_size * numel}
    else:
        raise PeerDataError(Reason.BAD_DTYPE, f"compression slot {slot} is not accepted from peers")
    if len(message.buffer) not in sizes:
        raise PeerDataError(Reason.OVERSIZE if len(message.buffer) > max(sizes) else Reason.MALFORMED,
                            f"tensor buffer of {len(message.buffer)} bytes, expected {min(sizes)} "
                            f"for {tuple(shape)}/{dtype_name} in slot {slot}")
    try:
        tensor = deserialize_torch_tensor(message).detach()
    except PeerDataError:
        raise
    except Exception as e:  # whatever else the library's decoder trips on is the sender's fault too
        raise PeerDataError(Reason.MALFORMED,
                            f"undecodable tensor in slot {slot}: {type(e).__name__}: {e}"[:200]) from None
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise PeerDataError(Reason.BAD_SHAPE, f"tensor decoded to {tuple(tensor.shape)}/{tensor.dtype}, "
                                              f"expected {tuple(shape)}/{dtype_name}"[:200])
    if not bool(torch.isfinite(tensor).all()):
        raise PeerDataError(Reason.NON_FINITE, f"tensor of {tuple(shape)} holds NaN or infinite values")
    return tensor


def _register() -> dict[str, CompressionBase]:
    """Install our quantizers into hivemind's deserialization table; return the codec per name.

    Our own quantizers because hivemind's 8-bit ones are broken under NumPy 2 (or need the absent
    bitsandbytes) and it has no 4-bit one; one slot each because reducers re-encode the returned
    deltas with the slot's registered instance (see the module docstring).
    """
    registry = _hm_serialization._BASE_COMPRESSION_TYPES
    for name, bits in QUANTIZER_BITS.items():
        slot = _HIVEMIND_SLOT[name]
        current = registry[slot]
        if not (isinstance(current, BlockwiseAbsmaxQuantization) and current.bits == bits):
            registry[slot] = BlockwiseAbsmaxQuantization(bits, BLOCK_SIZE, runtime_pb2.CompressionType.Value(slot))
            logger.debug("registered %r in hivemind slot %s (replacing %r)", registry[slot], slot, current)
    codecs = {name: registry[slot] for name, slot in _HIVEMIND_SLOT.items()}
    for name, codec in codecs.items():
        assert runtime_pb2.CompressionType.Name(codec.compression_type) == _HIVEMIND_SLOT[name]
    return codecs


_CODECS: Final[dict[str, CompressionBase]] = _register()


def get_codec(name: str) -> CompressionBase:
    """The hivemind compression object for ``name`` -- the very instance hivemind's reducers use."""
    check_codec_name(name)
    return _CODECS[name]


PARTS_PER_SPAN: Final[int] = 4
"""An all-reduce sends each member's span of the tensors in about this many parts (:func:`pipelined_part_bytes`)."""
MIN_PART_BYTES: Final[int] = 4096
"""The smallest part (hivemind's ``part_size_bytes``) :func:`pipelined_part_bytes` picks: a part is a message."""


def pipelined_part_bytes(tensors: Sequence[torch.Tensor], compression: CompressionBase, group_size: int) -> int:
    """hivemind's ``part_size_bytes`` for an all-reduce of ``tensors`` among ``group_size`` members: about a
    :data:`PARTS_PER_SPAN`-th of one member's span in the codec's estimated wire bytes, rounded down to a power of
    two (so that parts stay on the block grid: module docstring), within [:data:`MIN_PART_BYTES`, hivemind's
    ``DEFAULT_PART_SIZE_BYTES``]. A reducer sends a part's average back once every sender's copy of it is in; with
    hivemind's 512 kB a demo fragment's span is one part, so the averages went back only after whole spans came in,
    and the two halves of an all-reduce ran one after the other: at 0.25 Mbit/s a lone round moved 142 kB in 10 s,
    45% of the link. Every member derives the same size from what it shares with the others (the fragment's
    shapes, the codec, the group): a reducer expects its senders' parts in the shapes of its own split."""
    wire = sum(t.numel() * t.element_size() * compression.estimate_compression_ratio(CompressionInfo.from_tensor(t))
               for t in tensors)
    target = wire / max(1, group_size) / PARTS_PER_SPAN
    return min(DEFAULT_PART_SIZE_BYTES, max(MIN_PART_BYTES, _power_of_two_below(target)))


def _power_of_two_below(size: float) -> int:
    """The largest power of two at most ``size`` (1 below 2): part sizes stay on the quantizer's block grid."""
    return 1 << max(0, math.floor(math.log2(max(1.0, size))))


PART_SECONDS: Final[float] = 0.1
"""A part takes at least about this long on the group's slowest link (:func:`link_part_bytes`)."""


def link_part_bytes(tensors: Sequence[torch.Tensor], compression: CompressionBase, group_size: int,
                    slowest_Bps: float) -> int:
    """hivemind's ``part_size_bytes`` for an all-reduce whose slowest member's link moved ``slowest_Bps`` bytes per
    second in its recent rounds (0: one of them has not measured its link yet): the pipelined parts
    (:func:`pipelined_part_bytes`), but none shorter than :data:`PART_SECONDS` on that link -- rounded down to a
    power of two, up to hivemind's ``DEFAULT_PART_SIZE_BYTES``. A part is a message with its own costs (a protobuf
    message on a stream, a reducer's turn): on loopback the demo's 4 KiB parts made the all-reduce 55% slower (0.225
    to 0.349 s) where pipelining saved nothing, while at 0.25-1 Mbit/s they saved 15-20%. Every member computes the
    same size from the group's gathered metadata: a reducer expects its senders' parts in the shapes of its own
    split."""
    pipelined = pipelined_part_bytes(tensors, compression, group_size)
    if not math.isfinite(slowest_Bps) or slowest_Bps <= 0:
        return pipelined
    return min(DEFAULT_PART_SIZE_BYTES, max(pipelined, _power_of_two_below(slowest_Bps * PART_SECONDS)))


# --- local simulation ---------------------------------------------------------------------------
@torch.no_grad()
def roundtrip(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Compress ``tensor`` with the codec and decode it through hivemind's registry, as a peer would.

    Equal bit for bit to :func:`~p2p_diloco.core.codecs.local_roundtrip`, which needs no hivemind.
    """
    codec = get_codec(name)
    tensor = tensor.detach()
    message = codec.compress(tensor, CompressionInfo.from_tensor(tensor), allow_inplace=False)
    return deserialize_torch_tensor(message).detach()


@torch.no_grad()
def simulate_allreduce_per_peer(
    name: str,
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
) -> list[torch.Tensor]:
    """What each peer of a hivemind butterfly all-reduce with this codec ends up holding.

    Peer ``i`` holds ``tensors[i]`` with weight ``weights[i]`` and is the ``i``-th peer of the group
    (it reduces the ``i``-th share, all bandwidths equal, as ``DecentralizedAverager`` does by
    default). Mirrors ``hivemind/averaging/allreduce.py`` step by step, using hivemind's own
    partitioner (``TensorPartContainer``) and load balancer:

    * every sender compresses each part with the codec; the reducer decodes it, except its own part,
      which it uses raw;
    * the reducer accumulates ``sum w_k x~_k`` in float32 and divides by ``sum w_k``;
    * it sends each remote sender the *delta* ``avg - x~_k`` compressed again (same slot); the sender
      adds the decoded delta to its own raw tensor. The reducer's own share gets ``avg - x_j`` raw.

    So lossy codecs give each peer a slightly different result (see
    :func:`~p2p_diloco.core.codecs.allreduce_error_bound`). Accumulation order is sender order here;
    on the network it is arrival order, which changes only float32 rounding. Raises ValueError for
    all-zero or negative weights and mismatched tensors.
    """
    return _simulate(name, tensors, weights, part_size_bytes, range(len(tensors)))


def simulate_allreduce(
    name: str,
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
    peer: int = 0,
) -> torch.Tensor:
    """The result peer ``peer`` (default 0) gets; see :func:`simulate_allreduce_per_peer`."""
    if not 0 <= peer < len(tensors):
        raise ValueError(f"peer must be in 0..{len(tensors) - 1}, got {peer}")
    return _simulate(name, tensors, weights, part_size_bytes, (peer,))[0]


def _simulate(
    name: str,
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float],
    part_size_bytes: int,
    peers: Sequence[int],
) -> list[torch.Tensor]:
    codec = get_codec(name)
    validate_group(tensors, weights)
    group_size = len(tensors)
    flats = [t.detach().contiguous() for t in tensors]
    fractions = load_balance_peers(flats[0].numel(), [None] * group_size, 0)
    # parts[i][j]: the parts of sender i's tensor that reducer j averages (hivemind's own split)
    parts = []
    for flat in flats:
        container = TensorPartContainer([flat], fractions, compression=codec, part_size_bytes=part_size_bytes)
        parts.append([container.get_raw_input_parts(j) for j in range(group_size)])
        container.finalize()

    def through_codec(part: torch.Tensor) -> torch.Tensor:
        return deserialize_torch_tensor(codec.compress(part, CompressionInfo.from_tensor(part)))

    deltas: dict[int, list[torch.Tensor]] = {peer: [] for peer in peers}
    for j in range(group_size):
        for p in range(len(parts[0][j])):
            received = [parts[i][j][p] if i == j else through_codec(parts[i][j][p]) for i in range(group_size)]
            accumulator = torch.zeros(received[0].shape)
            denominator = 0.0
            for i in range(group_size):
                accumulator.add_(received[i], alpha=weights[i])
                denominator += weights[i]
            averaged = accumulator.div_(denominator)
            for peer in peers:
                if peer == j:
                    deltas[peer].append(averaged - parts[peer][j][p])
                else:
                    message = serialize_torch_tensor(averaged - received[peer], codec.compression_type)
                    deltas[peer].append(deserialize_torch_tensor(message))
    results = []
    for peer in peers:
        result = flats[peer].clone()
        if result.numel():
            result.add_(torch.cat(deltas[peer]).reshape(result.shape))
        results.append(result)
    return results
