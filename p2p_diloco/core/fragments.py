"""Model fragments and their staggered sync schedule.

Streaming DiLoCo (arXiv 2501.18512) syncs groups of transformer blocks *strided across depth*
(fragment f holds blocks f, f+F, f+2F, ...) at staggered offsets, so the bandwidth peak is 1/F
of the model. Decoupled DiLoCo (arXiv 2604.21428) balances fragment sizes by greedy bin-packing.
We do both: blocks are dealt strided, then the parameters outside the blocks (embeddings, final
norm) are packed, largest first, into the currently lightest fragment.

The blocks come from the model's structure, not from its names (:func:`block_map`): its stack of
repeated blocks is the ``nn.ModuleList`` that holds the most parameters (``blocks`` in the byte GPT,
``model.layers`` in a Llama, ``transformer.h`` in a GPT-2). Names come from ``named_parameters()``,
which lists a shared (tied) parameter once, under its first name: an input embedding that is also the
output head belongs to one fragment and is averaged once, and writing its anchor back in place keeps the
tie. Everything else here is a pure function of parameter names, block indices and sizes.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    from torch import nn

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


def partition(sizes: Mapping[str, int], num_fragments: int,
              blocks_of: Mapping[str, int | None] | None = None) -> list[list[str]]:
    """Split parameter names into ``num_fragments`` groups: blocks strided by depth, the rest bin-packed.

    ``blocks_of`` maps each name to its block's index in the model's stack (None: outside it), as
    :func:`block_map` reads it from a module; without it, names of the form ``blocks.N.`` (:func:`block_index`).
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    block_of = {n: (blocks_of[n] if blocks_of is not None else block_index(n)) for n in sizes}
    blocks = sorted({b for b in block_of.values() if b is not None})
    if blocks and num_fragments > len(blocks):
        raise ValueError(f"cannot split {len(blocks)} blocks into {num_fragments} fragments")
    groups: list[list[str]] = [[] for _ in range(num_fragments)]
    load = [0] * num_fragments
    for name, size in sizes.items():
        b = block_of[name]
        if b is not None:
            f = blocks.index(b) % num_fragments
            groups[f].append(name)
            load[f] += size
    rest = sorted((n for n in sizes if block_of[n] is None), key=lambda n: (-sizes[n], n))
    for name in rest:
        f = min(range(num_fragments), key=lambda i: (load[i], i))
        groups[f].append(name)
        load[f] += sizes[name]
    if any(not g for g in groups):
        raise ValueError(f"{num_fragments} fragments leave one empty for {len(sizes)} parameters")
    order = {n: i for i, n in enumerate(sizes)}
    return [sorted(g, key=order.__getitem__) for g in groups]


def make_fragments(sizes: Mapping[str, int], num_fragments: int,
                   blocks_of: Mapping[str, int | None] | None = None) -> list[Fragment]:
    groups = partition(sizes, num_fragments, blocks_of)
    return [Fragment(i, tuple(g), sum(sizes[n] for n in g)) for i, g in enumerate(groups)]


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's stack of repeated blocks and its name: the ``nn.ModuleList`` holding the most parameters
    (the outermost on a tie, so a list of experts inside a layer never wins over the layers); None if the
    model has no ``ModuleList`` with parameters."""
    from torch import nn

    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if numel > 0 and (best is None or numel > best[0]):
                best = (numel, name, module)
    return None if best is None else (best[1], best[2])


def block_map(model: nn.Module) -> dict[str, int | None]:
    """Each name of ``model.named_parameters()`` (shared parameters once) and the index of the repeated block
    that holds it (None: outside the stack), for :func:`partition`. By parameter identity, not by name."""
    found = repeated_blocks(model)
    owner: dict[int, int] = {}
    for i, block in enumerate(found[1] if found else ()):
        for p in block.parameters():
            owner.setdefault(id(p), i)
    return {name: owner.get(id(p)) for name, p in model.named_parameters()}


def model_fragments(model: nn.Module, num_fragments: int) -> list[Fragment]:
    """:func:`make_fragments` of a module: its parameters (tied ones once), with blocks from its structure."""
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    return make_fragments(sizes, num_fragments, block_map(model))


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


def swarm_step(peers: Iterable[tuple[int, float, float]], now: float) -> int | None:
    """The inner step a running swarm is at, ``now`` (DHT time), for a learner that joins it on the step
    schedule: it numbers its steps from there (:meth:`SyncSchedule.due` of ``step + offset``), so that its
    fragments fall due with the others'. Counting from its own first step instead, a newcomer is due at an
    arbitrary offset from the swarm -- however far into a sync period the swarm was when it started -- and at
    the same pace that offset never changes: beyond the matchmaking window it meets nobody, ever.

    ``peers``: the training peers' ``(inner_step, published_at, step_time_s)`` from their records; each step
    is advanced by the steps taken since it was published. The *lower* median: one peer's step, not the
    mean of two groups out of phase. Peers without a measured step time are left out; None if none is left
    (nobody to align to: learners that start together are in phase already)."""
    steps = [step + max(0.0, now - at) / step_time_s for step, at, step_time_s in peers
             if math.isfinite(step_time_s) and step_time_s > 0 and math.isfinite(at)]
    if not steps:
        return None
    return round(statistics.median_low(steps))
