"""Without a network: the in-process simulator of the same algorithm (:mod:`~p2p_diloco.sim.simulator`),
data-parallel reference curves, the goodput simulation at scale and its calibration, loss-curve reading."""
