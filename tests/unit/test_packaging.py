"""The package as installed: every subpackage listed in pyproject.toml, the configs, reference curves and peer
profiles inside the wheel, and nothing in the package that finds files relative to the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from p2p_diloco.core import resources

ROOT = Path(__file__).resolve().parents[2]
WHEEL_BUILD_TIMEOUT_S = 300.0
"""``pip wheel`` of the package, offline (no build isolation): seconds on an idle machine."""


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "p2p_diloco").rglob("__init__.py")}
    assert found - listed == set(), "add them to [tool.setuptools] packages"
    data = {"p2p_diloco.configs", "p2p_diloco.configs.reference", "p2p_diloco.peers"}
    assert listed - found == data


def test_the_bundled_files_are_the_repositorys_top_level_folders() -> None:
    assert resources.bundled_dir(resources.CONFIGS) == ROOT / "configs"  # a checkout: beside the package
    assert resources.bundled_dir(resources.PEERS) == ROOT / "peers"
    assert resources.bundled_names(resources.CONFIGS) == sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
    assert resources.bundled_names(resources.PEERS) == ["fast", "half"]
    assert resources.shown(ROOT / "configs" / "reference" / "x.json") == "configs/reference/x.json"


def test_find_takes_an_existing_path_else_a_bundled_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for given in ("peers/half.toml", "half.toml", "half"):
        assert resources.find(given, resources.PEERS) == ROOT / "peers" / "half.toml"
    mine = tmp_path / "half.toml"
    mine.write_text('name = "mine"\n')
    assert resources.find("half.toml", resources.PEERS) == Path("half.toml")
    with pytest.raises(FileNotFoundError, match=r"^peers/slow.toml: no such file, and no bundled peer profile "
                                                r"'slow.toml' \(bundled: fast, half\)$"):
        resources.find("peers/slow.toml", resources.PEERS)


def test_the_cli_reads_bundled_configs_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from p2p_diloco.cli import main as cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "--config", "configs/tiny.toml"]) == 0
    assert 'run_id = "tiny"' in capsys.readouterr().out
    assert cli.main(["config", "--config", "configs/huge.toml"]) == 2
    assert capsys.readouterr().err == ("p2p-diloco: config error: configs/huge.toml: no such file, and no bundled "
                                       "config 'huge.toml' (bundled: bench, demo, llama-20m, llama-3m, llama-tiny, tiny)\n")


def test_the_package_reads_no_file_relative_to_the_repository() -> None:
    """configs/, peers/ and the reference curves come through :mod:`p2p_diloco.core.resources` (they are in a
    wheel too); results/ is the benchmarks' output, never read at run time. tools/layers.py, a developer's
    check of the package's own sources, is the one module that looks at files beside itself."""
    offenders = []
    for path in (ROOT / "p2p_diloco").rglob("*.py"):
        text = path.read_text()
        if path.name != "layers.py" and "Path(__file__)" in text:
            offenders.append(f"{path.relative_to(ROOT)}: Path(__file__)")
        if re.search(r"""["']results["']|["']results/""", text):
            offenders.append(f"{path.relative_to(ROOT)}: results/")
    assert offenders == []


@pytest.mark.slow
def test_the_wheel_holds_the_configs_curves_and_profiles(tmp_path: Path) -> None:
    """Built offline (``pip wheel --no-deps --no-build-isolation``) from a copy of the sources, so the checkout
    gets no build/ folder."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("p2p_diloco", "configs", "peers"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                       timeout=WHEEL_BUILD_TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    [wheel] = (tmp_path / "dist").glob("p2p_diloco-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = ({f"p2p_diloco/configs/{p.name}" for p in (ROOT / "configs").glob("*.toml")}
                | {f"p2p_diloco/configs/reference/{p.name}" for p in (ROOT / "configs" / "reference").glob("*.json")}
                | {f"p2p_diloco/peers/{p.name}" for p in (ROOT / "peers").glob("*.toml")})
    assert len(expected) >= 12 and expected <= names, sorted(expected - names)
    assert "p2p_diloco/core/resources.py" in names and "p2p_diloco/cli/main.py" in names
    assert not any(n.startswith(("results/", "configs/", "peers/", "tests/")) for n in names)
