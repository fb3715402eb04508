"""Corpora, shards and the held-out split."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from p2p_diloco import data
from p2p_diloco.config import DataConfig, ModelConfig
from p2p_diloco.model import VOCAB_SIZE, build_model, count_parameters


def test_embedded_corpus_is_stdlib_source() -> None:
    blob = data.load_corpus(DataConfig(max_bytes=200_000))
    assert len(blob) == 200_000
    assert b"def " in blob and b"import " in blob
    assert blob == data.load_corpus(DataConfig(max_bytes=200_000))  # deterministic


def test_shards_are_disjoint_and_eval_is_held_out() -> None:
    # every segment is distinct, so membership can be checked by content
    seg = data.SEGMENT_BYTES
    blob = b"".join(bytes([i % 251]) * 7 + i.to_bytes(4, "big") + b"x" * (seg - 11) for i in range(100))
    splits = data.split_corpus(blob, 3, 0.1)
    chunks = lambda t: {bytes(t[i : i + seg].tolist()) for i in range(0, len(t), seg)}  # noqa: E731
    ev, shards = chunks(splits.eval), [chunks(s) for s in splits.shards]
    assert len(ev) == 10 and sum(len(s) for s in shards) == 90
    for i, s in enumerate(shards):
        assert not (s & ev)
        for t in shards[i + 1 :]:
            assert not (s & t)
    assert data.split_corpus(blob, 3, 0.1).shards[1].equal(splits.shards[1])


def test_batches_are_deterministic_windows() -> None:
    stream = torch.arange(1000) % 256
    a = next(data.batches(stream.to(torch.uint8), 4, 16, seed=3))
    b = next(data.batches(stream.to(torch.uint8), 4, 16, seed=3))
    assert a[0].equal(b[0]) and a[0].shape == (4, 16)
    assert a[1][:, :-1].equal(a[0][:, 1:])  # targets are the next bytes


def test_user_path_file_and_folder(tmp_path: Path) -> None:
    text = ("hello world, " * 4000).encode()
    (tmp_path / "a.txt").write_bytes(text)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_bytes(text)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01" * 100)
    assert data.load_corpus(DataConfig(), str(tmp_path / "a.txt")) == text
    both = data.load_corpus(DataConfig(), str(tmp_path))
    assert len(both) == 2 * len(text) + 1


def test_clear_errors_for_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_corpus(DataConfig(), str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        data.load_corpus(DataConfig(), str(tmp_path / "empty"))
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(ValueError, match="holds only 4 bytes"):
        data.load_corpus(DataConfig(), str(tmp_path / "small.txt"))
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("x" * 100_000)
        locked.chmod(0)
        with pytest.raises(PermissionError, match="cannot read"):
            data.load_corpus(DataConfig(), str(locked))


def test_model_shapes_and_size() -> None:
    model = build_model(ModelConfig(), seed=0)
    assert 0.8e6 < count_parameters(model) < 0.9e6
    x = torch.randint(0, VOCAB_SIZE, (2, 16))
    logits, loss = model(x, torch.randint(0, VOCAB_SIZE, (2, 16)))
    assert logits.shape == (2, 16, VOCAB_SIZE) and loss is not None
    assert abs(float(loss) - 5.545) < 0.1  # ln(256): untrained
    same = build_model(ModelConfig(), seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), same.parameters()))
    with pytest.raises(ValueError, match="exceeds model.block_size"):
        model(torch.zeros(1, 129, dtype=torch.long))
