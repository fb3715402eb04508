"""Corpora, per-peer shards and the held-out evaluation split.

The embedded default corpus is the source text of the running Python's standard library: real
text that is present wherever Python is, so the main job needs no download. ``data.path`` (or
``--data``) takes a text file or a folder of text files instead.

The corpus is cut into fixed-size segments; every ``round(1 / eval_fraction)``-th segment is
held out for evaluation and no learner ever trains on it. The remaining segments are dealt
round-robin into ``num_shards`` disjoint shards, one per learner.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from p2p_diloco.config import DataConfig

log = logging.getLogger(__name__)

SEGMENT_BYTES = 8192
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
    unreadable = 0
    for f in files:
        try:
            blob = f.read_bytes()
        except OSError as e:
            if len(files) == 1:
                raise PermissionError(f"cannot read data file {f}: {e.strerror}") from None
            unreadable += 1
            log.warning("skipping unreadable data file %s: %s", f, e.strerror)
            continue
        if b"\x00" in blob[:4096]:
            continue  # binary file
        parts.append(blob)
        total += len(blob) + 1
        if limit is not None and total >= limit:
            break
    data = b"\n".join(parts)
    if limit is not None:
        data = data[:limit]
    if len(data) < 4 * SEGMENT_BYTES:
        raise ValueError(
            f"data path {root} holds only {len(data)} bytes of text ({unreadable} unreadable files); "
            f"need at least {4 * SEGMENT_BYTES}"
        )
    return data


@dataclass(frozen=True)
class Splits:
    """The corpus cut into held-out evaluation bytes and ``num_shards`` disjoint training shards."""

    eval: torch.Tensor
    shards: tuple[torch.Tensor, ...]

    @property
    def train(self) -> torch.Tensor:
        return torch.cat(self.shards)


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
    """Mean cross-entropy in nats per byte on the held-out batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in eval_set:
        _, loss = model(x, y)
        total += float(loss)
    model.train(was_training)
    return total / len(eval_set)
