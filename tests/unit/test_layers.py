"""The layer rules of ``p2p_diloco.tools.layers`` hold for the package, and each rule can fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from p2p_diloco.tools import layers


def _package(tmp_path: Path, files: dict[str, str]) -> list[layers.Module]:
    root = tmp_path / "p2p_diloco"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))
    return layers.read_package(root)


def test_the_package_keeps_every_rule() -> None:
    assert layers.violations(layers.read_package()) == []


def test_a_forbidden_import_is_named_with_its_line(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "core/maths.py": "import torch\n\n\ndef f():\n    from p2p_diloco.net import records\n",
        "net/records.py": "from p2p_diloco.core import maths\n",
        "learner/loop.py": "from p2p_diloco.cli.common import out\n",
        "engine/rounds.py": "def f():\n    from p2p_diloco.learner import loop\n",  # the engine never imports join's
    })
    problems = layers.violations(modules)
    assert any("engine/rounds.py:2: engine/ may not import learner/" in p for p in problems), problems
    assert any("core/maths.py:5: core/ may not import net/" in p for p in problems), problems
    assert any("learner/loop.py:1: learner/ may not import cli/" in p for p in problems), problems
    assert not any("net/records.py" in p for p in problems)  # net may import core


def test_relative_and_package_level_imports_count(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "sync/slot.py": "from ..averaging import host\n",
        "core/config.py": "from p2p_diloco import cli\n",
    })
    problems = layers.violations(modules)
    assert any("sync/slot.py:1: sync/ may not import averaging/" in p for p in problems), problems
    assert any("core/config.py:1: core/ may not import cli/" in p for p in problems), problems


def test_hivemind_in_core_sizes_and_unknown_layers_fail(tmp_path: Path) -> None:
    big_class = "class Big:\n" + "    x = 1\n" * (layers.MAX_CLASS_LINES + 1)
    modules = _package(tmp_path, {
        "core/codecs.py": "from hivemind.compression import CompressionBase\n",
        "sim/long.py": "x = 1\n" * (layers.MAX_MODULE_LINES + 1),
        "net/big.py": big_class,
        "extras/thing.py": "",
    })
    problems = "\n".join(layers.violations(modules))
    assert "core/ imports hivemind.compression" in problems
    assert f"sim/long.py: {layers.MAX_MODULE_LINES + 1} lines" in problems
    assert f"class Big has {layers.MAX_CLASS_LINES + 2} lines" in problems
    assert "subpackage 'extras' has no rule" in problems


def test_the_command_prints_layers_and_exits_by_the_rules() -> None:
    done = subprocess.run([sys.executable, "-m", "p2p_diloco.tools.layers"], capture_output=True, text=True,
                          timeout=60)
    assert "core/" in done.stdout and "imports:" in done.stdout, done.stdout
    assert done.returncode == (0 if "ok: every rule holds" in done.stdout else 1), done.stdout


def test_an_import_circle_is_named_even_under_type_checking(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "learner/loop.py": "from p2p_diloco.learner.checkpointer import Checkpointer\n",
        "learner/checkpointer.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                   "    from p2p_diloco.learner.loop import Learner\n",
        "learner/view.py": "from p2p_diloco.learner import loop\n",  # imports into the circle, is not in it
    })
    assert [p for p in layers.violations(modules) if p.startswith("circle")] == [
        "circle: p2p_diloco.learner.checkpointer -> p2p_diloco.learner.loop -> p2p_diloco.learner.checkpointer"]


def test_relative_function_level_and_submodule_imports_make_edges(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "core/a.py": "from . import b\n",
        "core/b.py": "def f():\n    from .c import x\n",
        "core/c.py": "from p2p_diloco.core import a\n",
        "core/d.py": "from p2p_diloco.core.a import name\nfrom .b import f\n",
    })
    graph = layers.import_graph(modules)
    assert graph["p2p_diloco.core.a"] == {"p2p_diloco.core", "p2p_diloco.core.b"}
    assert graph["p2p_diloco.core.d"] == {"p2p_diloco.core.a", "p2p_diloco.core.b"}
    assert layers.circles(graph) == [[f"p2p_diloco.core.{m}" for m in ("a", "b", "c", "a")]]


def test_a_module_importing_itself_is_a_circle_a_package_naming_its_submodule_is_not(tmp_path: Path) -> None:
    modules = _package(tmp_path, {
        "core/x.py": "def f():\n    import p2p_diloco.core.x\n",
        "net/__init__.py": "from . import records\n",
        "net/records.py": "",
    })
    assert layers.circles(layers.import_graph(modules)) == [["p2p_diloco.core.x", "p2p_diloco.core.x"]]


def test_a_circle_through_a_hub_is_one_walk_over_real_imports() -> None:
    graph = {"hub": {"a", "b", "c"}, "a": {"hub"}, "b": {"hub"}, "c": {"d"}, "d": {"hub"}, "leaf": {"hub"}}
    [walk] = layers.circles(graph)
    assert walk[0] == walk[-1] == "a" and set(walk) == {"a", "b", "c", "d", "hub"}, walk
    assert all(after in graph[before] for before, after in zip(walk, walk[1:])), walk
    assert layers.circles({"a": {"b"}, "b": set()}) == []
