"""Which swarm sizes ``scripts/bench_control.py`` runs: those whose learners fit in memory, measured as it goes.

Sizes run smallest first; the memory per learner of the largest size run so far (the sum of PSS over its processes)
decides whether the next fits in the budget, with a margin, as memory per learner grows with N. A size that does not
fit is replaced by the largest candidate below it that does. Pure decisions: the caller measures and remembers.
"""

from __future__ import annotations

from _machine import GIB, MIB

CANDIDATES = (4, 16, 32, 64)
"""The sizes a size that does not fit in memory may be replaced by (the largest that fits)."""
MEMORY_BUDGET_BYTES = 16 * GIB
"""What all learners of one size may use (sum of PSS); less if less than that plus the reserve is available."""
MEMORY_RESERVE_BYTES = 2 * GIB
"""Kept free of the machine's available memory, whatever the budget (other sessions share it)."""
MEMORY_MARGIN = 1.25
"""Memory per learner grows with N (more connections, records, group metadata): plan with this margin."""


def memory_budget(available: int) -> int:
    """What one size's learners may use: the budget, or the available memory less the reserve if that is less."""
    return max(0, min(MEMORY_BUDGET_BYTES, available - MEMORY_RESERVE_BYTES))


def fits(n: int, per_learner: float | None, budget: int) -> str | None:
    """None when ``n`` learners of ``per_learner`` bytes each (None: not measured yet) fit in ``budget`` with the
    margin; else why not, in one line."""
    if per_learner is None:
        return None
    need = n * per_learner * MEMORY_MARGIN
    if need <= budget:
        return None
    return (f"needs ~{need / GIB:.1f} GiB ({n} x {per_learner / MIB:.0f} MiB PSS x {MEMORY_MARGIN:g}), "
            f"budget {budget / GIB:.1f} GiB")


def replacement(skipped: int, per_learner: float | None, budget: int, planned: list[int]) -> int | None:
    """The size to run in place of ``skipped`` (too big): the largest candidate below it that fits and is above
    every size already planned; None if there is none."""
    above = max(planned, default=0)
    options = [c for c in CANDIDATES if above < c < skipped and fits(c, per_learner, budget) is None]
    return max(options, default=None)
