"""``p2p-diloco join``'s loop: a client of the engine (:class:`~p2p_diloco.engine.engine.DiLoCo`).

Batch, forward and backward, the inner AdamW step, ``diloco.step``, a checkpoint when one is due: the
rest -- rounds, downloads, the schedule, the swarm view -- is the engine's. The loss stays on the device
until it is logged or published; the profile's pacing pads each step from outside the step itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from p2p_diloco.core import data, events
from p2p_diloco.core.config import Config
from p2p_diloco.core.inner import build_optimizer, schedule_step, swarm_tokens, train_step
from p2p_diloco.core.model import build_model
from p2p_diloco.engine.engine import DiLoCo
from p2p_diloco.engine.options import LearnerOptions, Profile, load_splits
from p2p_diloco.engine.swarm import Swarm
from p2p_diloco.learner import checkpoint, priority
from p2p_diloco.learner.checkpoint import Checkpointer
from p2p_diloco.learner.summary import evaluate_weights, final_summary
from p2p_diloco.sync.slot import FragmentSlot

if TYPE_CHECKING:
    from p2p_diloco.transport.network import Network

logger = logging.getLogger(__name__)

EVAL_JOIN_TIMEOUT_S = 60.0
"""Seconds :meth:`Learner.close` waits for an evaluation in progress (it ends within seconds)."""
SWARM_TOKENS_HORIZON_S = 60.0
"""How long another learner's published tokens are carried forward at its rate (``--lr-tokens``): a training learner
reads the records every 30 s (up to 40 learners) and each is refreshed every 10 s, so what it holds is up to 40 s old;
a record of a learner that left is read again within a TTL (30 s) and a read period."""


class Learner:
    """One learner unit on a joined swarm: our data, model and AdamW, driving a :class:`DiLoCo`."""

    def __init__(self, cfg: Config, profile: Profile, opts: LearnerOptions, swarm: Swarm,
                 splits: data.TrainingData | None = None, network: Network | None = None) -> None:
        """``network``: the engine's (None: the swarm's hivemind network, :class:`DiLoCo`'s default)."""
        torch.set_num_threads(profile.threads or 1)
        t_init = time.monotonic()
        self.cfg, self.profile, self.opts, self.joined, self.local = cfg, profile, opts, swarm.joined, swarm.local
        self._data = splits if splits is not None else load_splits(cfg, opts.num_shards)  # the CLI loads them first
        self._stream_seed = self._data_seed(0)
        self.batches = self._data.train_batches(opts.shard, cfg.inner.batch_size, cfg.model.block_size, self._stream_seed)
        self.eval_set = data.eval_batches(self._data.eval, cfg.data.eval_batches, cfg.data.eval_batch_size,
                                          cfg.model.block_size)
        self.device = torch.device(opts.device)  # built on the CPU under the run's seed, then moved
        self.model = build_model(cfg.model, cfg.run.seed).to(self.device)
        self.opt = build_optimizer(self.model, cfg.inner, self.device)
        t_engine = time.monotonic()
        self.diloco = DiLoCo(self.model, self.opt, swarm, opts.sync, check_model=False,  # built from the run's seed
                             network=network)
        self.stepping_s = 0.0
        self.diloco.watch("utilization", "share of the training time in inner steps (as the final summary's)",
                          self.utilization)
        self._stop_eval = threading.Event()
        self._eval_thread = threading.Thread(target=self._eval_loop, name="learner-eval", daemon=True)
        self._priority = priority.SessionPriority(opts.train_nice)  # lowered once we have joined
        self.resumed_from_step: int | None = None
        self._spent = 0.0  # the LR's other budgets: the share used up (_lr_spent)
        self._checkpointer = Checkpointer(self) if opts.checkpoint_dir is not None else None
        now = time.monotonic()
        logger.info("learner ready %.1f s after start: data and model %.1f s, engine (%d averagers) %.1f s",
                    now - opts.sync.started_at, t_engine - t_init, len(self.slots), now - t_engine)

    def run(self, stop: threading.Event, finish: threading.Event | None = None) -> dict[str, Any]:
        """Train until ``max_steps``, the time budget, ``stop`` (leave now) or ``finish`` (SIGUSR1: as at the time
        budget), then the engine's final rounds and linger; returns the ``final`` summary."""
        d = self.diloco
        d.start(stop)
        if self.opts.train_nice > 0:  # this thread (Linux); our session's autogroup once we have joined
            logger.info("%s", priority.lower_thread_priority(self.opts.train_nice))
        if self.opts.eval_every_s > 0:
            self._eval_thread.start()
        start_anchors = d.anchors()  # evaluated at the end: no eval delays the first round
        finish = finish or threading.Event()
        while d.inner_step < self.opts.max_steps and not stop.is_set() and not self._out_of_time() and not finish.is_set():
            self.train_once()
        train_s = time.monotonic() - d.t_start
        if d.inner_step == d.start_step and self._out_of_time():
            logger.warning("never trained: --max-time %g s ran out %.1f s after start, before the first step",
                           self.opts.sync.max_time_s, d.t_start - self.opts.sync.started_at)
        d.finish()
        if self._checkpointer is not None:
            self._checkpointer.save(final=True)
        return final_summary(d, self.evaluate(start_anchors), self.evaluate(d.anchors()), train_s, self.stepping_s,
                             self.resumed_from_step, float(self.opt.param_groups[0]["lr"]))

    def train_once(self) -> None:
        """One turn of the loop (``scripts/bench_overhead.py`` times exactly this against a plain PyTorch loop)."""
        t0 = time.monotonic()
        x, y = next(self.batches)
        i = self.cfg.inner
        at = schedule_step(self.step, i.total_steps, i.warmup_steps, self._lr_spent(t0))
        loss = train_step(self.model, self.opt, (x, y), at, i.total_steps, i, self.device)
        self.profile.pad(time.monotonic() - t0)  # a slower machine, emulated
        self.stepping_s += time.monotonic() - t0
        self.diloco.step(tokens=x.numel(), loss=loss)
        if self._checkpointer is not None:
            self._checkpointer.maybe_save()
        if lowered := self._priority.settle(self.diloco.rounds.first_contribution_s is not None,
                                            time.monotonic() - self.diloco.t_start):
            logger.info("%s", lowered)

    def close(self) -> None:
        self._stop_eval.set()
        if self._eval_thread.is_alive():  # an evaluation in progress ends within seconds
            self._eval_thread.join(timeout=EVAL_JOIN_TIMEOUT_S)
        self.diloco.close()

    # -------------------------------------------------------------- what the checkpointer reads and restores

    @property
    def slots(self) -> list[FragmentSlot]:
        return self.diloco.slots

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """The model's parameters by name: the engine's map of them."""
        return self.diloco.params

    @property
    def step(self) -> int:
        return self.diloco.inner_step

    @property
    def tokens(self) -> int:
        return self.diloco.tokens

    def log_event(self, event: events.Event) -> None:
        self.diloco.log_event(event)

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """:func:`~p2p_diloco.learner.checkpoint.checkpoint_state` of this learner (with its name and shard)."""
        return checkpoint.checkpoint_state(self.diloco, self.opt, {"name": self.opts.name, "shard": self.opts.shard,
                                                                   "num_shards": self.opts.num_shards})

    def _model_digest(self) -> str:
        return checkpoint.model_digest(self.params)

    def restore(self, ckpt: Any) -> str:
        """Resume from a verified checkpoint (:func:`~p2p_diloco.learner.checkpoint.restore`: through
        :meth:`DiLoCo.load_state_dict`); the data stream goes on with fresh batches, not the ones the first run
        already saw. Returns the restored weights' digest."""
        digest = checkpoint.restore(self.diloco, self.opt, ckpt)
        self.resumed_from_step = self.step
        self._stream_seed = self._data_seed(self.step)
        self.batches = self._data.train_batches(self.opts.shard, self.cfg.inner.batch_size, self.cfg.model.block_size,
                                                self._stream_seed)
        return digest

    # -------------------------------------------------------------- evaluation and small helpers

    def utilization(self) -> float | None:
        """The share of the training time so far spent in inner steps (None before training)."""
        d = self.diloco
        train_s = time.monotonic() - d.t_start
        return self.stepping_s / train_s if d.training and train_s > 0 else None

    def evaluate(self, weights: dict[str, torch.Tensor], batches: list[Any] | None = None) -> float:
        """:func:`evaluate_weights` on our device, on ``batches`` (default the whole eval set)."""
        return evaluate_weights(self.cfg, self.device, weights, self.eval_set if batches is None else batches)

    def _eval_loop(self) -> None:
        """Every ``eval_every_s``: the anchors' loss on the first ``eval_batches`` held-out batches (an ``eval``
        event), for the loss-over-time plots. Runs beside the inner loop, never blocks it."""
        quick, d = self.eval_set[:self.opts.eval_batches], self.diloco
        while not self._stop_eval.wait(self.opts.eval_every_s) and d.training:
            loss = self.evaluate(d.anchors(), quick)
            d.log_event(events.EvalEvent(eval_loss=loss, train_s=round(time.monotonic() - d.t_start, 3),
                                         versions=tuple(s.version for s in self.slots), batches=len(quick)))

    def _lr_spent(self, now: float) -> float:
        """The share of the LR's other budgets used up, the tightest (:func:`schedule_step`): the training share of
        ``--max-time`` with ``lr_by_time``, the swarm's tokens of ``--lr-tokens``. It never goes back: a learner
        that leaves takes its tokens out of the swarm's count, not out of our schedule."""
        s, d = self.opts.sync, self.diloco
        if self.opts.lr_by_time:
            budget_s = max(1e-3, s.max_time_s - (d.t_start - s.started_at))
            self._spent = max(self._spent, (now - d.t_start) / budget_s)
        if self.opts.lr_tokens > 0:
            trained = swarm_tokens(d.tokens, d.view.peer_tokens, d.dht_time(), SWARM_TOKENS_HORIZON_S)
            self._spent = max(self._spent, trained / self.opts.lr_tokens)
        return self._spent

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

    def _out_of_time(self) -> bool:
        """``--max-time`` is counted from the learner's start: waiting for peers and starting up use it too."""
        s = self.opts.sync
        return s.max_time_s > 0 and time.monotonic() - s.started_at > s.max_time_s


class FaultyLearner(Learner):
    """A :class:`Learner` on a :class:`~p2p_diloco.engine.faulty.FaultyNetwork`, with the ``inner-step`` point
    (``p2p-diloco join --fault``: built instead of a :class:`Learner` only when faults are armed)."""

    def __init__(self, cfg: Config, profile: Profile, opts: LearnerOptions, swarm: Swarm,
                 splits: data.TrainingData | None = None) -> None:
        from p2p_diloco.engine.faulty import FaultyNetwork, hit_inner_step  # loaded only when a fault is armed

        self._hit_inner_step = hit_inner_step
        super().__init__(cfg, profile, opts, swarm, splits, network=FaultyNetwork(swarm))

    def train_once(self) -> None:
        self._hit_inner_step()
        super().train_once()
