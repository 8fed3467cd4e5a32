"""The dequantize kernel: dense ``W_hat`` ``[N, K]`` in bf16/fp16 from the packed NVFP4 weight in one pass, the same
numbers as ``nvfp4.dequantize`` (e2m1 * (fp8 scale / global scale) in fp32, rounded once to the output dtype).
The FP4 linear's forward above ``schedule.DECODE_MAX_M`` rows and its grad_x above ``schedule.FUSED_BWD_MAX_M``
run it, then cuBLAS (``fp4_gemm``).

H200, 7B down_proj (docs/kernels.md, kernels table): 38.2 MB read + 135.8 MB written in 54-61 us (2.9-3.2 TB/s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.nvfp4 import NVFP4Tensors

from .fp4_base import as_words, check_dtype, check_weight


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    g_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    BN: tl.constexpr,
    BW: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[N, K] = W_hat in out's dtype: e2m1 * (fp8 scale / g) in fp32, rounded once (as nvfp4.dequantize).

    A [BN, BW, 8] tile (BW int32 words of 8 codes per row): each thread owns whole words, decodes
    the 8 codes with plain integer ops and stores them as one 16-byte vector, so the pass is bound by
    its 2.56 bytes/weight of traffic (0.56 read + 2 written), not by the decode.
    """
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    wcol = tl.program_id(1) * BW + tl.arange(0, BW)
    i = tl.arange(0, 8)
    mask_n = offs_n < N
    if EVEN_K:
        mask_w = mask_n[:, None]
    else:
        mask_w = mask_n[:, None] & (wcol[None, :] < K // 8)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + wcol[None, :], mask=mask_w, other=0)
    scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + (wcol // 2)[None, :], mask=mask_w, other=0.0)
    step = scale.to(tl.float32) / tl.load(g_ptr)
    code = words[:, :, None] >> (4 * i)[None, None, :]
    # Sign to bit 31, magnitude bits (e1 e0 m) to the low two exponent bits + top mantissa bit: the
    # fp32 number e2m1 * 2^-126 (0.5 is a subnormal, kept: Triton's fp32 multiply does not flush);
    # the exact * 2^126 restores e2m1, then one rounding in * step as in nvfp4.dequantize.
    bits = ((code << 28) & -0x80000000) | ((code << 22) & 0x01C00000)
    val = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37 * step[:, :, None]
    cols = wcol[None, :, None] * 8 + i[None, None, :]
    ptrs = out_ptr + offs_n[:, None, None] * stride_on + cols
    tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=mask_w[:, :, None])


def dequantize(
    weight: NVFP4Tensors, dtype: torch.dtype = torch.bfloat16, block: tuple[int, int, int] = (8, 128, 4)
) -> torch.Tensor:
    """Dense W_hat [N, K] in bf16/fp16 on the GPU (one pass: 0.5625 B/weight read, 2 B written).

    ``block`` = (rows, int32 words of 8 codes per row, warps) of one program.
    """
    N, K = check_weight(weight)
    check_dtype(dtype, "dequantize dtype")
    out = torch.empty((N, K), dtype=dtype, device=weight.weight_packed.device)
    packed = as_words(weight.weight_packed)
    weight_scale = weight.weight_scale
    BN, BW, warps = block
    _dequant_kernel[(triton.cdiv(N, BN), triton.cdiv(K // 8, BW))](
        packed,
        weight_scale,
        weight.weight_global_scale,
        out,
        N,
        K,
        packed.stride(0),
        weight_scale.stride(0),
        out.stride(0),
        BN=BN,
        BW=BW,
        EVEN_K=(K // 8) % BW == 0,
        num_warps=warps,
    )
    return out
