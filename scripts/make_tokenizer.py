"""Train a byte-level BPE tokenizer on local text, for ``data.tokenizer`` (nothing is downloaded).

    python scripts/make_tokenizer.py --data my_texts/ --out tokenizers/my-bpe-8k --vocab-size 8192

reads the ``.txt`` / ``.jsonl`` / ``.parquet`` files of ``--data`` (as ``data.source = "files"`` reads them:
``--text-field``, ``--sample-by``) and writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``--out``.
Set ``data.tokenizer`` to that folder and the model's ``vocab_size`` to at least the size printed.

Without ``--data`` it trains on the embedded corpus (this Python's stdlib source); ``--write-corpus DIR``
also writes that corpus as ``.txt`` files into DIR, so that ``configs/llama-20m.toml`` runs with no
download at all:

    python scripts/make_tokenizer.py --write-corpus data/stdlib-text --out tokenizers/stdlib-bpe-8k
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Iterator

from p2p_diloco.core.config import DataConfig
from p2p_diloco.core.datasource import TextSource, load_corpus
from p2p_diloco.core.tokenizer import BYTE_TOKENIZER, train_bpe

CORPUS_FILE_BYTES = 1_000_000
"""Size of each .txt file --write-corpus writes (several files: learners read them in their own orders)."""


def embedded_paragraphs(max_bytes: int) -> Iterator[str]:
    text = load_corpus(DataConfig(max_bytes=max_bytes)).decode("utf-8", errors="replace")
    yield from (p for p in text.split("\n\n") if p.strip())


def write_corpus(folder: Path, max_bytes: int) -> int:
    """The embedded corpus as .txt files of about :data:`CORPUS_FILE_BYTES` (cut at blank lines); returns the count."""
    folder.mkdir(parents=True, exist_ok=True)
    parts: list[str] = []
    size = count = 0
    for para in embedded_paragraphs(max_bytes):
        parts.append(para)
        size += len(para) + 2
        if size >= CORPUS_FILE_BYTES:
            (folder / f"part-{count:04d}.txt").write_text("\n\n".join(parts) + "\n")
            parts, size, count = [], 0, count + 1
    if parts:
        (folder / f"part-{count:04d}.txt").write_text("\n\n".join(parts) + "\n")
        count += 1
    return count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a .txt/.jsonl/.parquet file or folder to train on (default: the embedded corpus)")
    p.add_argument("--out", required=True, help="folder to write tokenizer.json and tokenizer_config.json into")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary (default: 8192)")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl/.parquet rows (default: text)")
    p.add_argument("--sample-by", default="paragraph", choices=("paragraph", "line", "document"),
                   help="what one document of a .txt file is (default: paragraph)")
    p.add_argument("--max-bytes", type=int, default=40_000_000,
                   help="embedded corpus: bytes read (default: 40000000)")
    p.add_argument("--write-corpus", metavar="DIR", help="also write the embedded corpus as .txt files into DIR")
    args = p.parse_args()
    t0 = time.monotonic()
    try:
        if args.write_corpus:
            n = write_corpus(Path(args.write_corpus), args.max_bytes)
            print(f"wrote the embedded corpus as {n} .txt files into {args.write_corpus}")
        if args.data:
            d = DataConfig(source="files", path=args.data, text_field=args.text_field, sample_by=args.sample_by)
            texts: Iterator[str] = TextSource(d, BYTE_TOKENIZER).documents()
        else:
            texts = embedded_paragraphs(args.max_bytes)
        tok = train_bpe(texts, args.vocab_size, Path(args.out))
    except ValueError as e:
        print(f"make_tokenizer: {e}", file=sys.stderr)
        return 2
    print(f"tokenizer {tok.digest}: {tok.vocab_size} tokens, written to {args.out} in {time.monotonic() - t0:.1f} s; "
          f"set data.tokenizer = \"{args.out}\" and the model's vocab_size >= {tok.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
