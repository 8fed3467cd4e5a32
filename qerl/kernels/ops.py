"""torch.library custom ops over the NVFP4 GEMMs, so torch.compile and CUDA graphs see opaque ops.

* ``qerl::nvfp4_mm(x, packed, scale, gscale, bias?, lora_u?, lora_b?, lora_scale) -> y`` (2-D x; the weight and
  epilogue objects of ``fp4_gemm.matmul`` as the plain tensors an op schema takes):
  ``x @ W_hat^T + bias + lora_scale * lora_u @ lora_b^T``; the decode path (M <= 128, split-K) and the
  prefill path are picked inside by M; the LoRA expand rides in the kernel's epilogue.
* ``qerl::nvfp4_mm_t(grad_y, packed, scale, gscale) -> grad_x`` (``grad_y @ W_hat``).

Both run the Triton kernels for bf16/fp16 CUDA tensors and the dequantize-then-matmul reference
everywhere else (CPU, fp32), so the ops are callable on any device. ``nvfp4_mm`` has an autograd
formula: gradients reach x, bias and the LoRA operands, never the packed weight.
"""

from __future__ import annotations

import torch

from qerl.kernels import backend, reference
from qerl.kernels.epilogue import Epilogue
from qerl.nvfp4 import NVFP4Tensors


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton FP4 kernels serve this activation (``backend.available`` and bf16/fp16)."""
    return backend.available(x) and x.dtype in (torch.bfloat16, torch.float16)


@torch.library.custom_op("qerl::nvfp4_mm", mutates_args=())
def nvfp4_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    gscale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora_u: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """The op's schema takes tensors only, so the weight and epilogue objects are taken apart here, and only here
    (``qerl.kernels.nvfp4_forward`` does it), and put back together for the kernels."""
    weight = NVFP4Tensors(packed, scale, gscale)
    epilogue = Epilogue(bias, lora_u, lora_b, lora_scale)
    if use_triton(x):
        from qerl.kernels import fp4_gemm

        return fp4_gemm.matmul(x, weight, epilogue=epilogue)
    return reference.mm(x, weight, epilogue)


@nvfp4_mm.register_fake
def _(x, packed, *_):
    return x.new_empty((x.shape[0], packed.shape[0]))


@torch.library.custom_op("qerl::nvfp4_mm_t", mutates_args=())
def nvfp4_mm_t(grad_y: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    weight = NVFP4Tensors(packed, scale, gscale)
    if use_triton(grad_y):
        from qerl.kernels import fp4_gemm

        return fp4_gemm.matmul_t(grad_y, weight)
    return reference.mm_t(grad_y, weight)


@nvfp4_mm_t.register_fake
def _(grad_y, packed, *_):
    return grad_y.new_empty((grad_y.shape[0], 2 * packed.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    x, packed, scale, gscale, bias, lora_u, lora_b, lora_scale = inputs
    ctx.save_for_backward(packed, scale, gscale, lora_u, lora_b)
    ctx.lora_scale = lora_scale
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    packed, scale, gscale, lora_u, lora_b = ctx.saved_tensors
    # needs_input_grad only covers the arguments actually passed; defaulted trailing ones need none.
    need = tuple(ctx.needs_input_grad) + (False,) * 8
    grad_x = nvfp4_mm_t(grad.contiguous(), packed, scale, gscale) if need[0] else None
    grad_bias = grad.sum(0).to(ctx.bias_dtype) if need[4] else None
    grad_u = (ctx.lora_scale * (grad @ lora_b.to(grad.dtype))).to(lora_u.dtype) if need[5] else None
    grad_b = (ctx.lora_scale * (grad.t() @ lora_u.to(grad.dtype))).to(lora_b.dtype) if need[6] else None
    return grad_x, None, None, None, grad_bias, grad_u, grad_b, None


nvfp4_mm.register_autograd(_backward, setup_context=_setup_context)
