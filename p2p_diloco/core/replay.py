"""Catch-up by replay: the committed rounds a learner keeps, their lossless wire form, and the chain a learner that
is behind applies instead of downloading the fragment's state.

Every member of a committed round applies the same merged pseudo-gradient to the same anchor and momentum (that is
what makes anchors identical), so a learner that missed a few rounds reaches the swarm's anchor exactly by applying
the rounds it missed, in order: each :class:`KeptRound` names the (version, anchor hash) it was applied at and the
anchor hash it made, and a replay is accepted only if every step reproduces that hash bit for bit (else the learner
downloads the state as before). A merged pseudo-gradient is the decoded all-reduce of int4 parts, times one factor
per tensor (the radial merge's length): a block of :data:`BLOCK` consecutive values, on the quantizer's block grid,
holds the quantizer's 15 levels ``c`` in -7..7, each ``c x scale x factor`` rounded twice. :func:`pack_exact` stores
such a block as one float32 step ``t`` (its largest magnitude / 7), a 4-bit level per value and, per level, how many
float32 steps (ulps) the value lies from ``c x t`` -- about 0.59 bytes a value, against the 8 (anchor and momentum
in fp32) of a state download and the 0.53 of the int4 wire. Where that does not hold for every block (levels
straddling two quantizer blocks, a -0.0), each block is stored as its distinct values and an index of a few bits per
value (about 1.25 bytes a value), and a tensor whose values do not repeat, an fp32 round's, goes raw: 4 bytes a
value. :func:`unpack_exact` gives back the same bits in every case.

Pure: torch and numpy only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgpack
import numpy as np
import torch

from p2p_diloco.core.rejects import PeerDataError, Reason

MAX_KEPT_ROUNDS = 64
"""The most rounds a learner keeps per fragment (``averaging.kept_rounds``, 8 by default) and a replay accepts."""
BLOCK = 128
"""Values per block of :func:`pack_exact` (each block has its own distinct values)."""
MAX_INDEX_BITS = 8
"""Past this many bits of index (256 distinct values in a block) a tensor goes as raw float32 bits."""
LEVELS = 7
"""The levels of a stepped block (:func:`pack_exact`): ``-LEVELS..LEVELS``, the int4 quantizer's."""
MAX_ULPS = 7
"""The most float32 steps (ulps) a stepped block's value may lie from its level times the block's step (twice
rounded, as a decode and a merge factor round, it lies within two)."""
STEPPED = 0x84
"""The header's mode byte of a stepped tensor (levels of 4 bits); 0 is raw, 1..:data:`MAX_INDEX_BITS` the bits of a
table's index."""
_HEADER = struct.Struct("<QB")  # element count, mode: 0 raw float32, 1..8 the index bits of a table, STEPPED


@dataclass(frozen=True)
class RoundStep:
    """Where a committed round of a fragment was applied -- at ``version`` with anchor ``base_hash`` -- and the anchor
    ``anchor_hash`` (at ``version + 1``) its outer step made."""

    version: int
    base_hash: str
    anchor_hash: str

    @property
    def base(self) -> tuple[int, str]:
        return self.version, self.base_hash

    @property
    def rank(self) -> tuple[int, str]:
        return self.version + 1, self.anchor_hash


@dataclass(frozen=True)
class KeptRound(RoundStep):
    """A committed round with its merged pseudo-gradient (what a replay applies)."""

    merged: dict[str, torch.Tensor]


@dataclass(frozen=True)
class PackedRound(RoundStep):
    """A committed round as kept for serving: its merged tensors :func:`pack_exact`-ed, in the fragment's names
    order."""

    tensors: tuple[bytes, ...]

    @classmethod
    def of(cls, kept: KeptRound, names: Sequence[str]) -> PackedRound:
        return cls(kept.version, kept.base_hash, kept.anchor_hash, tuple(pack_exact(kept.merged[n]) for n in names))


R = TypeVar("R", bound=RoundStep)


def keep(kept: Sequence[R], new: R, limit: int) -> list[R]:
    """``kept`` with ``new`` in, by version, and only the newest ``limit`` left; a round kept from another base at the
    same version (we rebased onto a fork's winner since) is replaced."""
    return sorted([*(k for k in kept if k.version != new.version), new], key=lambda k: k.version)[-limit:]


def chain(kept: Sequence[R], ours: tuple[int, str]) -> list[R]:
    """The kept rounds that take a learner at ``ours`` = (version, anchor hash) forward, in order: the one applied
    at ``ours``, then the one applied at what it made, and so on (empty if none was applied at ``ours``)."""
    by_base = {k.base: k for k in kept}
    out: list[R] = []
    at = ours
    while at in by_base and len(out) < len(kept):
        out.append(by_base[at])
        at = out[-1].rank
    return out


# ---------------------------------------------------------------- the exact packing


def pack_exact(tensor: torch.Tensor) -> bytes:
    """``tensor`` (float32) stepped (:func:`pack_stepped`) where every block is; else as blocks of :data:`BLOCK`
    values, each its distinct values' bits and a fixed-width index per value. :func:`unpack_exact` gives back every
    bit (``-0.0`` and ``0.0`` stay apart). A tensor with more than 256 distinct values in a block, or one that packs
    no smaller, goes raw."""
    flat = tensor.detach().cpu().contiguous().view(-1).to(torch.float32).view(torch.int32).numpy()
    n = flat.size
    rows = np.concatenate([flat, np.zeros((-n) % BLOCK, np.int32)]).reshape(-1, BLOCK) if n else flat.reshape(0, BLOCK)
    stepped = pack_stepped(rows)
    if stepped is not None:
        return _HEADER.pack(n, STEPPED) + stepped
    order = np.argsort(rows, axis=1, kind="stable")
    ordered = np.take_along_axis(rows, order, axis=1)
    fresh = np.ones_like(ordered, dtype=bool)
    fresh[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    counts = fresh.sum(axis=1)
    top = int(counts.max()) if counts.size else 1
    bits = max(1, math.ceil(math.log2(top))) if top > 1 else 1
    packed_bytes = counts.size + 4 * int(counts.sum()) + -(-counts.size * BLOCK * bits // 8)
    if bits > MAX_INDEX_BITS or packed_bytes >= 4 * n:  # values that do not repeat: raw is smaller
        return _HEADER.pack(n, 0) + flat.astype("<i4").tobytes()
    index = np.empty_like(order)
    np.put_along_axis(index, order, np.cumsum(fresh, axis=1) - 1, axis=1)
    return b"".join([_HEADER.pack(n, bits), (counts - 1).astype(np.uint8).tobytes(),
                     ordered[fresh].astype("<i4").tobytes(), _pack_bits(index, bits)])


def unpack_exact(data: bytes, shape: Sequence[int]) -> torch.Tensor:
    """The float32 tensor of ``shape`` that :func:`pack_exact` packed into ``data``; :class:`PeerDataError`
    (``malformed``) for anything else."""
    n = math.prod(shape)
    if len(data) < _HEADER.size:
        raise PeerDataError(Reason.MALFORMED, "a replayed tensor is shorter than its header")
    count, bits = _HEADER.unpack_from(data)
    body = memoryview(data)[_HEADER.size:]
    if count == n and bits == STEPPED:
        return torch.from_numpy(unpack_stepped(body, n)).view(torch.float32).reshape(tuple(shape))
    if count != n or bits > MAX_INDEX_BITS:
        raise PeerDataError(Reason.MALFORMED, f"a replayed tensor holds {count} values at {bits} bits; expected {n} "
                                              f"values at <= {MAX_INDEX_BITS}")
    if bits == 0:
        if len(body) != 4 * n:
            raise PeerDataError(Reason.MALFORMED, f"a raw replayed tensor of {n} values has {len(body)} bytes")
        values = np.frombuffer(body, "<i4").astype(np.int32)
    else:
        blocks = -(-n // BLOCK)
        counts = np.frombuffer(body[:blocks], np.uint8).astype(np.int64) + 1
        distinct = int(counts.sum())
        index_bytes = -(-blocks * BLOCK * bits // 8)
        if len(body) != blocks + 4 * distinct + index_bytes or (counts > 2**bits).any():
            raise PeerDataError(Reason.MALFORMED, f"a replayed tensor of {n} values has {len(body)} bytes, not what "
                                                  "its header and block counts make")
        book = np.frombuffer(body[blocks:blocks + 4 * distinct], "<i4").astype(np.int32)
        index = _unpack_bits(body[blocks + 4 * distinct:], blocks * BLOCK, bits).reshape(blocks, BLOCK)
        if (index >= counts[:, None]).any():
            raise PeerDataError(Reason.MALFORMED, "a replayed tensor's index points past its block's values")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        values = book[(starts[:, None] + index).reshape(-1)][:n]
    return torch.from_numpy(values.copy()).view(torch.float32).reshape(tuple(shape))


def _step_products(levels: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float32 bits (int64) of ``level x step`` for each value (``levels``: blocks x BLOCK, ``steps``: per block)."""
    return (levels.astype(np.float32) * steps[:, None]).view(np.int32).astype(np.int64)


def pack_stepped(rows: np.ndarray) -> bytes | None:
    """float32 bits ``rows`` (int32, :data:`BLOCK` a row, the last padded with zeros) as stepped blocks, or None where
    a block is not one (or there is none): every value of a block
    within :data:`MAX_ULPS` float32 steps of ``c x t`` for its level ``c`` in -7..7 (``t``: the block's largest
    magnitude / 7), the same number of steps for every value of a level. The body: each block's ``t`` (float32),
    then 8 bytes per block of the 15 levels' steps off (4 bits each, +8), then the values' levels (4 bits each, +8)."""
    values = rows.view(np.float32)
    if not values.size or not np.isfinite(values).all():
        return None
    steps = (np.abs(values).max(axis=1) / np.float32(LEVELS)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        rounded = np.where(steps[:, None] > 0, np.rint(values / steps[:, None]), 0.0)
    if (np.abs(rounded) > LEVELS).any():
        return None
    levels = rounded.astype(np.int64)  # integers, as unpacking reads them: a level of -0.0 would make -0.0
    off = values.view(np.int32).astype(np.int64) - _step_products(levels, steps)
    if (np.abs(off) > MAX_ULPS).any():
        return None
    slot = (np.arange(levels.shape[0])[:, None] * (2 * LEVELS + 1) + levels + LEVELS).reshape(-1)
    per_level = np.zeros(levels.shape[0] * (2 * LEVELS + 1), np.int64)
    per_level[slot] = off.reshape(-1)  # one of each level's values; all must agree with it
    if (per_level[slot] != off.reshape(-1)).any():
        return None
    table = np.concatenate([per_level.reshape(-1, 2 * LEVELS + 1) + 8, np.full((levels.shape[0], 1), 8)], axis=1)
    return b"".join([steps.astype("<f4").tobytes(), _pack_bits(table, 4), _pack_bits(levels + 8, 4)])


def _pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Values 0..2**bits - 1, each in ``bits`` bits, big-endian, back to back (the last byte padded with zeros)."""
    planes = np.unpackbits(values.astype(np.uint8)[..., None], axis=-1)[..., 8 - bits:]
    return np.packbits(planes.reshape(-1)).tobytes()


def _unpack_bits(data: memoryview, count: int, bits: int) -> np.ndarray:
    """The first ``count`` values of ``bits`` bits each that :func:`_pack_bits` wrote into ``data`` (int64)."""
    planes = np.unpackbits(np.frombuffer(data, np.uint8))[:count * bits].reshape(-1, bits)
    padded = np.concatenate([np.zeros((count, 8 - bits), np.uint8), planes], axis=1)
    return np.packbits(padded, axis=1).reshape(-1).astype(np.int64)


def unpack_stepped(body: memoryview, n: int) -> np.ndarray:
    """The float32 bits (int32) of ``n`` values that :func:`pack_stepped` made ``body`` of; :class:`PeerDataError`
    (``malformed``) for anything else."""
    blocks = -(-n // BLOCK)
    table_bytes, level_bytes = blocks * (LEVELS + 1), blocks * BLOCK // 2
    if len(body) != 4 * blocks + table_bytes + level_bytes:
        raise PeerDataError(Reason.MALFORMED, f"a stepped replayed tensor of {n} values has {len(body)} bytes")
    steps = np.frombuffer(body[:4 * blocks], "<f4").astype(np.float32)
    if not (np.isfinite(steps).all() and (steps >= 0).all()):
        raise PeerDataError(Reason.MALFORMED, "a stepped replayed tensor has a negative or non-finite step")
    table = _unpack_bits(body[4 * blocks:4 * blocks + table_bytes], blocks * 2 * (LEVELS + 1), 4) - 8
    levels = _unpack_bits(body[4 * blocks + table_bytes:], blocks * BLOCK, 4).reshape(blocks, BLOCK) - 8
    if (np.abs(levels) > LEVELS).any():
        raise PeerDataError(Reason.MALFORMED, "a stepped replayed tensor has a level outside -7..7")
    off = table.reshape(blocks, 2 * (LEVELS + 1))[np.arange(blocks)[:, None], levels + LEVELS]
    return (_step_products(levels, steps) + off).astype(np.int32).reshape(-1)[:n]


# ---------------------------------------------------------------- the wire


def rounds_payload(rounds: Sequence[PackedRound]) -> bytes:
    """What a learner sends one that replays: ``[version, base hash, anchor hash, [packed tensors in names order]]``
    per round, msgpack."""
    return msgpack.packb([[k.version, k.base_hash, k.anchor_hash, list(k.tensors)] for k in rounds],
                         use_bin_type=True)


def parse_rounds(data: bytes, names: Sequence[str], shapes: Mapping[str, torch.Size],
                 ours: tuple[int, str]) -> list[KeptRound]:
    """The rounds in ``data`` (:func:`rounds_payload`), checked: a chain from ``ours``, each tensor of its shape and
    finite. :class:`PeerDataError` (``malformed``) otherwise; an empty list if the sender kept none from ``ours``."""
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise PeerDataError(Reason.MALFORMED, f"replayed rounds: not msgpack ({e})"[:200]) from None
    if not isinstance(items, list) or len(items) > MAX_KEPT_ROUNDS:
        raise PeerDataError(Reason.MALFORMED, f"replayed rounds: expected a list of at most {MAX_KEPT_ROUNDS}")
    out: list[KeptRound] = []
    at = ours
    for item in items:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], int)
                and all(isinstance(h, str) and len(h) == 16 for h in item[1:3])
                and isinstance(item[3], list) and len(item[3]) == len(names)
                and all(isinstance(b, bytes) for b in item[3])):
            raise PeerDataError(Reason.MALFORMED, "replayed rounds: a round is not [version, base, anchor, tensors]")
        if (item[0], item[1]) != at:
            raise PeerDataError(Reason.MALFORMED, f"replayed rounds: a round applied at v{item[0]} ({item[1]}) where "
                                                  f"the chain is at v{at[0]} ({at[1]})")
        merged = {n: unpack_exact(b, shapes[n]) for n, b in zip(names, item[3])}
        if not all(bool(torch.isfinite(t).all()) for t in merged.values()):
            raise PeerDataError(Reason.NON_FINITE, "replayed rounds: a merged pseudo-gradient is not finite")
        out.append(KeptRound(item[0], item[1], item[2], merged))
        at = out[-1].rank
    return out
