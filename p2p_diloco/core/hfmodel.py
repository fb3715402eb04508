"""Hugging Face causal LMs as the model of a run (``[model] kind = "hf"``).

``model.hf_config`` is a transformers config: an inline table (``model_type = "llama"``, sizes...) built
with ``AutoConfig.for_model``, or a local ``config.json`` (or a folder holding one). ``model.init_from``
optionally names a local folder of weights (``save_pretrained``) to continue pre-training from. The model
is ``AutoModelForCausalLM.from_config`` under the run's seed (every peer builds the same initial weights)
or ``from_pretrained`` of that folder, in fp32.

Nothing here downloads: every transformers call is local (``local_files_only=True``), and a path that does
not exist is refused before transformers sees it (it would take it for a hub repo id). Config problems
are :class:`~p2p_diloco.core.errors.ConfigError`, one line naming the key.

Only the standard library is imported at module level; transformers (about a second) and torch are
imported by the functions that need them, so the byte-gpt path never pays for them.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from p2p_diloco.core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

BOOKKEEPING_KEYS = frozenset({"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
                              "use_cache"})
"""Keys of a transformers config that do not change the model we build: who wrote the file, which class
it names (we always build ``AutoModelForCausalLM``), its storage dtype (we build in fp32) and the
generation cache (the loss never uses it). Left out of the config hash."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
"""Files of an ``init_from`` folder that hold (or index) weights; their contents are hashed."""
DIMENSION_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "num_hidden_layers", "max_position_embeddings")
"""Sizes of a transformers config that must be positive integers where the config has them (None: derived or
absent). transformers checks few of them: a negative ``intermediate_size`` fails only when the model is built, and
zero layers builds a model without blocks."""


@dataclass(frozen=True)
class Architecture:
    """What config validation needs to know about a resolved transformers config."""

    source: str
    """The config key the architecture came from (``model.hf_config`` or ``model.init_from``)."""
    model_type: str
    num_layers: int | None
    """``num_hidden_layers`` (None where the config has no such notion)."""
    max_positions: int | None
    """``max_position_embeddings`` (None where positions are unbounded, e.g. some rotary models)."""
    vocab_size: int


class ModelSpec(Protocol):
    """What this module reads of a model section (:class:`~p2p_diloco.core.config.ModelConfig` is one); a protocol,
    not that class, because the config's validation calls :func:`check`: the config imports this module, not the
    other way round."""

    @property
    def kind(self) -> str: ...
    @property
    def hf_config(self) -> str | dict[str, Any]: ...
    @property
    def init_from(self) -> str: ...


_resolved: dict[str, tuple[str, PretrainedConfig]] = {}
_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _check_model_type(model_type: Any, key: str) -> str:
    """The model type, if transformers knows it and can build a causal LM of it; else ConfigError naming ``key``."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{key}: required: the transformers model type, e.g. \"llama\" or \"gpt2\", "
                          f"got {model_type!r}")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ConfigError(f"{key}: unknown model type {model_type!r} for transformers {transformers.__version__} "
                          "(e.g. \"llama\", \"gpt2\", \"mistral\", \"qwen2\")")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"{key}: model type {model_type!r} has no causal-LM class in transformers "
                          f"{transformers.__version__} (AutoModelForCausalLM cannot build it)")
    return model_type


def _refused(key: str, e: Exception) -> ConfigError:
    return ConfigError(f"{key}: transformers refuses it: {_one_line(e)}")


def _bad_size(value: Any) -> bool:
    """Not a positive integer (nor a list of them: some configs size each layer, e.g. Gemma 3n's intermediate_size)."""
    if isinstance(value, (list, tuple)):
        return not value or any(_bad_size(v) for v in value)
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


def _check_sizes(given: Mapping[str, Any], cls: type[PretrainedConfig], prefix: str) -> None:
    """The sizes of :data:`DIMENSION_KEYS` as given (a table, a config.json), before transformers derives others from
    them (``hidden_size // num_attention_heads`` would raise ZeroDivisionError); ConfigError naming the key after
    ``prefix`` (``model.hf_config.``)."""
    for name in DIMENSION_KEYS:
        for spelled in dict.fromkeys((name, cls.attribute_map.get(name, name))):
            value = given.get(spelled)
            if value is not None and _bad_size(value):
                raise ConfigError(f"{prefix}{spelled}: must be an integer >= 1, got {value!r}")


def _from_table(table: Mapping[str, Any], key: str) -> PretrainedConfig:
    """An inline table, checked strictly: a key the model type's config does not know is an error (transformers
    would keep a misspelt ``hidden_sise`` as an unused attribute)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = _check_model_type(table.get("model_type"), f"{key}.model_type")
    cls = CONFIG_MAPPING[model_type]
    known = set(inspect.signature(cls.__init__).parameters) | set(cls.attribute_map) | set(cls().to_dict())
    known -= {"self", "args", "kwargs"}
    unknown = sorted(set(table) - known - {"model_type"})
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key for model_type {model_type!r} "
                          f"(known: {', '.join(sorted(known - BOOKKEEPING_KEYS))})")
    _check_sizes(table, cls, f"{key}.")
    try:
        return AutoConfig.for_model(model_type, **{k: copy.deepcopy(v) for k, v in table.items() if k != "model_type"})
    except (ValueError, TypeError, ArithmeticError, StrictDataclassError) as e:
        raise _refused(key, e) from e


def _from_file(text: str, key: str) -> PretrainedConfig:
    """A local ``config.json``, or a folder holding one."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(f"{key}: no such file or folder: {text!r}")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{key}: folder {text!r} holds no config.json")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {str(file)!r} as JSON ({_one_line(e)})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {str(file)!r} holds a JSON {type(data).__name__}, not a transformers config")
    model_type = _check_model_type(data.get("model_type"), f"{key} ({file.name}) model_type")
    _check_sizes(data, CONFIG_MAPPING[model_type], f"{key} ({file.name}) ")
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except (ValueError, TypeError, ArithmeticError, StrictDataclassError) as e:
        raise _refused(key, e) from e


def _init_folder(m: ModelSpec) -> Path:
    path = Path(m.init_from).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.init_from: no such folder: {m.init_from!r}")
    if not weight_files(path):
        raise ConfigError(f"model.init_from: folder {m.init_from!r} holds no weights "
                          f"(files ending in {', '.join(WEIGHT_SUFFIXES[:2])})")
    return path


def resolve_config(m: ModelSpec) -> tuple[str, PretrainedConfig]:
    """The transformers config of an hf model section (a copy: callers may change it) and the key it came from.

    ``model.hf_config`` if given, else the ``config.json`` of ``model.init_from``; ConfigError naming the key
    if it is missing, unreadable, of an unknown model type or refused by transformers. Cached per process.
    """
    if m.kind != "hf":
        raise ValueError(f"model.kind: {m.kind!r} is not a transformers model")
    where = [str(Path(t).expanduser().absolute()) if isinstance(t, str) and t else t
             for t in (m.hf_config, m.init_from)]
    cache_key = json.dumps(where, sort_keys=True)  # paths relative to the working directory, as given
    if cache_key not in _resolved:
        if m.init_from:
            _init_folder(m)
        if isinstance(m.hf_config, Mapping):
            source, config = "model.hf_config", _from_table(m.hf_config, "model.hf_config")
        elif m.hf_config:
            source, config = "model.hf_config", _from_file(m.hf_config, "model.hf_config")
        elif m.init_from:
            source, config = "model.init_from", _from_file(m.init_from, "model.init_from")
        else:
            raise ConfigError('model.hf_config: required with model.kind = "hf": an inline table of a transformers '
                              "config, a config.json or a folder holding one (or give model.init_from)")
        _resolved[cache_key] = (source, config)
    source, config = _resolved[cache_key]
    return source, copy.deepcopy(config)


def _config_key(config: PretrainedConfig, name: str) -> str:
    """The name a config file or table spells ``name`` with (GPT-2's ``n_embd`` for ``hidden_size``)."""
    return config.attribute_map.get(name, name)


def _check_dimensions(config: PretrainedConfig, source: str) -> None:
    """Every size of :data:`DIMENSION_KEYS` the config has is a positive integer, and the query heads split evenly
    into key/value groups (transformers builds a model with 3 key/value heads for 4 query heads; its first forward
    fails); ConfigError naming the key."""
    for name in DIMENSION_KEYS:
        value = getattr(config, name, None)
        if value is not None and _bad_size(value):
            raise ConfigError(f"{source}.{_config_key(config, name)}: must be an integer >= 1, got {value!r}")
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ConfigError(f"{source}.{_config_key(config, 'num_key_value_heads')}: must divide "
                          f"{_config_key(config, 'num_attention_heads')}={heads} (each key/value head serves an equal "
                          f"group of query heads), got {kv_heads}")


def check(m: ModelSpec) -> Architecture:
    """Resolve and check an hf model section (see :func:`resolve_config`); the facts validation needs."""
    source, config = resolve_config(m)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"{source}.vocab_size: required, a positive integer, got {vocab!r}")
    _check_dimensions(config, source)
    layers = getattr(config, "num_hidden_layers", None)
    positions = getattr(config, "max_position_embeddings", None)
    return Architecture(source=source, model_type=config.model_type,
                        num_layers=layers if isinstance(layers, int) else None,
                        max_positions=positions if isinstance(positions, int) else None, vocab_size=vocab)


def meta_build(m: ModelSpec) -> torch.nn.Module:
    """The model's structure on the meta device: every parameter's shape and no memory (milliseconds for any size,
    plus the first import of the model type's module, about a second, which :func:`build` then reuses). Whatever
    transformers raises while building it is a ConfigError naming ``model.hf_config`` (or the key its message
    names) with the message in one line, so a config that cannot be built fails before a learner joins."""
    import torch
    from transformers import AutoModelForCausalLM

    check(m)  # the sizes first: their errors name the key
    source, config = resolve_config(m)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # model constructors raise RuntimeError, ValueError, ZeroDivisionError, ... on bad sizes
        named = [k for k in config.to_dict() if k not in BOOKKEEPING_KEYS and re.search(rf"\b{re.escape(k)}\b", str(e))]
        key = f"{source}.{named[0]}" if len(named) == 1 else source
        raise ConfigError(f"{key}: transformers cannot build this model: {_one_line(e)}") from e


def architecture(m: ModelSpec) -> dict[str, Any]:
    """The resolved architecture as plain data for the config hash: ``to_dict()`` without bookkeeping keys,
    so an inline table and a ``config.json`` of the same model give the same dict."""
    _source, config = resolve_config(m)
    arch = {k: v for k, v in config.to_dict().items() if k not in BOOKKEEPING_KEYS}
    return json.loads(json.dumps(arch, sort_keys=True, default=str))  # JSON-plain: int keys become strings


def weight_files(folder: Path) -> list[Path]:
    """The files of a ``save_pretrained`` folder that hold or index weights, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def init_digest(m: ModelSpec) -> str:
    """Content hash (sha256, 16 hex digits) of the ``init_from`` weights: names, sizes and bytes of its weight
    files, not its path; "" without ``init_from``. Cached per process by (path, names, sizes, mtimes)."""
    if not m.init_from:
        return ""
    folder = _init_folder(m)
    files = weight_files(folder)
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = (str(folder.resolve()), stamp)
    if key not in _digests:
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
        _digests[key] = h.hexdigest()[:16]
    return _digests[key]


def build(m: ModelSpec, seed: int) -> torch.nn.Module:
    """The model, in fp32 and training mode: ``from_config`` under ``seed`` (the same initial weights on every
    peer) or, with ``init_from``, ``from_pretrained`` of that folder (weights it lacks are initialised under
    ``seed`` too)."""
    import torch
    from transformers import AutoModelForCausalLM

    source, config = resolve_config(m)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if not m.init_from:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            try:
                model = AutoModelForCausalLM.from_pretrained(str(_init_folder(m)), config=config, dtype=torch.float32,
                                                             local_files_only=True)
            except (OSError, ValueError, RuntimeError) as e:
                raise ValueError(f"model.init_from: cannot load {m.init_from!r} into the model of {source}: "
                                 f"{_one_line(e)}") from e
    model.train()
    return model
