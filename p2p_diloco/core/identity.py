"""What counts in a config's identity: the config hash (:func:`config_hash`), and the parts of it and of a
data-parallel reference key that are not the config's plain values -- the data by what is read, the model by what
it builds, keys added later only when they change the training -- so that hashes do not depend on local paths, and
the hashes of existing runs and committed reference curves stay valid."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

from p2p_diloco.core.config import BYTE_GPT_KEYS, LEGACY_DATA_KEYS

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config, DataConfig, InnerConfig, ModelConfig

DATA_PATH_KEYS = ("path", "tokenizer", "fingerprint", "tokenizer_hash")


def config_hash(cfg: Config) -> str:
    """Stable 16-hex-digit hash of the resolved config (key order and float spelling do not matter).

    The model section counts by what it builds (:func:`model_identity`), the data section by the data and
    tokenizer it reads (:func:`data_identity`), never by a local path."""
    blob = json.dumps({**cfg.to_dict(), "model": model_identity(cfg.model), "inner": inner_identity(cfg.inner),
                       "averaging": averaging_identity(cfg),
                       "data": data_identity(cfg.data)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def data_identity(d: DataConfig) -> dict[str, Any]:
    """What the data section contributes to the config hash: its keys without the local paths, with the
    dataset's fingerprint and the tokenizer's hash in their place. Pinned values (``data.fingerprint``,
    ``data.tokenizer_hash``: a config fetched from the DHT has them) are taken as they are, so the hash is
    computable where the data are not; else they are computed from the local data (cached per process)."""
    from p2p_diloco.core import datasource, tokenizer

    ident = {k: v for k, v in dataclasses.asdict(d).items() if k not in DATA_PATH_KEYS}
    ident["fingerprint"] = d.fingerprint or datasource.fingerprint(d).digest
    ident["tokenizer"] = d.tokenizer_hash or tokenizer.tokenizer_hash(d.tokenizer)
    return ident


def reference_data_identity(d: DataConfig) -> dict[str, Any]:
    """The data part of a data-parallel reference key: the embedded byte corpus keeps its keys from before
    ``data.source`` existed (the committed curves are keyed by them; they do not cover the corpus read, so a
    curve computed on another Python's stdlib is taken as the reference too); other sources
    :func:`data_identity`."""
    if d.source == "embedded":
        return {k: getattr(d, k) for k in LEGACY_DATA_KEYS}
    return data_identity(d)


def pin_data(cfg: Config) -> Config:
    """``cfg`` with ``data.fingerprint`` and ``data.tokenizer_hash`` set from the local data (if not set): the
    config as published to the DHT and in checkpoints, whose hash needs no data (same hash as ``cfg``)."""
    ident = data_identity(cfg.data)
    data = dataclasses.replace(cfg.data, fingerprint=ident["fingerprint"], tokenizer_hash=ident["tokenizer"])
    return dataclasses.replace(cfg, data=data)


def inner_identity(i: InnerConfig) -> dict[str, Any]:
    """What the inner section contributes to the config hash (and to a data-parallel reference key): every key,
    but ``precision`` only when it is not the default fp32, so that the hashes of runs and the committed
    reference curves from before ``precision`` existed stay valid. bf16 changes the training: it counts."""
    d = dataclasses.asdict(i)
    if d["precision"] == "fp32":
        del d["precision"]
    return d


def model_identity(m: ModelConfig) -> dict[str, Any]:
    """What the model section contributes to the config hash (and to a data-parallel reference key).

    byte-gpt: its five keys, as before ``kind`` existed, so the hashes of existing runs and the committed
    reference curves stay valid. hf: the kind, the context length, the resolved transformers architecture
    (``to_dict()`` without bookkeeping such as ``transformers_version``) and a content hash of the
    ``init_from`` weights; two peers with the same model under different local paths hash the same.
    Imports transformers for hf only.
    """
    if m.kind != "hf":
        return {k: getattr(m, k) for k in BYTE_GPT_KEYS}
    from p2p_diloco.core import hfmodel

    return {"kind": m.kind, "block_size": m.block_size, "architecture": hfmodel.architecture(m),
            "init_weights": hfmodel.init_digest(m)}


def averaging_identity(cfg: Config) -> dict[str, Any] | None:
    """What the averaging section contributes to the config hash: every key but ``kept_rounds`` (a learner's own), and
    ``groups`` and ``matchmaking`` only when they are not the defaults 'heal' and 'dht', so that the hashes of runs
    from before either existed stay valid. None
    for a config whose section was set to None on purpose (the hash of what a simulation reads:
    ``scripts/bench_parity_demo.py``)."""
    if cfg.averaging is None:
        return None
    d = dataclasses.asdict(cfg.averaging)
    del d["kept_rounds"]  # each learner's own choice: peers that keep different numbers of rounds interoperate
    if d["groups"] == "heal":
        del d["groups"]
    if cfg.averaging.clock_groups:
        d["matchmaking"] = "clock"
    else:  # likewise: hashes from before groups from the clock stay valid
        del d["matchmaking"]
    return d
