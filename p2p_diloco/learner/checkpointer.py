"""Periodic and final checkpoints of a running learner."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from p2p_diloco.learner.checkpoint import save_checkpoint

if TYPE_CHECKING:
    from p2p_diloco.learner.loop import Learner

logger = logging.getLogger(__name__)


class Checkpointer:
    """Periodic checkpoints written by a background thread (the inner loop only pays for the copies),
    and a final one, written in the foreground, when the learner leaves."""

    def __init__(self, learner: Learner) -> None:
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
            self.learner._event({"event": "checkpoint", "outcome": "failed", "reason": f"{type(e).__name__}: {e}"[:300]})
            return
        self.saved_step = int(meta["inner_step"])
        logger.info("checkpoint saved: %s (step %d, model %s, %.2f s)%s", path, meta["inner_step"], meta["model_digest"],
                    time.monotonic() - t0, " (final)" if final else "")
        self.learner._event({"event": "checkpoint", "outcome": "saved", "path": str(path), "final": final,
                             "model_digest": meta["model_digest"], "anchor_hashes": meta["anchor_hashes"]})
