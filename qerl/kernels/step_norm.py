"""The decode step's residual-add + RMSNorm kernels, with the LoRA shrink of the projections that read their output
fused in (``step_base``), writing that output in the Gluon decode kernel's K order when the GEMM after it reads that
order (``gluon_k``). The SiLU gating's kernels, built the same way, are ``step_silu``'s.

Why: at batch 1 a 7B decode step streams ~4.8 GB of weights in ~1.1-1.5 ms, and an unfused RMSNorm costs several
tiny launches, times the layer count; each kernel here is one launch and reproduces transformers' rounding (fp32
math, cast to the activation dtype where transformers' ops would round). Up to ``RANK_SPLIT_MAX_ROWS`` rows the
RMSNorm kernel splits u's ranks over programs instead of the row's columns (each program normalises the whole row
and writes its ranks of u: no partials, no ticket).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import backend, pdl, schedule
from .fp4_base import gluon_k_offsets
from .step_base import (
    check_gluon_k,
    finish_shrink,
    load_a,
    part_tile,
    rank_dot,
    rank_pad,
    shrink_split,
    store_u,
    trigger,
)


@triton.jit
def _residual(h_ptr, d_ptr, offs, mask, HAS_DELTA: tl.constexpr):
    """h (+ delta, rounded to h's dtype as transformers' residual add is)."""
    h = tl.load(h_ptr + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
    return h


@triton.jit
def _rstd(h, n, eps):
    """transformers' RMSNorm scale of a row held whole (masked columns read as 0): 1 / sqrt(mean(h^2) + eps), fp32."""
    hf = h.to(tl.float32)
    return tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)


@triton.jit
def _normalise(h, rstd, w_ptr, cols, mask, DT: tl.constexpr):
    """transformers' RMSNorm tail: (h * rstd) rounded to the activation dtype, times the weight."""
    y = (h.to(tl.float32) * rstd).to(DT).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * y).to(DT)


@triton.jit
def _rms_norm_kernel(
    h_ptr,
    d_ptr,
    w_ptr,
    out_ptr,
    n_cols,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    GLUON_K: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """One program per row; the residual sum is written back in place; GLUON_K: the output in the
    Gluon decode kernel's K order (``fp4_base.gluon_k_offsets``)."""
    trigger(TRIGGER)
    base = tl.program_id(0).to(tl.int64) * n_cols
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = _residual(h_ptr, d_ptr, base + offs, mask, HAS_DELTA)
    if HAS_DELTA:
        tl.store(h_ptr + base + offs, h, mask=mask)
    rstd = _rstd(h, n_cols, eps)
    dest = gluon_k_offsets(offs) if GLUON_K else offs
    tl.store(out_ptr + base + dest, _normalise(h, rstd, w_ptr, offs, mask, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_shrink_kernel(
    h_ptr,
    d_ptr,
    w_ptr,
    hout_ptr,
    out_ptr,
    a_ptr,
    u_ptr,
    part_ptr,
    ticket_ptr,
    M,
    K,
    eps,
    chunk,
    R,
    S1,
    S2,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    BK: tl.constexpr,
    RP: tl.constexpr,
    PART_TILE: tl.constexpr,
    GLUON_K: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program (row, split): rstd from the whole row (an L2 read), then its ``chunk`` columns:
    residual sum -> hout, normalised row -> out (GLUON_K: in the Gluon K order), and their share of
    ``u = out @ A.T`` (in natural order: the shrink never reads out back).

    hout is a separate buffer: other programs of the row may still be reading h.
    """
    trigger(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = row * K
    cols = split * chunk + tl.arange(0, BK)
    a = load_a(a_ptr, K, cols, cols < K, R, RP)  # in flight while the row is reduced
    offs = tl.arange(0, BLOCK)
    rstd = _rstd(_residual(h_ptr, d_ptr, base + offs, offs < K, HAS_DELTA), K, eps)
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([RP], tl.float32)
    for k0 in range(0, chunk, BK):
        cols = split * chunk + k0 + tl.arange(0, BK)
        mask = cols < K
        nxt = cols + BK
        a_next = load_a(a_ptr, K, nxt, (nxt < K) & (k0 + BK < chunk), R, RP)
        h = _residual(h_ptr, d_ptr, base + cols, mask, HAS_DELTA)
        if HAS_DELTA:
            tl.store(hout_ptr + base + cols, h, mask=mask)
        y = _normalise(h, rstd, w_ptr, cols, mask, dt)
        tl.store(out_ptr + base + (gluon_k_offsets(cols) if GLUON_K else cols), y, mask=mask)
        acc += rank_dot(y, a)
        a = a_next
    finish_shrink(acc, row, split, tl.num_programs(1), M, R, S1, S2, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


@triton.jit
def _rms_norm_rank_kernel(
    out_ptr,
    hout_ptr,
    u_ptr,
    h_ptr,
    d_ptr,
    w_ptr,
    a_ptr,
    M,
    K,
    eps,
    share,
    R,
    S1,
    S2,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    RB: tl.constexpr,
    GLUON_K: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program (row, rank block): the whole row's residual sum and RMSNorm, then ``RB`` ranks of u from it over
    all K columns, stored as they are: no partials, no ticket. Of hout and out it stores its ``share`` of the
    columns (the outputs come first among the arguments). A's rows are loaded first: they come from DRAM and the row from L2, so the two latencies overlap."""
    trigger(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    a = load_a(a_ptr + blk * RB * K, K, offs, mask, R - blk * RB, RB)
    base = row * K
    h = _residual(h_ptr, d_ptr, base + offs, mask, HAS_DELTA)
    y = _normalise(h, _rstd(h, K, eps), w_ptr, offs, mask, out_ptr.dtype.element_ty)
    mine = mask & (offs >= blk * share) & (offs < blk * share + share)
    if HAS_DELTA:
        tl.store(hout_ptr + base + offs, h, mask=mine)
    tl.store(out_ptr + base + (gluon_k_offsets(offs) if GLUON_K else offs), y, mask=mine)
    store_u(u_ptr, rank_dot(y, a), row, blk * RB + tl.arange(0, RB), M, R, S1, S2)


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, gluon_k: bool = False
) -> torch.Tensor:
    """``h += delta`` (in place, when given), then ``weight * rmsnorm(h)`` in h's dtype; ``gluon_k``:
    written in the Gluon decode kernel's K order (rows a multiple of 256), for the GEMM that reads it."""
    n_cols = h.shape[-1]
    out = torch.empty_like(h)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(h.numel() // n_cols,)](
        h,
        delta if delta is not None else h,
        weight,
        out,
        n_cols,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        GLUON_K=check_gluon_k(gluon_k, n_cols),
        TRIGGER=pdl.enabled(h.device),
        num_warps=_norm_warps(block),
    )
    return out


#: Rows up to which the shrink splits u's ranks, not the row's columns: no partials, faster there (docs/kernels.md#rank-split).
RANK_SPLIT_MAX_ROWS = 64
#: Widest row (padded) a by-rank program holds in registers (docs/kernels.md#rank-split).
RANK_MAX_BLOCK = 8192
#: Warps of a by-rank program: the fastest up to 8 ranks of the 7B row (docs/kernels.md#rank-split).
RANK_WARPS = 8
#: Programs a by-rank launch aims at (docs/kernels.md#rank-split).
RANKTARGET_PROGRAMS = 128
#: Most A values a thread holds (ranks x row width / threads): more spill (docs/kernels.md#rank-split).
RANK_MAX_VALUES = 128


def rank_block(rows: int, rank: int, k: int) -> int:
    """Ranks per program of a by-rank shrink over rows of ``k`` columns (``block``: padded to a power of two): a
    power of two, the fewest that keep ``rows`` x blocks at most ``RANKTARGET_PROGRAMS``, with at most
    ``RANK_MAX_VALUES`` of A a thread; or 0 where the column split serves (more rows than ``RANK_SPLIT_MAX_ROWS``,
    rows wider than ``RANK_MAX_BLOCK``, or ``schedule.SWITCHES.shrink_by_rank`` off)."""
    block = triton.next_power_of_2(k)
    if not schedule.SWITCHES.shrink_by_rank or rows > RANK_SPLIT_MAX_ROWS or block > RANK_MAX_BLOCK:
        return 0
    most = max(1, RANK_MAX_VALUES * 32 * RANK_WARPS // block)
    rb = 1
    while rb < min(rank, most) and rows * triton.cdiv(rank, rb) > RANKTARGET_PROGRAMS:
        rb *= 2
    return rb


@dataclass(frozen=True)
class _Shrink:
    """One ``rms_norm_shrink`` call: its inputs and the outputs it fills (h_out, out, u)."""

    h: torch.Tensor
    delta: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    lora_a: torch.Tensor
    bounds: tuple[int, int]
    gluon_k: bool
    h_out: torch.Tensor
    out: torch.Tensor
    u: torch.Tensor


def rms_norm_shrink(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    lora_a: torch.Tensor,
    bounds: tuple[int, int],
    gluon_k: bool = False,
    rb: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h + delta, weight * rmsnorm(h + delta), u) with ``u = rmsnorm(..) @ lora_a.T`` segmented at
    ``bounds`` (see module doc). h is not modified; without delta the first result is h itself.
    ``gluon_k`` as in ``rms_norm`` (the second result only; u is the same). ``rb``: ranks per program of the
    by-rank split, 0 for the column split (None: ``rank_block``'s choice)."""
    k = h.shape[-1]
    m = h.numel() // k
    rank = lora_a.shape[0]
    h_out = torch.empty_like(h) if delta is not None else h
    out = torch.empty_like(h)
    u = torch.empty(m * rank, dtype=h.dtype, device=h.device)
    if rb is None:
        rb = rank_block(m, rank, k)
    call = _Shrink(h, delta, weight, eps, lora_a, bounds, gluon_k, h_out, out, u)
    if rb:
        _rank_split(call, rb)
    else:
        _column_split(call)
    return h_out, out, u


def _rank_split(c: _Shrink, rb: int) -> None:
    """``rms_norm_shrink``'s by-rank launch (``_rms_norm_rank_kernel``, ``rb`` ranks a program)."""
    k = c.h.shape[-1]
    m, rank = c.h.numel() // k, c.lora_a.shape[0]
    blocks = triton.cdiv(rank, rb)
    _rms_norm_rank_kernel[(m, blocks)](
        c.out,
        c.h_out,
        c.u,
        c.h,
        c.delta if c.delta is not None else c.h,
        c.weight,
        c.lora_a,
        m,
        k,
        c.eps,
        triton.cdiv(k, blocks),
        rank,
        c.bounds[0],
        c.bounds[1],
        HAS_DELTA=c.delta is not None,
        BLOCK=triton.next_power_of_2(k),
        RB=rb,
        GLUON_K=check_gluon_k(c.gluon_k, k),
        TRIGGER=pdl.enabled(c.h.device),
        num_warps=RANK_WARPS,
    )


def _column_split(c: _Shrink) -> None:
    """``rms_norm_shrink``'s column-split launch (``_rms_norm_shrink_kernel``: partials summed by each row's last
    program)."""
    k = c.h.shape[-1]
    m, rank = c.h.numel() // k, c.lora_a.shape[0]
    block = triton.next_power_of_2(k)
    rp = rank_pad(rank)
    # At most 8 warps: with 16 the 128-register cap spills the double-buffered A tiles (ptxas, sm_90).
    warps = min(8, _norm_warps(block))
    nsplit, chunk, bk = shrink_split(m, k, rp, warps)
    part = torch.empty(m * nsplit * rp, dtype=torch.float32, device=c.h.device)
    _rms_norm_shrink_kernel[(m, nsplit)](
        c.h,
        c.delta if c.delta is not None else c.h,
        c.weight,
        c.h_out,
        c.out,
        c.lora_a,
        c.u,
        part,
        backend.tickets(c.h.device, m),
        m,
        k,
        c.eps,
        chunk,
        rank,
        c.bounds[0],
        c.bounds[1],
        HAS_DELTA=c.delta is not None,
        BLOCK=block,
        BK=bk,
        RP=rp,
        PART_TILE=part_tile(nsplit, rp),
        GLUON_K=check_gluon_k(c.gluon_k, k),
        TRIGGER=pdl.enabled(c.h.device),
        num_warps=warps,
    )
