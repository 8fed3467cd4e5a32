"""FP4 x BF16 matmul: the one seam between ``NVFP4Linear`` and the kernels behind it.

``nvfp4_linear(x, weight, bias)`` (``weight`` an ``nvfp4.NVFP4Tensors``) computes ``x @ W_hat.T + bias`` with
gradients to ``x`` and ``bias`` only (the packed weight is frozen).

On CUDA with bf16/fp16 activations it runs the Triton NVFP4 kernels through the custom op
``torch.ops.qerl.nvfp4_mm`` (``qerl/kernels/ops.py``; split-K Triton kernel for M <= 128, Triton
dequantize + cuBLAS above; ``grad_x`` in backward: a fused Triton kernel for M <= 64, dequantize +
cuBLAS above). On CPU, fp32, or without Triton it dequantizes and calls
``F.linear``: the reference path that every fast path is tested against.

``nvfp4_forward`` is that op itself, the training forward's (``nvfp4_linear`` calls it on CUDA), with an optional
LoRA expand fused into its epilogue (an ``Epilogue``) for the rollout engine's per-projection forward:
``y = x @ W_hat.T + bias + lora_scale * lora_u @ lora_B.T`` where ``lora_u = x @ A.T`` is computed once per input
(shared by q/k/v or gate/up). ``nvfp4_group_decode`` is the rollout's stacked one-launch form (no autograd).
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import cache
from types import ModuleType

import torch

from qerl.kernels import backend, ops, reference
from qerl.kernels.epilogue import PLAIN, Epilogue
from qerl.nvfp4 import NVFP4Tensors


@cache
def step_kernels() -> ModuleType:
    """``qerl.kernels.fused_step``, the decode step's fused kernels, imported on first use: it needs Triton,
    and the package imports on CPU installs without it. (Here, on top, rather than in ``backend``, which the
    kernels themselves import.)"""
    from qerl.kernels import fused_step

    return fused_step


def nvfp4_linear(x: torch.Tensor, weight: NVFP4Tensors, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W).T + bias, through the fastest path available for x's device."""
    if not ops.use_triton(x):
        return reference.mm(x, weight, Epilogue(bias))
    return nvfp4_forward(x, weight, epilogue=Epilogue(bias))


def nvfp4_forward(x: torch.Tensor, weight: NVFP4Tensors, *, epilogue: Epilogue = PLAIN) -> torch.Tensor:
    """``x @ W_hat.T + bias + lora_scale * lora_u @ lora_b.T`` for x of shape ``[..., K]`` (``epilogue`` holds all
    but x and W; not segmented): the differentiable FP4 forward, the training forward's and the rollout's.

    ``lora_u`` is ``[..., r]`` (same leading dims as x), ``lora_b`` is ``[N, r]``. Any device and
    dtype (the reference path serves what the kernels do not); differentiable in x, bias and the
    LoRA operands. On CUDA the LoRA term costs one tiny dot per output tile, not a launch.
    """
    lead = x.shape[:-1]
    u = epilogue.lora_u
    y = ops.nvfp4_mm(
        x.reshape(-1, x.shape[-1]),
        weight.weight_packed,
        weight.weight_scale,
        weight.weight_global_scale,
        epilogue.bias,
        None if u is None else u.reshape(-1, u.shape[-1]),
        epilogue.lora_b,
        float(epilogue.lora_scale),
    )
    return y.reshape(*lead, weight.out_features)


def nvfp4_group_decode(
    x: torch.Tensor,
    weight: NVFP4Tensors,
    splits: tuple[int, ...],
    *,
    epilogue: Epilogue = PLAIN,
    gluon_k: bool = False,
    pdl: bool = False,
) -> list[torch.Tensor]:
    """One to three projections that read the same x and whose weights are stacked row-wise (``splits``
    rows each, one global scale): one launch instead of one per projection, each output a contiguous
    ``[..., N_j]`` tensor. For the rollout engine (no autograd). ``gluon_k``: x is in the Gluon K
    order (``gluon_layout``; see ``reads_gluon_k``). ``pdl``: the weights are frozen (no kernel in flight writes them), so
    the decode kernels may launch with programmatic dependent launch (``qerl/kernels/pdl.py``).

    Why: q/k/v and gate/up as separate launches cost the 7B decode step 27-42% more FP4-kernel time
    than the same GEMMs stacked (small k/v tiles, a partial last wave per launch; docs/kernels.md, "Where a
    b=64/128 step goes"). ``epilogue.lora_u`` is ``[..., R]`` or, with ``lora_bounds``, the flat segmented
    buffer the fused shrinks write; ``lora_b`` ``[N, R]`` is block-diagonal (projection j's rows only
    see its own rank columns), so one epilogue dot applies every projection's expand. The epilogue's
    ``out_bounds`` are set here, from ``splits``.
    """
    n_rows = weight.out_features
    if len(splits) not in (1, 2, 3) or sum(splits) != n_rows:
        raise ValueError(f"splits {splits} must be 1 to 3 row counts summing to the weight's {n_rows} rows")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    ends = [*itertools.accumulate(splits[:-1]), n_rows, n_rows]
    u = epilogue.lora_u
    if u is not None and epilogue.lora_bounds is None:
        u = u.reshape(m, -1)
    epilogue = dataclasses.replace(epilogue, lora_u=u, out_bounds=(ends[0], ends[1]))
    if ops.use_triton(x2):
        from qerl.kernels import fp4_gemm

        flat = fp4_gemm.matmul(x2, weight, epilogue=epilogue, gluon_k=gluon_k, pdl=pdl)
    elif gluon_k:
        raise ValueError("gluon_k: the Gluon K order is for the CUDA decode kernels only")
    else:
        flat = reference.mm(x2, weight, epilogue)
    outs, start = [], 0
    for n in splits:
        outs.append(flat[start * m : (start + n) * m].view(*lead, n))
        start += n
    return outs


def reads_gluon_k(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an [M, K] x [K, N] decode GEMM of ``dtype`` activations on ``device`` runs a Gluon kernel, which reads
    x in the Gluon K order (``gluon_layout``; ``fp4_gemm.gluon_kernel`` says which): a question about the GEMM's
    shape, for the rollout's step plan, which then has the op producing x write it so (``fused_step``,
    ``gluon_k=True``) instead of permuting it per call. False where the Triton kernels do not serve ``device``."""
    if not backend.serves(device):
        return False
    from qerl.kernels import fp4_gemm

    return fp4_gemm.gluon_kernel(M, N, K, dtype, device) is not None
