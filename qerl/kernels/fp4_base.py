"""What every NVFP4 kernel of ``qerl.kernels`` shares: the checkpoint's packed layout and its nibble decode, the
segmented and Gluon-K-order offsets (``gluon_layout`` is that order's host side), and the operand checks of the
launchers.

The layout (no repack): ``weight_packed`` u8 ``[N, K/2]`` holds two e2m1 codes a byte (the low nibble first),
``weight_scale`` fp8 e4m3 ``[N, K/16]`` one block scale per 16 codes, ``weight_global_scale`` one fp32, and
``W_hat = e2m1 * scale / global_scale`` (``nvfp4.dequantize``). Hopper has no FP4 tensor cores, so the kernels
read the packed words as they sit, decode them in registers (``nibble``) and feed bf16/fp16 MMAs.

This module is the ground floor of the FP4 kernels: the kernel families (``fp4_decode``, ``fp4_backward``,
``fp4_dequant``, ``fp4_direct``, ``fp4_gluon``) and the decode-step kernels import from it, never the other way.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl.nvfp4 import NVFP4Tensors


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
def gluon_k_offsets(offs):
    """Where element ``offs`` of a row-major activation goes in the Gluon K order (``gluon_layout``, whose
    ``to_gluon_k`` is the same map on tensors): within each 256-element K step, element 4j + i moves to i * 64 + j.
    Rows must be whole K steps, so a flat offset maps as a column does. The producers of a decode GEMM's input
    write it in this order directly (the decode-step kernels, ``gluon_k=True``)."""
    return offs - (offs & 255) + ((offs & 3) << 6) + ((offs >> 2) & 63)


def nibble_asm(i: int, fp16: bool, halves: bool = False) -> str:
    """PTX for nibble ``i`` of both 16-bit halves of ``$1`` -> a bf16x2 / fp16x2 pair in ``$0``; with ``halves``
    (bf16 only) the word is ``$2`` and the pair comes back as its two bf16 halves ``$0`` (low) and ``$1`` (high),
    for a caller that holds the word itself rather than two 16-bit elements (``fp4_direct``).

    Code bits ``4i..4i+3`` of a half are (magnitude e1 e0 m, sign s). The sign goes to bit 15 (31)
    and the magnitude to the low two exponent bits + top mantissa bit, so the half reads as
    ``e2m1 * 2^-126`` (bf16) or ``e2m1 * 2^-14`` (fp16), subnormals included.

    bf16: the code isolated, then one multiply by 2^a + 2^b writes two copies of it, one with the sign at
    bit 15 and one with the magnitude at bits 8..6 (the copies do not overlap, so the add carries nothing),
    and an AND keeps those bits: 3 instructions per pair + one shift shared by nibbles 2 and 3, 13 per 8
    weights against 15 for shifts (docs/kernels.md#nibble-mul). fp16: 2 shifts + 2 LOP3 per pair (its copies would
    overlap).
    """
    if not fp16:
        mask, mul = ("0x000F000F", 4096 + 64) if i % 2 == 0 else ("0x00F000F0", 256 + 4)
        word = "$2" if halves else "$1"
        src = f"shr.u32 t, {word}, 8;\nand.b32 t, t, " if i >= 2 else f"and.b32 t, {word}, "
        out = "and.b32 t, t, 0x81C081C0;\nmov.b32 {$0, $1}, t;" if halves else "and.b32 $0, t, 0x81C081C0;"
        return "{\n.reg .b32 t;\n" + src + f"{mask};\nmul.lo.u32 t, t, {mul};\n{out}\n}}"
    if halves:
        raise ValueError("nibble_asm: halves is bf16 only")
    sign_shl = 12 - 4 * i
    mag_shift, mask = (9 - 4 * i, "0x0E000E00") if fp16 else (6 - 4 * i, "0x01C001C0")
    mag = f"shl.b32 m, $1, {mag_shift};" if mag_shift >= 0 else f"shr.u32 m, $1, {-mag_shift};"
    sign = f"shl.b32 s, $1, {sign_shl};" if sign_shl else "mov.b32 s, $1;"
    return (
        "{\n.reg .b32 s, m;\n"
        + sign
        + "\n"
        + mag
        + f"\nand.b32 m, m, {mask};\nand.b32 s, s, 0x80008000;\nor.b32 $0, s, m;\n}}"
    )


#: ``nibble_asm`` for each (fp16, nibble): ``_NIBBLE_PTX[fp16][i]``.
_NIBBLE_PTX = tuple(tuple(nibble_asm(i, fp16) for i in range(4)) for fp16 in (False, True))


@triton.constexpr_function
def _nibble_ptx(i: int, fp16: bool) -> str:
    """Nibble ``i``'s ``_NIBBLE_PTX`` for the act dtype, looked up at compile time."""
    return _NIBBLE_PTX[fp16][i]


#: Under Triton's interpreter (CPU tests) ``nibble`` computes the same bits with plain integer ops:
#: the interpreter cannot run inline PTX.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _nibble_plain(h, NIB: tl.constexpr, IS_FP16: tl.constexpr):
    """``nibble_asm``'s bits with integer ops on the int16 elements (sign to bit 15, magnitude under it)."""
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
def nibble(h, NIB: tl.constexpr, IS_FP16: tl.constexpr):
    """int16 tensor of packed codes (4 per element) -> its code ``NIB``, scaled down (``nibble_asm``).

    A unary elementwise op, so Triton hoists the dot-operand layout conversion above it: the int16
    words go global -> shared (cp.async) -> registers in the wgmma A-operand layout, and the decoded
    bf16 pairs never touch shared memory.
    """
    if _INTERPRETED:
        return _nibble_plain(h, NIB, IS_FP16)
    if IS_FP16:
        return tl.inline_asm_elementwise(_nibble_ptx(NIB, True), "=r,r", [h], dtype=tl.float16, is_pure=True, pack=2)
    else:  # (an else: Triton takes the two returns as one function's only under a constexpr if / else)
        return tl.inline_asm_elementwise(_nibble_ptx(NIB, False), "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)


def check_act(t: torch.Tensor, what: str = "activations") -> None:
    """A one-line error unless ``t`` is a 2-D bf16/fp16 tensor (what the kernels' MMAs take)."""
    if t.dim() != 2:
        raise ValueError(f"nvfp4 kernels take 2-D {what}, got shape {tuple(t.shape)}")
    check_dtype(t.dtype, what)


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """A one-line error unless ``dtype`` is bf16 or fp16."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4 kernels take bf16/fp16 {what}, got {dtype}")


def check_weight(weight: NVFP4Tensors) -> tuple[int, int]:
    """(N, K) of a well-formed NVFP4 weight; a one-line error otherwise."""
    weight_packed, weight_scale = weight.weight_packed, weight.weight_scale
    N, half_k = weight_packed.shape
    K = 2 * half_k
    if weight_packed.dtype != torch.uint8 or weight_scale.shape != (N, K // 16) or K % 16:
        raise ValueError(
            f"bad NVFP4 weight: packed {tuple(weight_packed.shape)} {weight_packed.dtype}, scale {tuple(weight_scale.shape)}; "
            "expected u8 [N, K/2] and fp8 [N, K/16] with K % 16 == 0"
        )
    return N, K


def as_words(weight_packed: torch.Tensor) -> torch.Tensor:
    """The packed weight as int32 words of 8 codes (the unit the backward and dequantize kernels decode)."""
    return weight_packed.contiguous().view(torch.int32)
