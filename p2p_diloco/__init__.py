"""p2p-diloco: peer-to-peer Decoupled DiLoCo (learners that never wait, fragments averaged among live peers).

The library (``docs/api.md``)::

    from p2p_diloco import DiLoCo, Swarm, build_model, load_config

    cfg = load_config("llama-tiny")
    with Swarm.join(["/ip4/10.0.0.5/tcp/31337/p2p/12D3Koo..."], cfg) as swarm:
        model = build_model(cfg)                  # the run's seeded start, the same on every peer
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
        with DiLoCo(model, opt, swarm) as diloco:  # leaving the block: final rounds, then the linger
            for x, y in batches:
                ...                               # forward, backward, opt.step(): the loop's own
                diloco.step(tokens=x.numel())     # hands due fragments off, applies rounds; never waits

Names load on first use: ``import p2p_diloco`` (and ``p2p-diloco --help``) imports neither torch nor hivemind.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from p2p_diloco.core.version import VERSION as __version__

_EXPORTS = {
    "Swarm": "p2p_diloco.engine.swarm",
    "DiLoCo": "p2p_diloco.engine.engine",
    "SyncOptions": "p2p_diloco.engine.options",
    "build_model": "p2p_diloco.engine.engine",
    "training_batches": "p2p_diloco.engine.engine",
    "Config": "p2p_diloco.core.config",
    "load_config": "p2p_diloco.core.config",
    "events": "p2p_diloco.core.events",
}
"""Public name -> the module that defines it (``events``: the module of the typed events itself)."""

__all__ = ["__version__", "Swarm", "DiLoCo", "SyncOptions", "build_model", "training_batches", "Config",
           "load_config", "events"]

if TYPE_CHECKING:
    from p2p_diloco.core import events
    from p2p_diloco.core.config import Config, load_config
    from p2p_diloco.engine.engine import DiLoCo, build_model, training_batches
    from p2p_diloco.engine.options import SyncOptions
    from p2p_diloco.engine.swarm import Swarm


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'p2p_diloco' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if name == "events" else getattr(loaded, name)
    globals()[name] = value
    return value
