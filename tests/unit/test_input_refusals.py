"""Bad model, data and key inputs are refused before a learner joins: one stderr line naming the key or the file,
exit code 2. The model is built on the meta device (shapes, no memory) and its training memory estimated against
this machine's; every .txt file is checked for UTF-8; a key file's content problem is reported with its mode.

Most cases run ``cli.main`` in this process with ``joined_run`` replaced by a function that fails the test
(the checks must come before it); the huge model also runs as a real ``p2p-diloco join`` process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from p2p_diloco.net import joined as joined_module
from p2p_diloco.cli import main as cli
from p2p_diloco.core import datasource
from p2p_diloco.core import model as model_mod
from p2p_diloco.core.config import ConfigError, load_config
from procs import UNREACHABLE_PEER as PEER
from procs import child_pids
from test_hfmodel import LLAMA_TINY, ROOT

HUGE = "model.hf_config.hidden_size=1048576"
"""llama-tiny 16384 times wider: 6.6e12 parameters, about 144 TiB to train."""


def _join(*extra: str) -> list[str]:
    return ["join", "--initial-peers", PEER, "--config", str(LLAMA_TINY), *extra]


@pytest.fixture(autouse=True)
def never_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_a: Any, **_k: Any) -> None:
        raise AssertionError("joined before checking the inputs")

    monkeypatch.setattr(joined_module, "joined_run", never)  # what Swarm.from_options calls


@pytest.fixture
def config_refused(capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """Like conftest's ``refused``, for a ConfigError: one ``p2p-diloco: config error:`` line with every
    ``expected`` text, exit 2, nothing on stdout, no child process left. Returns the line."""

    def run(argv: list[str], *expected: str) -> str:
        before = set(child_pids())
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and out == "", (rc, out, err)
        assert len(lines) == 1 and lines[0].startswith("p2p-diloco: config error: "), err
        for text in expected:
            assert text in lines[0], (text, lines[0])
        assert set(child_pids()) <= before, "a process was left running"
        return lines[0]

    return run


# ---------------------------------------------------------------- items 1, 2, 4: sizes checked at validation


def test_key_value_heads_must_divide_the_attention_heads(config_refused: Callable[..., str]) -> None:
    config_refused(_join("--set", "model.hf_config.num_key_value_heads=3"),
                   "model.hf_config.num_key_value_heads: must divide num_attention_heads=4", "got 3")


@pytest.mark.parametrize("key, value", [("intermediate_size", -4), ("num_attention_heads", 0), ("head_dim", -1),
                                        ("num_hidden_layers", 0)])
def test_sizes_must_be_positive(config_refused: Callable[..., str], key: str, value: int) -> None:
    config_refused(_join("--set", f"model.hf_config.{key}={value}"),
                   f"model.hf_config.{key}: must be an integer >= 1, got {value}")


def test_zero_layers_is_refused_whatever_the_fragments() -> None:
    """outer.fragments = 2 was accepted for 0 layers (0 blocks read as 'unknown'), and a model without blocks trained."""
    for fragments in (1, 2):
        with pytest.raises(ConfigError, match=r"^model\.hf_config\.num_hidden_layers: must be an integer >= 1, got 0$"):
            load_config(LLAMA_TINY, ["model.hf_config.num_hidden_layers=0", f"outer.fragments={fragments}"])


def test_gpt2_keys_are_named_as_written() -> None:
    with pytest.raises(ConfigError, match=r"^model\.hf_config\.n_layer: must be an integer >= 1, got 0$"):
        load_config(LLAMA_TINY, ["model.hf_config={model_type='gpt2', vocab_size=256, n_layer=0, n_positions=64}",
                                 "outer.fragments=1"])


# ---------------------------------------------------------------- item 3: built on meta, memory estimated


def test_a_model_too_large_for_this_machine_is_refused_by_the_real_cli(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *_join("--set", HUGE)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("p2p-diloco: config error: model.hf_config: the model has 6.6e12 parameters, about "), lines
    assert "TiB to train (weights, gradients, AdamW moments, anchors, outer momentum); this machine has " in lines[0]
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    print(f"\nrefused {time.monotonic() - started:.1f} s after start: {lines[0]}")


def test_sim_and_swarm_count_every_learner(config_refused: Callable[..., str]) -> None:
    config_refused(["sim", "--config", str(LLAMA_TINY), "--set", HUGE], "for 3 learners (sim.learners)")
    config_refused(["swarm", "--config", str(LLAMA_TINY), "--set", HUGE, "--peers", "4"], "for 4 learners (--peers)")


def test_the_estimate_counts_six_fp32_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    m = load_config(ROOT / "configs" / "tiny.toml").model
    n = model_mod.count_parameters(model_mod.build_model(m, seed=0))
    assert model_mod.TRAINING_COPIES == 6
    cpu = torch.device("cpu")
    monkeypatch.setattr(model_mod, "available_ram", lambda: 6 * 4 * n * 2)
    assert model_mod.check_buildable(m, cpu, replicas=2) == n  # exactly fits
    with pytest.raises(ConfigError, match=rf"^model: the model has {n:,} parameters, .* for 3 learners \(sim\.learners\)"):
        model_mod.check_buildable(m, cpu, replicas=3, replicas_what="sim.learners")
    assert model_mod.check_buildable(m) == n  # no device: the structure only


def test_a_model_transformers_cannot_build_names_the_config() -> None:
    """Sizes transformers only checks while building (GPT-2: width a multiple of the heads) fail on meta."""
    cfg = load_config(LLAMA_TINY, ["model.hf_config={model_type='gpt2', vocab_size=256, n_embd=66, n_head=4, n_layer=2, "
                                   "n_positions=64, bos_token_id=1, eos_token_id=2}"])
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^model\.hf_config: transformers cannot build this model: `embed_dim` must "
                                          r"be divisible by num_heads"):
        model_mod.check_buildable(cfg.model, torch.device("cpu"))
    assert model_mod.check_buildable(load_config(LLAMA_TINY).model, torch.device("cpu")) == 90_432
    assert time.monotonic() - started < 5  # meta builds: no memory, no init


# ---------------------------------------------------------------- item 5: a .txt file that is not UTF-8


def test_a_non_utf8_text_file_is_named_with_its_offset(tmp_path: Path, refused: Callable[..., str]) -> None:
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("\n\n".join(f"document {i} " + "the quick brown fox " * 20 for i in range(300)))
    bad = folder / "sub" / "z.txt"
    bad.write_bytes(b"hello\n\n" * 100 + b"\xd6\xd6\xff more\n")
    refused(_join("--set", "data.source='files'", "--set", f"data.path={str(folder)!r}"),
            f"data.path: {bad}: not UTF-8 text at byte 700 (0xd6: invalid continuation byte)")


def test_utf8_offsets_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes("é".encode() * 10 + b"\xff")
    for chunk in (1, 3, 4 << 20):
        monkeypatch.setattr(datasource, "UTF8_CHUNK", chunk)
        with pytest.raises(ValueError, match=rf"^data\.path: {path}: not UTF-8 text at byte 20 \(0xff: invalid start byte\)"):
            datasource.check_utf8(path)
    path.write_bytes("é".encode() * 10)
    datasource.check_utf8(path)  # a character split between two chunks is fine
    path.write_bytes(b"ab\xc3")
    with pytest.raises(ValueError, match=r"at byte 2 \(0xc3: unexpected end of data\)"):
        datasource.check_utf8(path)


# ---------------------------------------------------------------- item 6: key files, content and mode at once


@pytest.mark.parametrize("content, problem", [(b"", "empty file (expected one line of 64 hex digits"),
                                              (b"zz\n", "not a swarm key (expected one line of 64 hex digits"),
                                              (b"\xff\xfe\x00", "not a swarm key (binary; expected")])
def test_swarm_key_content_and_mode_in_one_line(tmp_path: Path, refused: Callable[..., str], content: bytes,
                                                problem: str) -> None:
    key = tmp_path / "k.key"
    key.write_bytes(content)
    os.chmod(key, 0o644)
    refused(_join("--swarm-key", str(key)), f"--swarm-key {key}: {problem}",
            f"; also mode 0644 is readable by others: chmod 600 {key}")
    os.chmod(key, 0o600)
    line = refused(_join("--swarm-key", str(key)), f"--swarm-key {key}: {problem}")
    assert "readable by others" not in line


def test_identity_content_and_mode_in_one_line(tmp_path: Path, refused: Callable[..., str]) -> None:
    for name, content, problem in (("empty.id", b"", "empty file, not a p2p-diloco/libp2p key"),
                                   ("junk.id", b"garbage", "is not a p2p-diloco/libp2p key (Ed25519 or RSA)")):
        path = tmp_path / name
        path.write_bytes(content)
        os.chmod(path, 0o644)
        refused(_join("--identity", str(path)), f"identity file {path}: {problem}",
                f"move it away to create a new one; also mode 0644 is readable by others: chmod 600 {path}")
