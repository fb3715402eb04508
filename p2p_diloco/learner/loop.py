"""The learner: local training that never waits, fragment rounds in the background.

:meth:`Learner.train_once` is the loop (see :mod:`p2p_diloco.learner.options` for the algorithm): an
inner step, the rounds that came back applied, fragments a peer is ahead on downloaded, the due
fragments handed off. The mechanics hide behind those verbs: each fragment's state machine is a
:class:`~p2p_diloco.sync.fragment.FragmentSync` driven by :class:`~p2p_diloco.learner.rounds.Rounds`
over the fragment averagers; the status thread (:class:`~p2p_diloco.learner.view.SwarmView`) publishes
our record, reads the others' and tends the sync clock; :mod:`p2p_diloco.learner.checkpointer` saves
and restores.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from p2p_diloco.averaging.decisions import anchor_hash
from p2p_diloco.core import data, events, faults, fragments
from p2p_diloco.core.config import Config
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.devices import load_into, to_host
from p2p_diloco.core.inner import build_optimizer, schedule_step, train_step
from p2p_diloco.core.model import build_model
from p2p_diloco.learner import checkpointer, priority
from p2p_diloco.learner.checkpointer import Checkpointer
from p2p_diloco.learner.metrics import open_event_log
from p2p_diloco.learner.options import (
    LearnerOptions,
    Profile,
    check_supported,
    load_splits,
)
from p2p_diloco.learner.rounds import Rounds, start_averagers
from p2p_diloco.learner.view import SwarmView
from p2p_diloco.sync.slot import FragmentSlot

if TYPE_CHECKING:
    from p2p_diloco.net.clock import SyncClock
    from p2p_diloco.net.joined import Joined
    from p2p_diloco.net.records import LocalRun

logger = logging.getLogger(__name__)

EVAL_JOIN_TIMEOUT_S = 60.0
"""Seconds :meth:`Learner.close` waits for an evaluation in progress (it ends within seconds)."""
LINGER_POLL_S = 0.25
"""Seconds between two looks at the peers while lingering until they agree."""
LAST_SERVE_S = 1.0
"""Seconds we stay up at the very end, at most, so that peers still downloading from us finish."""


class Learner:
    """One learner unit on a joined swarm (see the module docstring for the loop)."""

    def __init__(self, cfg: Config, profile: Profile, opts: LearnerOptions, joined: Joined, local: LocalRun,
                 membership: Any = None, splits: data.TrainingData | None = None) -> None:
        check_supported(cfg)
        torch.set_num_threads(profile.threads or 1)
        t_init = time.monotonic()
        self.cfg, self.profile, self.opts, self.joined, self.local = cfg, profile, opts, joined, local
        if splits is None:  # the CLI loads them before joining: bad data never reaches the swarm
            splits = load_splits(cfg, opts.num_shards)
        self._data = splits
        self._stream_seed = self._data_seed(0)
        self.batches = splits.train_batches(opts.shard, cfg.inner.batch_size, cfg.model.block_size, self._stream_seed)
        self.eval_set = data.eval_batches(splits.eval, cfg.data.eval_batches, cfg.data.eval_batch_size,
                                          cfg.model.block_size)
        # built on the CPU under the run's seed (the same first anchor on every peer), then moved
        self.device = torch.device(opts.device)
        self.model = build_model(cfg.model, cfg.run.seed).to(self.device)
        self.params = dict(self.model.named_parameters())
        self.opt = build_optimizer(self.model, cfg.inner, self.device)
        o = cfg.outer
        self.schedule = fragments.SyncSchedule(o.fragments, o.sync_every, o.sync_every_start, o.sync_ramp_steps)
        self.slots: list[FragmentSlot] = []
        for frag in fragments.make_fragments({n: p.numel() for n, p in self.params.items()}, o.fragments,
                                             fragments.block_map(self.model)):
            anchor = to_host(self.params, frag.names)
            self.slots.append(FragmentSlot(frag.index, frag.names, anchor, anchor_hash=anchor_hash(anchor)))
        t_averagers = time.monotonic()
        hosts = start_averagers(cfg, self.slots, {n: p.shape for n, p in self.params.items()}, joined.dht,
                                joined.private_key, membership)
        self.step = self.tokens = 0
        self.start_step = self.start_tokens = 0
        self.loss: torch.Tensor | None = None
        """The latest training loss, on the device: read on the host only when logged or published."""
        self.blocked_s = self.stepping_s = 0.0
        self.max_stall_s = 0.0
        """The longest single time the inner loop waited between two steps (applying rounds, starting them)."""
        self.t_start = time.monotonic()
        self.schedule_offset = 0
        """Step schedule: added to our step count to number our steps like the swarm we joined
        (:meth:`_align_schedule`); 0 for learners that start together."""
        self._events = open_event_log(opts.events_path, opts.metrics)  # None: neither --events nor --metrics
        self._events_lock = threading.Lock()  # the status and checkpoint threads log events too
        self.view = SwarmView(self)
        self.rounds = Rounds(cfg, self.slots, self, hosts, self.view, local.config_hash, opts.started_at,
                             self._event, self._dht_time, joined.peer_id)
        self._stop_eval = threading.Event()
        self._eval_thread = threading.Thread(target=self._eval_loop, name="learner-eval", daemon=True)
        self._last_clock = self._dht_time()
        self.training = False
        self._priority = priority.SessionPriority(opts.train_nice)  # lowered once we have joined
        self.resumed_from_step: int | None = None
        self._checkpointer = Checkpointer(self) if opts.checkpoint_dir is not None else None
        now = time.monotonic()
        logger.info("learner ready %.1f s after start: data and model %.1f s, %d averagers %.1f s",
                    now - opts.started_at, t_averagers - t_init, len(hosts), now - t_averagers)

    # -------------------------------------------------------------- the loop

    def run(self, stop: threading.Event, finish: threading.Event | None = None) -> dict[str, Any]:
        if self.opts.wait_peers <= 1:
            self.view.look_before_training(stop)
        self.view.start()
        self.view.wait_for_peers(stop)
        if self.opts.train_nice > 0:  # this thread (Linux); our session's autogroup once we have joined
            logger.info("%s", priority.lower_thread_priority(self.opts.train_nice))
        if self.opts.eval_every_s > 0:
            self._eval_thread.start()
        start_anchors = self.anchor_snapshot()  # evaluated at the end: no eval delays the first round
        self._set_state("training")
        self.t_start = time.monotonic()
        logger.info("training from step %d, %.1f s after start", self.step, self.t_start - self.opts.started_at)
        self.start_step, self.start_tokens = self.step, self.tokens  # not 0 after --resume
        self.training = True
        self._last_clock = self._dht_time()  # boundaries passed while waiting for peers are not due
        if self.cfg.averaging.schedule == "steps":
            self._align_schedule()
        finish = finish or threading.Event()  # set: training ends as at --max-time (SIGUSR1)
        while self.step < self.opts.max_steps and not stop.is_set() and not self._out_of_time() and not finish.is_set():
            self.train_once(stop)
        train_s = time.monotonic() - self.t_start
        if self.step == self.start_step and self._out_of_time():
            logger.warning("never trained: --max-time %g s ran out %.1f s after start, before the first step",
                           self.opts.max_time_s, self.t_start - self.opts.started_at)
        self.training = False  # the clock is tended by learners that train
        self.finish(stop)
        if self._checkpointer is not None:
            self._checkpointer.save(final=True)
        return final_summary(self, self.evaluate(start_anchors), self.evaluate(self.anchor_snapshot()), train_s)

    def train_once(self, stop: threading.Event) -> None:
        """One turn of the loop: an inner step, then the fragments' bookkeeping (``scripts/bench_overhead.py``
        times exactly this against a plain PyTorch loop)."""
        faults.hit("inner-step")
        self.loss = self.inner_step()
        if self._checkpointer is not None:
            self._checkpointer.maybe_save()
        with self.blocked():
            self.rounds.collect(self.step, min_age_steps=self.cfg.outer.overlap)  # tau: mixed in a few steps later
            self.rounds.catch_up()  # a fragment we are behind on is downloaded and sits out its due round
            for f in self.due_fragments():
                self.rounds.hand_off(self.rounds.syncs[f], self.step)
            if self.opts.blocking:
                self.rounds.wait_rounds(stop, self.step)
        if lowered := self._priority.settle(self.rounds.first_contribution_s is not None,
                                            time.monotonic() - self.t_start):
            logger.info("%s", lowered)

    def inner_step(self) -> torch.Tensor:
        """One AdamW step on our data stream, padded to the profile's pace."""
        t0 = time.monotonic()
        x, y = next(self.batches)
        i = self.cfg.inner
        # the cosine ends when --max-time does: the training share of it, which began at t_start
        budget_s = max(1e-3, self.opts.max_time_s - (self.t_start - self.opts.started_at)) if self.opts.lr_by_time else 0.0
        at = schedule_step(self.step, i.total_steps, i.warmup_steps, t0 - self.t_start, budget_s)
        loss = train_step(self.model, self.opt, (x, y), at, i.total_steps, i, self.device)
        self.step += 1
        self.tokens += x.numel()
        for s in self.slots:
            s.since_tokens += x.numel()
            s.since_steps += 1
        natural = time.monotonic() - t0
        pace = max(natural, self.profile.min_step_s) * self.profile.slowdown
        if pace > natural:
            time.sleep(pace - natural)  # a slower machine, emulated
        self.stepping_s += time.monotonic() - t0
        return loss

    def due_fragments(self) -> list[int]:
        """Fragments due now: at the swarm clock's boundaries (none until a derived clock is known), or by
        our step count (``averaging.schedule = "steps"``)."""
        if self.cfg.averaging.schedule == "steps":
            return self.schedule.due(self.step + self.schedule_offset)
        now = self._dht_time()
        clock, self._last_clock, previous = self.clock, now, self._last_clock
        return clock.due(previous, now, len(self.slots)) if clock is not None else []

    def _align_schedule(self) -> None:
        """Step schedule, as training starts: number our steps like the swarm that is training already
        (:func:`~p2p_diloco.core.fragments.swarm_step`, from the last view: the one read before training, or the
        status thread's while waiting for peers), so that our fragments fall due with theirs. A newcomer that
        counted from its own first step met nobody when its due steps fell a few seconds after the others'."""
        at = fragments.swarm_step(self.view.peer_steps, self._dht_time())
        if at is None:
            return
        self.schedule_offset = at - self.step
        logger.info("step schedule: the swarm is at step %d; our fragments fall due with its steps (offset %+d)",
                    at, self.schedule_offset)

    # -------------------------------------------------------------- the end

    def finish(self, stop: threading.Event) -> None:
        """Final rounds for every fragment with unsynced progress, then linger until peers agree."""
        self._set_state("syncing")
        if stop.is_set():  # leaving on a signal: rounds in flight end now, nobody waits for us
            self.rounds.cancel()
        self.rounds.drain(self.step)
        if not stop.is_set():
            for sync in self.rounds.syncs:
                if sync.slot.since_steps > 0:
                    self.rounds.hand_off(sync, self.step)
            self.rounds.drain(self.step)
        self._set_state("leaving")
        logger.info("lingering up to %.0f s until the live peers agree on the fragment versions %s",
                    self.opts.linger_s, [s.version for s in self.slots])
        deadline = time.monotonic() + self.opts.linger_s
        while time.monotonic() < deadline and not stop.is_set():
            self.rounds.catch_up()
            self.rounds.drain(self.step)
            if self.rounds.peers_settled():
                break
            time.sleep(LINGER_POLL_S)
        if self.opts.serve_s > 0 and not stop.is_set():
            logger.info("serving our state to newcomers for %.0f s", self.opts.serve_s)
            stop.wait(self.opts.serve_s)
        time.sleep(min(LAST_SERVE_S, self.opts.status_period_s))  # let peers still fetching from us finish

    def close(self) -> None:
        self._stop_eval.set()
        self.view.stop()
        if self._eval_thread.is_alive():  # an evaluation in progress ends within seconds
            self._eval_thread.join(timeout=EVAL_JOIN_TIMEOUT_S)
        self.rounds.shutdown()
        if self._events is not None:
            self._events.close()

    # -------------------------------------------------------------- checkpoints

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """:func:`~p2p_diloco.learner.checkpointer.checkpoint_state` of this learner."""
        return checkpointer.checkpoint_state(self)

    def _model_digest(self) -> str:
        return checkpointer.model_digest(self.params)

    def restore(self, ckpt: Any) -> str:
        """Resume from a verified checkpoint (:func:`~p2p_diloco.learner.checkpointer.restore`); the anchors
        are advertised to downloaders only once verified, and the data stream goes on with fresh batches,
        not the ones the first run already saw. Returns the restored weights' digest."""
        digest = checkpointer.restore(self, ckpt, anchor_hash)
        self.rounds.advertise()
        self.resumed_from_step = self.step
        self._stream_seed = self._data_seed(self.step)
        self.batches = self._data.train_batches(self.opts.shard, self.cfg.inner.batch_size, self.cfg.model.block_size,
                                                self._stream_seed)
        return digest

    # -------------------------------------------------------------- reporting

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            dt = time.monotonic() - t0
            self.blocked_s += dt
            self.max_stall_s = max(self.max_stall_s, dt)

    def anchor_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the global model (the anchors of every fragment), not of our local replica."""
        out: dict[str, torch.Tensor] = {}
        for s in self.slots:
            with s.lock:
                out.update({n: s.anchor[n].detach().clone() for n in s.names})
        return out

    def evaluate(self, weights: Mapping[str, torch.Tensor], batches: list[Any] | None = None) -> float:
        """:func:`evaluate_weights` on our device, on ``batches`` (default the whole eval set)."""
        return evaluate_weights(self.cfg, self.device, weights, self.eval_set if batches is None else batches)

    def _eval_loop(self) -> None:
        """Every ``eval_every_s``: the anchors' loss on the first ``eval_batches`` held-out batches (an ``eval``
        event), for the loss-over-time plots. Runs beside the inner loop, never blocks it."""
        quick = self.eval_set[:self.opts.eval_batches]
        while not self._stop_eval.wait(self.opts.eval_every_s) and self.training:
            loss = self.evaluate(self.anchor_snapshot(), quick)
            self._event(events.EvalEvent(eval_loss=loss, train_s=round(time.monotonic() - self.t_start, 3),
                                         versions=tuple(s.version for s in self.slots), batches=len(quick)))

    def _event(self, event: events.Event) -> None:
        """Log ``event`` with our envelope (name, step, tokens, DHT time, latest loss)."""
        if self._events is None:
            return
        event = event.stamped(name=self.opts.name, step=self.step, tokens=self.tokens, time=self._dht_time(),
                              loss=self._finite_loss())
        with self._events_lock:
            self._events.write(event)  # the --events JSONL and every --metrics sink

    def _finite_loss(self) -> float | None:
        """The latest training loss, or None (not known yet, or not finite: JSON and records reject NaN)."""
        if self.loss is None:
            return None
        return events.finite_or_none(float(self.loss))  # the one host sync for the loss: when logged or published

    # -------------------------------------------------------------- small helpers

    @property
    def clock(self) -> SyncClock | None:
        """The swarm's sync clock (None on the step schedule, or before a derived clock is known)."""
        return self.view.clock

    def _data_seed(self, step: int) -> int:
        """Seed of our batches from ``step`` on: our own stream of the whole training split (distinct per
        peer, incarnation and resume), or an explicit shard's reproducible order."""
        if self.opts.shard is None:
            return data.stream_seed(self.cfg.run.seed, self.joined.peer_id, self.opts.incarnation, step)
        return data.shard_seed(self.cfg.run.seed, self.opts.shard, step)

    @property
    def data_stream(self) -> str:
        """What we train on, for the start line: ``stream 3f9a12c0 (whole training set, 7.2 MB)`` or
        ``shard 1/3 (2.4 MB)``."""
        size = self._data.train_size(self.opts.shard)
        if self.opts.shard is None:
            return f"stream {data.stream_name(self._stream_seed)} (whole training set, {size})"
        return f"shard {self.opts.shard}/{self.opts.num_shards} ({size})"

    def _set_state(self, state: str) -> None:
        self.joined.publisher.update(state=state)

    def _out_of_time(self) -> bool:
        """``--max-time`` is counted from the learner's start: waiting for peers and starting up use it too."""
        return self.opts.max_time_s > 0 and time.monotonic() - self.opts.started_at > self.opts.max_time_s

    @staticmethod
    def _dht_time() -> float:
        from hivemind.utils import get_dht_time

        return get_dht_time()


def final_consensus(rounds: Rounds) -> list[float | None]:
    """Per fragment, the consensus distance we can state at the end: 0.0 when every live peer of the last view
    holds exactly our (version, anchor hash); None when one holds another anchor (it differs, by an amount we
    did not measure) or no live peer was left to compare with. In grid mode groups are small and anchors only
    converge, so it is the relative distance measured across the last committed group instead."""
    if rounds.grid:
        return [slot.consensus_distance for slot in rounds.slots]
    out: list[float | None] = []
    for slot in rounds.slots:
        ranks = rounds.peer_ranks(slot)
        out.append(0.0 if ranks and all(tuple(rank) == slot.rank for rank in ranks) else None)
    return out


def final_summary(learner: Learner, eval_start: float, eval_end: float, train_s: float) -> dict[str, Any]:
    """The ``final`` line: where we ended (versions, anchor hashes), the anchors' eval loss before and after,
    rounds and downloads per fragment, and how long the inner loop waited."""
    sent, received = learner.rounds.bytes_total()
    slots, r = learner.slots, learner.rounds
    return {
        "name": learner.opts.name, "peer_id": learner.joined.peer_id, "config_hash": config_hash(learner.cfg),
        "steps": learner.step, "tokens": learner.tokens, "versions": [s.version for s in slots],
        "anchor_hashes": [s.anchor_hash for s in slots],
        "committed": [s.committed for s in slots], "discarded": [s.discarded for s in slots],
        "resynced": [s.resynced for s in slots], "forks_healed": [s.forks_healed for s in slots],
        "late_commits": [s.late_commits for s in slots],
        "consensus_distance": final_consensus(r),
        "fork_distance": [s.consensus_distance for s in slots],
        "busy_skips": [s.busy_skips for s in slots],
        "behind_skips": [s.behind_skips for s in slots],
        "eval_loss_start": eval_start, "eval_loss_end": eval_end,
        "train_s": round(train_s, 3), "stepping_s": round(learner.stepping_s, 3), "blocked_s": round(learner.blocked_s, 4),
        "max_stall_s": round(learner.max_stall_s, 4),
        "blocked_share": learner.blocked_s / train_s if train_s > 0 else 0.0,
        "utilization": learner.stepping_s / train_s if train_s > 0 else 0.0,
        "bytes_sent": sent, "bytes_received": received, "window_s": round(r.window_s, 3),
        "schedule": learner.cfg.averaging.schedule, "sync_period_s": learner.clock.period_s if learner.clock else None,
        "first_contribution_s": None if r.first_contribution_s is None else round(r.first_contribution_s, 3),
        "last_sync_time": r.last_sync_time,
        "resumed_from_step": learner.resumed_from_step,
    }


def evaluate_weights(cfg: Config, device: torch.device, weights: Mapping[str, torch.Tensor], batches: list[Any]) -> float:
    """Held-out eval loss of a model with these weights on ``batches``, on ``device``, in fp32 whatever
    ``inner.precision`` (the loss of the anchors themselves)."""
    model = build_model(cfg.model, cfg.run.seed).to(device)
    load_into(dict(model.named_parameters()), weights)
    if device.type != "cpu":
        batches = [(x.to(device), y.to(device)) for x, y in batches]
    with torch.no_grad():
        return data.evaluate(model, batches)
