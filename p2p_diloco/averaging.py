"""Per-fragment background averaging among live peers: one hivemind averager per fragment.

A round of fragment f is a hivemind group all-reduce of the members' encoded pseudo-gradients
(:func:`p2p_diloco.outer.encode_contribution`), weighted by progress, among whoever is alive and due
within the matchmaking window (at least ``averaging.min_group_size`` peers). Every member then
decodes the *same* averaged tensors with the *same* gathered metadata and applies the same outer
step to the same anchor, so anchors stay identical inside a group. What makes that true, and what
this module adds to hivemind 1.1.12 (see ``shared/notes/hivemind.md``):

* **Same bytes for everyone** (:class:`ExactAllReduceRunner`). hivemind's reducer sends each
  sender ``codec(average - x_sender)`` and the sender adds it to its own tensor, so with a lossy
  codec (and even with fp32 rounding) every peer ends with a slightly different result. Our
  reducer sends ``codec(average)`` itself -- the same deterministic bytes to every sender, and
  decodes the same bytes for its own share -- and senders *copy* what they receive. Every member
  then holds bit-identical averaged tensors, at no extra traffic (one message per part, as before).
  The price: the codec error is relative to the average, not to the difference from it.
* **Partial rounds fail** (:meth:`ExactAllReduceRunner.completeness_problem`). hivemind can finish
  a round with some parts replaced by the local tensor (a reducer that failed) or some senders
  dropped (banned after a timeout), and report success. We check the runner's own books after
  every round and raise instead, so ``step()`` fails; a round that fails is discarded by the
  learner, never half-applied, and its pseudo-gradient is kept for the next round.
* **Group-atomic commit** (:func:`commit_decision`). A partial all-reduce is not always visible to
  every member: when a reducer drops a sender, the third peer gets a "successful" average that
  lacks one contribution. So after the all-reduce each member posts its verdict (signed, in the
  DHT, under a key only this attempt's members derive) and commits only if every member reported
  success within ``commit_timeout_s``; silence is a veto. A member whose own all-reduce failed
  posts its veto from the averager process at once (:meth:`FragmentAverager._post_veto`), so the
  others do not wait out the timeout. (Two-phase commit without a coordinator cannot be perfect: a
  verdict read just after a member's deadline makes one member abort while the others commit;
  versions then differ and the behind member catches up by state download.)
* **Checked metadata** (:func:`check_group`). Each member gathers (fragment, version, anchor hash,
  config hash, tokens, steps, weight, radial norms, due time) from all the others; a round whose
  members disagree on the anchor, or whose weights are not what their progress says, or all zero
  (hivemind would return NaN), is discarded by every member -- the decision is a pure function of
  the gathered data, so all members take the same one.
* **Bounded influence** (``outer.robust``, :class:`RobustTensorPartReducer`). A member that sends
  1000x tensors or norms must not steer the anchor. Each reducer averages the parts it receives with
  :func:`outer.robust_mean` (norms capped at ``clip_factor`` x the senders' lower median, non-finite
  parts left out, and with "trim" a coordinate-wise trimmed mean), weighting senders by their
  *gathered* weights capped the same way -- not by what they claim in the stream; every member
  applies the same rule to the gathered norms (:func:`outer.decode_merged`). One reducer computes
  each part for everyone, so anchors stay bit-identical.
* **Versioned groups**: the group key carries the fragment version and a few bits of the anchor
  hash (``set_group_bits``), so only peers holding the same anchor meet; a peer behind the swarm
  finds nobody and fetches the current anchor + outer state from a peer that has it
  (:meth:`FragmentAveraging.fetch_state`).
* **Forks heal** (:func:`anchor_order`). hivemind matchmaking can split the peers due for a round
  into two groups that each commit the same version from the same anchor, with different results.
  The (version, anchor hash) pairs are totally ordered -- at equal versions the smaller hash wins --
  and a peer that sees (in the peer records) a peer ahead of it downloads that anchor and rebases
  onto it, like a peer that missed rounds. The distance between the two anchors is measured then
  (:func:`relative_distance`) and published as the peer's consensus distance.
* **Members only** (when a swarm key is in use): our averaging and state-download handlers refuse
  peers that :class:`p2p_diloco.swarm.Membership` does not list; the DHT authorizer does not
  cover these RPCs.

hivemind surprise: RPC handler names carry the servicer's *class name*, so every peer must run
the same averager class; fault injection therefore swaps the runner (``runner_class``), not the
averager class.

Every hivemind timeout is set from :class:`~p2p_diloco.config.AveragingConfig` (seconds), and
``allow_retries=False``: a failed round is reported, not silently retried with other tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import itertools
import logging
import math
import multiprocessing as mp
import re
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import msgpack
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished, azip
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco import faults, outer, procguard
from p2p_diloco.compression import decode_part, get_codec
from p2p_diloco.config import AveragingConfig, Config, config_hash
from p2p_diloco.rejects import PeerDataError, Reason, log_rejection, reason_of

logger = logging.getLogger(__name__)

NO_GROUP_MESSAGE = "Averaging step failed: could not find a group"
"""hivemind's error when a round's matchmaking ended alone: for us an outcome, not a fault."""


class NoGroupIsNotAnError(logging.Filter):
    """Drops hivemind's ERROR + traceback for a round that found no group (a lone learner, a learner one
    version behind): the learner logs that round in one line, as discarded with this reason. Every other
    averaging failure keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.getMessage() == NO_GROUP_MESSAGE)


def quiet_expected_failures() -> None:
    """Install :class:`NoGroupIsNotAnError` on hivemind's averager logger, once; the averager processes
    forked afterwards inherit it."""
    hv = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(f, NoGroupIsNotAnError) for f in hv.filters):
        hv.addFilter(NoGroupIsNotAnError())


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
"""A download's host-side deadline allows this many donors to each take ``state_timeout_s``."""
MAX_WIRE_INT = 2**63 - 1
"""Largest integer gathered metadata or a state download may carry (msgpack's int64)."""
MAX_NORMS = 1 << 16
"""Most radial norms a member's gathered metadata may carry (one per tensor of the fragment)."""
MAX_TENSOR_NAME_CHARS = 512
MAX_STATE_METADATA_BYTES = 4096
"""A state download's msgpack metadata is four scalars; anything longer is refused before decoding."""
STATE_METADATA_KEYS = frozenset({"fragment", "version", "anchor", "momentum"})
_ANCHOR_RE = re.compile(r"^[0-9a-f]{16}$")


# ---------------------------------------------------------------- pure helpers and decisions


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


def anchor_order(version: int, anchor: str) -> tuple[int, int]:
    """Total order of (version, anchor hash): newer versions first; at equal versions (a fork: two groups
    each committed the same version) the *smaller* hash wins. Every peer ranks the same way, so the
    losing side of a fork adopts the winner's anchor (state download + rebase) and the forks heal."""
    return version, -int(anchor, 16) if anchor else 0


def is_ahead(theirs: tuple[int, str], ours: tuple[int, str]) -> bool:
    """Is a peer's (version, anchor hash) ahead of ours in :func:`anchor_order`?"""
    return anchor_order(*theirs) > anchor_order(*ours)


def round_is_doomed(ours: tuple[int, str], peers: Sequence[tuple[int, str]]) -> bool:
    """Would a round at ``ours`` = (version, anchor hash) find nobody? Groups meet only at one version and
    anchor (:func:`version_group_bits`): a round is doomed when a live peer is ahead of us and none is
    where we are. A learner behind then downloads instead (its progress waits for the next round), rather
    than hold the fragment through a round that ends only at its matchmaking deadline."""
    return any(is_ahead(p, ours) for p in peers) and not any(p == ours for p in peers)


def sharing_priority(version: int, anchor: str) -> float:
    """hivemind state-sharing priority that follows :func:`anchor_order` (donors are tried highest first):
    the version plus a fraction in [0, 1) that is larger for smaller hashes."""
    if not anchor:
        return float(version)
    return version + (0xFFFFFFFF - int(anchor[:8], 16)) / 2.0**32


def donor_order(priorities: Mapping[str, float], own_id: str, ours: float) -> list[str]:
    """The donors to download a fragment's state from, in the order to try them: only peers ahead of us
    (their :func:`sharing_priority` above ours ``ours``), the best rank first; peers of equal rank (the
    same version and anchor, the usual case) in rendezvous-hash order of (our id, their id), so that
    newcomers spread over the donors instead of all starting with the same one, and each newcomer's
    order is stable."""
    ahead = [(p, d) for d, p in priorities.items() if d != own_id and math.isfinite(p) and p > ours]
    return [d for _, d in sorted(ahead, key=lambda pd: (-pd[0], hashlib.sha256(f"{own_id}/{pd[1]}".encode()).digest()))]


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


@dataclass(frozen=True)
class RoundMeta:
    """What each member gathers from every other member of a round (msgpack: str keys, plain types)."""

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
    norms: dict[str, float] = field(default_factory=dict)
    """Radial merge: the norm of each (non-embedding) pseudo-gradient tensor."""

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["weight"], d["due"] = float(self.weight), float(self.due)
        d["norms"] = {str(k): float(v) for k, v in self.norms.items()}
        return d

    @classmethod
    def from_wire(cls, value: Any) -> "RoundMeta":
        """Strict parse of a peer's gathered metadata; raises :class:`~p2p_diloco.rejects.PeerDataError`
        (a ValueError with a one-line reason and a reason code)."""
        def refuse(reason: Reason, message: str) -> PeerDataError:
            return PeerDataError(reason, message[:300])

        if not isinstance(value, Mapping):
            raise refuse(Reason.MALFORMED, f"gathered metadata must be a dict, got {type(value).__name__}")
        expected = {f for f in cls.__dataclass_fields__}
        if set(value) != expected:
            keys = sorted(repr(k)[:40] for k in itertools.islice(value, len(expected) + 1))
            raise refuse(Reason.OVERSIZE if len(value) > 4 * len(expected) else Reason.MALFORMED,
                         f"gathered metadata keys {keys} != {sorted(expected)}")
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
        numbers = {}
        for key in ("weight", "due"):
            numbers[key] = _finite_number(value[key])
            if numbers[key] is None:
                raise refuse(_number_reason(value[key]), f"gathered {key} must be a finite number, got {value[key]!r}")
        norms = value["norms"]
        if not isinstance(norms, Mapping):
            raise refuse(Reason.MALFORMED, "gathered norms must map names to finite non-negative numbers")
        if len(norms) > MAX_NORMS:
            raise refuse(Reason.OVERSIZE, f"gathered norms hold {len(norms)} entries, at most {MAX_NORMS}")
        parsed: dict[str, float] = {}
        for k, v in norms.items():
            x = _finite_number(v)
            if not isinstance(k, str) or len(k) > MAX_TENSOR_NAME_CHARS or x is None or x < 0:
                reason = (Reason.OVERSIZE if isinstance(k, str) and len(k) > MAX_TENSOR_NAME_CHARS
                          else _number_reason(v) if isinstance(k, str) and x is None else Reason.MALFORMED)
                raise refuse(reason, "gathered norms must map names to finite non-negative numbers")
            parsed[k] = x
        return cls(**{**value, "weight": numbers["weight"], "due": numbers["due"], "norms": parsed})


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
    :class:`~p2p_diloco.rejects.PeerDataError` whose message starts with that peer id."""
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
                min_group_size: int, weighting: str) -> Decision:
    """May this round's average be applied? A pure function of the gathered data, so every member of
    the group decides the same (``own`` only adds checks that hold for every honest member).

    Refused: fewer members than ``min_group_size``; members of another fragment or config; members
    at another version or with another anchor (their pseudo-gradients are measured against a
    different point); weights that are not what the member's progress says; all-zero weights
    (hivemind returns NaN); radial norms missing.
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
        if m.version != own.version:
            return Decision(False, f"version mismatch: a member is at v{m.version}, we are at v{own.version}")
        if m.anchor != own.anchor:
            return Decision(False, f"anchor mismatch at v{own.version}: {m.anchor} vs ours {own.anchor}")
        expected = outer.contribution_weight(m.tokens, m.steps, weighting)
        if not math.isclose(m.weight, expected, rel_tol=1e-9, abs_tol=1e-12):
            return Decision(False, f"a member's weight {m.weight} does not match its progress ({m.tokens} tokens, "
                                   f"{m.steps} steps -> {expected})")
        missing = set(radial_names) - set(m.norms)
        if missing:
            return Decision(False, f"a member's metadata lacks the norms of {sorted(missing)[:3]}")
    if sum(m.weight for m in members) <= 0:
        return Decision(False, "all weights are zero: nothing to merge (hivemind would return NaN)")
    return Decision(True)


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
        return f"partial all-reduce: {failed_elements} of {total_elements} elements not averaged (a reducer failed)"
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


# ---------------------------------------------------------------- hivemind subclasses (run in the averager process)


class _RobustPart:
    """Stands in for :class:`TensorPartReducer`'s accumulator of one part. hivemind calls
    ``add_(part, alpha=weight)`` once per sender it counts and then ``div_(total weight)``; we keep the
    parts and return :func:`outer.robust_mean` of them instead of the plain weighted mean."""

    def __init__(self, shape: torch.Size, rule: outer.Robust) -> None:
        self.shape, self.rule = shape, rule
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> "_RobustPart":
        self.parts.append(part)
        self.weights.append(float(alpha))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        if not self.parts:
            return torch.zeros(self.shape)
        return outer.robust_mean(self.parts, self.weights, self.rule)


class RobustTensorPartReducer(TensorPartReducer):
    """hivemind's reducer with a bounded influence per sender (``outer.robust``): each part is
    :func:`outer.robust_mean` of what the senders sent (non-finite parts left out, norms capped at
    ``clip_factor`` x the lower median, a trimmed mean with "trim"), weighted by the senders' *gathered*
    weights after :func:`outer.clip_to_median` -- the weights every member decodes with -- not by the weight a sender
    claims in its stream. One reducer computes each part and sends it to everyone, so all members
    still hold bit-identical results. hivemind's own bookkeeping (which sender counts for which part,
    bans, completion) is untouched: only the accumulator is replaced (hivemind 1.1.12 uses exactly
    ``add_`` and ``div_`` on it)."""

    def __init__(self, part_shapes: Sequence[torch.Size], sender_weights: Sequence[float], rule: outer.Robust) -> None:
        self.sender_weights = [float(w) for w in sender_weights]
        self.rule = rule
        super().__init__(part_shapes, len(self.sender_weights))

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _RobustPart(self.part_shapes[self.current_part_index], self.rule)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        return await super().accumulate_part(sender_index, part_index, tensor_part,
                                             weight=self.sender_weights[sender_index])


class ExactAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, except that reducers return ``codec(average)`` (the same bytes
    to every sender) instead of ``codec(average - x_sender)``, and every message sent or received is
    counted. The outputs are the averaged tensors, not deltas: :class:`FragmentAverager` copies them.
    With ``robust`` = (clipped gathered weight per peer, rule), parts are reduced by
    :class:`RobustTensorPartReducer`.
    """

    def __init__(self, *args: Any, counters: tuple[Any, Any], fragment: int | None = None,
                 robust: tuple[Mapping[Any, float], outer.Robust] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent, self._received = counters
        self.fragment = fragment
        if robust is not None:
            weights, rule = robust
            self.tensor_part_reducer.finished.set()  # hivemind's own reducer is replaced unused: no "0% received"
            self.tensor_part_reducer = RobustTensorPartReducer(
                tuple(part.shape for part in self.parts_for_local_averaging),
                [weights[peer] for peer in self.sender_peer_ids], rule)

    def _count(self, counter: Any, message: Any) -> None:
        with counter.get_lock():
            counter.value += message.ByteSize() + HIVEMIND_FRAMING_BYTES

    def _quantized(self, averaged: torch.Tensor, compression_type: int) -> tuple[Any, torch.Tensor]:
        message = serialize_torch_tensor(averaged, compression_type)
        return message, deserialize_torch_tensor(message)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in faults.after_first(super()._generate_input_for_peer(peer_index), "while-sending",
                                                self.fragment):
            self._count(self._sent, message)
            yield message

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            compression_type = container.compression.compression_type
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight)
                _, decoded = await asyncio.get_event_loop().run_in_executor(
                    None, self._quantized, averaged, compression_type)
                container.register_processed_part(peer_index, part_index, decoded)
            return
        try:  # as hivemind's, plus counting the received messages
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def decode(msg: averaging_pb2.AveragingData) -> torch.Tensor:
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                self._count(self._received, msg)
                return deserialize_torch_tensor(msg.tensor_part)

            part_index = 0
            async for averaged in amap_in_executor(decode, aiter_with_timeout(stream, self.reducer_timeout),
                                                   max_prefetch=container.prefetch):
                container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != container.num_parts_by_peer[peer_index]:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected "
                                         f"{container.num_parts_by_peer[peer_index]}")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug("all-reduce with %s failed: %r", peer_id, e)
            container.register_failed_reducer(peer_index)
            raise

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """As hivemind's, except that each part is decoded strictly (:func:`decode_part`: our codec's slot,
        the part's shape and dtype, exact buffer length, finite values; a finite non-negative weight): a
        sender whose part is refused is logged with its peer id and a reason code, and banned -- the
        round then fails as a whole (:meth:`completeness_problem`), never half-applied."""
        part_index = 0
        loop = asyncio.get_event_loop()
        reducer, compression = self.tensor_part_reducer, self.tensor_part_container.compression
        sender = self.sender_peer_ids[sender_index]

        async def numbered() -> AsyncIterator[tuple[int, averaging_pb2.AveragingData]]:
            index = 0
            async for msg in stream:
                yield index, msg
                index += 1

        def receive(item: tuple[int, averaging_pb2.AveragingData]) -> tuple[torch.Tensor, float, int]:
            index, msg = item
            self._count(self._received, msg)
            if index >= reducer.num_parts:
                raise PeerDataError(Reason.OVERSIZE, f"part {index} of only {reducer.num_parts}")
            if not math.isfinite(msg.weight) or msg.weight < 0:
                raise PeerDataError(Reason.NON_FINITE if not math.isfinite(msg.weight) else Reason.MALFORMED,
                                    f"weight {msg.weight} is not a finite number >= 0")
            local = self.parts_for_local_averaging[index]
            part = decode_part(msg.tensor_part, reducer.part_shapes[index], local.dtype, compression.compression_type)
            return part, msg.weight, msg.tensor_part.compression

        parts = amap_in_executor(receive, numbered(), max_prefetch=self.tensor_part_container.prefetch)
        try:
            while True:
                try:
                    tensor_part, weight, compression_type = await parts.__anext__()
                except StopAsyncIteration:
                    break
                except ValueError as e:  # excluded: the round fails for everyone (completeness_problem)
                    log_rejection(logger, "a tensor part", sender, e)
                    await self._ban_sender(sender)
                    break
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight)
                    part_index += 1
                    if part_index == 1 and self.sender_peer_ids[sender_index] != self.peer_id:
                        faults.hit("while-reducing", self.fragment)
                except AllreduceException:  # BannedException included: this sender no longer counts
                    logger.debug("sender %d was banned", sender_index)
                    break
                serialized, _ = await loop.run_in_executor(None, self._quantized, averaged, compression_type)
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self._count(self._sent, message)
                yield message
        finally:
            await parts.aclose()
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def completeness_problem(self) -> str | None:
        reducer = self.tensor_part_reducer
        expected = reducer.num_parts * reducer.num_senders
        return completeness_problem(self.tensor_part_container.total_size, self.tensor_part_container.failed_size,
                                    len(self.banned_senders), expected, sum(reducer.num_parts_received))


class FragmentAverager(DecentralizedAverager):
    """One fragment's averager: exact all-reduce, completeness check, members-only handlers, state sharing.

    ``state_provider`` (host process) returns ``(metadata, tensors)`` for :meth:`get_current_state`:
    the fragment's anchor and outer momentum, so a peer that is behind can catch up.
    """

    def __init__(self, *args: Any, membership: Any = None,
                 state_provider: Callable[[], tuple[dict[str, Any], list[torch.Tensor]]] | None = None,
                 runner_class: type[ExactAllReduceRunner] = ExactAllReduceRunner, report_subkey: bytes | None = None,
                 fragment: int | None = None, layout: tuple[Sequence[str], Mapping[str, torch.Size]] | None = None,
                 robust: outer.Robust = outer.NO_ROBUST, **kwargs: Any) -> None:
        # the runner is chosen per instance, not by subclassing: hivemind names RPC handlers after the
        # servicer's class, so a subclass could not talk to the other peers' FragmentAverager handlers
        self.runner_class = runner_class  # tests inject faults with a runner subclass
        self.report_subkey: bytes | None = report_subkey
        self.bytes_sent = mp.Value(ctypes.c_longlong, 0)
        self.bytes_received = mp.Value(ctypes.c_longlong, 0)
        self.refused = mp.Value(ctypes.c_longlong, 0)
        """Requests our handlers refused (non-members), counted in the averager process."""
        self.membership = membership
        self.state_provider = state_provider
        self.fragment = fragment
        self.layout = layout
        """(names, shapes) of the fragment's tensors: what a downloaded state is checked against."""
        self.robust = robust
        """The robust merge rule (:func:`outer.robust_rule`): our reducer bounds each sender's influence."""
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        try:
            robust = self._robust_weights(group_info)
        except ValueError as e:  # every member parses the same gathered data, so every member refuses
            self._running_groups[group_id].cancel()
            raise AllreduceException(f"refusing the round: {e}") from None
        runner = self.runner_class(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, counters=(self.bytes_sent, self.bytes_received),
            fragment=self.fragment, robust=robust, **kwargs)
        assert group_id in self._running_groups, f"group {group_id!r} was not registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            raise AllreduceException("fragment averagers never run as auxiliaries")
        try:
            # the outputs are averages (not deltas); tensors are our private buffers, so a failure leaves
            # garbage there that nobody reads: the host reads them only after step() succeeded
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)
            problem = runner.completeness_problem()
            if problem is not None:
                raise AllreduceException(problem)
        except BaseException as e:
            # our step() will raise and the host will not know the group: post the veto from here, so
            # the members whose all-reduce looked fine stop waiting for our verdict at once
            await self._post_veto(group_info, f"{type(e).__name__}: {e}")
            raise
        self.last_updated = get_dht_time()

    def _robust_weights(self, group_info: GroupInfo) -> tuple[dict[Any, float], outer.Robust] | None:
        """(each member's gathered weight after :func:`outer.clip_to_median`, the rule), or None when the
        robust merge is off: what our reducer weighs each sender's parts with."""
        if not self.robust.active:
            return None
        metas = []
        for blob in group_info.gathered:
            _bandwidth, _mode, user = self.serializer.loads(blob)
            metas.append(RoundMeta.from_wire(self.serializer.loads(user)))  # the host logs who sent bad metadata
        weights = outer.clip_to_median([m.weight for m in metas], self.robust.clip_factor)
        return dict(zip(group_info.peer_ids, weights)), self.robust

    async def _post_veto(self, group_info: GroupInfo, reason: str) -> None:
        if self.report_subkey is None:
            return
        try:
            peers = [str(pid) for pid in group_info.peer_ids]
            metas = []
            for blob in group_info.gathered:
                _bandwidth, _mode, user = self.serializer.loads(blob)
                metas.append(RoundMeta.from_wire(self.serializer.loads(user)))
            key = commit_key(self.prefix, dict(zip(peers, metas)))
            await self.dht.store(key, reason[:300], get_dht_time() + 120, subkey=self.report_subkey,
                                 return_future=True)
        except Exception:  # the veto is an optimisation: silence vetoes too, after commit_timeout_s
            logger.exception("could not post our veto for a failed round")

    async def _refuse(self, context: P2PContext, what: str) -> bool:
        """True if a swarm key is in use and the remote peer is not a member (logged once per request)."""
        if self.membership is None:
            return False
        loop = asyncio.get_event_loop()
        allowed = await loop.run_in_executor(None, self.membership.is_member, context.remote_id)
        if not allowed:
            with self.refused.get_lock():
                self.refused.value += 1
            logger.warning("refused %s from %s: not a member of the run", what, context.remote_id)
        return not allowed

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if await self._refuse(context, "a join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        if await self._refuse(context, "tensor parts"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if await self._refuse(context, "a state download"):
            return
        async for message in faults.after_first(super().rpc_download_state(request, context), "serving-state",
                                                self.fragment):
            yield message

    # -- state download (the newcomer's side; hivemind's load_state_from_peers has no size cap, no
    #    check before it returns, and tries every declared peer, behind us or not)
    def download_state(self, ours: tuple[int, str], timeout_s: float) -> MPFuture:
        """(host) Download a state ahead of ``ours`` from the donors of :func:`donor_order`, trying the
        next on any failure; the future's result is ``(FetchedState | None, attempts)``."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_download_state", [], dict(future=future, ours=ours, timeout_s=timeout_s)))
        return future

    async def _download_state(self, future: MPFuture, ours: tuple[int, str], timeout_s: float) -> None:
        attempts: list[tuple[str, str, float]] = []  # (donor, "ok" or why not, seconds)
        try:
            assert self.layout is not None and self.fragment is not None, "download_state needs fragment and layout"
            names, shapes = self.layout
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = await self.dht.get(key, latest=True, return_future=True)
            priorities: dict[str, float] = {}
            for subkey, item in (found.value.items() if found is not None and isinstance(found.value, dict) else ()):
                with contextlib.suppress(Exception):  # a malformed declaration is skipped, not trusted
                    if isinstance(item.value, (int, float)) and not isinstance(item.value, bool):
                        priorities[PeerID(subkey).to_base58()] = float(item.value)
            cap = state_size_cap([shapes[n] for n in names])
            expected = [shapes[n] for n in names] * 2  # the anchor then the momentum, in names order
            for donor in donor_order(priorities, self.peer_id.to_base58(), sharing_priority(*ours))[:MAX_DONORS_TRIED]:
                t0 = time.monotonic()
                try:
                    metadata, tensors = await asyncio.wait_for(
                        self._download_from(PeerID.from_base58(donor), cap, expected), timeout=timeout_s)
                    fetched = await asyncio.get_event_loop().run_in_executor(
                        None, parse_state, metadata, tensors, self.fragment, names, shapes, ours)
                    if fetched is None:
                        raise ValueError("its state is not ahead of ours (its declaration was stale)")
                except Exception as e:  # this donor failed us (died, stalled, sent too much or bad data): the next
                    if isinstance(e, PeerDataError):  # it sent something our checks refuse
                        why = f"{reason_of(e)}: {e}"
                        log_rejection(logger, f"fragment {self.fragment}'s state download", donor, e)
                    else:
                        why = "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
                        logger.warning("fragment %s: state download from %s failed (%s); trying the next donor",
                                       self.fragment, donor, why[:200])
                    attempts.append((donor, why[:200], time.monotonic() - t0))
                    continue
                attempts.append((donor, "ok", time.monotonic() - t0))
                future.set_result((fetched, attempts))
                return
            future.set_result((None, attempts))
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    async def _download_from(self, donor: Any, cap_bytes: int,
                             expected: Sequence[torch.Size]) -> tuple[Any, list[torch.Tensor]]:
        """Stream a donor's state: at most ``cap_bytes`` in all; each tensor must be an uncompressed float32
        tensor of the ``expected`` shape (checked before it is decoded, :func:`decode_part`)."""
        stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, tensors, parts, received = None, [], [], 0

        def decode(parts: list[Any]) -> torch.Tensor:
            if len(tensors) >= len(expected):
                raise PeerDataError(Reason.OVERSIZE, f"the donor sent more than the {len(expected)} tensors expected")
            return decode_part(combine_from_streaming(parts), expected[len(tensors)], torch.float32,
                               self.state_compression.compression_type)

        async for message in faults.after_first(aiter_with_timeout(stream, timeout=self.next_chunk_timeout),
                                                "fetching-state", self.fragment):
            received += len(message.metadata) + message.tensor_part.ByteSize()
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
        if parts:
            tensors.append(decode(parts))
        if metadata is None:
            raise PeerDataError(Reason.MALFORMED, "the donor sent no state")
        return metadata, tensors

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        if self.state_provider is None:
            raise RuntimeError("this averager shares no state (no state_provider)")
        metadata, tensors = self.state_provider()
        return metadata, tensors, None


# ---------------------------------------------------------------- host side: rounds in the background


@dataclass(frozen=True)
class Contribution:
    """What the learner hands to averaging for one round of one fragment."""

    meta: RoundMeta
    tensors: dict[str, torch.Tensor]
    """Encoded pseudo-gradient (:func:`outer.encode_contribution`), by parameter name."""
    scheduled_time: float
    """DHT time at which the group should start its all-reduce."""
    window_s: float


@dataclass(frozen=True)
class RoundOutcome:
    """How a round ended. ``merged`` is set only when ``committed``."""

    fragment: int
    version: int
    committed: bool
    reason: str
    group_size: int = 0
    peers: tuple[str, ...] = ()
    own_share: float = 0.0
    weights: tuple[float, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    duration_s: float = 0.0
    finished_at: float = float("nan")
    """When the round ended (committed or not), on this process's ``time.monotonic()`` clock."""
    arrival_spread_s: float = float("nan")
    window_s: float = 0.0
    merged: dict[str, torch.Tensor] | None = None

    def event(self) -> dict[str, Any]:
        """The JSONL record of this round (no tensors)."""
        # not asdict(): it deep-copied the merged tensors (a whole fragment) on the training thread only to drop
        # them; finished_at is on this process's clock only
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("merged", "finished_at")}
        d["peers"] = list(self.peers)
        d["weights"] = list(self.weights)
        d["outcome"] = "committed" if self.committed else "discarded"
        if not math.isfinite(d["arrival_spread_s"]):
            d["arrival_spread_s"] = None
        return d


@dataclass(frozen=True)
class FetchedState:
    version: int
    anchor: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    anchor_hash: str


@dataclass(frozen=True)
class Download:
    """How a state download ended: the state (None: no donor was ahead of us, or every donor failed)
    and each donor tried, with ``"ok"`` or why not, and seconds."""

    fetched: FetchedState | None
    attempts: tuple[tuple[str, str, float], ...]
    duration_s: float

    @property
    def failures(self) -> list[str]:
        return [f"{d[-8:]}: {why}" for d, why, _ in self.attempts if why != "ok"]


class FragmentAveraging:
    """Owns one fragment's averager and runs its rounds and state downloads in a background thread.

    :meth:`start_round` and :meth:`fetch_state` return futures at once; the learner polls them.
    At most one operation per fragment is in flight (the learner enforces it).
    """

    def __init__(self, cfg: Config, fragment: int, names: Sequence[str], shapes: Mapping[str, torch.Size],
                 dht: Any, private_key: Any, *, membership: Any = None,
                 state_provider: Callable[[], tuple[dict[str, Any], list[torch.Tensor]]] | None = None,
                 runner_class: type[ExactAllReduceRunner] = ExactAllReduceRunner, start: bool = True) -> None:
        """``start=False``: the averager process is started by :meth:`start_background` (several at once)."""
        from p2p_diloco.swarm import owner_peer_id, owner_subkey

        quiet_expected_failures()  # before our averager process is forked
        a = cfg.averaging
        self.cfg, self.fragment, self.names, self.dht = cfg, fragment, tuple(names), dht
        self.prefix = averager_prefix(cfg.run.run_id, fragment)
        self.report_subkey = owner_subkey(private_key)  # verdicts are signed: nobody can vote for us
        if owner_peer_id(self.report_subkey) != dht.peer_id.to_base58():
            raise ValueError(f"the DHT's peer id {dht.peer_id} is not the one of the signing key: start the DHT with "
                             f"the same identity (SwarmOptions.identity) so that verdicts can be matched to members")
        self.config_hash = config_hash(cfg)
        self.radial_names = tuple(n for n in names if cfg.outer.merge == "radial" and not outer.uses_plain_merge(n))
        self.robust = outer.robust_rule(cfg.outer.robust, cfg.outer.clip_factor)
        self.buffers = [torch.zeros(shapes[n], dtype=torch.float32) for n in self.names]
        self.averager = FragmentAverager(
            self.buffers, dht, start=start, prefix=self.prefix,
            target_group_size=a.target_group_size or None, min_group_size=a.min_group_size,
            initial_group_bits=version_group_bits(0), min_matchmaking_time=a.window_s,
            request_timeout=a.request_timeout_s, allreduce_timeout=a.allreduce_timeout_s,
            next_chunk_timeout=a.next_chunk_timeout_s, sender_timeout=a.next_chunk_timeout_s,
            reducer_timeout=2 * a.next_chunk_timeout_s, compression=get_codec(cfg.outer.codec),
            shutdown_timeout=a.shutdown_timeout_s, allow_state_sharing=state_provider is not None,
            declare_state_period=max(1.0, a.record_ttl_s), membership=membership, state_provider=state_provider,
            runner_class=runner_class, report_subkey=self.report_subkey, fragment=fragment,
            robust=self.robust,
            layout=(self.names, {n: b.shape for n, b in zip(self.names, self.buffers)}),
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"averaging-f{fragment}")
        self._cancelled = threading.Event()

    def start_background(self) -> None:
        """Start the averager process without waiting for it (then :meth:`wait_ready`)."""
        with procguard.handlers_kept():  # hivemind sets SIGINT to SIG_IGN here, in our process
            self.averager.run_in_background(await_ready=False)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the averager process serves requests; raises what made it fail to start."""
        self.averager.wait_until_ready(timeout=timeout_s)

    def cancel(self) -> None:
        """Leaving: end the round in flight at once (discarded) and start no new one."""
        self._cancelled.set()

    # -- rounds
    def start_round(self, contribution: Contribution) -> "Future[RoundOutcome]":
        return self._executor.submit(self._round, contribution)

    def _round(self, c: Contribution) -> RoundOutcome:
        a = self.cfg.averaging
        t0 = time.monotonic()
        base = dict(fragment=self.fragment, version=c.meta.version, window_s=c.window_s)
        sent0, received0 = self.averager.bytes_sent.value, self.averager.bytes_received.value

        def failed(reason: str, **extra: Any) -> RoundOutcome:
            now = time.monotonic()
            return RoundOutcome(**base, committed=False, reason=reason, duration_s=now - t0, finished_at=now,
                                bytes_sent=self.averager.bytes_sent.value - sent0,
                                bytes_received=self.averager.bytes_received.value - received0, **extra)

        if c.meta.weight <= 0:
            return failed("no progress since the last sync (weight 0): not joining")
        if self._cancelled.is_set():
            return failed("cancelled: this peer is leaving")
        self.averager.set_group_bits(version_group_bits(c.meta.version, c.meta.anchor))
        with self.averager.get_tensors() as buffers:
            for buf, name in zip(buffers, self.names):
                buf.copy_(c.tensors[name])
        # a lone peer gives up after two windows past the scheduled start
        matchmaking_timeout_s = max(0.0, c.scheduled_time - get_dht_time()) + 2 * c.window_s
        control = self.averager.step(gather=c.meta.to_wire(), weight=c.meta.weight, scheduled_time=c.scheduled_time,
                                     timeout=matchmaking_timeout_s, allow_retries=False, wait=False)
        give_up_at = time.monotonic() + matchmaking_timeout_s + a.allreduce_timeout_s + a.request_timeout_s
        while True:
            try:
                gathered = control.result(timeout=max(0.01, min(CANCEL_POLL_S, give_up_at - time.monotonic())))
                break
            except TimeoutError:
                if self._cancelled.is_set():  # we are leaving: do not make the others wait for us
                    control.cancel()
                    return failed("cancelled: this peer is leaving")
                if time.monotonic() >= give_up_at:
                    control.cancel()
                    return failed(f"round exceeded {matchmaking_timeout_s + a.allreduce_timeout_s:.1f} s")
            except Exception as e:  # hivemind raises on every failure; the round is discarded with its reason
                text = str(e).strip().splitlines()
                return failed(f"{type(e).__name__}: {text[-1] if text else ''}"[:300])
        if not gathered:
            return failed("all-reduce returned no group")
        peers = tuple(str(p) for p in gathered)
        try:
            metas = parse_gathered(gathered)
        except ValueError as e:
            return failed(f"bad metadata from a member: {e}", group_size=len(peers), peers=peers)
        weights = tuple(m.weight for m in metas)
        spread = max(m.due for m in metas) - min(m.due for m in metas)
        extra = dict(group_size=len(peers), peers=peers, weights=weights, arrival_spread_s=spread)
        decision = check_group(c.meta, metas, self.radial_names, min_group_size=a.min_group_size,
                               weighting=self.cfg.outer.weighting)
        averaged: dict[str, torch.Tensor] = {}
        if decision.ok:
            with self.averager.get_tensors() as buffers:
                averaged = {n: b.clone() for n, b in zip(self.names, buffers)}
            if not all(bool(torch.isfinite(t).all()) for t in averaged.values()):
                decision = Decision(False, "averaged tensors are not finite")
        # phase two: nobody commits unless every member's all-reduce was complete and its checks passed
        key = commit_key(self.prefix, dict(zip(peers, metas)))
        verdict = self._agree(key, peers, "ok" if decision.ok else decision.reason)
        if not decision.ok:
            return failed(decision.reason, **extra)
        if not verdict.ok:
            return failed(verdict.reason, **extra)
        merged = outer.decode_merged(averaged, [m.norms for m in metas], list(weights), self.cfg.outer.merge,
                                     self.robust)
        now = time.monotonic()
        return RoundOutcome(**base, committed=True, reason="ok", own_share=c.meta.weight / sum(weights),
                            duration_s=now - t0, finished_at=now, bytes_sent=self.averager.bytes_sent.value - sent0,
                            bytes_received=self.averager.bytes_received.value - received0, merged=merged, **extra)

    def _agree(self, key: str, peers: Sequence[str], own_verdict: str) -> Decision:
        """Post our verdict under ``key`` (signed subkey), then read the others' until all are in or
        ``commit_timeout_s`` passes; returns :func:`commit_decision` of what was read."""
        from p2p_diloco.swarm import owner_peer_id

        timeout_s = self.cfg.averaging.commit_timeout_s
        deadline = time.monotonic() + timeout_s
        self.dht.store(key, own_verdict[:300], get_dht_time() + 10 * timeout_s + 60, subkey=self.report_subkey)
        reports: dict[str, str] = {}
        while True:
            found = self.dht.get(key, latest=True)
            if found is not None and isinstance(found.value, dict):
                for subkey, item in found.value.items():
                    pid = owner_peer_id(subkey)
                    if pid is not None and isinstance(item.value, str):
                        reports[pid] = item.value
            decision = commit_decision(reports, peers)
            if decision.ok or any(reports.get(p, "ok") != "ok" for p in peers) or time.monotonic() >= deadline:
                if not decision.ok and "no verdict" in decision.reason:
                    decision = Decision(False, f"{decision.reason} within {timeout_s:g} s")
                return decision
            time.sleep(0.05)

    # -- state download
    def fetch_state(self, ours: tuple[int, str]) -> "Future[Download]":
        """Download a state ahead of ``ours`` = (version, anchor hash) in :func:`anchor_order`."""
        return self._executor.submit(self._fetch, ours)

    def _fetch(self, ours: tuple[int, str]) -> "Download":
        """Try the donors of :func:`donor_order` in turn, each for at most ``state_timeout_s`` (silent for
        ``next_chunk_timeout_s`` between chunks: dropped); every payload is size-capped and checked
        (:func:`parse_state`: shapes, finite values, the anchor hash) before it is returned."""
        a = self.cfg.averaging
        t0 = time.monotonic()
        deadline_s = a.state_timeout_s * MAX_DONORS_TRIED + a.request_timeout_s
        fetched, attempts = self.averager.download_state(ours, a.state_timeout_s).result(timeout=deadline_s)
        return Download(fetched, tuple(attempts), time.monotonic() - t0)

    def set_anchor(self, version: int, anchor: str) -> None:
        """Advertise our anchor's rank as state-sharing priority (donors ahead in :func:`anchor_order` first)."""
        if self.averager.allow_state_sharing:
            self.averager.state_sharing_priority = sharing_priority(version, anchor)

    def refusals(self) -> int:
        """Requests from non-members that our handlers refused so far."""
        return int(self.averager.refused.value)

    def bytes_total(self) -> tuple[int, int]:
        return int(self.averager.bytes_sent.value), int(self.averager.bytes_received.value)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        procguard.stop_process(self.averager, f"averager of fragment {self.fragment}")


def state_payload(fragment: int, version: int, anchor: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor],
                  names: Sequence[str]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """What a donor sends: metadata and the anchor then the momentum tensors, in ``names`` order."""
    zeros = {n: torch.zeros_like(anchor[n]) for n in names if n not in momentum}
    tensors = [anchor[n].detach().clone() for n in names] + [(momentum.get(n, zeros.get(n))).detach().clone() for n in names]
    meta = {"fragment": fragment, "version": version, "anchor": anchor_hash({n: anchor[n] for n in names}),
            "momentum": bool(momentum)}
    return meta, tensors


def parse_state(metadata: Any, tensors: Sequence[torch.Tensor], fragment: int, names: Sequence[str],
                shapes: Mapping[str, torch.Size], ours: tuple[int, str]) -> FetchedState | None:
    """Validate a downloaded state (everything from a peer is checked: metadata keys and types, the
    version, tensor count, shapes, dtypes, finite values, the anchor hash); None if it is not ahead of
    ``ours`` = (version, anchor hash) in :func:`anchor_order`. Raises
    :class:`~p2p_diloco.rejects.PeerDataError`."""
    def refuse(reason: Reason, message: str) -> PeerDataError:
        return PeerDataError(reason, f"state download: {message}"[:300])

    if (not isinstance(metadata, Mapping) or set(metadata) != STATE_METADATA_KEYS
            or type(metadata["fragment"]) is not int or metadata["fragment"] != fragment):
        raise refuse(Reason.MALFORMED, f"metadata is not for fragment {fragment}: {metadata!r:.160}")
    version = metadata["version"]
    if type(version) is not int or not 0 <= version <= MAX_WIRE_INT:
        raise refuse(Reason.BAD_VERSION, f"bad version {version!r:.40}")
    if not isinstance(metadata["anchor"], str) or not _ANCHOR_RE.match(metadata["anchor"]):
        raise refuse(Reason.MALFORMED, f"bad anchor hash {metadata['anchor']!r:.40}")
    if not isinstance(metadata["momentum"], bool):
        raise refuse(Reason.MALFORMED, f"bad momentum flag {metadata['momentum']!r:.40}")
    if version < ours[0]:
        return None
    if len(tensors) != 2 * len(names):
        raise refuse(Reason.OVERSIZE if len(tensors) > 2 * len(names) else Reason.MALFORMED,
                     f"{len(tensors)} tensors, expected {2 * len(names)}")
    anchor, momentum = {}, {}
    for i, n in enumerate(names):
        for t, sink in ((tensors[i], anchor), (tensors[len(names) + i], momentum)):
            if not isinstance(t, torch.Tensor):
                raise refuse(Reason.MALFORMED, f"tensor {n} is a {type(t).__name__}")
            if tuple(t.shape) != tuple(shapes[n]):
                raise refuse(Reason.BAD_SHAPE, f"tensor {n} is {tuple(t.shape)}/{t.dtype} or not finite")
            if t.dtype != torch.float32:
                raise refuse(Reason.BAD_DTYPE, f"tensor {n} is {tuple(t.shape)}/{t.dtype} or not finite")
            if not bool(torch.isfinite(t).all()):
                raise refuse(Reason.NON_FINITE, f"tensor {n} is {tuple(t.shape)}/{t.dtype} or not finite")
            sink[n] = t.clone()
    digest = anchor_hash(anchor)
    if digest != metadata["anchor"]:
        raise refuse(Reason.BAD_HASH, f"anchor hash {digest} does not match the donor's {metadata['anchor']!r}")
    if not is_ahead((version, digest), ours):
        return None
    return FetchedState(version, anchor, momentum if metadata["momentum"] else {}, digest)


def decode_state_metadata(blob: bytes) -> Any:
    """The msgpack metadata of a state download, decoded strictly: at most ``MAX_STATE_METADATA_BYTES``,
    plain msgpack (no extension types: hivemind's serializer would run its extension hooks on a peer's
    bytes). What it holds is checked by :func:`parse_state`."""
    if len(blob) > MAX_STATE_METADATA_BYTES:
        raise PeerDataError(Reason.OVERSIZE, f"state download: metadata of {len(blob)} bytes, "
                                             f"at most {MAX_STATE_METADATA_BYTES}")

    def no_ext(code: int, _data: bytes) -> Any:
        raise ValueError(f"msgpack extension type {code}")

    try:
        return msgpack.unpackb(blob, raw=False, strict_map_key=True, ext_hook=no_ext)
    except Exception as e:  # msgpack's errors are several classes; all mean the same here
        raise PeerDataError(Reason.MALFORMED,
                            f"state download: undecodable metadata: {type(e).__name__}: {e}"[:200]) from None
