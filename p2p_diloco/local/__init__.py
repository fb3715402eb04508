"""A whole swarm on this machine: launching child processes that always stop (:mod:`~p2p_diloco.local.launcher`),
the chaos that disrupts them (:mod:`~p2p_diloco.local.chaos`, shared with ``scripts/chaos.py``), and the ``swarm``
command's run, live view and report (:mod:`~p2p_diloco.local.run`)."""
