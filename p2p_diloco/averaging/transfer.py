"""State transfer: what a donor sends a peer catching up, and how it is checked."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import msgpack
import torch

from p2p_diloco.averaging.decisions import (
    ANCHOR_RE,
    MAX_STATE_METADATA_BYTES,
    MAX_WIRE_INT,
    STATE_METADATA_KEYS,
    anchor_hash,
    is_ahead,
)
from p2p_diloco.core.rejects import PeerDataError, Reason

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class FetchedState:
    version: int
    anchor: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    anchor_hash: str


def state_payload(fragment: int, version: int, anchor: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor],
                  names: Sequence[str]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """What a donor sends: metadata and the anchor then the momentum tensors, in ``names`` order."""
    zeros = {n: torch.zeros_like(anchor[n]) for n in names if n not in momentum}
    tensors = [anchor[n].detach().clone() for n in names] + [(momentum[n] if n in momentum else zeros[n]).detach().clone()
                                                             for n in names]
    meta = {"fragment": fragment, "version": version, "anchor": anchor_hash({n: anchor[n] for n in names}),
            "momentum": bool(momentum)}
    return meta, tensors


def parse_state(metadata: Any, tensors: Sequence[torch.Tensor], fragment: int, names: Sequence[str],
                shapes: Mapping[str, torch.Size], ours: tuple[int, str]) -> FetchedState | None:
    """Validate a downloaded state (everything from a peer is checked: metadata keys and types, the
    version, tensor count, shapes, dtypes, finite values, the anchor hash); None if it is not ahead of
    ``ours`` = (version, anchor hash) in :func:`anchor_order`. Raises
    :class:`~p2p_diloco.core.rejects.PeerDataError`."""
    def refuse(reason: Reason, message: str) -> PeerDataError:
        return PeerDataError(reason, f"state download: {message}"[:300])

    if (not isinstance(metadata, Mapping) or set(metadata) != STATE_METADATA_KEYS
            or type(metadata["fragment"]) is not int or metadata["fragment"] != fragment):
        raise refuse(Reason.MALFORMED, f"metadata is not for fragment {fragment}: {metadata!r:.160}")
    version = metadata["version"]
    if type(version) is not int or not 0 <= version <= MAX_WIRE_INT:
        raise refuse(Reason.BAD_VERSION, f"bad version {version!r:.40}")
    if not isinstance(metadata["anchor"], str) or not ANCHOR_RE.match(metadata["anchor"]):
        raise refuse(Reason.MALFORMED, f"bad anchor hash {metadata['anchor']!r:.40}")
    if not isinstance(metadata["momentum"], bool):
        raise refuse(Reason.MALFORMED, f"bad momentum flag {metadata['momentum']!r:.40}")
    if version < ours[0]:
        return None
    if len(tensors) != 2 * len(names):
        raise refuse(Reason.OVERSIZE if len(tensors) > 2 * len(names) else Reason.MALFORMED,
                     f"{len(tensors)} tensors, expected {2 * len(names)}")
    anchor: dict[str, torch.Tensor] = {}
    momentum: dict[str, torch.Tensor] = {}
    for i, n in enumerate(names):
        for t, sink in ((tensors[i], anchor), (tensors[len(names) + i], momentum)):
            if not isinstance(t, torch.Tensor):
                raise refuse(Reason.MALFORMED, f"tensor {n} is a {type(t).__name__}")
            if tuple(t.shape) != tuple(shapes[n]):
                raise refuse(Reason.BAD_SHAPE, f"tensor {n} is {tuple(t.shape)}/{t.dtype} or not finite")
            if t.dtype != torch.float32:
                raise refuse(Reason.BAD_DTYPE, f"tensor {n} is {tuple(t.shape)}/{t.dtype} or not finite")
            if not bool(torch.isfinite(t).all()):
                raise refuse(Reason.NON_FINITE, f"tensor {n} is {tuple(t.shape)}/{t.dtype} or not finite")
            sink[n] = t.clone()
    digest = anchor_hash(anchor)
    if digest != metadata["anchor"]:
        raise refuse(Reason.BAD_HASH, f"anchor hash {digest} does not match the donor's {metadata['anchor']!r}")
    if not is_ahead((version, digest), ours):
        return None
    return FetchedState(version, anchor, momentum if metadata["momentum"] else {}, digest)


def decode_state_metadata(blob: bytes) -> Any:
    """The msgpack metadata of a state download, decoded strictly: at most ``MAX_STATE_METADATA_BYTES``,
    plain msgpack (no extension types: hivemind's serializer would run its extension hooks on a peer's
    bytes). What it holds is checked by :func:`parse_state`."""
    if len(blob) > MAX_STATE_METADATA_BYTES:
        raise PeerDataError(Reason.OVERSIZE, f"state download: metadata of {len(blob)} bytes, "
                                             f"at most {MAX_STATE_METADATA_BYTES}")

    def no_ext(code: int, _data: bytes) -> Any:
        raise ValueError(f"msgpack extension type {code}")

    try:
        return msgpack.unpackb(blob, raw=False, strict_map_key=True, ext_hook=no_ext)
    except Exception as e:  # msgpack's errors are several classes; all mean the same here
        raise PeerDataError(Reason.MALFORMED,
                            f"state download: undecodable metadata: {type(e).__name__}: {e}"[:200]) from None
