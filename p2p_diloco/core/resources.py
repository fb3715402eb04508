"""The files that ship with the package: run configs, peer profiles and data-parallel reference curves.

The repository keeps them in its top-level ``configs/`` (with ``configs/reference/``) and ``peers/``;
``pyproject.toml`` maps those folders into the package (``p2p_diloco.configs``, ``p2p_diloco.peers``), so a
wheel installs them as ``p2p_diloco/configs`` and ``p2p_diloco/peers``. :func:`bundled_dir` finds them either
way: inside the installed package, or beside it in a checkout (which is also where an editable install
imports the package from).

:func:`find` is how the CLI reads ``--config`` and ``--profile``: a path that exists is taken as it is;
otherwise its file name is looked up among the bundled files, so ``--config configs/tiny.toml`` and
``--config tiny`` work from any directory.

Only the standard library is imported (``p2p-diloco --help`` stays fast).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

CONFIGS = "configs"
"""Run configs (``*.toml``), and the committed reference curves in its ``reference/`` folder."""
PEERS = "peers"
"""Peer profiles (``*.toml``)."""
REFERENCE = "reference"
"""The folder of data-parallel reference curves inside :data:`CONFIGS` (:mod:`p2p_diloco.sim.reference`)."""
KINDS = {CONFIGS: "config", PEERS: "peer profile"}
SUFFIX = ".toml"


def bundled_dir(kind: str) -> Path:
    """The folder of the bundled ``kind`` files (:data:`CONFIGS` or :data:`PEERS`): in the installed package
    (a wheel: package data), else the repository's top-level folder beside the package (a checkout, or an
    editable install of one). ``FileNotFoundError`` if neither is there (a broken install)."""
    if kind not in KINDS:
        raise ValueError(f"no bundled files of kind {kind!r} (known: {', '.join(KINDS)})")
    package = Path(str(importlib.resources.files("p2p_diloco")))
    for folder in (package / kind, package.parent / kind):
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"the bundled {kind}/ folder is missing: neither {package / kind} nor "
                            f"{package.parent / kind} exists (reinstall p2p-diloco)")


def bundled_names(kind: str) -> list[str]:
    """The bundled ``kind`` files by name, without ``.toml`` (``["bench", "demo", ...]``)."""
    return sorted(p.stem for p in bundled_dir(kind).glob(f"*{SUFFIX}"))


def bundled(kind: str, name: str) -> Path:
    """The bundled ``kind`` file ``name`` (``tiny`` or ``tiny.toml``); ``FileNotFoundError`` (one line, with
    the bundled names) if there is none."""
    file = name if name.endswith(SUFFIX) else name + SUFFIX
    path = bundled_dir(kind) / file
    if not path.is_file():
        raise FileNotFoundError(f"{name}: no such file, and no bundled {KINDS[kind]} of that name "
                                f"(bundled: {', '.join(bundled_names(kind))})")
    return path


def find(given: str | Path, kind: str) -> Path:
    """``given`` if that path exists (relative to the current directory), else the bundled ``kind`` file of
    its name (``configs/tiny.toml``, ``tiny.toml`` and ``tiny`` all name ``tiny.toml``); else
    ``FileNotFoundError`` with one line listing the bundled names."""
    path = Path(given).expanduser()
    if path.exists():
        return path
    try:
        return bundled(kind, path.name)
    except FileNotFoundError:
        raise FileNotFoundError(f"{given}: no such file, and no bundled {KINDS[kind]} {path.name!r} "
                                f"(bundled: {', '.join(bundled_names(kind))})") from None


def reference_dir() -> Path:
    """The folder of the data-parallel reference curves that ship with the configs (it may be empty)."""
    return bundled_dir(CONFIGS) / REFERENCE


def shown(path: Path) -> str:
    """``path`` as reports show it: ``configs/...`` or ``peers/...`` for a bundled file (the same on every
    machine), else as it is."""
    for kind in KINDS:
        folder = bundled_dir(kind)
        if path.is_relative_to(folder):
            return str(Path(kind) / path.relative_to(folder))
    return str(path)
