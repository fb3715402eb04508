"""Training data as tensors: the byte corpus cut into shards, streamed datasets, held-out batches.

Two kinds (:func:`load_training_data`): :class:`Splits` for ``data.source = "embedded"`` (below) and
:class:`StreamedData` for ``files`` / ``hf`` (documents streamed, tokenized and packed by
:mod:`p2p_diloco.core.datasource`; held out by a hash of each document). Both give a learner its batches
(``train_batches``) and the held-out tokens (``eval``) that :func:`eval_batches` cuts windows from.

The embedded default corpus is the source text of the running Python's standard library: real
text that is present wherever Python is, so the main job needs no download. ``data.path`` (or
``--data``) takes a text file or a folder of text files instead.

The corpus is cut into fixed-size segments; every ``round(1 / eval_fraction)``-th segment is
held out for evaluation and no learner ever trains on it (the same split on every peer). By default
a networked learner samples random windows from the whole training split in its own order, seeded by
:func:`stream_seed` (run seed, peer id, incarnation), so any number of learners get distinct streams
without coordinating. With an explicit shard (``join --shard I --num-shards N``, the simulator, the
benchmarks) the training segments are dealt round-robin into ``num_shards`` disjoint shards instead.

A file with a NUL byte in its first 4 KiB counts as binary (as git and grep decide): inside a folder
it is skipped, named alone as ``data.path`` it is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch

from p2p_diloco.core.config import Config

# The byte corpus is read in p2p_diloco.core.datasource (no torch there: the config hash covers its
# fingerprint); re-exported here, where its callers look for it.
from p2p_diloco.core.datasource import (
    SEGMENT_BYTES,
    TextSource,
    load_corpus,
)
from p2p_diloco.core.model import lm_loss
from p2p_diloco.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Splits:
    """The corpus cut into held-out evaluation bytes and ``num_shards`` disjoint training shards."""

    eval: torch.Tensor
    shards: tuple[torch.Tensor, ...]

    @property
    def train(self) -> torch.Tensor:
        return torch.cat(self.shards)

    def train_batches(self, shard: int | None, batch_size: int, block_size: int,
                      seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Random windows of shard ``shard`` (None: of the whole training split)."""
        return batches(self.train if shard is None else self.shards[shard], batch_size, block_size, seed)

    def train_size(self, shard: int | None) -> str:
        size = sum(len(s) for s in self.shards) if shard is None else len(self.shards[shard])
        return f"{size / 1e6:.1f} MB"


@dataclass(frozen=True)
class StreamedData:
    """A streamed dataset (``data.source`` files or hf): each learner packs its own order of the training
    documents (:meth:`datasource.TextSource.train_sequences`); ``eval`` holds the first held-out tokens in file
    order (``data.eval_batches x data.eval_batch_size`` sequences), identical on every peer."""

    source: TextSource
    eval: torch.Tensor
    num_shards: int

    @property
    def tokenizer(self) -> Tokenizer:
        return self.source.tokenizer

    def train_batches(self, shard: int | None, batch_size: int, block_size: int,
                      seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless batches of packed sequences in the order of ``seed`` (of shard ``shard`` of ``num_shards``),
        made :data:`PREFETCH_BATCHES` ahead in a thread: reading, filtering and tokenizing overlap the inner
        steps (the tokenizer and torch release the GIL) instead of adding to them."""
        sequences = self.source.train_sequences(block_size, seed, shard, self.num_shards if shard is not None else 1)

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            window = torch.tensor([next(sequences) for _ in range(batch_size)], dtype=torch.long)
            return window[:, :-1], window[:, 1:]

        return _prefetched(make, PREFETCH_BATCHES)

    def train_size(self, shard: int | None) -> str:
        return self.source.describe()


TrainingData = Splits | StreamedData
PREFETCH_BATCHES = 4
"""Batches a streamed dataset prepares ahead of the inner steps."""


def _prefetched(make: Callable[[], T], depth: int) -> Iterator[T]:
    """``make()``, over and over, computed up to ``depth`` items ahead in a daemon thread, in order. An exception
    in ``make`` is raised here, at the item it would have made; the thread stops when the iterator is closed."""
    items: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            while not stop.is_set():
                item = make()
                while not stop.is_set():
                    try:
                        items.put((True, item), timeout=0.5)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer, who raises it
            items.put((False, e))

    threading.Thread(target=produce, name="data-prefetch", daemon=True).start()
    try:
        while True:
            ok, item = items.get()
            if not ok:
                raise item
            yield item
    finally:
        stop.set()


def load_training_data(cfg: Config, num_shards: int, path: str | None = None) -> TrainingData:
    """The run's training data for ``num_shards`` explicit shards, with every check that needs the data
    done here (missing, empty, unreadable, too small, a JSONL without the text field, a tokenizer that is
    missing or larger than the model's vocabulary, a fingerprint other than the one the config pins):
    before a learner joins. ``path`` replaces ``data.path`` (``sim --data``)."""
    from p2p_diloco.core import datasource
    from p2p_diloco.core.tokenizer import check_vocab, load_tokenizer

    d = cfg.data if path is None else dataclasses.replace(cfg.data, path=path)
    datasource.check_local(d)
    window = cfg.model.block_size + 1
    if d.source == "embedded":
        splits = split_corpus(load_corpus(d), num_shards, d.eval_fraction)
        shortest = min(len(s) for s in splits.shards)
        if shortest <= window or len(splits.eval) <= window:
            raise ValueError(f"data path {d.path or 'the embedded corpus'}: too small for windows of {window} bytes "
                             f"({shortest} bytes in the smallest of {num_shards} shards, {len(splits.eval)} held out)")
        return splits
    tok = load_tokenizer(d.tokenizer)
    vocab, key = model_vocab(cfg)
    check_vocab(tok, vocab, key)
    source = datasource.TextSource(d, tok)
    held = source.held_out_tokens(d.eval_batches * d.eval_batch_size * window)
    if len(held) <= window:
        raise ValueError(f"data.path: {d.path or d.name}: the held-out documents (data.eval_fraction="
                         f"{d.eval_fraction}) hold {len(held)} tokens, fewer than one sequence of {window}; "
                         f"more text or a larger data.eval_fraction")
    streamed = StreamedData(source, torch.tensor(held, dtype=torch.long), num_shards)
    next(streamed.source.train_sequences(cfg.model.block_size, 0))  # an empty training set fails now
    return streamed


def model_vocab(cfg: Config) -> tuple[int, str]:
    """The model's vocabulary size and the key that sets it (the tokenizer's ids must fit)."""
    if cfg.model.kind == "hf":
        from p2p_diloco.core import hfmodel

        arch = hfmodel.check(cfg.model)
        return arch.vocab_size, f"{arch.source}.vocab_size"
    from p2p_diloco.core.model import VOCAB_SIZE

    return VOCAB_SIZE, "the byte GPT's vocabulary"


def split_corpus(data: bytes, num_shards: int, eval_fraction: float) -> Splits:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_seg = len(buf) // SEGMENT_BYTES
    segments = [buf[i * SEGMENT_BYTES : (i + 1) * SEGMENT_BYTES] for i in range(n_seg)]
    every = max(2, round(1 / eval_fraction))
    eval_segs = [s for i, s in enumerate(segments) if i % every == every // 2]
    train_segs = [s for i, s in enumerate(segments) if i % every != every // 2]
    if len(train_segs) < num_shards:
        raise ValueError(f"corpus too small: {len(train_segs)} training segments for {num_shards} shards")
    shards = tuple(torch.cat(train_segs[k::num_shards]) for k in range(num_shards))
    return Splits(eval=torch.cat(eval_segs), shards=shards)


def stream_seed(run_seed: int, peer_id: str, incarnation: int, step: int = 0) -> int:
    """Seed of a learner's own order over the whole training split (for :func:`batches`).

    Distinct for distinct peers (``peer_id``), for restarts of one peer with a stable identity
    (``incarnation``: its start time in ns) and after a resume (``step``, the step it resumed at),
    so learners need no shard assignment to see different data; deterministic for equal inputs.
    """
    blob = f"p2p-diloco data stream\0{run_seed}\0{peer_id}\0{incarnation}\0{step}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big") >> 1  # 63 bits: any torch seed


def stream_name(seed: int) -> str:
    """A short public name for a stream seed, as the learner's start line shows it."""
    return f"{seed:016x}"[:8]


def shard_seed(run_seed: int, shard: int, step: int = 0) -> int:
    """Seed of an explicit shard's order (``--shard``): reproducible across runs, as benchmarks want;
    after a resume at ``step`` the stream goes on with fresh batches."""
    return run_seed * 1000 + shard + (7919 * (step + 1) if step else 0)


def batches(stream: torch.Tensor, batch_size: int, block_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows of ``stream``: (inputs, next-byte targets), deterministic for a seed."""
    if len(stream) <= block_size + 1:
        raise ValueError(f"data stream of {len(stream)} bytes is shorter than one window of {block_size + 1}")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(block_size + 1)
    while True:
        starts = torch.randint(0, len(stream) - block_size - 1, (batch_size,), generator=gen)
        window = stream[starts[:, None] + offsets].long()
        yield window[:, :-1], window[:, 1:]


def eval_batches(stream: torch.Tensor, n_batches: int, batch_size: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced windows of the held-out split (the same for every peer and every run)."""
    n = n_batches * batch_size
    span = len(stream) - block_size - 1
    if span <= 0:
        raise ValueError(f"evaluation split of {len(stream)} bytes is shorter than one window")
    starts = torch.linspace(0, span, n).long()
    window = stream[starts[:, None] + torch.arange(block_size + 1)].long()
    return [(window[i : i + batch_size, :-1], window[i : i + batch_size, 1:]) for i in range(0, n, batch_size)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_set: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy in nats per token (per byte for byte data) on the held-out batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in eval_set:
        total += float(lm_loss(model, x, y))
    model.train(was_training)
    return total / len(eval_set)
