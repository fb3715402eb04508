"""scripts/bench_overhead.py --quick: the pipeline runs and writes its JSON, table and plot (not the speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_overhead_quick_writes_its_results(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    payload = json.loads((tmp_path / "overhead.json").read_text())
    for key in ("device", "precision", "model", "blocks", "steps_per_block", "results", "ratio_min", "load_average_start",
                "load_average_end", "torch", "target_ratio"):
        assert key in payload, key
    assert payload["quick"] is True and payload["device"] == "cpu" and payload["precision"] == "fp32"
    (result,) = payload["results"]
    assert result["threads"] == 1 and len(result["plain_steps_per_s"]) == len(result["learner_steps_per_s"]) == 3
    assert result["ratio"] > 0 and result["plain_median"] > 0 and result["learner_median"] > 0
    assert result["learner_rounds_committed"] >= 1  # the learner arm applied an outer step, as a learner does
    assert "| torch threads |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "overhead.png").stat().st_size > 0
