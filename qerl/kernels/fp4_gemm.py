"""Triton NVFP4 x BF16/FP16 GEMMs on the checkpoint layout (no repack), for Hopper-class GPUs.

Hopper has no FP4 tensor cores, so every kernel here streams the packed weight as it sits in the
checkpoint (``weight_packed`` u8 ``[N, K/2]``, ``weight_scale`` fp8 ``[N, K/16]``), decodes it in
registers and feeds bf16/fp16 ``tl.dot`` (wgmma).

Kernels:
* ``_decode_kernel`` (M <= 128, the rollout path): y^T = W_hat @ x^T with the weight as the wgmma
  A operand in registers and the tokens padded to 16..128 as its N dim; the packed row is read as
  int16 elements of 4 codes, and a 3-instruction PTX snippet (``_nibble_asm``, via
  ``tl.inline_asm_elementwise(pack=2)``; 4 for fp16) turns nibble i of two elements into one bf16x2 pair
  ``e2m1 * 2^-126``; one packed multiply by the fp8 block scale * 2^118 makes the exact
  ``e2m1 * scale * 2^-8``. Because the decode is a unary elementwise op, Triton hoists the
  dot-operand conversion above it: words go global -> shared (cp.async, pipelined) -> registers
  (ldmatrix) and the decoded weights never touch shared memory. About 4 SASS instructions per
  weight in the main loop (before the 3-instruction decode). Split-K with an
  atomic ticket per tile: one launch, CUDA-graph safe; the split count from a model of waves of
  resident programs (``decode_split``).
* ``_bwd_kernel`` (grad_x for M <= 64): fused wgmma tiles on int32 words (two codes per 32-bit
  shift/mask, two half-tile dots).
* ``_dequant_kernel``: dense ``W_hat`` in bf16/fp16, 8 codes per thread -> one 16-byte store,
  bitwise equal to ``nvfp4.dequantize``; the forward above M = 128 and grad_x above M = 64 run it
  + cuBLAS.

On Hopper, ``matmul`` hands decode GEMMs whose x comes in the Gluon K order (``nibble_major``) to Gluon
kernels instead (``gluon_takes``): ``fp4_direct`` up to 8 rows, ``fp4_gluon`` from 17 (from 9 for GEMMs of at
least ``schedule.GLUON_MIN_WEIGHTS`` weights, from 1 for those ``fp4_direct.refills``).

Floors and measurements are in ``benchmarks/NOTES.md`` (``## Kernels``). H200, 7B down_proj
(N=3584, K=18944), benchmarks/results/kernels.json (2026-12-01 19:50): M=16 (this module's decode kernel)
1.86x of bf16 cuBLAS, 22.0 us against a 9.0 us floor (38.2 MB at 4.24 TB/s); M=1 2.15x (``fp4_direct``), M=64
1.32x (``fp4_gluon``; 29.9 us, the same as 1.44x at 17:39 against a slower cuBLAS); M=1024 fwd 0.73x / bwd
0.75x; M=4096 0.94x / 0.93x of bf16. Nsight Compute of this
kernel at M=1: 4.3 instructions per weight, issue-bound (9.7 us of issue at one per cycle), 53% of cycles
issuing.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import backend, reference, schedule
from .schedule import DECODE_MAX_M, FUSED_BWD_MAX_M, Config, DecodeConfig, bwd_config, decode_config


@triton.jit
def segmented(col, row, rows, S1, S2, TOTAL):
    """Offset of element (row, col) of a ``[rows, TOTAL]`` matrix kept *segmented*: columns [0, S1),
    [S1, S2) and [S2, TOTAL) each stored as their own contiguous ``[rows, len]`` block, one after the
    other. With S1 = S2 = TOTAL this is plain row-major ``row * TOTAL + col``. The rollout engine's
    LoRA shrinks (``u``, split per projection) and the grouped decode's outputs (q/k/v, gate/up, each
    a contiguous tensor for the op that reads it) use this layout."""
    lo = tl.where(col < S1, 0, tl.where(col < S2, S1, S2))
    hi = tl.where(col < S1, S1, tl.where(col < S2, S2, TOTAL))
    return lo * rows + row * (hi - lo) + (col - lo)


@triton.jit
def nibble_major(offs):
    """Where element ``offs`` of a row-major activation goes in the Gluon decode kernel's x order
    (``reference.nibble_major``): within each 256-element K step, element 4j + i moves to i * 64 + j, so
    the x slice that meets nibble i of the packed weight is contiguous. Rows must be whole K steps
    (the row length a multiple of 256), so a flat offset maps as a column does. The producers of a
    decode GEMM's input write it in this order directly (``fused_step``, ``permute=True``)."""
    return offs - (offs & 255) + ((offs & 3) << 6) + ((offs >> 2) & 63)


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
    gy_ptr, w_ptr, s_ptr, g_ptr, gx_ptr, M, N, K, stride_gm, stride_wn, stride_sn, stride_xm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    IS_FP16: tl.constexpr, MUL_F32: tl.constexpr,
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
        gy = tl.load(gy_ptr + offs_m[:, None] * stride_gm + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + wcol[None, :], mask=mask_n[:, None] & (wcol[None, :] < K // 8), other=0)
        scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + scol[None, :], mask=mask_n[:, None] & (scol[None, :] < K // 16), other=0.0)
        w_lo, w_hi = _dequant_tile(words, scale, IS_FP16, MUL_F32)
        acc_lo = tl.dot(gy, w_lo, acc_lo)
        acc_hi = tl.dot(gy, w_hi, acc_hi)
    c = 256.0 / tl.load(g_ptr)
    rows = gx_ptr + offs_m[:, None] * stride_xm
    dt = gx_ptr.dtype.element_ty
    tl.store(rows + kcol[None, :], (acc_lo * c).to(dt), mask=mask_m[:, None] & (kcol[None, :] < K))
    tl.store(rows + (kcol + 4)[None, :], (acc_hi * c).to(dt), mask=mask_m[:, None] & (kcol[None, :] + 4 < K))


def _nibble_asm(i: int, fp16: bool, halves: bool = False) -> str:
    """PTX for nibble ``i`` of both 16-bit halves of ``$1`` -> a bf16x2 / fp16x2 pair in ``$0``; with ``halves``
    (bf16 only) the word is ``$2`` and the pair comes back as its two bf16 halves ``$0`` (low) and ``$1`` (high),
    for a caller that holds the word itself rather than two 16-bit elements (``fp4_direct``).

    Code bits ``4i..4i+3`` of a half are (magnitude e1 e0 m, sign s). The sign goes to bit 15 (31)
    and the magnitude to the low two exponent bits + top mantissa bit, so the half reads as
    ``e2m1 * 2^-126`` (bf16) or ``e2m1 * 2^-14`` (fp16), subnormals included.

    bf16: the code isolated, then one multiply by 2^a + 2^b writes two copies of it, one with the sign at
    bit 15 and one with the magnitude at bits 8..6 (the copies do not overlap, so the add carries nothing),
    and an AND keeps those bits: 3 instructions per pair + one shift shared by nibbles 2 and 3, 13 per 8
    weights against 15 for shifts (H200, decode_gluon_nibble_mul.json: the 7B decode GEMMs 5% faster at
    M = 1 / 8, 3% at M = 16 / 32). fp16: 2 shifts + 2 LOP3 per pair (its copies would overlap).
    """
    if not fp16:
        mask, mul = ("0x000F000F", 4096 + 64) if i % 2 == 0 else ("0x00F000F0", 256 + 4)
        word = "$2" if halves else "$1"
        src = f"shr.u32 t, {word}, 8;\nand.b32 t, t, " if i >= 2 else f"and.b32 t, {word}, "
        out = "and.b32 t, t, 0x81C081C0;\nmov.b32 {$0, $1}, t;" if halves else "and.b32 $0, t, 0x81C081C0;"
        return "{\n.reg .b32 t;\n" + src + f"{mask};\nmul.lo.u32 t, t, {mul};\n{out}\n}}"
    if halves:
        raise ValueError("_nibble_asm: halves is bf16 only")
    sign_shl = 12 - 4 * i
    mag_shift, mask = (9 - 4 * i, "0x0E000E00") if fp16 else (6 - 4 * i, "0x01C001C0")
    mag = f"shl.b32 m, $1, {mag_shift};" if mag_shift >= 0 else f"shr.u32 m, $1, {-mag_shift};"
    sign = f"shl.b32 s, $1, {sign_shl};" if sign_shl else "mov.b32 s, $1;"
    return "{\n.reg .b32 s, m;\n" + sign + "\n" + mag + f"\nand.b32 m, m, {mask};\nand.b32 s, s, 0x80008000;\nor.b32 $0, s, m;\n}}"

_NIB_BF16_0, _NIB_BF16_1, _NIB_BF16_2, _NIB_BF16_3 = (tl.constexpr(_nibble_asm(i, False)) for i in range(4))
_NIB_FP16_0, _NIB_FP16_1, _NIB_FP16_2, _NIB_FP16_3 = (tl.constexpr(_nibble_asm(i, True)) for i in range(4))


#: Under Triton's interpreter (CPU tests) ``_nibble`` computes the same bits with plain integer ops:
#: the interpreter cannot run inline PTX.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _nibble_plain(h, NIB: tl.constexpr, IS_FP16: tl.constexpr):
    """``_nibble_asm``'s bits with integer ops on the int16 elements (sign to bit 15, magnitude under it)."""
    sign = (h << (12 - 4 * NIB)) & -0x8000
    if IS_FP16:
        MAG: tl.constexpr = 9 - 4 * NIB
        MASK: tl.constexpr = 0x0E00
        DT: tl.constexpr = tl.float16
    else:
        MAG: tl.constexpr = 6 - 4 * NIB
        MASK: tl.constexpr = 0x01C0
        DT: tl.constexpr = tl.bfloat16
    if MAG >= 0:
        mag = (h << MAG) & MASK
    else:
        mag = (h >> -MAG) & MASK
    return (sign | mag).to(tl.int16).to(DT, bitcast=True)


@triton.jit
def _nibble(h, NIB: tl.constexpr, IS_FP16: tl.constexpr):
    """int16 tensor of packed codes (4 per element) -> its code ``NIB``, scaled down (_nibble_asm).

    A unary elementwise op, so Triton hoists the dot-operand layout conversion above it: the int16
    words go global -> shared (cp.async) -> registers in the wgmma A-operand layout, and the decoded
    bf16 pairs never touch shared memory.
    """
    if _INTERPRETED:
        return _nibble_plain(h, NIB, IS_FP16)
    if IS_FP16:
        if NIB == 0:
            asm: tl.constexpr = _NIB_FP16_0
        elif NIB == 1:
            asm: tl.constexpr = _NIB_FP16_1
        elif NIB == 2:
            asm: tl.constexpr = _NIB_FP16_2
        else:
            asm: tl.constexpr = _NIB_FP16_3
        return tl.inline_asm_elementwise(asm, "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
    else:
        if NIB == 0:
            asm: tl.constexpr = _NIB_BF16_0
        elif NIB == 1:
            asm: tl.constexpr = _NIB_BF16_1
        elif NIB == 2:
            asm: tl.constexpr = _NIB_BF16_2
        else:
            asm: tl.constexpr = _NIB_BF16_3
        return tl.inline_asm_elementwise(asm, "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _decode_kernel(
    x_ptr, h_ptr, s_ptr, g_ptr, bias_ptr, u_ptr, b_ptr, y_ptr, part_ptr, ticket_ptr,
    M, N, K, stride_xm, stride_hr, h_step, h_tile, stride_sr, s_step, s_tile, Y1, Y2, S1, S2, stride_bn, R,
    lora_scale, steps_per_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BR: tl.constexpr, IS_FP16: tl.constexpr, X_SPLIT: tl.constexpr,
):
    """Decode GEMM (M <= BM <= 128): y^T[N, M] = W_hat[N, K] @ x^T, split-K over program_id(1).

    Swapped operands: the weight tile is the wgmma A operand (registers, M-dim = BN rows of W) and
    the few tokens are the N-dim (BM >= 16, padded by masking), so the tensor cores do all
    multiply-adds and the per-weight cost is the decode alone. The packed row is read as int16
    elements of 4 codes; nibble ``i`` of element ``j`` is code ``4j + i``, so each K tile becomes
    four dots over ``BK/4`` elements (``W_i = nibble(h, i) * scale``, ``x_i[m, j] = x[m, 4j + i]``)
    with no reshape/join between the decode and the dot. The fp8 block scale (one per 4 elements)
    times 2^118 (2^6 for fp16) is exact in the act dtype, so ``W_i`` is the exact
    ``e2m1 * scale * 2^-8``; ``2^8 / g`` is applied to the fp32 result.

    ``y`` and the LoRA input ``u`` are in the :func:`segmented` layout (output columns split at Y1/Y2,
    rank columns at S1/S2; plain row-major when the bounds equal N and R): one launch over row-stacked
    q/k/v (or gate/up) weights hands each projection its own contiguous output.

    Weight addressing is three strides per tensor: row within the tile (``stride_hr``), K step
    (``h_step``) and tile (``h_tile``), so that another weight order can be tried without a new kernel
    (benchmarks/NOTES.md, sweeps 2-3, has the orders measured).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if IS_FP16:
        DT: tl.constexpr = tl.float16
        FACTOR: tl.constexpr = 64.0  # 2^6
    else:
        DT: tl.constexpr = tl.bfloat16
        FACTOR: tl.constexpr = 3.3230699894622896e35  # 2^118
    HW: tl.constexpr = BK // 4  # int16 elements per row and K tile
    G: tl.constexpr = BK // 16  # scale groups per row and K tile
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    mask_n = offs_n < N
    mask_m = offs_m < M
    hcol = tl.arange(0, HW)
    gcol = tl.arange(0, G)
    rows = tl.arange(0, BN)
    h_rows = h_ptr + pid_n.to(tl.int64) * h_tile + rows[:, None] * stride_hr
    s_rows = s_ptr + pid_n.to(tl.int64) * s_tile + rows[:, None] * stride_sr
    x_cols = x_ptr + offs_m[None, :] * stride_xm
    x_rows = x_ptr + offs_m[:, None] * stride_xm

    acc = tl.zeros((BN, BM), dtype=tl.float32)
    k_steps = tl.cdiv(K, BK)
    first = pid_k * steps_per_split
    for step in range(0, tl.minimum(steps_per_split, k_steps - first)):
        kt = first + step
        k0 = kt * BK
        h_ptrs = h_rows + kt * h_step + hcol[None, :]
        s_ptrs = s_rows + kt * s_step + gcol[None, :]
        if EVEN_K:
            h = tl.load(h_ptrs, mask=mask_n[:, None], other=0)
            sc = tl.load(s_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            h = tl.load(h_ptrs, mask=mask_n[:, None] & (k0 // 4 + hcol[None, :] < K // 4), other=0)
            sc = tl.load(s_ptrs, mask=mask_n[:, None] & (k0 // 16 + gcol[None, :] < K // 16), other=0.0)
        s = (sc.to(tl.float32) * FACTOR).to(DT)
        # Scale in the compact [BN, G] tile, then broadcast to the 4 elements of its group: Triton
        # gives the load a layout in which broadcast + reshape land on the dot-operand layout.
        sb = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, G, 4)), (BN, HW))
        if X_SPLIT:
            # One contiguous [BM, BK] load, split in registers into the four strided slices.
            kx = k0 + tl.arange(0, BK)
            if EVEN_K:
                xs = tl.load(x_rows + kx[None, :], mask=mask_m[:, None], other=0.0)
            else:
                xs = tl.load(x_rows + kx[None, :], mask=mask_m[:, None] & (kx[None, :] < K), other=0.0)
            x02, x13 = tl.split(tl.reshape(xs, (BM, HW, 2, 2)))
            x0, x2 = tl.split(x02)
            x1, x3 = tl.split(x13)
            acc = tl.dot(_nibble(h, 0, IS_FP16) * sb, tl.trans(x0), acc)
            acc = tl.dot(_nibble(h, 1, IS_FP16) * sb, tl.trans(x1), acc)
            acc = tl.dot(_nibble(h, 2, IS_FP16) * sb, tl.trans(x2), acc)
            acc = tl.dot(_nibble(h, 3, IS_FP16) * sb, tl.trans(x3), acc)
        else:
            for i in tl.static_range(4):
                kx = k0 + 4 * hcol + i
                if EVEN_K:
                    xt = tl.load(x_cols + kx[:, None], mask=mask_m[None, :], other=0.0)
                else:
                    xt = tl.load(x_cols + kx[:, None], mask=mask_m[None, :] & (kx[:, None] < K), other=0.0)
                acc = tl.dot(_nibble(h, i, IS_FP16) * sb, xt, acc)

    tile_nm = offs_m[None, :] * N + offs_n[:, None]
    mask_nm = mask_n[:, None] & mask_m[None, :]
    if SPLIT:
        # Publish this fp32 partial, take a ticket; the program that draws the tile's last ticket
        # sums all partials (L2 reads, .cg), runs the epilogue and resets the ticket, so stream
        # order guarantees the tickets are back at zero for the next launch.
        nsplit = tl.num_programs(1)
        tl.store(part_ptr + pid_k * M * N + tile_nm, acc, mask=mask_nm)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
        if ticket == nsplit - 1:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for s_ in range(0, nsplit):
                acc += tl.load(part_ptr + s_ * M * N + tile_nm, mask=mask_nm, other=0.0, cache_modifier=".cg")
            tl.store(ticket_ptr + pid_n, 0)
            _decode_epilogue(acc, g_ptr, offs_m, offs_n, mask_m, mask_n, M, N, y_ptr, Y1, Y2, bias_ptr, u_ptr, S1, S2,
                             b_ptr, stride_bn, R, lora_scale, HAS_BIAS, HAS_LORA, BR)
    else:
        _decode_epilogue(acc, g_ptr, offs_m, offs_n, mask_m, mask_n, M, N, y_ptr, Y1, Y2, bias_ptr, u_ptr, S1, S2,
                         b_ptr, stride_bn, R, lora_scale, HAS_BIAS, HAS_LORA, BR)


@triton.jit
def _decode_epilogue(acc, g_ptr, offs_m, offs_n, mask_m, mask_n, M, N, y_ptr, Y1, Y2, bias_ptr, u_ptr, S1, S2,
                     b_ptr, stride_bn, R, lora_scale, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BR: tl.constexpr):
    """y[m, n] = acc[n, m] * 2^8 / g (+ bias[n]) (+ lora_scale * B[n] . u[m]), for the transposed tile;
    y and u segmented (:func:`segmented`)."""
    out = acc * (256.0 / tl.load(g_ptr))
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if HAS_LORA:
        r = tl.arange(0, BR)
        b = tl.load(b_ptr + offs_n[:, None] * stride_bn + r[None, :], mask=mask_n[:, None] & (r[None, :] < R), other=0.0)
        ut = tl.load(u_ptr + segmented(r[:, None], offs_m[None, :], M, S1, S2, R),
                     mask=mask_m[None, :] & (r[:, None] < R), other=0.0)
        dt = y_ptr.dtype.element_ty
        out += lora_scale * tl.dot(b.to(dt), ut.to(dt))
    tl.store(y_ptr + segmented(offs_n[:, None], offs_m[None, :], M, Y1, Y2, N), out.to(y_ptr.dtype.element_ty),
             mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                    BN: tl.constexpr, BW: tl.constexpr, EVEN_K: tl.constexpr):
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


# ----------------------------------------------------------------------------------------------
# Launchers


def _check_act(t: torch.Tensor, what: str = "activations") -> None:
    if t.dim() != 2:
        raise ValueError(f"nvfp4 kernels take 2-D {what}, got shape {tuple(t.shape)}")
    _check_dtype(t.dtype, what)


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4 kernels take bf16/fp16 {what}, got {dtype}")


def _check_weight(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a well-formed NVFP4 weight; a one-line error otherwise."""
    N, half_k = weight_packed.shape
    K = 2 * half_k
    if weight_packed.dtype != torch.uint8 or weight_scale.shape != (N, K // 16) or K % 16:
        raise ValueError(
            f"bad NVFP4 weight: packed {tuple(weight_packed.shape)} {weight_packed.dtype}, scale {tuple(weight_scale.shape)}; "
            "expected u8 [N, K/2] and fp8 [N, K/16] with K % 16 == 0"
        )
    return N, K


def _words(weight_packed: torch.Tensor) -> torch.Tensor:
    return weight_packed.contiguous().view(torch.int32)


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

    Decode-sized M (<= DECODE_MAX_M) takes ``_decode_kernel`` (one launch, split-K), or a Gluon kernel
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
    _check_act(x)
    N, K = _check_weight(weight_packed, weight_scale)
    M = x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}] for this weight, got {tuple(x.shape)}")
    x = x.contiguous()
    has_lora = lora_u is not None
    if has_lora:
        rank = lora_b.shape[1] if lora_b is not None else -1
        u_shape = (M * rank,) if lora_bounds is not None else (M, rank)
        if lora_b is None or lora_b.shape[0] != N or tuple(lora_u.shape) != u_shape:
            raise ValueError(f"LoRA epilogue needs lora_u {'[M*r]' if lora_bounds else '[M, r]'} (M={M}) and lora_B [N={N}, r], "
                             f"got {tuple(lora_u.shape)} and {None if lora_b is None else tuple(lora_b.shape)}")
        lora_u = lora_u.contiguous()
        lora_b = lora_b.contiguous()
    if M > DECODE_MAX_M:
        if config is not None:
            raise ValueError(f"the decode kernel takes M <= {DECODE_MAX_M}, got {M}")
        # Large M: one dequantize pass + cuBLAS beats the fused kernels measured so far (NOTES.md).
        y = torch.nn.functional.linear(x, dequantize(weight_packed, weight_scale, weight_global_scale, x.dtype), bias)
        if has_lora:
            u = lora_u if lora_bounds is None else reference.unsegment(lora_u, M, lora_bounds, rank)
            y = y + lora_scale * (u.to(x.dtype) @ lora_b.to(x.dtype).t())
        if out_bounds is not None:
            return reference.segment(y, out_bounds)
        return y if out is None else out.copy_(y)
    if config is None and gluon_takes(M, N, K, x.dtype, x.device):
        if _tma_rows(M, N, K, x.device):  # gluon_takes's first case
            from . import fp4_gluon  # imports this module: loaded on first use only

            return fp4_gluon.matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_u, lora_b, lora_scale,
                                    out, out_bounds, lora_bounds, permuted=x_permuted, pdl=pdl)  # fmt: skip
        if x_permuted:
            from . import fp4_direct

            return fp4_direct.matmul(x, weight_packed, weight_scale, weight_global_scale, bias, lora_u, lora_b, lora_scale,
                                     out, out_bounds, lora_bounds, pdl=pdl)  # fmt: skip
    elif x_permuted:
        raise ValueError(f"x in the Gluon kernels' K order (x_permuted) needs a GEMM gluon_takes, got M={M}, K={K}, "
                         f"{x.dtype}, config={config}")  # fmt: skip
    shape = (M, N) if out_bounds is None else (M * N,)
    y = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return y
    rank = lora_b.shape[1] if has_lora else 0
    lora_args = (lora_u if has_lora else y, lora_b if has_lora else y)
    y1, y2 = out_bounds or (N, N)
    s1, s2 = lora_bounds or (rank, rank)
    br = max(16, triton.next_power_of_2(rank))
    cfg = decode_config(M, N, K, x.device, config)
    k_steps = triton.cdiv(K, cfg.BK)
    steps_per_split = triton.cdiv(k_steps, cfg.split)
    split = triton.cdiv(k_steps, steps_per_split)
    tiles = triton.cdiv(N, cfg.BN)
    part, tickets = _split_buffers(split, tiles, M, N, x.device, y)
    h = weight_packed.contiguous().view(torch.int16)
    scale = weight_scale.contiguous()
    h_strides = (h.stride(0), cfg.BK // 4, cfg.BN * h.stride(0))  # (row, K step, tile)
    s_strides = (scale.stride(0), cfg.BK // 16, cfg.BN * scale.stride(0))
    _decode_kernel[(tiles, split)](
        x, h, scale, weight_global_scale, bias if bias is not None else y, *lora_args, y, part, tickets,
        M, N, K, x.stride(0), *h_strides, *s_strides, y1, y2, s1, s2, lora_b.stride(0) if has_lora else 0, rank,
        float(lora_scale), steps_per_split,
        BM=max(16, triton.next_power_of_2(M)), BN=cfg.BN, BK=cfg.BK, SPLIT=split > 1, EVEN_K=K % cfg.BK == 0,
        HAS_BIAS=bias is not None, HAS_LORA=has_lora, BR=br, IS_FP16=x.dtype == torch.float16,
        X_SPLIT=cfg.x_split, num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return y


def _split_buffers(split: int, tiles: int, M: int, N: int, device: torch.device, dummy: torch.Tensor):
    """fp32 partials [split, M, N] and the ticket table for a split-K launch (``dummy`` twice if split == 1)."""
    if split == 1:
        return dummy, dummy
    return torch.empty((split, M, N), dtype=torch.float32, device=device), backend.tickets(device, tiles)


def _tma_rows(M: int, N: int, K: int, device: torch.device) -> bool:
    """Whether the TMA/wgmma kernel is the Gluon kernel for this many rows of this GEMM (``gluon_takes``)."""
    if not schedule.GLUON_DECODE:
        return False
    if M > schedule.GLUON_MIN_M or (M > schedule.DIRECT_MAX_M and N * K >= schedule.GLUON_MIN_WEIGHTS):
        return True
    if M > schedule.DIRECT_MAX_M or not schedule.DIRECT_DECODE or schedule.DIRECT_RING:
        return False
    from . import fp4_direct

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
      takes ``_decode_kernel`` (a direct kernel reading natural order measured 2% faster at M=1 and ~48%
      slower at M=8, summed over the 7B GEMMs: NOTES.md, "A decode kernel without shared memory").

    False without a Triton that has Gluon."""
    if not _has_gluon():
        return False
    if _tma_rows(M, N, K, device):
        from . import fp4_gluon

        return fp4_gluon.supports(M, K, dtype, device)
    if schedule.DIRECT_DECODE and M <= schedule.DIRECT_MAX_M:
        from . import fp4_direct

        return fp4_direct.supports(M, K, dtype, device)
    return False


@functools.cache
def _has_gluon() -> bool:
    """Whether this Triton has Gluon's Hopper API (3.5 and later); without it the Triton kernel serves."""
    try:
        from . import fp4_gluon  # noqa: F401
    except ImportError:
        return False
    return True


def matmul_t(
    grad_y: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """grad_x = grad_y @ W_hat for 2-D bf16/fp16 grad_y [M, N]; returns [M, K].

    The fused kernel for M <= FUSED_BWD_MAX_M or an explicit ``config``, dequantize + cuBLAS above.
    """
    N, K = _check_weight(weight_packed, weight_scale)
    _check_act(grad_y, "grad_y")
    if grad_y.shape[1] != N:
        raise ValueError(f"grad_y must be [M, {N}], got {tuple(grad_y.shape)}")
    M = grad_y.shape[0]
    grad_y = grad_y.contiguous()
    if config is None and M > FUSED_BWD_MAX_M:
        gx = grad_y @ dequantize(weight_packed, weight_scale, weight_global_scale, grad_y.dtype)
        return gx if out is None else out.copy_(gx)
    gx = torch.empty((M, K), dtype=grad_y.dtype, device=grad_y.device) if out is None else out
    if M == 0:
        return gx
    cfg = config or bwd_config(M, N, K)
    words = _words(weight_packed)
    grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(K, cfg.BK),)
    _bwd_kernel[grid](
        grad_y, words, weight_scale, weight_global_scale, gx, M, N, K,
        grad_y.stride(0), words.stride(0), weight_scale.stride(0), gx.stride(0),
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.group_m, IS_FP16=grad_y.dtype == torch.float16,
        MUL_F32=cfg.mul_f32, num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return gx


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: tuple[int, int, int] = (8, 128, 4),
) -> torch.Tensor:
    """Dense W_hat [N, K] in bf16/fp16 on the GPU (one pass: 0.5625 B/weight read, 2 B written).

    ``block`` = (rows, int32 words of 8 codes per row, warps) of one program.
    """
    N, K = _check_weight(weight_packed, weight_scale)
    _check_dtype(dtype, "dequantize dtype")
    out = torch.empty((N, K), dtype=dtype, device=weight_packed.device)
    words = _words(weight_packed)
    BN, BW, warps = block
    _dequant_kernel[(triton.cdiv(N, BN), triton.cdiv(K // 8, BW))](
        words, weight_scale, weight_global_scale, out, N, K, words.stride(0), weight_scale.stride(0), out.stride(0),
        BN=BN, BW=BW, EVEN_K=(K // 8) % BW == 0, num_warps=warps,
    )
    return out
