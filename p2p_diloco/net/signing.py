"""Who owns a DHT entry: Ed25519 owner markers and their record validator, beside hivemind's RSA ones.

A peer publishes under a subkey that *is* its owner marker, and the DHT's record validators refuse any value
under that subkey that the marker's key did not sign: nobody can write in another peer's name. hivemind's own
:class:`RSASignatureValidator` puts a 2048-bit RSA key in the marker and an RSA signature in the value, about
750 bytes on every signed entry -- more than most entries themselves (a commit verdict is "ok"). Every read
of a key returns every entry under it from every node asked, so those bytes were most of the control plane.

Identities made since are Ed25519 (:mod:`p2p_diloco.net.keys`): the marker ``[ed25519:<public key,
base64>]`` is 54 bytes and the signature ``[ed25519-sig:<base64>]`` 102. The libp2p peer id of an Ed25519
key is the key itself (an identity multihash), so a marker names its owner's peer id with no lookup, as an
RSA marker does. Every node runs both validators, so peers with RSA identities made before keep working in
the same swarm.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from p2p_diloco.net.records import ED25519_OWNER_PATTERN, OWNER_MARKER_RE

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey

ED25519_KEY_BYTES = 32
ED25519_OWNER_RE = re.compile(ED25519_OWNER_PATTERN)
"""An Ed25519 owner marker anywhere in a key or subkey (what the validator protects)."""
ED25519_SIGNATURE_RE = re.compile(rb"\[ed25519-sig:([A-Za-z0-9+/]{86}==)\]")


class Ed25519Key:
    """An Ed25519 private key that signs our DHT entries (picklable, like hivemind's ``RSAPrivateKey``)."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != ED25519_KEY_BYTES:
            raise ValueError(f"an Ed25519 private key is {ED25519_KEY_BYTES} bytes, got {len(seed)}")
        self._seed = bytes(seed)
        self._key = Ed25519PrivateKey.from_private_bytes(self._seed)

    @classmethod
    def generate(cls) -> "Ed25519Key":
        return cls(Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()))

    @property
    def seed(self) -> bytes:
        return self._seed

    def public_bytes(self) -> bytes:
        return self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def owner_marker(self) -> bytes:
        return b"[ed25519:" + base64.b64encode(self.public_bytes()) + b"]"

    def __getstate__(self) -> dict[str, bytes]:
        return {"seed": self._seed}

    def __setstate__(self, state: dict[str, bytes]) -> None:
        self.__init__(state["seed"])  # type: ignore[misc]


SigningKey = Any
"""An :class:`Ed25519Key` or hivemind's ``RSAPrivateKey`` (identities made before Ed25519)."""


def owner_subkey(key: SigningKey) -> bytes:
    """The subkey under which ``key``'s owner publishes: its owner marker."""
    if isinstance(key, Ed25519Key):
        return key.owner_marker()
    from hivemind.dht.crypto import RSASignatureValidator

    return RSASignatureValidator(key).local_public_key


def owner_public_key(subkey: bytes) -> tuple[str, bytes] | None:
    """``("ed25519", raw public key)`` or ``("rsa", OpenSSH public key)`` of a subkey that is exactly an owner
    marker; None for anything else."""
    m = OWNER_MARKER_RE.match(subkey) if isinstance(subkey, bytes) else None
    if m is None:
        return None
    return ("rsa", m.group(1)) if m.group(1) is not None else ("ed25519", base64.b64decode(m.group(2)))


class Ed25519SignatureValidator(RecordValidatorBase):
    """hivemind record validator for entries whose key or subkey holds an Ed25519 owner marker: their value
    must carry exactly one signature by that key over the record (key, subkey, value without the signature,
    expiration), as hivemind's ``RSASignatureValidator`` does for RSA markers. With ``key`` it also signs our
    own entries; without, it only validates (a node whose identity is RSA)."""

    def __init__(self, key: Ed25519Key | None = None) -> None:
        self._key = key
        self._marker = key.owner_marker() if key is not None else None

    def validate(self, record: DHTRecord) -> bool:
        owners = ED25519_OWNER_RE.findall(record.key)
        if record.subkey is not None:
            owners += ED25519_OWNER_RE.findall(record.subkey)
        if not owners:
            return True  # not ours to protect
        signatures = ED25519_SIGNATURE_RE.findall(record.value)
        if len(set(owners)) != 1 or len(signatures) != 1:
            return False
        try:
            public = Ed25519PublicKey.from_public_bytes(base64.b64decode(owners[0], validate=True))
            signature = base64.b64decode(signatures[0], validate=True)
            public.verify(signature, _serialize(dataclasses.replace(record, value=self.strip_value(record))))
        except (InvalidSignature, ValueError, binascii.Error):
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._key is None or self._marker is None:
            return record.value
        if self._marker not in record.key and (record.subkey is None or self._marker not in record.subkey):
            return record.value
        signature = base64.b64encode(self._key.sign(_serialize(record)))
        return record.value + b"[ed25519-sig:" + signature + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        return ED25519_SIGNATURE_RE.sub(b"", record.value)

    @property
    def priority(self) -> int:
        return 10  # before any validator that deserializes the value, as hivemind's RSA one

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, Ed25519SignatureValidator)  # one per node: the first one added signs


def _serialize(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps(dataclasses.astuple(record))


def signature_validators(key: SigningKey, rsa_key: "RSAPrivateKey | None" = None) -> list[RecordValidatorBase]:
    """Both signature validators of a node whose entries ``key`` signs: every node checks owned entries of
    either kind. ``rsa_key`` is the RSA validator's key for an Ed25519 identity (it signs nothing; None: the
    process-wide one hivemind makes)."""
    from hivemind.dht.crypto import RSASignatureValidator

    if isinstance(key, Ed25519Key):
        return [RSASignatureValidator(rsa_key), Ed25519SignatureValidator(key)]
    return [RSASignatureValidator(key), Ed25519SignatureValidator(None)]
