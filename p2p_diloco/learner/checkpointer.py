"""A running learner's checkpoints: what goes into one (:func:`checkpoint_state`), resuming from one
(:func:`restore`), and the periodic and final saves (:class:`Checkpointer`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from p2p_diloco.core import events, outer
from p2p_diloco.core.devices import load_into, state_to_device, state_to_host, to_host
from p2p_diloco.learner.checkpoint import portable_config, save_checkpoint, tensors_digest

if TYPE_CHECKING:
    from p2p_diloco.core.config import Config
    from p2p_diloco.core.inner import InnerOptimizer
    from p2p_diloco.learner.options import LearnerOptions
    from p2p_diloco.net.joined import Joined
    from p2p_diloco.net.records import LocalRun
    from p2p_diloco.sync.slot import FragmentSlot

logger = logging.getLogger(__name__)


class Owner(Protocol):
    """What a checkpoint holds of its learner, and what the checkpointer asks of it
    (:class:`~p2p_diloco.learner.loop.Learner` is one; a protocol, because the learner builds its checkpointer:
    it imports this module, not the other way round)."""

    cfg: Config
    opts: LearnerOptions
    joined: Joined
    local: LocalRun
    params: dict[str, torch.nn.Parameter]
    opt: InnerOptimizer
    device: torch.device
    @property
    def slots(self) -> list[FragmentSlot]: ...
    step: int
    tokens: int

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...
    def log_event(self, event: events.Event) -> None: ...


def checkpoint_state(learner: Owner) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Everything a resumed learner needs, as flat tensors (copies) and JSON metadata: the weights,
    AdamW's state, every fragment's anchor and outer momentum, versions, progress and step."""
    tensors: dict[str, torch.Tensor] = {}
    params, slots = learner.params, learner.slots
    with torch.no_grad():  # host copies: a checkpoint is the same file whatever device wrote it
        for n, theta in to_host(params).items():
            tensors[f"model/{n}"] = theta
            for k, v in state_to_host(learner.opt.state.get(params[n], {})).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"adam/{n}/{k}"] = v
        for slot in slots:
            with slot.lock:
                for n in slot.names:
                    tensors[f"anchor/{n}"] = slot.anchor[n].clone()
                    if n in slot.state.momentum:
                        tensors[f"momentum/{n}"] = slot.state.momentum[n].clone()
    opts = learner.opts
    meta = {
        "config_hash": learner.local.config_hash, "run_id": learner.local.run_id, "name": opts.name,
        "peer_id": learner.joined.peer_id, "shard": opts.shard, "num_shards": opts.num_shards,
        "inner_step": learner.step, "tokens": learner.tokens, "versions": [s.version for s in slots],
        "anchor_hashes": [s.anchor_hash for s in slots],
        "since_tokens": [s.since_tokens for s in slots], "since_steps": [s.since_steps for s in slots],
        "model_digest": model_digest(learner.params),
        "config": portable_config(learner.cfg),  # what `p2p-diloco export` rebuilds the model from
    }
    return tensors, meta


def model_digest(params: Mapping[str, torch.Tensor]) -> str:
    """:func:`~p2p_diloco.learner.checkpoint.tensors_digest` of the weights, as a checkpoint's manifest records it."""
    return tensors_digest({f"model/{n}": theta for n, theta in to_host(params).items()})


def restore(learner: Owner, ckpt: Any, hash_anchor: Callable[[Mapping[str, torch.Tensor]], str]) -> str:
    """Resume from a verified checkpoint (:func:`~p2p_diloco.learner.checkpoint.load_checkpoint`, already checked
    against our config hash): weights, AdamW state, anchors, momenta, versions, progress, step. The
    restored weights and anchors are hashed again and must match the manifest; returns the weights' digest.
    The caller advertises the anchors and restarts the data stream."""
    m, t = ckpt.manifest, ckpt.tensors
    params, slots = learner.params, learner.slots
    missing = [n for n in params if f"model/{n}" not in t or f"anchor/{n}" not in t]
    if missing or len(m.get("versions", ())) != len(slots):
        raise ValueError(f"checkpoint {ckpt.path}: not this model's (missing {missing[:3]}, "
                         f"{len(m.get('versions', ()))} fragments vs {len(slots)})")
    with torch.no_grad():
        load_into(params, {n: t[f"model/{n}"] for n in params})
        for n, p in params.items():
            adam = {k.rsplit("/", 1)[1]: v for k, v in t.items() if k.startswith(f"adam/{n}/")}
            if adam:
                learner.opt.state[p] = state_to_device(adam, learner.device)
        for slot in slots:
            with slot.lock:
                slot.anchor = {n: t[f"anchor/{n}"].clone() for n in slot.names}
                momentum = {n: t[f"momentum/{n}"].clone() for n in slot.names if f"momentum/{n}" in t}
                slot.state = outer.OuterState(momentum=momentum, version=int(m["versions"][slot.index]))
                slot.anchor_hash = hash_anchor(slot.anchor)
                slot.since_tokens = int(m["since_tokens"][slot.index])
                slot.since_steps = int(m["since_steps"][slot.index])
                slot.restored = True
    digest = model_digest(params)
    if digest != m["model_digest"]:
        raise ValueError(f"checkpoint {ckpt.path}: the restored weights hash to {digest}, its manifest says "
                         f"{m['model_digest']}")
    if [s.anchor_hash for s in slots] != list(m["anchor_hashes"]):
        raise ValueError(f"checkpoint {ckpt.path}: its anchors do not hash to its manifest's anchor_hashes")
    learner.step, learner.tokens = int(m["inner_step"]), int(m["tokens"])
    return digest


class Checkpointer:
    """Periodic checkpoints written by a background thread (the inner loop only pays for the copies),
    and a final one, written in the foreground, when the learner leaves."""

    def __init__(self, learner: Owner) -> None:
        assert learner.opts.checkpoint_dir is not None
        self.learner, self.root = learner, learner.opts.checkpoint_dir
        self.every_s = learner.opts.checkpoint_every_s
        self.last = time.monotonic()
        self.saved_step: int | None = None
        """The step of the last checkpoint this learner wrote."""
        self._thread: threading.Thread | None = None

    def maybe_save(self) -> None:
        """(inner loop) Start a background save when one is due and none is running."""
        if self.every_s <= 0 or time.monotonic() - self.last < self.every_s:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self.last = time.monotonic()
        tensors, meta = self.learner.checkpoint_state()
        self._thread = threading.Thread(target=self._write, args=(tensors, meta), name="checkpoint", daemon=True)
        self._thread.start()

    def save(self, final: bool = False) -> None:
        """(foreground) Wait for a background save, then write the current state."""
        if self._thread is not None:
            self._thread.join()
        tensors, meta = self.learner.checkpoint_state()
        if meta["inner_step"] == self.saved_step:
            return  # this step is on disk already
        self._write(tensors, meta, final=final)

    def _write(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], final: bool = False) -> None:
        t0 = time.monotonic()
        try:
            path = save_checkpoint(self.root, int(meta["inner_step"]), tensors, meta)
        except Exception as e:  # disk full, permissions: training goes on; the previous checkpoint is intact
            logger.error("checkpoint at step %d NOT saved (%s: %s); the previous one is intact", meta["inner_step"],
                         type(e).__name__, e)
            self.learner.log_event(events.CheckpointEvent(outcome="failed", reason=f"{type(e).__name__}: {e}"[:300]))
            return
        self.saved_step = int(meta["inner_step"])
        logger.info("checkpoint saved: %s (step %d, model %s, %.2f s)%s", path, meta["inner_step"], meta["model_digest"],
                    time.monotonic() - t0, " (final)" if final else "")
        self.learner.log_event(events.CheckpointEvent(outcome="saved", path=str(path), final=final,
                                                   model_digest=meta["model_digest"],
                                                   anchor_hashes=tuple(meta["anchor_hashes"])))
