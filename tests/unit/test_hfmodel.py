"""Hugging Face causal LMs as the model of a run: config checks, a hash without paths, seeded init, the loss."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2p_diloco.core.config import ConfigError, load_config, render
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.identity import model_identity
from p2p_diloco.core.inner import build_optimizer, train_step
from p2p_diloco.core.model import build_model, lm_loss, vocab_size

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TINY = ROOT / "configs" / "llama-tiny.toml"


def _table(cfg_path: Path = LLAMA_TINY) -> dict[str, object]:
    table = load_config(cfg_path).model.hf_config
    assert isinstance(table, dict)
    return table


def _save_config(folder: Path) -> Path:
    """The llama-tiny architecture written as transformers writes it (config.json)."""
    from transformers import AutoConfig

    table = dict(_table())
    AutoConfig.for_model(str(table.pop("model_type")), **table).save_pretrained(folder)
    return folder


def test_llama_tiny_loads_renders_and_hashes() -> None:
    cfg = load_config(LLAMA_TINY)
    assert cfg.model.kind == "hf" and vocab_size(cfg.model) == 256
    text = render(cfg)
    assert "\nn_layer = " not in text and 'model_type = "llama"' in text
    assert config_hash(load_config(None, [])) != config_hash(cfg)
    assert config_hash(cfg) == config_hash(load_config(LLAMA_TINY, ["model.hf_config.hidden_size=64"]))
    assert config_hash(cfg) != config_hash(load_config(LLAMA_TINY, ["model.hf_config.intermediate_size=192"]))


def test_rendered_config_loads_back(tmp_path: Path) -> None:
    cfg = load_config(LLAMA_TINY)
    (tmp_path / "again.toml").write_text(render(cfg))
    assert load_config(tmp_path / "again.toml") == cfg


def test_the_hash_covers_the_architecture_not_the_path(tmp_path: Path) -> None:
    inline = config_hash(load_config(LLAMA_TINY))
    a, b = _save_config(tmp_path / "a"), tmp_path / "b"
    shutil.copytree(a, b)
    for where in (a, b, a / "config.json"):
        cfg = load_config(LLAMA_TINY, [f"model.hf_config={str(where)!r}"])
        assert config_hash(cfg) == inline, where
        assert str(tmp_path) not in str(model_identity(cfg.model))


@pytest.mark.parametrize("overrides, message", [
    (["model.hf_config.model_type='nope'"], "model.hf_config.model_type: unknown model type 'nope'"),
    (["model.hf_config.model_type='t5'"], "model.hf_config.model_type: model type 't5' has no causal-LM class"),
    (["model.hf_config.hidden_sise=64"], "model.hf_config.hidden_sise: unknown key for model_type 'llama'"),
    (["model.hf_config.hidden_size=66"], "model.hf_config: transformers refuses it:"),
    (["model.hf_config='/nonexistent/llama'"], "model.hf_config: no such file or folder: '/nonexistent/llama'"),
    (["model.hf_config=3"], "model.hf_config: expected a string or a table, got int 3"),
    (["model.hf_config=''"], "model.hf_config: required with model.kind = \"hf\""),
    (["model.init_from='/nonexistent/weights'"], "model.init_from: no such folder: '/nonexistent/weights'"),
    (["model.n_layer=8"], "model.n_layer: is a byte-gpt key"),
    (["model.block_size=128"], "model.block_size: must be <= the model's max_position_embeddings=64, got 128"),
    (["model.hf_config.vocab_size=100"], "model.hf_config.vocab_size: must be >= 256"),
    (["outer.fragments=3"], "outer.fragments: must be in [1, model.hf_config.num_hidden_layers=2]"),
    (["model.kind='gpt'"], "model.kind: must be one of byte-gpt, hf, got 'gpt'"),
])
def test_bad_hf_configs_are_one_line_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(LLAMA_TINY, overrides)
    assert str(info.value).startswith(message), info.value
    assert "\n" not in str(info.value)


def test_hf_keys_are_refused_for_the_byte_gpt() -> None:
    with pytest.raises(ConfigError, match=r"^model\.hf_config: is only read with model\.kind = \"hf\""):
        load_config(None, ["model.hf_config={model_type = 'llama'}"])
    with pytest.raises(ConfigError, match=r"^model\.init_from: is only read"):
        load_config(None, ["model.init_from='x'"])


def test_a_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model\.hf_config: folder .* holds no config\.json$"):
        load_config(LLAMA_TINY, [f"model.hf_config={str(tmp_path)!r}"])
    (tmp_path / "config.json").write_text('{"model_type": "nope"}')
    with pytest.raises(ConfigError, match=r"^model\.hf_config \(config\.json\) model_type: unknown model type 'nope'"):
        load_config(LLAMA_TINY, [f"model.hf_config={str(tmp_path)!r}"])


def test_seeded_init_is_identical_on_every_peer() -> None:
    m = load_config(LLAMA_TINY).model
    a, b, other = build_model(m, seed=0), build_model(m, seed=0), build_model(m, seed=1)
    assert a.training and next(a.parameters()).dtype == torch.float32
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(sa[name], dict(other.named_parameters())[name])
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tie_word_embeddings = true


def test_lm_loss_is_the_causal_lm_loss_on_shifted_batches() -> None:
    """Our (x, y) batches are already shifted; HF's ``labels=`` shifts by itself: the two losses agree."""
    model = build_model(load_config(LLAMA_TINY).model, seed=0)
    ids = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    ours = lm_loss(model, ids[:, :-1], ids[:, 1:])
    theirs = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)


def test_inner_steps_train_an_hf_model() -> None:
    cfg = load_config(LLAMA_TINY)
    model = build_model(cfg.model, seed=0)
    opt = build_optimizer(model, cfg.inner)
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    losses = [train_step(model, opt, (ids[:, :-1], ids[:, 1:]), step, 20, cfg.inner) for step in range(12)]
    assert losses[-1] < losses[0] - 0.5


def test_init_from_loads_the_weights_and_hashes_their_contents(tmp_path: Path) -> None:
    cfg = load_config(LLAMA_TINY)
    trained = build_model(cfg.model, seed=5)
    trained.save_pretrained(tmp_path / "w1")
    shutil.copytree(tmp_path / "w1", tmp_path / "w2")
    start = load_config(LLAMA_TINY, [f"model.init_from={str(tmp_path / 'w1')!r}"])
    model = build_model(start.model, seed=0)
    assert all(torch.equal(p, dict(trained.named_parameters())[n]) for n, p in model.named_parameters())
    moved = load_config(LLAMA_TINY, [f"model.init_from={str(tmp_path / 'w2')!r}"])
    assert config_hash(moved) == config_hash(start) != config_hash(cfg)
    # the architecture can come from the weights' folder alone
    alone = load_config(LLAMA_TINY, ["model.hf_config=''", f"model.init_from={str(tmp_path / 'w1')!r}"])
    assert config_hash(alone) == config_hash(start)
    with torch.no_grad():
        trained.model.norm.weight.add_(1.0)
    trained.save_pretrained(tmp_path / "w2")
    changed = load_config(LLAMA_TINY, [f"model.init_from={str(tmp_path / 'w2')!r}"])
    assert config_hash(changed) != config_hash(start)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"^model\.init_from: folder .* holds no weights"):
        load_config(LLAMA_TINY, [f"model.init_from={str(empty)!r}"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_config_prints_an_hf_config_and_its_hash() -> None:
    r = _cli("config", "--config", str(LLAMA_TINY))
    assert r.returncode == 0, r.stderr
    assert 'kind = "hf"' in r.stdout and f"config_hash = {config_hash(load_config(LLAMA_TINY))}" in r.stdout
    r = _cli("config", "--config", str(LLAMA_TINY), "--set", "model.hf_config.model_type=nope")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "model.hf_config.model_type: unknown model type 'nope'" in lines[0]
