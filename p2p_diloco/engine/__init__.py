"""The library engine: :class:`~p2p_diloco.engine.engine.DiLoCo` (around any training loop) on a joined
:class:`~p2p_diloco.engine.swarm.Swarm` -- the public API -- with its options (:mod:`~p2p_diloco.engine.options`),
the rounds (:mod:`~p2p_diloco.engine.rounds`), the swarm view (:mod:`~p2p_diloco.engine.view`), the hivemind
network it runs on by default (:mod:`~p2p_diloco.engine.network`), the event log and metric sinks
(:mod:`~p2p_diloco.engine.metrics`), the checks of what the loop hands it (:mod:`~p2p_diloco.engine.checks`) and
its fault wrappers (:mod:`~p2p_diloco.engine.faulty`). It never imports :mod:`p2p_diloco.learner`, the
``join`` command's process, which is one client of it like any user's loop."""
