"""The sync engine: Decoupled DiLoCo around any PyTorch training loop (see :mod:`p2p_diloco.engine.options`).

:class:`DiLoCo` owns a model's fragments, the schedule and the round policy. The user's loop does its own
forward, backward and ``optimizer.step()``, then calls :meth:`DiLoCo.step`, which hands the due fragments'
pseudo-gradients off to their averagers, applies the rounds that came back and starts downloads of the
fragments a peer is ahead on -- never waiting for the network. Behind it: each fragment's state machine
(:class:`~p2p_diloco.sync.fragment.FragmentSync`), driven by :class:`~p2p_diloco.engine.rounds.Rounds` over the
fragment averagers, and the status thread (:class:`~p2p_diloco.engine.view.SwarmView`) that publishes our
record, reads the others' and tends the sync clock. ``p2p-diloco join`` (:mod:`p2p_diloco.learner.loop`) is one
client of it; ``examples/`` and :mod:`p2p_diloco.integrations` are others.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from p2p_diloco.averaging.decisions import anchor_hash
from p2p_diloco.core import data, events, fragments, outer
from p2p_diloco.core.devices import to_host
from p2p_diloco.core.model import build_model as model_of
from p2p_diloco.core.model import unwrapped
from p2p_diloco.engine import checks
from p2p_diloco.engine.metrics import open_event_log
from p2p_diloco.engine.options import SyncOptions, check_supported
from p2p_diloco.engine.network import HivemindNetwork
from p2p_diloco.engine.rounds import Rounds, final_rounds
from p2p_diloco.sync.slot import FragmentSlot

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config
    from p2p_diloco.engine.swarm import Swarm
    from p2p_diloco.net.clock import SyncClock
    from p2p_diloco.transport.network import Member, Network

logger = logging.getLogger(__name__)

LINGER_POLL_S = 0.25
"""Seconds between two looks at the peers while lingering until they agree."""
LAST_SERVE_S = 1.0
"""Seconds we stay up at the very end, at most, so that peers still downloading from us finish."""
RECENT_EVENTS = 10_000
"""Events kept for :meth:`DiLoCo.poll_events` (the oldest are dropped past it)."""


def build_model(config: Config) -> torch.nn.Module:
    """The run's model at its seeded start, fp32 on the CPU: the same weights on every peer (move it where it
    trains). A Hugging Face model (``model.kind = "hf"``) is a transformers ``AutoModelForCausalLM``."""
    return model_of(config.model, config.run.seed)


def training_batches(config: Config, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(inputs, targets)`` batches of the run's training data on the CPU, ``config.inner.batch_size`` x
    ``config.model.block_size`` token ids, targets shifted by one (``targets[:, t] = inputs[:, t + 1]``), in the
    order of ``seed`` (give each peer its own). The data are checked first: missing or too small is a
    ``ValueError``."""
    splits = data.load_training_data(config, 1)
    return splits.train_batches(None, config.inner.batch_size, config.model.block_size, seed)


def check_start(model: torch.nn.Module, cfg: Config) -> dict[str, torch.Tensor]:
    """Raise ``ValueError`` (one line) unless ``model``'s parameters are the run's seeded start: the names,
    shapes and values :func:`~p2p_diloco.core.model.build_model` gives every peer, compared in the model's own
    precision and on the host (a bf16 model is the start when it holds the start rounded to bf16). Peers must share
    the first anchor; a model built some other way would average its progress into anchors that are not its own.
    Returns the start's parameters (fp32, on the CPU): the first anchors, the same on every peer whatever the
    model's dtype."""
    ours = dict(unwrapped(model).named_parameters())
    start = {n: p.detach() for n, p in build_model(cfg).named_parameters()}
    if ours.keys() != start.keys():
        odd = sorted(ours.keys() ^ start.keys())
        raise ValueError(f"model: its parameters are not the run's model ({len(ours)} vs {len(start)}; e.g. "
                         f"{odd[:3]}): build it with p2p_diloco.build_model(config)")
    for name, p in ours.items():
        if p.shape != start[name].shape:
            raise ValueError(f"model: parameter {name} has shape {tuple(p.shape)}, the run's model "
                             f"{tuple(start[name].shape)}: build it with p2p_diloco.build_model(config)")
        if not p.is_floating_point():
            raise ValueError(f"model: parameter {name} is {p.dtype}, not a floating-point tensor")
        if not torch.equal(p.detach().to("cpu"), start[name].to(p.dtype)):
            raise ValueError(f"model: parameter {name} is not the run's seeded start (every peer begins from the same "
                             f"weights): build the model with p2p_diloco.build_model(config), before any step")
    return start


class DiLoCo:
    """Decoupled DiLoCo for one learner unit on a joined :class:`~p2p_diloco.engine.swarm.Swarm`.

    ``model`` holds the local weights (on any device) and ``optimizer`` is the inner optimizer that steps them; the
    engine reads ``optimizer.state`` only to reset a fragment's moments when its progress is dropped. With
    ``check_model`` the model must be the run's seeded start (:func:`check_start`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Any, swarm: Swarm | Member,
                 options: SyncOptions | None = None, *, check_model: bool = True,
                 network: Network | None = None) -> None:
        cfg = swarm.config
        check_supported(cfg)
        params = dict(unwrapped(model).named_parameters())
        checks.check_optimizer(params, optimizer)
        start = check_start(model, cfg) if check_model else params
        self.cfg, self.opts, self.swarm = cfg, options or SyncOptions(), swarm
        self.joined, self.local = swarm.joined, swarm.local
        self.model, self.opt = model, optimizer
        self.params = params
        o = cfg.outer
        self.schedule = fragments.SyncSchedule(o.fragments, o.sync_every, o.sync_every_start, o.sync_ramp_steps)
        self.slots: list[FragmentSlot] = []
        for frag in fragments.make_fragments({n: p.numel() for n, p in self.params.items()}, o.fragments,
                                             fragments.block_map(unwrapped(model))):
            anchor = to_host(start, frag.names)  # the run's fp32 start, also for a bf16 model that holds it rounded
            self.slots.append(FragmentSlot(frag.index, frag.names, anchor, anchor_hash=anchor_hash(anchor)))
        self.network: Network = network if network is not None else HivemindNetwork(swarm)
        hosts = self.network.hosts(cfg, self.slots, {n: p.shape for n, p in self.params.items()})
        self.inner_step = self.tokens = 0
        """Inner steps and tokens counted by :meth:`step` (restored by :meth:`load_state_dict`)."""
        self.start_step = self.start_tokens = 0
        self.loss: torch.Tensor | float | None = None
        """The latest training loss given to :meth:`step`: read on the host only when logged or published."""
        self.blocked_s = self.max_stall_s = 0.0
        """Time :meth:`step` took (applying rounds, starting them), in all and the longest single call."""
        self.t_start = time.monotonic()
        self.schedule_offset = 0
        """Step schedule: added to our step count to number our steps like the swarm we joined
        (:meth:`_align_schedule`); 0 for learners that start together."""
        self.training = self.finished = self.closed = False
        self._stop = threading.Event()
        self._events = open_event_log(self.opts.events_path, self.opts.metrics)  # None: no file, no sink
        self._events_lock = threading.Lock()  # the status and checkpoint threads log events too
        self._subscribers: list[Callable[[events.Event], None]] = []
        self._recent: collections.deque[events.Event] = collections.deque(maxlen=RECENT_EVENTS)
        self.view = self.network.view(self)
        self.rounds = Rounds(cfg, self.slots, self, hosts, self.view, self.local.config_hash, self.opts.started_at,
                             self.log_event, self.dht_time, self.joined.peer_id)
        self._last_clock = self.dht_time()

    # -------------------------------------------------------------- the loop's verbs

    def start(self, stop: threading.Event | None = None) -> None:
        """Look at the swarm (download what a peer is ahead on), start the status thread, wait for
        ``wait_peers`` and align our schedule; :meth:`step` calls it if the loop did not. ``stop``, set (a
        signal), ends the waits and makes :meth:`finish` cancel the rounds in flight."""
        if self.finished or self.closed:
            raise RuntimeError("DiLoCo.start after finish() or close(): this engine has left the swarm's rounds")
        if stop is not None:
            self._stop = stop
        if self.opts.wait_peers <= 1:
            self.view.look_before_training(self._stop)
        self.view.start()
        self.view.wait_for_peers(self._stop)
        self.joined.publisher.update(state="training")
        self.t_start = time.monotonic()
        self.start_step, self.start_tokens = self.inner_step, self.tokens  # not 0 after a restore
        self.training = True
        self._last_clock = self.dht_time()  # boundaries passed while waiting for peers are not due
        if self.cfg.averaging.schedule == "steps":
            self._align_schedule()
        waited_s = self.t_start - self.opts.started_at
        logger.info("training from step %d, %.1f s after start", self.inner_step, waited_s)
        self.log_event(events.TrainingEvent(seconds_since_start=round(waited_s, 3)))

    def step(self, tokens: int, loss: torch.Tensor | float | None = None) -> None:
        """After the loop's own ``optimizer.step()``: count one inner step of ``tokens`` tokens (``loss``, kept as
        it is, is what our record shows), apply the rounds that came back at least ``outer.overlap`` steps ago,
        download fragments a peer is ahead on, and hand the due fragments off. Never waits for the network
        (unless ``blocking``)."""
        if self.finished or self.closed:
            raise RuntimeError("DiLoCo.step after finish() or close(): this engine has left the swarm's rounds")
        tokens = checks.check_count(tokens, "tokens")  # before anything counts it: peers refuse a round of any other
        loss = checks.check_loss(loss)
        if not self.training:
            self.start()
        self.inner_step += 1
        self.tokens += tokens
        if loss is not None:
            self.loss = loss
        for s in self.slots:
            s.since_tokens += tokens
            s.since_steps += 1
        with self._timed():
            self.rounds.collect(self.inner_step, min_age_steps=self.cfg.outer.overlap)  # tau: mixed in a few steps later
            self.rounds.catch_up()  # a fragment we are behind on is downloaded and sits out its due round
            for f in dict.fromkeys([*self.due_fragments(), *self.rounds.deferred]):  # due, or waiting for the link
                self.rounds.hand_off(self.rounds.syncs[f], self.inner_step)
            if self.opts.blocking:
                self.rounds.wait_rounds(self._stop, self.inner_step)

    def hand_off(self, fragments: Sequence[int]) -> None:
        """Hand ``fragments`` off now, each one with progress since its last round: the due fragments of a clock
        the caller keeps (the simulator's ticks) instead of ours. Never waits for the network."""
        with self._timed():
            for f in fragments:
                if self.slots[f].since_steps > 0:
                    self.rounds.hand_off(self.rounds.syncs[f], self.inner_step)

    def due_fragments(self) -> list[int]:
        """Fragments due now: at the swarm clock's boundaries (none until a derived clock is known), or by
        our step count (``averaging.schedule = "steps"``)."""
        if self.cfg.averaging.schedule == "steps":
            return self.schedule.due(self.inner_step + self.schedule_offset)
        now = self.dht_time()
        clock, self._last_clock, previous = self.clock, now, self._last_clock
        return clock.due(previous, now, len(self.slots)) if clock is not None else []

    def _align_schedule(self) -> None:
        """Step schedule, as training starts: number our steps like the swarm that is training already
        (:func:`~p2p_diloco.core.fragments.swarm_step`, from the last view: the one read before training, or the
        status thread's while waiting for peers), so that our fragments fall due with theirs. A newcomer that
        counted from its own first step met nobody when its due steps fell a few seconds after the others'."""
        at = fragments.swarm_step(self.view.peer_steps, self.dht_time())
        if at is None:
            return
        self.schedule_offset = at - self.inner_step
        logger.info("step schedule: the swarm is at step %d; our fragments fall due with its steps (offset %+d)",
                    at, self.schedule_offset)

    # -------------------------------------------------------------- the end

    def finish(self) -> None:
        """Final rounds for every fragment with unsynced progress (one after another where together they would
        not fit the link, :meth:`Rounds.final_rounds_in_turn`), then linger until the live peers agree (at
        most ``linger_s``), then serve newcomers ``serve_s``. After a stop signal: rounds in flight are
        cancelled and nobody is waited for."""
        if self.finished:
            return
        self.finished, self.training = True, False  # the clock is tended by learners that train
        stop, final_by = self._stop, time.monotonic() + self.opts.final_wait_s
        self.joined.publisher.update(state="syncing")
        if stop.is_set():
            self.rounds.cancel()
        self.rounds.drain(self.inner_step)
        if not stop.is_set():
            final_rounds(self.rounds, self.inner_step, stop, final_by)
        for link in self.rounds.links:  # no round of ours follows: groups that still name us go on without us
            link.leave()
        self.joined.publisher.update(state="leaving")
        logger.info("lingering up to %.0f s until the live peers agree on the fragment versions %s",
                    self.opts.linger_s, [s.version for s in self.slots])
        deadline = time.monotonic() + self.opts.linger_s
        while time.monotonic() < deadline and not stop.is_set():
            self.rounds.catch_up()
            self.rounds.drain(self.inner_step)
            if self.rounds.peers_settled():
                break
            time.sleep(LINGER_POLL_S)
        if self.opts.serve_s > 0 and not stop.is_set():
            logger.info("serving our state to newcomers for %.0f s", self.opts.serve_s)
            stop.wait(self.opts.serve_s)
        time.sleep(min(LAST_SERVE_S, self.opts.status_period_s))  # let peers still fetching from us finish

    def close(self) -> None:
        """Cancel the rounds and downloads still in flight (none after :meth:`finish`; not waited for), stop the
        status thread and the averagers, close the event sinks (the swarm stays joined). Idempotent."""
        if self.closed:
            return
        self.closed, self.training = True, False
        self.rounds.cancel()  # first: they end while the status thread stops
        self.view.stop()
        self.rounds.shutdown()
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        """Leaving the block normally finishes (final rounds, the linger); on an error (Ctrl+C included) it only
        closes: the rounds in flight are cancelled, and the process can exit at once."""
        try:
            if kind is None:
                self.finish()
        finally:
            self.close()

    # -------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The engine's state (copies, on the CPU): per fragment its version, anchor, outer momentum and the
        progress not yet synced, and the step and token counts. The model and the inner optimizer are the
        caller's to save beside it."""
        frags = []
        for s in self.slots:
            with s.lock:
                frags.append({"version": s.version, "anchor": {n: t.clone() for n, t in s.anchor.items()},
                              "momentum": {n: t.clone() for n, t in s.state.momentum.items()},
                              "since_tokens": s.since_tokens, "since_steps": s.since_steps})
        return {"config_hash": self.local.config_hash, "step": self.inner_step, "tokens": self.tokens, "fragments": frags}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (of this run: the config hash must match), then advertise the anchors and
        vouch for them. The whole state is checked first (keys, shapes, fp32, finite values, non-negative counts:
        :func:`~p2p_diloco.engine.checks.check_state`), then every fragment is replaced, or none. Load the model's
        weights and the optimizer's state too: the engine does not."""
        checked = checks.check_state(state, self.local.config_hash, [s.names for s in self.slots],
                                     {n: p.shape for n, p in self.params.items()})
        for slot, frag in zip(self.slots, checked.fragments):
            with slot.lock:
                slot.anchor = frag.anchor
                slot.state = outer.OuterState(momentum=frag.momentum, version=frag.version)
                slot.anchor_hash = anchor_hash(slot.anchor)
                slot.since_tokens, slot.since_steps = frag.since_tokens, frag.since_steps
                slot.restored = True
        self.inner_step, self.tokens = checked.step, checked.tokens
        self.rounds.advertise()

    @property
    def versions(self) -> list[int]:
        """Each fragment's version: the committed rounds (and downloads) its anchor is the result of."""
        return [s.version for s in self.slots]

    @property
    def anchor_hashes(self) -> list[str]:
        """Each fragment's anchor hash: peers that hold the same (version, hash) hold the same anchor."""
        return [s.anchor_hash for s in self.slots]

    def anchors(self) -> dict[str, torch.Tensor]:
        """A copy of the global model (every fragment's anchor), not of our local replica."""
        out: dict[str, torch.Tensor] = {}
        for s in self.slots:
            with s.lock:
                out.update({n: s.anchor[n].detach().clone() for n in s.names})
        return out

    # -------------------------------------------------------------- events

    def subscribe(self, callback: Callable[[events.Event], None]) -> None:
        """Call ``callback`` with every event from now on (from the training, status or checkpoint thread:
        keep it short)."""
        self._subscribers.append(callback)

    def watch(self, metric: str, doc: str, read: Callable[[], float | None]) -> None:
        """Serve a figure of the loop's own, ``read()`` at each scrape, on the metric sinks that serve gauges
        (``metrics`` with ``prometheus:PORT``); nothing without one."""
        if self._events is not None:
            self._events.watch(metric, doc, read)

    def poll_events(self) -> list[events.Event]:
        """The events logged since the last call (at most :data:`RECENT_EVENTS`), oldest first."""
        with self._events_lock:
            out = list(self._recent)
            self._recent.clear()
        return out

    def log_event(self, event: events.Event) -> None:
        """Log ``event`` with our envelope (name, step, tokens, DHT time, latest loss) to the event file, the
        metric sinks and the subscribers."""
        event = event.stamped(name=self.joined.name, step=self.inner_step, tokens=self.tokens, time=self.dht_time(),
                              loss=self.latest_loss())
        with self._events_lock:
            self._recent.append(event)
            if self._events is not None:
                self._events.write(event)  # the --events JSONL and every --metrics sink
        for callback in self._subscribers:
            callback(event)

    def latest_loss(self) -> float | None:
        """The latest training loss, or None (not known yet, or not finite: JSON and records reject NaN)."""
        if self.loss is None:
            return None
        return events.finite_or_none(float(self.loss))  # the one host sync for the loss: when logged or published

    # -------------------------------------------------------------- small helpers

    @property
    def clock(self) -> SyncClock | None:
        """The swarm's sync clock (None on the step schedule, or before a derived clock is known)."""
        return self.view.clock

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            dt = time.monotonic() - t0
            self.blocked_s += dt
            self.max_stall_s = max(self.max_stall_s, dt)

    @staticmethod
    def dht_time() -> float:
        from hivemind.utils import get_dht_time

        return get_dht_time()
