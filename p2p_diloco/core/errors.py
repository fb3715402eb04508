"""Errors shared across ``core``, in a module that imports nothing of ours (the config imports the modules that
raise them, e.g. :mod:`p2p_diloco.core.hfmodel`)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, always reported as one line naming the offending key."""
