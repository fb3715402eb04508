"""Poisoned contributions: the robust merge's golden values, an attacker's bounded influence, the
local check, that ``outer.robust = "none"`` is the old merge, and one real hivemind all-reduce with a
poisoned sender (3 DHTs + 3 fragment averagers on 127.0.0.1, in-process)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_diloco.hivemind_ext import compression
from p2p_diloco.core import data, outer
from p2p_diloco.sim import simulator as sim
from p2p_diloco.core.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CLIP = outer.Robust(clip_factor=2.0)
TRIM = outer.Robust(clip_factor=2.0, trim=True)


# ---------------------------------------------------------------- golden values


def test_clip_to_median_golden() -> None:
    assert outer.clip_to_median([1.0, 2.0, 3.0, 1000.0], 2.0) == [1.0, 2.0, 3.0, 4.0]  # lower median 2 -> cap 4
    assert outer.clip_to_median([1.0, 1000.0], 2.0) == [1.0, 2.0]  # a pair: the larger is bounded by the smaller
    assert outer.clip_to_median([5.0, 1000.0], 0.0) == [5.0, 1000.0]  # off
    with pytest.raises(ValueError, match="finite"):
        outer.clip_to_median([1.0, float("inf")], 2.0)


def test_clip_contributions_golden() -> None:
    parts = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 1.0]), torch.tensor([float("nan"), 0.0]),
             torch.tensor([30.0, 40.0])]
    clipped, weights = outer.clip_contributions(parts, [1.0, 2.0, 3.0, 4.0], 2.0)
    # finite norms 5, 1, 50 -> lower median 5 -> cap 10; the NaN part is left out
    assert [t.tolist() for t in clipped] == [[3.0, 4.0], [0.0, 1.0], [0.0, 0.0], [6.0, 8.0]]
    assert weights == [1.0, 2.0, 0.0, 4.0]


def test_trimmed_mean_golden() -> None:
    parts = [torch.tensor([1.0, -5.0]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0]), torch.tensor([100.0, 2.0])]
    assert outer.trimmed_mean(parts, [1.0] * 4, 1).tolist() == [2.5, 0.5]  # the middle two of each coordinate
    assert outer.trimmed_mean(parts, [1.0, 1.0, 3.0, 1.0], 1).tolist() == [2.75, 0.75]  # weighted
    assert outer.trimmed_mean(parts[:3], [1.0] * 3, 1).tolist() == [2.0, 0.0]  # three: the median
    assert [outer.trim_count(n) for n in (1, 2, 3, 4, 7, 8, 16)] == [0, 0, 1, 1, 1, 2, 4]
    with pytest.raises(ValueError, match="trim"):
        outer.trimmed_mean(parts[:2], [1.0, 1.0], 1)


def test_robust_mean_leaves_out_non_finite_parts_and_never_returns_nan() -> None:
    parts = [torch.tensor([1.0, 1.0]), torch.tensor([float("inf"), 0.0]), torch.tensor([3.0, 3.0])]
    # the inf part is left out; norms sqrt(2), 3 sqrt(2) -> cap 2 sqrt(2): (3, 3) -> (2, 2); mean of (1, 1), (2, 2)
    assert outer.robust_mean(parts, [1.0, 1.0, 1.0], CLIP).tolist() == pytest.approx([1.5, 1.5])
    nan = [torch.full((2,), float("nan"))] * 2
    assert outer.robust_mean(nan, [1.0, 1.0], TRIM).tolist() == [0.0, 0.0]


def test_decode_with_the_robust_rule_caps_weights_and_norms() -> None:
    averaged = {"blocks.0.w": torch.tensor([1.0, 0.0])}
    metas = [{"blocks.0.w": 1.0}, {"blocks.0.w": 2.0}, {"blocks.0.w": 3.0}, {"blocks.0.w": 1000.0}]
    weights = [1.0, 1.0, 1.0, 1000.0]
    # clip: weights -> 1, 1, 1, 2 (shares 1/5 .. 2/5); norms -> 1, 2, 3, 4: mean (1 + 2 + 3 + 8) / 5
    assert outer.decode_merged(averaged, metas, weights, "radial", CLIP)["blocks.0.w"].tolist() == \
        pytest.approx([14 / 5, 0.0])
    # trim: the middle two norms (2, 3) with weights 1, 1
    assert outer.decode_merged(averaged, metas, weights, "radial", TRIM)["blocks.0.w"].tolist() == \
        pytest.approx([2.5, 0.0])
    # none: the 1000x member dominates
    assert outer.decode_merged(averaged, metas, weights, "radial")["blocks.0.w"][0] > 900


def test_robust_rule_and_config_are_strict() -> None:
    assert outer.robust_rule("none", 2.0) == outer.NO_ROBUST and not outer.NO_ROBUST.active
    assert outer.robust_rule("trim", 3.0) == outer.Robust(3.0, trim=True)
    for key, value in (("outer.robust", "'median'"), ("outer.clip_factor", "0.5"), ("outer.clip_factor", "inf"),
                       ("outer.max_delta_ratio", "-1.0")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(ROOT / "configs" / "tiny.toml", [f"{key}={value}"])


# ---------------------------------------------------------------- an attacker's influence


def _honest(gen: torch.Generator, k: int = 3) -> list[dict[str, torch.Tensor]]:
    """Correlated pseudo-gradients, like learners that train the same model on different shards."""
    common = {"blocks.0.w": torch.randn(64, 32, generator=gen), "wte.weight": torch.randn(128, 16, generator=gen)}
    return [{n: t + 0.7 * torch.randn(t.shape, generator=gen) for n, t in common.items()} for _ in range(k)]


def _merge(deltas: list[dict[str, torch.Tensor]], attack: sim.Attack | None, merge: str,
           rule: outer.Robust) -> dict[str, torch.Tensor]:
    """encode -> (the last member poisons what it sends) -> robust reducers -> decode, whole tensors as parts."""
    encoded = [outer.encode_contribution(d, merge) for d in deltas]
    if attack is not None:
        encoded[-1] = sim.poison(*encoded[-1], attack, torch.Generator().manual_seed(1))
    weights = [1.0] * len(deltas)
    reducer_weights = outer.clip_to_median(weights, rule.clip_factor)
    averaged = {n: outer.robust_mean([e[0][n] for e in encoded], reducer_weights, rule) if rule.active
                else outer.weighted_mean([e[0][n] for e in encoded], weights) for n in deltas[0]}
    return outer.decode_merged(averaged, [e[1] for e in encoded], weights, merge, rule)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in b)) / math.sqrt(sum(float(b[n].pow(2).sum()) for n in b))


@pytest.mark.parametrize("merge", ["radial", "mean"])
@pytest.mark.parametrize("mode", ["sign-flip", "random"])
def test_one_attacker_in_four_is_bounded_by_the_trimmed_merge(merge: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    honest = _honest(gen)
    deltas = honest + [_honest(gen, 1)[0]]
    reference = outer.merge_pseudo_gradients(honest, [1.0] * 3, merge)  # the three honest members alone
    attack = sim.Attack(3, mode)
    trimmed = _distance(_merge(deltas, attack, merge, TRIM), reference)
    undefended = _distance(_merge(deltas, attack, merge, outer.NO_ROBUST), reference)
    clean = _distance(_merge(deltas, None, merge, TRIM), reference)
    print(f"{merge}/{mode}: distance to the honest merge: trim {trimmed:.3f}, clean+trim {clean:.3f}, "
          f"none {undefended:.1f}")
    assert undefended > 50  # the attack works without a defence
    assert trimmed < 0.5  # and is bounded with it: of the order of an honest member's own deviation
    assert trimmed < 1.5 * clean + 0.1


def test_robust_none_is_the_old_merge_in_the_simulator() -> None:
    """``outer.robust = "none"``: a simulated round is exactly hivemind's weighted mean (simulate_allreduce)
    decoded as before -- bit for bit."""
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["outer.robust=none"])
    splits = data.split_corpus(data.load_corpus(cfg.data), cfg.sim.learners, cfg.data.eval_fraction)
    s = sim.Simulator(cfg, splits)
    for _ in range(3):
        for m in s.learners:
            m.tick()
    names, members = s.fragments[0].names, s.learners
    weights = [outer.contribution_weight(m.since_tokens[0], m.since_steps[0], cfg.outer.weighting) for m in members]
    encoded = [outer.encode_contribution({n: s.anchor[n] - m.params[n].detach() for n in names}, cfg.outer.merge)
               for m in members]
    averaged = {n: compression.simulate_allreduce(cfg.outer.codec, [e[0][n] for e in encoded], weights) for n in names}
    expected = outer.decode_merged(averaged, [e[1] for e in encoded], weights, cfg.outer.merge)
    s._start_round(0, tick=3)  # every learner hands its progress off; the in-process reducer merges it at once
    assert len(s.pending) == 1 and s.pending[0].members == {m.idx for m in members}
    merged = s.pending[0].outcome.merged
    assert merged is not None and all(torch.equal(merged[n], expected[n]) for n in names)


# ---------------------------------------------------------------- the local check


def test_local_problem_golden() -> None:
    anchor = {"a": torch.tensor([3.0, 4.0])}
    assert outer.local_problem({"a": torch.tensor([0.3, 0.4])}, anchor, 10.0) is None
    assert "not finite" in outer.local_problem({"a": torch.tensor([float("nan"), 0.0])}, anchor, 0.0)
    assert "51 x the anchor" in outer.local_problem({"a": torch.tensor([153.0, 204.0])}, anchor, 10.0)
    assert outer.local_problem({"a": torch.tensor([153.0, 204.0])}, anchor, 0.0) is None  # no ratio bound
    assert outer.delta_ratio({"a": torch.tensor([0.6, 0.8])}, anchor) == pytest.approx(0.2)


def test_a_diverged_learner_drops_its_pseudo_gradient_and_re_anchors() -> None:
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    splits = data.split_corpus(data.load_corpus(cfg.data), cfg.sim.learners, cfg.data.eval_fraction)
    s = sim.Simulator(cfg, splits)
    for _ in range(2):
        for m in s.learners:
            m.tick()
    bad, names = s.learners[1], s.fragments[0].names
    with torch.no_grad():
        bad.params[names[0]].fill_(float("nan"))
    s._start_round(0, tick=2)
    assert s.result.local_drops == 1 and s.result.rounds == 1 and s.result.discarded_rounds == 0
    assert all(torch.equal(bad.params[n], s.anchor[n]) for n in names)  # re-anchored
    assert bad.since_steps[0] == 0 and bad.since_steps[1] == 2  # only that fragment's progress is dropped
    assert all(r.outcome.merged is not None and all(bool(torch.isfinite(p).all()) for p in r.outcome.merged.values())
               for r in s.pending)


# ---------------------------------------------------------------- a real all-reduce with a poisoned sender

NAMES = tuple(f"blocks.{i}.fc.weight" for i in range(6))
SHAPES = {n: torch.Size([64, 32]) for n in NAMES}
ROUND_DEADLINE_S = 60.0


def _run_round(peers: list[Any], encoded: list[tuple[dict[str, torch.Tensor], dict[str, float]]], cfg: Any) -> list[Any]:
    from hivemind.utils import get_dht_time

    from p2p_diloco.averaging.plans import RoundPlan
    from p2p_diloco.sync.fragment import Contribution

    start = get_dht_time() + cfg.averaging.window_s
    futures = []
    for peer, (sent, norms) in zip(peers, encoded):
        contribution = Contribution(fragment=0, version=0, anchor_hash="0" * 16, tokens=2560, steps=10, weight=2560.0,
                                    tensors=sent, norms=norms)
        futures.append(peer.start_round(contribution, RoundPlan(start, cfg.averaging.window_s, due=get_dht_time())))
    return [f.result(timeout=ROUND_DEADLINE_S) for f in futures]
