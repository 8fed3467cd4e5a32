"""FP4 x BF16 matmul: the one seam between ``NVFP4Linear`` and the kernels behind it.

``nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias)`` computes
``x @ W_hat.T + bias`` with gradients to ``x`` and ``bias`` only (the packed weight is frozen).

On CPU, and wherever the Triton kernels are unavailable, it dequantizes and calls ``F.linear``:
the reference path that every fast path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl import nvfp4


def reference_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize to x's dtype, then a plain matmul. Autograd flows to x and bias."""
    w = nvfp4.dequantize(weight_packed, weight_scale, weight_global_scale, dtype=x.dtype)
    return F.linear(x, w, bias)


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W).T + bias, through the fastest path available for x's device."""
    return reference_linear(x, weight_packed, weight_scale, weight_global_scale, bias)
