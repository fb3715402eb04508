"""A benchmark's RPC byte tally: children that count every hivemind RPC they make, and what those counts say.

``scripts/wan/rpc_tally`` is the measuring tool (``sitecustomize.py`` tallies each process's RPCs into
``$RPC_TALLY_OUT/<pid>.json`` every few seconds; ``summarize.py`` adds them up by purpose). This module starts a
``p2p-diloco`` child with it, reads a whole run's tallies at a moment (:func:`snapshot`), and turns the difference of
two snapshots into bytes by purpose. ``scripts/bench_control.py`` counts its control plane with it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import _bench

from p2p_diloco.local.launcher import Child, LocalSwarm

TALLY_DIR = _bench.ROOT / "scripts" / "wan" / "rpc_tally"
"""The byte tally (``sitecustomize.py``) and its summary by purpose (``summarize.py``)."""
VOUCHES = "anchor vouches (and the sync clock read with them)"
"""A purpose of our own beside ``summarize.PURPOSES``: every RPC naming a ``<prefix>_anchor_vN`` key (``summarize``
counts them under matchmaking, as their keys hold ``_frag``). The learner reads the vouches and the sync clock in one
``get_many``, whose RPCs are labelled with all its keys: those reads count here, not under the sync clock."""
PAYLOAD = "pseudo-gradients and state downloads"
"""The one purpose that is not control plane: the tensors themselves."""


def load_summarize() -> ModuleType:
    """``scripts/wan/rpc_tally/summarize.py``, loaded by file (its folder is no package)."""
    spec = importlib.util.spec_from_file_location("rpc_tally_summarize", TALLY_DIR / "summarize.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{TALLY_DIR / 'summarize.py'}: cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summarize = load_summarize()
Counts = dict[str, list[int]]
"""``{rpc name: [calls, bytes sent, bytes received]}``, as ``summarize.summarize`` returns."""


def start_tallied(swarm: LocalSwarm, name: str, args: list[str], tally: Path) -> Child:
    """A ``p2p-diloco`` child whose processes tally their RPCs into ``tally/<name>``; stopped with the swarm."""
    path = os.pathsep.join(p for p in (str(TALLY_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(swarm.env, PYTHONPATH=path, RPC_TALLY_OUT=str(tally / name))
    child = Child(name, args, swarm.logs / f"{name}.log", env)
    swarm.children.append(child)
    return child


def snapshot(root: Path) -> dict[str, Counts]:
    """Every process folder's tallies so far (``root/<process>/<pid>.json``), summed per folder; a folder with none
    written yet (its processes made no RPC, or have not dumped yet) maps to nothing."""
    return {folder.name: summarize.summarize(folder) if any(folder.glob("*.json")) else {}
            for folder in sorted(root.iterdir()) if folder.is_dir()}


def difference(end: Counts, start: Counts) -> Counts:
    """What was tallied between two snapshots of one folder."""
    out = {}
    for name, counts in end.items():
        before = start.get(name, [0, 0, 0])
        out[name] = [a - b for a, b in zip(counts, before)]
    return out


def add(totals: list[Counts]) -> Counts:
    """The tallies of several folders summed."""
    out: Counts = {}
    for total in totals:
        for name, counts in total.items():
            out[name] = [a + b for a, b in zip(out.get(name, [0, 0, 0]), counts)]
    return out


def by_purpose(total: Counts) -> dict[str, dict[str, int]]:
    """Calls and bytes per purpose: ``summarize.by_purpose`` with the anchor vouches split out of matchmaking."""
    vouches = {n: c for n, c in total.items() if "_anchor_v" in n}
    out = summarize.by_purpose({n: c for n, c in total.items() if n not in vouches})
    out[VOUCHES] = {"calls": sum(c[0] for c in vouches.values()), "bytes": sum(c[1] + c[2] for c in vouches.values())}
    return out


def control_bytes(total: Counts) -> int:
    """Every byte of ``total`` but the payload's: the control plane."""
    return sum(p["bytes"] for purpose, p in by_purpose(total).items() if purpose != PAYLOAD)
