"""Hugging Face ``Trainer`` on a p2p-diloco swarm: :class:`DiLoCoCallback`.

``Trainer(model=build_model(cfg), ..., callbacks=[DiLoCoCallback(swarm)])``: at the start of training the
callback wraps the Trainer's model and optimizer in a :class:`~p2p_diloco.engine.engine.DiLoCo`; after every
optimizer step it calls ``diloco.step``; at the end of training it runs the final rounds and the linger and
closes the engine (the swarm stays the caller's to close). Needs ``accelerate`` (``pip install
p2p-diloco[hf]``), as the Trainer does: without it, importing this module fails (a script imports it before it
joins a swarm; the Trainer would only fail after).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.utils import is_accelerate_available
from transformers.utils.import_utils import ACCELERATE_MIN_VERSION

from p2p_diloco.engine.engine import DiLoCo
from p2p_diloco.engine.options import SyncOptions

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from p2p_diloco.engine.swarm import Swarm


def check_trainer_ready() -> None:
    """Raise ``ImportError`` (one line) if transformers' ``Trainer`` cannot run here: it needs ``accelerate`` (its
    own check, with its own minimum version), and says so only when its ``TrainingArguments`` are built."""
    if not is_accelerate_available():
        raise ImportError(f"p2p_diloco.integrations.hf: transformers' Trainer needs accelerate>={ACCELERATE_MIN_VERSION}"
                          ", which is not installed: pip install 'p2p-diloco[hf]'")


check_trainer_ready()  # at import: a script imports us before it joins a swarm


class DiLoCoCallback(TrainerCallback):
    """Syncs a ``Trainer``'s model through ``swarm``. ``tokens_per_step``: tokens of one optimizer step on this
    unit (default: batch size x gradient accumulation x the run's ``model.block_size``), what its progress is
    weighted by."""

    def __init__(self, swarm: Swarm, options: SyncOptions | None = None, tokens_per_step: int | None = None) -> None:
        self.swarm, self.options, self.tokens_per_step = swarm, options, tokens_per_step
        self.diloco: DiLoCo | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        if model is None or optimizer is None:
            raise ValueError("DiLoCoCallback: the Trainer gave no model or optimizer at on_train_begin")
        if self.tokens_per_step is None:
            self.tokens_per_step = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                                    * self.swarm.config.model.block_size)
        self.diloco = DiLoCo(model, optimizer, self.swarm, self.options)
        self.diloco.start()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        assert self.diloco is not None and self.tokens_per_step is not None
        loss = state.log_history[-1].get("loss") if state.log_history else None
        self.diloco.step(tokens=self.tokens_per_step, loss=loss)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.diloco is None:
            return
        self.diloco.finish()
        self.close()

    def close(self) -> None:
        """Close the engine if training ended without ``on_train_end`` (an error): call it in a ``finally``."""
        if self.diloco is not None:
            self.diloco.close()
