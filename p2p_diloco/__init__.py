"""p2p-diloco: peer-to-peer Decoupled DiLoCo (learners that never wait, fragments averaged among live peers)."""

__version__ = "0.1.0"
