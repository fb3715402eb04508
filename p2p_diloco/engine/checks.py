"""Checks of what a user hands the engine (:class:`~p2p_diloco.engine.engine.DiLoCo`): ``step``'s tokens and
loss, the model and its optimizer, a state dict to restore. Pure functions: each returns the checked value or
raises one line -- ``TypeError`` for a wrong type, ``ValueError`` for a wrong value -- naming the argument and what
it must be, before anything reaches the fragments, our record or the wire.

Why each matters: our token count is sent to every peer of a round, and peers refuse a round whose metadata is
not a non-negative int (a float stalled every round of the swarm); our loss is published in our record by the
status thread (a non-scalar one killed it); an optimizer that does not step a parameter sends zero progress for
it while claiming its tokens; a state dict is applied to every fragment or to none.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_COUNT = 2**63 - 1
"""The largest count (tokens, steps, version) a peer accepts on the wire (``decisions.MAX_WIRE_INT``)."""


def check_count(value: Any, what: str) -> int:
    """``value`` as an int if it is a non-negative integer (a Python int, or anything with ``__index__`` such as
    a NumPy integer or an integer 0-d tensor); bools and floats are a ``TypeError``, negatives a ``ValueError``."""
    if isinstance(value, bool) or isinstance(value, float) or (isinstance(value, torch.Tensor)
                                                                  and value.is_floating_point()):
        raise TypeError(f"{what} must be a non-negative int, got {type(value).__name__} {value!r:.40}")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be a non-negative int, got {type(value).__name__} {value!r:.40}") from None
    if not 0 <= count <= MAX_COUNT:
        raise ValueError(f"{what} must be a non-negative int, got {count}")
    return count


def check_loss(loss: Any) -> torch.Tensor | float | None:
    """``loss`` as given if it is None, a real number or a tensor of one element (on any device: its value is
    not read here, so no host sync); anything else is a ``TypeError`` (a string) or ``ValueError`` (a tensor of
    another size). NaN and inf are accepted: a diverging loss is news, not an error (records show it as none)."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"loss must be a scalar (a tensor of one element), got a tensor of shape "
                             f"{tuple(loss.shape)}")
        if loss.is_complex():
            raise TypeError("loss must be a real scalar, got a complex tensor")
        return loss
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):  # NumPy scalars are numbers.Real too
        raise TypeError(f"loss must be a number, a scalar tensor or None, got {type(loss).__name__} {loss!r:.40}")
    return float(loss)


def check_optimizer(params: Mapping[str, torch.nn.Parameter], optimizer: Any) -> None:
    """``optimizer`` must step every parameter of the model (``params``, by name); every parameter must be
    trainable. A parameter the optimizer does not own never moves, so its fragment would send zero progress while
    claiming our tokens and dilute every average; a frozen one would be overwritten by each outer step (every
    parameter of the run's model is averaged: frozen parameters are not supported)."""
    frozen = [n for n, p in params.items() if not p.requires_grad]
    if frozen:
        raise ValueError(f"model: {len(frozen)} parameter(s) do not require grad (e.g. {frozen[0]}): every parameter "
                         f"of the run's model is trained and averaged, frozen ones are not supported")
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, Iterable) or isinstance(groups, (str, bytes, Mapping)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (with param_groups), got "
                        f"{type(optimizer).__name__}")
    owned = {id(p) for group in groups for p in group.get("params", ())}
    missing = [n for n, p in params.items() if id(p) not in owned]
    if missing:
        raise ValueError(f"optimizer: it does not step {len(missing)} of the model's {len(params)} parameters (e.g. "
                         f"{missing[0]}): build it over model.parameters() of the model given to DiLoCo")


@dataclass(frozen=True)
class FragmentState:
    """One fragment of a checked state dict: ready to apply."""

    version: int
    anchor: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    since_tokens: int
    since_steps: int


@dataclass(frozen=True)
class EngineState:
    """A checked :meth:`~p2p_diloco.engine.engine.DiLoCo.state_dict`: every fragment's state, copied, and the
    step and token counts."""

    step: int
    tokens: int
    fragments: tuple[FragmentState, ...]


FRAGMENT_KEYS = frozenset({"version", "anchor", "momentum", "since_tokens", "since_steps"})
STATE_KEYS = frozenset({"config_hash", "step", "tokens", "fragments"})


def check_state(state: Any, config_hash: str, fragments: Sequence[tuple[str, ...]],
                shapes: Mapping[str, torch.Size]) -> EngineState:
    """The whole of ``state`` checked against this run (``config_hash``, each fragment's tensor names, each
    tensor's shape): keys, types, shapes, dtype (fp32, as anchors are kept), finite values, counts. Returns copies,
    so that applying them cannot fail half-way; raises one line naming the first problem."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict must be a mapping (what DiLoCo.state_dict() returns), got {type(state).__name__}")
    missing = sorted(STATE_KEYS - set(state))
    if missing:
        raise ValueError(f"state_dict: missing {', '.join(missing)} (not a DiLoCo.state_dict())")
    if state["config_hash"] != config_hash:
        raise ValueError(f"state_dict: of config hash {state['config_hash']!r:.40}, not this run's {config_hash}")
    frags = state["fragments"]
    if not isinstance(frags, Sequence) or isinstance(frags, (str, bytes)):
        raise TypeError(f"state_dict: fragments must be a list, got {type(frags).__name__}")
    if len(frags) != len(fragments):
        raise ValueError(f"state_dict: {len(frags)} fragments, this run has {len(fragments)}")
    checked = tuple(_check_fragment(i, frag, names, shapes) for i, (frag, names) in enumerate(zip(frags, fragments)))
    return EngineState(step=check_count(state["step"], "state_dict: step"),
                       tokens=check_count(state["tokens"], "state_dict: tokens"), fragments=checked)


def _check_fragment(index: int, frag: Any, names: tuple[str, ...], shapes: Mapping[str, torch.Size]) -> FragmentState:
    where = f"state_dict: fragment {index}"
    if not isinstance(frag, Mapping):
        raise TypeError(f"{where} must be a mapping, got {type(frag).__name__}")
    missing = sorted(FRAGMENT_KEYS - set(frag))
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    anchor = _tensors(frag["anchor"], f"{where} anchor", shapes)
    if set(anchor) != set(names):
        odd = sorted(set(anchor) ^ set(names))
        raise ValueError(f"{where} holds other tensors than this model's fragment (e.g. {odd[0]!r:.80})")
    momentum = _tensors(frag["momentum"], f"{where} momentum", shapes)
    if not set(momentum) <= set(names):
        odd = sorted(set(momentum) - set(names))
        raise ValueError(f"{where} momentum holds a tensor not of this fragment ({odd[0]!r:.80})")
    return FragmentState(version=check_count(frag["version"], f"{where} version"), anchor=anchor, momentum=momentum,
                         since_tokens=check_count(frag["since_tokens"], f"{where} since_tokens"),
                         since_steps=check_count(frag["since_steps"], f"{where} since_steps"))


def _tensors(value: Any, where: str, shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of a name -> tensor mapping whose every tensor has its parameter's shape and is finite."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must map names to tensors, got {type(value).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, t in value.items():
        if name not in shapes:
            raise ValueError(f"{where} names {name!r:.80}, not a parameter of this model")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where} {name}: must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise ValueError(f"{where} {name}: must be float32 (as the engine keeps anchors), got {t.dtype}")
        if t.shape != shapes[name]:
            raise ValueError(f"{where} {name}: shape {tuple(t.shape)}, the model's {tuple(shapes[name])}")
        copy = t.detach().to("cpu", copy=True)
        if not bool(torch.isfinite(copy).all()):
            raise ValueError(f"{where} {name}: not finite (NaN or inf)")
        out[name] = copy
    return out

