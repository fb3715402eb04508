"""A peer's identity (one key file) and the swarm secret file of a private swarm.

Identity: one key file that gives both the libp2p peer id and the record-signing key.

Using the same key for the libp2p daemon (``identity_path``) and for signing DHT records
(:mod:`p2p_diloco.net.signing`) ties a record's owner to the peer id of its connections, so a
handler that knows the (authenticated) remote peer id can check it against the records
(:func:`p2p_diloco.net.membership.Membership.is_member`).

The file is libp2p's ``PrivateKey`` protobuf, the format hivemind's daemon reads. New files hold an
Ed25519 key (its owner marker and signatures are 150 bytes on each signed DHT entry, against 750 for
RSA); RSA files made before still load and work beside them. A file is created on first use with mode
0600 and never overwritten; an existing file readable by others is refused, as ssh does. hivemind is
imported inside the functions only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from p2p_diloco.net.signing import SigningKey

logger = logging.getLogger(__name__)

SWARM_KEY_BYTES = 32


@dataclass(frozen=True)
class Identity:
    """A loaded identity file."""

    path: Path
    peer_id: str
    """Base58 libp2p peer id derived from the key."""
    key_type: Literal["ed25519", "rsa"]
    """``ed25519`` (files made now) or ``rsa`` (files made before)."""
    key_data: bytes
    """Ed25519: the 32-byte private seed. RSA: the private key, DER (TraditionalOpenSSL), as hivemind's
    ``RSAPrivateKey`` pickles it."""

    def private_key(self) -> "SigningKey":
        """The record-signing key: an :class:`~p2p_diloco.net.signing.Ed25519Key`, or hivemind's
        ``RSAPrivateKey`` for an RSA file."""
        if self.key_type == "ed25519":
            from p2p_diloco.net.signing import Ed25519Key

            return Ed25519Key(self.key_data)
        from hivemind.utils.crypto import RSAPrivateKey

        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": self.key_data})  # hivemind's own (un)pickling path
        return key


def _write_new_key(path: Path) -> None:
    from hivemind.proto import crypto_pb2

    from p2p_diloco.net.signing import Ed25519Key

    key = Ed25519Key.generate()  # libp2p's Ed25519 private key data: the seed, then the public key
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=key.seed + key.public_bytes()).SerializeToString()
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL: two processes starting at once must not both write; 0600 from the first byte.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    logger.info("created identity %s", path)


def _open_mode(path: Path) -> int | None:
    """The mode of ``path`` if others may read or write it (refused, as ssh refuses such keys), else None."""
    mode = stat.S_IMODE(path.stat().st_mode)
    return mode if mode & 0o077 else None


def _refused(what: str, problem: str, path: Path, mode: int | None) -> ValueError:
    """One line: what is wrong with the content first, then with the mode, so that one try shows both."""
    also = f"; also mode {mode:04o} is readable by others: chmod 600 {path}" if mode is not None else ""
    return ValueError(f"{what}: {problem}{also}")


def load_or_create_identity(path: str | Path) -> Identity:
    """Load the key at ``path``, creating it (mode 0600) if it does not exist."""
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"identity file {path}: a folder, not a key file")
    if not path.exists():
        try:
            _write_new_key(path)
        except FileExistsError:
            logger.debug("identity %s appeared while creating it; loading it", path)
    mode = _open_mode(path)
    blob = path.read_bytes()
    what, fix = f"identity file {path}", "move it away to create a new one"
    if not blob:
        raise _refused(what, f"empty file, not a p2p-diloco/libp2p key (Ed25519 or RSA); {fix}", path, mode)
    try:
        pb = crypto_pb2.PrivateKey.FromString(blob)
        if pb.key_type == crypto_pb2.KeyType.Ed25519:
            from p2p_diloco.hivemind_ext.peerids import ed25519_public_of, peer_id_from_ed25519

            public = ed25519_public_of(pb.data)
            identity = Identity(path, peer_id_from_ed25519(public), "ed25519", bytes(pb.data[:32]))
        elif pb.key_type != crypto_pb2.KeyType.RSA or not pb.data:
            raise ValueError("neither an Ed25519 nor an RSA key")
        else:
            identity = Identity(path, PeerID.from_identity(blob).to_base58(), "rsa", bytes(pb.data))
    except Exception as e:  # protobuf DecodeError, cryptography ValueError: all mean "not our key file"
        raise _refused(what, f"is not a p2p-diloco/libp2p key (Ed25519 or RSA) ({e}); {fix}", path, mode) from None
    if mode is not None:
        raise ValueError(f"{what} is readable by others (mode {mode:04o}); run: chmod 600 {path}")
    return identity


def peer_id_from_public_key(ssh_public_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH format (as records carry it).

    Mirrors ``hivemind.p2p.PeerID.from_identity``, which only accepts private keys.
    """
    import multihash
    from cryptography.hazmat.primitives import serialization
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    public_key = serialization.load_ssh_public_key(ssh_public_key)
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


# ---------------------------------------------------------------- swarm secret (private swarms)


def write_swarm_key(path: str | Path, flag: str = "--out") -> str:
    """Write a new random swarm secret (hex, mode 0600); refuse to overwrite, and refuse a folder that does
    not exist (a typo in the path would otherwise create a tree of folders). Returns its fingerprint."""
    path = Path(path).expanduser()
    secret = secrets.token_bytes(SWARM_KEY_BYTES)
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {path.parent} does not exist; create it first or choose another path")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(f"{path} already exists; keep it (every peer needs the same secret) or choose another path") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return swarm_key_fingerprint(secret)


def read_swarm_key(path: str | Path) -> bytes:
    """Read a swarm secret written by :func:`write_swarm_key` (one line of hex). What is wrong with its content
    is reported first, with a mode readable by others in the same line."""
    path = Path(path).expanduser()
    what = f"--swarm-key {path}"
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what}: file not found (create one with: p2p-diloco keygen --out {path})") from None
    except IsADirectoryError:
        raise ValueError(f"{what}: a folder, not a swarm key file") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot read it ({e.strerror})") from None
    mode = _open_mode(path)
    expected = f"expected one line of {2 * SWARM_KEY_BYTES} hex digits written by p2p-diloco keygen"
    try:
        text = blob.decode("ascii").strip()
    except UnicodeDecodeError:
        raise _refused(what, f"not a swarm key (binary; {expected})", path, mode) from None
    if not text:
        raise _refused(what, f"empty file ({expected})", path, mode)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise _refused(what, f"not a swarm key ({expected})", path, mode) from None
    if len(secret) < 16:
        raise _refused(what, f"too short ({len(secret)} bytes, need >= 16; {expected})", path, mode)
    if mode is not None:
        raise ValueError(f"{what}: readable by others (mode {mode:04o}); run: chmod 600 {path}")
    return secret


def swarm_key_fingerprint(secret: bytes) -> str:
    """A short public name for a secret (safe to print and compare)."""
    return hashlib.sha256(b"p2p-diloco swarm key fingerprint\0" + secret).hexdigest()[:12]
