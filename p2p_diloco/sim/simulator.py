"""In-process simulation of K learner units, and the data-parallel / single-learner references.

The simulator runs the same fragment, merge, outer-optimizer and codec code as the networked
learner, with no network: every simulated learner moves its fragments through the learner's own
state machine (:class:`~p2p_diloco.sync.fragment.FragmentSync`: hand off with the local check,
apply a round, rebase onto a newer anchor), over an in-process transport. A round of fragment f
is the weighted all-reduce of the pseudo-gradients of whichever learners are alive and delivered,
reproduced by
:func:`p2p_diloco.hivemind_ext.compression.simulate_allreduce` (each tensor through the codec as hivemind's
butterfly all-reduce would send it). It is how we measure what quality to expect from the
network and how tests pin the maths.

Time is counted in *ticks* of the swarm clock: a learner of speed s does s inner steps per tick
on average, so slower learners bring fewer tokens to the same round (weighting by progress),
exactly as with the DHT-clock schedule of the networked learner. Fragments are due on the
staggered :class:`~p2p_diloco.core.fragments.SyncSchedule`; a merged result is applied ``tau`` ticks later.

Protocol rules reproduced here:
- participants of a round alpha-mix the new anchor into their weights; live learners that were
  not in it (contribution lost, or joined meanwhile) *rebase* onto it and keep their progress,
  which they contribute at the next round;
- a learner that leaves loses its unsynced work; one that (re)joins starts from the current
  anchors with a fresh inner optimizer;
- at the end every live learner contributes its remaining progress in a final round of every
  fragment, and the anchors (the global model) are evaluated;
- a learner whose own pseudo-gradient is non-finite or absurd (:func:`outer.local_problem`) drops it
  and re-anchors the fragment; a round whose merged result is not finite is discarded by everyone
  and its members keep their progress (as a networked round that fails);
- the robust merge (``outer.robust``) uses the same functions as the networked reducers and members
  (:func:`outer.robust_mean`, :func:`outer.decode_merged`), with each whole tensor as one reducer
  part (decoded from the codec, reduced, and sent back through the codec). A non-finite part is left
  out of its average, here as in the networked reducers.

An :class:`Attack` makes one learner poison what it sends every round (the poisoning benchmark).
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from p2p_diloco.core import data, fragments, outer
from p2p_diloco.core.config import Config
from p2p_diloco.core.devices import load_into
from p2p_diloco.core.inner import CPU, InnerOptimizer, build_optimizer, train_step
from p2p_diloco.core.model import build_model
from p2p_diloco.hivemind_ext import compression
from p2p_diloco.sync.fragment import BUSY, DROPPED, Contribution, FragmentSync
from p2p_diloco.sync.slot import FragmentSlot

log = logging.getLogger(__name__)

MODES = ("diloco", "data-parallel", "single")
ATTACKS = ("sign-flip", "random", "nan")


@dataclass(frozen=True)
class Attack:
    """One learner poisons its contribution to every round, on every surface a peer controls.

    ``sign-flip``: it sends ``-scale`` x its encoded tensors and ``scale`` x its radial norms (with the
    mean merge, ``-scale`` x its pseudo-gradient); ``random``: each tensor replaced by a random one of
    ``scale`` x its norm, norms ``scale`` x; ``nan``: tensors full of NaN. Its claimed progress is honest.
    """

    learner: int
    mode: str
    scale: float = 1000.0

    def __post_init__(self) -> None:
        if self.mode not in ATTACKS:
            raise ValueError(f"unknown attack {self.mode!r} (expected one of {', '.join(ATTACKS)})")
        if self.learner < 0 or not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"attack needs a learner index >= 0 and a finite scale > 0, got {self}")


def poison(sent: dict[str, torch.Tensor], norms: dict[str, float], attack: Attack,
           generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """What the attacker sends instead of its honest encoded contribution ``(sent, norms)``."""
    k = attack.scale
    if attack.mode == "nan":
        return {n: torch.full_like(t, float("nan")) for n, t in sent.items()}, dict(norms)
    if attack.mode == "sign-flip":
        return {n: -k * t for n, t in sent.items()}, {n: k * v for n, v in norms.items()}
    out = {}
    for n, t in sent.items():
        r = torch.randn(t.shape, generator=generator)
        out[n] = r * (k * float(t.norm()) / max(float(r.norm()), 1e-12))
    return out, {n: k * v for n, v in norms.items()}


@dataclass(frozen=True)
class Event:
    """A learner leaving or (re)joining at a tick (``kind`` is "leave" or "join")."""

    tick: int
    learner: int
    kind: str


@dataclass
class SimResult:
    mode: str
    learners: int
    curve: list[dict[str, float]] = field(default_factory=list)  # {"tokens", "eval_loss"}
    final_eval_loss: float = float("nan")
    tokens: int = 0
    bytes_sent: float = 0.0  # all learners together, as the butterfly all-reduce would send them
    dp_fp32_bytes: float = 0.0  # what fp32 data-parallel would send for the same tokens
    rounds: int = 0
    empty_rounds: int = 0
    discarded_rounds: int = 0  # merged result not finite: nobody applied it
    local_drops: int = 0  # own pseudo-gradients refused by outer.local_problem (fragment re-anchored)
    max_delta_ratio: float = 0.0  # largest ||own pseudo-gradient|| / ||fragment anchor|| that was sent
    contributed_tokens: int = 0  # tokens whose progress reached the anchors through some round
    weight_shares: list[list[float]] = field(default_factory=list)  # per round, per learner (0 if absent)
    token_shares: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "learners": self.learners,
            "final_eval_loss": round(self.final_eval_loss, 4),
            "tokens": self.tokens,
            "bytes_sent": self.bytes_sent,
            "dp_fp32_bytes": self.dp_fp32_bytes,
            "bytes_saved_vs_dp_fp32": (self.dp_fp32_bytes / self.bytes_sent) if self.bytes_sent else None,
            "rounds": self.rounds,
            "empty_rounds": self.empty_rounds,
            "discarded_rounds": self.discarded_rounds,
            "local_drops": self.local_drops,
            "max_delta_ratio": round(self.max_delta_ratio, 4),
            "contributed_tokens": self.contributed_tokens,
            "wall_s": round(self.wall_s, 1),
            "curve": self.curve,
        }


class _Learner:
    """One simulated learner unit: its replica and inner AdamW (on ``device``), and its data stream."""

    def __init__(self, idx: int, cfg: Config, splits: data.TrainingData, speed: float, total_steps: int,
                 device: torch.device = CPU) -> None:
        self.idx = idx
        self.cfg = cfg
        self.speed = speed
        self.total_steps = total_steps
        self.device = device
        self.model = build_model(cfg.model, cfg.run.seed).to(device)
        self.params = dict(self.model.named_parameters())
        self.batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = splits.train_batches(
            idx, cfg.inner.batch_size, cfg.model.block_size, seed=cfg.run.seed * 1000 + idx)
        self.opt = self._new_optimizer()
        self.alive = True
        self.credit = 0.0
        self.steps = 0
        self.tokens = 0
        self.syncs: list[FragmentSync] = []
        """One per fragment, as a networked learner has (attached by the :class:`Simulator`)."""
        self.error_feedback = compression.ErrorFeedback(cfg.outer.codec) if cfg.outer.error_feedback else None

    def _new_optimizer(self) -> InnerOptimizer:
        return build_optimizer(self.model, self.cfg.inner, self.device)

    @property
    def since_tokens(self) -> list[int]:
        """Unsynced tokens, per fragment."""
        return [s.slot.since_tokens for s in self.syncs]

    @property
    def since_steps(self) -> list[int]:
        """Unsynced inner steps, per fragment."""
        return [s.slot.since_steps for s in self.syncs]

    def reset_from(self, swarm: Sequence[FragmentSync]) -> None:
        """(Re)join: take the swarm's current anchors, a fresh inner optimizer, no unsynced progress."""
        for sync, record in zip(self.syncs, swarm):
            sync.reset_to(record.state_copy())
        self.opt = self._new_optimizer()
        if self.error_feedback is not None:
            self.error_feedback.reset()

    def tick(self) -> None:
        self.credit += self.speed
        while self.credit >= 1.0:
            self.credit -= 1.0
            self.step()

    def step(self) -> None:
        x, y = next(self.batches)
        train_step(self.model, self.opt, (x, y), self.steps, self.total_steps, self.cfg.inner, self.device)
        self.steps += 1
        n = x.numel()
        self.tokens += n
        for sync in self.syncs:
            sync.slot.since_tokens += n
            sync.slot.since_steps += 1


@dataclass(frozen=True)
class SimOutcome:
    """How a simulated round ended (a :class:`~p2p_diloco.sync.fragment.Outcome`)."""

    committed: bool
    merged: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class PendingRound:
    """A round that ended, applied at ``apply_at`` (tau ticks after it was sent; at once if discarded)."""

    apply_at: int
    fragment: int
    outcome: SimOutcome
    members: frozenset[int]
    plain: bool


class _Port:
    """One simulated learner's transport for one fragment: rounds go to the simulator's in-process
    reducer (their futures are set when the round's members are all in), downloads come from the
    swarm's record at once."""

    def __init__(self, sim: Simulator, learner: _Learner, fragment: int) -> None:
        self.sim, self.learner, self.fragment = sim, learner, fragment

    def start_round(self, contribution: Contribution) -> Future[Any]:
        done: Future[Any] = Future()
        self.sim.gathered.append((self.learner, contribution, done))
        return done

    def fetch_state(self, ours: tuple[int, str]) -> Future[Any]:
        done: Future[Any] = Future()
        done.set_result(self.sim.swarm[self.fragment].state_copy())
        return done

    def anchor_changed(self, version: int, anchor_hash: str) -> None:
        """Nobody downloads from a simulated learner: the swarm record is the donor."""


def _butterfly_bytes(numel: int, group: int, codec: str, n_tensors: int, radial: bool) -> float:
    """Bytes all members of a butterfly all-reduce send together: 2 (n-1) V, plus gathered norms."""
    if group < 2:
        return 0.0
    payload = numel * compression.bits_per_element(codec) / 8
    meta = 8 * n_tensors if radial else 0
    return 2 * (group - 1) * payload + group * (group - 1) * meta


class Simulator:
    """K learners and the shared anchors; :meth:`run` trains to the token budget and evaluates."""

    def __init__(self, cfg: Config, splits: data.TrainingData, events: Sequence[Event] = (), eval_points: int = 10,
                 stop_after_ticks: int = 0, attack: Attack | None = None, device: torch.device = CPU) -> None:
        """``stop_after_ticks`` > 0 runs exactly that many ticks while the LR schedule still spans
        ``inner.total_steps``: fewer end the run early, more go on past it with the LR at its floor -- what a
        networked learner bounded by time and not by steps does, for comparisons at equal steps. ``attack``: one learner
        poisons every contribution it sends. ``device``: where the learners' replicas and inner optimizers
        live; the anchors, outer states and merges stay fp32 on the CPU, as in a networked learner."""
        self.cfg = cfg
        self.device = device
        o, k = cfg.outer, cfg.sim.learners
        speeds = list(cfg.sim.speeds) or [1.0] * k
        # equal tokens whatever the speeds: run until K * total_steps inner steps are done in all
        self.schedule_ticks = math.ceil(k * cfg.inner.total_steps / sum(speeds))
        self.ticks = stop_after_ticks if stop_after_ticks > 0 else self.schedule_ticks
        self.global_model = build_model(cfg.model, cfg.run.seed)
        self.anchor = {n: p.detach() for n, p in self.global_model.named_parameters()}
        sizes = {n: p.numel() for n, p in self.anchor.items()}
        self.fragments = fragments.make_fragments(sizes, o.fragments, fragments.block_map(self.global_model))
        self.schedule = fragments.SyncSchedule(o.fragments, o.sync_every, o.sync_every_start, o.sync_ramp_steps)
        # the swarm's record of every fragment: the anchors all live learners agree on (the global model,
        # stepped in place), which joiners and learners that missed a round download
        self.swarm = [FragmentSync(FragmentSlot(fr.index, fr.names, {n: self.anchor[n] for n in fr.names}), None, o,
                                   None) for fr in self.fragments]
        self.learners = [_Learner(i, cfg, splits, speeds[i], max(1, round(self.schedule_ticks * speeds[i])),
                                  device) for i in range(k)]
        for m in self.learners:
            m.syncs = [FragmentSync(FragmentSlot(fr.index, fr.names, {n: self.anchor[n].clone() for n in fr.names}),
                                    m, o, _Port(self, m, fr.index), measure_ratio=True) for fr in self.fragments]
        self.gathered: list[tuple[_Learner, Contribution, Future[Any]]] = []
        """Contributions handed off to the round being formed: (learner, contribution, its outcome's future)."""
        # the anchors are evaluated where the learners compute (a copy of the global model there, fp32)
        self.eval_model = self.global_model if device.type == "cpu" else build_model(cfg.model, cfg.run.seed).to(device)
        self.events = sorted(events, key=lambda e: e.tick)
        self.eval_set = data.eval_batches(splits.eval, cfg.data.eval_batches, cfg.data.eval_batch_size, cfg.model.block_size)
        self.eval_every = max(1, self.ticks // eval_points)
        self.rng = random.Random(cfg.run.seed)
        self.pending: list[PendingRound] = []
        self.result = SimResult(mode="diloco", learners=k)
        self.n_params = sum(sizes.values())
        if attack is not None and attack.learner >= k:
            raise ValueError(f"attack.learner {attack.learner} is not one of the {k} learners")
        self.attack = attack
        self.attack_rng = torch.Generator().manual_seed(cfg.run.seed + 7919)
        self.robust = outer.robust_rule(o.robust, o.clip_factor)

    @property
    def outer_states(self) -> list[outer.OuterState]:
        """The swarm's outer state (momentum, version) of every fragment."""
        return [record.slot.state for record in self.swarm]

    # ------------------------------------------------------------ one round of one fragment
    def _merge_round(self, f: int, gathered: Sequence[tuple[_Learner, Contribution, Any]]) -> SimOutcome:
        """The in-process reducer: the merged pseudo-gradient of the gathered contributions for fragment f (codec,
        merge and robust merge as configured; error feedback and an attack applied to what each member
        sends); not committed if it is not finite (the members keep their progress)."""
        o = self.cfg.outer
        names = self.fragments[f].names
        weights = [c.weight for _, c, _ in gathered]
        encoded = []
        for m, c, _ in gathered:
            sent, meta = c.tensors, c.norms
            if m.error_feedback is not None:
                sent = {n: m.error_feedback.encode(n, t) for n, t in sent.items()}
            if self.attack is not None and m.idx == self.attack.learner:
                sent, meta = poison(sent, meta, self.attack, self.attack_rng)
            encoded.append((sent, meta))
        rule = self.robust
        averaged = {}
        for n in names:
            tensors = [e[0][n] for e in encoded]
            if rule.active:  # as a robust reducer: the parts it decodes, its rule, codec(result) back to all
                received = [compression.roundtrip(o.codec, t) for t in tensors]
                reduced = outer.robust_mean(received, outer.clip_to_median(weights, rule.clip_factor), rule)
                averaged[n] = compression.roundtrip(o.codec, reduced)
            else:
                averaged[n] = compression.simulate_allreduce(o.codec, tensors, weights)
        self.result.rounds += 1
        if not all(bool(torch.isfinite(t).all()) for t in averaged.values()):
            self.result.discarded_rounds += 1  # as the networked members do: "averaged tensors are not finite"
            return SimOutcome(committed=False)
        merged = outer.decode_merged(averaged, [e[1] for e in encoded], weights, o.merge, rule)
        self.result.bytes_sent += _butterfly_bytes(self.fragments[f].numel, len(gathered), o.codec, len(names),
                                                   o.merge == "radial")
        total = sum(weights)
        share = {m.idx: w / total for (m, _, _), w in zip(gathered, weights)}
        self.result.weight_shares.append([share.get(i, 0.0) for i in range(len(self.learners))])
        self.result.contributed_tokens += sum(c.tokens for _, c, _ in gathered) // len(self.fragments)
        return SimOutcome(committed=True, merged=merged)

    def _start_round(self, f: int, tick: int, final: bool = False) -> None:
        """Every live learner with progress on fragment f (and not dropped) hands it off; the reducer ends the
        round at once, and its outcome is applied ``tau`` ticks later (:meth:`_apply_due`)."""
        drop = 0.0 if final else self.cfg.sim.drop_prob
        members = [m for m in self.learners if m.alive and m.syncs[f].slot.since_steps > 0 and self.rng.random() >= drop]
        for m in members:
            handed = m.syncs[f].hand_off(tick)
            if handed.status == BUSY:  # rounds are applied within tau < H ticks: none can be in flight here
                raise RuntimeError(f"learner {m.idx} fragment {f}: a round is still in flight at tick {tick}")
            if handed.status == DROPPED:
                log.debug("learner %d fragment %d: %s; dropped, fragment re-anchored", m.idx, f, handed.reason)
                self.result.local_drops += 1
            elif handed.contribution is not None:
                self.result.max_delta_ratio = max(self.result.max_delta_ratio, handed.contribution.delta_ratio)
        gathered, self.gathered = self.gathered, []
        if not gathered:
            if not final:  # at the final flush a fragment synced on the last tick has nothing left
                self.result.empty_rounds += 1
            return
        outcome = self._merge_round(f, gathered)
        for m, _, done in gathered:
            done.set_result(outcome)
            if outcome.committed:  # the round has ended: what went out leaves the unsynced progress now
                m.syncs[f].settle()
        apply_at = tick if final or not outcome.committed else tick + self.cfg.outer.overlap
        plain = final and self.cfg.outer.final_average
        self.pending.append(PendingRound(apply_at, f, outcome, frozenset(m.idx for m, _, _ in gathered), plain))

    def _apply_due(self, tick: int) -> None:
        """Apply the rounds due: the swarm record takes the outer step; the live members apply their round
        (outer step, alpha-mix), the other live learners download the new anchor and rebase onto it; a
        member that left loses its round."""
        due = [p for p in self.pending if p.apply_at <= tick]
        self.pending = [p for p in self.pending if p.apply_at > tick]
        for r in due:
            if r.outcome.committed:
                self.swarm[r.fragment].apply_round(r.outcome, r.plain)
            for m in self.learners:
                sync = m.syncs[r.fragment]
                if not m.alive:
                    if m.idx in r.members:
                        sync.abandon()
                    continue
                if m.idx in r.members:
                    finished = sync.finished(tick, min_age_steps=0)
                    if finished is None:
                        raise RuntimeError(f"learner {m.idx} fragment {r.fragment}: its round is not in its slot")
                    sync.apply_round(finished.future.result(), r.plain)
                elif r.outcome.committed:
                    sync.start_fetch()
                    fetched = sync.finished(tick, min_age_steps=0)
                    if fetched is None:
                        raise RuntimeError(f"fragment {r.fragment}: the swarm record did not answer at once")
                    sync.apply_fetched(fetched.future.result())

    def _handle_events(self, tick: int) -> None:
        while self.events and self.events[0].tick <= tick:
            ev = self.events.pop(0)
            learner = self.learners[ev.learner]
            if ev.kind == "leave":
                learner.alive = False
            elif ev.kind == "join":
                learner.reset_from(self.swarm)
                learner.alive = True
            else:
                raise ValueError(f"unknown event kind {ev.kind!r}")

    def _evaluate(self) -> None:
        tokens = sum(m.tokens for m in self.learners)
        if self.eval_model is not self.global_model:
            load_into(dict(self.eval_model.named_parameters()), self.anchor)
        loss = evaluate_on(self.eval_model, self.eval_set, self.device)
        self.result.curve.append({"tokens": tokens, "eval_loss": loss})

    def run(self, progress: bool = False) -> SimResult:
        t0 = time.monotonic()
        self._evaluate()
        for tick in range(1, self.ticks + 1):
            self._handle_events(tick)
            for m in self.learners:
                if m.alive:
                    m.tick()
            self._apply_due(tick)  # results of rounds sent tau ticks ago
            for f in self.schedule.due(tick):
                self._start_round(f, tick)
            self._apply_due(tick)  # tau = 0: apply at once
            if tick % self.eval_every == 0 and tick < self.ticks:
                self._evaluate()
                if progress:
                    progress_line(f"sim tick {tick}/{self.ticks} eval_loss {self.result.curve[-1]['eval_loss']:.3f}")
        # final flush: pending results, then every live learner's remaining progress
        self._apply_due(self.ticks + self.cfg.outer.overlap)
        for f in range(len(self.fragments)):
            self._start_round(f, self.ticks, final=True)
        self._apply_due(self.ticks)
        self._evaluate()
        r = self.result
        r.final_eval_loss = r.curve[-1]["eval_loss"]
        r.tokens = sum(m.tokens for m in self.learners)
        r.token_shares = [m.tokens / max(1, r.tokens) for m in self.learners]
        r.dp_fp32_bytes = dp_fp32_bytes(r.tokens, self.cfg, self.n_params)
        r.wall_s = time.monotonic() - t0
        return r


def dp_fp32_bytes(tokens: int, cfg: Config, n_params: int, learners: int | None = None) -> float:
    """Bytes K data-parallel workers send all-reducing fp32 gradients every step for ``tokens``
    (K = ``learners``, by default ``sim.learners``)."""
    k = learners or cfg.sim.learners
    steps = tokens / (k * cfg.inner.batch_size * cfg.model.block_size)
    return steps * 2 * (k - 1) * 4 * n_params


def run_reference(cfg: Config, splits: data.TrainingData, mode: str, eval_points: int = 10, progress: bool = False,
                  device: torch.device = CPU) -> SimResult:
    """``data-parallel``: one replica with K x batch on all shards; ``single``: one learner on shard 0."""
    if mode not in ("data-parallel", "single"):
        raise ValueError(f"unknown reference mode {mode!r}")
    t0 = time.monotonic()
    k, i = cfg.sim.learners, cfg.inner
    batch = i.batch_size * k if mode == "data-parallel" else i.batch_size
    model = build_model(cfg.model, cfg.run.seed).to(device)
    opt = build_optimizer(model, i, device)
    # "single" sees exactly learner 0's batches, so DiLoCo with one learner, outer lr 1 and no
    # momentum reproduces it bit for bit (a test pins this)
    seed = cfg.run.seed * 1000 + (999 if mode == "data-parallel" else 0)
    it = splits.train_batches(None if mode == "data-parallel" else 0, batch, cfg.model.block_size, seed=seed)
    eval_set = data.eval_batches(splits.eval, cfg.data.eval_batches, cfg.data.eval_batch_size, cfg.model.block_size)
    result = SimResult(mode=mode, learners=k if mode == "data-parallel" else 1)
    every = max(1, i.total_steps // eval_points)
    tokens = 0
    result.curve.append({"tokens": 0, "eval_loss": evaluate_on(model, eval_set, device)})
    for step in range(i.total_steps):
        x, y = next(it)
        train_step(model, opt, (x, y), step, i.total_steps, i, device)
        tokens += x.numel()
        if (step + 1) % every == 0 or step + 1 == i.total_steps:
            result.curve.append({"tokens": tokens, "eval_loss": evaluate_on(model, eval_set, device)})
            if progress:
                progress_line(f"{mode} step {step + 1}/{i.total_steps} eval_loss {result.curve[-1]['eval_loss']:.3f}")
    result.final_eval_loss = result.curve[-1]["eval_loss"]
    result.tokens = tokens
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "data-parallel":
        result.bytes_sent = result.dp_fp32_bytes = dp_fp32_bytes(tokens, cfg, n_params)
    result.wall_s = time.monotonic() - t0
    return result


def run(cfg: Config, splits: data.TrainingData, mode: str = "diloco", events: Sequence[Event] = (),
        eval_points: int = 10, progress: bool = False, attack: Attack | None = None,
        device: torch.device = CPU) -> SimResult:
    if mode == "diloco":
        return Simulator(cfg, splits, events, eval_points, attack=attack, device=device).run(progress)
    if attack is not None:
        raise ValueError(f"an attack needs the diloco mode, not {mode!r}")
    return run_reference(cfg, splits, mode, eval_points, progress, device)


def run_from_config(cfg: Config, mode: str = "diloco", data_path: str | None = None, progress: bool = False,
                    device: torch.device = CPU) -> SimResult:
    splits = data.load_training_data(cfg, cfg.sim.learners, data_path)
    return run(cfg, splits, mode, progress=progress, device=device)


def evaluate_on(model: torch.nn.Module, eval_set: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """:func:`p2p_diloco.core.data.evaluate` on ``device`` (the CPU batches moved there), fp32, without autograd."""
    if device.type != "cpu":
        eval_set = [(x.to(device), y.to(device)) for x, y in eval_set]
    with torch.no_grad():
        return data.evaluate(model, eval_set)


def progress_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
