"""The Gluon decode kernels' K order: the one layout module of the activations ``fp4_gluon`` and ``fp4_direct`` read.

Why: a packed int16 weight element holds 4 codes along K, and nibble ``i`` of element ``j`` of a 256-code K step
meets activation ``4j + i``. With x reordered within each step so that element ``4j + i`` sits at ``i * 64 + j``,
the x slice that meets nibble ``i`` is 64 contiguous values: the TMA tile feeds the wgmma (and the mma.sync
registers) as loaded. The rollout engine has the op producing a GEMM's input write it in this order (a ``gluon_k``
flag across ``qerl.kernels`` and ``qerl.rollout``: "x, or this output, is in the Gluon K order"), so no permute
launch runs per GEMM. The kernels write it through ``fp4_base.gluon_k_offsets``, the same map on flat offsets.

Plain torch: the rollout's layers import it on CPU installs without Triton.
"""

from __future__ import annotations

import torch

#: Codes per K step of the Gluon decode kernels (``fp4_gluon.BK``): the order permutes within such steps.
K_STEP = 256


def fits(k: int) -> bool:
    """Whether rows of ``k`` elements can be in the Gluon K order (whole K steps)."""
    return k % K_STEP == 0


def to_gluon_k(x: torch.Tensor) -> torch.Tensor:
    """x ``[..., K]`` (K whole steps) in the Gluon K order: within each 256-element step, element 4j + i moves to
    i * 64 + j."""
    *lead, k = x.shape
    return x.reshape(*lead, k // K_STEP, K_STEP // 4, 4).transpose(-1, -2).reshape(*lead, k).contiguous()
