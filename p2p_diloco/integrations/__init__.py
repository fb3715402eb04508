"""Integrations of the engine (:class:`~p2p_diloco.learner.engine.DiLoCo`) with other training loops:
:mod:`p2p_diloco.integrations.hf`, a callback for Hugging Face's ``Trainer``."""
