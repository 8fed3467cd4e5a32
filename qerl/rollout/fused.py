"""Dispatch to the Triton kernels of ``triton_ops`` when they can run; otherwise say no.

Kept apart from ``triton_ops`` so that CPU installs without Triton never import it. The kernel
helper's NVFP4 decode op (``qerl.kernels.nvfp4_decode``, with an optional LoRA-expand epilogue) is
looked up here too, so that ``ops.project`` has one place to ask.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from types import ModuleType

import torch

from qerl import kernels

#: Set QERL_ROLLOUT_TRITON=0 to force the plain-torch ops (debugging, A/B timing).
ENV_SWITCH = "QERL_ROLLOUT_TRITON"


@cache
def _triton_ops() -> ModuleType | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        from qerl.rollout import triton_ops
    except ImportError:
        return None
    return triton_ops


def available(x: torch.Tensor) -> bool:
    """True when ``x`` lives on a GPU and the Triton kernels import."""
    return x.is_cuda and _triton_ops() is not None


def kernels_module() -> ModuleType:
    ops = _triton_ops()
    if ops is None:
        raise RuntimeError("qerl.rollout.fused: Triton kernels are unavailable; check available() first")
    return ops


def nvfp4_lora_op(x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The FP4 decode op with a LoRA-expand epilogue, when qerl.kernels provides one for x's device.

    Expected signature: ``nvfp4_decode(x, packed, scale, gscale, bias, lora_u, lora_b) -> y`` with
    ``y = x @ W_hat.T + bias + lora_u @ lora_b.T`` (``lora_b`` already holds the LoRA scaling).
    """
    op = getattr(kernels, "nvfp4_decode", None)
    if op is None or not x.is_cuda:
        return None
    return op
