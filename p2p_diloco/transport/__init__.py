"""How an engine reaches the other learners: the seam (:mod:`~p2p_diloco.transport.network`) and its
implementations -- hivemind over the network (its hosts: :mod:`~p2p_diloco.transport.hivemind`; with the learner's
status thread: :class:`p2p_diloco.engine.network.HivemindNetwork`, the default) and in-process
(:mod:`~p2p_diloco.transport.inprocess`: N engines in one process, for the simulator and protocol tests) -- and how
both plan a round (:mod:`~p2p_diloco.transport.planning`). None of them imports the engine.
"""
