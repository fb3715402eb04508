"""The outer step: merging pseudo-gradients, outer Nesterov SGD per fragment, and alpha-mixing.

DiLoCo (arXiv 2311.08105): each learner's pseudo-gradient is ``delta_i = anchor - theta_i``; the
merged ``delta`` drives Nesterov SGD on the anchor (the paper's lr 0.7, momentum 0.9; our default lr is 0.5). Decoupled DiLoCo
(arXiv 2604.21428) weights contributions by progress (tokens, or tokens^2/steps) and merges
them *radial-directionally*: the norms and the unit directions are averaged separately, with a
plain average for embeddings. Streaming DiLoCo (arXiv 2501.18512) applies the result tau steps
after sending and mixes: ``theta <- alpha * theta + (1 - alpha) * anchor``.

The merge is written in two halves so that the networked all-reduce (which can only compute a
weighted mean) and the in-process simulator run exactly the same maths:
:func:`encode_contribution` turns a pseudo-gradient into the tensors to average plus a small
metadata dict, the all-reduce (or :func:`weighted_mean`) averages the tensors, and
:func:`decode_merged` turns the averaged tensors plus everyone's metadata back into the merged
pseudo-gradient.

**Robust merge** (``outer.robust``, a :class:`Robust` rule): one member must not be able to steer the
anchor. ``clip``: every quantity a member contributes is capped at ``clip_factor`` x the group's
*lower* median of that quantity (the lower median, so that even a pair bounds the larger one by the
smaller) -- its weight (:func:`clip_to_median`), its radial norms, and each tensor part a reducer
receives (:func:`clip_contributions`), where non-finite parts are left out. A capped attacker still
pulls: a sign-flipped direction at 2x the median norm cancels most of three honest ones. ``trim``
adds a coordinate-wise trimmed mean (:func:`trimmed_mean`): at every element the most extreme
values are left out, so one member out of four has no say at all in any coordinate it makes
extreme. Reducers apply the rule to the parts they receive (:func:`robust_mean`) and send the same
result to everyone; every member applies it to the gathered norms in :func:`decode_merged`; so
anchors stay bit-identical. A learner's *own* pseudo-gradient that is non-finite or absurd
(:func:`local_problem`) is never sent: the learner drops it and re-anchors the fragment.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

Tensors = dict[str, torch.Tensor]

# Parameters whose pseudo-gradients are merged by plain weighted mean even under "radial":
# embedding rows are sparse updates, and their norms say how many rows were touched, not how far.
PLAIN_MERGE_SUFFIXES = ("wte.weight", "wpe.weight")
_NORM_EPS = 1e-12


def contribution_weight(tokens: int, steps: int, weighting: str) -> float:
    """A learner's weight in a round, from its progress since this fragment's last sync."""
    if tokens < 0 or steps < 0:
        raise ValueError(f"progress must be non-negative, got tokens={tokens} steps={steps}")
    if weighting == "uniform":
        return 1.0 if steps > 0 else 0.0
    if weighting == "tokens":
        return float(tokens)
    if weighting == "tokens2":
        return float(tokens) * tokens / steps if steps > 0 else 0.0
    raise ValueError(f"unknown weighting {weighting!r} (expected uniform, tokens or tokens2)")


def normalized_weights(weights: Sequence[float]) -> list[float]:
    """Weights scaled to sum to 1; all-zero or negative weights raise (hivemind would return NaN)."""
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    total = sum(weights)
    if total <= 0:
        raise ValueError("all contribution weights are zero: nothing to merge")
    return [w / total for w in weights]


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    shares = normalized_weights(weights)
    out = torch.zeros_like(tensors[0], dtype=torch.float32)
    for t, s in zip(tensors, shares):
        out.add_(t.float(), alpha=s)
    return out


def uses_plain_merge(name: str) -> bool:
    return name.endswith(PLAIN_MERGE_SUFFIXES)


@dataclass(frozen=True)
class Robust:
    """How a round bounds each member's influence (from ``outer.robust`` and ``outer.clip_factor``)."""

    clip_factor: float = 0.0
    """Caps at this multiple of the group's lower median (0: the robust merge is off)."""
    trim: bool = False
    """Also a coordinate-wise trimmed mean: :func:`trim_count` members left out at each end."""

    @property
    def active(self) -> bool:
        return self.clip_factor > 0


NO_ROBUST = Robust()


def robust_rule(robust: str, clip_factor: float) -> Robust:
    """The :class:`Robust` rule of ``outer.robust`` ("none", "clip" or "trim") and ``outer.clip_factor``."""
    if robust == "none":
        return NO_ROBUST
    if robust not in ("clip", "trim"):
        raise ValueError(f"unknown robust merge {robust!r} (expected none, clip or trim)")
    if not 1.0 <= clip_factor < math.inf:
        raise ValueError(f"clip_factor must be finite and >= 1, got {clip_factor}")
    return Robust(clip_factor, trim=robust == "trim")


def trim_count(members: int) -> int:
    """How many values the trimmed mean leaves out at each end of every coordinate: ``members // 4``, at
    least 1 from 3 members on (3 -> the median, 4 -> the mean of the middle two); 0 for a pair."""
    return max(1, members // 4) if members >= 3 else 0


def clip_to_median(values: Sequence[float], factor: float) -> list[float]:
    """Each value capped at ``factor`` x the lower median of ``values`` (``factor`` 0: unchanged).

    Values are a group's weights or the norms of one tensor, one per member; they must be finite and
    non-negative (gathered metadata is checked before it gets here)."""
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"values to clip must be finite and non-negative, got {list(values)}")
    if factor == 0 or not values:
        return [float(v) for v in values]
    cap = factor * statistics.median_low(values)
    return [float(min(v, cap)) for v in values]


def clip_contributions(tensors: Sequence[torch.Tensor], weights: Sequence[float],
                       factor: float) -> tuple[list[torch.Tensor], list[float]]:
    """What a robust reducer averages instead of ``tensors`` (one part per sender, with its weight).

    A non-finite part is left out (zeros, weight 0). Each remaining part's norm is capped at
    ``factor`` x the lower median of the remaining parts' norms (``factor`` 0: no cap). Returns the
    parts and weights to pass to :func:`weighted_mean`; weights may all be 0 (nothing usable)."""
    if len(tensors) != len(weights):
        raise ValueError(f"{len(tensors)} tensors but {len(weights)} weights")
    finite = [bool(torch.isfinite(t).all()) for t in tensors]
    norms = [float(t.float().norm()) if ok else 0.0 for t, ok in zip(tensors, finite)]
    kept = [n for n, ok in zip(norms, finite) if ok]
    cap = factor * statistics.median_low(kept) if factor > 0 and kept else math.inf
    out_t: list[torch.Tensor] = []
    out_w: list[float] = []
    for t, w, ok, n in zip(tensors, weights, finite, norms):
        if not ok:
            out_t.append(torch.zeros_like(t, dtype=torch.float32))
            out_w.append(0.0)
        elif n > cap:
            out_t.append(t.float() * (cap / n))
            out_w.append(float(w))
        else:
            out_t.append(t.float())
            out_w.append(float(w))
    return out_t, out_w


def trimmed_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float], trim: int) -> torch.Tensor:
    """Coordinate-wise weighted trimmed mean: at every element, the ``trim`` smallest and ``trim`` largest
    values are left out and the rest averaged with their weights (positive, ``2 * trim < len(tensors)``).
    Deterministic: a stable sort, then a fixed summation order."""
    if not 0 <= 2 * trim < len(tensors) or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"trimmed mean needs positive weights and 2 * trim < {len(tensors)}, got trim={trim}")
    stacked = torch.stack([t.float() for t in tensors])
    values, order = torch.sort(stacked, dim=0, stable=True)
    w = torch.tensor([float(x) for x in weights], dtype=torch.float32)[order]
    if trim:
        w[:trim] = 0
        w[-trim:] = 0
    return (values * w).sum(0) / w.sum(0)


def robust_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float], rule: Robust) -> torch.Tensor:
    """What a robust reducer returns for the parts it received (one per sender, with the sender's weight):
    :func:`clip_contributions`, then the weighted mean -- or, with ``rule.trim``, the
    :func:`trimmed_mean` -- of the usable parts. Zeros if no part is usable (never NaN)."""
    clipped, kept = clip_contributions(tensors, weights, rule.clip_factor)
    usable = [i for i, w in enumerate(kept) if w > 0]
    if not usable:
        return torch.zeros_like(tensors[0], dtype=torch.float32)
    if rule.trim:
        return trimmed_mean([clipped[i] for i in usable], [kept[i] for i in usable], trim_count(len(usable)))
    return weighted_mean(clipped, kept)


def local_problem(delta: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor],
                  max_ratio: float) -> str | None:
    """Why a learner's own pseudo-gradient of a fragment must not be sent (None: it may be).

    Refused: any non-finite element; a norm above ``max_ratio`` x the fragment anchor's norm
    (``max_ratio`` 0: no such bound). Honest pseudo-gradients after H inner steps are a small
    fraction of the anchor; a far larger one means the local replica diverged."""
    for name, t in delta.items():
        if not bool(torch.isfinite(t).all()):
            return f"pseudo-gradient {name} is not finite"
    if max_ratio <= 0:
        return None
    ratio = delta_ratio(delta, anchor)
    if ratio > max_ratio:
        return f"pseudo-gradient norm is {ratio:.3g} x the anchor's (max {max_ratio:g})"
    return None


def delta_ratio(delta: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]) -> float:
    """``||delta|| / ||anchor||`` over a fragment's tensors (inf if the anchor is all zero and delta not)."""
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))
    anchor_norm = math.sqrt(sum(float(anchor[n].double().pow(2).sum()) for n in delta))
    return norm / anchor_norm if anchor_norm > 0 else (0.0 if norm == 0 else math.inf)


def encode_contribution(delta: Mapping[str, torch.Tensor], merge: str) -> tuple[Tensors, dict[str, float]]:
    """What a learner puts into the all-reduce for a fragment, and the metadata it gathers with it.

    ``mean``: the pseudo-gradient itself, no metadata. ``radial``: each tensor's unit direction,
    with its norm in the metadata (embeddings are sent as they are).
    """
    if merge == "mean":
        return {n: t.float() for n, t in delta.items()}, {}
    if merge != "radial":
        raise ValueError(f"unknown merge {merge!r} (expected mean or radial)")
    sent: Tensors = {}
    norms: dict[str, float] = {}
    for name, t in delta.items():
        t = t.float()
        if uses_plain_merge(name):
            sent[name] = t
            continue
        norm = float(t.norm())
        norms[name] = norm
        sent[name] = t / norm if norm > _NORM_EPS else torch.zeros_like(t)
    return sent, norms


def decode_merged(averaged: Mapping[str, torch.Tensor], metas: Sequence[Mapping[str, float]],
                  weights: Sequence[float], merge: str, robust: Robust = NO_ROBUST) -> Tensors:
    """Turn the all-reduced tensors (weighted means of what :func:`encode_contribution` produced) into
    the merged pseudo-gradient. ``metas``/``weights`` are every group member's, in the same order.

    Radial: ``delta = mean_norm * mean_direction / |mean_direction|``; the merged step keeps the
    typical length of one learner's pseudo-gradient instead of shrinking when directions disagree.
    With a ``robust`` rule, weights are capped by :func:`clip_to_median` (the weights the robust
    reducers averaged the tensors with) and each tensor's mean norm is :func:`robust_mean` of the
    members' norms (capped; trimmed with ``robust.trim``).
    """
    if merge == "mean":
        return {n: t.float().clone() for n, t in averaged.items()}
    if merge != "radial":
        raise ValueError(f"unknown merge {merge!r} (expected mean or radial)")
    robust_weights = clip_to_median(weights, robust.clip_factor)
    shares = normalized_weights(robust_weights)
    out: Tensors = {}
    for name, t in averaged.items():
        t = t.float()
        if uses_plain_merge(name):
            out[name] = t.clone()
            continue
        try:
            norms = [float(m[name]) for m in metas]
        except KeyError:
            raise ValueError(f"a group member's metadata lacks the norm of {name}") from None
        if robust.active:  # the same rule the reducers applied to the tensor parts, on one-element "parts"
            mean_norm = float(robust_mean([torch.tensor([n]) for n in norms], robust_weights, robust)[0])
        else:
            mean_norm = sum(s * n for s, n in zip(shares, norms))
        direction_norm = float(t.norm())
        out[name] = t * (mean_norm / direction_norm) if direction_norm > _NORM_EPS else torch.zeros_like(t)
    return out


def merge_pseudo_gradients(deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], merge: str,
                           robust: Robust = NO_ROBUST) -> Tensors:
    """Reference merge (no compression): the same maths as encode -> all-reduce -> decode. With an
    active ``robust`` rule each whole tensor is one reducer part (the network applies it per part)."""
    encoded = [encode_contribution(d, merge) for d in deltas]
    if robust.active:
        robust_weights = clip_to_median(weights, robust.clip_factor)
        averaged = {n: robust_mean([e[0][n] for e in encoded], robust_weights, robust) for n in deltas[0]}
    else:
        averaged = {n: weighted_mean([e[0][n] for e in encoded], weights) for n in deltas[0]}
    return decode_merged(averaged, [e[1] for e in encoded], weights, merge, robust)


@dataclass
class OuterState:
    """Per-fragment outer state: the shared anchor's Nesterov momentum and its version (outer steps)."""

    momentum: Tensors = field(default_factory=dict)
    version: int = 0


def nesterov_step(anchor: Mapping[str, torch.Tensor], grad: Mapping[str, torch.Tensor], state: OuterState,
                  lr: float, momentum: float) -> None:
    """In place: ``buf = mu * buf + g; anchor -= lr * (g + mu * buf)`` (torch.optim.SGD with nesterov=True)."""
    if set(grad) != set(anchor):
        raise ValueError(f"pseudo-gradient names {sorted(grad)} differ from the anchor's {sorted(anchor)}")
    for name, p in anchor.items():
        g = grad[name].to(p.dtype)
        if g.shape != p.shape:
            raise ValueError(f"pseudo-gradient {name} has shape {tuple(g.shape)}, anchor has {tuple(p.shape)}")
        if not torch.isfinite(g).all():
            raise ValueError(f"pseudo-gradient {name} is not finite")
        buf = state.momentum.get(name)
        if buf is None:
            buf = state.momentum[name] = g.clone()  # torch's first step: buf = g
        else:
            buf.mul_(momentum).add_(g)
        p.sub_(g + momentum * buf, alpha=lr)
    state.version += 1


def alpha_mix(local: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], alpha: float) -> None:
    """In place: ``local <- alpha * local + (1 - alpha) * anchor`` (alpha = 0 takes the anchor)."""
    for name, p in local.items():
        p.mul_(alpha).add_(anchor[name], alpha=1.0 - alpha)


def rebase(local: Mapping[str, torch.Tensor], old_anchor: Mapping[str, torch.Tensor],
           new_anchor: Mapping[str, torch.Tensor]) -> None:
    """In place: ``local <- new_anchor + (local - old_anchor)``; a peer that missed a round keeps its progress."""
    for name, p in local.items():
        p.add_(new_anchor[name] - old_anchor[name])
