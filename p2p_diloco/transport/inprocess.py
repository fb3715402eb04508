"""N engines in one process: an in-process network (:class:`Hub`) for the simulator and protocol tests.

Each member is a real :class:`~p2p_diloco.engine.engine.DiLoCo` with its own loop (usually a thread): its round
policy, catch-up, late commits and events are the engine's own; only what crosses the network is replaced here.

- **Rounds.** A round's contribution (the engine's :class:`~p2p_diloco.sync.fragment.Contribution`, planned as the
  hivemind host plans it: :func:`~p2p_diloco.transport.planning.plan_round`) goes to the hub, which groups the
  contributions of one fragment at one (version, anchor hash) -- as hivemind's group key does -- that arrive before
  the first one's scheduled time (its matchmaking window). At that time the group closes: with
  fewer than ``max(2, averaging.min_group_size)`` members it fails for all ("could not find a group"); if any
  member's quorum check refuses it (a minority of the live learners at that rank), it fails for all; otherwise the
  weighted average is reduced through the run's codec as hivemind's butterfly all-reduce would send it
  (:func:`~p2p_diloco.hivemind_ext.compression.simulate_allreduce`, or the robust reducers' rule), merged
  (:func:`~p2p_diloco.core.outer.decode_merged`) and handed to every member alike: identical anchors inside a group.
  A member killed while its group is open fails the group (a partial all-reduce).
- **Downloads** come from the live member ranked best ahead of us, through the same payload and checks as a
  network download (:func:`~p2p_diloco.averaging.transfer.state_payload`, :func:`~p2p_diloco.averaging.transfer.
  parse_state`).
- **The view** each engine reads is the members' live state: their fragment ranks, states and steps; the clock is
  the run's fixed period (``averaging.schedule = "clock"`` with ``sync_period_s``) or none (``"steps"``).
- **Groups from the clock** (``averaging.matchmaking = "clock"``): each member names its group as a pure function of
  the clock's round and the ranks its view holds (:func:`~p2p_diloco.core.groups.clock_group`); the hub groups the
  contributions by that id -- as hivemind's runner refuses streams of another group id -- and starts the all-reduce
  as soon as every member named is in or declined (:meth:`Hub.decline`: it skips the boundary); by the scheduled
  time it goes on without the members named that are not in (declined or not), if more than half of all named are in
  (:func:`~p2p_diloco.core.groups.without_absent`), else fails the round for all alike (``incomplete group``): the
  decision one of the group's leaders makes over hivemind (:func:`~p2p_diloco.core.groups.group_leaders`).

Faults from outside: :meth:`Hub.kill` (kill -9), :meth:`Hub.partition` and :meth:`Hub.heal` (a split network: each side
sees and averages only with itself), :attr:`Hub.tamper` (a member that poisons what it sends), :meth:`Hub.blind` (a
member's view misses some live members: records that lag), :meth:`Hub.lose_verdicts` (a member's all-reduce completes
but the others' verdicts never reach it), :meth:`Hub.delay` (a round's outcome reaches a member late: a slow link's
tail). Not yet: grid groups and the derived clock (refused), seeded delays and drops.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from p2p_diloco.averaging.decisions import RoundMeta, anchor_order, is_ahead
from p2p_diloco.averaging.host import Download
from p2p_diloco.averaging.plans import RoundOutcome, RoundPlan
from p2p_diloco.averaging.linktime import payload_bytes
from p2p_diloco.averaging.transfer import parse_state, state_payload
from p2p_diloco.core import outer
from p2p_diloco.core.config import Config
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.replay import KeptRound, PackedRound, chain, keep, parse_rounds, rounds_payload
from p2p_diloco.net.records import STEPPING_STATES
from p2p_diloco.transport.hubgroups import (Member, Offer, OpenGroup, RoundRecord, absent_members, average,
                                             failed_outcomes, refusal, round_record)
from p2p_diloco.transport.planning import LastGroup, clock_boundary_ms, plan_round

if TYPE_CHECKING:
    from p2p_diloco.averaging.linktime import LinkEstimate
    from p2p_diloco.net.clock import SyncClock
    from p2p_diloco.sync.fragment import Contribution
    from p2p_diloco.sync.slot import FragmentSlot
    from p2p_diloco.transport.network import Host, Rank, RoundContext, View

Tamper = Callable[["Member", dict[str, torch.Tensor], dict[str, float]],
                  tuple[dict[str, torch.Tensor], dict[str, float]]]
"""What a member sends instead of ``(tensors, norms)`` (:attr:`Hub.tamper`)."""
LEAVING = "cancelled: this peer is leaving"
VERDICTS_LOST = "verdicts missing"
"""Why a member whose verdicts were lost (:meth:`Hub.lose_verdicts`) discards a round the others commit."""
KILLED = "partial all-reduce: a member of the group died"
WAIT_POLL_S = 0.05
"""How often a wait for peers looks at the members."""
DECLINE_KEEP_S = 120.0
"""How long the hub keeps a decline of a group nobody has opened yet (as an averager keeps one)."""


def check_supported(cfg: Config) -> None:
    """Raise ``ValueError`` for what the in-process network does not do yet."""
    a = cfg.averaging
    if a.groups == "grid":
        raise ValueError("in-process network: averaging.groups = \"grid\" is not supported yet")
    if a.schedule == "clock" and a.sync_period_s <= 0:
        raise ValueError("in-process network: the derived clock is not supported: set averaging.sync_period_s > 0 "
                         "or averaging.schedule = \"steps\"")


class Hub:
    """An in-process swarm of one run: members join with :meth:`join` and build their engines with the network it
    returns (``DiLoCo(model, opt, swarm, network=swarm.network)``)."""

    def __init__(self, cfg: Config, *, manual: bool = False) -> None:
        """``manual``: groups close only when :meth:`close_open` is called (a driver that steps every engine in
        turn, deterministically), not at their members' scheduled times; the engines see no clock (the driver's
        ticks are it: it hands the due fragments off, ``DiLoCo.hand_off``)."""
        if not manual:
            check_supported(cfg)
        self.manual = manual
        self.cfg, self.config_hash = cfg, config_hash(cfg)
        self.robust = outer.robust_rule(cfg.outer.robust, cfg.outer.clip_factor)
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._open: dict[tuple[int, int, str, int, str], OpenGroup] = {}
        self._ids = itertools.count()
        self.rounds: list[RoundRecord] = []
        """Every round that ended, in order."""
        self.tamper: Tamper | None = None
        """Faults from outside: what a member sends instead of its honest contribution (the poisoning benchmark's
        attacker), given its encoded tensors and radial norms; None: everyone is honest."""
        self.round_bytes = 0
        """Bytes the committed rounds' members sent together, as hivemind's butterfly all-reduce would."""
        self._blind: dict[str, set[str]] = {}  # name -> names its view misses
        self._lost_verdicts: dict[str, int] = {}  # name -> how many more committed rounds lose their verdicts
        self._delays: dict[str, float] = {}  # name -> seconds its next round's outcome comes late
        self._declines: dict[tuple[int, int], tuple[set[str], float]] = {}
        """Groups from the clock: (fragment, boundary in DHT ms) -> (the members that skip it, when the first said so)."""
        self._left: set[tuple[int, str]] = set()  # (fragment, peer id): done with its rounds for good (leave)

    # ------------------------------------------------------------ members

    def join(self, name: str) -> LocalSwarm:
        """A new member (a peer id of its own; ``name`` must not be a live member's)."""
        with self._lock:
            if any(m.name == name and m.alive and m.state != "left" for m in self._members.values()):
                raise ValueError(f"name {name!r}: already taken by a live member")
            member = Member(peer_id=f"inproc-{next(self._ids):04d}-{name}", name=name)
            self._members[member.peer_id] = member
        return LocalSwarm(self, member)

    def kill(self, name: str) -> None:
        """``name`` dies at once (kill -9): it leaves every view, and its open groups fail for all their members."""
        with self._lock:
            member = next(m for m in self._members.values() if m.name == name and m.alive)
            member.alive = False
            doomed = [g for g in self._open.values() if any(o.member is member for o in g.offers)]
        for group in doomed:
            self._close(group, failure=KILLED)

    def partition(self, *sides: Sequence[str]) -> None:
        """Split the network: each of ``sides`` (members' names) sees and averages only with itself; members not
        named form one more side. Groups open across the cut fail for all their members (a partial all-reduce)."""
        with self._lock:
            side_of = {name: i + 1 for i, names in enumerate(sides) for name in names}
            for m in self._members.values():
                m.side = side_of.get(m.name, 0)
            split = [g for g in self._open.values() if len({o.member.side for o in g.offers}) > 1]
        for group in split:
            self._close(group, failure="partial all-reduce: the network split under the group")

    def blind(self, name: str, *hidden: str) -> None:
        """``name``'s view misses the live members ``hidden`` (their records lag behind for it), until :meth:`unblind`:
        with groups from the clock, its group differs from theirs."""
        with self._lock:
            self._blind[name] = set(hidden)

    def unblind(self, name: str) -> None:
        with self._lock:
            self._blind.pop(name, None)

    def lose_verdicts(self, name: str, rounds: int = 1) -> None:
        """The verdicts of ``name``'s next ``rounds`` complete all-reduces do not reach it: it discards each (keeping
        the result as its pending round) while the others commit it."""
        with self._lock:
            self._lost_verdicts[name] = rounds

    def delay(self, name: str, seconds: float) -> None:
        """The outcome of ``name``'s next round reaches it ``seconds`` after its group ended (a slow link's tail):
        its round stays in flight meanwhile, so a boundary of the fragment may come while it is (the engine skips it,
        and with groups from the clock declines it)."""
        with self._lock:
            self._delays[name] = seconds

    def heal(self) -> None:
        """End a partition: everyone sees everyone again."""
        with self._lock:
            for m in self._members.values():
                m.side = 0

    def members(self) -> list[Member]:
        """Every member that ever joined (dead and departed ones too), in joining order."""
        with self._lock:
            return list(self._members.values())

    def others(self, member: Member) -> list[Member]:
        """The live members with an engine on ``member``'s side of a partition, but ``member``."""
        with self._lock:
            return [m for m in self._members.values() if m is not member and m.alive and m.state != "left"
                    and m.engine is not None and m.side == member.side]

    def seen_by(self, member: Member) -> list[Member]:
        """:meth:`others` as ``member``'s view has them (:meth:`blind`)."""
        with self._lock:
            hidden = self._blind.get(member.name, set())
        return [m for m in self.others(member) if m.name not in hidden]

    # ------------------------------------------------------------ rounds

    def offer(self, member: Member, fragment: int, c: Contribution, plan: RoundPlan) -> Future[RoundOutcome]:
        """Add ``member``'s contribution to the open group of its fragment and rank; a new group closes at its
        scheduled time."""
        done: Future[RoundOutcome] = Future()
        with self._lock:
            key = (fragment, c.version, c.anchor_hash, member.side, plan.group_id)
            if member.peer_id in self._declines.get((fragment, plan.boundary_ms), ((), 0.0))[0]:
                done.set_result(RoundOutcome(fragment=fragment, version=c.version, committed=False, reason=(
                    f"we declined the round at {plan.boundary_ms} ms: its groups go on without us"),
                    finished_at=time.monotonic()))
                return done
            group = self._open.get(key)
            if group is None:
                group = self._open[key] = OpenGroup(key, [], members=plan.members, boundary_ms=plan.boundary_ms)
                if not self.manual:
                    timer = threading.Timer(max(0.0, plan.scheduled_time - time.time()), self._close, (group,))
                    timer.daemon = True
                    timer.start()
            group.offers.append(Offer(member, c, plan, done))
            group.complete = self._all_in(group)
        if group.complete:  # groups from the clock: everyone named is in, the all-reduce starts (no window to wait out)
            self._close(group)
        return done

    def decline(self, member: Member, fragment: int, boundary_ms: int) -> None:
        """Groups from the clock: ``member`` skips ``fragment``'s boundary ``boundary_ms`` (DHT ms): any group of it
        that names ``member`` goes on without it once everyone else named is in (:func:`~p2p_diloco.core.groups.
        without_absent`), as over hivemind, where its averager answers their offer requests so."""
        now = time.monotonic()
        with self._lock:
            for old in [k for k, (_, since) in self._declines.items() if now - since > DECLINE_KEEP_S]:
                del self._declines[old]
            self._declines.setdefault((fragment, boundary_ms), (set(), now))[0].add(member.peer_id)
            ready = self._now_complete(fragment, boundary_ms)
        for group in ready:
            self._close(group)

    def leave(self, member: Member, fragment: int) -> None:
        """``member`` is done with ``fragment``'s rounds for good: its groups go on without it, their majority counted
        without it (:func:`~p2p_diloco.core.groups.without_absent`), as over hivemind."""
        with self._lock:
            self._left.add((fragment, member.peer_id))
            ready = self._now_complete(fragment)
        for group in ready:
            self._close(group)

    def _now_complete(self, fragment: int, boundary_ms: int | None = None) -> list[OpenGroup]:
        """``fragment``'s open groups (at ``boundary_ms``; None: any) everyone named is in or out of (under the lock)."""
        for group in self._open.values():
            group.complete = group.complete or self._all_in(group)
        return [g for g in self._open.values() if g.complete and g.key[0] == fragment
                and boundary_ms in (None, g.boundary_ms)]

    def _gone(self, group: OpenGroup) -> set[str]:  # the members it names that left (under the lock)
        return {p for p in group.members if (group.key[0], p) in self._left}

    def _declined(self, group: OpenGroup) -> set[str]:
        """The members ``group`` names that declined its boundary (under the lock)."""
        return self._declines.get((group.key[0], group.boundary_ms), (set(), 0.0))[0] & set(group.members)

    def _all_in(self, group: OpenGroup) -> bool:
        """Groups from the clock: every member the group's id names is in or declined (under the lock)."""
        said = self._declined(group) | self._gone(group)
        return bool(group.members) and set(group.members) <= {o.member.peer_id for o in group.offers} | said

    def close_open(self) -> int:
        """Close every open group now, in key order (a manual hub's driver calls it once all members that are due
        have offered); returns how many closed."""
        with self._lock:
            groups = [self._open[k] for k in sorted(self._open)]
        for group in groups:
            self._close(group)
        return len(groups)

    def cancel(self, member: Member, fragment: int) -> None:
        """``member`` leaves: its contributions to open groups of ``fragment`` end, discarded; the others go on."""
        with self._lock:
            for group in self._open.values():
                if group.key[0] != fragment:
                    continue
                for o in [o for o in group.offers if o.member is member]:
                    group.offers.remove(o)
                    o.done.set_result(RoundOutcome(fragment=fragment, version=group.key[1], committed=False,
                                                   reason=LEAVING, finished_at=time.monotonic()))

    def _close(self, group: OpenGroup, failure: str = "") -> None:
        with self._lock:
            if group.closed:
                return
            group.closed = True
            if self._open.get(group.key) is group:
                del self._open[group.key]
            offers, declined, left = list(group.offers), self._declined(group), self._gone(group)
        if not offers:
            return
        reason = failure or refusal(self.cfg, offers, declined, left)
        outcomes = failed_outcomes(group, offers, reason) if reason else self._reduced(group, offers)
        self.rounds.append(round_record(group, offers, outcomes, declined, left))
        for o, outcome in zip(offers, outcomes):
            with self._lock:
                late_s = self._delays.pop(o.member.name, 0.0)
            if late_s > 0:  # its link's tail: the outcome reaches it later (its round stays in flight meanwhile)
                timer = threading.Timer(late_s, o.done.set_result, (outcome,))
                timer.daemon = True
                timer.start()
            else:
                o.done.set_result(outcome)

    def _reduced(self, group: OpenGroup, offers: Sequence[Offer]) -> list[RoundOutcome]:
        """The weighted average of the group's contributions through the run's codec, merged: the same for all."""
        o_cfg, t0 = self.cfg.outer, time.monotonic()
        weights = [o.contribution.weight for o in offers]
        sent = [(o.contribution.tensors, o.contribution.norms) if self.tamper is None
                else self.tamper(o.member, o.contribution.tensors, o.contribution.norms) for o in offers]
        averaged = average(o_cfg.codec, [t for t, _ in sent], weights, self.robust)
        now = time.monotonic()
        if not all(bool(torch.isfinite(t).all()) for t in averaged.values()):
            return failed_outcomes(group, offers, "averaged tensors are not finite")
        merged = outer.decode_merged(averaged, [norms for _, norms in sent], weights, o_cfg.merge, self.robust)
        total, peers = sum(weights), tuple(o.member.peer_id for o in offers)
        dues = [o.plan.due for o in offers]
        moved = int(2 * (len(offers) - 1) / len(offers)
                    * payload_bytes(sum(t.numel() for t in averaged.values()), o_cfg.codec))
        outcomes, absent = [], len(absent_members(offers))
        with self._lock:
            self.round_bytes += moved * len(offers)
        for o in offers:
            with self._lock:
                o.member.bytes_sent += moved
                o.member.bytes_received += moved
                lost = self._lost_verdicts.get(o.member.name, 0) > 0
                if lost:
                    self._lost_verdicts[o.member.name] -= 1
            if lost:  # its all-reduce was complete, the others' "ok" never came: keep the result, as hivemind's host
                outcomes.append(RoundOutcome(
                    fragment=group.key[0], version=group.key[1], committed=False, reason=VERDICTS_LOST,
                    group_size=len(offers), peers=peers, finished_at=now, window_s=o.plan.window_s,
                    pending={n: t.clone() for n, t in merged.items()}))
                continue
            outcomes.append(RoundOutcome(
                fragment=group.key[0], version=group.key[1], committed=True, reason="committed", group_size=len(offers),
                peers=peers, own_share=o.contribution.weight / total, weights=tuple(weights), bytes_sent=moved,
                bytes_received=moved, duration_s=now - o.arrived, finished_at=now,
                arrival_spread_s=max(dues) - min(dues),
                waited_s=max(0.0, max(dues) - o.plan.due), window_s=o.plan.window_s, allreduce_s=now - t0,
                merged={n: t.clone() for n, t in merged.items()}, absent=absent))
        return outcomes

    # ------------------------------------------------------------ downloads

    def fetch(self, member: Member, fragment: int, ours: Rank, donors: Collection[str],
              replay: bool = True) -> Future[Download]:
        """The state of ``fragment`` from the live member among ``donors`` (peer ids: the member's view's) ranked best
        ahead of ``ours`` by what it holds now (none: nothing newer); with ``replay``, the rounds it kept from
        ``ours`` instead where it kept them (through their wire form, as a network replay would get them)."""
        t0, done = time.monotonic(), Future[Download]()
        wanted = set(donors)
        candidates = [(m, m.ranks()[fragment]) for m in self.others(member) if m.peer_id in wanted]
        ahead = sorted(((m, r) for m, r in candidates if is_ahead(r, ours)), key=lambda d: anchor_order(*d[1]),
                       reverse=True)
        if not ahead:
            done.set_result(Download(None, (), time.monotonic() - t0))
            return done
        donor = ahead[0][0]
        slot = donor.engine.slots[fragment]
        shapes = {n: slot.anchor[n].shape for n in slot.names}
        rounds = chain(donor.kept.get(fragment, []), ours) if replay else []
        if rounds:
            data = rounds_payload([PackedRound.of(k, slot.names) for k in rounds])
            with self._lock:
                member.bytes_received += len(data)
                donor.bytes_sent += len(data)
            done.set_result(Download(None, (), time.monotonic() - t0, len(data),
                                     replayed=tuple(parse_rounds(data, slot.names, shapes, ours))))
            return done
        with slot.lock:
            meta, tensors = state_payload(fragment, slot.version, slot.anchor, slot.state.momentum, slot.names)
        try:
            fetched = parse_state(meta, tensors, fragment, slot.names, shapes, ours)
        except Exception as e:  # what a network download would refuse: this donor failed us
            done.set_result(Download(None, ((donor.peer_id, f"{type(e).__name__}: {e}"[:200], 0.0),),
                                     time.monotonic() - t0))
            return done
        received = sum(t.numel() * t.element_size() for t in tensors)
        with self._lock:
            member.bytes_received += received
            donor.bytes_sent += received
        done.set_result(Download(fetched, ((donor.peer_id, "ok", time.monotonic() - t0),), time.monotonic() - t0,
                                 received))
        return done


class LocalSwarm:
    """One member of a :class:`Hub` as an engine sees a joined swarm (``config``, ``joined``, ``local``) plus its
    ``network``: ``DiLoCo(model, opt, swarm, network=swarm.network)``. :meth:`close` leaves (a tombstone)."""

    def __init__(self, hub: Hub, member: Member) -> None:
        self.hub, self.member, self.config = hub, member, hub.cfg
        self.joined = SimpleNamespace(peer_id=member.peer_id, name=member.name, dht=None, private_key=None,
                                      publisher=SimpleNamespace(update=self._publish))
        self.local = SimpleNamespace(run_id=hub.cfg.run.run_id, config_hash=hub.config_hash)
        self.membership = None
        self.network = InProcessNetwork(hub, member)
        self.closed = False

    def _publish(self, **fields: Any) -> None:
        if "state" in fields:
            self.member.state = str(fields["state"])

    def close(self) -> None:
        self.member.state, self.closed = "left", True


class InProcessNetwork:
    """One member's :class:`~p2p_diloco.transport.network.Network` on a :class:`Hub`."""

    def __init__(self, hub: Hub, member: Member) -> None:
        self.hub, self.member = hub, member

    def hosts(self, cfg: Config, slots: Sequence[FragmentSlot], shapes: Mapping[str, torch.Size]) -> list[Host]:
        if cfg is not self.hub.cfg and config_hash(cfg) != self.hub.config_hash:
            raise ValueError("in-process network: the engine's config is not the hub's run")
        return [InProcessHost(self.hub, self.member, s.index) for s in slots]

    def view(self, engine: Any) -> View:
        self.member.engine = engine
        return InProcessView(self.hub, self.member, engine)


class InProcessHost:
    """One fragment's rounds and downloads of one member, through the hub."""

    def __init__(self, hub: Hub, member: Member, fragment: int) -> None:
        self.hub, self.member, self.fragment = hub, member, fragment
        self.prefix = f"{hub.cfg.run.run_id}_f{fragment}"
        self._last_group = LastGroup()

    def start_round(self, contribution: Contribution, context: RoundContext) -> Future[RoundOutcome]:
        """Planned as the hivemind host plans it (:func:`~p2p_diloco.transport.planning.plan_round`): the hub closes
        the group at its scheduled time and checks its quorum. Its wire metadata is checked as the hivemind host's
        is (:meth:`RoundMeta.of`: raises on the training thread), though nothing is sent."""
        RoundMeta.of(contribution, self.hub.config_hash, context.due)
        plan = plan_round(contribution, context, self.hub.cfg, self.prefix, self._last_group.get())
        return self._last_group.watch(self.hub.offer(self.member, self.fragment, contribution, plan))

    def decline(self, context: RoundContext) -> None:
        boundary_ms = clock_boundary_ms(self.fragment, context, self.hub.cfg)
        if boundary_ms >= 0:
            self.hub.decline(self.member, self.fragment, boundary_ms)

    def leave(self) -> None:
        if self.hub.cfg.averaging.clock_groups:
            self.hub.leave(self.member, self.fragment)

    def fetch_state(self, ours: Rank, donors: Mapping[str, Rank], link: LinkEstimate | None = None,
                    replay: bool = True) -> Future[Download]:
        return self.hub.fetch(self.member, self.fragment, ours, donors, replay)

    def keep_round(self, kept: KeptRound) -> None:
        limit = self.hub.cfg.averaging.kept_rounds
        if limit > 0:
            self.member.kept[self.fragment] = keep(self.member.kept.get(self.fragment, []), kept, limit)

    def last_group(self) -> tuple[int, tuple[str, ...]]:
        return self._last_group.get()

    def vouch(self, version: int, anchor: str) -> None:
        """Nothing to sign: the hub's downloads are its members' own state."""

    def cancel(self) -> None:
        self.hub.cancel(self.member, self.fragment)

    def shutdown(self) -> None:
        self.cancel()

    def bytes_total(self) -> tuple[int, int]:
        return self.member.bytes_sent, self.member.bytes_received


class InProcessView:
    """What one member's engine reads of the hub: the other live members as they are now."""

    def __init__(self, hub: Hub, member: Member, engine: Any) -> None:
        from p2p_diloco.net.clock import SyncClock

        self.hub, self.member, self.engine = hub, member, engine
        a = hub.cfg.averaging
        self.clock: SyncClock | None = (SyncClock(a.sync_period_s) if a.schedule == "clock" and not hub.manual
                                        else None)
        """The run's fixed clock; none on a manual hub (its driver keeps the clock and hands fragments off)."""
        self.swarm_reads = 0

    @property
    def peer_anchors(self) -> list[list[Rank]]:
        return [m.ranks() for m in self.hub.seen_by(self.member)]

    @property
    def peer_ids(self) -> list[str]:
        return [m.peer_id for m in self.hub.seen_by(self.member)]

    @property
    def peer_states(self) -> list[str]:
        return [m.state for m in self.hub.seen_by(self.member)]

    @property
    def peer_steps(self) -> list[tuple[int, float, float]]:
        """(inner step, now, seconds per step) of the members that train."""
        out = []
        for m in self.hub.seen_by(self.member):
            e = m.engine
            steps = e.inner_step - e.start_step
            if m.state in STEPPING_STATES and steps > 0:
                out.append((e.inner_step, time.time(), (time.monotonic() - e.t_start) / steps))
        return out

    @property
    def peer_tokens(self) -> list[tuple[int, float, float]]:
        """(tokens, now, 0 tokens/s: the count is current) of the other live members."""
        return [(m.engine.tokens, time.time(), 0.0) for m in self.hub.seen_by(self.member)]

    def start(self) -> None:
        self.swarm_reads += 1

    def stop(self) -> None:
        """Nothing runs in the background."""

    def look_before_training(self, stop: threading.Event) -> None:
        self.swarm_reads += 1

    def wait_for_peers(self, stop: threading.Event) -> None:
        """Until ``wait_peers`` members (us included) train or wait to, or ``stop``."""
        wanted = self.engine.opts.wait_peers
        deadline = time.monotonic() + self.engine.opts.wait_peers_timeout_s
        while 1 + len(self.hub.others(self.member)) < wanted and not stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.engine.opts.wait_peers_timeout_s:g} s for {wanted} learners")
            stop.wait(WAIT_POLL_S)
        self.swarm_reads += 1
