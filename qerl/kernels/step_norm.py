"""The decode step's residual-add + RMSNorm and SiLU-gating kernels, each with the LoRA shrink of the projections
that read its output fused in (``step_base``), writing that output in the Gluon decode kernel's K order when the
GEMM after it reads that order (``permute``).

Why: at batch 1 a 7B decode step streams ~4.8 GB of weights in ~1.1-1.5 ms, and an unfused RMSNorm costs several
tiny launches, times the layer count; each kernel here is one launch and reproduces transformers' rounding (fp32
math, cast to the activation dtype where transformers' ops would round). Up to ``RANK_SPLIT_MAX_ROWS`` rows the
RMSNorm kernel splits u's ranks over programs instead of the row's columns (each program normalises the whole row
and writes its ranks of u: no partials, no ticket).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend, pdl, schedule
from .fp4_base import nibble_major
from .step_base import (
    check_permute,
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
    PERMUTE: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """One program per row; the residual sum is written back in place; PERMUTE: the output in the
    Gluon decode kernel's K order (``fp4_base.nibble_major``)."""
    trigger(TRIGGER)
    base = tl.program_id(0).to(tl.int64) * n_cols
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = _residual(h_ptr, d_ptr, base + offs, mask, HAS_DELTA)
    if HAS_DELTA:
        tl.store(h_ptr + base + offs, h, mask=mask)
    rstd = _rstd(h, n_cols, eps)
    dest = nibble_major(offs) if PERMUTE else offs
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
    PERMUTE: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program (row, split): rstd from the whole row (an L2 read), then its ``chunk`` columns:
    residual sum -> hout, normalised row -> out (PERMUTE: in the Gluon K order), and their share of
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
        tl.store(out_ptr + base + (nibble_major(cols) if PERMUTE else cols), y, mask=mask)
        acc += rank_dot(y, a)
        a = a_next
    finish_shrink(acc, row, split, tl.num_programs(1), M, R, S1, S2, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


@triton.jit
def _rms_norm_rank_kernel(
    h_ptr,
    d_ptr,
    w_ptr,
    hout_ptr,
    out_ptr,
    a_ptr,
    u_ptr,
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
    PERMUTE: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program (row, rank block): the whole row's residual sum and RMSNorm, then ``RB`` ranks of u from it over
    all K columns, stored as they are: no partials, no ticket. Of hout and out it stores its ``share`` of the
    columns. A's rows are loaded first: they come from DRAM and the row from L2, so the two latencies overlap."""
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
    tl.store(out_ptr + base + (nibble_major(offs) if PERMUTE else offs), y, mask=mine)
    store_u(u_ptr, rank_dot(y, a), row, blk * RB + tl.arange(0, RB), M, R, S1, S2)


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, permute: bool = False
) -> torch.Tensor:
    """``h += delta`` (in place, when given), then ``weight * rmsnorm(h)`` in h's dtype; ``permute``:
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
        PERMUTE=check_permute(permute, n_cols),
        TRIGGER=pdl.enabled(h.device),
        num_warps=_norm_warps(block),
    )
    return out


#: Rows up to which ``rms_norm_shrink`` splits u's ranks over programs (``_rms_norm_rank_kernel``: each program
#: normalises the whole row and reduces ``rb`` ranks over all of it) instead of the row's columns (partials summed by
#: the row's last program, ``_finish_shrink``), for rows of at most ``RANK_MAX_BLOCK`` columns (held in registers).
#: Why: the column split's partial store, ticket and partial sum sit in each program's chain; a by-rank program has
#: none, and is faster at every row count up to 64 (docs/kernels.md#rank-split). The SiLU shrink keeps the column split.
RANK_SPLIT_MAX_ROWS = 64
RANK_MAX_BLOCK = 8192
#: Warps of a by-rank program, the programs a launch aims at, and the most A values a thread holds (``rank_block``:
#: ranks x row width / threads): the fastest measured up to 8 ranks of the 7B row (4096 columns padded, 128 values a
#: thread); wider rows take fewer ranks a program, as more values a thread spill (docs/kernels.md#rank-split).
RANK_WARPS = 8
RANKTARGET_PROGRAMS = 128
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


def rms_norm_shrink(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    lora_a: torch.Tensor,
    bounds: tuple[int, int],
    permute: bool = False,
    rb: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h + delta, weight * rmsnorm(h + delta), u) with ``u = rmsnorm(..) @ lora_a.T`` segmented at
    ``bounds`` (see module doc). h is not modified; without delta the first result is h itself.
    ``permute`` as in ``rms_norm`` (the second result only; u is the same). ``rb``: ranks per program of the
    by-rank split, 0 for the column split (None: ``rank_block``'s choice)."""
    k = h.shape[-1]
    m = h.numel() // k
    rank = lora_a.shape[0]
    block = triton.next_power_of_2(k)
    h_out = torch.empty_like(h) if delta is not None else h
    out = torch.empty_like(h)
    u = torch.empty(m * rank, dtype=h.dtype, device=h.device)
    if rb is None:
        rb = rank_block(m, rank, k)
    common = (h, delta if delta is not None else h, weight, h_out, out, lora_a, u)
    if rb:
        blocks = triton.cdiv(rank, rb)
        _rms_norm_rank_kernel[(m, blocks)](
            *common,
            m,
            k,
            eps,
            triton.cdiv(k, blocks),
            rank,
            bounds[0],
            bounds[1],
            HAS_DELTA=delta is not None,
            BLOCK=block,
            RB=rb,
            PERMUTE=check_permute(permute, k),
            TRIGGER=pdl.enabled(h.device),
            num_warps=RANK_WARPS,
        )
        return h_out, out, u
    rp = rank_pad(rank)
    # At most 8 warps: with 16 the 128-register cap spills the double-buffered A tiles (ptxas, sm_90).
    warps = min(8, _norm_warps(block))
    nsplit, chunk, bk = shrink_split(m, k, rp, warps)
    part = torch.empty(m * nsplit * rp, dtype=torch.float32, device=h.device)
    _rms_norm_shrink_kernel[(m, nsplit)](
        *common,
        part,
        backend.tickets(h.device, m),
        m,
        k,
        eps,
        chunk,
        rank,
        bounds[0],
        bounds[1],
        HAS_DELTA=delta is not None,
        BLOCK=block,
        BK=bk,
        RP=rp,
        PART_TILE=part_tile(nsplit, rp),
        PERMUTE=check_permute(permute, k),
        TRIGGER=pdl.enabled(h.device),
        num_warps=warps,
    )
    return h_out, out, u


@triton.jit
def _silu_gate(g_ptr, u_ptr, offs, mask, DT: tl.constexpr):
    """transformers' ``act_fn(gate) * up``: SiLU rounded to the activation dtype, then the product."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    return (act * u).to(DT)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, PERMUTE: tl.constexpr, TRIGGER: tl.constexpr):
    trigger(TRIGGER)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dest = nibble_major(offs) if PERMUTE else offs
    tl.store(out_ptr + dest, _silu_gate(g_ptr, u_ptr, offs, mask, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_shrink_kernel(
    g_ptr,
    up_ptr,
    out_ptr,
    a_ptr,
    u_ptr,
    part_ptr,
    ticket_ptr,
    M,
    K,
    chunk,
    R,
    BK: tl.constexpr,
    RP: tl.constexpr,
    PART_TILE: tl.constexpr,
    PERMUTE: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program (row, split): SiLU-gate ``chunk`` columns of the row (stored in the Gluon K order with
    PERMUTE) and reduce their share of u."""
    trigger(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    acc = tl.zeros([RP], tl.float32)
    for k0 in range(0, chunk, BK):
        cols = split * chunk + k0 + tl.arange(0, BK)
        mask = cols < K
        a = load_a(a_ptr, K, cols, mask, R, RP)
        act = _silu_gate(g_ptr, up_ptr, row * K + cols, mask, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * K + (nibble_major(cols) if PERMUTE else cols), act, mask=mask)
        acc += rank_dot(act, a)
    finish_shrink(acc, row, split, tl.num_programs(1), M, R, R, R, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, permute: bool = False) -> torch.Tensor:
    """``silu(gate) * up``; ``permute`` as in ``rms_norm``."""
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](
        gate,
        up,
        out,
        n,
        BLOCK=1024,
        PERMUTE=check_permute(permute, gate.shape[-1]),
        TRIGGER=pdl.enabled(gate.device),
        num_warps=4,
    )
    return out


def silu_mul_shrink(
    gate: torch.Tensor, up: torch.Tensor, lora_a: torch.Tensor, permute: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up, u = that @ lora_a.T as a flat ``[M * R]`` buffer); ``permute`` as in ``rms_norm``
    (the first result only). Always the column split: a by-rank program would gate the whole row (18,944 columns
    at 7B) and measured 2x slower (docs/kernels.md#rank-split)."""
    k = gate.shape[-1]
    m = gate.numel() // k
    rank = lora_a.shape[0]
    rp = rank_pad(rank)
    nsplit, chunk, bk = shrink_split(m, k, rp, 4)
    out = torch.empty_like(gate)
    u = torch.empty(m * rank, dtype=gate.dtype, device=gate.device)
    part = torch.empty(m * nsplit * rp, dtype=torch.float32, device=gate.device)
    _silu_mul_shrink_kernel[(m, nsplit)](
        gate,
        up,
        out,
        lora_a,
        u,
        part,
        backend.tickets(gate.device, m),
        m,
        k,
        chunk,
        rank,
        BK=bk,
        RP=rp,
        PART_TILE=part_tile(nsplit, rp),
        PERMUTE=check_permute(permute, k),
        TRIGGER=pdl.enabled(gate.device),
        num_warps=4,
    )
    return out, u
