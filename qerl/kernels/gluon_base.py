"""What the two Gluon decode kernels (``fp4_direct``'s mma.sync kernel, ``fp4_gluon``'s TMA/wgmma kernel) share: the
scale layout that broadcasts one fp8 block scale onto the A operand's registers, the transposed output tile's
offsets, the split-K reduction over a tile's K slices (partials and tickets), the epilogue store, and the host
side of their launch (output, partials, tickets and the argument tail). Both kernels' decode contract is
``fp4_gemm.matmul``'s: bias, the LoRA expand from a segmented u, segmented outputs (``fp4_base.segmented``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from qerl.nvfp4 import NVFP4Tensors

from . import backend
from .epilogue import Epilogue
from .fp4_base import segmented


@gluon.constexpr_function
def scale_layout(a_linear):
    """The [BN, G, 4] layout whose reshape to [BN, BK/4] is the A operand's (``a_linear``, its linear
    layout): a column basis c becomes (c // 4, c % 4), so a scale loaded in its dim-2 slice and broadcast
    along dim 2 lands in the A layout with no data movement."""

    def split(basis):
        r, c = basis
        return [r, c // 4, c % 4]

    return gl.DistributedLinearLayout(
        reg_bases=[split(b) for b in a_linear.reg_bases],
        lane_bases=[split(b) for b in a_linear.lane_bases],
        warp_bases=[split(b) for b in a_linear.warp_bases],
        block_bases=[split(b) for b in a_linear.block_bases],
        shape=[a_linear.shape[0], a_linear.shape[1] // 4, 4],
    )


@gluon.jit
def tile_offsets(pid_n, M, N, Y1, Y2, BN: gl.constexpr, BM: gl.constexpr, layout: gl.constexpr):
    """(offs_n, offs, mask) of a decode program's transposed [BN, BM] output tile in ``layout``: ``offs``
    in y's segmented order (``segmented``)."""
    offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, layout))
    offs = segmented(gl.expand_dims(offs_n, 1), gl.expand_dims(offs_m, 0), M, Y1, Y2, N)
    mask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_m < M, 0)
    return offs_n, offs, mask


@gluon.constexpr_function
def _partial_layout(num_warps):
    """The vector partials' [BN, BM] layout: 4 consecutive weight rows per thread, 16 threads along BN = 64,
    2 along the tokens, warps along the tokens (BM >= 2 x warps), so each thread's share of a partial in the
    launch-private n-fastest order is whole 16-byte vectors."""
    return gl.BlockedLayout([4, 1], [16, 2], [1, num_warps], [0, 1])


@gluon.jit
def split_k_sum(
    acc, pid_n, pid_k, nsplit, tiles, part_ptr, ticket_ptr, offs, mask, M, N, CH: gl.constexpr, VECTOR: gl.constexpr
):
    """Publish this program's fp32 partial (slice ``pid_k`` of the ``nsplit`` of tile ``pid_n``, one of ``tiles``)
    and take a ticket: ``(sum of every slice's partial in slice order, True)`` for the program that draws the tile's
    last ticket (it also resets the ticket, so stream
    order leaves the table at zero for the next launch), ``(acc, False)`` for the others (as fp4_gemm does).
    The last program reads CH partials per round trip; the sum stays in slice order, so the result depends
    on neither CH nor the partials' layout.

    The partials are private to the launch. Without ``VECTOR`` they sit at y's offsets (``offs``, slice s at
    s x M x N) in the accumulator's layout, where a thread's elements are 4 bytes apart along n: one 4-byte
    access each, 32 a partial per thread at BM=64. With ``VECTOR`` slice s of tile t is the [BM, BN] block at
    (s x tiles + t) x BN x BM, n fastest, moved through ``_partial_layout`` (a shared-memory layout conversion
    each way) in 16-byte vectors: faster for the TMA/wgmma kernel; the direct kernel (M <= 8, a partial is 4 values a
    thread and mostly masked at M=1) was slower with it, so it keeps y's offsets (docs/kernels.md#vector-partials)."""
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    if VECTOR:
        lay: gl.constexpr = _partial_layout(gl.num_warps())
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, lay))
        at = part_ptr + pid_n * (BN * BM) + gl.expand_dims(offs_m * BN, 0)
        at += gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, lay)), 1)
        rows = gl.expand_dims(offs_m < M, 0)
        stride = tiles * (BN * BM)  # one slice's partials
        part = gl.convert_layout(acc, lay)
    else:
        at = part_ptr + offs
        rows = mask
        stride = M * N
        part = acc
    gl.store(at + pid_k * stride, part, mask=rows)
    gl.thread_barrier()
    ticket = gl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
    last = ticket == nsplit - 1
    if last:
        total = gl.zeros_like(part)
        for s0 in range(0, nsplit, CH):
            for j in gl.static_range(CH):
                total += gl.load(at + (s0 + j) * stride, mask=rows & (s0 + j < nsplit), other=0.0, cache_modifier=".cg")
        acc = gl.convert_layout(total, acc.type.layout) if VECTOR else total
        gl.store(ticket_ptr + pid_n, 0)
    return acc, last


@gluon.jit
def store_tile(
    acc, lora, g_ptr, offs_n, offs, mask, N, y_ptr, bias_ptr, lora_scale, HAS_BIAS: gl.constexpr, HAS_LORA: gl.constexpr
):
    """y[m, n] = acc[n, m] * 2^8 / g (+ bias[n]) (+ lora_scale * lora[n, m]) at the tile's (segmented)
    offsets ``offs``; ``lora`` is the tile's B . u (read only with HAS_LORA)."""
    out = acc * (256.0 / gl.load(g_ptr))
    if HAS_BIAS:
        out += gl.expand_dims(gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32), 1)
    if HAS_LORA:
        out += lora_scale * lora
    gl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def launch_tail(
    x: torch.Tensor,
    weight: NVFP4Tensors,
    epilogue: Epilogue,
    out: torch.Tensor | None,
    *,
    tiles: int,
    tile_size: int,
    slices: int,
) -> tuple[torch.Tensor, dict[str, object]]:
    """Host side of the tail both Gluon decode kernels share: ``(out, args)`` with y allocated (``[M, N]``, or
    flat segmented with the epilogue's ``out_bounds``), the fp32 partials of a split launch (``slices`` a tile at
    most; ``tile_size`` = BN x BM elements a tile and slice: room for either of ``split_k_sum``'s layouts) and its
    tickets, and the kernel arguments from ``g_ptr`` to ``lora_scale`` by name (both kernels name them alike)."""
    M = x.shape[0]
    N = weight.out_features
    if out is None:
        out = torch.empty((M, N) if epilogue.out_bounds is None else (M * N,), dtype=x.dtype, device=x.device)
    lb = None if epilogue.lora_b is None else epilogue.lora_b.contiguous()
    rank = epilogue.rank
    y1, y2 = epilogue.out_bounds or (N, N)
    s1, s2 = epilogue.lora_bounds or (rank, rank)
    split = slices > 1
    args = {
        "g_ptr": weight.weight_global_scale,
        "y_ptr": out,
        "part_ptr": torch.empty((slices, tiles, tile_size), dtype=torch.float32, device=x.device) if split else out,
        "ticket_ptr": backend.tickets(x.device, tiles) if split else out,
        "bias_ptr": out if epilogue.bias is None else epilogue.bias,
        "u_ptr": out if epilogue.lora_u is None else epilogue.lora_u.contiguous(),
        "lb_ptr": out if lb is None else lb,
        "M": M,
        "N": N,
        "K": x.shape[1],
        "Y1": y1,
        "Y2": y2,
        "S1": s1,
        "S2": s2,
        "stride_lb": 0 if lb is None else lb.stride(0),
        "R": rank,
        "lora_scale": float(epilogue.lora_scale),
        "SPLIT": split,
        "HAS_BIAS": epilogue.bias is not None,
        "HAS_LORA": epilogue.lora_u is not None,
        "RC": min(64, max(16, triton.next_power_of_2(rank))),
    }
    return out, args
