"""Console output shared by every layer: one line at a time, flushed at once (tmux, pipes, logs)."""

from __future__ import annotations


def out(line: str) -> None:
    """Print ``line`` and flush, so a watcher sees it now and not when a buffer fills."""
    print(line, flush=True)
