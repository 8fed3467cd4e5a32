"""The fused grad_x GEMM of the FP4 linear's backward (``grad_x = grad_y @ W_hat``, M <= ``schedule.FUSED_BWD_MAX_M``):
tiles of wgmma on int32 words of the packed weight, two codes per 32-bit shift/mask (``_code_pair``) and two
half-tile dots. ``fp4_gemm.matmul_t`` runs it at training-sized M up to that bound and dequantize + cuBLAS above.

H200, 7B down_proj, benchmarks/results/kernels.json: M=1024 0.75x, M=4096 0.93x of bf16 cuBLAS (those M take the
dequantize path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.nvfp4 import NVFP4Tensors

from .fp4_base import as_words
from .schedule import Config, bwd_config


@triton.jit
def _code_pair(words, shift: tl.constexpr, MAG_SHIFT: tl.constexpr, MAG_MASK: tl.constexpr, DT: tl.constexpr):
    """Codes at bits 15..12 and 31..28 of ``words << shift`` as two scaled-down floats (bitcasts)."""
    v = words << shift
    # -0x7FFF8000 is 0x80008000 as an int32: the two sign bits.
    p = (v & -0x7FFF8000) | ((v >> MAG_SHIFT) & MAG_MASK)
    lo = p.to(tl.int16).to(DT, bitcast=True)
    hi = (p >> 16).to(tl.int16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def _scaled(v, s, s32, MUL_F32: tl.constexpr):
    if MUL_F32:
        return (v.to(tl.float32) * s32).to(v.dtype)
    else:
        return v * s


@triton.jit
def _dequant_tile(words, scale, IS_FP16: tl.constexpr, MUL_F32: tl.constexpr):
    """int32 words [R, W] and their fp8 block scales [R, W/2] -> (lo, hi), each [R, 4W] in the act dtype.

    ``lo[:, 4j + i]`` is the weight at column ``8j + i`` of the tile, ``hi[:, 4j + i]`` the one at
    ``8j + 4 + i``, both equal to ``e2m1 * fp8_scale * 2^-8`` (exact).
    """
    R: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    if IS_FP16:
        DT: tl.constexpr = tl.float16
        MAG_SHIFT: tl.constexpr = 3
        MAG_MASK: tl.constexpr = 0x0E000E00
        FACTOR: tl.constexpr = 64.0  # 2^6: fp16 codes are e2m1 * 2^-14
    else:
        DT: tl.constexpr = tl.bfloat16
        MAG_SHIFT: tl.constexpr = 6
        MAG_MASK: tl.constexpr = 0x01C001C0
        FACTOR: tl.constexpr = 3.3230699894622896e35  # 2^118: bf16 codes are e2m1 * 2^-126
    s32 = scale.to(tl.float32) * FACTOR
    s32 = tl.reshape(tl.broadcast_to(s32[:, :, None], (R, W // 2, 2)), (R, W))  # one scale per word
    s = s32.to(DT)  # exact: 4 significant bits
    l0, h0 = _code_pair(words, 12, MAG_SHIFT, MAG_MASK, DT)
    l1, h1 = _code_pair(words, 8, MAG_SHIFT, MAG_MASK, DT)
    l2, h2 = _code_pair(words, 4, MAG_SHIFT, MAG_MASK, DT)
    l3, h3 = _code_pair(words, 0, MAG_SHIFT, MAG_MASK, DT)
    l0 = _scaled(l0, s, s32, MUL_F32)
    l1 = _scaled(l1, s, s32, MUL_F32)
    l2 = _scaled(l2, s, s32, MUL_F32)
    l3 = _scaled(l3, s, s32, MUL_F32)
    h0 = _scaled(h0, s, s32, MUL_F32)
    h1 = _scaled(h1, s, s32, MUL_F32)
    h2 = _scaled(h2, s, s32, MUL_F32)
    h3 = _scaled(h3, s, s32, MUL_F32)
    # join(join(c0, c2), join(c1, c3)) orders the last axis as 2*b + a = i.
    lo = tl.reshape(tl.join(tl.join(l0, l2), tl.join(l1, l3)), (R, 4 * W))
    hi = tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (R, 4 * W))
    return lo, hi


@triton.jit
def _half_cols(BK: tl.constexpr):
    """Tile columns held by the ``lo`` half tile, in its order: 8j + i for i < 4."""
    t = tl.arange(0, BK // 2)
    return (t // 4) * 8 + (t % 4)


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering of output tiles, so that consecutive programs share weight tiles in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _bwd_kernel(
    gy_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    gx_ptr,
    M,
    N,
    K,
    stride_gm,
    stride_wn,
    stride_sn,
    stride_xm,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IS_FP16: tl.constexpr,
    MUL_F32: tl.constexpr,
):
    """grad_x[M, K] = grad_y[M, N] @ W_hat[N, K]: tiles of BM x BK outputs, reduction over N in BN steps."""
    pid_m, pid_k = _tile_ids(M, K, BM, BK, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    kcol = pid_k * BK + _half_cols(BK)
    wcol = pid_k * (BK // 8) + tl.arange(0, BK // 8)
    scol = pid_k * (BK // 16) + tl.arange(0, BK // 16)
    acc_lo = tl.zeros((BM, BK // 2), dtype=tl.float32)
    acc_hi = tl.zeros((BM, BK // 2), dtype=tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < N
        gy = tl.load(
            gy_ptr + offs_m[:, None] * stride_gm + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.0
        )
        words = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + wcol[None, :],
            mask=mask_n[:, None] & (wcol[None, :] < K // 8),
            other=0,
        )
        scale = tl.load(
            s_ptr + offs_n[:, None] * stride_sn + scol[None, :],
            mask=mask_n[:, None] & (scol[None, :] < K // 16),
            other=0.0,
        )
        w_lo, w_hi = _dequant_tile(words, scale, IS_FP16, MUL_F32)
        acc_lo = tl.dot(gy, w_lo, acc_lo)
        acc_hi = tl.dot(gy, w_hi, acc_hi)
    c = 256.0 / tl.load(g_ptr)
    rows = gx_ptr + offs_m[:, None] * stride_xm
    dt = gx_ptr.dtype.element_ty
    tl.store(rows + kcol[None, :], (acc_lo * c).to(dt), mask=mask_m[:, None] & (kcol[None, :] < K))
    tl.store(rows + (kcol + 4)[None, :], (acc_hi * c).to(dt), mask=mask_m[:, None] & (kcol[None, :] + 4 < K))


def matmul_t(
    grad_y: torch.Tensor, weight: NVFP4Tensors, *, out: torch.Tensor | None, config: Config | None
) -> torch.Tensor:
    """grad_x ``[M, K]`` = grad_y ``[M, N]`` @ W_hat on ``_bwd_kernel``, for operands ``fp4_gemm.matmul_t`` has checked
    (grad_y contiguous); ``config`` (None: ``bwd_config``'s choice) sets the tiles."""
    M, N = grad_y.shape
    K = 2 * weight.weight_packed.shape[1]
    gx = torch.empty((M, K), dtype=grad_y.dtype, device=grad_y.device) if out is None else out
    if M == 0:
        return gx
    cfg = config or bwd_config(M, N, K)
    packed = as_words(weight.weight_packed)
    weight_scale = weight.weight_scale
    grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(K, cfg.BK),)
    _bwd_kernel[grid](
        grad_y,
        packed,
        weight_scale,
        weight.weight_global_scale,
        gx,
        M,
        N,
        K,
        grad_y.stride(0),
        packed.stride(0),
        weight_scale.stride(0),
        gx.stride(0),
        BM=cfg.BM,
        BN=cfg.BN,
        BK=cfg.BK,
        GROUP_M=cfg.group_m,
        IS_FP16=grad_y.dtype == torch.float16,
        MUL_F32=cfg.mul_f32,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return gx
