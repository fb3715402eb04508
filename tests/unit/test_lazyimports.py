"""Deferred imports (p2p_diloco/lazyimports.py): hivemind imports ``scipy.optimize`` at start-up for a call
our averagers never make; with the stand-in in place it is not loaded by importing what a learner
imports, is loaded on first use, and gives the same answers. Each check runs in a fresh interpreter
(this one has long imported everything)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120.0

CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from p2p_diloco.hivemind_ext.lazyimports import DeferredModule, defer_unused_imports
deferred = defer_unused_imports() if {defer!r} else []
again = defer_unused_imports() if {defer!r} else []
import p2p_diloco.learner.loop, p2p_diloco.cli.members, p2p_diloco.hivemind_ext.compression  # everything a learner imports
loaded_at_import = "scipy.optimize._optimize" in sys.modules
from hivemind.averaging.load_balancing import load_balance_peers
even = load_balance_peers(1000, [None] * 3)  # what our averagers ask: no bandwidths, no linprog
loaded_after_even = "scipy.optimize._optimize" in sys.modules
stated = load_balance_peers(1000, [1.0, 2.0, None])  # a peer stating a bandwidth: linprog
import scipy
print(json.dumps(dict(deferred=deferred, again=again, loaded_at_import=loaded_at_import,
                      loaded_after_even=loaded_after_even, even=even, stated=stated,
                      real_now=not isinstance(sys.modules["scipy.optimize"], DeferredModule),
                      parent_has_real=scipy.optimize is sys.modules["scipy.optimize"])))
"""


def _child(defer: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), defer=defer)], capture_output=True,
                         text=True, timeout=CHILD_TIMEOUT_S, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_scipy_optimize_loads_only_when_used_and_answers_the_same() -> None:
    lazy, eager = _child(defer=True), _child(defer=False)
    assert lazy["deferred"] == ["scipy.optimize"] and lazy["again"] == []
    assert eager["loaded_at_import"]  # the check can fail: without the stand-in hivemind loads it
    assert not lazy["loaded_at_import"] and not lazy["loaded_after_even"]
    assert lazy["real_now"] and lazy["parent_has_real"]  # loaded by the call that needed it
    assert lazy["even"] == eager["even"] == [334, 333, 333]
    assert lazy["stated"] == eager["stated"] and sum(lazy["stated"]) == 1000


def test_the_cli_defers_before_any_command_runs() -> None:
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from p2p_diloco.cli import main as cli; "
            "cli.main(['config', '--config', 'configs/demo.toml']); "
            "from p2p_diloco.hivemind_ext.lazyimports import DeferredModule; "
            "print('DEFERRED' if isinstance(sys.modules.get('scipy.optimize'), DeferredModule) else 'NOT')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=CHILD_TIMEOUT_S, check=True).stdout
    assert out.strip().splitlines()[-1] == "DEFERRED"
