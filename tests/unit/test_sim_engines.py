"""The simulator as real engines (:mod:`p2p_diloco.sim.engines`): K :class:`p2p_diloco.DiLoCo` engines on the
in-process network, in lockstep. On the same config and data it is the tick simulator's run, round for round (the
engine's round policy and the hub's codec-exact reduction give the same anchors); with a learner killed and rejoining
it goes on, the newcomer downloads the swarm's anchors, and every live learner ends on the same anchors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from p2p_diloco.core import data, events
from p2p_diloco.core.config import Config, load_config
from p2p_diloco.sim import engines, simulator

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg() -> Config:
    return load_config(ROOT / "configs" / "tiny.toml", ["data.eval_batches=2"])


@pytest.fixture(scope="module")
def splits(cfg: Config) -> data.TrainingData:
    return data.load_training_data(cfg, cfg.sim.learners)


def test_the_engines_run_the_tick_simulators_rounds_and_reach_its_loss(cfg: Config, splits: data.TrainingData) -> None:
    torch.set_num_threads(1)
    tick = simulator.run(cfg, splits, eval_points=4)
    real = engines.run(cfg, splits, eval_points=4)
    print(f"tick: {tick.final_eval_loss:.6f}, {tick.rounds} rounds, {tick.bytes_sent:.0f} B; engines: "
          f"{real.final_eval_loss:.6f}, {real.rounds} rounds, {real.bytes_sent:.0f} B")
    assert real.rounds == tick.rounds > 0 and real.discarded_rounds == real.empty_rounds == 0
    assert math.isclose(real.final_eval_loss, tick.final_eval_loss, rel_tol=1e-5), (real.final_eval_loss,
                                                                                    tick.final_eval_loss)
    assert real.tokens == tick.tokens and real.contributed_tokens == tick.contributed_tokens
    assert math.isclose(real.bytes_sent, tick.bytes_sent, rel_tol=0.05)  # the tick sim adds the radial norms
    assert [len(c) for c in (real.curve, tick.curve)] == [len(tick.curve)] * 2


def test_learners_of_different_speeds_meet_at_the_clocks_boundaries_as_in_the_tick_simulator(
        cfg: Config, splits: data.TrainingData) -> None:
    """The driver's clock hands every live learner's due fragments off at the same tick whatever its speed; what
    still differs from the tick simulator is when a slow learner applies a result (``outer.overlap`` of its own
    steps, not ticks) and catches up (at its next step)."""
    torch.set_num_threads(1)
    mixed = load_config(ROOT / "configs" / "tiny.toml", ["data.eval_batches=2", "sim.speeds=[1.0, 0.5, 1.0]"])
    tick = simulator.run(mixed, splits, eval_points=4)
    real = engines.run(mixed, splits, eval_points=4)
    print(f"tick: {tick.final_eval_loss:.6f}, {tick.rounds} rounds; engines: {real.final_eval_loss:.6f}, "
          f"{real.rounds} rounds; shares {real.token_shares}")
    assert real.rounds == tick.rounds and real.tokens == tick.tokens
    assert real.token_shares[1] < real.token_shares[0]  # the slow learner made fewer tokens
    assert math.isclose(real.final_eval_loss, tick.final_eval_loss, rel_tol=0.005)


def test_a_learner_killed_and_rejoining_catches_up_and_everyone_ends_on_the_same_anchors(
        cfg: Config, splits: data.TrainingData) -> None:
    torch.set_num_threads(1)
    sim = engines.EngineSimulator(cfg, splits, [simulator.Event(12, 1, "leave"), simulator.Event(22, 1, "join")],
                                  eval_points=4)
    result = sim.run()
    live = [u for u in sim.units if u.alive]
    assert len(live) == 3
    assert len({tuple(u.diloco.anchor_hashes) for u in live}) == 1
    assert len({tuple(u.diloco.versions) for u in live}) == 1
    rejoined = sim.units[1].diloco.poll_events()
    caught_up = [e for e in rejoined if isinstance(e, events.ReplayEvent)
                 or isinstance(e, events.ResyncEvent) and e.outcome == "rebased"]
    assert caught_up, "the rejoined learner did not catch up with the swarm's anchors (a download or a replay)"
    during = [r for r in sim.hub.rounds if r.committed and "learner-1" not in r.members]
    assert during, "no round committed without the killed learner"
    assert math.isfinite(result.final_eval_loss) and result.final_eval_loss < result.curve[0]["eval_loss"]


def test_what_the_engines_do_not_simulate_yet_is_refused(cfg: Config) -> None:
    grid = ["averaging.groups=\"grid\"", "averaging.target_group_size=2", "averaging.schedule=\"clock\"",
            "averaging.sync_period_s=15.0", "outer.codec=\"fp32\""]
    for changes, what in ((grid, "grid"), (["outer.error_feedback=true"], "error_feedback")):
        other = load_config(ROOT / "configs" / "tiny.toml", changes)
        with pytest.raises(ValueError, match=what):
            engines.check_supported(other)


@pytest.mark.parametrize("mode", ["sign-flip", "random"])
def test_an_attacker_poisons_the_engines_rounds_as_it_does_the_tick_simulators(mode: str) -> None:
    """The poisoning benchmark's attacker, as the hub's tamper with what it sends (a fault from outside): with the
    clipped robust merge the run is the tick simulator's, to the bit."""
    torch.set_num_threads(1)
    robust = load_config(ROOT / "configs" / "tiny.toml", ["data.eval_batches=2", "outer.robust=\"clip\"",
                                                          "outer.clip_factor=2.0"])
    splits = data.load_training_data(robust, robust.sim.learners)
    attack = simulator.Attack(2, mode)
    tick = simulator.run(robust, splits, eval_points=2, attack=attack)
    real = engines.run(robust, splits, eval_points=2, attack=attack)
    honest = engines.run(robust, splits, eval_points=2)
    print(f"{mode}: tick {tick.final_eval_loss:.6f}, engines {real.final_eval_loss:.6f}, honest "
          f"{honest.final_eval_loss:.6f}")
    assert real.final_eval_loss == tick.final_eval_loss and real.rounds == tick.rounds
    assert real.final_eval_loss != honest.final_eval_loss  # the attack reached the rounds


def test_the_sim_command_runs_the_engines_and_the_tick_simulator_on_request() -> None:
    """``p2p-diloco sim`` is the engines; what only the tick simulator has is refused in one line naming ``--tick``,
    and runs with it."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "p2p_diloco.cli.main", "sim", "--config", str(ROOT / "configs" / "tiny.toml"),
            "--quiet", "--json", "--set", "inner.total_steps=10"]
    engines_run = subprocess.run(base, capture_output=True, text=True, timeout=300)
    tick_run = subprocess.run([*base, "--tick"], capture_output=True, text=True, timeout=300)
    assert engines_run.returncode == tick_run.returncode == 0, engines_run.stderr + tick_run.stderr
    import json

    a, b = json.loads(engines_run.stdout), json.loads(tick_run.stdout)
    assert a["final_eval_loss"] == b["final_eval_loss"] and a["rounds"] == b["rounds"] > 0
    refused = subprocess.run([*base, "--set", "outer.error_feedback=true"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "p2p-diloco: error: sim: outer.error_feedback and outer.final_average are not in the engine: run the tick "
        "simulator (--tick)"]
