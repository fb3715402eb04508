"""Model fragments and their staggered sync schedule.

Streaming DiLoCo (arXiv 2501.18512) syncs groups of transformer blocks *strided across depth*
(fragment f holds blocks f, f+F, f+2F, ...) at staggered offsets, so the bandwidth peak is 1/F
of the model. Decoupled DiLoCo (arXiv 2604.21428) balances fragment sizes by greedy bin-packing.
We do both: blocks are dealt strided, then the parameters outside the blocks (embeddings, final
norm) are packed, largest first, into the currently lightest fragment.

Everything here is a pure function of parameter names and sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

_BLOCK_RE = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.")


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]
    numel: int
    offset: int  # inner step (mod H) at which this fragment is due


def block_index(name: str) -> int | None:
    m = _BLOCK_RE.match(name)
    return int(m.group(1)) if m else None


def partition(sizes: Mapping[str, int], num_fragments: int) -> list[list[str]]:
    """Split parameter names into ``num_fragments`` groups: blocks strided by depth, the rest bin-packed."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    blocks = sorted({b for n in sizes if (b := block_index(n)) is not None})
    if blocks and num_fragments > len(blocks):
        raise ValueError(f"cannot split {len(blocks)} blocks into {num_fragments} fragments")
    groups: list[list[str]] = [[] for _ in range(num_fragments)]
    load = [0] * num_fragments
    for name, size in sizes.items():
        b = block_index(name)
        if b is not None:
            f = blocks.index(b) % num_fragments
            groups[f].append(name)
            load[f] += size
    rest = sorted((n for n in sizes if block_index(n) is None), key=lambda n: (-sizes[n], n))
    for name in rest:
        f = min(range(num_fragments), key=lambda i: (load[i], i))
        groups[f].append(name)
        load[f] += sizes[name]
    if any(not g for g in groups):
        raise ValueError(f"{num_fragments} fragments leave one empty for {len(sizes)} parameters")
    order = {n: i for i, n in enumerate(sizes)}
    return [sorted(g, key=order.__getitem__) for g in groups]


def offsets(num_fragments: int, sync_every: int) -> list[int]:
    """Staggered offsets: fragment f is due when ``step % H == offsets[f]`` (evenly spread over H)."""
    return [(f * sync_every) // num_fragments for f in range(num_fragments)]


def make_fragments(sizes: Mapping[str, int], num_fragments: int, sync_every: int) -> list[Fragment]:
    groups = partition(sizes, num_fragments)
    offs = offsets(num_fragments, sync_every)
    return [Fragment(i, tuple(g), sum(sizes[n] for n in g), offs[i]) for i, g in enumerate(groups)]


def due_fragments(step: int, fragments: Sequence[Fragment], sync_every: int) -> list[int]:
    """Fragments due after inner step ``step`` (1-based count of completed steps).

    The first sync of fragment f happens after ``H + offset_f`` steps, so every fragment has at
    least H steps of local progress the first time; thereafter every H steps.
    """
    if step < sync_every:
        return []
    return [fr.index for fr in fragments if step % sync_every == fr.offset]
