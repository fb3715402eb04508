"""The run's tokenizer (``data.tokenizer``): bytes, or a local Hugging Face tokenizer, and its hash.

``bytes`` (the default) maps text to its UTF-8 bytes, ids 0-255: what the byte GPT reads, and no
import at all. Anything else names a local ``tokenizer.json`` file, or a folder holding one (what
``save_pretrained`` and ``scripts/make_tokenizer.py`` write), loaded with the ``tokenizers`` library;
a folder without one (e.g. a SentencePiece model) goes through ``AutoTokenizer.from_pretrained(...,
local_files_only=True)`` and must convert to a fast tokenizer. Nothing is ever downloaded.

Documents are separated by the tokenizer's end-of-text token when it has one (``eos_token`` of the
folder's ``tokenizer_config.json``, else one of :data:`EOS_TOKENS` in its vocabulary), else by the
encoding of a blank line; bytes use a blank line (``\\n\\n``).

The tokenizer's hash (:attr:`Tokenizer.digest`, in the config hash) is the sha256 of its serialized
JSON (``Tokenizer.to_str()``: canonical, whatever the file's formatting) and the separator: two peers
with the same tokenizer in different folders hash the same. Only the standard library is imported at
module level.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

BYTES = "bytes"
BYTES_VOCAB = 256
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
"""End-of-text tokens looked up in a tokenizer's vocabulary when its folder does not name one."""


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: ``encode`` turns a batch of texts into token ids."""

    spec: str
    """``bytes`` or the path as configured."""
    vocab_size: int
    separator: tuple[int, ...]
    """Ids appended after every document when documents are packed into sequences."""
    digest: str
    """``bytes``, or 16 hex digits of the sha256 of the serialized tokenizer and the separator."""
    encode: Callable[[list[str]], list[list[int]]]


def _encode_bytes(texts: list[str]) -> list[list[int]]:
    return [list(t.encode("utf-8")) for t in texts]


BYTE_TOKENIZER = Tokenizer(BYTES, BYTES_VOCAB, (10, 10), BYTES, _encode_bytes)


def tokenizer_file(spec: str) -> Path | None:
    """The ``tokenizer.json`` that ``spec`` names (the file, or the one in the folder), None for a folder
    without one; a one-line ``ValueError`` naming ``data.tokenizer`` when the path does not exist."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        inner = path / "tokenizer.json"
        return inner if inner.is_file() else None
    raise ValueError(f"data.tokenizer: no such file or folder: {spec} (give \"bytes\", a tokenizer.json or a folder "
                     f"holding one, e.g. made by scripts/make_tokenizer.py)")


def _eos_from_folder(folder: Path) -> str | None:
    cfg_file = folder / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    try:
        eos = json.loads(cfg_file.read_text()).get("eos_token")
    except (OSError, ValueError) as e:
        raise ValueError(f"data.tokenizer: cannot read {cfg_file}: {e}") from None
    if isinstance(eos, dict):  # an AddedToken as saved by transformers
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _backend(spec: str) -> tuple[Any, Path]:
    """The ``tokenizers.Tokenizer`` that ``spec`` names and the folder it came from."""
    file = tokenizer_file(spec)
    if file is not None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return HFTokenizer.from_file(str(file)), file.parent
        except Exception as e:  # tokenizers raises its own Exception subclass for a malformed file
            raise ValueError(f"data.tokenizer: {file} is not a tokenizers JSON file "
                             f"({str(e).splitlines()[0][:200]})") from None
    folder = Path(spec).expanduser()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.tokenizer: {folder} holds no tokenizer.json and transformers cannot load it "
                         f"({str(e).splitlines()[0][:200]})") from None
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"data.tokenizer: {folder}: only fast tokenizers are supported (save it with "
                         f"save_pretrained from a fast tokenizer, which writes tokenizer.json)")
    return tok.backend_tokenizer, folder


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names (cached per process); one-line ``ValueError`` if unusable."""
    if spec == BYTES:
        return BYTE_TOKENIZER
    if not spec:
        raise ValueError('data.tokenizer: empty; give "bytes" or a local tokenizer.json / tokenizer folder')
    backend, folder = _backend(spec)
    eos = _eos_from_folder(folder) or next((t for t in EOS_TOKENS if backend.token_to_id(t) is not None), None)
    eos_id = backend.token_to_id(eos) if eos is not None else None
    separator = (eos_id,) if eos_id is not None else tuple(backend.encode("\n\n", add_special_tokens=False).ids)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    digest = hashlib.sha256(backend.to_str().encode() + f"\0separator={list(separator)}".encode()).hexdigest()[:16]

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(spec, vocab, separator, digest, encode)


def tokenizer_hash(spec: str) -> str:
    """What ``data.tokenizer`` contributes to the config hash: ``bytes`` or its digest (never its path)."""
    return BYTES if spec == BYTES else load_tokenizer(spec).digest


def loss_unit(cfg: Any) -> str:
    """The unit of the run's losses (mean cross-entropy per token): ``nats/byte`` with the byte tokenizer, whose
    tokens are bytes; ``nats/token`` with any other (``data.tokenizer``)."""
    return "nats/byte" if cfg.data.tokenizer == BYTES else "nats/token"


def check_vocab(tok: Tokenizer, model_vocab: int, model_key: str) -> None:
    """One line if the tokenizer's ids do not fit the model's embedding table."""
    if tok.vocab_size > model_vocab:
        raise ValueError(f"data.tokenizer: {tok.spec} has {tok.vocab_size} tokens, more than the model's "
                         f"{model_key}={model_vocab}; set {model_key} to at least {tok.vocab_size}")


END_OF_TEXT = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Tokenizer:
    """Train a byte-level BPE tokenizer (the ``tokenizers`` library's ``BpeTrainer``; every byte is in its
    alphabet, so no text is out of vocabulary) with :data:`END_OF_TEXT` as its end-of-text token, and save it
    into the folder ``out`` (``tokenizer.json`` and a ``tokenizer_config.json`` that ``AutoTokenizer`` reads).
    Returns it as loaded from there."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + 1:
        raise ValueError(f"--vocab-size: must be > 256 (the bytes and the end-of-text token), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT,
         "unk_token": END_OF_TEXT, "model_max_length": 1_000_000}, indent=2) + "\n")
    load_tokenizer.cache_clear()
    return load_tokenizer(str(out))
