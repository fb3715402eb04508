"""Defer the imports that hivemind makes at start-up and that our use of it never needs.

``hivemind.averaging.load_balancing`` imports ``scipy.optimize`` at module level for one call,
``linprog``, made only when the peers of a group state their bandwidths. Ours never do (every
averager's ``bandwidth`` is None, so hivemind splits the vector evenly), yet the import is 0.45 s of
the 2.7 s that importing a learner takes on an idle 2-core machine, and about 0.7 s beside a
training swarm: start-up time that a newcomer spends before its first contribution, and that every
``p2p-diloco`` command that touches the network pays.

:func:`defer_unused_imports` puts a stand-in module in its place before hivemind is imported:
``import scipy.optimize`` then costs nothing, and the first attribute read from the stand-in imports
the real module (and puts it in ``sys.modules``), should a peer ever state a bandwidth. (The standard
library's ``importlib.util.LazyLoader`` does not do here: on Python 3.11 the import statement itself
reads the module's ``__spec__``, which loads it.)

Only the standard library is imported here.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DEFERRED = ("scipy.optimize",)
"""Modules imported at start-up by our dependencies and not used by p2p-diloco itself."""


class DeferredModule(types.ModuleType):
    """Stands in for a module until one of its attributes is read; then imports it and reads from it."""

    def __getattr__(self, attr: str) -> Any:  # only called for attributes the stand-in does not have
        if attr.startswith("__"):  # the import machinery and introspection probing: not a use
            raise AttributeError(attr)
        real = load_deferred(self.__name__)
        return getattr(real, attr)


logger = logging.getLogger(__name__)

def load_deferred(name: str) -> types.ModuleType:
    """The real module ``name``, imported now if a stand-in is in its place."""
    if isinstance(sys.modules.get(name), DeferredModule):
        del sys.modules[name]  # so that the import below loads it; it also sets it on the parent package
    return importlib.import_module(name)


def defer_unused_imports(names: Iterable[str] = DEFERRED) -> list[str]:
    """Put a :class:`DeferredModule` in the place of each module of ``names`` that is installed and not
    imported yet (its parent package is imported for real: ``scipy``'s own ``__init__`` takes 10 ms).
    Returns the names deferred. Call it before the first ``import hivemind``; calling it again changes
    nothing."""
    deferred = []
    for name in names:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:  # its parent package is not installed
            continue
        if spec is None:
            continue
        stand_in = DeferredModule(name, f"stands in for {name} until it is used (p2p_diloco.hivemind_ext.lazyimports)")
        sys.modules[name] = stand_in
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, stand_in)
        deferred.append(name)
    return deferred


def light_hivemind_import() -> None:
    """Make ``import hivemind.dht`` skip ``hivemind/__init__`` in this CLI process.

    hivemind's package ``__init__`` imports the averager, MoE and optimizer stacks (scipy among
    them): ~0.6 s of a ~3 s import, on every ``status``. We register the package with its real
    ``__path__`` but without running ``__init__``; the first attribute looked up on the package
    itself (``from hivemind import X``) runs the real ``__init__`` then, so nothing breaks later.
    torch is still imported (``hivemind.utils.mpfuture`` needs it): that is the other ~2 s.
    """
    if "hivemind" in sys.modules:
        return
    import importlib.util
    import types

    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return  # not installed as a plain package: import it the normal way
    origin: str = spec.origin
    module = types.ModuleType("hivemind")
    module.__spec__, module.__file__ = spec, origin
    module.__path__ = list(spec.submodule_search_locations)
    loaded: list[bool] = []

    def __getattr__(name: str) -> Any:
        submodule = sys.modules.get(f"hivemind.{name}")
        if submodule is not None:  # `import hivemind.a.b as x` looks up hivemind.a while it is still loading
            return submodule
        if loaded or name.startswith("__"):
            raise AttributeError(f"module 'hivemind' has no attribute {name!r}")
        loaded.append(True)
        logger.debug("hivemind.%s requested: running hivemind/__init__ now", name)
        exec(compile(Path(origin).read_text(), origin, "exec"), module.__dict__)
        return getattr(module, name)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules["hivemind"] = module
