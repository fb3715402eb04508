"""Config loading: strict keys and types, cross-field rules, overrides, a stable hash, the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.core.config import Config, ConfigError, OuterConfig, load_config, parse_override, replace
from p2p_diloco.core.identity import config_hash

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def test_shipped_configs_load() -> None:
    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_config(path)
        assert isinstance(cfg, Config)


def test_unknown_key_in_override_names_it() -> None:
    with pytest.raises(ConfigError, match=r"^outer\.nonexistent: unknown key"):
        load_config(TINY, ["outer.nonexistent=1"])


def test_unknown_key_in_file_names_it(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(TINY.read_text() + "\n[outer.extra]\n")  # a table where none is expected
    with pytest.raises(ConfigError, match=r"^outer\.extra: unknown key"):
        load_config(p)
    p.write_text("[outer]\nnonexistent = 1\n")
    with pytest.raises(ConfigError, match=r"^outer\.nonexistent: unknown key"):
        load_config(p)
    p.write_text("[nosuchsection]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"^nosuchsection: unknown key"):
        load_config(p)


@pytest.mark.parametrize(
    "override, key",
    [
        ("outer.lr='fast'", "outer.lr"),
        ("inner.total_steps=1.5", "inner.total_steps"),
        ("outer.error_feedback=1", "outer.error_feedback"),
        ("sim.speeds=1", "sim.speeds"),
        ("run.seed=true", "run.seed"),
    ],
)
def test_wrong_types_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert str(info.value).startswith(f"{key}: expected"), info.value


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["outer.fragments=3"], "outer.fragments"),  # tiny has 2 blocks
        (["outer.overlap=10"], "outer.overlap"),  # tau >= H
        (["outer.codec='int3'"], "outer.codec"),
        (["outer.merge='median'"], "outer.merge"),
        (["sim.speeds=[1.0, 0.5]"], "sim.speeds"),  # tiny has 3 learners
        (["model.n_embd=33"], "model.n_embd"),
        (["inner.warmup_steps=40"], "inner.warmup_steps"),
        (["run.run_id='a b'"], "run.run_id"),
        (["outer.alpha=1.0"], "outer.alpha"),
    ],
)
def test_impossible_combinations_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert str(info.value).startswith(f"{key}:")
    assert "\n" not in str(info.value)


def test_override_parsing() -> None:
    assert parse_override("outer.lr=0.5") == (["outer", "lr"], 0.5)
    assert parse_override("outer.codec=int8") == (["outer", "codec"], "int8")  # bare string
    assert parse_override("sim.speeds=[1, 0.5]") == (["sim", "speeds"], [1, 0.5])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("outer.lr")
    with pytest.raises(ConfigError, match="malformed key"):
        parse_override("outer..lr=1")


def test_hash_is_stable_and_sensitive(tmp_path: Path) -> None:
    a = load_config(TINY)
    # the same values spelled differently (explicit defaults, 0.5 vs 0.50, key order) hash the same
    assert OuterConfig().lr == 0.5 and OuterConfig().momentum == 0.9  # the defaults tiny.toml leaves alone
    reordered = tmp_path / "same.toml"
    reordered.write_text(TINY.read_text().replace("[outer]\n", "[outer]\nmomentum = 0.9\nlr = 0.50\n"))
    assert config_hash(load_config(reordered)) == config_hash(a)
    assert config_hash(a) == config_hash(load_config(TINY, ["outer.lr=0.5", "outer.momentum=0.9"]))
    assert config_hash(a) == config_hash(load_config(TINY, ["outer.lr=0.50"]))
    assert config_hash(a) != config_hash(load_config(TINY, ["outer.lr=0.51"]))
    assert len(config_hash(a)) == 16
    assert config_hash(replace(a, outer={"lr": 0.5})) == config_hash(load_config(TINY, ["outer.lr=0.5"]))


def test_frozen() -> None:
    cfg = load_config(TINY)
    with pytest.raises(AttributeError):
        cfg.outer.lr = 1.0  # type: ignore[misc]


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    # one line that lists the bundled configs
    with pytest.raises(ConfigError, match=r"nope.toml: no such file, and no bundled config 'nope.toml' "
                                          r"\(bundled: bench, demo, llama-20m, llama-3m, llama-tiny, tiny\)$"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[outer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_bundled_configs_load_by_name_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here
    want = config_hash(load_config(TINY))
    for name in ("configs/tiny.toml", "tiny.toml", "tiny", "elsewhere/tiny.toml"):
        assert config_hash(load_config(name)) == want, name
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text(TINY.read_text().replace('run_id = "tiny"', 'run_id = "mine"'))
    assert load_config("configs/tiny.toml").run.run_id == "mine"  # a file that exists is read, not the bundled one
    assert load_config("tiny").run.run_id == "tiny"


def test_a_removed_key_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``averaging.round_timeout_s`` was validated and hashed but never read. An old config (a checkpoint's
    manifest records its run's whole config) still loads, with one warning line, and hashes as without it."""
    old = tmp_path / "old.toml"
    old.write_text(TINY.read_text().replace("[averaging]\n", "[averaging]\nround_timeout_s = 30.0\n"))
    with caplog.at_level("WARNING", logger="p2p_diloco.core.config"):
        cfg = load_config(old)
    assert config_hash(cfg) == config_hash(load_config(TINY))
    assert not hasattr(cfg.averaging, "round_timeout_s")
    assert [r.getMessage() for r in caplog.records] == [
        "config: averaging.round_timeout_s is no longer a config key (it was never read: a round is bounded by "
        "its matchmaking window and averaging.allreduce_timeout_s); ignored"]
    assert config_hash(load_config(TINY, ["averaging.round_timeout_s=14"])) == config_hash(cfg)


def test_every_config_key_is_read_outside_config_py() -> None:
    """A key nothing reads is noise in every config and in the hash: each field of each section must be read
    (``.name``) somewhere in the package besides config.py."""
    import dataclasses
    import re

    sources = "\n".join(p.read_text() for p in (ROOT / "p2p_diloco").rglob("*.py") if p.name != "config.py")
    unread = [f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
              for f in dataclasses.fields(getattr(Config(), section.name))
              if not re.search(rf"\.{f.name}\b", sources)]
    assert unread == []


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_cli_config_prints_resolved_config_and_hash() -> None:
    r = _cli("config", "--config", str(TINY), "--set", "outer.sync_every=20")
    assert r.returncode == 0, r.stderr
    assert "sync_every = 20" in r.stdout
    assert f"config_hash = {config_hash(load_config(TINY, ['outer.sync_every=20']))}" in r.stdout


def test_cli_config_unknown_key_is_one_line_error(tmp_path: Path) -> None:
    r = _cli("config", "--config", str(TINY), "--set", "outer.nonexistent=1")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "outer.nonexistent" in lines[0], r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[outer]\nnonexistent = 1\n")
    r = _cli("config", "--config", str(bad))
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "outer.nonexistent" in lines[0], r.stderr


def test_help_imports_neither_torch_nor_hivemind() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from p2p_diloco.cli import main as cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        cli.main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'hivemind', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    r = _cli("--help")
    assert r.returncode == 0 and "config" in r.stdout


@pytest.mark.parametrize("override", ["inner.lr=inf", "inner.lr=nan", "outer.lr=-inf", "averaging.window_s=inf"])
def test_non_finite_numbers_are_refused_naming_the_key(override: str) -> None:
    # inf passed every "> 0" check and trained to a NaN loss
    key = re.escape(override.split("=")[0])
    with pytest.raises(ConfigError, match=rf"^{key}: expected a finite number, got"):
        load_config(None, [override])
