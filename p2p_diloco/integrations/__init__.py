"""Integrations of the engine (:class:`~p2p_diloco.engine.engine.DiLoCo`) with other training loops:
:mod:`p2p_diloco.integrations.hf`, a callback for Hugging Face's ``Trainer``."""
