"""``scripts/_bench.py`` for the scripts in this folder and below.

``python scripts/wan/x.py`` puts ``scripts/wan``, not ``scripts``, on ``sys.path``, so ``import _bench`` finds this
file; it loads the file one folder up under the same name and puts it in its own place in ``sys.modules``, so the
importer gets that module (the documented way for a module to replace itself), without touching ``sys.path``.
"""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(__name__, Path(__file__).resolve().parents[1] / "_bench.py")
assert _spec is not None and _spec.loader is not None
sys.modules[__name__] = _module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
