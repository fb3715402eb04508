"""The tests of ``tests/unit/test_robust_merge.py`` that start real DHTs, averagers or processes (the integration
tier); the rest, and the helpers they share, are there."""

from __future__ import annotations

from pathlib import Path
import pytest
import torch
from averagers import averaging_swarm
from p2p_diloco.core import outer
from p2p_diloco.sim import simulator as sim
from p2p_diloco.core.config import load_config
from test_robust_merge import NAMES, SHAPES, _distance, _run_round

pytestmark = pytest.mark.integration


def test_a_poisoned_sender_in_a_real_all_reduce_is_bounded_and_everyone_agrees(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.run_id=poison", "model.n_layer=2", "outer.fragments=2", "outer.merge=\"radial\"",
                             "outer.codec=\"fp32\"", "outer.robust=\"trim\"", "averaging.window_s=1.0",
                             "averaging.commit_timeout_s=3.0", "averaging.next_chunk_timeout_s=2.0",
                             "averaging.allreduce_timeout_s=10.0"])
    gen = torch.Generator().manual_seed(0)
    common = {n: torch.randn(SHAPES[n], generator=gen) for n in NAMES}
    deltas = [{n: t + 0.7 * torch.randn(t.shape, generator=gen) for n, t in common.items()} for _ in range(3)]
    encoded = [outer.encode_contribution(d, "radial") for d in deltas]
    encoded[2] = sim.poison(*encoded[2], sim.Attack(2, "sign-flip"), gen)  # -1000x directions, 1000x norms
    from p2p_diloco.averaging.runner import ExactAllReduceRunner

    with averaging_swarm(tmp_path, cfg, NAMES, SHAPES, (ExactAllReduceRunner,) * 3) as peers:
        outcomes = _run_round(peers, encoded, cfg)
    assert all(o.committed and o.group_size == 3 for o in outcomes), [o.reason for o in outcomes]
    merged = [o.merged for o in outcomes]
    assert merged[0] is not None
    reference = outer.merge_pseudo_gradients(deltas[:2], [1.0, 1.0], "radial")
    for n in NAMES:
        assert all(m is not None and torch.equal(m[n], merged[0][n]) for m in merged), n  # bit-identical
        # median of three norms: the attacker's 1000x is capped, then trimmed away
        honest_norms = sorted(float(deltas[i][n].norm()) for i in range(2))
        assert honest_norms[0] * 0.999 <= float(merged[0][n].norm()) <= honest_norms[1] * 1.001
    distance = _distance(merged[0], reference)
    print(f"poisoned all-reduce: distance to the two honest members' merge {distance:.3f}")
    assert distance < 0.5

