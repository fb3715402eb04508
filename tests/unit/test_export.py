"""``p2p-diloco export``: the anchors of a learner checkpoint, written as a model other tools load.

No processes: a model is built, a checkpoint is written the way the learner writes one (weights, AdamW
state and anchors that differ from the weights), exported through the CLI and loaded back; the logits must
be the anchors' logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_diloco.cli import main as cli
from p2p_diloco.learner.checkpoint import portable_config, save_checkpoint
from p2p_diloco.core.config import Config, load_config, load_config_data
from p2p_diloco.core.identity import config_hash
from p2p_diloco.tools.export import EXPORT_INFO_FILE, load_byte_gpt, model_fingerprint, save_tokenizer
from p2p_diloco.core.model import build_model

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TINY = ROOT / "configs" / "llama-tiny.toml"
SMALL_GPT = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "outer.fragments=2"]
TOLERANCE = 1e-5


def _anchors(cfg: Config) -> dict[str, torch.Tensor]:
    """The global model of a pretend run: the initial weights moved by a seeded random step."""
    model = build_model(cfg.model, cfg.run.seed)
    gen = torch.Generator().manual_seed(1234)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _write_checkpoint(root: Path, cfg: Config, anchors: dict[str, torch.Tensor], step: int = 30,
                      with_config: bool = True) -> Path:
    """A checkpoint laid out as :meth:`p2p_diloco.learner.loop.Learner.checkpoint_state` lays it out: the local
    weights (here deliberately far from the anchors), AdamW moments, the anchors and outer momenta."""
    tensors: dict[str, torch.Tensor] = {}
    for n, a in anchors.items():
        tensors[f"model/{n}"] = a + 1.0  # the local replica: not the global model
        tensors[f"adam/{n}/exp_avg"] = torch.zeros_like(a)
        tensors[f"anchor/{n}"] = a
        tensors[f"momentum/{n}"] = torch.zeros_like(a)
    meta: dict[str, Any] = {"config_hash": config_hash(cfg), "run_id": cfg.run.run_id, "name": "peer-a",
                            "inner_step": step, "tokens": 1000 * step, "versions": [3, 2],
                            "anchor_hashes": ["aaaa", "bbbb"], "model_digest": "x"}
    if with_config:
        meta["config"] = portable_config(cfg)
    return save_checkpoint(root, step, tensors, meta)


def _batch(cfg: Config, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (3, cfg.model.block_size), generator=torch.Generator().manual_seed(7))


def _reference_logits(cfg: Config, anchors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The anchors' logits, computed directly (no export)."""
    model = build_model(cfg.model, cfg.run.seed).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(anchors[n])
        out = model(x) if cfg.model.kind != "hf" else model(input_ids=x)
    return out[0] if isinstance(out, tuple) else out.logits


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["export", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_byte_gpt_export_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, SMALL_GPT)
    anchors = _anchors(cfg)
    _write_checkpoint(tmp_path / "ckpt", cfg, anchors, step=10)
    _write_checkpoint(tmp_path / "ckpt", cfg, {n: a * 2 for n, a in anchors.items()}, step=20)  # the newest
    rc, out, err = _export(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))
    assert rc == 0, err
    assert "step 20" in out and "byte-gpt n_layer=2" in out
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == sorted(["config.json", "model.safetensors", EXPORT_INFO_FILE])
    model = load_byte_gpt(tmp_path / "out")
    x = _batch(cfg)
    with torch.no_grad():
        got = model(x)[0]
    want = _reference_logits(cfg, {n: a * 2 for n, a in anchors.items()}, x)
    diff = (got - want).abs().max().item()
    print(f"byte GPT export: max abs logit difference {diff:.3g}")
    assert diff <= TOLERANCE
    assert model.lm_head.weight is model.wte.weight  # still tied
    info = json.loads((tmp_path / "out" / EXPORT_INFO_FILE).read_text())
    assert info["step"] == 20 and info["kind"] == "byte-gpt" and info["config_hash"] == config_hash(cfg)
    assert info["parameters"] == sum(a.numel() for a in anchors.values())


def test_hf_llama_export_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    cfg = load_config(LLAMA_TINY)
    anchors = _anchors(cfg)
    _write_checkpoint(tmp_path / "ckpt", cfg, anchors)
    rc, out, err = _export(capsys, "--checkpoint", str(tmp_path / "ckpt" / "ckpt-00000030"),
                           "--out", str(tmp_path / "out"), "--config", str(LLAMA_TINY), "--json")
    assert rc == 0, err
    written = json.loads(out)
    assert {"config.json", "model.safetensors", EXPORT_INFO_FILE} <= set(written["files"])
    assert written["tokenizer"].startswith("bytes")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as trained
    x = _batch(cfg)
    with torch.no_grad():
        got = model(input_ids=x).logits
    diff = (got - _reference_logits(cfg, anchors, x)).abs().max().item()
    print(f"HF Llama export: max abs logit difference {diff:.3g}")
    assert diff <= TOLERANCE


def test_the_manifest_config_rebuilds_an_hf_model_from_a_file_without_the_file(tmp_path: Path) -> None:
    """A run whose hf_config is a local config.json records the architecture inline: export needs no file."""
    from transformers import AutoConfig

    table = dict(load_config(LLAMA_TINY).model.hf_config)  # type: ignore[arg-type]
    AutoConfig.for_model(str(table.pop("model_type")), **table).save_pretrained(tmp_path / "arch")
    cfg = load_config(LLAMA_TINY, [f"model.hf_config={str(tmp_path / 'arch')!r}"])
    recorded = load_config_data(portable_config(cfg))
    assert isinstance(recorded.model.hf_config, dict)
    assert model_fingerprint(recorded.model) == model_fingerprint(cfg.model)
    assert config_hash(recorded) == config_hash(cfg)


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, SMALL_GPT)
    _write_checkpoint(tmp_path / "ckpt", cfg, _anchors(cfg))
    rc, out, err = _export(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                           "--config", str(LLAMA_TINY))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    theirs, their_hash = model_fingerprint(cfg.model)
    assert f"is of model {theirs} (hash {their_hash}), --config {LLAMA_TINY} says hf llama" in err
    assert not (tmp_path / "out").exists()
    # the same model with other training settings is the same model
    rc, _, err = _export(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                         *[a for s in [*SMALL_GPT, "inner.lr=0.01"] for a in ("--set", s)])
    assert rc == 0, err


def test_a_checkpoint_without_its_config_takes_one_with_its_hash(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, SMALL_GPT)
    anchors = _anchors(cfg)
    _write_checkpoint(tmp_path / "ckpt", cfg, anchors, with_config=False)
    base = ["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    rc, _, err = _export(capsys, *base)
    assert rc == 2 and "does not record its config" in err and err.count("\n") == 1
    rc, _, err = _export(capsys, *base, "--set", "model.n_layer=3", "--set", "outer.fragments=2")
    assert rc == 2 and f"config hash {config_hash(cfg)}, --set hashes to" in err and err.count("\n") == 1
    rc, _, err = _export(capsys, *base, *[a for s in SMALL_GPT for a in ("--set", s)])
    assert rc == 0, err
    x = _batch(cfg)
    with torch.no_grad():
        diff = (load_byte_gpt(tmp_path / "out")(x)[0] - _reference_logits(cfg, anchors, x)).abs().max().item()
    assert diff <= TOLERANCE


def test_bad_inputs_get_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, SMALL_GPT)
    anchors = _anchors(cfg)
    _write_checkpoint(tmp_path / "ckpt", cfg, anchors)
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    partial = {n: a for n, a in anchors.items() if not n.startswith("blocks.1.")}
    _write_checkpoint(tmp_path / "partial", cfg, partial)
    cases = [
        (["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o1")], "nope does not exist"),
        (["--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "o2")], "no complete ckpt-* folder"),
        (["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "full")], "exists and is not empty"),
        (["--checkpoint", str(tmp_path / "partial"), "--out", str(tmp_path / "o3")],
         "does not fit the model of its config: 12 parameters without an anchor (blocks.1."),
    ]
    for args, expected in cases:
        rc, out, err = _export(capsys, *args)
        assert rc == 2 and out == "", (args, err)
        assert err.startswith("p2p-diloco: error: ") and err.count("\n") == 1 and expected in err, (args, err)
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left behind
    rc, _, err = _export(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "full"), "--force")
    assert rc == 0, err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and (tmp_path / "full" / "model.safetensors").exists()


def test_the_tokenizer_hook_saves_a_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert save_tokenizer("bytes", tmp_path / "unused").startswith("bytes")
    (tmp_path / "out").mkdir()
    assert "vocabulary 3" in save_tokenizer(str(tmp_path / "tokenizer.json"), tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tokenizer("hello world")["input_ids"] == [1, 2]
    with pytest.raises(ValueError, match="data.tokenizer: no such file or folder"):
        save_tokenizer(str(tmp_path / "missing"), tmp_path / "out")
