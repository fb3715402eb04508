"""The host side of a fragment's averager: rounds in the background, state downloads."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from hivemind.utils import get_dht_time

from p2p_diloco.averaging.decisions import (
    ANCHOR_TENSOR,
    CANCEL_POLL_S,
    MAX_DONORS_TRIED,
    MISSING,
    MOMENTUM_TENSOR,
    NO_GROUP,
    VOUCH_TTL_S,
    VOUCH_WAIT_S,
    Decision,
    decision_at_deadline,
    RoundMeta,
    VerdictRule,
    averager_prefix,
    commit_key,
    grid_version,
    parse_gathered,
    relative_distance,
    round_verdict,
    version_group_bits,
    vouch_key,
)
from p2p_diloco.averaging.linktime import (
    DownloadTimeouts,
    LinkEstimate,
    RoundTimeouts,
    download_timeouts,
    estimate_link,
    floor_timeouts,
    verdict_wait_s,
)
from p2p_diloco.averaging.fixed_groups import FixedGroup
from p2p_diloco.averaging.plans import RoundOutcome, RoundPlan
from p2p_diloco.averaging.process import FragmentAveragerProcess
from p2p_diloco.averaging.runner import ExactAllReduceRunner
from p2p_diloco.averaging.transfer import FetchedState
from p2p_diloco.core import outer
from p2p_diloco.core.config import Config
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.replay import KeptRound
from p2p_diloco.hivemind_ext import procguard
from p2p_diloco.hivemind_ext.compression import get_codec
from p2p_diloco.hivemind_ext.logfilters import quiet_expected_failures
from p2p_diloco.sync.fragment import Contribution

logger = logging.getLogger(__name__)

VERDICT_POLL_S = (0.05, 0.1, 0.2, 0.4)
"""Seconds between two reads of a round's verdicts, the last one repeated: each read is a DHT search that the
nodes nearest the key answer with every verdict posted so far, so a member waiting on a slow one stops
re-reading 20 times a second (the control-plane bench counted the verdicts at 28% of the control plane)."""
SET_TIMEOUTS_DEADLINE_S = 10.0
"""How long a round waits for its averager process to take its timeouts (a control-pipe message: milliseconds
when healthy; generous for a loaded machine)."""
LEAVING = "cancelled: this peer is leaving"
"""The reason of a round ended by :meth:`FragmentAveragerHost.cancel`."""


class Leaving(Exception):
    """A wait of the averaging worker ended because the learner is leaving (:meth:`FragmentAveragerHost.cancel`)."""


@dataclass(frozen=True)
class Download:
    """How a state download ended: the state (None: no donor was ahead of us, or every donor failed)
    and each donor tried, with ``"ok"`` or why not, and seconds."""

    fetched: FetchedState | None
    attempts: tuple[tuple[str, str, float], ...]
    duration_s: float
    bytes_received: int = 0
    """Wire bytes received from every donor tried (an aborted one's included)."""
    timeouts: DownloadTimeouts | None = None
    replayed: tuple[KeptRound, ...] = ()
    """Instead of a state, the rounds the best donor kept from our rank (:mod:`p2p_diloco.core.replay`): the caller
    replays them (checked there, step by step, against the anchor hashes they name)."""

    @property
    def failures(self) -> list[str]:
        return [f"{d[-8:]}: {why}" for d, why, _ in self.attempts if why != "ok"]


def step_failure(e: BaseException) -> str:
    """The reason of a round whose averager step raised ``e``: its type and last line (a group from the clock that
    a member missing failed: that line alone, as every transport words it)."""
    text = str(e).strip().splitlines()
    if text and text[-1].startswith(MISSING):
        return text[-1][:300]
    return f"{type(e).__name__}: {text[-1] if text else 'the averager cancelled the step'}"[:300]


def took_settings(host: FragmentAveragerHost, settings: Sequence[tuple[str, Any]]) -> str:
    """Why the averager did not take a round's ``settings`` (what, its future), empty if it took them all; raises
    :class:`Leaving` when we leave meanwhile."""
    for what, future in settings:
        try:
            host._wait(future, SET_TIMEOUTS_DEADLINE_S)
        except Leaving:
            raise
        except Exception as e:
            return f"the averager did not take {what}: {type(e).__name__}: {e}"[:300]
    return ""


def fixed_group_of(plan: RoundPlan, limits: RoundTimeouts, rule: VerdictRule, min_group_size: int) -> FixedGroup | None:
    """Groups from the clock: ``plan``'s group, which our averager meets at its next step, carrying our verdict
    ``rule``; None when nobody else is at our rank (the round cannot run: :data:`NO_GROUP`)."""
    if len(plan.members) < max(2, min_group_size):
        return None
    return FixedGroup(plan.group_id.encode(), plan.members, plan.scheduled_time, limits.request_timeout_s,
                      boundary_ms=plan.boundary_ms, rule=rule)


def told(host: FragmentAveragerHost, future: Any, what: str) -> None:
    """Log, once ``future`` (a message to ``host``'s averager that nobody waits for) ends, if the averager did not
    take ``what``: the others then wait out our offer, as before."""

    def taken(done: Any) -> None:
        if done.exception() is not None:
            logger.warning("fragment %d: the averager did not take %s: %s", host.fragment, what, done.exception())

    future.add_done_callback(taken)


def decline_round(host: FragmentAveragerHost, boundary_ms: int) -> None:
    """Groups from the clock: tell ``host``'s averager we skip its fragment's boundary ``boundary_ms``, so
    that the members of any group that counts on us there hear so at once
    (:meth:`~p2p_diloco.averaging.fixed_groups.FixedGroupMeeting.decline`). Never waits (:func:`told`)."""
    told(host, host.averager.decline(boundary_ms), f"our decline of the round at {boundary_ms} ms")


def leave_rounds(host: FragmentAveragerHost) -> None:
    """Groups from the clock: tell ``host``'s averager we are done with rounds for good, so that every group that
    still counts on us goes on without us (:meth:`~p2p_diloco.averaging.fixed_groups.FixedGroupMeeting.leave`). Never
    waits (:func:`told`)."""
    told(host, host.averager.leave(), "our leaving")


class FragmentAveragerHost:
    """Owns one fragment's averager and runs its rounds and state downloads in a background thread.

    :meth:`start_round` and :meth:`fetch_state` return futures at once; the learner polls them.
    At most one operation per fragment is in flight (the learner enforces it)."""
    averager_class: type[FragmentAveragerProcess] = FragmentAveragerProcess  # averaging/faulty.py's: a subclass

    def __init__(self, cfg: Config, fragment: int, names: Sequence[str], shapes: Mapping[str, torch.Size],
                 dht: Any, private_key: Any, *, membership: Any = None,
                 state_provider: Callable[[], tuple[dict[str, Any], list[torch.Tensor]]] | None = None,
                 runner_class: type[ExactAllReduceRunner] = ExactAllReduceRunner, start: bool = True) -> None:
        """``start=False``: the averager process is started by :meth:`start_background` (several at once)."""
        from p2p_diloco.net.membership import owner_peer_id, owner_subkey

        quiet_expected_failures()  # before our averager process is forked
        a = cfg.averaging
        self.cfg, self.fragment, self.names, self.dht = cfg, fragment, tuple(names), dht
        self.state_bytes = 2 * 4 * sum(math.prod(shapes[n]) for n in self.names)  # anchor and momentum in fp32
        self.prefix = averager_prefix(cfg.run.run_id, fragment)
        self.report_subkey = owner_subkey(private_key)  # verdicts are signed: nobody can vote for us
        if owner_peer_id(self.report_subkey) != dht.peer_id.to_base58():
            raise ValueError(f"the DHT's peer id {dht.peer_id} is not the one of the signing key: start the DHT with "
                             f"the same identity (SwarmOptions.identity) so that verdicts can be matched to members")
        self.config_hash = config_hash(cfg)
        self.radial_names = tuple(n for n in names if cfg.outer.merge == "radial" and not outer.uses_plain_merge(n))
        self.robust = outer.robust_rule(cfg.outer.robust, cfg.outer.clip_factor)
        self.grid = a.groups == "grid"
        self.wire_names = self.names + (tuple(p + n for p in (ANCHOR_TENSOR, MOMENTUM_TENSOR) for n in self.names)
                                        if self.grid else ())
        """What a round all-reduces (``buffers`` holds one per name, in order): the pseudo-gradient, with grid
        groups the anchor and momentum too."""
        self.buffers = [torch.zeros(shapes[n], dtype=torch.float32) for n in self.names * (3 if self.grid else 1)]
        floor = floor_timeouts(a)  # until a round sets its own (RoundPlan.timeouts)
        self.averager = self.averager_class(
            self.buffers, dht, start=start, prefix=self.prefix,
            target_group_size=a.target_group_size or None, min_group_size=a.min_group_size,
            initial_group_bits=version_group_bits(0), min_matchmaking_time=a.window_s,
            request_timeout=floor.request_timeout_s, allreduce_timeout=floor.allreduce_timeout_s,
            next_chunk_timeout=floor.sender_timeout_s, sender_timeout=floor.sender_timeout_s,
            reducer_timeout=floor.reducer_timeout_s, compression=get_codec(cfg.outer.codec),
            shutdown_timeout=a.shutdown_timeout_s, allow_state_sharing=state_provider is not None,
            membership=membership, state_provider=state_provider,
            runner_class=runner_class, report_subkey=self.report_subkey, fragment=fragment,
            robust=self.robust, layout=(self.names, {n: shapes[n] for n in self.names}),
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
        """Leaving: end the round or download in flight within ``CANCEL_POLL_S`` (a round is discarded, a download
        raises :class:`Leaving`) and start no new one. Does not wait for it."""
        self._cancelled.set()

    def _wait(self, future: Any, timeout_s: float | None) -> Any:
        """``future.result(timeout_s)`` (None: no bound), looking every ``CANCEL_POLL_S`` whether we are leaving
        (:class:`Leaving` then). The futures of the averager and DHT processes are never resolved once those
        processes are stopped: a worker blocked on one outlived :meth:`shutdown` and held the interpreter's exit,
        which joins every worker thread (Ctrl+C with a round in flight took 31-37 s to exit)."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while not self._cancelled.is_set():
            try:
                return future.result(timeout=max(0.0, min(CANCEL_POLL_S, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
        raise Leaving(LEAVING)

    # -- rounds
    def start_round(self, contribution: Contribution, plan: RoundPlan) -> "Future[RoundOutcome]":
        # checked on the caller's thread (its raise)
        meta = RoundMeta.of(contribution, self.config_hash, plan.due, plan.link_Bps)
        return self._executor.submit(self._round, contribution, meta, plan)

    def _round(self, c: Contribution, meta: RoundMeta, plan: RoundPlan) -> RoundOutcome:
        """One round (:meth:`_run_round`); whatever it raises discards it with the exception as its reason, logged with
        its traceback. A worker's exception reaches the training loop through the future and ends the learner: a
        verdicts' exchange past its deadline after a SIGSTOP once did (07a3b96 caught that one). Our "ok", if posted, may
        let the others commit without us; we then catch up like any member that discarded."""
        t0 = time.monotonic()
        try:
            return self._run_round(c, meta, plan)
        except Exception as e:
            logger.exception("fragment %d v%d: the round failed: %s: %s", self.fragment, c.version, type(e).__name__, e)
            now = time.monotonic()
            return RoundOutcome(fragment=self.fragment, version=c.version, window_s=plan.window_s, timeouts=plan.timeouts,
                                committed=False, reason=f"the round failed: {type(e).__name__}: {e}"[:300],
                                duration_s=now - t0, finished_at=now)

    def _run_round(self, c: Contribution, meta: RoundMeta, plan: RoundPlan) -> RoundOutcome:
        a = self.cfg.averaging
        t0 = time.monotonic()
        limits = plan.timeouts if plan.timeouts is not None else floor_timeouts(a)
        base: dict[str, Any] = dict(fragment=self.fragment, version=c.version, window_s=plan.window_s, timeouts=limits)
        sent0, received0 = self.averager.bytes_sent.value, self.averager.bytes_received.value
        self.averager.last_allreduce_s.value = math.nan  # the averager process times this round's all-reduce
        self.averager.last_part_bytes.value = 0  # and says how it cut it
        self.averager.last_meet_s.value = self.averager.last_allreduce_end.value = math.nan

        def failed(reason: str, **extra: Any) -> RoundOutcome:
            now = time.monotonic()
            return RoundOutcome(**base, committed=False, reason=reason, duration_s=now - t0, finished_at=now,
                                bytes_sent=self.averager.bytes_sent.value - sent0,
                                bytes_received=self.averager.bytes_received.value - received0,
                                allreduce_s=self.averager.last_allreduce_s.value,
                                part_bytes=self.averager.last_part_bytes.value, **extra)

        if c.weight <= 0:
            return failed("no progress since the last sync (weight 0): not joining")
        if self._cancelled.is_set():
            return failed(LEAVING)
        logger.debug("fragment %d v%d: round timeouts %s", self.fragment, c.version, limits.event())
        group = (fixed_group_of(plan, limits, self.verdict_rule(plan, limits), a.min_group_size) if plan.members
                 else None)
        if plan.members and group is None:
            return failed(NO_GROUP)
        # the round's settings go down the averager's control pipe before its step, so they apply before it; their
        # answers are read once the step is in (each was a round trip to a process on a loaded machine before)
        settings = [("the round's timeouts", self.averager.set_round_timeouts(limits)),
                    ("the round's group bits", self.averager.set_group_bits(
                        plan.group_bits or version_group_bits(c.version, c.anchor_hash), wait=False))]
        if group is not None:  # a group from the clock: its members meet directly, no matchmaking
            settings.append(("the round's group", self.averager.set_next_group(group)))
        with self.averager.get_tensors() as buffers:
            for buf, name in zip(buffers, self.wire_names):
                buf.copy_(c.tensors[name])
        # a lone peer gives up after two windows past the scheduled start (plus a slow link's join round trips)
        matchmaking_timeout_s = (max(0.0, plan.scheduled_time - get_dht_time()) + 2 * plan.window_s
                                 + limits.matchmaking_slack_s)
        base["setup_s"] = time.monotonic() - t0
        control = self.averager.step(gather=meta.to_wire(), weight=meta.weight, scheduled_time=plan.scheduled_time,
                                     timeout=matchmaking_timeout_s, allow_retries=False, wait=False)
        try:
            problem = took_settings(self, settings)
        except Leaving:
            control.cancel()
            return failed(LEAVING)
        if problem:  # the averager process is gone or stuck: this round cannot run
            control.cancel()
            return failed(problem)
        give_up_at = time.monotonic() + matchmaking_timeout_s + limits.allreduce_timeout_s + limits.request_timeout_s
        while True:
            try:
                gathered = control.result(timeout=max(0.01, min(CANCEL_POLL_S, give_up_at - time.monotonic())))
                break
            except TimeoutError:
                if self._cancelled.is_set():  # we are leaving: do not make the others wait for us
                    control.cancel()
                    return failed(LEAVING)
                if plan.doomed is not None and not control.began_allreduce and plan.doomed():
                    control.cancel()  # still matching: nobody is waiting on our tensors yet
                    return failed(f"abandoned while matching: a live peer is past v{c.version}")
                if time.monotonic() >= give_up_at:
                    control.cancel()
                    return failed(f"round exceeded {matchmaking_timeout_s + limits.allreduce_timeout_s:.1f} s")
            except (Exception, asyncio.CancelledError) as e:  # hivemind raises on every failure; the round is
                # discarded with its reason. It may also cancel a step itself (its matchmaking, cancelled while a
                # join request was in flight): a CancelledError -- a BaseException -- that crashed the learner
                # (measured at 16 learners on 2 cores); this runs in a worker thread, never an asyncio task
                return failed(step_failure(e))
        if not gathered:
            return failed("all-reduce returned no group")
        peers = tuple(str(p) for p in gathered)
        try:
            metas = parse_gathered(gathered)
        except ValueError as e:
            return failed(f"bad metadata from a member: {e}", group_size=len(peers), peers=peers)
        weights = tuple(m.weight for m in metas)
        last = max(m.due for m in metas)
        extra: dict[str, Any] = dict(group_size=len(peers), peers=peers, weights=weights,
                                     arrival_spread_s=last - min(m.due for m in metas),
                                     waited_s=max(0.0, last - meta.due),
                                     absent=len(set(plan.members) - set(peers)))
        extra["meet_s"] = self.averager.last_meet_s.value
        rule = self.verdict_rule(plan, limits)
        decision = round_verdict(rule, meta, metas, finite=True)  # the gathered data's checks first
        averaged: dict[str, torch.Tensor] = {}
        if decision.ok:
            with self.averager.get_tensors() as buffers:
                averaged = {n: b.clone() for n, b in zip(self.wire_names, buffers)}
            decision = round_verdict(rule, meta, metas, all(bool(torch.isfinite(t).all()) for t in averaged.values()))
        # phase two: nobody commits unless every member's all-reduce was complete and its checks passed
        own = "ok" if decision.ok else decision.reason
        agreeing = time.monotonic()
        extra["handback_s"] = agreeing - self.averager.last_allreduce_end.value
        extra["allreduce_end"] = get_dht_time() - extra["handback_s"]
        try:  # a group from the clock: the verdicts go to its members directly; else through the DHT
            verdict, rtt_s, withdrawn = (agree_in_group(self, plan.group_id.encode(), peers, own, limits) if plan.members else
                                         agree_in_dht(self, commit_key(self.prefix, dict(zip(peers, metas))), peers, own))
        except Leaving:  # our verdict, if posted, stays: members that read every "ok" commit without us
            return failed(LEAVING, **extra)
        extra.update(rtt_s=rtt_s, verdicts_s=time.monotonic() - agreeing)
        if not decision.ok:
            return failed(decision.reason, **extra)
        keep = withdrawn and not self.grid  # grid rounds mix anchors: nothing to adopt later
        if not verdict.ok and not keep:
            return failed(verdict.reason, **extra)
        norms = [m.norms_by_name(self.radial_names) for m in metas]
        merged = outer.decode_merged({n: averaged[n] for n in self.names}, norms, list(weights), self.cfg.outer.merge,
                                     self.robust)
        if not verdict.ok:
            return failed(verdict.reason, **extra, pending=merged)
        if self.grid:
            anchor = {n: averaged[ANCHOR_TENSOR + n] for n in self.names}
            extra.update(mixed_anchor=anchor, mixed_momentum={n: averaged[MOMENTUM_TENSOR + n] for n in self.names},
                         version_after=grid_version(metas),
                         group_distance=relative_distance({n: c.tensors[ANCHOR_TENSOR + n] for n in self.names}, anchor))
        now = time.monotonic()
        return RoundOutcome(**base, committed=True, reason="ok", own_share=meta.weight / sum(weights),
                            duration_s=now - t0, finished_at=now, bytes_sent=self.averager.bytes_sent.value - sent0,
                            bytes_received=self.averager.bytes_received.value - received0,
                            allreduce_s=self.averager.last_allreduce_s.value,
                            part_bytes=self.averager.last_part_bytes.value, merged=merged, **extra)

    def verdict_rule(self, plan: RoundPlan, limits: RoundTimeouts) -> VerdictRule:
        """What our verdict on ``plan``'s round checks (:func:`round_verdict`), here and -- groups from the clock -- in
        the averager process, which sends it as the all-reduce ends."""
        a = self.cfg.averaging
        return VerdictRule(self.radial_names, a.min_group_size, self.cfg.outer.weighting, plan.at_rank,
                           a.target_group_size, self.grid, verdict_wait_s(a, limits))

    def _read_verdicts(self, key: str) -> tuple[Any, float]:
        """One read of a round's verdicts: (what the DHT holds under ``key``, the seconds the read took)."""
        asked = time.monotonic()
        return self._wait(self.dht.get(key, latest=True, return_future=True), None), time.monotonic() - asked

    # -- state download
    def keep_round(self, kept: KeptRound) -> None:
        """Keep a round we committed to serve peers that replay it (:meth:`StateDownloads.keep_round`), the newest
        ``averaging.kept_rounds`` (none if 0)."""
        if self.cfg.averaging.kept_rounds > 0:
            self.averager.keep_round(kept, self.cfg.averaging.kept_rounds)

    def fetch_state(self, ours: tuple[int, str], donors: Mapping[str, tuple[int, str]],
                    link: LinkEstimate | None = None, replay: bool = True) -> "Future[Download]":
        """Download a state ahead of ``ours`` = (version, anchor hash) in :func:`anchor_order` from ``donors`` (peer
        id -> the rank our view holds for it), with deadlines derived from its bytes and ``link``
        (:func:`~p2p_diloco.averaging.linktime.download_timeouts`; None: the prior, nothing measured yet)."""
        return self._executor.submit(self._fetch, ours, dict(donors), link if link is not None else estimate_link([], []),
                                     replay)

    def _fetch(self, ours: tuple[int, str], donors: Mapping[str, tuple[int, str]], link: LinkEstimate,
               replay: bool = True) -> "Download":
        """Try the donors of :func:`donor_order` in turn; a donor silent for the derived ``silence_s`` is dropped,
        one that progresses is never; every payload is size-capped and checked (:func:`parse_state`: shapes,
        finite values, the anchor hash) before it is returned. Raises :class:`Leaving` when we leave meanwhile."""
        a = self.cfg.averaging
        t0 = time.monotonic()
        timeouts = download_timeouts(self.state_bytes, link, a)
        deadline_s = timeouts.total_s(MAX_DONORS_TRIED, VOUCH_WAIT_S) + a.request_timeout_s
        fetched, attempts, received, replayed = self._wait(self.averager.download_state(ours, donors, timeouts, replay),
                                                           deadline_s)
        return Download(fetched, tuple(attempts), time.monotonic() - t0, received, timeouts, tuple(replayed))

    def vouch(self, version: int, anchor: str) -> None:
        """Sign, in the DHT, that we hold ``anchor`` at ``version`` (after a commit or a verified rebase): a peer
        that downloads this state from another donor needs such an entry from someone other than that donor
        (:func:`vouchers`). Returns at once; a failed store is logged (the next commit vouches again)."""
        def logged(done: Any) -> None:
            if done.exception() is not None or not done.result():
                logger.warning("fragment %d: vouching for v%d (%s) in the DHT failed: %s", self.fragment, version,
                               anchor, done.exception() or "no DHT node accepted it")

        from p2p_diloco.net.membership import store

        stored = store(self.dht, vouch_key(self.prefix, version), anchor, get_dht_time() + VOUCH_TTL_S,
                       subkey=self.report_subkey, return_future=True)
        stored.add_done_callback(logged)

    def refusals(self) -> int:
        """Requests from non-members that our handlers refused so far."""
        return int(self.averager.refused.value)

    def bytes_total(self) -> tuple[int, int]:
        return int(self.averager.bytes_sent.value), int(self.averager.bytes_received.value)

    def shutdown(self) -> None:
        """Cancel what is in flight (:meth:`cancel`: not waited for) and stop the averager process."""
        self.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        procguard.stop_process(self.averager, f"averager of fragment {self.fragment}")


def agree_in_dht(host: FragmentAveragerHost, key: str, peers: Sequence[str],
                 own_verdict: str) -> tuple[Decision, float, bool]:
    """(``host``'s round worker) Post our verdict under ``key`` (signed subkey), then read the others' until all
    are in or ``commit_timeout_s`` passes; returns :func:`commit_decision` of what was read, the fastest read's
    seconds (a round trip to the group's peers, the DHT nodes nearest the key: our RTT sample) and whether
    we withdrew our "ok".

    A member still silent at our deadline may only be late (a process stopped by SIGSTOP, a machine that
    swapped): if it then reads every "ok", ours included, it commits alone. So at the deadline we replace our
    "ok" with a veto (a newer value under our subkey wins), and a member that reads late discards as we do. One
    that read our "ok" just before may still have committed: the caller keeps the round's result for that
    case (``RoundOutcome.pending``). Raises :class:`Leaving` when we leave meanwhile."""
    from p2p_diloco.net.membership import owned_values, store

    timeout_s = host.cfg.averaging.commit_timeout_s
    deadline = time.monotonic() + timeout_s
    keep_s = 10 * timeout_s + 60  # verdicts outlive every member's read of them
    posted_until = get_dht_time() + keep_s
    host._wait(store(host.dht, key, own_verdict[:300], posted_until, subkey=host.report_subkey, return_future=True),
               None)
    reports: dict[str, str] = {}
    rtt_s, reads = math.inf, 0
    while True:
        found, read_s = host._read_verdicts(key)
        rtt_s = min(rtt_s, read_s)
        reports.update({p: v for p, v in owned_values(found).items() if isinstance(v, str)})
        decision, silent = decision_at_deadline(reports, peers, timeout_s)
        if not silent or time.monotonic() >= deadline:
            withdrawn = silent and own_verdict == "ok"  # silence only: withdraw our "ok" (see above)
            if withdrawn:  # a later expiration than our "ok" replaces it under the same subkey
                host._wait(store(host.dht, key, f"withdrawn: {decision.reason}"[:300],
                                 max(posted_until + 1, get_dht_time() + keep_s),
                                 subkey=host.report_subkey, return_future=True), None)
            return decision, rtt_s, withdrawn
        if host._cancelled.wait(min(VERDICT_POLL_S[min(reads, len(VERDICT_POLL_S) - 1)],
                                    max(0.0, deadline - time.monotonic()))):
            raise Leaving(LEAVING)
        reads += 1


def agree_in_group(host: FragmentAveragerHost, group_id: bytes, peers: Sequence[str],
                   own_verdict: str, limits: RoundTimeouts) -> tuple[Decision, float, bool]:
    """(``host``'s round worker) :func:`agree_in_dht` for a group from the clock: our verdict goes to each other
    member in one message over the group's connections, theirs come to us (the averager process keeps them), until
    all are in, one is not "ok", or :func:`verdict_wait_s` passes (``commit_timeout_s`` and, on a measured link, a
    control message's wait there); then, as there, silence only withdraws our "ok" (a second message replaces it
    where it arrives). No DHT store or read. Raises :class:`Leaving`. An exchange the averager process does not
    answer in time (this learner was stopped, SIGSTOP, past its deadline) is a silence: the round is discarded (it
    raised into the training loop and ended the learner, under ``scripts/chaos.py``)."""
    timeout_s = verdict_wait_s(host.cfg.averaging, limits)
    try:
        reports, rtt_s = host._wait(host.averager.exchange_verdicts(group_id, tuple(peers), own_verdict, timeout_s),
                                    timeout_s + SET_TIMEOUTS_DEADLINE_S)
    except TimeoutError:
        logger.warning("fragment %d: the verdicts' exchange did not end within %.0f s (were we stopped?): as if "
                       "none came", host.fragment, timeout_s + SET_TIMEOUTS_DEADLINE_S)
        reports, rtt_s = {}, math.nan
    decision, silent = decision_at_deadline(reports, peers, timeout_s)
    withdrawn = silent and own_verdict == "ok"
    if withdrawn:
        request_s = host.cfg.averaging.request_timeout_s
        try:
            host._wait(host.averager.send_verdict(group_id, tuple(peers), f"withdrawn: {decision.reason}"[:300],
                                                  request_s), request_s + SET_TIMEOUTS_DEADLINE_S)
        except TimeoutError:  # a member that read our "ok" may commit: the late-commit and fork rules cover it
            logger.warning("fragment %d: our withdrawal was not sent within %.0f s", host.fragment,
                           request_s + SET_TIMEOUTS_DEADLINE_S)
    return decision, rtt_s, withdrawn
