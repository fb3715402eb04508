"""hivemind's ``PeerID.from_identity`` for Ed25519 key files too: it reads RSA keys only.

hivemind 1.1.12 computes the peer id of an identity file in one place we reach: ``P2P.is_identity_taken``
(``check_if_identity_free``, the check that no other live peer uses our key file) calls
``PeerID.from_identity``, which parses the key as RSA DER and fails on an Ed25519 file, the kind
:mod:`p2p_diloco.net.keys` makes. :func:`install` wraps it: an Ed25519 file gets its libp2p peer id
(the public key as an identity multihash, :func:`peer_id_from_ed25519`), every other file goes to hivemind's own
code. Idempotent; the version is checked when it patches. The two key functions here are pure libp2p rules,
used by :mod:`p2p_diloco.net.keys` too.
"""

from __future__ import annotations

from typing import Any

from p2p_diloco.hivemind_ext import require_hivemind


def install() -> None:
    """Patch ``hivemind.p2p.PeerID.from_identity`` (in this process and the processes it forks later)."""
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    if getattr(PeerID.from_identity, "_p2p_diloco_ed25519", False):
        return
    require_hivemind(__name__)  # patches a hivemind classmethod
    original = PeerID.from_identity.__func__

    def from_identity(cls: Any, data: bytes) -> Any:
        key = crypto_pb2.PrivateKey.FromString(data)
        if key.key_type == crypto_pb2.KeyType.Ed25519:
            return cls.from_base58(peer_id_from_ed25519(ed25519_public_of(key.data)))
        return original(cls, data)

    from_identity._p2p_diloco_ed25519 = True  # type: ignore[attr-defined]
    PeerID.from_identity = classmethod(from_identity)


def ed25519_public_of(data: bytes) -> bytes:
    """The public key in libp2p's Ed25519 private key data (seed, then public key: 64 bytes), checked
    against the seed; raises ``ValueError`` on anything else."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if len(data) != 64:
        raise ValueError(f"Ed25519 key data must be 64 bytes (seed and public key), got {len(data)}")
    public = Ed25519PrivateKey.from_private_bytes(bytes(data[:32])).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if public != bytes(data[32:]):
        raise ValueError("Ed25519 key data: the public key does not belong to the seed")
    return public


def peer_id_from_ed25519(public: bytes) -> str:
    """The libp2p peer id (base58, ``12D3KooW...``) of a raw 32-byte Ed25519 public key: the protobuf
    ``PublicKey`` as an identity multihash (libp2p inlines keys of at most 42 bytes)."""
    import base58
    from hivemind.proto import crypto_pb2

    if len(public) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(public)}")
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public).SerializeToString()
    return base58.b58encode(bytes([0x00, len(encoded)]) + encoded).decode()
