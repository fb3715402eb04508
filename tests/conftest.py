"""Fixtures that several test modules share: processes that never outlive their test, ports from the OS,
and the small files (profiles, corpora, signed DHT records) that tests build the same way.

Helpers for processes are in ``procs.py`` and for in-process averagers in ``averagers.py``; what needs
pytest's machinery (a temp folder, ``capsys``, clean-up after the test) is here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
from dataclasses import astuple, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from procs import ProcGroup, child_pids

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny.toml"

CORPUS_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial bumpkin "
                "near green hills and deep rivers under bright stars").split()
"""The vocabulary of :func:`make_corpus`'s documents."""
RECORD_TTL_S = 30.0
"""How long past ``now`` a record signed by :func:`sign_record` stays valid."""


PYTEST_HANDLERS = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
"""pytest's own handlers, before any test (or a module's fixture) started hivemind objects in this process."""


@pytest.fixture(autouse=True)
def _signal_handlers_put_back() -> Iterator[None]:
    """hivemind's averagers set SIGINT to SIG_IGN in the process that starts them, and an ignored signal is
    inherited by every process started later: after a test had started hivemind objects in pytest's own
    process, the learner that ``test_signals_api.py`` sends Ctrl+C to ignored it and trained on (it passed alone
    and failed in the suite). Each test gets pytest's handlers back."""
    yield
    for s, handler in PYTEST_HANDLERS.items():
        if handler is not None and signal.getsignal(s) != handler:
            signal.signal(s, handler)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcGroup]:
    """Start processes with this; every process (and everything it started) is killed when the test ends."""
    with ProcGroup(tmp_path) as group:
        yield group


@pytest.fixture
def tiny_config() -> str:
    """The path of ``configs/tiny.toml``, the smallest real run."""
    return str(TINY_CONFIG)


@pytest.fixture
def free_port() -> int:
    """A loopback TCP port that the OS just reported free (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def held_port() -> Iterator[socket.socket]:
    """A listening socket on a free loopback port, with the options another peer's daemon sets (libp2p
    listens with SO_REUSEADDR and SO_REUSEPORT, which is why a second daemon on it starts without error)."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    with held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held


@pytest.fixture
def refused(capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """``refused(argv, *expected)``: run the CLI in this process; assert exit 2, one ``p2p-diloco: error:`` line
    on stderr containing every ``expected`` text, no traceback, nothing on stdout and no child process left.
    Returns the line."""
    from p2p_diloco.cli import main as cli

    def run(argv: list[str], *expected: str) -> str:
        before = set(child_pids())
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        assert rc == 2, (rc, out, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("p2p-diloco: error: "), err
        assert "Traceback" not in err and out == "", (out, err)
        for text in expected:
            assert text in lines[0], (text, lines[0])
        assert set(child_pids()) <= before, "a process was left running"
        return lines[0]

    return run


@pytest.fixture
def write_profile(tmp_path: Path) -> Callable[..., Path]:
    """``write_profile(name, slowdown=1.0, min_step_s=0.1, folder=tmp_path)``: a learner profile file
    (``--profile``) with one thread."""

    def write(name: str, slowdown: float = 1.0, min_step_s: float = 0.1, folder: Path | None = None) -> Path:
        path = (folder or tmp_path) / f"{name}.toml"
        path.write_text(f'name = "{name}"\nslowdown = {slowdown}\nmin_step_s = {min_step_s}\nthreads = 1\n')
        return path

    return write


def corpus_doc(i: int, rng: random.Random) -> str:
    """Document ``i``: a ``doc-NNNNN`` marker (to find it again in packed sequences), then 25-60 words."""
    return f"doc-{i:05d} " + " ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(25, 60))) + "."


def write_corpus(root: Path, n: int = 200, first: int = 0) -> Path:
    """``root`` with 4 x ``n`` documents numbered from ``first``: ``a.txt`` and ``sub/d.txt`` (paragraphs),
    ``sub/b.jsonl`` (field ``text``, and another), ``c.parquet`` (8 row groups: 8 shards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(first)
    docs = [corpus_doc(first + i, rng) for i in range(4 * n)]
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("\n\n".join(docs[:n]) + "\n")
    (root / "sub" / "d.txt").write_text("\n\n".join(docs[n : 2 * n]) + "\n")
    (root / "sub" / "b.jsonl").write_text("".join(json.dumps({"id": k, "text": t}) + "\n"
                                                  for k, t in enumerate(docs[2 * n : 3 * n])))
    pq.write_table(pa.table({"text": docs[3 * n :], "n": list(range(n))}), root / "c.parquet", row_group_size=n // 8)
    return root


@pytest.fixture(scope="session")
def make_corpus() -> Callable[..., Path]:
    """``make_corpus(root, n=200, first=0)``: a small multi-format dataset (:func:`write_corpus`)."""
    return write_corpus


@pytest.fixture
def sign_record() -> Callable[..., Any]:
    """``sign_record(t, signer_key, owner_key, key, value, now)``: a hivemind DHT record for ``key`` under
    ``owner_key``'s subkey, signed (as far as possible) by ``signer_key``; keys are hivemind ``RSAPrivateKey``s
    or our ``Ed25519Key``s. ``t`` holds hivemind's ``RSASignatureValidator``, ``ser`` (its serializer),
    ``DHTID`` and ``DHTRecord``: tests import them lazily."""

    def sign(t: dict[str, Any], signer_key: Any, owner_key: Any, key: str, value: Any, now: float) -> Any:
        import base64

        from p2p_diloco.net.signing import Ed25519Key, Ed25519SignatureValidator, owner_subkey

        record = t["DHTRecord"](key=t["DHTID"].generate(source=key).to_bytes(), subkey=t["ser"].dumps(owner_subkey(owner_key)),
                                value=t["ser"].dumps(value), expiration_time=now + RECORD_TTL_S)
        if isinstance(owner_key, Ed25519Key):
            if signer_key is owner_key:
                return replace(record, value=Ed25519SignatureValidator(owner_key).sign_value(record))
            # a forger signs with its own key (sign_value would refuse to sign someone else's subkey)
            signature = base64.b64encode(signer_key.sign(t["ser"].dumps(astuple(record))))
            return replace(record, value=record.value + b"[ed25519-sig:" + signature + b"]")
        signer = t["RSASignatureValidator"](signer_key)
        if signer_key is owner_key:
            return replace(record, value=signer.sign_value(record))
        signature = signer_key.sign(signer._serialize_record(record))
        return replace(record, value=record.value + b"[signature:" + signature + b"]")

    return sign


@pytest.fixture
def write_rsa_identity() -> Callable[[Path], None]:
    """``write_rsa_identity(path)``: an identity file as p2p-diloco made them before Ed25519 (libp2p's protobuf
    of an RSA key, DER; mode 0600)."""

    def write(path: Path) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from hivemind.proto import crypto_pb2

        der = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
        path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString())
        os.chmod(path, 0o600)

    return write


INTEGRATION = Path(__file__).resolve().parent / "integration"
"""The integration tier: real DHTs, averagers and processes (``pytest tests/integration``)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tiers are on disk: every test under ``tests/integration`` is marked ``integration`` (so ``-m`` selects
    the same tests), and one marked so anywhere else is refused (it would slow the fast tier down)."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)
        elif item.get_closest_marker("integration") is not None:
            raise pytest.UsageError(f"{item.nodeid}: marked integration outside tests/integration (move it there)")


FUTURE_LOCK_TIMEOUT_S = 30.0
"""How long the check after a test waits for hivemind's process-wide future lock (held for microseconds)."""


@pytest.fixture(autouse=True)
def hivemind_future_lock_left_free() -> Iterator[None]:
    """After each test that loaded hivemind: its futures' process-wide lock is free. It is one
    ``multiprocessing`` lock shared by every process forked from this one; a forked DHT killed while holding
    it leaves it held, and every later in-process DHT then hangs on its first update -- a failure that showed up
    tests later, far from its cause. Fail the test that left it held instead."""
    yield
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is None:
        return
    lock = mpfuture.MPFuture._update_lock
    if not lock.acquire(timeout=FUTURE_LOCK_TIMEOUT_S):
        pytest.fail("hivemind's process-wide future lock is still held: a process forked from the test process was "
                    "killed while holding it (kill such processes in a Python of their own)")
    lock.release()
