"""Bounded groups: which peers average together in a round, how a group merges versions and anchors,
and how far apart anchors may drift (docs/design.md, "Bounded groups").

When no round can hold every peer, each round splits the live peers into groups of at most G
(``averaging.target_group_size``) on a Moshpit-style grid (Ryabinin et al., 2021, "Moshpit SGD"):
the live peers, ranked by a salted hash of their ids, are the cells of a d-dimensional grid whose
sides are at most G; round k groups the peers that differ only along axis ``k mod d``. Consecutive
rounds average along different axes, so a change made anywhere reaches every peer within d rounds
on a full grid (the exact global mean), 2d on a partial one, while each all-reduce stays small.
Groups do not compete: every group that commits keeps its update, and the anchors of different
groups *converge* (their consensus distance is bounded, :func:`consensus_bound`) instead of being
bit-identical.

Everything here is pure (peer ids, round numbers, sizes in; groups and numbers out): the networked
learner and the simulation (``p2p_diloco/sim/scale.py``) take the same decisions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def grid_sides(peers: int, target_group_size: int) -> tuple[int, ...]:
    """The grid's sides for ``peers`` live peers and groups of at most ``target_group_size`` (0: no cap,
    one group of everyone). The fewest axes d with G**d >= peers, then sides as equal as possible
    (each at most G, their product at least ``peers``, the smaller ones last): equal sides make every
    round's groups alike and the mixing bound (:func:`consensus_bound`) the tightest."""
    if peers < 1:
        raise ValueError(f"peers must be >= 1, got {peers}")
    if target_group_size != 0 and target_group_size < 2:
        raise ValueError(f"target_group_size must be 0 (no cap) or >= 2, got {target_group_size}")
    if target_group_size == 0 or peers <= target_group_size:
        return (peers,)
    axes = 1
    while target_group_size**axes < peers:
        axes += 1
    side = 2
    while side**axes < peers:
        side += 1
    sides = [side] * axes
    for a in reversed(range(axes)):
        while sides[a] > 1 and math.prod(sides) // sides[a] * (sides[a] - 1) >= peers:
            sides[a] -= 1
    return tuple(sides)


def grid_rank(peers: Sequence[str], salt: str = "") -> list[str]:
    """The peers in grid order: by SHA-256 of ``salt/peer id``. The salt (the run id and fragment) makes
    grids of different runs and fragments unrelated; every peer computes the same order from the ids."""
    if len(set(peers)) != len(peers):
        raise ValueError("peer ids must be distinct")
    return sorted(peers, key=lambda p: hashlib.sha256(f"{salt}/{p}".encode()).digest())


def round_axis(round_index: int, sides: Sequence[int]) -> int:
    """The grid axis that round ``round_index`` averages along: the axes in turn."""
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    return round_index % len(sides)


def assign_groups(peers: Sequence[str], round_index: int, target_group_size: int,
                  salt: str = "") -> list[tuple[str, ...]]:
    """The groups of one round: every peer in exactly one group of at most ``target_group_size`` peers
    (all of them with 0). Cell i of the grid is the i-th peer in :func:`grid_rank` order; a group is the
    peers whose grid coordinates are equal except along :func:`round_axis`. Groups are listed by their
    first cell, members in grid order along the axis."""
    if not peers:
        return []
    order = grid_rank(peers, salt)
    sides = grid_sides(len(order), target_group_size)
    axis = round_axis(round_index, sides)
    stride = math.prod(sides[:axis])
    groups: dict[int, list[str]] = {}
    for cell, peer in enumerate(order):
        digit = (cell // stride) % sides[axis]
        groups.setdefault(cell - digit * stride, []).append(peer)
    return [tuple(groups[k]) for k in sorted(groups)]


def live_groups(roster: Sequence[str], live: Collection[str], round_index: int, target_group_size: int,
                salt: str = "") -> list[tuple[str, ...]]:
    """The groups of one round over a *roster* (every peer id seen in the run's records lately, live or not),
    each restricted to the live peers, empty ones left out. Cells are ranks in the roster, so a peer that
    dies or comes back leaves a hole or fills its own cell and moves nobody else: ranked among the live
    peers only, every death would shift the cells of all peers after it and the grid would be reshuffled
    (near random groups) every round."""
    groups = []
    for group in assign_groups(roster, round_index, target_group_size, salt):
        kept = tuple(p for p in group if p in live)
        if kept:
            groups.append(kept)
    return groups


def group_of(peer: str, peers: Sequence[str], round_index: int, target_group_size: int,
             salt: str = "") -> tuple[str, ...]:
    """The group ``peer`` belongs to in this round (its matchmaking key is the group's first member)."""
    for group in assign_groups(peers, round_index, target_group_size, salt):
        if peer in group:
            return group
    raise ValueError(f"peer {peer!r} is not among the live peers")


def mixing_rounds(peers: int, target_group_size: int) -> int:
    """Rounds after which a change made at one peer has reached every peer, with a fixed live set and
    every round committed: d on a full grid (then every peer holds the exact mean), 2d on a partial one
    (any cell reaches cell 0 by lowering its coordinates one axis at a time, and cell 0 reaches any cell
    by raising them: every intermediate cell exists because it is at most the larger end)."""
    sides = grid_sides(peers, target_group_size)
    return len(sides) if math.prod(sides) == peers else 2 * len(sides)


def consensus_bound(sides: Sequence[int], update_spread: float) -> float:
    """Upper bound on the consensus distance (RMS over peers of ||anchor_i - mean anchor||) in steady state,
    every round committed: ``update_spread`` x sum over k = 1..d-1 of 1/sqrt(P_k), with P_k the product of
    the k smallest sides and ``update_spread`` the RMS spread of one round's updates (||u_i - mean u||).

    Why: after d rounds along d distinct axes a round's updates are averaged over the whole (full) grid,
    so only the last d - 1 rounds' updates still differ between peers; the one from k + 1 rounds ago has
    been averaged over at least P_{k+1} peers, which shrinks a spread of independent updates by
    sqrt(P_{k+1}) in expectation. Adding the rounds' parts (triangle inequality, no independence across
    rounds needed) gives the bound; 0 with one group. It bounds the expected spread: one draw of the
    updates may exceed it by its sampling fluctuation (about 1% with 256 peers of 64 numbers each)."""
    if update_spread < 0:
        raise ValueError(f"update_spread must be >= 0, got {update_spread}")
    ordered = sorted(sides)
    return update_spread * sum(1.0 / math.sqrt(math.prod(ordered[:k])) for k in range(1, len(ordered)))


def merged_version(versions: Sequence[int], round_index: int) -> int:
    """The version a group commits at round ``round_index``: ``round_index + 1``, whatever its members'
    versions were (a member that missed rounds still takes part; its older anchor is averaged in). Versions
    count rounds of the swarm clock, so all groups of a round commit the same version and none is a fork.
    A member claiming a version past this round is refused (ValueError): it is not on this clock."""
    if not versions:
        raise ValueError("a group needs at least one member")
    if min(versions) < 0 or max(versions) > round_index:
        raise ValueError(f"member versions {sorted(set(versions))} not within [0, {round_index}]")
    return round_index + 1


def needs_download(version: int, newest: int, max_lag_rounds: int) -> bool:
    """Should a learner at ``version`` download an anchor before its next round, the newest live version
    being ``newest``? Only if it lags more than ``max_lag_rounds`` (the mixing time, :func:`mixing_rounds`):
    a smaller lag is healed by averaging, and its progress is kept either way (rebase)."""
    return newest - version > max_lag_rounds


def heir(dead: str, last_group: Sequence[str], live: Collection[str]) -> str | None:
    """Who takes over the weight of a peer that died (its tombstone, or its record expired): the live member of
    its last committed group with the smallest id, None if none is left. They held the same anchor when that
    round committed, so moving the weight keeps the weighted sum of anchors (the global model) nearly where it
    was; every former group-mate computes the same heir, and only the heir acts."""
    mates = [p for p in last_group if p != dead and p in live]
    return min(mates) if mates else None


def weighted_merge(anchors: Mapping[str, Any], weights: Mapping[str, float], updates: Mapping[str, Any]) -> tuple[Any, float]:
    """One committed group's result, the same for every member: (anchor, weight). The anchor is the weighted
    mean of the members' anchors plus the sum of their updates over the group's weight, and each member gets an
    equal share of that weight; the weighted sum of anchors over the swarm thus grows by exactly the updates
    (push-sum, Kempe et al. 2003: no update is weighed down because of the group it met). Summed in peer-id
    order (:func:`mean_in_peer_order`), so the bits do not depend on arrival order."""
    if set(anchors) != set(weights) or set(anchors) != set(updates):
        raise ValueError("anchors, weights and updates must name the same members")
    total = sum(weights[p] for p in sorted(weights))
    if not total > 0:
        raise ValueError(f"the group's weight must be > 0, got {total}")
    n = len(anchors)
    weighted = mean_in_peer_order({p: anchors[p] * weights[p] for p in anchors}) * n
    summed = mean_in_peer_order(dict(updates)) * n
    return (weighted + summed) / total, total / n


def mean_in_peer_order(values: Mapping[str, Any]) -> Any:
    """The uniform mean of the members' values (anchors, momenta: tensors or arrays), summed in peer-id order
    so that every member gets the same bits whatever order the values arrived in."""
    if not values:
        raise ValueError("no values to average")
    ids = sorted(values)
    total = values[ids[0]] * 1.0
    for pid in ids[1:]:
        total = total + values[pid]
    return total / len(ids)


def swarm_distance_estimate(per_axis_rms: Sequence[float]) -> float:
    """An upper estimate of the swarm's consensus distance (RMS over peers) from the last d rounds' in-group
    distances (per round, the RMS over peers of the distance to their group's mean anchor: one value per
    axis): sqrt of the sum of squares. On a full grid with the anchors held fixed, the deviations from the
    global mean split into orthogonal parts (an analysis of variance over the axes) and each part is seen by
    at least one axis's groups, so the sum over axes is at least the total."""
    return math.sqrt(sum(d * d for d in per_axis_rms))


def clock_group(run_id: str, fragment: int, rank: tuple[int, str], round_index: int, own_id: str,
                peers: Mapping[str, tuple[int, str]]) -> tuple[str, tuple[str, ...]]:
    """Groups from the clock: the group of our round ``round_index`` (a name unique to the clock's round: the engine
    passes its boundary's DHT milliseconds) of ``fragment`` at ``rank`` (our version and
    anchor hash), from what every member already holds -- the clock's round and the live records (``peers``: the
    other live learners' rank of the fragment, by peer id). Returns ``(group id, members)``: the members are us and
    every peer at exactly our rank, sorted by peer id; the id hashes the run, the fragment, the rank, the round and
    the member list, so members whose views agree derive the same group and members whose views differ (a record
    that lagged, a peer that just left) derive different ids -- their round fails for all of them alike, never
    half-applied (docs/design.md, "Rounds that cost their bytes")."""
    members = tuple(sorted({own_id, *(p for p, r in peers.items() if tuple(r) == tuple(rank))}))
    blob = "\n".join((run_id, str(fragment), str(rank[0]), rank[1], str(round_index), *members))
    return hashlib.sha256(blob.encode()).hexdigest()[:16], members


def without_absent(group_id: str, members: Sequence[str], absent: Collection[str],
                   declined: Collection[str] = (), left: Collection[str] = ()) -> tuple[str, tuple[str, ...]]:
    """Groups from the clock: the group that goes on when ``absent`` members of group ``group_id`` did not show by its
    deadline and ``declined`` ones said they will not (a member that skips the boundary: its link still carries
    another round, or its last round of the fragment is still in flight). Returns ``(id, members that showed)``, or
    ``("", ())`` when the round must fail for all alike instead: fewer than two showed, or not more than half of the
    group's members. A member that declined counts as one that did not show: it fails the round at once instead of
    at the deadline, but it does not shrink the majority. (It did for a while, and two disjoint pairs of four
    learners committed the same version at 0.5 Mbit/s: a member that declines one boundary is free at the next, and
    a member whose round is still in flight declines a group that competes with its own; only a part holding more
    than half of the whole group keeps every other part -- at this boundary or another -- a minority.) The id hashes
    the group's and the members that showed, so members that saw different members missing derive different groups
    and fail alike, never half-applied; a member that sees nobody missing never asks for it.

    Members that ``left`` -- done training, they said so when asked for their offer, and no round of theirs follows --
    leave the group itself: the majority counts the members that stay. A learner that ends its run a few seconds
    before the others stays in the records that name it until their next full read (half a minute), and the group
    of the two that trained on failed as "2 of 4 members showed". A member that left belongs to no group at this
    boundary or any later one, so the rest keeps every other part a minority as before; a decider that heard of a
    departure as silence only counts the member in, which fails the round, never forks it."""
    gone = set(absent) | set(declined)
    staying = tuple(m for m in members if m not in set(left))
    showed = tuple(m for m in staying if m not in gone)
    if len(showed) < 2 or 2 * len(showed) <= len(staying) or len(showed) == len(members):
        return "", ()
    blob = "\n".join((group_id, "without", *showed))
    return hashlib.sha256(blob.encode()).hexdigest()[:16], showed


def group_leaders(group_id: bytes, members: Sequence[str]) -> list[str]:
    """Groups from the clock: the members that may decide the round of group ``group_id`` -- who showed, whether the
    group goes on without the others (:func:`without_absent`) -- in the order they are asked, the same on every
    member: a hash of the group's id and each member orders them, so that a member that died comes first in only its
    share of the rounds that still name it. The first one decides; a member that cannot reach it (its process is
    gone: the connection fails at once) asks the next. Two deciders' groups each hold more than half of the group,
    so they share a member, which runs only one of them: at most one commits."""
    return sorted(members, key=lambda m: hashlib.sha256(group_id + b"/" + m.encode()).digest())
