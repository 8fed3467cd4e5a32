"""When the Triton kernels of ``qerl.kernels`` run: one availability check and one switch for all of them.

Every fast path in qerl (the FP4 GEMMs of ``fp4_gemm``, the fused decode-step kernels that
``qerl.kernels.step_kernels()`` returns) asks ``available(x)``; everything else falls back to ``qerl.kernels.reference``, the
plain-torch code each kernel is tested against. ``QERL_TRITON=0`` forces the reference everywhere
(debugging, A/B timing). CPU installs without Triton never import a Triton module.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
#: Set to 0 to run the plain-torch reference instead of every Triton kernel.
ENV_SWITCH = "QERL_TRITON"
#: Split-K tickets shared by every kernel that reduces partials across programs: one int32 counter per
#: output tile or row, zero between launches (the program that draws the last ticket resets it), so
#: kernels on one stream can share the table. Allocated once per device, before any CUDA-graph capture.
MAX_TICKETS = 1 << 20
_TICKETS: dict[torch.device, torch.Tensor] = {}


@cache
def enabled() -> bool:
    """Triton is installed and not switched off (read once)."""
    return HAS_TRITON and os.environ.get(ENV_SWITCH, "1") != "0"


def serves(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on ``device`` (dtype rules are each op's own)."""
    return device.type == "cuda" and enabled()


def available(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve tensors on ``x``'s device (``serves``)."""
    return serves(x.device)


def tickets(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed ticket table; ``needed`` counters must fit in it. The first call must come
    from an eager launch (any warm-up or prefill does), not from inside a CUDA-graph capture."""
    if needed > MAX_TICKETS:
        raise ValueError(f"a split-K launch over {needed} tiles or rows exceeds the ticket table ({MAX_TICKETS})")
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)
    return _TICKETS[device]
