"""The engine of the public API (:class:`p2p_diloco.DiLoCo`) around a plain PyTorch loop, without a network: the
fragment averagers are stand-ins whose rounds commit at once with our own pseudo-gradient as the group's (a group
of one), so every outer step, state dict and event is the real one. The swarm of a real join is in
``tests/integration/test_api_examples.py``."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

from p2p_diloco import DiLoCo, SyncOptions, Swarm, build_model, events, load_config, training_batches
from p2p_diloco.averaging.plans import RoundOutcome, RoundPlan
from p2p_diloco.core import outer
from p2p_diloco.core.config import Config
from p2p_diloco.core.identity import config_hash
from p2p_diloco.transport import hivemind
from p2p_diloco.sync.fragment import Contribution

OVERRIDES = ["outer.sync_every=4", "outer.fragments=2", "averaging.schedule=steps", "inner.batch_size=4"]


class GroupOfOne:
    """A fragment averager whose every round commits at once with the sender's own pseudo-gradient."""

    prefix = "run_f0"

    def __init__(self, cfg: Config, index: int, *_args: Any, **_kwargs: Any) -> None:
        self.cfg, self.index = cfg, index
        self.vouched: list[tuple[int, str]] = []
        self.kept: list[Any] = []

    def start_background(self) -> None: ...
    def wait_ready(self, timeout_s: float) -> None: ...
    def cancel(self) -> None: ...
    def shutdown(self) -> None: ...

    def vouch(self, version: int, anchor: str) -> None:
        self.vouched.append((version, anchor))

    def keep_round(self, kept: Any) -> None:
        self.kept.append(kept)

    def bytes_total(self) -> tuple[int, int]:
        return 0, 0

    def start_round(self, contribution: Contribution, plan: RoundPlan) -> Future[RoundOutcome]:
        c = contribution
        merged = outer.decode_merged(c.tensors, [c.norms], [c.weight], self.cfg.outer.merge)
        done: Future[RoundOutcome] = Future()
        done.set_result(RoundOutcome(fragment=self.index, version=c.version, committed=True, reason="a group of one",
                                     group_size=1, own_share=1.0, weights=(c.weight,), finished_at=time.monotonic(),
                                     merged=merged))
        return done


@pytest.fixture
def cfg() -> Config:
    return load_config("llama-tiny", OVERRIDES)


def fake_swarm(cfg: Config, name: str = "me") -> SimpleNamespace:
    joined = SimpleNamespace(dht=None, private_key=None, peer_id=f"peer-{name}", name=name, snapshot=None,
                             publisher=SimpleNamespace(update=lambda **_kw: None))
    local = SimpleNamespace(run_id=cfg.run.run_id, config_hash=config_hash(cfg))
    return SimpleNamespace(config=cfg, joined=joined, local=local, membership=None)


def averagers(d: DiLoCo) -> list[GroupOfOne]:
    """The stand-in averagers behind ``d``'s hosts (:class:`~p2p_diloco.transport.hivemind.AveragerLink`\\ s)."""
    return [h.averager for h in d.rounds.hosts]  # type: ignore[attr-defined]


def engine(cfg: Config, model: torch.nn.Module, opt: Any, **kwargs: Any) -> Iterator[DiLoCo]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hivemind, "FragmentAveragerHost", GroupOfOne)
        d = DiLoCo(model, opt, fake_swarm(cfg), **kwargs)  # type: ignore[arg-type]
    d.view.swarm_reads = 1  # as if the status thread had looked at the swarm (none here): rounds are handed off
    d.training = True  # start() reads the DHT; there is none
    yield d
    d.close()


def train(d: DiLoCo, model: torch.nn.Module, opt: Any, batches: Iterator[Any], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        d.step(tokens=x.numel(), loss=loss.detach())
        losses.append(float(loss.detach()))
    return losses


def test_a_plain_loop_commits_rounds_and_its_state_dict_restores_into_another_engine(cfg: Config) -> None:
    torch.set_num_threads(1)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    heard: list[events.Event] = []
    for d in engine(cfg, model, opt):
        d.subscribe(heard.append)
        losses = train(d, model, opt, training_batches(cfg, seed=1), steps=24)
        assert d.inner_step == 24 and d.tokens == 24 * cfg.inner.batch_size * cfg.model.block_size
        assert all(v >= 4 for v in d.versions), d.versions  # 24 steps, a fragment every 2: 5-6 rounds each
        assert losses[-1] < losses[0]
        rounds_heard = [e for e in heard if isinstance(e, events.RoundEvent)]
        assert len(rounds_heard) == sum(d.versions) and all(e.outcome == "committed" for e in rounds_heard)
        assert [e.to_json() for e in d.poll_events()] == [e.to_json() for e in heard] and d.poll_events() == []
        state, hashes, versions = d.state_dict(), d.anchor_hashes, d.versions
        anchors = d.anchors()
    other_model = build_model(cfg)
    other_model.load_state_dict(model.state_dict())
    other_opt = torch.optim.AdamW(other_model.parameters(), lr=cfg.inner.lr)
    for d2 in engine(cfg, other_model, other_opt, check_model=False):
        d2.load_state_dict(state)
        assert (d2.versions, d2.anchor_hashes, d2.inner_step) == (versions, hashes, 24)
        assert all(torch.equal(anchors[n], t) for n, t in d2.anchors().items())
        assert all(h.vouched[-1] == (v, a) for h, v, a in zip(averagers(d2), versions, hashes))
        with pytest.raises(ValueError, match="config hash"):
            d2.load_state_dict({**state, "config_hash": "0" * 16})


def test_a_model_that_is_not_the_runs_seeded_start_is_refused(cfg: Config) -> None:
    model = build_model(cfg)
    with torch.no_grad():
        next(iter(model.parameters())).add_(1e-3)
    with pytest.raises(ValueError, match=r"is not the run's seeded start.*p2p_diloco.build_model") as e:
        next(engine(cfg, model, torch.optim.AdamW(model.parameters())))
    assert "\n" not in str(e.value)
    for change, expected in (("model.hf_config.hidden_size=32", r"has shape \(256, 32\), the run's model \(256, 64\)"),
                             ("model.hf_config.num_hidden_layers=1", "parameters are not the run's model")):
        other = build_model(load_config("llama-tiny", [*OVERRIDES, "outer.fragments=1", change]))
        with pytest.raises(ValueError, match=expected):
            next(engine(cfg, other, torch.optim.AdamW(other.parameters())))


def test_blocking_options_and_an_engine_used_as_a_context_manager(cfg: Config) -> None:
    """``with DiLoCo(...)``: leaving the block finishes (final rounds for unsynced progress, then the linger)."""
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    gen = engine(cfg, model, opt, options=SyncOptions(linger_s=0.0, status_period_s=0.01))
    d = next(gen)
    with d:
        train(d, model, opt, itertools.cycle(list(itertools.islice(training_batches(cfg, seed=2), 3))), steps=3)
        before = list(d.versions)
        assert any(s.since_steps > 0 for s in d.slots)
    assert d.finished and d.closed
    with pytest.raises(RuntimeError, match="after finish"):
        d.step(tokens=1)
    assert all(s.since_steps == 0 for s in d.slots) and sum(d.versions) > sum(before)
    gen.close()


@pytest.mark.parametrize(("peers", "kwargs", "expected"), [
    (["/ip4/127.0.0.1/tcp/1/p2p/nonsense"], {}, "initial_peers"),
    (["not an address"], {}, "initial_peers"),
    (["/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWG2rGRLwZHVBC2UGmDu2NUmW4JmQtR8jn7vaiURxKPUVK"], {"join_timeout_s": 0},
     "join_timeout_s"),
    (["/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWG2rGRLwZHVBC2UGmDu2NUmW4JmQtR8jn7vaiURxKPUVK"],
     {"announce": ["/ip4/10.0.0.1/tcp/4000"]}, "announce needs a fixed port"),
])
def test_swarm_join_refuses_bad_input_in_one_line_before_starting_anything(cfg: Config, peers: list[str],
                                                                           kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match=expected) as e:
        Swarm.join(peers, cfg, **kwargs)
    assert "\n" not in str(e.value)
