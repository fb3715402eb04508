"""Golden values for the outer step: weights, merges, Nesterov, alpha-mixing, rebase."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.core import outer


def test_contribution_weights() -> None:
    assert outer.contribution_weight(1000, 10, "tokens") == 1000.0
    assert outer.contribution_weight(1000, 10, "tokens2") == 100_000.0
    assert outer.contribution_weight(1000, 10, "uniform") == 1.0
    assert outer.contribution_weight(0, 0, "tokens2") == 0.0
    with pytest.raises(ValueError, match="unknown weighting"):
        outer.contribution_weight(1, 1, "flops")


def test_all_zero_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="all contribution weights are zero"):
        outer.weighted_mean([torch.ones(2), torch.ones(2)], [0.0, 0.0])
    with pytest.raises(ValueError, match="non-negative"):
        outer.weighted_mean([torch.ones(2)], [float("nan")])


def test_weighted_mean_golden() -> None:
    out = outer.weighted_mean([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 4.0])], [3, 1])
    assert torch.allclose(out, torch.tensor([0.75, 1.0]))


def test_radial_directional_golden() -> None:
    a = {"blocks.0.w": torch.tensor([3.0, 0.0]), "wte.weight": torch.tensor([2.0, 2.0])}
    b = {"blocks.0.w": torch.tensor([0.0, 1.0]), "wte.weight": torch.tensor([0.0, 0.0])}
    merged = outer.merge_pseudo_gradients([a, b], [1.0, 1.0], "radial")
    # norms 3 and 1 -> mean norm 2; unit directions (1,0),(0,1) -> mean (.5,.5) -> unit (1,1)/sqrt2
    assert torch.allclose(merged["blocks.0.w"], torch.tensor([2 / math.sqrt(2), 2 / math.sqrt(2)]))
    assert torch.allclose(merged["wte.weight"], torch.tensor([1.0, 1.0]))  # embeddings: plain mean
    plain = outer.merge_pseudo_gradients([a, b], [1.0, 1.0], "mean")
    assert torch.allclose(plain["blocks.0.w"], torch.tensor([1.5, 0.5]))


def test_radial_weighted_and_zero_contribution() -> None:
    a = {"blocks.0.w": torch.tensor([4.0, 0.0])}
    z = {"blocks.0.w": torch.tensor([0.0, 0.0])}
    merged = outer.merge_pseudo_gradients([a, z], [3.0, 1.0], "radial")
    # mean norm 3*4/4 + 0 = 3, direction (1,0): a zero delta adds no direction and no NaN
    assert torch.allclose(merged["blocks.0.w"], torch.tensor([3.0, 0.0]))


def test_radial_encode_decode_equals_reference() -> None:
    torch.manual_seed(0)
    deltas = [{"blocks.1.w": torch.randn(5, 3), "wpe.weight": torch.randn(4)} for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    enc = [outer.encode_contribution(d, "radial") for d in deltas]
    assert all(abs(float(e[0]["blocks.1.w"].norm()) - 1) < 1e-6 for e in enc)
    avg = {n: outer.weighted_mean([e[0][n] for e in enc], weights) for n in deltas[0]}
    got = outer.decode_merged(avg, [e[1] for e in enc], weights, "radial")
    ref = outer.merge_pseudo_gradients(deltas, weights, "radial")
    for n in ref:
        assert torch.allclose(got[n], ref[n])
    mean_norm = sum(w * float(d["blocks.1.w"].norm()) for w, d in zip(weights, deltas)) / sum(weights)
    assert abs(float(got["blocks.1.w"].norm()) - mean_norm) < 1e-5


def test_nesterov_matches_torch_sgd() -> None:
    torch.manual_seed(1)
    anchor = {"w": torch.randn(4, 3)}
    ref = torch.nn.Parameter(anchor["w"].clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    state = outer.OuterState()
    for _ in range(4):
        g = torch.randn(4, 3)
        outer.nesterov_step(anchor, {"w": g}, state, lr=0.7, momentum=0.9)
        ref.grad = g.clone()
        opt.step()
    assert torch.allclose(anchor["w"], ref.detach(), atol=1e-6)
    assert state.version == 4


def test_nesterov_golden_two_steps() -> None:
    anchor = {"w": torch.tensor([1.0])}
    state = outer.OuterState()
    outer.nesterov_step(anchor, {"w": torch.tensor([1.0])}, state, lr=0.5, momentum=0.5)
    # buf = 1; step = 1 + .5*1 = 1.5; w = 1 - .75
    assert torch.allclose(anchor["w"], torch.tensor([0.25]))
    outer.nesterov_step(anchor, {"w": torch.tensor([1.0])}, state, lr=0.5, momentum=0.5)
    # buf = .5 + 1 = 1.5; step = 1 + .75 = 1.75; w = .25 - .875
    assert torch.allclose(anchor["w"], torch.tensor([-0.625]))


def test_nesterov_refuses_bad_gradients_without_touching_state() -> None:
    anchor = {"w": torch.zeros(2)}
    state = outer.OuterState()
    with pytest.raises(ValueError, match="not finite"):
        outer.nesterov_step(anchor, {"w": torch.tensor([1.0, float("inf")])}, state, 0.7, 0.9)
    with pytest.raises(ValueError, match="shape"):
        outer.nesterov_step(anchor, {"w": torch.zeros(3)}, state, 0.7, 0.9)
    with pytest.raises(ValueError, match="names"):
        outer.nesterov_step(anchor, {"v": torch.zeros(2)}, state, 0.7, 0.9)
    assert state.version == 0 and not state.momentum and torch.equal(anchor["w"], torch.zeros(2))


def test_alpha_mix_and_rebase() -> None:
    local = {"w": torch.tensor([4.0])}
    outer.alpha_mix(local, {"w": torch.tensor([0.0])}, 0.25)
    assert torch.allclose(local["w"], torch.tensor([1.0]))
    local = {"w": torch.tensor([5.0])}
    outer.rebase(local, {"w": torch.tensor([3.0])}, {"w": torch.tensor([10.0])})
    assert torch.allclose(local["w"], torch.tensor([12.0]))  # kept its +2 of progress
