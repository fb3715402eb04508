"""Run configuration: frozen, typed dataclasses loaded from TOML with ``--set a.b=value`` overrides.

Every section is a small frozen dataclass whose field docstrings (the ``help`` metadata) are the
reference documentation. Loading is strict: an unknown key, a value of the wrong type or an
impossible combination raises :class:`ConfigError` with one line that names the key.

This module imports nothing heavy (no torch, no hivemind) so that the CLI stays fast.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import tomllib

from p2p_diloco.core import resources
from p2p_diloco.core.errors import ConfigError as ConfigError  # re-exported: everyone imports it from here

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 4
"""The wire protocol's version: peers of another are foreign (not in our groups, shown apart by ``status``), so a
swarm half-upgraded splits cleanly instead of averaging nothing. 4: a round's metadata carries the member's measured
link, and the parts are no shorter than a tenth of a second on the slowest member's
(:func:`~p2p_diloco.hivemind_ext.compression.link_part_bytes`). 3: an all-reduce's parts are sized to the members'
spans (:func:`~p2p_diloco.hivemind_ext.compression.pipelined_part_bytes`; 2: hivemind's 512 kB). 2: a round's
metadata is a list of its fields with the radial norms packed (1: a dict keyed by field and tensor names)."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class RunConfig:
    run_id: str = _f("p2p-diloco-demo", "Name of the run; peers of different runs never mix.")
    seed: int = _f(0, "Base random seed (model init, data order).")


MODEL_KINDS = ("byte-gpt", "hf")
BYTE_GPT_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout")
"""The keys of the model section before ``kind`` existed: a byte-gpt config hashes over exactly these."""


@dataclass(frozen=True)
class ModelConfig:
    kind: str = _f("byte-gpt", "Model family: 'byte-gpt' (the built-in byte-level GPT, vocabulary 256) or 'hf' (a "
                   "transformers causal LM built from model.hf_config and/or model.init_from).")
    n_layer: int = _f(4, "Transformer blocks (byte-gpt).")
    n_head: int = _f(4, "Attention heads per block (byte-gpt).")
    n_embd: int = _f(128, "Embedding width (byte-gpt).")
    block_size: int = _f(128, "Context length in tokens (bytes for byte-gpt), for every kind.")
    dropout: float = _f(0.0, "Dropout probability (byte-gpt; an hf model takes its own from model.hf_config).")
    hf_config: str | dict[str, Any] = _f("", "kind = 'hf': the transformers config, as an inline table (model_type = "
                                         "\"llama\", hidden_size = 64, ...) or a local config.json or folder holding "
                                         "one; empty = the config of model.init_from. Never downloaded.")
    init_from: str = _f("", "kind = 'hf': a local folder of weights (save_pretrained) to start from, for continued "
                        "pre-training; empty = a seeded random init. Never downloaded.")


DATA_SOURCES = ("embedded", "files", "hf")
TEXT_SAMPLE_BY = ("paragraph", "line", "document")
LEGACY_DATA_KEYS = ("path", "max_bytes", "eval_fraction", "eval_batches", "eval_batch_size")
"""The keys of the data section before ``source`` existed (a data-parallel reference key of the embedded
source hashes over exactly these, so the committed reference curves stay valid)."""


@dataclass(frozen=True)
class DataConfig:
    source: str = _f("embedded", "Where the text comes from: 'embedded' (read whole into memory as bytes, at most "
                     "data.max_bytes: data.path, or this Python's stdlib source when it is empty; no download), "
                     "'files' (data.path: a .txt, .jsonl or .parquet file or a folder of them, streamed through "
                     "the datasets library, tokenized with data.tokenizer) or 'hf' (the hub dataset data.name, "
                     "streamed; needs the network).")
    path: str = _f("", "Text file or folder to train on; empty = the embedded corpus (this Python's stdlib source). "
                   "A local path: it is not part of the config hash (data.fingerprint is).")
    max_bytes: int = _f(8_000_000, "Upper bound on corpus bytes read (0 = no bound); source 'embedded' only ('files' "
                        "and 'hf' are streamed whole).")
    tokenizer: str = _f("bytes", "'bytes' (ids 0-255: the byte GPT's) or a local tokenizer.json or folder holding one "
                        "(scripts/make_tokenizer.py makes one); sources 'files' and 'hf'. A local path: the config "
                        "hash covers data.tokenizer_hash instead.")
    text_field: str = _f("text", "The field of a .jsonl/.parquet row (or hub dataset row) that holds its text.")
    sample_by: str = _f("paragraph", "What one document of a .txt file is: 'paragraph' (text between blank lines), "
                        "'line' or 'document' (the whole file, read into memory).")
    name: str = _f("", "source 'hf': the hub dataset, e.g. 'allenai/c4'.")
    config_name: str = _f("", "source 'hf': the dataset's configuration, e.g. 'en' (empty: its default).")
    split: str = _f("train", "source 'hf': the split to stream (the held-out documents are taken from it by hash).")
    revision: str = _f("", "source 'hf': the dataset revision (a commit hash pins the data; empty: main).")
    fingerprint: str = _f("", "The dataset fingerprint the run trains on (16 hex digits). Empty: computed at start "
                          "from the data (a content hash of the files' relative names, sizes and first and last "
                          "64 KiB; for 'hf' its name, config, split and revision; for 'embedded' the bytes read). "
                          "Set (the config a peer fetches from the DHT has it set): a peer whose data hash otherwise "
                          "is refused before it joins.")
    tokenizer_hash: str = _f("", "The tokenizer's hash the run uses ('bytes' or 16 hex digits). Empty: computed at "
                             "start from data.tokenizer; set: a different local tokenizer is refused.")
    eval_fraction: float = _f(0.05, "Share of the corpus held out for evaluation; no learner trains on it.")
    eval_batches: int = _f(8, "Batches of the held-out split used per evaluation.")
    eval_batch_size: int = _f(32, "Sequences per evaluation batch.")


@dataclass(frozen=True)
class InnerConfig:
    lr: float = _f(3e-3, "Peak AdamW learning rate.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a share of the peak (cosine decay).")
    warmup_steps: int = _f(50, "Linear warm-up steps.")
    total_steps: int = _f(600, "Inner steps per learner (sets the cosine schedule and the token budget).")
    batch_size: int = _f(16, "Sequences per inner step.")
    weight_decay: float = _f(0.1, "AdamW weight decay.")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    grad_clip: float = _f(1.0, "Gradient norm clip (0 = off).")
    precision: str = _f("fp32", "Arithmetic of the forward pass and the loss: 'fp32', or 'bf16' (torch.autocast to "
                        "bfloat16; weights, gradients and AdamW moments stay fp32). Meant for CUDA devices; on a CPU it "
                        "runs too (CPU autocast): faster where the CPU has bf16 instructions (AVX512-BF16, AMX), "
                        "slower elsewhere.")


PRECISIONS = ("fp32", "bf16")
"""``inner.precision`` (:mod:`p2p_diloco.core.devices` applies it)."""

MERGES = ("mean", "radial")
WEIGHTINGS = ("uniform", "tokens", "tokens2")
CODECS = ("fp32", "fp16", "int8", "int4")
ROBUST = ("none", "clip", "trim")
SCHEDULES = ("clock", "steps")
GROUPINGS = ("heal", "grid")
MATCHMAKINGS = ("auto", "clock", "dht")


@dataclass(frozen=True)
class OuterConfig:
    lr: float = _f(0.5, "Outer Nesterov learning rate.")
    momentum: float = _f(0.9, "Outer Nesterov momentum.")
    sync_every: int = _f(28, "H: inner steps between two syncs of the same fragment.")
    sync_every_start: int = _f(0, "H at step 0 when the sync period ramps up (0 = no ramp: always sync_every).")
    sync_ramp_steps: int = _f(0, "Inner steps over which H ramps linearly from sync_every_start to sync_every.")
    fragments: int = _f(4, "F: number of model fragments synced on a staggered schedule.")
    overlap: int = _f(1, "tau: inner steps between sending a pseudo-gradient and applying its result.")
    alpha: float = _f(0.5, "Share of the local weights kept when the merged anchor arrives (0 = take the anchor).")
    codec: str = _f("int4", "Pseudo-gradient codec: fp32, fp16, int8 or int4.")
    error_feedback: bool = _f(False, "Carry each round's quantization error into the next round.")
    merge: str = _f("radial", "How pseudo-gradients are merged: mean or radial (radial-directional).")
    weighting: str = _f("tokens", "Contribution weight: uniform, tokens, or tokens2 (tokens^2/steps).")
    final_average: bool = _f(False, "The last sync sets each anchor to the weighted average of the learners' weights "
                             "(no outer step: stale Nesterov momentum would overshoot at the end of the schedule).")
    robust: str = _f("none", "How far a round trusts each member: 'clip' caps its weight, its radial norms and every "
                     "tensor part a reducer receives at outer.clip_factor x the group's lower median (non-finite "
                     "parts are left out); 'trim' also takes a coordinate-wise trimmed mean (from 3 members on, the "
                     "most extreme values of every element are left out); 'none' trusts every member (the default: "
                     "both others also cap honest members with much more progress than the least advanced one, e.g. "
                     "a veteran paired with a newcomer; use 'trim' where members are not trusted).")
    clip_factor: float = _f(2.0, "Robust merge: the cap, as a multiple of the group's lower median (>= 1).")
    max_delta_ratio: float = _f(10.0, "A learner's own pseudo-gradient whose norm exceeds this multiple of its fragment "
                                "anchor's norm (or that is not finite) is dropped and the fragment re-anchored "
                                "(0 = only non-finite ones).")


@dataclass(frozen=True)
class SimConfig:
    learners: int = _f(4, "Learner units simulated in one process.")
    speeds: tuple[float, ...] = _f((), "Per-learner speed (inner steps per tick, <= 1); empty = all 1.0.")
    drop_prob: float = _f(0.0, "Probability that a learner's contribution to a round is lost.")


@dataclass(frozen=True)
class AveragingConfig:
    """How a networked learner meets its peers for each fragment's all-reduce (all times in seconds)."""

    min_group_size: int = _f(2, "Fewest peers (self included) that make a round; 1 would let a lone peer 'average' with itself.")
    target_group_size: int = _f(0, "A group forms at once when this many peers are in (0 = no cap: wait out the window).")
    groups: str = _f("heal", "'heal': capped groups that commit side by side are forks, the losing side adopts the "
                     "winner's anchor; 'grid': each round's groups of at most target_group_size lie on a grid that "
                     "changes every round, every group keeps its update and anchors converge (docs/design.md).")
    matchmaking: str = _f("auto", "How a round's group forms: 'clock' (the group is a pure function of the sync clock's "
                          "round and the live records every member holds: no search, no window; needs "
                          "averaging.schedule = 'clock' and groups = 'heal'; docs/design.md 'Rounds that cost their "
                          "bytes'), 'dht' (hivemind's matchmaking: a DHT search and a leader's window) or 'auto' "
                          "(the default: 'clock' where it applies, else 'dht').")
    window_s: float = _f(2.0, "Initial matchmaking window: how long the first peer of a round waits for the others.")
    window_min_s: float = _f(1.0, "Lower bound of the adaptive matchmaking window.")
    window_max_s: float = _f(10.0, "Upper bound of the adaptive matchmaking window.")
    request_timeout_s: float = _f(0.5, "hivemind request_timeout: a join request's wait for the leader (at least).")
    allreduce_timeout_s: float = _f(30.0, "Bound on one all-reduce once its group has formed: the least; each round "
                                    "scales it and next_chunk_timeout_s to its bytes over the measured link, up to 10x.")
    next_chunk_timeout_s: float = _f(5.0, "A sender silent this long mid-all-reduce is dropped (reducers: 2x); at least.")
    commit_timeout_s: float = _f(3.0, "After an all-reduce, how long members wait for each other's verdicts; a round "
                                 "commits only if every member reported success in time.")
    state_timeout_s: float = _f(15.0, "Floor of a state download's budget per donor (it grows with the state's "
                                  "bytes over the measured link).")
    shutdown_timeout_s: float = _f(5.0, "How long an averager process may take to shut down.")
    kept_rounds: int = _f(8, "Committed rounds each learner keeps per fragment (packed: about 0.6 bytes a value for "
                          "int4) so that a learner up to that many versions behind replays them instead of downloading "
                          "the fragment's fp32 state (8 bytes a value); 0: none kept, a learner behind always "
                          "downloads.")
    schedule: str = _f("clock", "When a fragment is due in a networked run: 'clock' (at instants of the swarm's DHT "
                       "clock, the same for everyone: learners of any speed meet) or 'steps' (every outer.sync_every "
                       "of the learner's own steps, as in the simulator: for homogeneous, paced runs).")
    sync_period_s: float = _f(0.0, "Clock schedule: fragment f is due every sync_period_s of DHT time, offset by f/F of "
                              "a period; 0 = derived: outer.sync_every x the live learners' median step time, chosen "
                              "by one learner and published in the DHT.")
    record_ttl_s: float = _f(30.0, "Lifetime of the learner's peer record; republished every ttl/3.")

    @property
    def clock_groups(self) -> bool:
        """Do rounds meet in groups from the clock (``matchmaking = 'clock'``, or 'auto' where the schedule is the
        clock's and the groups heal)?"""
        if self.matchmaking == "auto":
            return self.schedule == "clock" and self.groups == "heal"
        return self.matchmaking == "clock"


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_help(section: type, name: str) -> str:
    return next(f.metadata.get("help", "") for f in dataclasses.fields(section) if f.name == name)


# ---------------------------------------------------------------- building from plain data


def _coerce(key: str, annotation: Any, value: Any) -> Any:
    """Check ``value`` against a field's annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation)
    if origin is types.UnionType:  # e.g. str | dict[str, Any]: the option of the value's own type
        options = typing.get_args(annotation)
        for option in options:
            if isinstance(value, Mapping if typing.get_origin(option) is dict else option):
                return _coerce(key, option, value)
        wanted = " or ".join({str: "a string"}.get(o, "a table" if typing.get_origin(o) is dict else o.__name__)
                             for o in options)
        raise ConfigError(f"{key}: expected {wanted}, got {type(value).__name__} {value!r}")
    if origin is dict:  # a free-form table (model.hf_config): its contents are checked where it is used
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return copy.deepcopy(dict(value))
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(f"{key}[{i}]", item_type, v) for i, v in enumerate(value))
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):  # inf and nan pass every "> 0" check below and train to a NaN loss
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")  # a programming error


REMOVED_KEYS = {"averaging.round_timeout_s": "it was never read: a round is bounded by its matchmaking window "
                                             "and averaging.allreduce_timeout_s"}
"""Keys configs once had. One still there is ignored with a warning, not refused: learner checkpoints record
their run's whole config, and older ones must still load (``p2p-diloco export``)."""


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if f"{prefix}{key}" in REMOVED_KEYS:
            logger.warning("config: %s%s is no longer a config key (%s); ignored", prefix, key,
                           REMOVED_KEYS[f"{prefix}{key}"])
        elif key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key (known: {', '.join(sorted(names))})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        key, annotation, value = f"{prefix}{f.name}", hints[f.name], data[f.name]
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
            kwargs[f.name] = _build(annotation, value, f"{key}.")
        else:
            kwargs[f.name] = _coerce(key, annotation, value)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b=value``; the value is read as a TOML value, or as a bare string if that fails. Its errors name
    no flag (:func:`load_config` is a library call too; the CLI's ``--set`` checks with :func:`override_arg`)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. outer.sync_every=50")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: malformed key {key!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def override_arg(text: str) -> str:
    """The argparse ``type`` of the CLI's ``--set``: a malformed override is the flag's own error (argparse names
    ``--set``), before anything loads."""
    try:
        parse_override(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def check_overrides(overrides: Any) -> None:
    """Raise ``TypeError`` (one line) unless ``overrides`` is a list (or tuple) of ``"key=value"`` strings: a str
    alone would be read one character at a time."""
    if not isinstance(overrides, (list, tuple)) or not all(isinstance(o, str) for o in overrides):
        raise TypeError(f'overrides: must be a list of "key=value" strings (e.g. ["inner.lr=3e-4"]), got '
                        f"{type(overrides).__name__} {overrides!r:.60}")


def _merge_override(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a table")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load ``path`` (or the defaults), apply the overrides (the CLI's ``--set``), validate, return the frozen config.
    A ``path`` that does not exist names a bundled config (``configs/tiny.toml``, ``tiny``:
    :func:`resources.find`), so the shipped configs load from any directory. ``overrides``: a list of ``"key=value"``
    strings (``TypeError`` otherwise; a malformed one is a ``ConfigError``)."""
    check_overrides(overrides)
    data: dict[str, Any] = {}
    if path is not None:
        try:
            p = resources.find(path, resources.CONFIGS)
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read config file ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML ({e})") from None
    return load_config_data(data, overrides)


def load_config_data(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Like :func:`load_config`, from already-parsed data (e.g. a config fetched from the DHT): apply
    overrides, validate exactly as a file is, and return the frozen config. ``data`` is not changed."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a table of sections, got {type(data).__name__}")
    check_overrides(overrides)
    copied: dict[str, Any] = copy.deepcopy(dict(data))
    for text in overrides:
        key_path, value = parse_override(text)
        _merge_override(copied, key_path, value)
    cfg = _build(Config, copied, "")
    validate(cfg)
    return cfg


def replace(cfg: Config, **sections: Mapping[str, Any]) -> Config:
    """Return ``cfg`` with some fields of some sections replaced, validated (``replace(cfg, outer={"lr": 0.5})``)."""
    data = cfg.to_dict()
    for name, changes in sections.items():
        if name not in data:
            raise ConfigError(f"{name}: unknown section")
        data[name] = {**data[name], **changes}
    new = _build(Config, data, "")
    validate(new)
    return new


# ---------------------------------------------------------------- cross-field validation


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def _validate_model(m: ModelConfig) -> tuple[int | None, str]:
    """Check the model section; returns its number of repeated blocks (None: unknown before it is built) and
    the key that sets it. An hf model's config is resolved here (imports transformers; nothing downloads)."""
    _require(m.kind in MODEL_KINDS, "model.kind", f"must be one of {', '.join(MODEL_KINDS)}, got {m.kind!r}")
    if m.kind == "byte-gpt":
        _require(m.hf_config == "", "model.hf_config", 'is only read with model.kind = "hf"')
        _require(m.init_from == "", "model.init_from", 'is only read with model.kind = "hf"')
        _require(m.n_layer >= 1, "model.n_layer", f"must be >= 1, got {m.n_layer}")
        _require(m.n_head >= 1, "model.n_head", f"must be >= 1, got {m.n_head}")
        _require(m.n_embd >= 1 and m.n_embd % m.n_head == 0, "model.n_embd",
                 f"must be a positive multiple of model.n_head={m.n_head}, got {m.n_embd}")
        _require(m.block_size >= 2, "model.block_size", f"must be >= 2, got {m.block_size}")
        _require(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
        return m.n_layer, "model.n_layer"
    defaults = ModelConfig()
    for key in ("n_layer", "n_head", "n_embd", "dropout"):
        _require(getattr(m, key) == getattr(defaults, key), f"model.{key}",
                 'is a byte-gpt key; with model.kind = "hf" the architecture comes from model.hf_config')
    _require(m.block_size >= 2, "model.block_size", f"must be >= 2, got {m.block_size}")
    from p2p_diloco.core import hfmodel

    arch = hfmodel.check(m)
    _require(arch.max_positions is None or m.block_size <= arch.max_positions, "model.block_size",
             f"must be <= the model's max_position_embeddings={arch.max_positions}, got {m.block_size}")
    # The data are bytes (0-255) until a tokenizer can be configured; then the tokenizer's vocabulary must fit.
    _require(arch.vocab_size >= 256, f"{arch.source}.vocab_size",
             f"must be >= 256 (the training data are bytes), got {arch.vocab_size}")
    return arch.num_layers, f"{arch.source}.num_hidden_layers"


def _is_hex16(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def _validate_data(d: DataConfig) -> None:
    _require(d.source in DATA_SOURCES, "data.source", f"must be one of {', '.join(DATA_SOURCES)}, got {d.source!r}")
    _require(d.max_bytes >= 0, "data.max_bytes", f"must be >= 0, got {d.max_bytes}")
    _require(d.sample_by in TEXT_SAMPLE_BY, "data.sample_by",
             f"must be one of {', '.join(TEXT_SAMPLE_BY)}, got {d.sample_by!r}")
    _require(bool(d.text_field), "data.text_field", "must not be empty")
    _require(bool(d.tokenizer), "data.tokenizer", 'must be "bytes" or a local tokenizer.json / tokenizer folder')
    _require(d.fingerprint == "" or _is_hex16(d.fingerprint), "data.fingerprint",
             f"must be empty or 16 hex digits, got {d.fingerprint!r}")
    _require(d.tokenizer_hash in ("", "bytes") or _is_hex16(d.tokenizer_hash), "data.tokenizer_hash",
             f'must be empty, "bytes" or 16 hex digits, got {d.tokenizer_hash!r}')
    if d.source == "embedded":
        _require(d.tokenizer == "bytes", "data.tokenizer",
                 'data.source = "embedded" is bytes; a tokenizer needs data.source = "files" or "hf"')
    if d.source != "hf":
        for key in ("name", "config_name", "revision"):
            _require(getattr(d, key) == "", f"data.{key}", 'is only read with data.source = "hf"')
    if d.source == "files":
        _require(bool(d.path), "data.path", 'required with data.source = "files" (a file or a folder of .txt, '
                 '.jsonl, .parquet files)')
    if d.source == "hf":
        _require(bool(d.name), "data.name", 'required with data.source = "hf" (a hub dataset, e.g. "allenai/c4")')
        _require(d.path == "", "data.path", 'is not read with data.source = "hf" (data.name is)')


def validate(cfg: Config) -> None:
    """Reject impossible values and combinations, naming the key."""
    m, d, i, o, s = cfg.model, cfg.data, cfg.inner, cfg.outer, cfg.sim
    _require(bool(cfg.run.run_id) and all(c.isalnum() or c in "-_." for c in cfg.run.run_id), "run.run_id",
             f"must be non-empty letters, digits, '-', '_' or '.', got {cfg.run.run_id!r}")
    n_blocks, blocks_key = _validate_model(m)
    _validate_data(d)
    _require(0.0 < d.eval_fraction < 0.5, "data.eval_fraction", f"must be in (0, 0.5), got {d.eval_fraction}")
    _require(d.eval_batches >= 1, "data.eval_batches", f"must be >= 1, got {d.eval_batches}")
    _require(d.eval_batch_size >= 1, "data.eval_batch_size", f"must be >= 1, got {d.eval_batch_size}")
    _require(i.lr > 0, "inner.lr", f"must be > 0, got {i.lr}")
    _require(0.0 <= i.min_lr_ratio <= 1.0, "inner.min_lr_ratio", f"must be in [0, 1], got {i.min_lr_ratio}")
    _require(i.total_steps >= 1, "inner.total_steps", f"must be >= 1, got {i.total_steps}")
    _require(0 <= i.warmup_steps < i.total_steps, "inner.warmup_steps",
             f"must be in [0, inner.total_steps={i.total_steps}), got {i.warmup_steps}")
    _require(i.batch_size >= 1, "inner.batch_size", f"must be >= 1, got {i.batch_size}")
    _require(i.weight_decay >= 0, "inner.weight_decay", f"must be >= 0, got {i.weight_decay}")
    _require(0 <= i.beta1 < 1, "inner.beta1", f"must be in [0, 1), got {i.beta1}")
    _require(0 <= i.beta2 < 1, "inner.beta2", f"must be in [0, 1), got {i.beta2}")
    _require(i.grad_clip >= 0, "inner.grad_clip", f"must be >= 0, got {i.grad_clip}")
    _require(i.precision in PRECISIONS, "inner.precision", f"must be one of {', '.join(PRECISIONS)}, got {i.precision!r}")
    _require(o.lr > 0, "outer.lr", f"must be > 0, got {o.lr}")
    _require(0 <= o.momentum < 1, "outer.momentum", f"must be in [0, 1), got {o.momentum}")
    _require(o.sync_every >= 1, "outer.sync_every", f"must be >= 1, got {o.sync_every}")
    _require(0 <= o.sync_every_start <= o.sync_every, "outer.sync_every_start",
             f"must be in [0, outer.sync_every={o.sync_every}], got {o.sync_every_start}")
    _require(o.sync_ramp_steps >= 0, "outer.sync_ramp_steps", f"must be >= 0, got {o.sync_ramp_steps}")
    _require(o.sync_ramp_steps == 0 or o.sync_every_start >= 1, "outer.sync_every_start",
             "must be >= 1 when outer.sync_ramp_steps is set")
    _require(1 <= o.fragments <= (o.fragments if n_blocks is None else n_blocks), "outer.fragments",
             f"must be in [1, {blocks_key}={n_blocks}] (a fragment holds at least one block), got {o.fragments}")
    _require(o.fragments <= o.sync_every, "outer.fragments",
             f"must be <= outer.sync_every={o.sync_every} so each fragment gets its own offset, got {o.fragments}")
    _require(0 <= o.overlap < o.sync_every, "outer.overlap",
             f"tau must be in [0, outer.sync_every={o.sync_every}), got {o.overlap}")
    _require(o.overlap < max(1, o.sync_every_start or o.sync_every), "outer.overlap",
             f"tau must be below the shortest sync period ({o.sync_every_start or o.sync_every}), got {o.overlap}")
    _require(0.0 <= o.alpha < 1.0, "outer.alpha", f"must be in [0, 1), got {o.alpha}")
    _require(o.codec in CODECS, "outer.codec", f"must be one of {', '.join(CODECS)}, got {o.codec!r}")
    _require(o.merge in MERGES, "outer.merge", f"must be one of {', '.join(MERGES)}, got {o.merge!r}")
    _require(o.weighting in WEIGHTINGS, "outer.weighting",
             f"must be one of {', '.join(WEIGHTINGS)}, got {o.weighting!r}")
    _require(o.robust in ROBUST, "outer.robust", f"must be one of {', '.join(ROBUST)}, got {o.robust!r}")
    _require(1.0 <= o.clip_factor < float("inf"), "outer.clip_factor",
             f"must be finite and >= 1 (a cap below the median would clip honest members), got {o.clip_factor}")
    _require(0 <= o.max_delta_ratio < float("inf"), "outer.max_delta_ratio",
             f"must be finite and >= 0, got {o.max_delta_ratio}")
    _require(s.learners >= 1, "sim.learners", f"must be >= 1, got {s.learners}")
    _require(not s.speeds or len(s.speeds) == s.learners, "sim.speeds",
             f"must list one speed per learner (sim.learners={s.learners}), got {len(s.speeds)}")
    _require(all(0 < v <= 1 for v in s.speeds), "sim.speeds", f"each speed must be in (0, 1], got {list(s.speeds)}")
    _require(0.0 <= s.drop_prob < 1.0, "sim.drop_prob", f"must be in [0, 1), got {s.drop_prob}")
    a = cfg.averaging
    _require(a.min_group_size >= 1, "averaging.min_group_size", f"must be >= 1, got {a.min_group_size}")
    _require(a.target_group_size == 0 or a.target_group_size >= a.min_group_size, "averaging.target_group_size",
             f"must be 0 or >= averaging.min_group_size={a.min_group_size}, got {a.target_group_size}")
    _require(a.groups in GROUPINGS, "averaging.groups", f"must be one of {', '.join(GROUPINGS)}, got {a.groups!r}")
    _require(a.groups != "grid" or (a.target_group_size >= 2 and a.schedule == "clock" and cfg.outer.codec == "fp32"),
             "averaging.groups", "'grid' needs averaging.target_group_size >= 2, averaging.schedule = 'clock' and "
             f"outer.codec = 'fp32' (anchors are averaged too), got {a.target_group_size}, {a.schedule!r}, "
             f"{cfg.outer.codec!r}")
    _require(a.request_timeout_s > 0, "averaging.request_timeout_s", f"must be > 0, got {a.request_timeout_s}")
    _require(a.window_min_s > a.request_timeout_s, "averaging.window_min_s",
             f"must exceed averaging.request_timeout_s={a.request_timeout_s} (hivemind deadlocks otherwise), "
             f"got {a.window_min_s}")
    _require(a.window_min_s <= a.window_s <= a.window_max_s, "averaging.window_s",
             f"must be in [averaging.window_min_s={a.window_min_s}, averaging.window_max_s={a.window_max_s}], "
             f"got {a.window_s}")
    _require(a.next_chunk_timeout_s > 0, "averaging.next_chunk_timeout_s", f"must be > 0, got {a.next_chunk_timeout_s}")
    _require(a.allreduce_timeout_s > 2 * a.next_chunk_timeout_s, "averaging.allreduce_timeout_s",
             f"must exceed 2 x averaging.next_chunk_timeout_s={a.next_chunk_timeout_s} (the reducer timeout), "
             f"got {a.allreduce_timeout_s}")
    _require(a.state_timeout_s > 0, "averaging.state_timeout_s", f"must be > 0, got {a.state_timeout_s}")
    _require(a.commit_timeout_s > 0, "averaging.commit_timeout_s", f"must be > 0, got {a.commit_timeout_s}")
    _require(a.shutdown_timeout_s > 0, "averaging.shutdown_timeout_s", f"must be > 0, got {a.shutdown_timeout_s}")
    _require(0 <= a.kept_rounds <= 64, "averaging.kept_rounds", f"must be in 0..64, got {a.kept_rounds}")
    _require(a.matchmaking in MATCHMAKINGS, "averaging.matchmaking",
             f"must be one of {', '.join(MATCHMAKINGS)}, got {a.matchmaking!r}")
    _require(a.matchmaking != "clock" or (a.schedule == "clock" and a.groups == "heal"), "averaging.matchmaking",
             f"'clock' needs averaging.schedule = 'clock' and averaging.groups = 'heal' (grid cells: not yet), got "
             f"{a.schedule!r} and {a.groups!r}")
    _require(a.schedule in SCHEDULES, "averaging.schedule", f"must be one of {', '.join(SCHEDULES)}, got {a.schedule!r}")
    _require(a.sync_period_s >= 0, "averaging.sync_period_s", f"must be >= 0, got {a.sync_period_s}")
    _require(a.sync_period_s == 0 or a.clock_groups or a.sync_period_s > a.window_max_s, "averaging.sync_period_s",
             f"must be 0 or exceed averaging.window_max_s={a.window_max_s} under hivemind's matchmaking (a round "
             f"must fit in a period), got {a.sync_period_s}")
    _require(a.sync_period_s == 0 or a.schedule == "clock", "averaging.sync_period_s",
             f"is only used with averaging.schedule = \"clock\" (schedule is {a.schedule!r}); set one or the other")
    _require(a.record_ttl_s > 0, "averaging.record_ttl_s", f"must be > 0, got {a.record_ttl_s}")


def render(cfg: Config) -> str:
    """The resolved config as TOML text (what ``p2p-diloco config`` prints); the model section without the
    keys its kind does not read (they are at their defaults: :func:`validate` makes sure)."""
    lines: list[str] = []
    unread = {"hf": set(BYTE_GPT_KEYS) - {"block_size"}}.get(cfg.model.kind, {"hf_config", "init_from"})
    for name, section in cfg.to_dict().items():
        lines.append(f"[{name}]")
        for key, value in section.items():
            if name != "model" or key not in unread:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):  # an inline table (model.hf_config)
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {value!r} as TOML")


def _toml_key(key: str) -> str:
    return key if key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key) else json.dumps(key)
