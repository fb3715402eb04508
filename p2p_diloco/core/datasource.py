"""Where the training text comes from (``data.source``), its fingerprint, the held-out rule, and each
learner's own order over it. Only the standard library is imported at module level: the config hash
(:func:`p2p_diloco.core.identity.config_hash`) covers :func:`fingerprint`, and ``datasets`` costs seconds to
import, so the byte GPT on the embedded corpus never imports it.

Sources:

- ``embedded`` (the default): bytes read whole into memory, at most ``data.max_bytes`` (:func:`load_corpus`):
  ``data.path``, or the source of this Python's standard library, which is present wherever Python is, so
  the main job needs no download. Cut into segments by :func:`p2p_diloco.core.data.split_corpus`. Its
  fingerprint is the sha256 of the bytes read, so peers on different Pythons (whose stdlib differs) are
  refused instead of silently training on different text.
- ``files``: ``data.path``, a ``.txt``, ``.jsonl`` or ``.parquet`` file or a folder of them (recursively),
  streamed through ``datasets.load_dataset(..., streaming=True)``, never read whole (a ``.txt`` document is a
  paragraph by default, ``data.sample_by``; a row's text is in ``data.text_field``). Fingerprint: a content
  hash of the files' relative names, sizes and first and last :data:`FINGERPRINT_BLOCK` bytes, so the same
  files under another folder hash the same.
- ``hf``: ``data.name`` (``config_name``, ``split``, ``revision``) streamed from the hub; only where the
  machine reaches it (not in the tests). Fingerprint: those four names.

Held out (:func:`is_held_out`): a document whose sha256 falls in the first ``eval_fraction`` of
:data:`HELD_OUT_BUCKETS` buckets, the same rule on every peer, whatever its order or packing; no learner
trains on it. Evaluation takes the first held-out tokens in file order (sorted relative names).

A learner's order (:meth:`TextSource.train_sequences`, seeded by
:func:`p2p_diloco.core.data.stream_seed`: run seed, peer id, incarnation): every epoch is
:data:`STREAM_PARTS` passes over the data; in each pass the learner keeps the documents that a hash of
(its seed, the document) puts in that pass's part, reads the shards (files; parquet row groups) in a seeded
order through a seeded shuffle buffer, tokenizes and packs them. Two learners thus train on independent
random parts of the data even when they read the same file at the same time, and each sees every training
document once per epoch, at the cost of reading the data :data:`STREAM_PARTS` times per epoch (tokenizing
it once). ``datasets`` cannot start a stream in the middle of a .txt or .jsonl file, so with one large file
two learners start at its beginning, each in its own eighth of the documents: split large files (or use
parquet with several row groups, each a shard) for streams that differ from the first step. An explicit
shard (``--shard I``, the simulator) keeps the documents that hash to shard ``I`` of ``N``: disjoint shards.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from p2p_diloco.core.config import DataConfig
from p2p_diloco.core.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

SEGMENT_BYTES = 8192
BINARY_SNIFF_BYTES = 4096
"""A file with a NUL byte in its first this many bytes is binary, not text."""
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".toml", ".json", ".c", ".h", ".html", ".csv", "")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stable_order(paths: list[Path], root: Path) -> list[Path]:
    """A fixed pseudo-random order (hash of the relative path) so a byte cap samples the whole tree."""
    return sorted(paths, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())


def _collect_files(path: Path, default_corpus: bool) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"data path {path} does not exist")
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in ("__pycache__", "site-packages"))
        for name in filenames:
            p = Path(dirpath) / name
            if default_corpus and p.suffix != ".py":
                continue
            if not default_corpus and p.suffix.lower() not in TEXT_SUFFIXES:
                continue
            files.append(p)
    return _stable_order(files, path)


def load_corpus(cfg: DataConfig, path: str | None = None) -> bytes:
    """Read the corpus as bytes (at most ``cfg.max_bytes``); raise a clear error for empty/unreadable input."""
    chosen = path if path is not None else cfg.path
    default_corpus = not chosen
    root = stdlib_root() if default_corpus else Path(chosen).expanduser()
    files = _collect_files(root, default_corpus)
    if not files:
        raise ValueError(f"data path {root} holds no text files")
    limit = cfg.max_bytes or None
    parts: list[bytes] = []
    total = 0
    unreadable = binary = 0
    for f in files:
        try:
            blob = f.read_bytes()
        except OSError as e:
            if len(files) == 1:
                raise PermissionError(f"cannot read data file {f}: {e.strerror}") from None
            unreadable += 1
            log.warning("skipping unreadable data file %s: %s", f, e.strerror)
            continue
        if b"\x00" in blob[:BINARY_SNIFF_BYTES]:
            if len(files) == 1 and root.is_file():
                raise ValueError(f"data path {f}: a binary file (NUL bytes in its first {BINARY_SNIFF_BYTES} bytes), "
                                 "not text; give a text file or a folder of text files")
            binary += 1
            continue
        parts.append(blob)
        total += len(blob) + 1
        if limit is not None and total >= limit:
            break
    data = b"\n".join(parts)
    if limit is not None:
        data = data[:limit]
    if len(data) < 4 * SEGMENT_BYTES:
        skipped = ", ".join(f"{n} {what} files skipped" for n, what in ((unreadable, "unreadable"), (binary, "binary")) if n)
        raise ValueError(f"data path {root} holds only {len(data)} bytes of text{f' ({skipped})' if skipped else ''}; "
                         f"need at least {4 * SEGMENT_BYTES}")
    return data


# ---------------------------------------------------------------- files: listing and fingerprint

FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
"""File suffix -> the ``datasets`` packaged builder that reads it."""
FINGERPRINT_BLOCK = 64 * 1024
"""Bytes hashed at each end of every file for the ``files`` fingerprint."""
HELD_OUT_BUCKETS = 10_000
STREAM_PARTS = 8
"""Passes per epoch of a learner's stream: each keeps a seeded random eighth of the documents."""
SHUFFLE_BUFFER = 1_000
"""Documents in a learner's shuffle buffer (see :meth:`TextSource.documents`)."""
ENCODE_BATCH = 64
"""Documents tokenized together (``encode_batch``)."""
UTF8_CHUNK = 4 << 20
"""Bytes decoded at a time when a text file is checked for UTF-8 at start (about 1 GB/s: a 1 GB dataset costs a
second, read again by the stream anyway)."""


@dataclass(frozen=True)
class Fingerprint:
    """A dataset's identity: ``digest`` (16 hex digits, in the config hash) and where it was taken."""

    digest: str
    where: str
    """For messages: ``path /x/y, 12 files, 3.4 MB``."""


@dataclass(frozen=True)
class DataFile:
    path: Path
    name: str
    """Relative to ``data.path`` (the file's own name when ``data.path`` is a file): what the fingerprint hashes."""
    size: int

    @property
    def builder(self) -> str:
        return FILE_BUILDERS[self.path.suffix.lower()]


def list_files(path: str) -> list[DataFile]:
    """The ``.txt``/``.jsonl``/``.parquet`` files under ``data.path`` (hidden files and folders skipped), sorted
    by relative name; a one-line ``ValueError`` naming ``data.path`` for a missing path or an empty dataset."""
    if not path:
        raise ValueError('data.path: required with data.source = "files" (a .txt, .jsonl or .parquet file or a folder)')
    root = Path(path).expanduser()
    suffixes = ", ".join(FILE_BUILDERS)
    if root.is_file():
        if root.suffix.lower() not in FILE_BUILDERS:
            raise ValueError(f"data.path: {root} is not a {suffixes} file")
        files = [DataFile(root, root.name, root.stat().st_size)]
    elif root.is_dir():
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                p = Path(dirpath) / name
                if not name.startswith(".") and p.suffix.lower() in FILE_BUILDERS:
                    files.append(DataFile(p, p.relative_to(root).as_posix(), p.stat().st_size))
        files.sort(key=lambda f: f.name)
        if not files:
            raise ValueError(f"data.path: {root} holds no {suffixes} files (an empty dataset)")
    else:
        raise ValueError(f"data.path: no such file or folder: {root}")
    if not any(f.size for f in files):
        raise ValueError(f"data.path: {root}: its {len(files)} files are all empty (an empty dataset)")
    return files


@functools.lru_cache(maxsize=4096)
def _file_ends(path: Path, size: int, mtime_ns: int) -> bytes:
    """sha256 of a file's first and last :data:`FINGERPRINT_BLOCK` bytes (cached per size and mtime)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_BLOCK))
        if size > FINGERPRINT_BLOCK:
            f.seek(max(FINGERPRINT_BLOCK, size - FINGERPRINT_BLOCK))
            h.update(f.read(FINGERPRINT_BLOCK))
    return h.digest()


def files_fingerprint(files: list[DataFile], shown: str) -> Fingerprint:
    h = hashlib.sha256(b"p2p-diloco files v1\0")
    for f in files:
        h.update(f"{f.name}\0{f.size}\0".encode())
        h.update(_file_ends(f.path, f.size, f.path.stat().st_mtime_ns))
    return Fingerprint(h.hexdigest()[:16], f"path {shown}, {len(files)} files, {human_bytes(sum(f.size for f in files))}")


def human_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


@functools.lru_cache(maxsize=2)
def _stdlib_fingerprint(max_bytes: int) -> Fingerprint:
    blob = load_corpus(DataConfig(max_bytes=max_bytes))
    return Fingerprint(hashlib.sha256(blob).hexdigest()[:16],
                       f"the embedded corpus ({stdlib_root()}, {human_bytes(len(blob))})")


def fingerprint(d: DataConfig) -> Fingerprint:
    """The local data's fingerprint (what ``data.fingerprint`` pins); one-line ``ValueError`` if it cannot be read."""
    if d.source == "files":
        return files_fingerprint(list_files(d.path), d.path)
    if d.source == "hf":
        blob = json.dumps([d.name, d.config_name, d.split, d.revision]).encode()
        return Fingerprint(hashlib.sha256(b"p2p-diloco hf v1\0" + blob).hexdigest()[:16],
                           f"hub dataset {d.name}" + "".join(f" {k}={v}" for k, v in (
                               ("config", d.config_name), ("split", d.split), ("revision", d.revision)) if v))
    if not d.path:
        return _stdlib_fingerprint(d.max_bytes)
    blob = load_corpus(d)
    return Fingerprint(hashlib.sha256(blob).hexdigest()[:16], f"path {d.path}, {human_bytes(len(blob))} read")


def check_local(d: DataConfig) -> Fingerprint:
    """Our data's fingerprint, after checking it (and our tokenizer) against what the config pins
    (``data.fingerprint``, ``data.tokenizer_hash``: a config fetched from the run has them); one line if not."""
    ours = fingerprint(d)
    if d.fingerprint and ours.digest != d.fingerprint:
        raise ValueError(f"data fingerprint differs: yours {ours.digest} ({ours.where}), the run's {d.fingerprint}; "
                         f"every peer needs the same files")
    if d.tokenizer_hash:
        tok = load_tokenizer(d.tokenizer)
        if tok.digest != d.tokenizer_hash:
            raise ValueError(f"tokenizer differs: yours {tok.digest} (data.tokenizer {d.tokenizer}), the run's "
                             f"{d.tokenizer_hash}; every peer needs the same tokenizer")
    return ours


# ---------------------------------------------------------------- documents

def doc_digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def is_held_out(digest: bytes, eval_fraction: float) -> bool:
    """The held-out rule, the same on every peer: the document's hash falls in the first ``eval_fraction``."""
    return int.from_bytes(digest[:8], "big") % HELD_OUT_BUCKETS < round(eval_fraction * HELD_OUT_BUCKETS)


def in_shard(digest: bytes, shard: int, num_shards: int) -> bool:
    return int.from_bytes(digest[8:16], "big") % num_shards == shard


def stream_part(seed: int, digest: bytes) -> int:
    """Which of the :data:`STREAM_PARTS` passes of an epoch a learner with ``seed`` reads a document in."""
    h = hashlib.blake2b((seed % 2**64).to_bytes(8, "big") + digest, digest_size=8).digest()
    return int.from_bytes(h, "big") % STREAM_PARTS


def _offline() -> None:
    """Local files never need the hub: keep ``datasets`` from reaching for it (set before it is imported)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]


def check_utf8(path: Path) -> None:
    """A one-line ``ValueError`` naming ``path`` and the byte offset of its first byte that is not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the chunk read next
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(UTF8_CHUNK)
            pending = len(decoder.getstate()[0])  # the end of the previous chunk: an incomplete character
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                at = offset - pending + e.start
                raise ValueError(f"data.path: {path}: not UTF-8 text at byte {at} (0x{e.object[e.start]:02x}: "
                                 f"{e.reason}); .txt and .jsonl files must be UTF-8") from None
            if not chunk:
                return
            offset += len(chunk)


class TextSource:
    """The documents of a ``files`` or ``hf`` source, read through ``datasets`` (streaming), and the token
    sequences packed from them. Construction checks what can be checked cheaply (the files, the text field
    in each file's first row); reading errors surface as one-line ``ValueError``s."""

    def __init__(self, d: DataConfig, tokenizer: Tokenizer) -> None:
        self.cfg, self.tokenizer = d, tokenizer
        self._base: list[tuple[Any, str, int]] | None = None
        self.files = list_files(d.path) if d.source == "files" else []
        self.total_bytes = sum(f.size for f in self.files)
        for f in self.files:
            self._check_field(f)
        self.fingerprint = files_fingerprint(self.files, d.path) if self.files else fingerprint(d)

    def describe(self) -> str:
        """For the start line: ``3 files, 1.2 MB, data 3f9a..., tokenizer 7c01...``."""
        what = f"hub dataset {self.cfg.name}" if self.cfg.source == "hf" else \
            f"{len(self.files)} files, {human_bytes(self.total_bytes)}"
        return f"{what}, data {self.fingerprint.digest}, tokenizer {self.tokenizer.digest}"

    def _check_field(self, f: DataFile) -> None:
        """A JSONL or parquet file must have ``data.text_field`` (its first row; the parquet schema); a .txt or
        .jsonl file must be UTF-8 throughout (``datasets`` would fail mid-stream, without the file's name)."""
        field = self.cfg.text_field
        if f.builder in ("text", "json"):
            check_utf8(f.path)
        if f.builder == "json":
            with open(f.path, "rb") as fh:
                line = next((ln for ln in fh if ln.strip()), b"")
            if not line:
                return
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"data.path: {f.path}: its first line is not JSON ({_one_line(e)})") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                have = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"data.text_field: {f.path} has no text field {field!r} in its first row "
                                 f"(it has: {have}); set data.text_field")
        elif f.builder == "parquet":
            import pyarrow.parquet as pq

            try:
                names = pq.read_schema(f.path).names
            except Exception as e:  # pyarrow's ArrowInvalid and friends: not a parquet file
                raise ValueError(f"data.path: {f.path} is not a readable parquet file ({_one_line(e)})") from None
            if field not in names:
                raise ValueError(f"data.text_field: {f.path} has no column {field!r} (it has: {', '.join(names)}); "
                                 f"set data.text_field")

    def _datasets(self) -> list[tuple[Any, str, int]]:
        """One streaming dataset per builder: (dataset, its text column, its bytes), in a fixed order. Made once
        (``load_dataset`` takes a while); every iteration of a streaming dataset reads it from its start."""
        if self._base is None:
            self._base = self._load_datasets()
        return self._base

    def _load_datasets(self) -> list[tuple[Any, str, int]]:
        d = self.cfg
        if d.source == "files":
            _offline()
        import datasets

        if d.source == "hf":  # not exercised by the tests (no network there): kept to this one call
            try:
                ds = datasets.load_dataset(d.name, d.config_name or None, split=d.split, revision=d.revision or None,
                                           streaming=True)
            except Exception as e:  # offline, unknown name, ...: datasets raises many kinds
                raise ValueError(f"data.name: cannot stream the hub dataset {d.name!r} ({_one_line(e)})") from None
            return [(ds, d.text_field, 1)]
        out = []
        for builder in ("text", "json", "parquet"):
            files = [str(f.path) for f in self.files if f.builder == builder]
            if not files:
                continue
            kwargs: dict[str, Any] = {"sample_by": d.sample_by} if builder == "text" else {}
            if builder == "parquet":
                kwargs["columns"] = [d.text_field]
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
            column = "text" if builder == "text" else d.text_field
            out.append((ds, column, sum(f.size for f in self.files if f.builder == builder)))
        return out

    def documents(self, seed: int | None = None, keep: Callable[[str], bool] | None = None) -> Iterator[str]:
        """The documents that ``keep`` accepts (all if None), in file order (``seed`` None: the files sorted by
        relative name, a builder's files after the previous builder's) or in the order of ``seed``: the shards
        (files; parquet row groups, ``IterableDataset.reshard``) in a seeded order, through a seeded shuffle
        buffer of :data:`SHUFFLE_BUFFER` documents.

        Our own shard order and buffer, not ``IterableDataset.shuffle``: with parquet data that ends every pass
        with a 5 s sleep (datasets' ``SLEEP_TIME_ON_THREADS_SHUTDOWN``, its workaround for apache/arrow#45214),
        and a learner makes :data:`STREAM_PARTS` passes per epoch."""
        shards: list[tuple[Any, str]] = []
        for ds, column, _size in self._datasets():
            if keep is not None:
                ds = ds.filter(lambda row, c=column: not isinstance(row[c], str) or keep(row[c]))
            if seed is None:
                shards.append((ds, column))
                continue
            ds = ds.reshard()
            shards += [(ds.shard(num_shards=ds.num_shards, index=k), column) for k in range(ds.num_shards)]
        if seed is None:
            yield from self._texts(shards)
            return
        rng = random.Random(seed)
        rng.shuffle(shards)
        buffer: list[str] = []
        for text in self._texts(shards):
            if len(buffer) < SHUFFLE_BUFFER:
                buffer.append(text)
                continue
            i = rng.randrange(SHUFFLE_BUFFER)
            buffer[i], text = text, buffer[i]
            yield text
        rng.shuffle(buffer)
        yield from buffer

    def _texts(self, shards: list[tuple[Any, str]]) -> Iterator[str]:
        missing = 0
        for ds, column in shards:
            for row in ds:
                text = row.get(column)
                if not isinstance(text, str):
                    missing += 1
                    if missing == 1:
                        log.warning("skipping rows without text in %r (the first of them: %s)", column,
                                    {k: str(v)[:40] for k, v in row.items()})
                    continue
                if text:
                    yield text

    def _packed(self, docs: Iterator[str], window: int) -> Iterator[list[int]]:
        """Tokenize ``docs`` (in batches), each followed by the separator, and cut the stream into ``window``s."""
        buf: list[int] = []
        sep = list(self.tokenizer.separator)
        batch: list[str] = []
        for text in docs:
            batch.append(text)
            if len(batch) < ENCODE_BATCH:
                continue
            for ids in self.tokenizer.encode(batch):
                buf += ids + sep
            batch = []
            while len(buf) >= window:
                yield buf[:window]
                del buf[:window]
        for ids in self.tokenizer.encode(batch) if batch else []:
            buf += ids + sep
        while len(buf) >= window:
            yield buf[:window]
            del buf[:window]

    def held_out_tokens(self, n_tokens: int) -> list[int]:
        """The first ``n_tokens`` tokens of the held-out documents in file order (fewer if there are no more)."""
        frac = self.cfg.eval_fraction
        out: list[int] = []
        sep = list(self.tokenizer.separator)
        for text in self.documents(keep=lambda t: is_held_out(doc_digest(t), frac)):
            out += self.tokenizer.encode([text])[0] + sep
            if len(out) >= n_tokens:
                return out[:n_tokens]
        return out

    def train_sequences(self, block_size: int, seed: int, shard: int | None = None,
                        num_shards: int = 1) -> Iterator[list[int]]:
        """Endless ``block_size + 1``-token sequences of the training documents in the order of ``seed``
        (see the module docstring); with ``shard``, only the documents of that shard of ``num_shards``."""
        frac = self.cfg.eval_fraction
        first = seed % STREAM_PARTS
        epoch = 0
        while True:
            produced = False
            for p in range(STREAM_PARTS):
                part = (first + p) % STREAM_PARTS
                pass_seed = int.from_bytes(hashlib.sha256(f"{seed}\0{epoch}\0{part}".encode()).digest()[:8], "big") >> 1
                docs = self.documents(pass_seed, functools.partial(self._trains, seed=seed, part=part, frac=frac,
                                                                   shard=shard, num_shards=num_shards))
                for seq in self._packed(docs, block_size + 1):
                    produced = True
                    yield seq
            if not produced:
                where = f"shard {shard}/{num_shards} of " if shard is not None else ""
                raise ValueError(f"data.path: {where}{self.cfg.path or self.cfg.name} holds no training text for "
                                 f"one sequence of {block_size + 1} tokens (an empty dataset)")
            epoch += 1

    @staticmethod
    def _trains(text: str, *, seed: int, part: int, frac: float, shard: int | None, num_shards: int) -> bool:
        """Do we train on ``text`` in pass ``part`` of our epoch? Never on a held-out document."""
        digest = doc_digest(text)
        if is_held_out(digest, frac):
            return False
        if shard is not None:  # an explicit shard: its documents, in the shard's seeded order (every pass reads all)
            return in_shard(digest, shard, num_shards) and stream_part(seed, digest) == part
        return stream_part(seed, digest) == part
