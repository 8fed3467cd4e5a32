"""The FP4 GEMM dispatcher: which NVFP4 x BF16/FP16 kernel runs a GEMM of a given shape, and the checks of its operands.

Callers (``ops``, ``nvfp4_group_decode``, the benchmarks) reach every FP4 kernel through ``matmul`` (the forward,
with the rollout engine's bias, LoRA-expand and segmented-layout epilogue) and ``matmul_t`` (grad_x); the kernels
sit one family a module below it:

* decode-sized M (<= ``schedule.DECODE_MAX_M``): on Hopper, for x in the Gluon K order (``fp4_base.nibble_major``),
  ``fp4_direct`` (mma.sync, up to ``schedule.DIRECT_MAX_M`` rows) or ``fp4_gluon`` (TMA/wgmma, above
  ``schedule.GLUON_MIN_M`` rows, above ``DIRECT_MAX_M`` for GEMMs of at least ``schedule.GLUON_MIN_WEIGHTS`` weights,
  at any row count for those ``fp4_direct.refills``): ``gluon_takes``; everything else ``fp4_decode`` (Triton);
* larger M: ``fp4_dequant.dequantize`` once into a transient bf16/fp16 copy, then cuBLAS;
* grad_x: ``fp4_backward`` up to ``schedule.FUSED_BWD_MAX_M`` rows, dequantize + cuBLAS above.

H200, 7B down_proj (N=3584, K=18944), benchmarks/results/kernels.json: M=1 2.15x of bf16 cuBLAS (``fp4_direct``),
M=16 1.86x (``fp4_decode``), M=64 1.32x (``fp4_gluon``); M=1024 fwd 0.73x / bwd 0.75x; M=4096 0.94x / 0.93x.
"""

from __future__ import annotations

import torch

from . import fp4_backward, fp4_decode, reference, schedule
from .fp4_base import check_act, check_weight
from .fp4_dequant import dequantize
from .schedule import DECODE_MAX_M, FUSED_BWD_MAX_M, Config, DecodeConfig

try:  # the Gluon kernels need Gluon's Hopper API (Triton 3.5 and later); without it the Triton kernel serves
    from . import fp4_direct, fp4_gluon
except ImportError:
    HAS_GLUON = False
else:
    HAS_GLUON = True


def matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora_u: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    out_bounds: tuple[int, int] | None = None,
    lora_bounds: tuple[int, int] | None = None,
    x_permuted: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """y = x @ W_hat^T (+ bias) (+ lora_scale * lora_u @ lora_b^T) for 2-D bf16/fp16 x on CUDA.

    Decode-sized M (<= DECODE_MAX_M) takes ``fp4_decode`` (one launch, split-K), or a Gluon kernel
    where ``gluon_takes`` (``fp4_direct`` only for an x already in its K order). Larger M
    dequantizes the weight once into a transient bf16/fp16 copy and calls cuBLAS. An explicit
    ``DecodeConfig`` sets the decode kernel's schedule (M <= DECODE_MAX_M only). ``out`` (a
    contiguous [M, N] tensor of x's dtype) lets tests hand in a poisoned buffer.

    ``out_bounds`` returns y as a flat ``[M * N]`` buffer in the segmented layout (``segmented``:
    output columns split at the two bounds, each block a contiguous ``[M, len]``); ``lora_bounds``
    says ``lora_u`` is such a flat ``[M * r]`` buffer (as the rollout's fused shrinks write it).
    ``x_permuted``: x is in the Gluon kernels' K order (``nibble_major``); only for GEMMs ``gluon_takes``.
    ``pdl``: the Gluon kernels launch with programmatic dependent launch where ``pdl.gemm_launch`` allows it
    (``qerl/kernels/pdl.py``); the caller vouches that no kernel still in flight writes the weight (a model's frozen
    base weights).
    """
    check_act(x)
    N, K = check_weight(weight_packed, weight_scale)
    M = x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}] for this weight, got {tuple(x.shape)}")
    x = x.contiguous()
    has_lora = lora_u is not None
    if has_lora:
        rank = lora_b.shape[1] if lora_b is not None else -1
        u_shape = (M * rank,) if lora_bounds is not None else (M, rank)
        if lora_b is None or lora_b.shape[0] != N or tuple(lora_u.shape) != u_shape:
            raise ValueError(
                f"LoRA epilogue needs lora_u {'[M*r]' if lora_bounds else '[M, r]'} (M={M}) and lora_B [N={N}, r], "
                f"got {tuple(lora_u.shape)} and {None if lora_b is None else tuple(lora_b.shape)}"
            )
        lora_u = lora_u.contiguous()
        lora_b = lora_b.contiguous()
    if M > DECODE_MAX_M:
        if config is not None:
            raise ValueError(f"the decode kernel takes M <= {DECODE_MAX_M}, got {M}")
        # Large M: one dequantize pass + cuBLAS beats the fused kernels measured (docs/kernels.md).
        y = torch.nn.functional.linear(x, dequantize(weight_packed, weight_scale, weight_global_scale, x.dtype), bias)
        if has_lora:
            u = lora_u if lora_bounds is None else reference.unsegment(lora_u, M, lora_bounds, rank)
            y = y + lora_scale * (u.to(x.dtype) @ lora_b.to(x.dtype).t())
        if out_bounds is not None:
            return reference.segment(y, out_bounds)
        return y if out is None else out.copy_(y)
    if config is None and gluon_takes(M, N, K, x.dtype, x.device):
        if _tma_rows(M, N, K, x.device):  # gluon_takes's first case
            return fp4_gluon.matmul(
                x,
                weight_packed,
                weight_scale,
                weight_global_scale,
                bias,
                lora_u,
                lora_b,
                lora_scale,
                out,
                out_bounds,
                lora_bounds,
                permuted=x_permuted,
                pdl=pdl,
            )
        if x_permuted:
            return fp4_direct.matmul(
                x,
                weight_packed,
                weight_scale,
                weight_global_scale,
                bias,
                lora_u,
                lora_b,
                lora_scale,
                out,
                out_bounds,
                lora_bounds,
                pdl=pdl,
            )
    elif x_permuted:
        raise ValueError(
            f"x in the Gluon kernels' K order (x_permuted) needs a GEMM gluon_takes, got M={M}, K={K}, "
            f"{x.dtype}, config={config}"
        )
    return fp4_decode.matmul(
        x,
        weight_packed,
        weight_scale,
        weight_global_scale,
        bias,
        lora_u,
        lora_b,
        lora_scale,
        out,
        config,
        out_bounds,
        lora_bounds,
    )


def _tma_rows(M: int, N: int, K: int, device: torch.device) -> bool:
    """Whether the TMA/wgmma kernel is the Gluon kernel for this many rows of this GEMM (``gluon_takes``)."""
    if not schedule.GLUON_DECODE:
        return False
    if M > schedule.GLUON_MIN_M or (M > schedule.DIRECT_MAX_M and N * K >= schedule.GLUON_MIN_WEIGHTS):
        return True
    if M > schedule.DIRECT_MAX_M or not schedule.DIRECT_DECODE or schedule.DIRECT_RING:
        return False
    return fp4_direct.refills(N, K, device)


def gluon_takes(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``matmul`` runs an [M, K] x [K, N] decode GEMM on a Gluon kernel that reads x in its K order
    (``nibble_major``), so the op producing x should write it so (the rollout engine asks this):

    * above ``GLUON_MIN_M`` rows, from ``DIRECT_MAX_M + 1`` rows for GEMMs of at least ``GLUON_MIN_WEIGHTS``
      weights, and at fewer rows for GEMMs whose split-K slices the mma.sync kernel would stream through its
      x ring (``fp4_direct.refills``: the 32B down), the TMA/wgmma kernel (``fp4_gluon``,
      ``schedule.GLUON_DECODE``: sm_90, bf16, M <= 128, whole 256-code K steps); ``matmul`` permutes an x that is
      not in that order itself;
    * at most ``DIRECT_MAX_M`` rows the register-only ``mma.sync`` kernel (``fp4_direct``,
      ``schedule.DIRECT_DECODE``), for an x already in that order (``x_permuted``); an x in natural order
      takes ``fp4_decode`` (a direct kernel reading natural order was 2% faster at M=1 but ~48% slower at
      M=8: docs/kernels.md#direct-max-m).

    False without a Triton that has Gluon."""
    if not HAS_GLUON:
        return False
    if _tma_rows(M, N, K, device):
        return fp4_gluon.supports(M, K, dtype, device)
    if schedule.DIRECT_DECODE and M <= schedule.DIRECT_MAX_M:
        return fp4_direct.supports(M, K, dtype, device)
    return False


def matmul_t(
    grad_y: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """grad_x = grad_y @ W_hat for 2-D bf16/fp16 grad_y [M, N]; returns [M, K].

    The fused kernel (``fp4_backward``) for M <= FUSED_BWD_MAX_M or an explicit ``config``, dequantize + cuBLAS above.
    """
    N, K = check_weight(weight_packed, weight_scale)
    check_act(grad_y, "grad_y")
    if grad_y.shape[1] != N:
        raise ValueError(f"grad_y must be [M, {N}], got {tuple(grad_y.shape)}")
    M = grad_y.shape[0]
    grad_y = grad_y.contiguous()
    if config is None and M > FUSED_BWD_MAX_M:
        gx = grad_y @ dequantize(weight_packed, weight_scale, weight_global_scale, grad_y.dtype)
        return gx if out is None else out.copy_(gx)
    return fp4_backward.matmul_t(grad_y, weight_packed, weight_scale, weight_global_scale, out, config)
