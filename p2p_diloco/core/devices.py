"""Where a learner computes: its device (``--device``), mixed precision, and the host/device boundary.

Where each tensor lives, and why:

- **On the learner's device** (``--device``: a CUDA GPU, or the CPU): the model's weights, their
  gradients and the inner AdamW state, all fp32. With ``inner.precision = "bf16"`` only the forward pass
  and the loss run under ``torch.autocast(dtype=bfloat16)``; weights, gradients and moments stay fp32
  (mixed precision). These tensors are local: no peer ever sees them.
- **On the CPU, fp32** (the host): every fragment's anchor and outer Nesterov momentum, pseudo-gradients,
  what the codecs encode and decode, and the outer step. These are shared: every peer must compute them
  bit for bit the same way, and CPU fp32 arithmetic is the one every peer has (GPU kernels round
  differently from the CPU's, and from one GPU model to another). A swarm that mixes CPU and GPU peers
  therefore ends with bit-identical anchors.
- The boundary is crossed in two places only: :func:`to_host` (weights -> fp32 CPU copies: the
  pseudo-gradient ``anchor - to_host(params)``, checkpoints, digests) and :func:`load_into` (CPU tensors
  -> weights: after an outer step's alpha-mix, a rebase onto a downloaded anchor, a re-anchor, a restore).
  Both run once per fragment round, never per inner step.

:func:`resolve_device` is the pure decision behind ``--device``; :func:`machine_device` asks torch for the
facts. torch is imported by the functions that need it: the CLI imports this module before torch loads.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Mapping

if TYPE_CHECKING:
    import torch

from p2p_diloco.core.config import PRECISIONS

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPEC_RE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def resolve_device(spec: str, cuda_available: bool, device_count: int, torch_version: str = "",
                   cuda_build: bool = False) -> torch.device:
    """The device of ``--device spec`` on a machine where CUDA is (not) available with ``device_count``
    devices: ``auto`` is ``cuda:0`` where CUDA is available, else the CPU; ``cuda`` is ``cuda:0``.
    ``ValueError`` (one line naming the flag) for a malformed spec or a CUDA device this machine lacks;
    ``torch_version`` and ``cuda_build`` (torch built with CUDA) only shape that message."""
    import torch

    m = _SPEC_RE.match(spec.strip().lower())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"--device {spec!r}: expected {DEVICE_CHOICES}")
    kind, index = m.group(1), int(m.group(2) or 0)
    count = device_count if cuda_available else 0
    if kind == "cpu" or (kind == "auto" and count == 0):
        return torch.device("cpu")
    if kind == "auto":
        return torch.device("cuda", 0)
    if count == 0:
        why = f"torch {torch_version} sees none" if cuda_build else f"torch {torch_version} is a CPU build"
        raise ValueError(f"--device {spec}: no CUDA device on this machine ({why}); use --device cpu")
    if index >= count:
        have = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
        raise ValueError(f"--device {spec}: this machine has {count} CUDA device{'s' * (count > 1)} ({have})")
    return torch.device("cuda", index)


def machine_device(spec: str) -> torch.device:
    """:func:`resolve_device` on this machine (asks torch whether CUDA is there; loads no CUDA context)."""
    import torch

    available = torch.cuda.is_available()
    return resolve_device(spec, available, torch.cuda.device_count() if available else 0, torch.__version__,
                          torch.version.cuda is not None)


def check_precision(precision: str, device: torch.device) -> None:
    """Whether ``inner.precision`` runs on ``device``: fp32 anywhere; bf16 on CUDA devices that support it
    and on the CPU (torch's CPU autocast: 0.7x fp32's step time on a CPU with AVX512-BF16, slower on CPUs
    without bf16 instructions)."""
    if precision not in PRECISIONS:
        raise ValueError(f"inner.precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "bf16" and device.type == "cuda":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise ValueError(f"inner.precision = \"bf16\": {torch.cuda.get_device_name(device)} does not support "
                             "bfloat16; use fp32")


def autocast(device: torch.device, precision: str) -> ContextManager[Any]:
    """The context of the forward pass and the loss: bf16 autocast on ``device`` for ``precision`` "bf16",
    else nothing at all (fp32 runs exactly as without it)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"inner.precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    import torch

    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def to_host(params: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of ``params`` (those of ``names``, default all): the device -> host crossing. Always
    copies, so the result never aliases the weights (on a CPU learner ``.to`` alone would return them)."""
    import torch

    with torch.no_grad():
        return {n: params[n].detach().to("cpu", torch.float32, copy=True) for n in (params if names is None else names)}


def load_into(params: Mapping[str, torch.Tensor], host: Mapping[str, torch.Tensor]) -> None:
    """Copy CPU tensors into the weights of the same names, wherever the weights live: the host -> device
    crossing (``copy_`` converts device and dtype)."""
    import torch

    with torch.no_grad():
        for n, t in host.items():
            params[n].copy_(t)


def state_to_host(state: Mapping[str, Any]) -> dict[str, Any]:
    """CPU copies of one parameter's optimizer state (tensors; other values as they are), for a checkpoint."""
    import torch

    return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def state_to_device(state: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """One parameter's restored optimizer state on ``device`` (fused AdamW keeps even its step count there)."""
    import torch

    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
