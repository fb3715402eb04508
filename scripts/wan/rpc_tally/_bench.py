"""``scripts/_bench.py`` for ``summarize.py``: running it puts this folder, not ``scripts/``, on ``sys.path``, so
``import _bench`` finds this file, which loads the real module in its own place (as ``scripts/wan/_bench.py`` does)."""

import importlib.util
import sys
from pathlib import Path

_real = importlib.util.spec_from_file_location(__name__, Path(__file__).resolve().parents[2] / "_bench.py")
assert _real is not None and _real.loader is not None
sys.modules[__name__] = importlib.util.module_from_spec(_real)
_real.loader.exec_module(sys.modules[__name__])
