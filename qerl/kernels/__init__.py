"""FP4 x BF16 matmul: the one seam between ``NVFP4Linear`` and the kernels behind it.

``nvfp4_linear(x, weight_packed, weight_scale, weight_global_scale, bias)`` computes
``x @ W_hat.T + bias`` with gradients to ``x`` and ``bias`` only (the packed weight is frozen).

On CUDA with bf16/fp16 activations it runs the Triton NVFP4 kernels through the custom op
``torch.ops.qerl.nvfp4_mm`` (``qerl/kernels/ops.py``; split-K Triton kernel for M <= 128, Triton
dequantize + cuBLAS above; ``grad_x`` in backward: a fused Triton kernel for M <= 64, dequantize +
cuBLAS above). On CPU, fp32, or without Triton it dequantizes and calls
``F.linear``: the reference path that every fast path is tested against.

``nvfp4_decode`` is the same op with an optional LoRA expand fused into its epilogue, for the
rollout engine: ``y = x @ W_hat.T + bias + lora_scale * lora_u @ lora_B.T`` where ``lora_u = x @ A.T``
is computed once per input (shared by q/k/v or gate/up).
"""

from __future__ import annotations

import itertools
from functools import cache
from types import ModuleType

import torch

from qerl.kernels import ops, reference


@cache
def step_kernels() -> ModuleType:
    """``qerl.kernels.fused_step``, the decode step's fused kernels, imported on first use: it needs Triton,
    and the package imports on CPU installs without it. (Here, on top, rather than in ``backend``, which the
    kernels themselves import.)"""
    from qerl.kernels import fused_step

    return fused_step


def nvfp4_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W).T + bias, through the fastest path available for x's device."""
    if not ops.use_triton(x):
        return reference.mm(x, weight_packed, weight_scale, weight_global_scale, bias)
    return nvfp4_decode(x, weight_packed, weight_scale, weight_global_scale, bias)


def nvfp4_decode(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora_u: torch.Tensor | None = None,
    lora_B: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """``x @ W_hat.T + bias + lora_scale * lora_u @ lora_B.T`` for x of shape ``[..., K]``.

    ``lora_u`` is ``[..., r]`` (same leading dims as x), ``lora_B`` is ``[N, r]``. Any device and
    dtype (the reference path serves what the kernels do not); differentiable in x, bias and the
    LoRA operands. On CUDA the LoRA term costs one tiny dot per output tile, not a launch.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    u2 = None if lora_u is None else lora_u.reshape(-1, lora_u.shape[-1])
    y = ops.nvfp4_mm(x2, weight_packed, weight_scale, weight_global_scale, bias, u2, lora_B, float(lora_scale))
    return y.reshape(*lead, weight_packed.shape[0])


def nvfp4_group_decode(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    splits: tuple[int, ...],
    lora_u: torch.Tensor | None = None,
    lora_bounds: tuple[int, int] | None = None,
    lora_B: torch.Tensor | None = None,
    x_permuted: bool = False,
    pdl: bool = False,
) -> list[torch.Tensor]:
    """One to three projections that read the same x and whose weights are stacked row-wise (``splits``
    rows each, one global scale): one launch instead of one per projection, each output a contiguous
    ``[..., N_j]`` tensor. For the rollout engine (no autograd). ``x_permuted``: x is in the Gluon
    decode kernel's K order (see ``gluon_order``). ``pdl``: the weights are frozen (no kernel in flight writes them), so
    the decode kernels may launch with programmatic dependent launch (``qerl/kernels/pdl.py``).

    Why: q/k/v and gate/up as separate launches cost the 7B decode step 27-42% more FP4-kernel time
    than the same GEMMs stacked (small k/v tiles, a partial last wave per launch; docs/kernels.md, "Where a
    b=64/128 step goes"). ``lora_u`` is ``[..., R]`` or, with ``lora_bounds``, the flat segmented
    buffer the fused shrinks write; ``lora_B`` ``[N, R]`` is block-diagonal (projection j's rows only
    see its own rank columns), so one epilogue dot applies every projection's expand.
    """
    n_rows = weight_packed.shape[0]
    if len(splits) not in (1, 2, 3) or sum(splits) != n_rows:
        raise ValueError(f"splits {splits} must be 1 to 3 row counts summing to the weight's {n_rows} rows")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    ends = [*itertools.accumulate(splits[:-1]), n_rows, n_rows]
    out_bounds = (ends[0], ends[1])
    u = lora_u if lora_u is None or lora_bounds is not None else lora_u.reshape(m, -1)
    if ops.use_triton(x2):
        from qerl.kernels import fp4_gemm

        flat = fp4_gemm.matmul(
            x2,
            weight_packed,
            weight_scale,
            weight_global_scale,
            bias,
            u,
            lora_B,
            out_bounds=out_bounds,
            lora_bounds=lora_bounds,
            x_permuted=x_permuted,
            pdl=pdl,
        )
    elif x_permuted:
        raise ValueError("x_permuted: the Gluon K order is for the CUDA decode kernels only")
    else:
        flat = reference.group_mm(
            x2, weight_packed, weight_scale, weight_global_scale, bias, out_bounds, u, lora_bounds, lora_B
        )
    outs, start = [], 0
    for n in splits:
        outs.append(flat[start * m : (start + n) * m].view(*lead, n))
        start += n
    return outs


def gluon_order(rows: int, n: int, k: int, x: torch.Tensor) -> bool:
    """Whether a decode GEMM over ``rows`` x ``k`` inputs of ``x``'s dtype and device to ``n`` outputs runs a Gluon kernel,
    which reads x in their K order (``fp4_base.nibble_major``; ``fp4_gemm.gluon_takes``): the rollout engine
    then has the op producing x write it so (``fused_step``, ``permute=True``) instead of permuting it per call."""
    if not ops.use_triton(x):
        return False
    from qerl.kernels import fp4_gemm

    return fp4_gemm.gluon_takes(rows, n, k, x.dtype, x.device)
