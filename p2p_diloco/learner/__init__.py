"""``p2p-diloco join``'s process: the loop (:mod:`~p2p_diloco.learner.loop`), a client of the engine
(:mod:`p2p_diloco.engine`) like any user's, with its checkpoints (:mod:`~p2p_diloco.learner.checkpoint`), final
summary (:mod:`~p2p_diloco.learner.summary`) and CPU priority (:mod:`~p2p_diloco.learner.priority`)."""
