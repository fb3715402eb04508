"""``data.source = "files"``: .txt + .jsonl + .parquet streamed through ``datasets``, packed, held out by hash,
each learner in its own order; the dataset fingerprint and the tokenizer hash in the config hash (never a
path); bad input refused with one line. Every dataset and tokenizer here is made from files the test writes:
nothing is downloaded (``datasets`` runs offline, its cache in a temp folder).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("HF_HOME", str(Path(tempfile.gettempdir()) / "p2p-diloco-tests-hf-home"))  # not ~/.cache

import pytest

from p2p_diloco.core import data, datasource
from p2p_diloco.sim import simulator as sim
from p2p_diloco.core.config import DataConfig, load_config
from p2p_diloco.core.identity import config_hash
from p2p_diloco.core.identity import pin_data
from p2p_diloco.core.datasource import TextSource, doc_digest, is_held_out
from p2p_diloco.net.runconfig import data_mismatch
from p2p_diloco.core.tokenizer import BYTE_TOKENIZER, load_tokenizer, train_bpe
from procs import UNREACHABLE_PEER as PEER

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
LLAMA_TINY = str(ROOT / "configs" / "llama-tiny.toml")
MARKER = re.compile(rb"doc-(\d{5})")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, make_corpus: Callable[..., Path]) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "data")


def files_cfg(path: Path | str, *extra: str, base: str = TINY) -> Any:
    return load_config(base, ['data.source="files"', f'data.path="{path}"', *extra])


def markers(seqs: list[list[int]]) -> list[int]:
    """The document numbers in packed byte sequences (consecutive sequences are the packed stream itself)."""
    return [int(m) for m in MARKER.findall(bytes(t for s in seqs for t in s))]


def take(it: Iterator[list[int]], n: int) -> list[list[int]]:
    return [next(it) for _ in range(n)]


def test_documents_of_all_three_formats_are_packed_into_sequences(corpus: Path) -> None:
    src = TextSource(DataConfig(source="files", path=str(corpus)), BYTE_TOKENIZER)
    assert [f.name for f in src.files] == ["a.txt", "c.parquet", "sub/b.jsonl", "sub/d.txt"]
    docs = list(src.documents())  # file order: every document once, whole (the .txt's split at blank lines)
    assert sorted(int(MARKER.match(d.encode()).group(1)) for d in docs) == list(range(800))
    seqs = take(src.train_sequences(block_size=64, seed=1), 50)
    assert all(len(s) == 65 and all(0 <= t < 256 for t in s) for s in seqs)
    stream = bytes(t for s in seqs for t in s).decode()
    parts = [p for p in stream.split("\n\n") if p.startswith("doc-")][1:-1]  # whole documents, separated by \n\n
    assert parts and all(p in docs for p in parts)


def test_held_out_split_is_identical_on_two_peers_and_never_trained_on(corpus: Path, tmp_path: Path) -> None:
    elsewhere = shutil.copytree(corpus, tmp_path / "peer-b" / "my-data")  # the same files under another path
    a = TextSource(DataConfig(source="files", path=str(corpus)), BYTE_TOKENIZER)
    b = TextSource(DataConfig(source="files", path=str(elsewhere)), BYTE_TOKENIZER)
    assert a.held_out_tokens(8000) == b.held_out_tokens(8000)  # two independent loads, the same tokens
    held = {int(MARKER.match(t.encode()).group(1)) for t in a.documents() if is_held_out(doc_digest(t), 0.05)}
    assert 20 <= len(held) <= 70  # ~5% of 800
    assert set(markers([a.held_out_tokens(10**6)])) == held  # held out: exactly those documents, in file order
    # two epochs of a learner's stream: every training document, never a held-out one
    seen = set(markers(take(a.train_sequences(block_size=256, seed=7), 1600)))
    assert seen == set(range(800)) - held


def test_two_learners_streams_overlap_no_more_than_chance(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each learner's first K sequences hold some documents; had both drawn their documents uniformly at
    random from the N training documents, the number in common would be hypergeometric (mean a*b/N). Ours
    stay within 4 standard deviations of that mean, with a shuffle buffer of only 16 documents (so what mixes
    is the shard order and the per-learner parts, not a buffer as large as this small dataset)."""
    monkeypatch.setattr(datasource, "SHUFFLE_BUFFER", 16)
    src = TextSource(DataConfig(source="files", path=str(corpus)), BYTE_TOKENIZER)
    n_train = sum(1 for t in src.documents() if not is_held_out(doc_digest(t), 0.05))
    seeds = [data.stream_seed(0, peer, 1_700_000_000_000_000_000) for peer in ("QmAlpha", "QmBravo", "QmCharlie")]
    firsts = [set(markers(take(src.train_sequences(128, s), 40))) for s in seeds]
    for i in range(3):
        for j in range(i + 1, 3):
            a, b = len(firsts[i]), len(firsts[j])
            mean = a * b / n_train
            sd = math.sqrt(mean * (1 - a / n_train) * (n_train - b) / (n_train - 1))
            common = len(firsts[i] & firsts[j])
            assert common <= mean + 4 * sd, (common, mean, sd, a, b, n_train)
    # the same seed: the same stream (a learner's order is reproducible); in file order, all would share all
    assert take(src.train_sequences(128, seeds[0]), 5) == take(src.train_sequences(128, seeds[0]), 5)


def test_a_dataset_larger_than_max_bytes_is_streamed_whole(corpus: Path) -> None:
    cfg = files_cfg(corpus, "data.max_bytes=20000", "sim.learners=1")  # the corpus is ~190 KB
    assert sum(f.stat().st_size for f in corpus.rglob("*.*")) > 5 * cfg.data.max_bytes
    streamed = data.load_training_data(cfg, 1)
    assert isinstance(streamed, data.StreamedData)
    batches = streamed.train_batches(None, 16, cfg.model.block_size, seed=3)
    seen = set(markers([x[i].tolist() + [y[i, -1].item()] for x, y in (next(batches) for _ in range(250))
                        for i in range(len(x))]))
    # 400 documents of ~250 bytes: 5 x max_bytes; and the last ones of two files, far beyond the first max_bytes
    assert len(seen) > 400 and seen & set(range(760, 800)) and seen & set(range(360, 400))


def test_fingerprint_and_config_hash_ignore_the_path_and_see_the_files(corpus: Path, tmp_path: Path,
                                                                       make_corpus: Callable[..., Path]) -> None:
    moved = shutil.copytree(corpus, tmp_path / "elsewhere")
    same = [files_cfg(corpus), files_cfg(moved)]
    assert datasource.fingerprint(same[0].data).digest == datasource.fingerprint(same[1].data).digest
    assert config_hash(same[0]) == config_hash(same[1])
    other = make_corpus(tmp_path / "other", first=5000)
    changed = shutil.copytree(corpus, tmp_path / "changed")
    text = (changed / "sub" / "d.txt").read_text()
    (changed / "sub" / "d.txt").write_text(text[:-10] + "X" + text[-9:])  # one character in the last block
    renamed = shutil.copytree(corpus, tmp_path / "renamed")
    (renamed / "a.txt").rename(renamed / "a2.txt")
    digests = {datasource.fingerprint(files_cfg(p).data).digest for p in (corpus, other, changed, renamed)}
    assert len(digests) == 4
    assert config_hash(files_cfg(other)) != config_hash(same[0])
    # the config a peer publishes pins the fingerprint: it hashes the same where the data are absent
    pinned = pin_data(same[0])
    gone = load_config(TINY, ['data.source="files"', 'data.path="/nowhere"',
                              f'data.fingerprint="{pinned.data.fingerprint}"', 'data.tokenizer_hash="bytes"'])
    assert config_hash(gone) == config_hash(same[0])
    # and a peer whose files differ from the pinned ones is refused with one line naming both fingerprints
    theirs, ours = pinned.data.fingerprint, datasource.fingerprint(files_cfg(other).data).digest
    line = data_mismatch(pinned, files_cfg(other))
    assert re.fullmatch(rf"data fingerprint differs: yours {ours} \(path {re.escape(str(other))}, 4 files, \d+ kB\), "
                        rf"the run's {theirs}; every peer needs the same files", line), line
    assert data_mismatch(pinned, files_cfg(moved)) == ""
    # the same check before a learner joins with a fetched (pinned) config and its own --data
    fetched_with_other_files = dataclasses.replace(pinned, data=dataclasses.replace(pinned.data, path=str(other)))
    with pytest.raises(ValueError, match=f"^data fingerprint differs: yours {ours} .*, the run's {theirs}; every"):
        data.load_training_data(fetched_with_other_files, 1)


def test_the_embedded_corpus_is_fingerprinted_by_the_bytes_read() -> None:
    a, b = DataConfig(max_bytes=200_000), DataConfig(max_bytes=300_000)
    assert datasource.fingerprint(a).digest == datasource.fingerprint(DataConfig(max_bytes=200_000)).digest
    assert datasource.fingerprint(a).digest != datasource.fingerprint(b).digest
    import hashlib

    assert datasource.fingerprint(a).digest == hashlib.sha256(data.load_corpus(a)).hexdigest()[:16]


def test_a_bpe_tokenizer_made_here_packs_and_trains_llama_tiny(corpus: Path, tmp_path: Path) -> None:
    texts = [t for t in TextSource(DataConfig(source="files", path=str(corpus)), BYTE_TOKENIZER).documents()]
    tok = train_bpe(texts, 400, tmp_path / "tok")
    copy = shutil.copytree(tmp_path / "tok", tmp_path / "elsewhere" / "tok")
    assert load_tokenizer(str(copy)).digest == tok.digest == load_tokenizer(str(tmp_path / "tok" / "tokenizer.json")).digest
    assert tok.vocab_size <= 400 and tok.separator == (0,)  # <|endoftext|>
    # llama-tiny's vocabulary (256) is smaller than the tokenizer's: one line naming both
    too_small = files_cfg(corpus, f'data.tokenizer="{tmp_path / "tok"}"', base=LLAMA_TINY)
    with pytest.raises(ValueError, match=r"^data\.tokenizer: .* has \d+ tokens, more than the model's "
                                         r"model\.hf_config\.vocab_size=256; set model\.hf_config\.vocab_size"):
        data.load_training_data(too_small, 1)
    short = ("model.hf_config.vocab_size=400", "inner.total_steps=16", "inner.batch_size=4", "sim.learners=1",
             "data.eval_batches=1", "data.eval_batch_size=8")
    cfg = files_cfg(corpus, f'data.tokenizer="{tmp_path / "tok"}"', *short, base=LLAMA_TINY)
    assert config_hash(cfg) != config_hash(files_cfg(corpus, *short, base=LLAMA_TINY))  # the tokenizer counts
    streamed = data.load_training_data(cfg, 1)
    x, y = next(streamed.train_batches(None, 4, 64, seed=0))
    assert x.shape == (4, 64) and int(x.max()) < 400 and (x == 0).any()  # documents end with <|endoftext|>
    result = sim.run(cfg, streamed, eval_points=2)
    assert result.curve[-1]["eval_loss"] < result.curve[0]["eval_loss"] - 0.5, result.curve


def test_sim_trains_on_files_with_the_byte_tokenizer(corpus: Path) -> None:
    cfg = files_cfg(corpus, "inner.total_steps=40", "sim.learners=2")
    result = sim.run_from_config(cfg)
    assert result.curve[-1]["eval_loss"] < result.curve[0]["eval_loss"] - 1.5, result.curve


def test_bad_data_is_one_line_and_a_non_zero_exit(tmp_path: Path, refused: Callable[..., str],
                                                  make_corpus: Callable[..., Path]) -> None:
    no_field = tmp_path / "nofield"
    no_field.mkdir()
    (no_field / "rows.jsonl").write_text('{"body": "some text", "id": 1}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "notes.md").write_text("not a data file\n")
    good = make_corpus(tmp_path / "good", n=16)
    sim_argv = ["sim", "--config", TINY, "--quiet", "--set", 'data.source="files"']
    refused([*sim_argv, "--set", f'data.path="{no_field}"'],
             f"data.text_field: {no_field / 'rows.jsonl'} has no text field 'text' in its first row (it has: body, id)")
    refused([*sim_argv, "--set", f'data.path="{empty}"'], "data.path: ", "all empty (an empty dataset)")
    refused([*sim_argv, "--set", f'data.path="{nothing}"'],
             "data.path: ", "holds no .txt, .jsonl, .parquet files (an empty dataset)")
    refused([*sim_argv, "--set", f'data.path="{tmp_path / "missing"}"'],
             f"data.path: no such file or folder: {tmp_path / 'missing'}")
    missing_tok = ["--set", f'data.path="{good}"', "--set", f'data.tokenizer="{tmp_path / "no-tokenizer"}"']
    refused([*sim_argv, *missing_tok], f"data.tokenizer: no such file or folder: {tmp_path / 'no-tokenizer'}")
    # join refuses it before anything starts (no DHT: nothing dialled, nothing left running)
    refused(["join", "--initial-peers", PEER, "--config", TINY, "--set", 'data.source="files"', *missing_tok],
             "data.tokenizer: no such file or folder")
    # a config that cannot be: a tokenizer on the byte corpus, hub keys on local files
    with pytest.raises(ValueError, match=r'^data\.tokenizer: data\.source = "embedded" is bytes'):
        load_config(TINY, [f'data.tokenizer="{tmp_path}"'])
    with pytest.raises(ValueError, match=r'^data\.name: is only read with data\.source = "hf"'):
        files_cfg(good, 'data.name="allenai/c4"')
