"""The simulator as N real engines: K :class:`~p2p_diloco.engine.engine.DiLoCo` engines on one in-process network
(:class:`~p2p_diloco.transport.inprocess.Hub`), driven in lockstep from one thread, deterministically.

Every round, download, late commit and catch-up is the engine's own -- the round policy the networked learner runs
-- and only what crosses the network is the hub's: its groups, its codec-exact reduction, its downloads. A tick is
one inner step of a learner at speed 1 (a learner at speed s takes s steps a tick on average, as in
:mod:`~p2p_diloco.sim.simulator`). The driver keeps the clock: at a tick where fragments fall due
(:class:`~p2p_diloco.core.fragments.SyncSchedule` of the tick, as the tick simulator's), every live learner with
progress on them hands them off (``DiLoCo.hand_off``: the engine's own round policy); at the end of the tick the hub
closes the groups (a window of one tick), and each engine applies their results at least ``outer.overlap`` of its
steps later.

Events from outside (:class:`~p2p_diloco.sim.simulator.Event`): ``leave`` kills a learner (kill -9: gone from every
view, a group it was in fails for all), ``join`` starts it again as a newcomer -- a fresh engine under the same name
that downloads the swarm's anchors from its peers and then contributes.

The same :class:`~p2p_diloco.sim.simulator.SimResult` as the tick simulator, so the two can be compared run for run
(``p2p-diloco sim``; ``--tick`` for the tick simulator). An attack (:class:`~p2p_diloco.sim.simulator.Attack`) is the hub's tamper with what
the attacker sends, a fault from outside. Not here: grid groups, error feedback and the final average (``p2p-diloco
sim --tick`` runs the tick simulator, which has them).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Sequence

import torch

from p2p_diloco.core import data, fragments
from p2p_diloco.core.config import Config
from p2p_diloco.core.devices import load_into
from p2p_diloco.core.inner import CPU, build_optimizer, train_step
from p2p_diloco.core.model import build_model
from p2p_diloco.engine.engine import DiLoCo
from p2p_diloco.engine.options import SyncOptions
from p2p_diloco.sim.simulator import Attack, Event, SimResult, dp_fp32_bytes, evaluate_on, poison, progress_line
from p2p_diloco.averaging.decisions import NO_GROUP
from p2p_diloco.transport.inprocess import Hub, Member, Tamper

log = logging.getLogger(__name__)


def on_ticks(cfg: Config) -> Config:
    """``cfg`` for engines whose fragments the driver hands off at its ticks: no schedule of their own (a clock
    schedule, and a manual hub shows them no clock)."""
    a = cfg.averaging
    return dataclasses.replace(cfg, averaging=dataclasses.replace(a, schedule="clock",
                                                                  sync_period_s=a.sync_period_s or 1.0))


def check_supported(cfg: Config) -> None:
    """Raise ``ValueError`` (one line) for what the engine simulator does not run yet."""
    o = cfg.outer
    if cfg.averaging.groups == "grid":
        raise ValueError("sim: averaging.groups = \"grid\" is not simulated on the engines yet: run the tick "
                         "simulator (--tick)")
    if o.error_feedback or o.final_average:
        raise ValueError("sim: outer.error_feedback and outer.final_average are not in the engine: run the tick "
                         "simulator (--tick)")


class Unit:
    """One simulated learner: its replica, inner optimizer and data (as the tick simulator's), and its engine."""

    def __init__(self, hub: Hub, idx: int, cfg: Config, splits: data.TrainingData, speed: float, total_steps: int,
                 device: torch.device) -> None:
        self.idx, self.cfg, self.speed, self.total_steps, self.device = idx, cfg, speed, total_steps, device
        self.credit = 0.0
        self.name = f"learner-{idx}"
        self.batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = splits.train_batches(
            idx, cfg.inner.batch_size, cfg.model.block_size, seed=cfg.run.seed * 1000 + idx)
        self.steps = self.tokens = 0
        self.alive = True
        self.engines: list[DiLoCo] = []
        """Every engine this learner ran (a rejoin starts a new one)."""
        self.start(hub)

    def start(self, hub: Hub) -> None:
        """(Re)join: a fresh model at the run's seed, a fresh optimizer and engine; the engine downloads the swarm's
        anchors from its peers at its first step."""
        self.model = build_model(self.cfg.model, self.cfg.run.seed).to(self.device)
        self.opt = build_optimizer(self.model, self.cfg.inner, self.device)
        self.swarm = hub.join(self.name)
        self.diloco = DiLoCo(self.model, self.opt, self.swarm, SyncOptions(linger_s=0.0), check_model=False,
                             network=self.swarm.network)
        for sync in self.diloco.rounds.syncs:
            sync.measure_ratio = True  # the simulator reports the largest pseudo-gradient sent
        self.diloco.start()
        self.alive = True
        self.engines.append(self.diloco)

    def tick(self) -> None:
        """The steps this learner takes in one tick (``speed`` on average)."""
        self.credit += self.speed
        while self.credit >= 1.0:
            self.credit -= 1.0
            self.step()

    def step(self) -> None:
        x, y = next(self.batches)
        train_step(self.model, self.opt, (x, y), self.steps, self.total_steps, self.cfg.inner, self.device)
        self.steps += 1
        self.tokens += x.numel()
        self.diloco.step(tokens=x.numel())

    def leave(self, hub: Hub) -> None:
        hub.kill(self.name)
        self.diloco.close()
        self.alive = False


class EngineSimulator:
    """K engines on a manual :class:`Hub`; :meth:`run` trains to the token budget and evaluates the anchors."""

    def __init__(self, cfg: Config, splits: data.TrainingData, events: Sequence[Event] = (), eval_points: int = 10,
                 device: torch.device = CPU, attack: Attack | None = None) -> None:
        """``attack``: one learner poisons every contribution it sends (:class:`~p2p_diloco.sim.simulator.Attack`,
        applied by the hub to what it sends, as the tick simulator does)."""
        check_supported(cfg)
        o, k = cfg.outer, cfg.sim.learners
        self.schedule = fragments.SyncSchedule(o.fragments, o.sync_every, o.sync_every_start, o.sync_ramp_steps)
        speeds = list(cfg.sim.speeds) or [1.0] * k
        # equal tokens whatever the speeds: K * total_steps inner steps in all (as the tick simulator)
        self.ticks = math.ceil(k * cfg.inner.total_steps / sum(speeds))
        cfg = on_ticks(cfg)
        self.cfg, self.device = cfg, device
        self.hub = Hub(cfg, manual=True)
        if attack is not None:
            if attack.learner >= k:
                raise ValueError(f"attack.learner {attack.learner} is not one of the {k} learners")
            self.hub.tamper = poisoner(attack, f"learner-{attack.learner}", cfg.run.seed)
        self.units = [Unit(self.hub, i, cfg, splits, speeds[i], max(1, round(self.ticks * speeds[i])), device)
                      for i in range(k)]
        self.events = sorted(events, key=lambda e: e.tick)
        self.eval_model = build_model(cfg.model, cfg.run.seed).to(device)
        self.eval_set = data.eval_batches(splits.eval, cfg.data.eval_batches, cfg.data.eval_batch_size,
                                          cfg.model.block_size)
        self.eval_every = max(1, self.ticks // eval_points)
        self.result = SimResult(mode="diloco", learners=k)

    def _handle_events(self, tick: int) -> None:
        while self.events and self.events[0].tick <= tick:
            ev = self.events.pop(0)
            unit = self.units[ev.learner]
            if ev.kind == "leave" and unit.alive:
                unit.leave(self.hub)
            elif ev.kind == "join" and not unit.alive:
                unit.start(self.hub)
            elif ev.kind not in ("leave", "join"):
                raise ValueError(f"unknown event kind {ev.kind!r}")

    def _evaluate(self) -> None:
        """The eval loss of the global model: the anchors of the first live learner (every live learner's, once
        the rounds of this tick are applied)."""
        live = next((u for u in self.units if u.alive), None)
        if live is not None:
            load_into(dict(self.eval_model.named_parameters()), live.diloco.anchors())
        loss = evaluate_on(self.eval_model, self.eval_set, self.device)
        self.result.curve.append({"tokens": sum(u.tokens for u in self.units), "eval_loss": loss})

    def _final_rounds(self) -> None:
        """Every live learner's unsynced progress in one last round of each fragment, then applied."""
        live = [u for u in self.units if u.alive]
        for u in live:
            rounds = u.diloco.rounds
            rounds.drain(u.diloco.inner_step)  # what is still in flight ended with the last tick's close
            for sync in rounds.syncs:
                if sync.slot.since_steps > 0:
                    rounds.hand_off(sync, u.diloco.inner_step)
        self.hub.close_open()
        for u in live:
            u.diloco.rounds.drain(u.diloco.inner_step)
            u.diloco.rounds.catch_up()  # a learner left out of a final group takes the others' anchors
            u.diloco.rounds.drain(u.diloco.inner_step)

    def run(self, progress: bool = False) -> SimResult:
        t0 = time.monotonic()
        self._evaluate()
        for tick in range(1, self.ticks + 1):
            self._handle_events(tick)
            for u in self.units:
                if u.alive:
                    u.tick()
            due = self.schedule.due(tick)
            for u in self.units:  # the clock's boundary: every live learner with progress on them hands them off
                if u.alive and due:
                    u.diloco.hand_off(due)
            self.hub.close_open()
            if tick % self.eval_every == 0 and tick < self.ticks:
                self._evaluate()
                if progress:
                    progress_line(f"sim tick {tick}/{self.ticks} eval_loss {self.result.curve[-1]['eval_loss']:.3f}")
        self._final_rounds()
        self._evaluate()
        for u in self.units:
            u.diloco.close()
        return self._result(time.monotonic() - t0)

    def _result(self, wall_s: float) -> SimResult:
        r, rounds = self.result, self.hub.rounds
        r.final_eval_loss = r.curve[-1]["eval_loss"]
        r.tokens = sum(u.tokens for u in self.units)
        r.token_shares = [u.tokens / max(1, r.tokens) for u in self.units]
        n_params = sum(p.numel() for p in self.eval_model.parameters())
        r.dp_fp32_bytes = dp_fp32_bytes(r.tokens, self.cfg, n_params)
        r.rounds = sum(1 for x in rounds if x.reason != NO_GROUP)
        r.empty_rounds = sum(1 for x in rounds if x.reason == NO_GROUP)
        r.discarded_rounds = sum(1 for x in rounds if x.reason != NO_GROUP and not x.committed)
        r.bytes_sent = float(self.hub.round_bytes)
        syncs = [sync for u in self.units for e in u.engines for sync in e.rounds.syncs]
        r.max_delta_ratio = max((sync.max_delta_ratio for sync in syncs), default=0.0)
        r.local_drops = sum(sync.slot.local_drops for sync in syncs)
        committed = [x for x in rounds if x.committed]
        r.contributed_tokens = sum(x.tokens for x in committed) // max(1, len(self.units[0].diloco.slots))
        names = [u.name for u in self.units]
        for x in committed:
            share = {m: w / sum(x.weights) for m, w in zip(x.members, x.weights)}
            r.weight_shares.append([share.get(n, 0.0) for n in names])
        r.wall_s = wall_s
        if math.isnan(r.final_eval_loss):
            log.warning("sim --engines: the final eval loss is not finite")
        return r


def poisoner(attack: Attack, name: str, seed: int) -> Tamper:
    """The hub's :attr:`~p2p_diloco.transport.inprocess.Hub.tamper` for ``attack`` by the learner ``name`` (its
    random draws seeded as the tick simulator's)."""
    generator = torch.Generator().manual_seed(seed + 7919)

    def tamper(member: Member, tensors: dict[str, torch.Tensor],
               norms: dict[str, float]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return poison(tensors, norms, attack, generator) if member.name == name else (tensors, norms)

    return tamper


def run(cfg: Config, splits: data.TrainingData, events: Sequence[Event] = (), eval_points: int = 10,
        progress: bool = False, device: torch.device = CPU, attack: Attack | None = None) -> SimResult:
    return EngineSimulator(cfg, splits, events, eval_points, device, attack).run(progress)
