"""The decisions of a round, as pure functions of what the members gathered: who is ahead (:func:`anchor_order`),
whether a group is sound (:func:`check_group`), whether it commits (:func:`commit_decision`), the group keys
(:func:`version_group_bits`, :func:`grid_group_bits`), the vouches a download needs (:func:`vouchers`), the
matchmaking window (:func:`adapt_window`) and the metadata a member sends (:class:`RoundMeta`). Why each
holds: the package overview (:mod:`p2p_diloco.averaging`)."""

from __future__ import annotations

import hashlib
import logging
import math
import re
import statistics
import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from p2p_diloco.core import outer
from p2p_diloco.core.config import AveragingConfig
from p2p_diloco.core.rejects import PeerDataError, Reason, log_rejection, reason_of

if TYPE_CHECKING:
    from p2p_diloco.sync.fragment import Contribution

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.25
"""How often a waiting round checks whether the learner is leaving."""
HIVEMIND_FRAMING_BYTES = 9
"""Bytes hivemind adds around each protobuf message on a stream (8-byte length + marker)."""
VERSION_BITS = 8
"""Group-key bits that carry the fragment version (mod 256): peers at other versions never meet."""
ANCHOR_BITS = 4
"""Group-key bits from the anchor hash: the two sides of a fork rarely (1 in 16) meet."""
MAX_GROUP_SIZE = 4096
MAX_DONORS_TRIED = 4
"""A download tries at most this many donors (its host-side deadline allows each its derived budget)."""
MAX_WIRE_INT = 2**63 - 1
"""Largest integer gathered metadata or a state download may carry (msgpack's int64)."""
MAX_NORMS = 1 << 16
"""Most radial norms a member's gathered metadata may carry (one per tensor of the fragment)."""
MAX_STATE_METADATA_BYTES = 4096
"""A state download's msgpack metadata is four scalars; anything longer is refused before decoding."""
STATE_METADATA_KEYS = frozenset({"fragment", "version", "anchor", "momentum"})
ANCHOR_RE = re.compile(r"^[0-9a-f]{16}$")
VOUCH_TTL_S = 24 * 3600.0
"""How long a committer's signed "(version, anchor hash) is mine" entry lives in the DHT: a downloaded state
needs one from a peer other than its donor, so a swarm whose newest version is older than this cannot be
joined by download (every member re-vouches its anchor each time it commits or rebases)."""
VOUCH_WAIT_S = 3.0
"""A downloaded state's vouches are re-read for this long before it is refused: the other committers'
entries are stored at the moment the donor's own commit lands, and can reach the DHT a little later."""
VOUCH_POLL_S = 0.25


def missing_reason(showed: int, named: int, declined: int = 0, left: int = 0) -> str:
    """Why a group from the clock failed for all: ``showed`` of the ``named`` members were in (``declined`` of the
    others said they skip the boundary, ``left`` that they are done), too few to go on without the rest."""
    said = ", ".join(f"{n} {what}" for n, what in ((declined, "declined"), (left, "left")) if n)
    return f"{MISSING}: {showed} of {named} members showed" + (f" ({said})" if said else "")


def anchor_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """16 hex digits over names, shapes, dtypes and bytes (name order): equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def version_group_bits(version: int, anchor: str = "") -> str:
    """The group-key bits of a fragment's anchor: the version mod 2**VERSION_BITS, then ANCHOR_BITS
    bits of the anchor hash (none if ``anchor`` is empty), so that the two sides of a fork -- equal
    version, different anchors -- do not meet and spoil each other's rounds while one side catches up."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    bits = format(version % (1 << VERSION_BITS), f"0{VERSION_BITS}b")
    if anchor:
        bits += format(int(anchor[0], 16), "04b")[:ANCHOR_BITS]
    return bits


GRID_KEY_BITS = 16
"""Group-key bits of a grid group (``averaging.groups = "grid"``): a hash of its round and first cell."""
NO_GROUP = "could not find a group"
"""Why a round of one member fails (hivemind's words for it)."""
MISSING = "incomplete group"
"""Why a group from the clock fails for all its members when one it names did not show by its scheduled time."""
ANCHOR_TENSOR = "anchor:"
MOMENTUM_TENSOR = "momentum:"
"""Name prefixes of the anchor and outer momentum tensors a grid round averages beside the pseudo-gradient."""


def grid_group_bits(round_key: int, first_member: str) -> str:
    """The group key of a grid group (:func:`p2p_diloco.core.groups.group_of`): ``GRID_KEY_BITS`` bits of a hash of
    the round (its clock boundary) and the group's first member, so that each of a round's groups meets under its own
    key and a group of another round never does."""
    digest = hashlib.sha256(f"{round_key}/{first_member}".encode()).digest()
    return format(int.from_bytes(digest[:4], "big") >> (32 - GRID_KEY_BITS), f"0{GRID_KEY_BITS}b")


def grid_version(members: Sequence[RoundMeta]) -> int:
    """The version a grid group commits: one past its most advanced member's. Members may come from different
    groups of earlier rounds (other versions, other anchors: averaging them is what mixes the swarm); every member
    computes the same from the gathered metadata. Versions count a fragment's committed rounds along the way to it."""
    return max(m.version for m in members) + 1


def anchor_order(version: int, anchor: str) -> tuple[int, int]:
    """Total order of (version, anchor hash): newer versions first; at equal versions (a fork: two groups
    each committed the same version) the *smaller* hash wins. Every peer ranks the same way, so the
    losing side of a fork adopts the winner's anchor (state download + rebase) and the forks heal."""
    return version, -int(anchor, 16) if anchor else 0


def is_ahead(theirs: tuple[int, str], ours: tuple[int, str]) -> bool:
    """Is a peer's (version, anchor hash) ahead of ours in :func:`anchor_order`?"""
    return anchor_order(*theirs) > anchor_order(*ours)


def round_is_doomed(ours: tuple[int, str], peers: Sequence[tuple[int, str]]) -> bool:
    """Must a round at ``ours`` = (version, anchor hash) not start? When a live peer is at a newer version: that
    version is taken -- a group committed it -- and a second group committing it from our version would fork the
    fragment, which only a full fp32 state download heals; the peer ahead keeps the rounds we missed, and catching up
    replays them (a few int4 averages). And when a live peer wins a fork at our version and none is where we are:
    groups meet only at one version and anchor (:func:`version_group_bits`), so the round would find nobody. A learner
    behind then catches up instead (its progress waits for the next round), rather than hold the fragment through a
    round that forks or ends only at its deadline. (A peer at our version once sufficed to go ahead: at 0.25 Mbit/s
    two pairs of four learners, each a version behind the other pair, committed the version the others held, and
    each fork cost a 1.6 MB download of 59-74 s on the link.)"""
    return any(p[0] > ours[0] for p in peers) or (
        any(is_ahead(p, ours) for p in peers) and not any(p == ours for p in peers))


def sharing_priority(version: int, anchor: str) -> float:
    """hivemind state-sharing priority that follows :func:`anchor_order` (donors are tried highest first):
    the version plus a fraction in [0, 1) that is larger for smaller hashes."""
    if not anchor:
        return float(version)
    return version + (0xFFFFFFFF - int(anchor[:8], 16)) / 2.0**32


def donor_order(priorities: Mapping[str, float], own_id: str, ours: float, fragment: int = 0) -> list[str]:
    """The donors to download a fragment's state from, in the order to try them: only peers ahead of us
    (their :func:`sharing_priority` above ours ``ours``), the best rank first; peers of equal rank (the
    same version and anchor, the usual case) in rendezvous-hash order of (our id, their id), so that
    newcomers spread over the donors instead of all starting with the same one, and each newcomer's
    order is stable; the best ones rotated by ``fragment``, so that one learner's fragments start with
    different donors and its catch-up, fragment after fragment, moves from one donor's uplink to the next
    (at 0.5 Mbit/s a paused learner's every replay and download came from one donor, whose own rounds
    slowed until the clock's period doubled)."""
    ahead = [(p, d) for d, p in priorities.items() if d != own_id and math.isfinite(p) and p > ours]
    order = [d for _, d in sorted(ahead, key=lambda pd: (-pd[0], hashlib.sha256(f"{own_id}/{pd[1]}".encode()).digest()))]
    top = max((p for p, _ in ahead), default=math.nan)
    best = sum(1 for p, _ in ahead if p == top)
    turn = fragment % best if best else 0
    return order[turn:best] + order[:turn] + order[best:]


def state_size_cap(shapes: Sequence[torch.Size]) -> int:
    """The most bytes a state download of these tensors may take: anchor + momentum in fp32, plus 10%
    and 64 KiB for framing and metadata. A donor that sends more is dropped."""
    elements = sum(math.prod(s) for s in shapes)
    return int(2 * 4 * elements * 1.1) + 65536


def relative_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all tensors of a fragment: the consensus distance of two anchors."""
    num = math.sqrt(sum(float((a[n] - b[n]).double().pow(2).sum()) for n in b))
    den = math.sqrt(sum(float(b[n].double().pow(2).sum()) for n in b))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def averager_prefix(run_id: str, fragment: int) -> str:
    """hivemind key prefix of one fragment's averager (no dots allowed by hivemind)."""
    return f"{run_id.replace('.', '_')}_frag{fragment}"


def vouch_key(prefix: str, version: int) -> str:
    """DHT key under which the peers holding a fragment's anchor at ``version`` sign its hash (one owner
    subkey each): what a downloaded state is checked against (:func:`vouchers`)."""
    return f"{prefix}_anchor_v{version}"


def vouchers(signed: Mapping[str, Any], anchor: str) -> set[str]:
    """The peer ids whose signed entry (peer id -> value, read under :func:`vouch_key`) names ``anchor``.
    A state download is accepted only if one of them is not its donor: a version is committed by a group
    of at least two members that all hold the same anchor, so an honest state is vouched for by someone
    else, and a member that fabricates a newer anchor (with a hash that matches it) is not."""
    return {peer for peer, value in signed.items() if isinstance(value, str) and value == anchor}


@dataclass(frozen=True)
class RoundMeta:
    """What each member gathers from every other member of a round. On the wire (:meth:`to_wire`) a msgpack list of
    its fields in their order, the norms packed as little-endian float32: the group's leader sends every member's
    to every member (O(n^2) bytes a round), and names -- field names, tensor names -- were most of them."""

    fragment: int
    version: int
    anchor: str
    """:func:`anchor_hash` of the member's anchor for this fragment before the round."""
    config: str
    """The member's config hash."""
    tokens: int
    steps: int
    weight: float
    due: float
    """DHT time at which the fragment became due for this member (arrival spread -> adaptive window)."""
    norms: tuple[float, ...] = ()
    """Radial merge: the norm of each (non-embedding) pseudo-gradient tensor, in the order of their names
    (:func:`norms_in_order`; every member of a group has the same names: its config hash is the same), as float32
    values (what the wire carries, so that a member's own norms are what the others read)."""
    link: float = 0.0
    """Bytes per second the member's recent rounds moved (its link estimate; 0.0: none measured yet): the group's
    all-reduce parts are sized for its slowest member (:func:`~p2p_diloco.hivemind_ext.compression.link_part_bytes`)."""

    @classmethod
    def of(cls, contribution: Contribution, config: str, due: float, link: float = 0.0) -> "RoundMeta":
        """What a member sends of ``contribution`` (derived at the wire, nowhere else): its gathered fields, our
        config hash, ``due`` (the DHT time it was handed off) and ``link`` (our measured throughput, 0.0: none);
        checked (:meth:`check_outgoing`: raises ``ValueError``) so that nothing malformed is ever sent."""
        c = contribution
        meta = cls(fragment=c.fragment, version=c.version, anchor=c.anchor_hash, config=config, tokens=c.tokens,
                   steps=c.steps, weight=c.weight, due=due, norms=norms_in_order(c.norms), link=link)
        meta.check_outgoing()
        return meta

    def to_wire(self) -> list[Any]:
        """The fields in their order (:data:`META_FIELDS`), the norms packed (msgpack-safe: ints, str, floats, bytes)."""
        wire = {**asdict(self), "weight": float(self.weight), "due": float(self.due), "norms": pack_norms(self.norms),
                "link": float(self.link)}
        return [wire[name] for name in META_FIELDS]

    def check_outgoing(self) -> None:
        """Raise ``ValueError`` unless our own metadata passes the rule every peer applies to it
        (:meth:`from_wire`): nothing a peer would refuse as malformed is ever sent."""
        try:
            RoundMeta.from_wire(self.to_wire())
        except PeerDataError as e:
            raise ValueError(f"our round metadata would be refused by every peer: {e}") from e

    @classmethod
    def from_wire(cls, value: Any) -> "RoundMeta":
        """Strict parse of a peer's gathered metadata; raises :class:`~p2p_diloco.core.rejects.PeerDataError`
        (a ValueError with a one-line reason and a reason code)."""
        def refuse(reason: Reason, message: str) -> PeerDataError:
            return PeerDataError(reason, message[:300])

        if not isinstance(value, (list, tuple)):
            raise refuse(Reason.MALFORMED, f"gathered metadata must be a list, got {type(value).__name__}")
        if len(value) != len(META_FIELDS):
            raise refuse(Reason.OVERSIZE if len(value) > 4 * len(META_FIELDS) else Reason.MALFORMED,
                         f"gathered metadata holds {len(value)} fields, not {len(META_FIELDS)} {list(META_FIELDS)}")
        value = dict(zip(META_FIELDS, value))
        for key in ("fragment", "version", "tokens", "steps"):
            v = value[key]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_WIRE_INT:
                reason = (Reason.OVERSIZE if isinstance(v, int) and not isinstance(v, bool) and v > MAX_WIRE_INT
                          else Reason.BAD_VERSION if key == "version" else Reason.MALFORMED)
                raise refuse(reason, f"gathered {key} must be a non-negative int, got {v!r}")
        for key in ("anchor", "config"):
            if not isinstance(value[key], str) or len(value[key]) > 64:
                raise refuse(Reason.OVERSIZE if isinstance(value[key], str) else Reason.MALFORMED,
                             f"gathered {key} must be a short string, got {value[key]!r:.80}")
        numbers: dict[str, float] = {}
        for key in ("weight", "due", "link"):
            number = _finite_number(value[key])
            if number is None:
                raise refuse(_number_reason(value[key]), f"gathered {key} must be a finite number, got {value[key]!r}")
            numbers[key] = number
        if numbers["link"] < 0:
            raise refuse(Reason.MALFORMED, f"gathered link must be >= 0 bytes per second, got {value['link']!r}")
        packed = value["norms"]
        if not isinstance(packed, bytes) or len(packed) % NORM_BYTES:
            raise refuse(Reason.MALFORMED, "gathered norms must be float32 values packed in bytes")
        if len(packed) > MAX_NORMS * NORM_BYTES:
            raise refuse(Reason.OVERSIZE, f"gathered norms hold {len(packed) // NORM_BYTES} values, at most {MAX_NORMS}")
        norms = unpack_norms(packed)
        if not all(math.isfinite(x) and x >= 0 for x in norms):
            raise refuse(Reason.NON_FINITE if not all(math.isfinite(x) for x in norms) else Reason.MALFORMED,
                         "gathered norms must be finite and non-negative")
        return cls(**{**value, **numbers, "norms": norms})

    def norms_by_name(self, radial_names: Sequence[str]) -> dict[str, float]:
        """Our norms keyed by the fragment's radial tensor names (checked to be as many by :func:`check_group`)."""
        return dict(zip(sorted(radial_names), self.norms))


META_FIELDS = ("fragment", "version", "anchor", "config", "tokens", "steps", "weight", "due", "norms", "link")
""":class:`RoundMeta`'s fields in their wire order."""
NORM_BYTES = 4


FLOAT32_MAX = 3.4028234663852886e38


def pack_norms(norms: Sequence[float]) -> bytes:
    """Little-endian float32 values; one beyond float32's range becomes inf (which a peer refuses)."""
    return struct.pack(f"<{len(norms)}f", *(x if abs(x) <= FLOAT32_MAX else math.copysign(math.inf, x) for x in norms))


def unpack_norms(packed: bytes) -> tuple[float, ...]:
    return struct.unpack(f"<{len(packed) // NORM_BYTES}f", packed)


def norms_in_order(norms: Mapping[str, float]) -> tuple[float, ...]:
    """A contribution's radial norms as :class:`RoundMeta` carries them: in the order of their names, as float32
    (a norm beyond float32's range is inf, which the peers' rule refuses: :meth:`RoundMeta.check_outgoing`)."""
    return unpack_norms(pack_norms([float(norms[name]) for name in sorted(norms)]))


def _finite_number(v: Any) -> float | None:
    """``float(v)`` for a finite int or float (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        x = float(v)
    except OverflowError:  # an int beyond float range
        return None
    return x if math.isfinite(x) else None


def _number_reason(v: Any) -> Reason:
    if isinstance(v, float) and not math.isfinite(v):
        return Reason.NON_FINITE
    if isinstance(v, int) and not isinstance(v, bool):
        return Reason.OVERSIZE
    return Reason.MALFORMED


def parse_gathered(gathered: Mapping[Any, Any]) -> list[RoundMeta]:
    """Every member's :meth:`RoundMeta.from_wire`, in the group's order. A member whose metadata is refused
    is logged (``rejected gathered metadata from <peer id>: <reason>: ...``) and the round with it: raises
    :class:`~p2p_diloco.core.rejects.PeerDataError` whose message starts with that peer id."""
    metas = []
    for peer, value in gathered.items():
        try:
            metas.append(RoundMeta.from_wire(value))
        except ValueError as e:
            log_rejection(logger, "gathered metadata", peer, e)
            raise PeerDataError(reason_of(e), f"{peer}: {reason_of(e)}: {e}") from None
    return metas


@dataclass(frozen=True)
class Decision:
    ok: bool
    reason: str = ""


def check_group(own: RoundMeta, members: Sequence[RoundMeta], radial_names: Sequence[str], *,
                min_group_size: int, weighting: str, grid: bool = False) -> Decision:
    """May this round's average be applied? A pure function of the gathered data, so every member of
    the group decides the same (``own`` only adds checks that hold for every honest member).

    Refused: fewer members than ``min_group_size``; members of another fragment or config; members
    at another version or with another anchor (their pseudo-gradients are measured against a
    different point; not with ``grid``, where the anchors are averaged too); weights that are not what
    the member's progress says; all-zero weights (hivemind returns NaN); radial norms missing.
    """
    if len(members) < max(2, min_group_size) and not (min_group_size == 1 and len(members) == 1):
        return Decision(False, f"group of {len(members)} < min_group_size {max(2, min_group_size)}")
    if own not in members:
        return Decision(False, "our own metadata is not among the gathered")
    for m in members:
        if m.fragment != own.fragment:
            return Decision(False, f"a member averaged fragment {m.fragment}, not {own.fragment}")
        if m.config != own.config:
            return Decision(False, f"a member has config hash {m.config}, ours {own.config}")
        if grid:
            pass  # anchors and versions differ between grid groups' members: the round averages them
        elif m.version != own.version:
            return Decision(False, f"version mismatch: a member is at v{m.version}, we are at v{own.version}")
        elif m.anchor != own.anchor:
            return Decision(False, f"anchor mismatch at v{own.version}: {m.anchor} vs ours {own.anchor}")
        expected = outer.contribution_weight(m.tokens, m.steps, weighting)
        if not math.isclose(m.weight, expected, rel_tol=1e-9, abs_tol=1e-12):
            return Decision(False, f"a member's weight {m.weight} does not match its progress ({m.tokens} tokens, "
                                   f"{m.steps} steps -> {expected})")
        if len(m.norms) != len(radial_names):
            return Decision(False, f"a member's metadata holds {len(m.norms)} norms, the fragment has "
                                   f"{len(radial_names)} radial tensors")
    if sum(m.weight for m in members) <= 0:
        return Decision(False, "all weights are zero: nothing to merge (hivemind would return NaN)")
    return Decision(True)


def peers_at_rank(ours: tuple[int, str], peers: Sequence[tuple[int, str]]) -> int:
    """The live learners at our (version, anchor hash) of a fragment, us included, for :func:`quorum_problem`: the
    peers whose records show it, and those whose records show the version before it (a record is republished only
    every heartbeat: just after a round, the peers that committed it still show the version it started from --
    measured, two pairs each counted only themselves and both committed)."""
    return 1 + sum(1 for version, anchor in peers if (version, anchor) == ours or version == ours[0] - 1)


def quorum_problem(group_size: int, at_rank: int, target_group_size: int = 0) -> str | None:
    """Why a sound group of ``group_size`` members must still not commit, or None. ``at_rank``: the live learners,
    us included, whose records show them at our (version, anchor hash) of the fragment (0: not checked).

    Two disjoint groups cannot both hold more than half of those, so a group that does not is refused: another
    group could commit the same version with another average -- a fork, which only a full fp32 state download
    heals (measured: at 0.5 Mbit/s with 1 s queues, four peers matched as two pairs, again and again). Not applied
    when groups are capped below the peers at the rank (``target_group_size``: several groups a round by design).
    A member's records may lag; the verdicts make the group's decision one: if any member refuses, none commits."""
    if at_rank <= 0 or (target_group_size and at_rank > target_group_size) or 2 * group_size > at_rank:
        return None
    return (f"a minority group: {group_size} of the {at_rank} live peers at this version (another group "
            f"could commit it too)")


NOT_FINITE = "averaged tensors are not finite"
"""A member's verdict on a round whose averaged tensors hold a NaN or an infinity."""


@dataclass(frozen=True)
class VerdictRule:
    """What a member's verdict on a round checks besides its averaged tensors: :func:`check_group`'s settings and
    :func:`quorum_problem`'s ``at_rank``; with groups from the clock the averager process reads it to send our verdict
    the moment the all-reduce ends (:meth:`~p2p_diloco.averaging.verdicts.GroupVerdicts.early_verdict`),
    ``send_timeout_s`` each, and the host checks the same rule on the same data."""

    radial_names: tuple[str, ...]
    min_group_size: int
    weighting: str
    at_rank: int = 0
    target_group_size: int = 0
    grid: bool = False
    send_timeout_s: float = 0.0


def round_verdict(rule: VerdictRule, own: RoundMeta, metas: Sequence[RoundMeta], finite: bool) -> Decision:
    """Our verdict on a round whose group gathered ``metas`` (ours: ``own``) and whose averaged tensors are ``finite``
    or not: :func:`check_group`, then :func:`quorum_problem`, then the tensors. Pure: the averager process and the
    host reach the same one."""
    decision = check_group(own, metas, rule.radial_names, min_group_size=rule.min_group_size,
                           weighting=rule.weighting, grid=rule.grid)
    quorum = quorum_problem(len(metas), rule.at_rank, rule.target_group_size) if decision.ok else None
    if quorum is not None:
        return Decision(False, quorum)
    if decision.ok and not finite:
        return Decision(False, NOT_FINITE)
    return decision


def adapt_window(spreads_s: Sequence[float], cfg: AveragingConfig, history: int = 8) -> float:
    """Matchmaking window from the arrival spreads (last due - first due, s) of recent rounds.

    ``median + 2 * MAD + request_timeout`` of the last ``history`` spreads (robust to one slow
    round), clamped to ``[window_min_s, window_max_s]``; ``window_s`` until a round was seen.
    """
    recent = [s for s in spreads_s[-history:] if math.isfinite(s) and s >= 0]
    if not recent:
        return cfg.window_s
    med = statistics.median(recent)
    mad = statistics.median(abs(s - med) for s in recent)
    return min(cfg.window_max_s, max(cfg.window_min_s, med + 2 * mad + cfg.request_timeout_s))


def start_instant(proposals: Mapping[str, float], count: int) -> float | None:
    """The common start (DHT time) of ``count`` learners: the latest of the ``count`` earliest proposals,
    or None while fewer than ``count`` are in. Everyone who has read the same first ``count`` proposals
    gets the same instant; later arrivals (proposing later) do not move it."""
    if count < 1 or len(proposals) < count:
        return None
    return sorted(proposals.values())[count - 1]


def completeness_problem(total_elements: int, failed_elements: int, banned_senders: int,
                         parts_expected: int, parts_received: int) -> str | None:
    """None if an all-reduce averaged every element with every sender; else why it is partial."""
    if failed_elements:
        dropped = f", {banned_senders} sender(s) dropped mid-round" if banned_senders else ""
        return (f"partial all-reduce: {failed_elements} of {total_elements} elements not averaged (a reducer "
                f"failed){dropped}")
    if banned_senders:
        return f"partial all-reduce: {banned_senders} sender(s) dropped mid-round"
    if parts_received != parts_expected:
        return f"partial all-reduce: our reducer received {parts_received} of {parts_expected} parts"
    return None


def commit_key(prefix: str, members: Mapping[str, RoundMeta]) -> str:
    """DHT key where the members of one round attempt post their verdicts: fragment, version and every
    member's (peer id, due time), so a retry by the same group at the same version gets a new key."""
    blob = ";".join(f"{pid}@{members[pid].due!r}" for pid in sorted(members))
    first = next(iter(members.values()))
    return f"{prefix}_commit_f{first.fragment}_v{first.version}_{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def commit_decision(reports: Mapping[str, str], peers: Sequence[str]) -> Decision:
    """Commit only if every member of the group reported "ok" (two-phase commit over the DHT).

    A member whose all-reduce was partial, failed, or whose checks refused the round reports why;
    one that reports nothing (dead, or its step raised before it knew the group) vetoes by silence.
    """
    for pid in peers:
        verdict = reports.get(pid)
        if verdict is not None and verdict != "ok":
            return Decision(False, f"member {pid[-8:]} reported: {verdict}"[:300])
    silent = [pid for pid in peers if pid not in reports]
    if silent:
        return Decision(False, f"no verdict from {len(silent)} of {len(peers)} members")
    return Decision(True)


def vetoed(reports: Mapping[str, str], peers: Sequence[str]) -> bool:
    """A member of ``peers`` reported something other than "ok" (silence is no veto here)."""
    return any(reports.get(pid, "ok") != "ok" for pid in peers)


def decision_at_deadline(reports: Mapping[str, str], peers: Sequence[str], timeout_s: float) -> tuple[Decision, bool]:
    """What the verdicts read so far decide if no more are waited for: :func:`commit_decision`, and whether silence
    alone stands in the way (no veto) -- then the reason says within how long, and a member that said "ok" withdraws
    it (a late member then discards too)."""
    decision = commit_decision(reports, peers)
    if decision.ok or vetoed(reports, peers):
        return decision, False
    return Decision(False, f"{decision.reason} within {timeout_s:g} s"), True


