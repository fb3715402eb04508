"""What the engine refuses (issue 49): every bad argument of :class:`p2p_diloco.DiLoCo` -- ``step``'s tokens and
loss, a model or optimizer it cannot train, a state dict to restore -- raises one line naming it, before it touches
the fragments, our counts or the wire; a restore that fails applies nothing. On the unit engine of
``test_engine.py`` (fragment averagers that commit a group of one)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from p2p_diloco import build_model, load_config
from p2p_diloco.averaging.decisions import RoundMeta
from p2p_diloco.core.config import Config
from p2p_diloco.engine import checks

from test_engine import OVERRIDES, engine, train
from p2p_diloco import training_batches


@pytest.fixture
def cfg() -> Config:
    return load_config("llama-tiny", OVERRIDES)


def one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(e.value)
    assert "\n" not in text and text
    return text


@pytest.mark.parametrize(("tokens", "error", "expected"), [
    (1.5, TypeError, "tokens must be a non-negative int, got float 1.5"),
    (2.0, TypeError, "got float"),
    (True, TypeError, "got bool"),
    ("12", TypeError, "got str"),
    (torch.tensor(3.0), TypeError, "got Tensor"),
    (-5, ValueError, "tokens must be a non-negative int, got -5"),
    (2**64, ValueError, "non-negative int"),
])
def test_step_refuses_tokens_that_are_not_a_non_negative_int_before_counting_them(
        cfg: Config, tokens: Any, error: type[Exception], expected: str) -> None:
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    for d in engine(cfg, model, opt):
        with pytest.raises(error, match=expected) as e:
            d.step(tokens=tokens)
        one_line(e)
        assert d.inner_step == 0 and d.tokens == 0 and all(s.since_tokens == 0 for s in d.slots)
        d.step(tokens=np.int64(7))  # any integer with __index__
        d.step(tokens=torch.tensor(5))
        assert d.tokens == 12 and type(d.tokens) is int and all(type(s.since_tokens) is int for s in d.slots)


@pytest.mark.parametrize(("loss", "error", "expected"), [
    (torch.tensor([1.0, 2.0]), ValueError, r"loss must be a scalar \(a tensor of one element\), got a tensor of shape"),
    ("0.5", TypeError, "loss must be a number, a scalar tensor or None, got str"),
    ([1.0], TypeError, "got list"),
    (True, TypeError, "got bool"),
])
def test_step_refuses_a_loss_that_is_not_a_scalar(cfg: Config, loss: Any, error: type[Exception], expected: str) -> None:
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    for d in engine(cfg, model, opt):
        with pytest.raises(error, match=expected) as e:
            d.step(tokens=10, loss=loss)
        one_line(e)
        assert d.inner_step == 0 and d.loss is None
        for fine in (torch.tensor(2.5), torch.tensor([[1.5]]), 3, np.float32(0.25), float("nan")):
            d.step(tokens=1, loss=fine)
        assert d.latest_loss() is None  # NaN: shown as none, as records do
        d.step(tokens=1, loss=torch.tensor([[1.5]]))
        assert d.latest_loss() == 1.5  # what the status thread publishes


def test_our_round_metadata_is_checked_by_the_peers_rule_before_it_is_sent() -> None:
    good = RoundMeta(fragment=0, version=3, anchor="ab" * 8, config="cd" * 8, tokens=2561, steps=4, weight=1.0,
                     due=10.0)
    good.check_outgoing()
    for bad in ({"tokens": 2561.5}, {"tokens": -1}, {"steps": True}, {"weight": float("nan")}):
        with pytest.raises(ValueError, match="our round metadata would be refused by every peer: gathered") as e:
            RoundMeta(**{**good.__dict__, **bad}).check_outgoing()
        one_line(e)


def test_an_optimizer_that_does_not_step_every_parameter_is_refused(cfg: Config) -> None:
    model = build_model(cfg)
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"optimizer: it does not step 1 of the model's \d+ parameters \(e.g. ") as e:
        next(engine(cfg, model, torch.optim.AdamW(params[1:], lr=1e-3)))
    one_line(e)
    other = build_model(cfg)
    with pytest.raises(ValueError, match="build it over model.parameters"):
        next(engine(cfg, model, torch.optim.AdamW(other.parameters(), lr=1e-3)))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        next(engine(cfg, model, object()))
    split = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-4}], lr=1e-3)
    next(engine(cfg, model, split)).close()  # parameter groups are fine


def test_frozen_parameters_are_refused(cfg: Config) -> None:
    model = build_model(cfg)
    name, frozen = next(iter(model.named_parameters()))
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match=f"1 parameter\\(s\\) do not require grad \\(e.g. {name}\\).*not supported") as e:
        next(engine(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    one_line(e)


def test_a_bf16_model_at_the_runs_start_is_accepted_and_keeps_the_runs_fp32_anchors(cfg: Config) -> None:
    fp32 = build_model(cfg)
    reference = next(engine(cfg, fp32, torch.optim.AdamW(fp32.parameters())))
    hashes = reference.anchor_hashes
    reference.close()
    model = build_model(cfg).to(torch.bfloat16)
    d = next(engine(cfg, model, torch.optim.AdamW(model.parameters())))
    assert d.anchor_hashes == hashes  # the same first anchors as every fp32 peer
    d.close()
    with torch.no_grad():
        next(iter(model.parameters())).add_(1.0)
    with pytest.raises(ValueError, match="is not the run's seeded start"):
        next(engine(cfg, model, torch.optim.AdamW(model.parameters())))


def trained_state(cfg: Config) -> tuple[dict[str, Any], Any]:
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    gen = engine(cfg, model, opt)
    d = next(gen)
    train(d, model, opt, training_batches(cfg, seed=1), steps=8)
    assert all(s.state.momentum for s in d.slots)
    return d.state_dict(), gen


def bad_states(state: dict[str, Any]) -> list[tuple[str, dict[str, Any], type[Exception], str]]:
    """(what, a state broken in its last fragment or its counts, the error, its message)."""
    last = len(state["fragments"]) - 1
    name = sorted(state["fragments"][last]["anchor"])[-1]

    def frag(**changes: Any) -> dict[str, Any]:
        s = copy.deepcopy(state)
        s["fragments"][last].update(changes)
        return s

    anchor, momentum = state["fragments"][last]["anchor"], state["fragments"][last]["momentum"]
    mname = sorted(momentum)[-1]
    return [
        ("shape", frag(anchor={**anchor, name: torch.zeros(3)}), ValueError, f"{name}: shape \\(3,\\), the model's"),
        ("dtype", frag(anchor={**anchor, name: anchor[name].double()}), ValueError, "must be float32"),
        ("nan anchor", frag(anchor={**anchor, name: anchor[name].clone().fill_(float("nan"))}), ValueError,
         "not finite"),
        ("not a tensor", frag(anchor={**anchor, name: [1.0]}), TypeError, "must be a tensor, got list"),
        ("other names", frag(anchor={**anchor, "nope": anchor[name]}), ValueError, "'nope', not a parameter"),
        ("missing name", frag(anchor={k: v for k, v in anchor.items() if k != name}), ValueError, "other tensors"),
        ("bad momentum", frag(momentum={**momentum, mname: momentum[mname].clone().fill_(float("inf"))}), ValueError,
         "momentum .*not finite"),
        ("momentum of another fragment", frag(momentum={**momentum, sorted(state["fragments"][0]["anchor"])[0]:
                                                        state["fragments"][0]["anchor"][sorted(
                                                            state["fragments"][0]["anchor"])[0]]}),
         ValueError, "momentum holds a tensor not of this fragment"),
        ("version", frag(version=-7), ValueError, f"fragment {last} version must be a non-negative int, got -7"),
        ("float version", frag(version=2.0), TypeError, "version must be a non-negative int, got float"),
        ("since_tokens", frag(since_tokens=-100), ValueError, "since_tokens must be a non-negative int, got -100"),
        ("since_steps", frag(since_steps="3"), TypeError, "since_steps must be a non-negative int"),
        ("momentum None", frag(momentum=None), TypeError, "momentum must map names to tensors"),
        ("step", {**state, "step": -1}, ValueError, "step must be a non-negative int"),
        ("tokens", {**state, "tokens": 1.5}, TypeError, "tokens must be a non-negative int"),
        ("no fragments key", {k: v for k, v in state.items() if k != "fragments"}, ValueError, "missing fragments"),
        ("fragments a dict", {**state, "fragments": {0: 1}}, TypeError, "fragments must be a list"),
        ("a fragment a list", {**state, "fragments": [*state["fragments"][:last], [1, 2]]}, TypeError,
         f"fragment {last} must be a mapping"),
        ("fragment keys", {**state, "fragments": [*state["fragments"][:last], {"version": 1}]}, ValueError,
         "missing anchor, momentum, since_steps, since_tokens"),
        ("a list", [1, 2], TypeError, "state_dict must be a mapping"),
    ]


def test_load_state_dict_checks_the_whole_state_first_and_then_applies_every_fragment_or_none(cfg: Config) -> None:
    state, gen = trained_state(cfg)
    gen.close()
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    for d in engine(cfg, model, opt):
        before = (d.versions, d.anchor_hashes, d.inner_step, d.tokens,
                  [(s.since_tokens, s.since_steps, dict(s.state.momentum)) for s in d.slots])
        for what, bad, error, expected in bad_states(state):
            with pytest.raises(error, match=expected) as e:
                d.load_state_dict(bad)
            one_line(e)
            after = (d.versions, d.anchor_hashes, d.inner_step, d.tokens,
                     [(s.since_tokens, s.since_steps, dict(s.state.momentum)) for s in d.slots])
            assert after == before, f"{what}: a refused state changed the engine"
        d.load_state_dict(state)  # the good one still loads, and is copied, not aliased
        assert d.versions == [f["version"] for f in state["fragments"]] and d.inner_step == state["step"]
        name = next(iter(state["fragments"][0]["anchor"]))
        state["fragments"][0]["anchor"][name].add_(1.0)
        assert not torch.equal(d.slots[0].anchor[name], state["fragments"][0]["anchor"][name])


def test_check_count_and_check_loss_are_pure() -> None:
    assert checks.check_count(np.uint8(3), "n") == 3
    assert checks.check_loss(None) is None and checks.check_loss(2) == 2.0
    with pytest.raises(TypeError, match="n must be a non-negative int, got NoneType"):
        checks.check_count(None, "n")


@pytest.mark.parametrize(("kwargs", "error", "expected"), [
    ({"linger_s": -5}, ValueError, r"SyncOptions.linger_s must be a finite number of seconds >= 0, got -5"),
    ({"status_period_s": 0}, ValueError, r"status_period_s must be a finite number of seconds > 0"),
    ({"view_period_s": float("inf")}, ValueError, "view_period_s must be a finite"),
    ({"serve_s": "10"}, TypeError, "serve_s must be a number of seconds, got str"),
    ({"wait_peers": 1.5}, TypeError, "wait_peers must be an int, got float"),
    ({"wait_peers": -1}, ValueError, "wait_peers must be >= 0"),
    ({"blocking": 1}, TypeError, "blocking must be a bool"),
    ({"events_path": 3}, TypeError, "events_path must be a path or None"),
    ({"metrics": ["tensorboard:x"]}, TypeError, "metrics must be a tuple of MetricsSpec"),
])
def test_sync_options_refuse_what_is_out_of_type_or_range(kwargs: dict[str, Any], error: type[Exception],
                                                          expected: str) -> None:
    from p2p_diloco import SyncOptions

    with pytest.raises(error, match=expected) as e:
        SyncOptions(**kwargs)
    one_line(e)
    assert SyncOptions(events_path="e.jsonl").events_path == Path("e.jsonl")  # type: ignore[arg-type]
