"""The Triton split-K decode GEMM (M <= ``schedule.DECODE_MAX_M``): what ``fp4_gemm.matmul`` runs for decode-sized
M where no Gluon kernel takes the GEMM (x in natural K order, fp16, other GPUs than Hopper, or the Gluon kernels off).

y^T = W_hat @ x^T with the weight as the wgmma A operand in registers and the tokens padded to 16..128 as its N
dim; the packed row is read as int16 elements of 4 codes, and a 3-instruction PTX snippet (``fp4_base.nibble``,
via ``tl.inline_asm_elementwise(pack=2)``; 4 for fp16) turns nibble i of two elements into one bf16x2 pair
``e2m1 * 2^-126``; one packed multiply by the fp8 block scale * 2^118 makes the exact ``e2m1 * scale * 2^-8``.
Because the decode is a unary elementwise op, Triton hoists the dot-operand conversion above it: words go global
-> shared (cp.async, pipelined) -> registers (ldmatrix) and the decoded weights never touch shared memory. About
4 SASS instructions per weight in the main loop (before the 3-instruction decode). Split-K with an atomic ticket
per tile: one launch, CUDA-graph safe; the split count from a model of waves of resident programs
(``schedule.decode_split``).

H200, 7B down_proj (N=3584, K=18944), benchmarks/results/kernels.json: M=16 1.86x of bf16 cuBLAS, 22.0 us against
a 9.0 us floor (38.2 MB at 4.24 TB/s). Nsight Compute at M=1: 4.3 instructions per weight, issue-bound (9.7 us of
issue at one per cycle), 53% of cycles issuing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.nvfp4 import NVFP4Tensors

from . import backend
from .epilogue import Epilogue
from .fp4_base import nibble, segmented
from .schedule import DecodeConfig, decode_config


@triton.jit
def _decode_kernel(
    x_ptr,
    h_ptr,
    s_ptr,
    g_ptr,
    bias_ptr,
    u_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_hr,
    h_step,
    h_tile,
    stride_sr,
    s_step,
    s_tile,
    Y1,
    Y2,
    S1,
    S2,
    stride_bn,
    R,
    lora_scale,
    steps_per_split,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BR: tl.constexpr,
    IS_FP16: tl.constexpr,
    X_SPLIT: tl.constexpr,
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
    (docs/kernels.md lists the orders measured).
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
            acc = tl.dot(nibble(h, 0, IS_FP16) * sb, tl.trans(x0), acc)
            acc = tl.dot(nibble(h, 1, IS_FP16) * sb, tl.trans(x1), acc)
            acc = tl.dot(nibble(h, 2, IS_FP16) * sb, tl.trans(x2), acc)
            acc = tl.dot(nibble(h, 3, IS_FP16) * sb, tl.trans(x3), acc)
        else:
            for i in tl.static_range(4):
                kx = k0 + 4 * hcol + i
                if EVEN_K:
                    xt = tl.load(x_cols + kx[:, None], mask=mask_m[None, :], other=0.0)
                else:
                    xt = tl.load(x_cols + kx[:, None], mask=mask_m[None, :] & (kx[:, None] < K), other=0.0)
                acc = tl.dot(nibble(h, i, IS_FP16) * sb, xt, acc)

    tile_nm = offs_m[None, :] * N + offs_n[:, None]
    mask_nm = mask_n[:, None] & mask_m[None, :]
    run = True
    if SPLIT:
        # Publish this fp32 partial, take a ticket; the program that draws the tile's last ticket
        # sums all partials (L2 reads, .cg), runs the epilogue and resets the ticket, so stream
        # order guarantees the tickets are back at zero for the next launch.
        nsplit = tl.num_programs(1)
        tl.store(part_ptr + pid_k * M * N + tile_nm, acc, mask=mask_nm)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
        run = ticket == nsplit - 1
        if run:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for s_ in range(0, nsplit):
                acc += tl.load(part_ptr + s_ * M * N + tile_nm, mask=mask_nm, other=0.0, cache_modifier=".cg")
            tl.store(ticket_ptr + pid_n, 0)
    if run:
        # The epilogue: y[m, n] = acc[n, m] * 2^8 / g (+ bias[n]) (+ lora_scale * B[n] . u[m]) for the transposed
        # tile, y and u segmented (:func:`segmented`).
        out = acc * (256.0 / tl.load(g_ptr))
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if HAS_LORA:
            r = tl.arange(0, BR)
            b = tl.load(
                b_ptr + offs_n[:, None] * stride_bn + r[None, :], mask=mask_n[:, None] & (r[None, :] < R), other=0.0
            )
            ut = tl.load(
                u_ptr + segmented(r[:, None], offs_m[None, :], M, S1, S2, R),
                mask=mask_m[None, :] & (r[:, None] < R),
                other=0.0,
            )
            dt = y_ptr.dtype.element_ty
            out += lora_scale * tl.dot(b.to(dt), ut.to(dt))
        tl.store(
            y_ptr + segmented(offs_n[:, None], offs_m[None, :], M, Y1, Y2, N),
            out.to(y_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_m[None, :],
        )


def matmul(
    x: torch.Tensor, weight: NVFP4Tensors, *, epilogue: Epilogue, out: torch.Tensor | None, config: DecodeConfig | None
) -> torch.Tensor:
    """``fp4_gemm.matmul``'s decode contract on ``_decode_kernel`` for operands it has checked (x contiguous
    ``[M <= DECODE_MAX_M, K]``, the epilogue's LoRA operands shaped); ``config`` (None: ``decode_config``'s
    choice) sets the schedule."""
    M, K = x.shape
    N = weight.out_features
    shape = (M, N) if epilogue.out_bounds is None else (M * N,)
    y = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return y
    has_lora = epilogue.lora_u is not None
    rank = epilogue.rank if has_lora else 0
    lora_b = epilogue.lora_b.contiguous() if has_lora else y
    cfg = decode_config(M, N, K, x.device, config)
    k_steps = triton.cdiv(K, cfg.BK)
    steps_per_split = triton.cdiv(k_steps, cfg.split)
    split = triton.cdiv(k_steps, steps_per_split)
    tiles = triton.cdiv(N, cfg.BN)
    part, tickets = _split_buffers(split, tiles, M, N, x.device, y)
    h, scale = weight.weight_packed.contiguous().view(torch.int16), weight.weight_scale.contiguous()
    _decode_kernel[(tiles, split)](
        x,
        h,
        scale,
        weight.weight_global_scale,
        y if epilogue.bias is None else epilogue.bias,
        epilogue.lora_u.contiguous() if has_lora else y,
        lora_b,
        y,
        part,
        tickets,
        M,
        N,
        K,
        x.stride(0),
        *_strides(h, cfg.BK // 4, cfg.BN),
        *_strides(scale, cfg.BK // 16, cfg.BN),
        *(epilogue.out_bounds or (N, N)),  # Y1, Y2
        *(epilogue.lora_bounds or (rank, rank)),  # S1, S2
        lora_b.stride(0) if has_lora else 0,
        rank,
        float(epilogue.lora_scale),
        steps_per_split,
        BM=max(16, triton.next_power_of_2(M)),
        BN=cfg.BN,
        BK=cfg.BK,
        SPLIT=split > 1,
        EVEN_K=K % cfg.BK == 0,
        HAS_BIAS=epilogue.bias is not None,
        HAS_LORA=has_lora,
        BR=max(16, triton.next_power_of_2(rank)),
        IS_FP16=x.dtype == torch.float16,
        X_SPLIT=cfg.x_split,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return y


def _strides(t: torch.Tensor, step: int, rows: int) -> tuple[int, int, int]:
    """A packed weight tensor's (row, K step, tile) strides for ``_decode_kernel``'s three-stride addressing."""
    return t.stride(0), step, rows * t.stride(0)


def _split_buffers(split: int, tiles: int, M: int, N: int, device: torch.device, dummy: torch.Tensor):
    """fp32 partials [split, M, N] and the ticket table for a split-K launch (``dummy`` twice if split == 1)."""
    if split == 1:
        return dummy, dummy
    return torch.empty((split, M, N), dtype=torch.float32, device=device), backend.tickets(device, tiles)
