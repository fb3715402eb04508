"""Model fragments and their staggered sync schedule.

Streaming DiLoCo (arXiv 2501.18512) syncs groups of transformer blocks *strided across depth*
(fragment f holds blocks f, f+F, f+2F, ...) at staggered offsets, so the bandwidth peak is 1/F
of the model. Decoupled DiLoCo (arXiv 2604.21428) balances fragment sizes by greedy bin-packing.
We do both: blocks are dealt strided, then the parameters outside the blocks (embeddings, final
norm) are packed, largest first, into the currently lightest fragment.

Everything here is a pure function of parameter names and sizes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

_EPS = 1e-9
_BLOCK_RE = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.")


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]
    numel: int


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


def make_fragments(sizes: Mapping[str, int], num_fragments: int) -> list[Fragment]:
    groups = partition(sizes, num_fragments)
    return [Fragment(i, tuple(g), sum(sizes[n] for n in g)) for i, g in enumerate(groups)]


@dataclass(frozen=True)
class SyncSchedule:
    """When each fragment is due, as a pure function of the inner step (or of the swarm clock in steps).

    The sync period ramps linearly from ``start_every`` to ``sync_every`` over ``ramp_steps``, then stays:
    learners drift apart fastest early in training, so early syncs buy the most quality per byte.
    The *phase* ``phi(t) = sum over s < t of 1 / H(s)`` counts elapsed periods; fragment f is due
    whenever ``phi - f / F`` crosses an integer >= 1, so fragments are evenly staggered over each
    period and every fragment has at least one full period of progress at its first sync.
    """

    num_fragments: int
    sync_every: int
    start_every: int = 0  # 0: no ramp
    ramp_steps: int = 0

    def __post_init__(self) -> None:
        if self.num_fragments < 1 or self.sync_every < 1:
            raise ValueError(f"need num_fragments >= 1 and sync_every >= 1, got {self.num_fragments}, {self.sync_every}")
        if self.start_every < 0 or self.start_every > self.sync_every or self.ramp_steps < 0:
            raise ValueError(f"need 0 <= start_every <= sync_every and ramp_steps >= 0, got {self}")

    def period(self, step: float) -> float:
        """H at (fractional) step ``step``."""
        h0 = self.start_every or self.sync_every
        if self.ramp_steps == 0 or step >= self.ramp_steps:
            return float(self.sync_every)
        return h0 + (self.sync_every - h0) * step / self.ramp_steps

    def phase(self, step: float) -> float:
        """Periods elapsed after ``step`` steps (closed form of the sum for a linear ramp)."""
        h0, h = self.start_every or self.sync_every, self.sync_every
        if self.ramp_steps == 0 or h0 == h:
            return step / h
        w = self.ramp_steps
        ramp = min(step, w)
        phi = w / (h - h0) * math.log(self.period(ramp) / h0)
        return phi + max(0.0, step - w) / h

    def due(self, step: int) -> list[int]:
        """Fragments due after inner step ``step`` (1-based count of completed steps)."""
        if step < 1:
            return []
        now, before = self.phase(step), self.phase(step - 1)
        out = []
        for f in range(self.num_fragments):
            shift = f / self.num_fragments
            k_now, k_before = math.floor(now - shift + _EPS), math.floor(before - shift + _EPS)
            if k_now > k_before and k_now >= 1:
                out.append(f)
        return out
