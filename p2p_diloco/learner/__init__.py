"""A learner unit: the engine (:class:`~p2p_diloco.learner.engine.DiLoCo`, around any training loop) on a joined
:class:`~p2p_diloco.learner.swarm.Swarm` -- the public API -- with the rounds (:mod:`~p2p_diloco.learner.rounds`)
and the swarm view (:mod:`~p2p_diloco.learner.view`) behind it; and ``p2p-diloco join``'s loop
(:mod:`~p2p_diloco.learner.loop`), a client of the engine like any user's, with its options, checkpoints, metric
sinks and CPU priority."""
