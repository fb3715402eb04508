"""Loads a script of ``scripts/`` as a module for its tests, the way ``python scripts/...`` runs it.

Running a script puts its own folder first on ``sys.path``, which is how it imports ``_bench`` and its siblings
(``scripts/wan/bench_wan.py``: ``netns``, ``dp_gloo``); a test loading it by file does the same.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(path: str, name: str) -> ModuleType:
    """``scripts/<path>`` as module ``name`` (registered in ``sys.modules``: dataclasses look their module up by
    name)."""
    file = SCRIPTS / path
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
