"""Weight orders the decode kernel can read besides the checkpoint's (pure torch, no Triton).

Both are experiments selected through ``fp4_gemm.DecodeConfig`` (``tiled``, ``kperm``) and measured
by ``benchmarks/decode_tune.py`` on the same kernel, so that a layout change is judged by one
number before NVFP4Linear adopts it (benchmarks/NOTES.md, Kernels). Each keeps the bytes (4.5 bits
per weight) and the tensor shapes.
"""

from __future__ import annotations

import torch

from qerl.nvfp4 import pack_fp4, unpack_fp4


def tile_weight(packed: torch.Tensor, scale: torch.Tensor, BN: int, BK: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bytes reordered so that each (BN rows x BK codes) decode tile, and its scales, are contiguous.

    In the checkpoint's row-major order a decode K step reads BN separate 128-byte row pieces (and
    BN 16-byte scale pieces), spread over the whole weight; here it reads one 8 KB block and one
    1 KB block, consecutive K steps reading consecutive blocks. Shapes are kept ([N, K/2], [N, K/16]).
    """
    N, half_k = packed.shape
    K = 2 * half_k
    if N % BN or K % BK:
        raise ValueError(f"tile_weight needs N % {BN} == 0 and K % {BK} == 0, got N={N}, K={K}")

    def tiles(t: torch.Tensor, per_tile_row: int) -> torch.Tensor:
        r = t.contiguous().view(torch.uint8)
        r = r.reshape(N // BN, BN, K // BK, per_tile_row).permute(0, 2, 1, 3).contiguous()
        return r.reshape(t.shape).view(t.dtype)

    return tiles(packed, BK // 2), tiles(scale, BK // 16)


def permute_nibbles(packed: torch.Tensor, scale: torch.Tensor, BK: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight codes and scales reordered within each BK-column block of a row (same bytes, same shapes).

    Codes: nibble i of the block's int16 element j holds column i*BK/4 + j (the checkpoint: 4j + i).
    Scales: the block's BK/16 group scales stored as [BK/64, 4], group i*BK/64 + g at (g, i).
    Why (an experiment for the decode kernel, ``DecodeConfig(kperm=True)``): in the checkpoint order
    slice i of x is the strided x[:, 4j + i], which the kernel splits in registers and writes back to
    shared memory behind a barrier every K step (NOTES.md, "What one K step does"); in this order it
    is contiguous, and each nibble's scales come out of the step's scale tile with two splits.
    """
    N, half_k = packed.shape
    K = 2 * half_k
    if K % BK or BK % 64:
        raise ValueError(f"permute_nibbles needs K % {BK} == 0 and BK % 64 == 0, got K={K}")
    codes = unpack_fp4(packed).reshape(N, K // BK, 4, BK // 4).transpose(2, 3).reshape(N, K)
    groups = scale.view(torch.uint8).reshape(N, K // BK, 4, BK // 64).transpose(2, 3).reshape(N, K // 16)
    return pack_fp4(codes), groups.contiguous().view(scale.dtype)
