"""``p2p-diloco swarm``'s report (pure, no processes): which learners finished together, the live view's
progress, and the data-parallel reference -- which stored curve covers the run's tokens, or that one must
be computed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from p2p_diloco.core.config import load_config
from p2p_diloco.local.launcher import NO_STEP_LIMIT, unlimited_steps
from p2p_diloco.sim.reference import (
    SPAN, cache_dir, load_curves, lookup, plan, reference_at, reference_key, save_curve,
)
from p2p_diloco.local.run import Ending, finished_together, progress

CURVE = [{"tokens": 0, "eval_loss": 5.5}, {"tokens": 1000, "eval_loss": 3.0}, {"tokens": 3000, "eval_loss": 2.0}]


def write(folder: Path, key: str, name: str | None = None, curve: list[dict[str, float]] = CURVE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or f"dp-{key}.json")
    path.write_text(json.dumps({"reference_key": key, "curve": curve, "command": "python scripts/x.py"}))
    return path


KEY = "0123456789abcdef"


# ---------------------------------------------------------------- finished together


def test_learners_that_finished_together_and_the_others_with_their_reason() -> None:
    endings = [Ending("fast-0", 270.0), Ending("half-1", 430.0), Ending("fast-2", 300.5), Ending("half-3", 415.0)]
    together, excluded = finished_together(endings, window_s=60.0)
    assert together == ["half-1", "half-3"]  # the fast ones left at their step cap: their anchors are older
    assert excluded["fast-0"] == "left at 270 s, 160 s before the last learner finished (more than 60 s before)"
    assert "left at 300 s, 130 s before" in excluded["fast-2"]


def test_a_learner_without_a_final_summary_is_left_out_with_why() -> None:
    endings = [Ending("a-0", 400.0), Ending("b-1", 380.0), Ending("b-2", None, "killed by --chaos (kill -9) at 90 s"),
               Ending("b-2-rejoined", 399.0), Ending("c-3", None)]
    together, excluded = finished_together(endings, window_s=60.0)
    assert together == ["a-0", "b-1", "b-2-rejoined"]
    assert excluded == {"b-2": "killed by --chaos (kill -9) at 90 s", "c-3": "no final summary"}
    assert finished_together([Ending("x", None, "exited without a final summary (exit code 1)")], 60.0) == \
        ([], {"x": "exited without a final summary (exit code 1)"})
    assert finished_together([], 60.0) == ([], {})
    with pytest.raises(ValueError, match="window_s: must be >= 0"):
        finished_together(endings, -1.0)


# ---------------------------------------------------------------- the live view


def test_progress_is_by_time_with_a_time_budget_whatever_the_tokens() -> None:
    share, text = progress(130.0, 30.0, 400.0, 5_000_000, None)
    assert share == pytest.approx(0.25) and text == "5,000,000 tokens, 100/400 s trained"
    assert progress(20.0, None, 400.0, 0, None)[0] == 0.0  # not training yet
    assert progress(1000.0, 30.0, 400.0, 9, None) == (1.0, "9 tokens, 400/400 s trained")
    assert progress(50.0, 10.0, None, 500, 1000) == (0.5, "500/1,000 tokens")  # --minutes 0: the step budget
    assert progress(50.0, 10.0, 400.0, 900, 1000)[0] == pytest.approx(0.9)  # both: the further one


def test_a_time_budget_lifts_the_step_cap_but_an_explicit_one_wins() -> None:
    cfg = load_config(None, unlimited_steps(["inner.lr=0.01"]))
    assert cfg.inner.total_steps == NO_STEP_LIMIT and cfg.inner.lr == 0.01
    assert load_config(None, unlimited_steps(["inner.total_steps=300"])).inner.total_steps == 300
    assert reference_key(cfg) == reference_key(load_config(None, ["inner.lr=0.01"]))  # the reference does not change


# ---------------------------------------------------------------- the data-parallel reference


def test_plan_picks_a_curve_whose_schedule_ends_near_the_runs_tokens() -> None:
    ends = [2_908_160, 4_800_512]
    assert plan(ends, 2_450_000)[0] == 0  # the 2-core main job: in the last quarter of the shorter curve
    assert plan(ends, 4_685_824)[0] == 1  # the faster machine the issue saw
    assert plan(ends, 3_100_000)[0] == 0  # up to 10% past a curve's end
    i, why = plan(ends, 3_500_000)
    assert i is None and "no curve covers 3,500,000 tokens (curves end at 2,908,160, 4,800,512" in why
    assert plan(ends, 10_000_000)[0] is None  # a 16-core machine: computed for the run
    assert plan(ends, 1_000_000)[0] is None  # far before both ends: their LR had not decayed yet
    assert plan([], 1000) == (None, "no curve for this model, data, optimizer and number of learners")
    assert plan(ends, 0)[0] is None
    assert plan([1000, 1100], 1020)[0] == 0  # both cover it: the one ending nearest (ratio)
    assert plan([1000, 1100], 1060)[0] == 1
    assert SPAN[0] < 1 < SPAN[1]


def test_reference_is_interpolated_at_the_swarms_tokens(tmp_path: Path) -> None:
    write(tmp_path, KEY)
    [ref] = load_curves(KEY, [tmp_path])
    assert reference_at(ref, 2500)["eval_loss"] == pytest.approx(2.25)
    assert reference_at(ref, 3200)["eval_loss"] == pytest.approx(2.0)  # past the end: its last point
    found, why = lookup(KEY, 3000, [tmp_path])
    assert found is not None and found["eval_loss"] == pytest.approx(2.0) and found["reference_tokens"] == 3000
    assert found["path"] == str(tmp_path / f"dp-{KEY}.json")
    assert "covers 3,000" in why
    found, why = lookup(KEY, 1000, [tmp_path])
    assert found is None and "no curve covers 1,000 tokens (curves end at 3,000" in why


def test_curves_whose_ends_bracket_the_tokens_give_the_reference_from_their_ends(tmp_path: Path) -> None:
    """A run whose LR ends with its time is compared with data-parallel whose cosine ends at the same tokens: between
    two curves' ends (at most MAX_END_GAP apart), linear in log tokens; not a curve read inside its last quarter."""
    from p2p_diloco.sim.reference import MAX_END_GAP, bracketing

    write(tmp_path, KEY, name=f"dp-{KEY}-2000.json", curve=[{"tokens": 2000, "eval_loss": 2.0}])
    write(tmp_path, KEY, name=f"dp-{KEY}-4000.json", curve=[{"tokens": 3000, "eval_loss": 1.2},
                                                            {"tokens": 4000, "eval_loss": 1.5}])
    found, why = lookup(KEY, 3000, [tmp_path])  # not the 4000 curve's 1.2 at 3000: its LR had not decayed
    assert found is not None and found["eval_loss"] == pytest.approx(2.0 - 0.5 * math.log(1.5) / math.log(2)), found
    assert found["between"] == [2000, 4000] and "bracket 3,000" in why
    assert found["path"].endswith(f"dp-{KEY}-2000.json and {tmp_path}/dp-{KEY}-4000.json")
    assert lookup(KEY, 4000, [tmp_path])[0]["eval_loss"] == 1.5  # a curve's own end
    assert bracketing([2000, 4000], 4400) is None and bracketing([2000, 4000], 1999) is None  # no end on one side
    assert bracketing([1000, 2000 * MAX_END_GAP], 1500) is None  # too far apart: read off one curve (plan)
    assert bracketing([3000, 1000, 2000], 2500) == (2, 0) and bracketing([2000, 2000, 3000], 2000) == (0, 0)


def test_curves_come_from_every_folder_and_a_mismatched_file_is_refused(tmp_path: Path) -> None:
    committed, cache = tmp_path / "results", tmp_path / "cache"
    write(committed, KEY)
    longer = [*CURVE, {"tokens": 9000, "eval_loss": 1.5}]
    path = save_curve({"reference_key": KEY, "tokens": 9000, "curve": longer}, cache)
    assert path == cache / f"dp-{KEY}-9000.json"
    write(committed, "fedcba9876543210")  # another key's curve: not read
    assert sorted(len(c["curve"]) for c in load_curves(KEY, [committed, cache, tmp_path / "missing"])) == [3, 4]
    assert lookup(KEY, 8000, [committed, cache])[0]["reference_tokens"] == 9000
    assert load_curves("nothing0nothing0", [committed]) == []
    write(committed, KEY, name=f"dp-{KEY}-5000.json").write_text(json.dumps({"reference_key": "other", "curve": CURVE}))
    with pytest.raises(ValueError, match=f"not a reference curve for reference key {KEY}"):
        load_curves(KEY, [committed])


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("P2P_DILOCO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "p2p-diloco" / "reference"
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine" / "reference"


def test_the_bundled_curves_cover_the_main_job_on_a_2_core_and_a_faster_machine() -> None:
    from p2p_diloco.sim.reference import bundled_dir

    cfg = load_config("configs/demo.toml", [])
    for tokens in (1_900_000, 2_450_000, 4_685_824, 5_330_000):  # 5 and 6.5 min on 2 cores; the machine
        # (4.69M with the old step cap, about 5.3M training the whole 6.5 min)
        found, why = lookup(reference_key(cfg), tokens, [bundled_dir()])
        assert found is not None, why
        assert found["path"].startswith("configs/reference/dp-"), found["path"]  # as on every machine
    # the main job of results/mainjob-rounds-b44731e: 4.09M tokens, between the 3.7M and 4.8M curves' ends
    found, _ = lookup(reference_key(cfg), 4_085_760, [bundled_dir()])
    assert found is not None and found["between"] == [3_702_784, 4_800_512]
    assert found["eval_loss"] == pytest.approx(1.548, abs=0.002)


def test_the_bundled_curves_are_the_committed_benchmark_outputs() -> None:
    """``configs/reference`` ships (package data); ``results/reference`` is where ``scripts/bench_reference.py``
    writes. Every bundled curve is one of the benchmark's, unchanged, and none is read from results/."""
    from p2p_diloco.sim.reference import bundled_dir, folders

    root = Path(__file__).resolve().parents[2]
    bundled = sorted(bundled_dir().glob("dp-*.json"))
    assert bundled, bundled_dir()
    for path in bundled:
        assert path.read_bytes() == (root / "results" / "reference" / path.name).read_bytes(), path.name
    assert not any(folder.is_relative_to(root / "results") for folder in folders())


def test_stored_curves_come_from_the_cache_then_the_bundled_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from p2p_diloco.local.run import stored_reference
    from p2p_diloco.sim.reference import bundled_dir, folders

    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path))
    assert folders() == [tmp_path / "reference", bundled_dir()]
    cfg = load_config("demo", [])
    found, _ = stored_reference(cfg, 2_007_040)  # a curve's end
    assert found is not None and found["path"] == "configs/reference/dp-08e1f32363c36a1a-2007040.json"
    ours = json.loads((bundled_dir() / "dp-08e1f32363c36a1a-2007040.json").read_text())
    save_curve({**ours, "curve": [*ours["curve"][:-1], {**ours["curve"][-1], "eval_loss": 1.0}]}, tmp_path / "reference")
    found, _ = stored_reference(cfg, 2_007_040)  # the same length cached here: the cached one
    assert found is not None and found["path"] == str(tmp_path / "reference" / "dp-08e1f32363c36a1a-2007040.json")
    assert found["reference_final_eval_loss"] == 1.0


def test_reference_key_follows_what_data_parallel_training_depends_on() -> None:
    base = reference_key(load_config(None, []))
    for outer_only in ("outer.sync_every=7", "outer.codec=fp16", "averaging.window_s=3.0", "inner.total_steps=77"):
        assert reference_key(load_config(None, [outer_only])) == base, outer_only
    for changes in ("model.n_embd=32", "inner.lr=0.01", "run.seed=3", "sim.learners=2", "data.max_bytes=100000"):
        assert reference_key(load_config(None, [changes])) != base, changes


def test_local_swarm_clears_a_previous_runs_logs(tmp_path: Path) -> None:
    from p2p_diloco.local.launcher import LocalSwarm

    logs = tmp_path / "logs"
    (logs / "baseline").mkdir(parents=True)
    for name in ("l0.jsonl", "l0.log", "boot.log", "baseline/l0.jsonl", "notes.txt"):
        (logs / name).write_text("old\n")
    with LocalSwarm(logs):
        pass
    left = sorted(str(p.relative_to(logs)) for p in logs.rglob("*") if p.is_file())
    assert left == ["baseline/l0.jsonl", "notes.txt"]  # its own folder's run files only; a nested run clears its own


def test_the_reference_is_computed_unless_stored_skipped_or_interrupted() -> None:
    from p2p_diloco.local.run import reference_action

    why = "no curve covers 9,000,000 tokens"
    assert reference_action(True, "covers", 9_000_000, False, False) == ("use", "covers")
    assert reference_action(True, "covers", 9_000_000, True, True) == ("use", "covers")  # stored: always shown
    assert reference_action(False, why, 9_000_000, False, False) == ("compute", why)
    assert reference_action(False, why, 9_000_000, True, False) == ("none", why + "; --no-reference: not computed")
    assert reference_action(False, why, 9_000_000, False, True) == ("none", why + "; the run was interrupted: not computed")
    assert reference_action(False, why, 0, False, False) == ("none", "the learners trained no tokens")


# ---------------------------------------------------------------- a run the stored curves always cover


def test_covered_merges_the_spans_of_the_curves() -> None:
    from p2p_diloco.sim.reference import covered

    assert covered([]) == []
    assert covered([1000]) == [(SPAN[0] * 1000, SPAN[1] * 1000)]
    assert covered([2000, 1000, 0]) == [(750.0, 1100.0), (1500.0, 2200.0)]  # a gap: 1000 covers up to 1100 only
    (lo, hi), = covered([1000, 1400])  # overlapping (or touching): one range
    assert (lo, hi) == (750.0, pytest.approx(1540.0))
    for tokens in (750, 1100, 1101, 1540):
        assert plan([1000, 1400], tokens)[0] is not None, tokens
    assert plan([1000, 1400], 1541)[0] is None and plan([1000, 1400], 749)[0] is None


def test_the_token_budget_is_the_longest_stored_curve_unless_given() -> None:
    from p2p_diloco.local.run import token_budget

    ends = [2_000_000, 7_000_000, 5_000_000]
    assert token_budget(None, 390.0, ends) == (7_000_000, "the longest stored data-parallel curve: the report reads "
                                                          "its reference, never computes one")
    assert token_budget(None, 390.0, []) == (None, "no stored data-parallel curve for this run")
    assert token_budget(None, None, ends) == (None, "the step budget fixes the tokens")  # --minutes 0
    assert token_budget(3_000_000, 390.0, ends) == (3_000_000, "--max-tokens")
    assert token_budget(0, 390.0, ends) == (None, "--max-tokens 0")
    with pytest.raises(ValueError, match="--max-tokens: must be >= 0, got -1"):
        token_budget(-1, 390.0, ends)


def test_the_bundled_curves_cover_the_default_job_at_any_speed() -> None:
    """The main job (``p2p-diloco swarm``: demo.toml, 4 learners, a time budget) never computes its reference:
    a machine of any speed from a twentieth of a 2-core machine's up either trains fewer tokens than its token
    budget, which the bundled curves cover without a gap, or stops there and trains on at most 10% while its
    learners finish, which the longest curve still covers. (On a 2-core machine the learners trained 8.19M
    tokens in the default 6.5 minutes, issue 47.)"""
    from p2p_diloco.local.run import DEFAULT_CONFIG, DEFAULT_MINUTES, token_budget
    from p2p_diloco.sim.reference import bundled_dir, covered, curve_end

    cfg = load_config(DEFAULT_CONFIG, ["sim.learners=4"])  # the swarm's reference: --peers 4 replicas
    ends = [curve_end(c) for c in load_curves(reference_key(cfg), [bundled_dir()])]
    stop, _ = token_budget(None, DEFAULT_MINUTES * 60, ends)
    assert stop is not None and stop > 8_190_000  # the 2-core machine's run does not stop early
    slowest, fastest = 8_190_000 // 20, int(stop * SPAN[1])  # at most 10% past the budget while finishing
    assert any(lo <= slowest and fastest <= hi for lo, hi in covered(ends)), (covered(ends), slowest, fastest)
    for tokens in range(slowest, fastest + 1, 10_000):  # the same through plan(), which the swarm asks
        assert plan(ends, tokens)[0] is not None, plan(ends, tokens)[1]


def test_last_tokens_reads_the_last_whole_event(tmp_path: Path) -> None:
    from p2p_diloco.local.run import EVENTS_TAIL_BYTES, last_tokens

    path = tmp_path / "l0.jsonl"
    assert last_tokens(path) == 0  # not started yet
    path.write_text("")
    assert last_tokens(path) == 0
    filler = json.dumps({"name": "l0", "step": 1, "tokens": 2048, "event": "round", "pad": "x" * 1000})
    path.write_text("\n".join([filler] * (2 * EVENTS_TAIL_BYTES // len(filler)))
                    + '\n{"name": "l0", "step": 7, "tokens": 14336, "event": "round"}\n{"name": "l0", "tok')
    assert last_tokens(path) == 14336  # the line being written is skipped


class FakeLearner:
    def __init__(self, name: str, alive: bool = True, final: dict[str, int] | None = None) -> None:
        self.name, self.alive, self._final, self.signals = name, alive, final, []

    def final(self) -> dict[str, int] | None:
        return self._final

    def signal(self, sig: int) -> None:
        self.signals.append(sig)


def test_the_token_stop_finishes_every_learner_once_the_budget_is_trained(tmp_path: Path) -> None:
    import signal

    from p2p_diloco.local.run import TokenStop

    def events(name: str, tokens: int) -> None:
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"name": name, "tokens": tokens, "event": "round"}) + "\n")

    learners = [FakeLearner("a"), FakeLearner("b"), FakeLearner("c", alive=False), FakeLearner("d", final={"tokens": 1})]
    for name, tokens in (("a", 400), ("b", 300), ("c", 5000), ("d", 200)):
        events(name, tokens)
    stop = TokenStop(1000, tmp_path)
    assert not stop.tick(learners, ["c"], 10.0)  # 900: the killed learner's tokens do not count (nor in the report)
    assert stop.reached_s is None and not any(x.signals for x in learners)
    events("b", 450)
    assert stop.tick(learners, ["c"], 12.0) and stop.reached_s == 12.0  # 1050
    assert [x.signals for x in learners] == [[signal.SIGUSR1], [signal.SIGUSR1], [], []]  # alive and not finished
    assert stop.tick(learners, ["c"], 14.0) and learners[0].signals == [signal.SIGUSR1]  # once
    assert not TokenStop(None, tmp_path).tick(learners, [], 1.0)  # no budget


def test_the_token_stop_looks_one_look_ahead(tmp_path: Path) -> None:
    from p2p_diloco.local.run import TokenStop

    def events(tokens: int) -> None:
        (tmp_path / "a.jsonl").write_text(json.dumps({"name": "a", "tokens": tokens, "event": "round"}) + "\n")

    learners = [FakeLearner("a")]
    stop = TokenStop(1000, tmp_path)
    for t, tokens in ((2.0, 0), (4.0, 400), (6.0, 550), (8.0, 600)):  # 0, 400 + 400, 550 + 150, 600 + 50
        events(tokens)
        assert not stop.tick(learners, [], t), (t, tokens)
    events(990)  # below the budget, but 390 more by the next look: it would overshoot by then
    assert stop.tick(learners, [], 10.0) and stop.reached_s == 10.0 and learners[0].signals
