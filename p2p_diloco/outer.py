"""The outer step: merging pseudo-gradients, outer Nesterov SGD per fragment, and alpha-mixing.

DiLoCo (arXiv 2311.08105): each learner's pseudo-gradient is ``delta_i = anchor - theta_i``; the
merged ``delta`` drives Nesterov SGD on the anchor (lr 0.7, momentum 0.9). Decoupled DiLoCo
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
"""

from __future__ import annotations

import math
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
                  weights: Sequence[float], merge: str) -> Tensors:
    """Turn the all-reduced tensors (weighted means of what :func:`encode_contribution` produced) into
    the merged pseudo-gradient. ``metas``/``weights`` are every group member's, in the same order.

    Radial: ``delta = mean_norm * mean_direction / |mean_direction|``; the merged step keeps the
    typical length of one learner's pseudo-gradient instead of shrinking when directions disagree.
    """
    if merge == "mean":
        return {n: t.float().clone() for n, t in averaged.items()}
    if merge != "radial":
        raise ValueError(f"unknown merge {merge!r} (expected mean or radial)")
    shares = normalized_weights(weights)
    out: Tensors = {}
    for name, t in averaged.items():
        t = t.float()
        if uses_plain_merge(name):
            out[name] = t.clone()
            continue
        try:
            mean_norm = sum(s * float(m[name]) for s, m in zip(shares, metas))
        except KeyError:
            raise ValueError(f"a group member's metadata lacks the norm of {name}") from None
        direction_norm = float(t.norm())
        out[name] = t * (mean_norm / direction_norm) if direction_norm > _NORM_EPS else torch.zeros_like(t)
    return out


def merge_pseudo_gradients(deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], merge: str) -> Tensors:
    """Reference merge (no compression): the same maths as encode -> all-reduce -> decode."""
    encoded = [encode_contribution(d, merge) for d in deltas]
    averaged = {n: weighted_mean([e[0][n] for e in encoded], weights) for n in deltas[0]}
    return decode_merged(averaged, [e[1] for e in encoded], weights, merge)


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
