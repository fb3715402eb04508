"""Membership, through the DHT: addresses, key files and swarm secrets, the DHT authorizer, signed peer records
and the decisions taken from them, the sync clock, the run's config in the DHT, joining a run, ``status`` reports
and ``doctor`` probes. No averaging here: that is :mod:`p2p_diloco.averaging`, which builds on it."""
