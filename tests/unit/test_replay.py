"""Catch-up by replay, its pure parts (p2p_diloco/core/replay.py and FragmentSync.replayed): the exact packing of a
merged pseudo-gradient, the kept rounds and their chain, the wire form's checks, and a replay that reaches the
swarm's anchor bit for bit -- or refuses."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from p2p_diloco.averaging.decisions import anchor_hash
from p2p_diloco.core import outer
from p2p_diloco.core.codecs import local_roundtrip
from p2p_diloco.core.config import OuterConfig
from p2p_diloco.core.rejects import PeerDataError, Reason
from p2p_diloco.core.replay import (
    BLOCK,
    MAX_KEPT_ROUNDS,
    STEPPED,
    KeptRound,
    PackedRound,
    chain,
    keep,
    pack_exact,
    parse_rounds,
    rounds_payload,
    unpack_exact,
)
from p2p_diloco.sync.fragment import FragmentSync
from p2p_diloco.sync.slot import FragmentSlot

SHAPES = {"w": torch.Size([40, 50]), "b": torch.Size([7])}
NAMES = ("b", "w")


def int4_average(n: int, seed: int, cuts: int = 4) -> torch.Tensor:
    """What an int4 all-reduce among ``cuts`` reducers leaves: each part quantized on its own (blocks from the part's
    start), decoded, concatenated, then scaled as a radial merge scales it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.01
    bounds = [round(i * n / cuts) + (7 if 0 < i < cuts else 0) for i in range(cuts + 1)]
    return torch.cat([local_roundtrip("int4", x[a:b]) for a, b in zip(bounds, bounds[1:])]) * 0.7317


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_an_int4_average_packs_exactly_into_a_fraction_of_its_fp32_bytes() -> None:
    merged = int4_average(20_000, seed=0)
    merged[3] = -0.0  # apart from 0.0: an anchor's hash tells them apart
    packed = pack_exact(merged)
    assert torch.equal(bits(unpack_exact(packed, merged.shape)), bits(merged))
    assert len(packed) < 1.4 * merged.numel()  # ~1.25 bytes a value, not 4 (nor 8 for a state's anchor and momentum)


@pytest.mark.parametrize("factor", [1.0, 0.7317, 1 / 3, 812.5])
def test_a_merged_int4_round_on_the_block_grid_packs_stepped_into_little_more_than_its_wire_bytes(factor: float) -> None:
    """What a round over hivemind merges: parts on the quantizer's block grid, decoded, times the radial merge's
    factor (each value rounded twice): stepped, about 0.59 bytes a value (the int4 wire takes 0.53), bit for bit."""
    g = torch.Generator().manual_seed(3)
    merged = local_roundtrip("int4", torch.randn(5 * BLOCK + 17, generator=g) * 0.01) * factor
    packed = pack_exact(merged)
    assert packed[8] == STEPPED
    assert torch.equal(bits(unpack_exact(packed, merged.shape)), bits(merged))
    assert len(packed) < 0.65 * merged.numel() + 64
    merged[200] = -0.0  # not a level times a step: the table holds it, still bit for bit
    packed = pack_exact(merged)
    assert packed[8] != STEPPED and torch.equal(bits(unpack_exact(packed, merged.shape)), bits(merged))


@pytest.mark.parametrize("harm", ["cut", "level", "step", "long"])
def test_a_stepped_packing_that_was_tampered_with_is_refused(harm: str) -> None:
    merged = local_roundtrip("int4", torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(4)))
    packed = bytearray(pack_exact(merged))
    assert packed[8] == STEPPED
    if harm == "cut":
        packed = packed[:-1]
    elif harm == "level":
        packed[-1] &= 0xF0  # a level of nibble 0: -8, outside -7..7
    elif harm == "step":
        packed[9:13] = struct.pack("<f", -1.0)
    else:
        packed += b"\0"
    with pytest.raises(PeerDataError) as e:
        unpack_exact(bytes(packed), merged.shape)
    assert e.value.reason == Reason.MALFORMED


@pytest.mark.parametrize("shape", [(0,), (1,), (BLOCK - 1,), (BLOCK + 1, 3), (5, 0)])
def test_any_float32_tensor_comes_back_bit_for_bit(shape: tuple[int, ...]) -> None:
    t = torch.randn(shape)  # values that do not repeat go raw
    assert torch.equal(bits(unpack_exact(pack_exact(t), shape)), bits(t))
    z = torch.zeros(shape)
    assert torch.equal(bits(unpack_exact(pack_exact(z), shape)), bits(z))


def test_a_random_tensor_goes_raw_no_larger_than_its_bytes() -> None:
    t = torch.randn(1000)
    assert len(pack_exact(t)) <= 4 * 1000 + 16


@pytest.mark.parametrize("cut", [0, 5, 9, -1])
def test_a_cut_or_foreign_packing_is_refused(cut: int) -> None:
    packed = pack_exact(int4_average(1000, seed=1))
    with pytest.raises(PeerDataError) as e:
        unpack_exact(packed[:cut] if cut >= 0 else packed + b"\0", (1000,))
    assert e.value.reason == Reason.MALFORMED
    with pytest.raises(PeerDataError):
        unpack_exact(packed, (999,))  # another shape


def kept(version: int, base: str, after: str) -> KeptRound:
    return KeptRound(version, base, after, {n: torch.zeros(SHAPES[n]) for n in NAMES})


def test_the_newest_rounds_are_kept_and_chained_from_a_rank() -> None:
    rounds: list[KeptRound] = []
    for v in range(6):
        rounds = keep(rounds, kept(v, f"{v:016x}", f"{v + 1:016x}"), limit=4)
    assert [k.version for k in rounds] == [2, 3, 4, 5]
    assert [k.version for k in chain(rounds, (3, f"{3:016x}"))] == [3, 4, 5]
    assert chain(rounds, (3, "f" * 16)) == []  # another anchor at v3 (a fork): nothing to replay
    assert chain(rounds, (1, f"{1:016x}")) == []  # too far behind: download
    rebased = keep(rounds, kept(5, "e" * 16, "d" * 16), limit=4)  # the same version from another base replaces it
    assert [k.base_hash for k in rebased if k.version == 5] == ["e" * 16]


def test_the_wire_form_is_checked_as_a_chain_from_our_rank() -> None:
    a = KeptRound(3, "a" * 16, "b" * 16, {n: int4_average(SHAPES[n].numel(), 2).reshape(SHAPES[n]) for n in NAMES})
    b = KeptRound(4, "b" * 16, "c" * 16, {n: int4_average(SHAPES[n].numel(), 3).reshape(SHAPES[n]) for n in NAMES})
    data = rounds_payload([PackedRound.of(a, NAMES), PackedRound.of(b, NAMES)])
    got = parse_rounds(data, NAMES, SHAPES, (3, "a" * 16))
    assert [(k.base, k.rank) for k in got] == [(a.base, a.rank), (b.base, b.rank)]
    assert all(torch.equal(bits(k.merged[n]), bits(o.merged[n])) for k, o in zip(got, (a, b)) for n in NAMES)
    assert parse_rounds(rounds_payload([]), NAMES, SHAPES, (3, "a" * 16)) == []
    with pytest.raises(PeerDataError, match="where the chain is at v3"):
        parse_rounds(data, NAMES, SHAPES, (3, "f" * 16))  # not from our rank
    with pytest.raises(PeerDataError, match="where the chain is at v4"):
        parse_rounds(rounds_payload([PackedRound.of(a, NAMES), PackedRound.of(a, NAMES)]), NAMES, SHAPES,
                     (3, "a" * 16))  # a gap
    nan = KeptRound(3, "a" * 16, "b" * 16, {n: torch.full(SHAPES[n], float("nan")) for n in NAMES})
    with pytest.raises(PeerDataError) as e:
        parse_rounds(rounds_payload([PackedRound.of(nan, NAMES)]), NAMES, SHAPES, (3, "a" * 16))
    assert e.value.reason == Reason.NON_FINITE
    for bad in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([[3, "a" * 16, "b" * 16, [b"x"]]]),
                msgpack.packb([[3, "a" * 16, "b", [b"x", b"y"]]]), msgpack.packb([[]] * (MAX_KEPT_ROUNDS + 1))):
        with pytest.raises(PeerDataError):
            parse_rounds(bad, NAMES, SHAPES, (3, "a" * 16))


def swarm_member(o: OuterConfig) -> FragmentSync:
    g = torch.Generator().manual_seed(5)
    slot = FragmentSlot(0, NAMES, {n: torch.randn(SHAPES[n], generator=g) for n in NAMES})
    sync = FragmentSync(slot, None, o, None, hash_anchor=anchor_hash)
    slot.anchor_hash = anchor_hash(slot.anchor)
    return sync


def test_replaying_the_rounds_we_missed_reaches_the_swarms_anchor_and_momentum_exactly() -> None:
    o = OuterConfig(lr=0.7, momentum=0.9)
    ahead, behind = swarm_member(o), swarm_member(o)
    rounds: list[KeptRound] = []
    for v in range(3):  # the swarm commits three rounds; "behind" misses them
        merged = {n: int4_average(SHAPES[n].numel(), 10 + v).reshape(SHAPES[n]) for n in NAMES}
        base = ahead.slot.rank
        outer.nesterov_step(ahead.slot.anchor, merged, ahead.slot.state, o.lr, o.momentum)
        ahead.slot.anchor_hash = anchor_hash(ahead.slot.anchor)
        rounds = keep(rounds, KeptRound(base[0], base[1], ahead.slot.anchor_hash, merged), limit=4)
    packed = rounds_payload([PackedRound.of(k, NAMES) for k in chain(rounds, behind.slot.rank)])
    state = behind.replayed(parse_rounds(packed, NAMES, SHAPES, behind.slot.rank))
    assert state is not None
    assert (state.version, state.anchor_hash) == ahead.slot.rank
    assert all(torch.equal(state.momentum[n], ahead.slot.state.momentum[n]) for n in NAMES)
    assert behind.slot.version == 0  # nothing applied yet: the caller applies it as a download's
    # a round whose step does not make the anchor it names (another momentum, a tampered average): refused
    behind.slot.state.momentum = {n: torch.ones(SHAPES[n]) for n in NAMES}
    assert behind.replayed(chain(rounds, behind.slot.rank)) is None
    assert behind.replayed([]) is None and behind.replayed(rounds[1:]) is None  # nothing, or not from our rank
