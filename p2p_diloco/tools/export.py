"""``p2p-diloco export``: the global model of a learner checkpoint, in a form other tools load.

The global model is the **anchors** (each fragment's anchor tensors, ``anchor/<parameter>`` in a
checkpoint), not the learner's local replica (``model/<parameter>``), which is ahead of the swarm by its
unsynced inner steps. :func:`export` finds the newest checkpoint that verifies
(:func:`p2p_diloco.learner.checkpoint.load_checkpoint`), rebuilds the model from the config the checkpoint records
(:func:`p2p_diloco.learner.checkpoint.portable_config`; an older checkpoint without one takes ``--config``, checked
against its config hash), loads the anchors into every parameter and writes ``--out``:

``model.kind = "hf"`` -- a Hugging Face folder, ``AutoModelForCausalLM.from_pretrained(out)`` loads it::

    out/config.json                 the transformers config (save_pretrained)
    out/generation_config.json      (save_pretrained)
    out/model.safetensors           the weights, fp32; tied weights stored once (save_pretrained)
    out/tokenizer*.json ...         the run's tokenizer, when its config names one (:func:`save_tokenizer`)
    out/p2p_diloco_export.json      where it came from (see below)

``model.kind = "byte-gpt"`` -- the built-in byte GPT (:class:`p2p_diloco.core.model.ByteGPT`); :func:`load_byte_gpt`
loads it (its docstring spells the layout out)::

    out/model.safetensors           parameters by name, fp32 (lm_head.weight is wte.weight: stored once)
    out/config.json                 {"model_type": "p2p-diloco-byte-gpt", "format": 1, "vocab_size": 256,
                                     "n_layer", "n_head", "n_embd", "block_size", "dropout"}
    out/p2p_diloco_export.json      where it came from

``p2p_diloco_export.json`` (both kinds): the checkpoint folder and step, the run id, the run's config hash,
the fragments' versions and anchor hashes, the tokens the learner had trained on, the model's description
and hash (:func:`model_fingerprint`), its parameter count and the tokenizer.

Bad input is a ``ValueError`` (``ConfigError`` for a config) with one line naming it: a missing path or
one that holds no checkpoint, a checkpoint whose model is not the one ``--config`` describes, anchors that
do not cover the model's parameters, an ``--out`` that exists and is not empty (unless ``force``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from p2p_diloco.core.config import (
    Config,
    ConfigError,
    ModelConfig,
    load_config_data,
)
from p2p_diloco.core.identity import config_hash, model_identity
from p2p_diloco.core.devices import load_into, to_host
from p2p_diloco.core.model import VOCAB_SIZE, ByteGPT, build_model
from p2p_diloco.learner.checkpoint import Checkpoint, load_checkpoint

log = logging.getLogger(__name__)

EXPORT_INFO_FILE = "p2p_diloco_export.json"
BYTE_GPT_TYPE = "p2p-diloco-byte-gpt"
BYTE_GPT_FORMAT = 1
BYTE_GPT_WEIGHTS = "model.safetensors"
BYTE_GPT_CONFIG = "config.json"
ANCHOR_PREFIX = "anchor/"
BYTES_TOKENIZER = "bytes"
_SIZE_KEYS = (("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd", "d_model"), ("vocab_size",))
"""Keys of a transformers config that describe a model's size, by their names in different model types."""


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote."""

    out: Path
    files: tuple[str, ...]
    """The file names in ``out`` afterwards, sorted."""
    info: dict[str, Any]
    """The contents of ``p2p_diloco_export.json``."""


def model_fingerprint(m: ModelConfig) -> tuple[str, str]:
    """A short description of the model a section builds and a 12-hex-digit hash of it: its
    :func:`~p2p_diloco.core.identity.model_identity` without the ``init_from`` weights (a checkpoint holds every
    weight; where the first ones came from does not change the model). Imports transformers for hf only."""
    identity = {k: v for k, v in model_identity(m).items() if k != "init_weights"}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    if m.kind != "hf":
        what = f"byte-gpt n_layer={m.n_layer} n_head={m.n_head} n_embd={m.n_embd} block_size={m.block_size}"
    else:
        arch = identity["architecture"]
        sizes = [next(f"{k}={arch[k]}" for k in keys if k in arch)
                 for keys in _SIZE_KEYS if any(k in arch for k in keys)]
        what = " ".join(["hf", str(arch.get("model_type", "?")), *sizes, f"block_size={m.block_size}"])
    return what, digest


def checkpoint_config(ckpt: Checkpoint, config: Config | None = None, config_label: str = "--config") -> Config:
    """The run config of a learner checkpoint: the one its manifest records, checked against ``config`` when
    given (the same model, else a ``ValueError`` naming both); for a checkpoint written before manifests
    recorded the config, ``config`` itself, whose config hash must be the checkpoint's."""
    stored = ckpt.manifest.get("config")
    if stored is None:
        if config is None:
            raise ValueError(f"checkpoint {ckpt.path} does not record its config (it predates that): give the "
                             "--config FILE (and --set overrides) of its run")
        have, want = config_hash(config), ckpt.manifest.get("config_hash")
        if have != want:
            raise ValueError(f"checkpoint {ckpt.path} is of a run with config hash {want}, {config_label} hashes to "
                             f"{have} (another model or other settings)")
        return config
    try:
        recorded = load_config_data(stored)
    except ConfigError as e:
        raise ConfigError(f"checkpoint {ckpt.path}: the config it records does not load here: {e}") from e
    if config is not None:
        (theirs, their_hash), (ours, our_hash) = model_fingerprint(recorded.model), model_fingerprint(config.model)
        if their_hash != our_hash:
            raise ValueError(f"checkpoint {ckpt.path} is of model {theirs} (hash {their_hash}), {config_label} says "
                             f"{ours} (hash {our_hash})")
    return recorded


def anchors_of(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The global model in a learner checkpoint: its ``anchor/<parameter>`` tensors, by parameter name."""
    anchors = {k[len(ANCHOR_PREFIX):]: t for k, t in ckpt.tensors.items() if k.startswith(ANCHOR_PREFIX)}
    if not anchors:
        raise ValueError(f"checkpoint {ckpt.path} holds no anchors ({ANCHOR_PREFIX}<parameter> tensors): "
                         "not a learner's checkpoint")
    return anchors


def global_model(ckpt: Checkpoint, cfg: Config) -> torch.nn.Module:
    """The model of ``cfg`` with the checkpoint's anchors in every parameter, fp32, in eval mode.

    An hf model is built from its resolved architecture, never from ``init_from`` (the anchors overwrite
    every weight). ``ValueError`` naming the checkpoint if the anchors and the parameters differ in names or
    shapes: every parameter must be covered, and nothing else may be there."""
    m = cfg.model
    if m.kind == "hf" and m.init_from:
        from p2p_diloco.core import hfmodel

        m = dataclasses.replace(m, hf_config=hfmodel.architecture(m), init_from="")
    model = build_model(m, cfg.run.seed)
    load_anchors(model, anchors_of(ckpt), f"checkpoint {ckpt.path}")
    return model.eval()


def load_anchors(model: torch.nn.Module, anchors: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``anchors`` into ``model``'s parameters (tied ones are listed once by ``named_parameters``)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(anchors))
    extra = sorted(set(anchors) - set(params))
    shapes = sorted(n for n in set(params) & set(anchors) if tuple(params[n].shape) != tuple(anchors[n].shape))
    if missing or extra or shapes:
        faults = [f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                  for names, what in ((missing, "parameters without an anchor"), (extra, "anchors of no parameter"),
                                      (shapes, "of another shape")) if names]
        raise ValueError(f"{source} does not fit the model of its config: {'; '.join(faults)}")
    load_into(params, anchors)


def save_tokenizer(spec: str, out: Path) -> str:
    """Hook for the run's tokenizer (``data.tokenizer``): write it into ``out`` beside the model, so that
    ``AutoTokenizer.from_pretrained(out)`` loads it; returns what the export info records.

    ``"bytes"`` (the default: token id = byte value, 0-255) has no files. A local folder (``save_pretrained``
    or ``tokenizer.json`` inside) or a ``tokenizer.json`` file is saved with transformers. Nothing downloads.
    """
    if spec in ("", BYTES_TOKENIZER):
        return f"{BYTES_TOKENIZER}: token id = byte value (0-255); no tokenizer files"
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"data.tokenizer: no such file or folder: {spec!r}")
    tokenizer: Any  # fast or sentencepiece: both save_pretrained
    if path.is_file():
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    elif (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    elif (path / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    else:
        raise ValueError(f"data.tokenizer: folder {spec!r} holds neither tokenizer_config.json nor tokenizer.json")
    tokenizer.save_pretrained(str(out))
    return f"{type(tokenizer).__name__} (vocabulary {len(tokenizer)}) from {path.name}"


def write_byte_gpt(model: ByteGPT, folder: Path) -> None:
    """Write a byte GPT as :func:`load_byte_gpt` reads it."""
    m = model.cfg
    config = {"model_type": BYTE_GPT_TYPE, "format": BYTE_GPT_FORMAT, "vocab_size": VOCAB_SIZE,
              "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd, "block_size": m.block_size,
              "dropout": m.dropout}
    tensors = to_host(dict(model.named_parameters()))
    save_file(tensors, str(folder / BYTE_GPT_WEIGHTS), metadata={"format": "pt", "model_type": BYTE_GPT_TYPE})
    (folder / BYTE_GPT_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_byte_gpt(folder: str | Path) -> ByteGPT:
    """Load an exported byte GPT, in eval mode: ``model(idx)`` returns ``(logits, None)`` for byte ids ``idx``
    of shape (batch, t <= block_size); ``logits`` has shape (batch, t, 256).

    The folder holds ``config.json`` -- ``{"model_type": "p2p-diloco-byte-gpt", "format": 1,
    "vocab_size": 256, "n_layer", "n_head", "n_embd", "block_size", "dropout"}`` (the ``[model]`` keys of the
    run) -- and ``model.safetensors``: one fp32 tensor per parameter of :class:`~p2p_diloco.core.model.ByteGPT`,
    by its ``named_parameters()`` name (``wte.weight``, ``wpe.weight``, ``blocks.<i>.ln1.weight``, ...,
    ``ln_f.bias``); the output head ``lm_head.weight`` is tied to ``wte.weight`` and not stored. Without
    p2p_diloco: build the same module and copy the tensors in by name (``safetensors.torch.load_file``).
    """
    folder = Path(folder)
    try:
        config = json.loads((folder / BYTE_GPT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: {BYTE_GPT_CONFIG} unreadable: {e}") from e
    if not isinstance(config, dict) or config.get("model_type") != BYTE_GPT_TYPE:
        found = config.get("model_type") if isinstance(config, dict) else None
        raise ValueError(f"{folder}: not an exported byte GPT ({BYTE_GPT_CONFIG} model_type is {found!r}, "
                         f"expected {BYTE_GPT_TYPE!r})")
    if config.get("format") != BYTE_GPT_FORMAT:
        raise ValueError(f"{folder}: export format {config.get('format')!r}, this loader reads {BYTE_GPT_FORMAT}")
    keys = ("n_layer", "n_head", "n_embd", "block_size", "dropout")
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"{folder}: {BYTE_GPT_CONFIG} lacks {', '.join(missing)}")
    model = ByteGPT(ModelConfig(kind="byte-gpt", **{k: config[k] for k in keys}))
    load_anchors(model, load_file(str(folder / BYTE_GPT_WEIGHTS), device="cpu"), f"{folder / BYTE_GPT_WEIGHTS}")
    return model.eval()


def check_out(out: Path, force: bool) -> None:
    """``--out`` may be new, an empty folder, or (with ``force``) a folder whose files of the same names are
    replaced; anything else is refused before any work is done."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    if not force and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty (--force writes into it, replacing files of the "
                         "same names)")


def export(checkpoint: Path, out: Path, config: Config | None = None, config_label: str = "--config",
           force: bool = False) -> Exported:
    """Write the global model of the newest verified checkpoint under ``checkpoint`` (or of that checkpoint
    folder) into ``out`` (see the module docstring for the layouts). A new ``out`` appears complete or not at
    all: it is written beside, then renamed."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_out(out, force)
    ckpt = load_checkpoint(checkpoint)
    cfg = checkpoint_config(ckpt, config, config_label)
    model = global_model(ckpt, cfg)
    description, model_hash = model_fingerprint(cfg.model)
    m = ckpt.manifest
    info: dict[str, Any] = {
        "format": 1, "kind": cfg.model.kind, "model": description, "model_hash": model_hash,
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint": str(ckpt.path.resolve()), "step": ckpt.step, "run_id": m.get("run_id"),
        "config_hash": m.get("config_hash"), "versions": m.get("versions"), "anchor_hashes": m.get("anchor_hashes"),
        "tokens": m.get("tokens"), "exported_at": time.time(),
    }
    fresh = not out.exists()
    target = out.parent / f".{out.name}.tmp-export-{os.getpid()}" if fresh else out
    if fresh:
        out.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # our own pid, from an earlier process that had it
            shutil.rmtree(target)
        target.mkdir()
    try:
        if cfg.model.kind == "hf":
            pretrained: Any = model  # a transformers PreTrainedModel (nn.Module to the type checker)
            pretrained.save_pretrained(str(target))
            info["tokenizer"] = save_tokenizer(str(getattr(cfg.data, "tokenizer", BYTES_TOKENIZER)), target)
        else:
            assert isinstance(model, ByteGPT)
            write_byte_gpt(model, target)
            info["tokenizer"] = save_tokenizer(BYTES_TOKENIZER, target)
        (target / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if fresh:
            os.rename(target, out)
    except BaseException:
        if fresh and target.exists():
            shutil.rmtree(target)
        raise
    files = tuple(sorted(os.listdir(out)))
    log.info("exported step %d of run %s (%s) to %s: %s", ckpt.step, m.get("run_id"), description, out,
             ", ".join(files))
    return Exported(out=out, files=files, info=info)
