"""How an engine reaches the other learners: the seam (:mod:`~p2p_diloco.transport.network`) and its
implementations -- hivemind over the network (:class:`p2p_diloco.learner.network.HivemindNetwork`, the default) and
in-process (:mod:`~p2p_diloco.transport.inprocess`: N engines in one process, for the simulator and protocol tests).
"""
