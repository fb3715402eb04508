"""``scripts/chaos.py``'s pure parts: goodput, stalls, reason grouping, the page (no processes). The schedule and
its driver: ``tests/unit/test_local_chaos.py``."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from scripts_loader import load_script

chaos = load_script("chaos.py", "chaos_script")  # puts scripts/ on sys.path: its sibling modules import by name
analysis = importlib.import_module("chaos_analysis")
goodput = importlib.import_module("chaos_goodput")
record = importlib.import_module("chaos_record")


def test_reasons_group_once_ids_and_numbers_are_masked() -> None:
    rounds = [
        {"outcome": "discarded", "reason": "member t72LJRdB reported: AllreduceException: partial all-reduce: "
                                           "16768 of 198400 elements not averaged (a reducer failed)"},
        {"outcome": "discarded", "reason": "member MKgrM7bB reported: AllreduceException: partial all-reduce: "
                                           "128 of 214656 elements not averaged (a reducer failed)"},
        {"outcome": "discarded", "reason": "version mismatch: a member is at v3, we are at v4"},
        {"outcome": "committed", "reason": "ok"},
    ]
    assert analysis.failed_reasons(rounds) == [
        ("member <peer> reported: AllreduceException: partial all-reduce: N of N elements not averaged "
         "(a reducer failed)", 2),
        ("version mismatch: a member is at vN, we are at vN", 1),
    ]
    assert analysis.normalise_reason("anchor mismatch at v2: 294557ffa1b6fffb vs ours e79e0aceb7005fee") == \
        "anchor mismatch at vN: <hash> vs ours <hash>"
    assert analysis.normalise_reason("P2PDaemonError from QmVTdVdsYwZniit1hWYVQE43Xohu6JWmmC3CsTMKgrM7bB") == \
        "P2PDaemonError from <peer>"


def _round(fragment: int, tokens: int | None, outcome: str = "committed") -> dict[str, Any]:
    return {"fragment": fragment, "outcome": outcome, "tokens_sent": tokens, "reason": "ok"}


def test_goodput_counts_committed_tokens_averaged_over_fragments() -> None:
    incs = [
        # l0 never disturbed: 2 fragments, each committed 1000 tokens in all
        {"learner": "l0", "key": "l0.0", "rounds": [_round(0, 600), _round(0, 400), _round(1, 1000)]},
        # l1 killed: its first incarnation committed 300 on f0 and 500 on f1 (a discarded round counts nothing)
        {"learner": "l1", "key": "l1.0", "rounds": [_round(0, 300), _round(1, 500), _round(0, 200, "discarded")]},
        {"learner": "l1", "key": "l1.1", "rounds": [_round(0, 400), _round(1, 200)]},
    ]
    g = goodput.goodput(incs, {"l0": 10.0, "l1": 10.0}, 100.0, fragments=2)
    assert g is not None
    assert g["per_learner"]["l0"]["goodput"] == pytest.approx(1.0)
    assert g["per_learner"]["l1"]["committed_tokens"] == 700  # (300 + 400 + 500 + 200) / 2
    assert g["per_learner"]["l1"]["goodput"] == pytest.approx(0.7)
    assert g["goodput"] == pytest.approx(1700 / 2000)


def test_goodput_is_unknown_without_tokens_sent_or_a_rate() -> None:
    incs = [{"learner": "l0", "key": "l0.0", "rounds": [_round(0, None)]}]
    assert goodput.goodput(incs, {"l0": 10.0}, 100.0, fragments=1) is None
    incs = [{"learner": "l0", "key": "l0.0", "rounds": [_round(0, 5)]}]
    assert goodput.goodput(incs, {}, 100.0, fragments=1) is None


def test_stall_leaves_out_a_stall_that_may_be_the_stop() -> None:
    incs = [
        {"key": "l0.0", "final": {"max_stall_s": 0.4}, "stops": []},
        {"key": "l1.0", "final": {"max_stall_s": 12.0}, "stops": [[100.0, 112.5]]},  # the stop landed in a stall
        {"key": "l2.0", "final": {"max_stall_s": 0.9}, "stops": [[200.0, 220.0]]},  # stopped mid-step: stall is real
        {"key": "l3.0", "final": None, "stops": []},  # killed
    ]
    s = analysis.survivor_stall(incs)
    assert (s["survivors_max_s"], s["survivors_max_at"]) == (0.9, "l2.0")
    assert (s["overall_max_s"], s["overall_max_at"]) == (12.0, "l1.0")
    assert s["excluded"] == ["l1.0"]
    assert analysis.survivor_stall([{"key": "l0.0", "final": {"steps": 3}, "stops": []}])["survivors_max_s"] is None


def test_steps_sum_incarnations_and_eval_uses_the_most_advanced_anchors() -> None:
    incs = [{"learner": "l0", "key": "l0.0", "final": None, "max_step": 120},
            {"learner": "l0", "key": "l0.1", "final": {"steps": 300}, "max_step": 290},
            {"learner": "l1", "key": "l1.0", "final": {"steps": 450}, "max_step": 440}]
    assert analysis.steps_per_learner(incs) == {"l0": 420, "l1": 450}
    finals = [{"versions": [5, 5], "eval_loss_end": 1.80}, {"versions": [5, 5], "eval_loss_end": 1.80},
              {"versions": [4, 5], "eval_loss_end": 1.95}]
    assert analysis.final_model_eval(finals) == pytest.approx(1.80)
    assert analysis.final_model_eval([]) is None


def _final(name: str, tokens: int, stall: float, eval_loss: float = 1.8) -> dict[str, Any]:
    return {"name": name, "steps": tokens // 100, "tokens": tokens, "train_s": 100.0, "stepping_s": 99.0,
            "max_stall_s": stall, "versions": [3, 3], "anchor_hashes": ["a", "b"], "eval_loss_end": eval_loss,
            "committed": [3, 3], "discarded": [0, 1], "resynced": [1, 1]}


def test_report_from_a_small_payload(tmp_path: Path) -> None:
    incs = [
        {"learner": "l0", "key": "l0.0", "shard": 0, "spawned_s": -10.0, "up_s": -5.0, "ended_s": 130.0, "end": "final",
         "stops": [[40.0, 50.0]], "final": _final("l0", 1000, 0.3), "max_step": 10,
         "rounds": [_round(0, 500) | {"t": 30.0}, _round(1, 900) | {"t": 60.0},
                    {"fragment": 0, "outcome": "discarded", "tokens_sent": 300, "reason": "round exceeded 12.5 s",
                     "t": 45.0}]},
        {"learner": "l1", "key": "l1.0", "shard": 1, "spawned_s": -10.0, "up_s": -5.0, "ended_s": 20.0, "end": "killed",
         "stops": [], "final": None, "max_step": 2, "rounds": []},
        {"learner": "l1", "key": "l1.1", "shard": 1, "spawned_s": 35.0, "up_s": 45.0, "ended_s": 130.0, "end": "final",
         "stops": [], "final": _final("l1", 600, 0.2), "max_step": 6, "rounds": [_round(0, 400) | {"t": 90.0},
                                                                                  _round(1, 400) | {"t": 95.0}]},
    ]
    payload = {"config": "tiny.toml", "quick": True, "seed": 0, "duration_s": 100.0, "fragments": 2,
               "tokens_per_step": 100,
               "chaos": {"incarnations": incs, "schedule": [
                   {"at_s": 20.0, "victim": "l1", "kind": "kill", "down_s": 15.0},
                   {"at_s": 40.0, "victim": "l0", "kind": "stop", "down_s": 10.0}]},
               "baseline": {"finals": {"l0": _final("l0", 1000, 0.1, 1.75), "l1": _final("l1", 800, 0.1, 1.75)},
                            "steps": {"l0": 10, "l1": 8}, "rounds": [_round(0, 1000)]}}
    chaos.write(payload, tmp_path)
    a = payload["analysis"]
    # l0: (500 + 900) / 2 = 700 of 100 s x 10 tokens/s; l1: (400 + 400) / 2 = 400 of 100 s x 8 tokens/s
    assert a["goodput"]["goodput"] == pytest.approx(1100 / 1800)
    assert a["stall"]["survivors_max_s"] == 0.3
    assert a["eval_gap"] == pytest.approx(1.8 / 1.75 - 1)
    # learner-time: 35 of 200 learner-s away (l0 stopped 10 s; l1 down 15 s, starting up 10 s), times the work share
    assert a["time_away"]["ceiling"] == pytest.approx(1 - 35 / 200)
    assert a["learner_time_goodput"] == pytest.approx((1 - 35 / 200) * a["work_share"])
    assert a["verdicts"] == {"goodput": False, "learner_time_goodput": a["learner_time_goodput"] >= 0.85,
                             "stall": True, "eval": True}
    assert a["per_learner"]["l1"]["kills"] == 1 and a["per_learner"]["l0"]["stops"] == 1
    md = (tmp_path / "README.md").read_text()
    assert "61.1%" in md and "FAIL" in md and "1 x round exceeded N s" in md
    assert "Restart l1.1: spawned at 35 s, up at 45 s (start-up 10 s), trained 100 s" in md
    assert (tmp_path / "chaos.png").stat().st_size > 0
    assert "sources digest" not in md  # a run recorded before runs named their code
    payload["code"] = {"label": None, "commit": "abc1234", "changed": [], "sources_sha256": "0123456789abcdef"}
    chaos.write(payload, tmp_path)
    assert "commit abc1234; sources digest 0123456789abcdef" in (tmp_path / "README.md").read_text()


def test_resumed_incarnation_counts_its_steps_from_the_checkpoint(tmp_path: Path) -> None:
    first = {"learner": "l1", "final": None, "max_step": 130}  # killed at step 130, last checkpoint at 120
    resumed = {"learner": "l1", "final": {"steps": 300}, "max_step": 300, "resumed_from_step": 120}
    afresh = {"learner": "l2", "final": {"steps": 90}, "max_step": 90, "resumed_from_step": None}
    assert analysis.incarnation_steps(resumed) == 180
    assert analysis.incarnation_steps(afresh) == 90
    assert analysis.steps_per_learner([first, resumed, afresh]) == {"l1": 310, "l2": 90}

    class Child:  # what the harness keeps of a learner's stdout (launcher.Child.find)
        def __init__(self, lines: list[str]) -> None:
            self.lines = lines

        def find(self, pattern: Any) -> Any:
            return next((m for m in map(pattern.search, self.lines) if m), None)

    resumed = Child(["faults armed: none", "resumed from /tmp/x/ckpt-l1/ckpt-00000120: step 120, model ab12, v [3]"])
    assert record.resumed_step(resumed) == 120
    assert record.resumed_step(Child(["learner l1: shard 1/4"])) is None


def test_learner_time_goodput_is_the_time_spent_training_times_the_work_share() -> None:
    assert goodput.learner_time_goodput(0.89, 0.96) == pytest.approx(0.8544)
    assert goodput.learner_time_goodput(None, 0.96) is None and goodput.learner_time_goodput(0.89, None) is None


def test_time_away_splits_down_start_up_and_stops_inside_the_window() -> None:
    incs = [
        {"learner": "l0", "key": "l0.0", "spawned_s": -20.0, "up_s": 0.0, "ended_s": 100.0, "stops": []},
        {"learner": "l0", "key": "l0.1", "spawned_s": 130.0, "up_s": 150.0, "ended_s": 600.0, "stops": [[300.0, 310.0]]},
        {"learner": "l1", "key": "l1.0", "spawned_s": -20.0, "up_s": 0.0, "ended_s": 500.0,
         "stops": [[50.0, 70.0], [595.0, None]]},  # an open stop ends with the window
        # killed near the end, restarted, never trained again before the window closed
        {"learner": "l1", "key": "l1.1", "spawned_s": 560.0, "up_s": None, "ended_s": 610.0, "stops": []},
    ]
    t = goodput.time_away(incs, window_s=600.0, learners=2)
    assert t["down_s"] == pytest.approx(30.0 + 60.0)  # 100 -> 130, 500 -> 560
    assert t["startup_s"] == pytest.approx(20.0 + 40.0)  # 130 -> 150, 560 -> the window's end
    assert t["stopped_s"] == pytest.approx(10.0 + 20.0 + 5.0)
    assert t["allocated_s"] == 1200.0 and t["ceiling"] == pytest.approx(1 - 185.0 / 1200.0)
    assert goodput.time_away([], window_s=600.0, learners=0)["ceiling"] is None


def test_anchors_are_compared_among_the_incarnations_that_finished_together() -> None:
    incs = [
        {"learner": "l0", "key": "l0.0", "end": "final", "final_s": 520.0, "ended_s": 530.0,
         "final": {"anchor_hashes": ["a", "b"]}},
        {"learner": "l1", "key": "l1.0", "end": "killed", "ended_s": 100.0, "final": None},
        {"learner": "l1", "key": "l1.1", "end": "final", "final_s": 515.0, "ended_s": 530.0,
         "final": {"anchor_hashes": ["a", "b"]}},
        # left at its step cap long before the others: older anchors, not part of the comparison
        {"learner": "l2", "key": "l2.0", "end": "final", "final_s": 290.0, "ended_s": 300.0,
         "final": {"anchor_hashes": ["a0", "b0"]}},
        {"learner": "l3", "key": "l3.0", "end": "killed", "ended_s": 440.0, "final": None},
        {"learner": "l4", "key": "l4.0", "end": "crashed", "ended_s": 40.0, "exit_code": 1, "final": None},
    ]
    endings = analysis.incarnation_endings(incs)
    finals = {i["key"]: i["final"] for i in incs if i["final"]}
    end = analysis.end_state(finals, endings)
    assert end["identical"] is True and end["together"] == ["l0.0", "l1.1"]
    assert end["excluded"] == {
        "l1.0": "killed (kill -9) at 100 s, restarted as l1.1",
        "l2.0": "left at 290 s, 230 s before the last learner finished (more than 60 s before)",
        "l3.0": "killed (kill -9) at 440 s, not restarted",
        "l4.0": "exited without a final summary (code 1)"}
    old = [{k: v for k, v in i.items() if k != "final_s"} for i in incs]  # records before final_s: ended_s
    assert analysis.end_state(finals, analysis.incarnation_endings(old))["together"] == ["l0.0", "l1.1"]
    finals["l1.1"] = {"anchor_hashes": ["a", "c"]}
    assert analysis.end_state(finals, endings)["identical"] is False
    assert analysis.end_state({}, [])["identical"] is None


def test_time_away_counts_a_learner_gone_before_the_windows_end() -> None:
    incs = [
        {"learner": "l0", "key": "l0.0", "spawned_s": -20.0, "up_s": 0.0, "ended_s": 630.0, "stops": []},
        {"learner": "l1", "key": "l1.0", "spawned_s": -20.0, "up_s": 0.0, "ended_s": 540.0, "stops": []},  # no restart
        {"learner": "l2", "key": "l2.0", "spawned_s": -20.0, "up_s": 0.0, "ended_s": 100.0, "stops": []},
        {"learner": "l2", "key": "l2.1", "spawned_s": 130.0, "up_s": 150.0, "ended_s": 640.0, "stops": []},
    ]
    t = goodput.time_away(incs, window_s=600.0, learners=3)
    assert t["gone_s"] == pytest.approx(60.0) and t["down_s"] == pytest.approx(30.0)
    assert t["ceiling"] == pytest.approx(1 - (60.0 + 30.0 + 20.0) / 1800.0)
