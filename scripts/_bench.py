"""What every benchmark script shares: its common arguments, its output folder and how it writes what it found.

A benchmark writes into its folder (``results/<bench>`` by default, ``--out`` to change it):

- ``<name>.json``: every figure of the run. Paths in it are relative to the repository (results are committed and
  must read the same on any clone), see :func:`relative_paths`.
- ``README.md``: the page, generated from that JSON alone -- what is measured, how and on what config (the
  script's method text), then the full table -- so it is always the last run's. ``--render-only`` writes it
  again from the committed JSON without running anything.
- ``<name>.png``: the figure, drawn in one style (:data:`STYLE`); ``--replot`` redraws it from the JSON.

A run names the code it ran (:func:`code_identity`, :func:`short_commit`): results outlive the checkout they came
from. What a script starts and reads besides lives in sibling modules of one concept each: ``_swarm.py`` (a local
swarm and its learners' events), ``_tally.py`` (RPC bytes by purpose), ``_machine.py`` (memory, CPU and load).

Scripts in ``scripts/`` import this module as a sibling (``python scripts/x.py`` puts ``scripts/`` on
``sys.path``); scripts in ``scripts/wan/`` and below reach it through a shim of the same name in their own folder
(``scripts/wan/_bench.py``), which loads this file in its place.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("bench")

ROOT = Path(__file__).resolve().parents[1]
"""The repository: paths in results are relative to it."""
RESULTS = ROOT / "results"
PAGE = "README.md"
"""Every result folder's page."""
STYLE: dict[str, Any] = {
    "axes.grid": True, "grid.alpha": 0.3, "axes.titlesize": 10, "axes.labelsize": 9, "xtick.labelsize": 8,
    "ytick.labelsize": 8, "legend.fontsize": 8, "figure.dpi": 110, "savefig.dpi": 110,
}
"""The one plot style of every benchmark figure (matplotlib rcParams)."""

Payload = dict[str, Any]
Table = Callable[[Payload], str]
"""A benchmark's table (Markdown) from its JSON payload."""
Plot = Callable[[Payload, Path], None]
"""A benchmark's figure from its JSON payload, written to the path given."""


def repo_path(path: str | Path) -> str:
    """``path`` relative to the repository when it lies inside it, else as given (a run written outside the
    repository is not a committed result)."""
    p = Path(path)
    if not p.is_absolute():
        return str(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def relative_paths(value: Any) -> Any:
    """``value`` with every string that is an absolute path inside the repository made relative to it, in nested
    dicts, lists and tuples alike; everything else unchanged."""
    if isinstance(value, str):
        return repo_path(value) if value.startswith(f"{ROOT}/") else value
    if isinstance(value, dict):
        return {k: relative_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [relative_paths(v) for v in value]
    return value



@dataclass(frozen=True)
class Bench:
    """One benchmark's outputs: its file names and its page."""

    name: str
    """File stem: ``<name>.json``, ``<name>.png``."""
    folder: str
    """The default output folder, in ``results/``."""
    title: str
    """The page's heading."""
    script: str
    """The script, relative to the repository (``scripts/bench_x.py``): named on the page."""
    method: str
    """Markdown: what is measured, how and on what config; the page's first section."""
    source: str = ""
    """Markdown naming what the page is generated from, when it is not ``<name>.json``."""
    render_args: str = ""
    """Arguments the script needs to render this page again besides ``--render-only --out`` (e.g. ``--config``)."""

    def json_path(self, out: Path) -> Path:
        return out / f"{self.name}.json"

    def png_path(self, out: Path) -> Path:
        return out / f"{self.name}.png"

    def save(self, out: Path, payload: Payload, indent: int = 2) -> Payload:
        """Writes the JSON with repository-relative paths; returns what was written, as read back."""
        out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(relative_paths(payload), indent=indent) + "\n"
        self.json_path(out).write_text(text)
        return json.loads(text)

    def load(self, out: Path) -> Payload:
        return json.loads(self.json_path(out).read_text())

    def page(self, out: Path, table: str) -> str:
        """The page: the method, the table, the figure if there is one, and how to write it again."""
        again = " ".join(["python", self.script, *([self.render_args] if self.render_args else []),
                          "--render-only", "--out", str(repo_path(out.resolve()))])
        lines = [f"# {self.title}", "", self.method.strip(), "", "## Results", "", table.strip(), ""]
        if self.png_path(out).exists():
            lines += [f"![{self.title}]({self.name}.png)", ""]
        source = self.source or f"[`{self.name}.json`]({self.name}.json), the figures of its last run"
        lines += [f"Generated by `{self.script}` from {source}; `{again}` writes this page again from it.", ""]
        return "\n".join(lines)

    def write_page(self, out: Path, table: str) -> Path:
        path = out / PAGE
        path.write_text(self.page(out, table))
        return path

def parser(doc: str, bench: Bench, *, config: str | None = None, overrides: bool = True,
           quick: str | None = None) -> argparse.ArgumentParser:
    """The arguments every benchmark has: ``--out`` (default ``results/<bench.folder>``), ``--render-only`` and
    ``--replot``; with ``config`` (a file in ``configs/``) ``--config``, and ``--set`` unless not ``overrides``; with
    ``quick`` (its help) ``--quick``. The description is the first paragraph of ``doc``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS / bench.folder,
                   help=f"output folder (default: results/{bench.folder})")
    if config is not None:
        p.add_argument("--config", default=str(ROOT / "configs" / config), help=f"run config (default: configs/{config})")
    if config is not None and overrides:
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="config override, for every run (repeatable)")
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--render-only", action="store_true",
                   help=f"rewrite --out/{PAGE} from the JSON there, without running the benchmark")
    p.add_argument("--replot", action="store_true", help="--render-only, and redraw the figure from the JSON too")
    return p


def publish(bench: Bench, out: Path, payload: Payload, table: Table, plot: Plot | None, indent: int = 2,
            echo: bool = True) -> Payload:
    """A finished run: its JSON, then the figure and the page from what was written (what ``--render-only`` would
    give); with ``echo`` the table goes to stdout too. Returns the payload as written."""
    saved = bench.save(out, payload, indent)
    if plot is not None:
        plot(saved, bench.png_path(out))
    bench.write_page(out, table(saved))
    if echo:
        print(table(saved))
    return saved


def rerender(args: argparse.Namespace, bench: Bench, table: Table, plot: Plot | None) -> bool:
    """``--render-only`` / ``--replot``: the page (and with ``--replot`` the figure) again from the JSON in
    ``args.out``, nothing run. False when neither was asked for."""
    if not (args.render_only or args.replot):
        return False
    payload = bench.load(args.out)
    if args.replot and plot is not None:
        plot(payload, bench.png_path(args.out))
    bench.write_page(args.out, table(payload))
    return True


@contextmanager
def figure(path: Path, ncols: int = 1, size: tuple[float, float] = (7.0, 4.5)) -> Iterator[list[Any]]:
    """A row of ``ncols`` axes in :data:`STYLE`; on leaving the block, laid out, saved to ``path`` and closed (closed
    on an error too). matplotlib is imported here: a script's ``--help`` does not pay for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.style.context(STYLE):
        fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False)
        try:
            yield list(axes[0])
            fig.tight_layout()
            fig.savefig(path)
        finally:
            plt.close(fig)


_MEMBER_RE = re.compile(r"\bmember \S+ reported\b")
_PEER_RE = re.compile(r"\b(?:Qm[1-9A-HJ-NP-Za-km-z]{44}|12D3KooW[1-9A-HJ-NP-Za-km-z]{44,})\b")
_HASH_RE = re.compile(r"\b[0-9a-f]{16}\b")
_VERSION_RE = re.compile(r"\bv\d+\b")
_NUMBER_RE = re.compile(r"(?<![A-Za-z0-9_.])\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![A-Za-z0-9_])")


def normalise_reason(reason: str, max_chars: int) -> str:
    """A discarded round's reason with what differs between rounds masked, so that reasons group: peer ids
    (``<peer>``), 16-hex anchor hashes (``<hash>``), versions (``vN``) and numbers (``N``); at most ``max_chars``."""
    r = _MEMBER_RE.sub("member <peer> reported", reason.strip())
    r = _PEER_RE.sub("<peer>", r)
    r = _HASH_RE.sub("<hash>", r)
    r = _VERSION_RE.sub("vN", r)
    r = _NUMBER_RE.sub("N", r)
    return r[:max_chars] or "(no reason given)"


def git_revision(timeout_s: float) -> tuple[str, list[str]]:
    """The repository's commit (short) and the ``p2p_diloco`` files changed from it: which code a run used.
    Raises ``FileNotFoundError`` (no git), ``subprocess.CalledProcessError`` (not a checkout) or
    ``subprocess.TimeoutExpired``."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                            timeout=timeout_s).stdout.strip()
    status = subprocess.run([*git, "status", "--porcelain", "--", "p2p_diloco"], capture_output=True, text=True,
                            check=True, timeout=timeout_s).stdout
    return commit, [line[3:] for line in status.splitlines()]


def sources_digest() -> str:
    """A digest of the ``p2p_diloco`` sources a run's processes import (they run from this repository's folder)."""
    h = hashlib.sha256()
    package = ROOT / "p2p_diloco"
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def code_identity(label: str | None, timeout_s: float) -> dict[str, Any]:
    """Which code a run used: ``label`` (given), the git commit and the ``p2p_diloco`` files changed from it (when
    the repository is a git checkout, asked within ``timeout_s``), and the sources' digest."""
    ident: dict[str, Any] = {"label": label, "commit": None, "changed": [], "sources_sha256": sources_digest()}
    try:
        ident["commit"], ident["changed"] = git_revision(timeout_s)
    except (FileNotFoundError, subprocess.CalledProcessError, subprocess.TimeoutExpired):  # no git, not a checkout
        log.info("no git checkout at %s: the code is named by its label and digest only", ROOT)
    return ident


def code_line(code: dict[str, Any]) -> str:
    """:func:`code_identity`'s answer in a few words, for a page."""
    parts = [code["label"]] if code.get("label") else []
    if code.get("commit"):
        changed = code.get("changed", [])
        parts.append(f"commit {code['commit']}" + (f" with {len(changed)} changed files in p2p_diloco/ "
                                                   f"({', '.join(changed)})" if changed else ""))
    parts.append(f"sources digest {code['sources_sha256']}")
    return "; ".join(parts)


def short_commit(timeout_s: float) -> str | None:
    """The checkout's commit (short), with "+changes" if ``p2p_diloco`` differs from it; None outside git."""
    try:
        head, changed = git_revision(timeout_s)
    except (FileNotFoundError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return head + ("+changes" if changed else "")
