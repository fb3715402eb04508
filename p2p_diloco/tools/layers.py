"""The package's layers: subpackages, their sizes, the imports between them, and the rules they keep.

``python -m p2p_diloco.tools.layers`` prints each subpackage with its modules' line counts and the
subpackages it imports, then every broken rule (exit 1 if any):

- a subpackage imports only the layers below it (:data:`ALLOWED`): ``core`` and ``sync`` nothing of
  the network, ``cli`` is imported by nothing;
- ``core`` and ``sync`` never import hivemind (torch only, no network);
- no module over :data:`MAX_MODULE_LINES` lines, no class over :data:`MAX_CLASS_LINES` lines;
- no import circle between modules, inside a subpackage too (:func:`circles`).

Imports are read from the source (every ``import`` statement, also inside functions and under
``TYPE_CHECKING``), so nothing is imported to check it.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

PACKAGE = "p2p_diloco"
ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, frozenset[str]] = {
    "": frozenset({"core", "engine"}),  # the package's __init__: the public API, re-exported
    "core": frozenset(),
    "sync": frozenset({"core"}),
    "hivemind_ext": frozenset({"core"}),
    "net": frozenset({"core", "hivemind_ext"}),
    "averaging": frozenset({"core", "sync", "net", "hivemind_ext"}),  # sync: the round's Contribution
    "transport": frozenset({"core", "sync", "net", "averaging", "hivemind_ext"}),
    "engine": frozenset({"core", "sync", "net", "averaging", "transport", "hivemind_ext"}),  # the library engine
    "learner": frozenset({"core", "sync", "net", "averaging", "transport", "engine", "hivemind_ext"}),  # join's process
    "sim": frozenset({"core", "sync", "net", "averaging", "transport", "engine", "hivemind_ext"}),
    "integrations": frozenset({"core", "engine"}),
    "local": frozenset({"core", "net", "engine", "learner", "sim", "hivemind_ext"}),
    "tools": frozenset({"core", "sync", "net", "averaging", "transport", "engine", "learner", "sim", "local",
                        "hivemind_ext"}),
    "cli": frozenset({"core", "sync", "net", "averaging", "transport", "engine", "learner", "sim", "local",
                      "hivemind_ext", "tools"}),
}
"""Which subpackages each subpackage may import (besides itself and the top-level ``p2p_diloco``)."""

NO_HIVEMIND = frozenset({"core", "sync"})
"""Subpackages that must not import hivemind: the maths run without a network stack."""

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


@dataclass
class Module:
    name: str  # dotted, e.g. "p2p_diloco.core.config"
    layer: str  # the subpackage ("" for the package's own __init__)
    path: Path
    lines: int
    imports: list[tuple[str, int]] = field(default_factory=list)  # (imported module, line)
    classes: list[tuple[str, int]] = field(default_factory=list)  # (class name, lines)


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            yield (source := ".".join(base + ([node.module] if node.module else [])))
            yield from (f"{source}.{a.name}" for a in node.names)  # "from . import loop"
        elif node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)  # "from p2p_diloco import cli"


def read_module(path: Path, root: Path = ROOT) -> Module:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    name = ".".join(parts)
    layer = parts[1] if len(parts) > 1 else ""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    mod = Module(name, layer, path.relative_to(root.parent), len(text.splitlines()))
    for node in ast.walk(tree):
        for target in _imported(node, name, is_package):
            mod.imports.append((target, getattr(node, "lineno", 0)))
        if isinstance(node, ast.ClassDef):
            mod.classes.append((node.name, (node.end_lineno or node.lineno) - node.lineno + 1))
    return mod


def read_package(root: Path = ROOT) -> list[Module]:
    return [read_module(p, root) for p in sorted(root.rglob("*.py"))]


def layer_of(imported: str, layers: Iterable[str]) -> str | None:
    """The subpackage an imported dotted name belongs to (None: not a subpackage of ours)."""
    parts = imported.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1] if parts[1] in set(layers) else None


def violations(modules: Sequence[Module], allowed: dict[str, frozenset[str]] = ALLOWED) -> list[str]:
    """Every broken rule, one line each (``path:line: what``)."""
    problems: list[str] = []
    for m in modules:
        if m.layer and m.layer not in allowed:
            problems.append(f"{m.path}: subpackage {m.layer!r} has no rule in p2p_diloco.tools.layers.ALLOWED")
            continue
        seen: set[tuple[int, str]] = set()  # one line per import statement and layer ("from p2p_diloco.net import x")
        for target, line in m.imports:
            if m.layer in NO_HIVEMIND and (target == "hivemind" or target.startswith("hivemind.")):
                problems.append(f"{m.path}:{line}: {m.layer}/ imports {target} (core and sync are torch only)")
            other = layer_of(target, allowed)
            if other is None or other == m.layer or (line, other) in seen:
                continue
            if other not in allowed.get(m.layer, frozenset()):
                seen.add((line, other))
                problems.append(f"{m.path}:{line}: {m.layer or PACKAGE}/ may not import {other}/ ({target})")
        if m.lines > MAX_MODULE_LINES:
            problems.append(f"{m.path}: {m.lines} lines (at most {MAX_MODULE_LINES})")
        for cls, n in m.classes:
            if n > MAX_CLASS_LINES:
                problems.append(f"{m.path}: class {cls} has {n} lines (at most {MAX_CLASS_LINES})")
    problems += ["circle: " + " -> ".join(walk) for walk in circles(import_graph(modules))]
    return sorted(set(problems))


def import_graph(modules: Sequence[Module]) -> dict[str, set[str]]:
    """Each module and the package's modules it imports (top level, in functions, under ``TYPE_CHECKING``).

    ``from p2p_diloco.x import name`` imports ``p2p_diloco.x`` and, where ``name`` is a submodule, that too.
    """
    names = {m.name for m in modules}
    graph: dict[str, set[str]] = {}
    for m in modules:
        graph[m.name] = {target for target, _ in m.imports if target in names}
        if m.path.name == "__init__.py":
            graph[m.name].discard(m.name)  # "from . import sub" in a package names the package itself
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: each strongly connected component of more than one module (or a module that
    imports itself), as a closed walk ``[a, b, ..., a]`` through all its modules, each step an import."""
    found: list[list[str]] = []
    for members in _components(graph):
        if len(members) == 1 and members[0] not in graph[members[0]]:
            continue
        inside, walk, todo = set(members), [members[0]], set(members[1:])
        while todo:
            path = _path(graph, walk[-1], todo, inside)
            walk += path[1:]
            todo -= set(path)
        found.append(walk + _path(graph, walk[-1], {members[0]}, inside)[1:])
    return sorted(found)


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's algorithm, without recursion), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []  # visited, component not yet known
    work: list[tuple[str, Iterator[str]]] = []  # the depth-first path: each node and its imports not yet followed
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        work.append((node, iter(sorted(graph[node]))))

    for root in sorted(graph):
        if root in index:
            continue
        visit(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    visit(target)
                    break
                if target in stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    at = stack.index(node)
                    out.append(sorted(stack[at:]))
                    del stack[at:]
    return out


def _path(graph: dict[str, set[str]], start: str, goals: set[str], inside: set[str]) -> list[str]:
    """A shortest import path of at least one step from ``start`` to one of ``goals``, within ``inside``."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node] & inside):
            if target in goals:
                path = [target, node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if target != start and target not in parent:
                parent[target] = node
                queue.append(target)
    raise ValueError(f"no path from {start} to {sorted(goals)}")  # not strongly connected: a bug above


class LayerSummary(TypedDict):
    lines: int
    modules: dict[str, int]
    imports: list[str]


def summary(modules: Sequence[Module]) -> dict[str, LayerSummary]:
    """Per subpackage: line count, modules with their line counts, subpackages imported."""
    out: dict[str, LayerSummary] = {}
    imported: dict[str, set[str]] = {}
    for m in modules:
        layer = m.layer or PACKAGE
        entry = out.setdefault(layer, {"lines": 0, "modules": {}, "imports": []})
        entry["lines"] += m.lines
        entry["modules"][m.path.stem] = m.lines
        for target, _ in m.imports:
            other = layer_of(target, ALLOWED)
            if other and other != m.layer:
                imported.setdefault(layer, set()).add(other)
    for layer, entry in out.items():
        entry["imports"] = sorted(imported.get(layer, ()))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2p_diloco.tools.layers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the summary and the problems as JSON")
    args = parser.parse_args(argv)
    modules = read_package()
    table, problems = summary(modules), violations(modules)
    if args.json:
        print(json.dumps({"layers": table, "problems": problems}, indent=2))
        return 1 if problems else 0
    order = [PACKAGE, *ALLOWED]
    for layer in sorted(table, key=lambda k: order.index(k) if k in order else len(order)):
        entry = table[layer]
        imports = ", ".join(entry["imports"]) or "-"
        print(f"{layer + '/':<14} {entry['lines']:>6} lines   imports: {imports}")
        for name, lines in sorted(entry["modules"].items(), key=lambda kv: -kv[1]):
            print(f"    {name:<22} {lines:>5}")
    total = sum(m.lines for m in modules)
    print(f"{len(modules)} modules, {total} lines; largest module {max(m.lines for m in modules)} lines "
          f"(limit {MAX_MODULE_LINES}), largest class {max((n for m in modules for _, n in m.classes), default=0)} "
          f"lines (limit {MAX_CLASS_LINES}), {sum(p.startswith('circle: ') for p in problems)} import circles")
    for p in problems:
        print(f"problem: {p}")
    print("ok: every rule holds" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
