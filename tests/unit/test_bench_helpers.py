"""``scripts/_bench.py`` (what every benchmark script shares) and the committed result pages it generates.

The pages in ``results/<bench>/README.md`` are generated from the JSON beside them; the last test renders each
again from that JSON and checks that the committed page is what its script writes now.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from scripts_loader import load_script

bench = load_script("_bench.py", "_bench")
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
ABSOLUTE = ("/tmp/", "/home/", "/root/", "/work/", "/Users/", f"{ROOT}/")
"""Prefixes of paths that name one machine's files: no committed result may hold one."""
EXAMPLE = bench.Bench("example", "example", "An example benchmark", "scripts/bench_example.py",
                      "Measures *nothing*, on `configs/tiny.toml`.")


def _table(payload: dict[str, Any]) -> str:
    return f"| figure |\n|---|\n| {payload['figure']} |\n"


def _plot(payload: dict[str, Any], path: Path) -> None:
    with bench.figure(path, 2, (6, 3)) as (left, right):
        left.plot([0, 1], [payload["figure"], 1])
        right.bar(["a"], [payload["figure"]])


def test_paths_inside_the_repository_become_relative_and_others_stay() -> None:
    assert bench.repo_path(ROOT / "configs" / "demo.toml") == "configs/demo.toml"
    assert bench.repo_path("configs/demo.toml") == "configs/demo.toml"
    assert bench.repo_path("/elsewhere/demo.toml") == "/elsewhere/demo.toml"
    payload = {"config": str(ROOT / "configs" / "demo.toml"), "args": (str(ROOT / "x.py"), "join"),
               "nested": [{"out": str(ROOT / "results" / "wan")}], "peer": "/ip4/127.0.0.1/tcp/1", "n": 3,
               "other": "/elsewhere/file", "prefix": f"{ROOT}-not-inside"}
    assert bench.relative_paths(payload) == {
        "config": "configs/demo.toml", "args": ["x.py", "join"], "nested": [{"out": "results/wan"}],
        "peer": "/ip4/127.0.0.1/tcp/1", "n": 3, "other": "/elsewhere/file", "prefix": f"{ROOT}-not-inside"}


def test_save_writes_repository_relative_json_and_returns_it_as_written(tmp_path: Path) -> None:
    saved = EXAMPLE.save(tmp_path / "out", {"config": str(ROOT / "configs" / "tiny.toml"), "runs": (1, 2.5)})
    assert saved == {"config": "configs/tiny.toml", "runs": [1, 2.5]}
    assert json.loads((tmp_path / "out" / "example.json").read_text()) == saved == EXAMPLE.load(tmp_path / "out")


def test_publish_writes_json_figure_and_a_page_with_method_table_and_figure(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    saved = bench.publish(EXAMPLE, tmp_path, {"figure": 2.0}, _table, _plot)
    assert saved == {"figure": 2.0}
    assert (tmp_path / "example.png").stat().st_size > 0
    page = (tmp_path / "README.md").read_text()
    assert page.startswith("# An example benchmark\n\nMeasures *nothing*, on `configs/tiny.toml`.\n\n## Results\n")
    assert "| 2.0 |" in page and "![An example benchmark](example.png)" in page
    assert f"`python scripts/bench_example.py --render-only --out {tmp_path}`" in page
    assert "| 2.0 |" in capsys.readouterr().out
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []  # the figure was closed


def test_a_page_without_a_figure_names_no_image(tmp_path: Path) -> None:
    bench.publish(EXAMPLE, tmp_path, {"figure": 1}, _table, None, echo=False)
    assert "![" not in (tmp_path / "README.md").read_text()


def test_a_failing_plot_still_closes_its_figure(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    with pytest.raises(KeyError), bench.figure(tmp_path / "x.png"):
        raise KeyError("no such figure")
    assert plt.get_fignums() == [] and not (tmp_path / "x.png").exists()


def test_render_only_rewrites_the_page_alone_and_replot_the_figure_too(tmp_path: Path) -> None:
    bench.publish(EXAMPLE, tmp_path, {"figure": 1.0}, _table, _plot, echo=False)
    EXAMPLE.save(tmp_path, {"figure": 3.0})
    png = (tmp_path / "example.png").read_bytes()
    parser = bench.parser("Example.\n\nMore.", EXAMPLE)
    assert not bench.rerender(parser.parse_args(["--out", str(tmp_path)]), EXAMPLE, _table, _plot)
    assert "| 1.0 |" in (tmp_path / "README.md").read_text()
    assert bench.rerender(parser.parse_args(["--out", str(tmp_path), "--render-only"]), EXAMPLE, _table, _plot)
    assert "| 3.0 |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "example.png").read_bytes() == png
    (tmp_path / "example.png").unlink()
    assert bench.rerender(parser.parse_args(["--out", str(tmp_path), "--replot"]), EXAMPLE, _table, _plot)
    assert (tmp_path / "example.png").exists()


def test_the_common_arguments() -> None:
    plain = bench.parser("Example.", EXAMPLE).parse_args([])
    assert vars(plain) == {"out": RESULTS / "example", "render_only": False, "replot": False}
    full = bench.parser("Example.", EXAMPLE, config="bench.toml", quick="smoke run").parse_args(
        ["--set", "a=1", "--set", "b=2", "--quick"])
    assert full.config == str(ROOT / "configs" / "bench.toml") and full.overrides == ["a=1", "b=2"] and full.quick
    no_set = bench.parser("Example.", EXAMPLE, config="demo.toml", overrides=False)
    with pytest.raises(SystemExit):
        no_set.parse_args(["--set", "a=1"])
    assert isinstance(no_set, argparse.ArgumentParser) and no_set.description == "Example."


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_no_committed_result_holds_an_absolute_path() -> None:
    found = [(str(path.relative_to(ROOT)), s) for path in sorted(RESULTS.rglob("*.json"))
             if "logs" not in path.relative_to(RESULTS).parts  # a run's own logs: git-ignored, never committed
             for s in _strings(json.loads(path.read_text())) if s.startswith(ABSOLUTE)]
    assert found == []


PAGES = [
    ("chaos.py", "chaos"), ("chaos.py", "chaos-run-a"), ("chaos.py", "chaos-run-c"), ("chaos.py", "chaos-run-f"),
    ("chaos.py", "chaos-run-g"), ("chaos.py", "chaos-clock"), ("bench_control.py", "control"), ("bench_goodput.py", "goodput"), ("bench_hetero.py", "hetero"),
    ("bench_learners.py", "learners"), ("bench_learners.py", "learners-steps"), ("bench_overhead.py", "overhead"),
    ("bench_parity.py", "parity"), ("bench_parity_demo.py", "parity-demo"),
    ("bench_parity_demo.py", "parity-llama-3m"), ("bench_poison.py", "poison"),
    ("bench_rejoin.py", "rejoin"), ("bench_fast_steps.py", "fast-steps"), ("bench_mainjob.py", "mainjob-rounds"),
    ("bench_reference.py", "reference"), ("wan/bench_wan.py", "wan"), ("wan/rpc_tally/summarize.py", "wan-bytes"),
]
"""Every results folder whose page a script generates, and that script."""
RENDER_ARGS = {"parity-llama-3m": ["--config", "configs/llama-3m.toml"]}
"""What a page's script needs besides ``--render-only --out`` to render it (its "writes this page again" line)."""


@pytest.mark.parametrize(("script", "folder"), PAGES)
def test_every_committed_page_is_what_its_script_renders_from_the_committed_json(script: str, folder: str,
                                                                                 tmp_path: Path) -> None:
    committed = RESULTS / folder
    out = tmp_path / folder
    out.mkdir()
    for path in committed.iterdir():
        if path.is_file() and path.suffix in (".json", ".png"):
            shutil.copy(path, out / path.name)
        elif path.name == "runs" and path.is_dir():  # a resumable grid's finished runs (bench_parity_demo.py)
            shutil.copytree(path, out / "runs")
    module = load_script(script, f"page_{Path(script).stem}")
    assert module.main([*RENDER_ARGS.get(folder, []), "--render-only", "--out", str(out)]) == 0
    page = (out / "README.md").read_text().replace(f"--out {out}`", f"--out results/{folder}`")
    assert page == (committed / "README.md").read_text()
