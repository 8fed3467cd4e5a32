"""Triton kernels for the native engine's decode step (imported only where Triton and a GPU exist).

Why these kernels: at batch 1 a 7B decode step streams ~4.8 GB of weights in ~1.1-1.5 ms, and an
unfused RMSNorm, RoPE or attention costs 5-14 tiny launches each, times the layer count. Each kernel
here replaces one such cluster by one launch (two for attention) and reproduces transformers'
rounding (fp32 math, cast to the activation dtype where transformers' ops would round).

LoRA shrinks ride along instead of costing launches of their own: ``u = x @ A.T`` (A is ``[R, K]``,
R = 16-64 summed over the projections sharing x) is reduced by the kernel that *produces* x:

* the residual-add + RMSNorm kernel for q/k/v and gate/up (x = the normalised row),
* the SiLU-gating kernel for down_proj, the attention combine kernel for o_proj.

Those kernels split the row's K columns over programs (a GEMV over R x K at b=1 would otherwise be
one SM reading ~340 KB); each program writes an fp32 partial of u, and the program that draws a
row's last ticket sums the partials (loaded as one tile, summed in a fixed order: deterministic) and
writes u in the activation dtype. Up to ``RANK_SPLIT_MAX_ROWS`` rows the RMSNorm kernel splits u's ranks
instead (each program normalises the whole row and writes its ranks of u: no partials, no ticket). Tickets (``backend.tickets``) are per row, zero between launches
(the last program resets its own). ``u`` comes back *segmented*: projection j's ``[M, r_j]`` block is
contiguous (``flat[start_j * M : end_j * M]``), so the FP4 kernel's LoRA epilogue reads it
without a ``.contiguous()`` copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from qerl.kernels import backend, pdl, reference, schedule
from qerl.kernels.fp4_gemm import nibble_major, segmented

#: Aim for about two resident programs per SM (132 on an H200) in split-K attention and shrinks. From
#: b=64 up (64 rows x 4 kv-heads) the attention split stops splitting and each program walks a whole
#: row; aiming at 4x the programs there measured 11-18% slower (benchmarks/NOTES.md, seventh session).
_TARGET_PROGRAMS = 264


def rank_pad(rank: int) -> int:
    """Register width of a rank vector (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(rank))


def _shrink_split(rows: int, k: int, rp: int, warps: int) -> tuple[int, int, int]:
    """(programs per row, columns per program, columns per loop step) of a split shrink.

    A loop step holds an ``[rp, bk]`` tile of A, ~32 values per thread; rows x splits aims for
    ``_TARGET_PROGRAMS`` (a b=1 row is spread over the SMs, a b=64 row over few programs).
    """
    bk = max(32, min(512, triton.next_power_of_2(max(1, warps * 32 * 32 // rp))))
    nsplit = max(1, min(triton.cdiv(_TARGET_PROGRAMS, rows), triton.cdiv(k, bk)))
    chunk = triton.cdiv(triton.cdiv(k, nsplit), bk) * bk
    return triton.cdiv(k, chunk), chunk, bk


# ---------------------------------------------------------------------------------------------
# Shared pieces


@triton.jit
def _trigger(ON: tl.constexpr):
    """With ``ON`` (``pdl.enabled``): let the next kernel, a decode GEMM launched with PDL, be scheduled as soon as
    every program of this one has started (``qerl/kernels/pdl.py``); it waits for this kernel before reading x."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def _store_u(u_ptr, acc, row, r, M, R, S1, S2):
    """u[row, r] into the segmented layout: segments [0, S1), [S1, S2), [S2, R), each ``[M, len]``."""
    tl.store(u_ptr + segmented(r, row, M, S1, S2, R), acc.to(u_ptr.dtype.element_ty), mask=r < R)


@triton.jit
def _last_arrival(ticket_ptr, row, n):
    """Take ``row``'s ticket once this program's partials are stored: True for the program that draws the
    last of ``n`` (acq_rel: it then sees every other program's partials). That program resets the ticket
    after reading them, so stream order leaves the table at zero for the next launch."""
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel") == n - 1


@triton.jit
def _finish_shrink(acc, row, split, nsplit, M, R, S1, S2, u_ptr, part_ptr, ticket_ptr, RP: tl.constexpr,
                   PART_TILE: tl.constexpr):  # fmt: skip
    """``acc`` [RP] is this program's share of u[row]; the row's last program writes the sum.

    The last program loads the partials ``PART_TILE`` at a time (``part_tile``: all of them at the
    7B shapes) and sums each ``[PART_TILE, RP]`` tile in a fixed tree order, so the result stays
    deterministic. A loop over single partials cost one L2 round trip per four of them (ptxas unrolls
    by 4): ~19 for the 74 partials of the 7B down_proj shrink at b=1.
    """
    r = tl.arange(0, RP)
    if nsplit == 1:
        _store_u(u_ptr, acc, row, r, M, R, S1, S2)
    else:
        tl.store(part_ptr + (row * nsplit + split) * RP + r, acc)
        if _last_arrival(ticket_ptr, row, nsplit):
            total = tl.zeros([RP], tl.float32)
            for s0 in range(0, nsplit, PART_TILE):
                s = s0 + tl.arange(0, PART_TILE)[:, None]
                parts = tl.load(part_ptr + (row * nsplit + s) * RP + r[None, :], mask=s < nsplit, other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                total += tl.sum(parts, axis=0)
            tl.store(ticket_ptr + row, 0)
            _store_u(u_ptr, total, row, r, M, R, S1, S2)


def part_tile(nsplit: int, rp: int) -> int:
    """Partials of a split shrink that its last program sums per load: all of them, up to 4096 values
    (32 registers per thread at 4 warps)."""
    return min(triton.next_power_of_2(nsplit), max(1, 4096 // rp))


@triton.jit
def _load_a(a_ptr, stride_a, cols, mask, R, RP: tl.constexpr):
    """The ``[RP, len(cols)]`` tile of A (rows >= R and masked columns read as 0, no traffic).

    Callers issue it before the loads that x depends on: A comes from DRAM and x from L2, so the
    two latencies overlap instead of adding up (at b=1 latency, not bytes, is what a shrink costs).
    """
    r = tl.arange(0, RP)
    return tl.load(a_ptr + r[:, None] * stride_a + cols[None, :], mask=(r[:, None] < R) & mask[None, :], other=0.0)


@triton.jit
def _rank_dot(y, a):
    """Partial u over a tile's columns: sum_k y[k] * a[r, k] (fp32 from exact products)."""
    return tl.sum(y.to(tl.float32)[None, :] * a.to(tl.float32), axis=1)


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


# ---------------------------------------------------------------------------------------------
# Residual add + RMSNorm (+ LoRA shrink)


@triton.jit
def _rms_norm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
                     PERMUTE: tl.constexpr, TRIGGER: tl.constexpr):  # fmt: skip
    """One program per row; the residual sum is written back in place; PERMUTE: the output in the
    Gluon decode kernel's K order (``fp4_gemm.nibble_major``)."""
    _trigger(TRIGGER)
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
    h_ptr, d_ptr, w_ptr, hout_ptr, out_ptr, a_ptr, u_ptr, part_ptr, ticket_ptr,
    M, K, eps, chunk, R, S1, S2,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, PART_TILE: tl.constexpr,
    PERMUTE: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    """Program (row, split): rstd from the whole row (an L2 read), then its ``chunk`` columns:
    residual sum -> hout, normalised row -> out (PERMUTE: in the Gluon K order), and their share of
    ``u = out @ A.T`` (in natural order: the shrink never reads out back).

    hout is a separate buffer: other programs of the row may still be reading h.
    """
    _trigger(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = row * K
    cols = split * chunk + tl.arange(0, BK)
    a = _load_a(a_ptr, K, cols, cols < K, R, RP)  # in flight while the row is reduced
    offs = tl.arange(0, BLOCK)
    rstd = _rstd(_residual(h_ptr, d_ptr, base + offs, offs < K, HAS_DELTA), K, eps)
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([RP], tl.float32)
    for k0 in range(0, chunk, BK):
        cols = split * chunk + k0 + tl.arange(0, BK)
        mask = cols < K
        nxt = cols + BK
        a_next = _load_a(a_ptr, K, nxt, (nxt < K) & (k0 + BK < chunk), R, RP)
        h = _residual(h_ptr, d_ptr, base + cols, mask, HAS_DELTA)
        if HAS_DELTA:
            tl.store(hout_ptr + base + cols, h, mask=mask)
        y = _normalise(h, rstd, w_ptr, cols, mask, dt)
        tl.store(out_ptr + base + (nibble_major(cols) if PERMUTE else cols), y, mask=mask)
        acc += _rank_dot(y, a)
        a = a_next
    _finish_shrink(acc, row, split, tl.num_programs(1), M, R, S1, S2, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


@triton.jit
def _rms_norm_rank_kernel(
    h_ptr, d_ptr, w_ptr, hout_ptr, out_ptr, a_ptr, u_ptr, M, K, eps, share, R, S1, S2,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr, PERMUTE: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    """Program (row, rank block): the whole row's residual sum and RMSNorm, then ``RB`` ranks of u from it over
    all K columns, stored as they are: no partials, no ticket. Of hout and out it stores its ``share`` of the
    columns. A's rows are loaded first: they come from DRAM and the row from L2, so the two latencies overlap."""
    _trigger(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    a = _load_a(a_ptr + blk * RB * K, K, offs, mask, R - blk * RB, RB)
    base = row * K
    h = _residual(h_ptr, d_ptr, base + offs, mask, HAS_DELTA)
    y = _normalise(h, _rstd(h, K, eps), w_ptr, offs, mask, out_ptr.dtype.element_ty)
    mine = mask & (offs >= blk * share) & (offs < blk * share + share)
    if HAS_DELTA:
        tl.store(hout_ptr + base + offs, h, mask=mine)
    tl.store(out_ptr + base + (nibble_major(offs) if PERMUTE else offs), y, mask=mine)
    _store_u(u_ptr, _rank_dot(y, a), row, blk * RB + tl.arange(0, RB), M, R, S1, S2)


def _permute(permute: bool, row: int) -> bool:
    """``permute`` checked: the Gluon K order moves elements within 256-element steps of a row."""
    if permute and row % reference.GLUON_K_STEP:
        raise ValueError(f"an output in the Gluon decode kernel's K order needs rows of whole 256-element steps, got {row}")
    return permute


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, permute: bool = False
             ) -> torch.Tensor:  # fmt: skip
    """``h += delta`` (in place, when given), then ``weight * rmsnorm(h)`` in h's dtype; ``permute``:
    written in the Gluon decode kernel's K order (rows a multiple of 256), for the GEMM that reads it."""
    n_cols = h.shape[-1]
    out = torch.empty_like(h)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(h.numel() // n_cols,)](
        h, delta if delta is not None else h, weight, out, n_cols, eps,
        HAS_DELTA=delta is not None, BLOCK=block, PERMUTE=_permute(permute, n_cols), TRIGGER=pdl.enabled(h.device),
        num_warps=_norm_warps(block),
    )  # fmt: skip
    return out


#: Rows up to which ``rms_norm_shrink`` splits u's ranks over programs (``_rms_norm_rank_kernel``: each program
#: normalises the whole row and reduces ``rb`` ranks over all of it) instead of the row's columns (partials summed by
#: the row's last program, ``_finish_shrink``), for rows of at most ``RANK_MAX_BLOCK`` columns (held in registers).
#: Why: the column split cost a 7B step 4.0 us a launch at b=1 against 2.0 for the plain RMSNorm, in the chain of
#: each program (benchmarks/NOTES.md, "What the shrink producers spend their time on"); a by-rank program's chain
#: has no partial store, ticket or partial sum. H200, 7B q/k/v (R=48) / gate_up (R=32) shapes, graph-timed with A
#: from DRAM (benchmarks/results/shrink_rank_probe.json), us, column split -> by rank (this rule's choice):
#: b=1 3.95 -> 2.52 / 3.87 -> 2.56, b=8 4.75 -> 3.21 / 4.05 -> 2.77, b=16 5.44 -> 3.47 / 4.39 -> 2.91, b=32 6.61 ->
#: 4.56 / 5.18 -> 3.51 (the plain RMSNorm: 2.0-2.2); the 7B engine, b=1 2.691 / 2.621 -> 2.517 ms a step
#: (rollout_shrink_rank_ab.json), b=8 2.884 / 2.860 -> 2.776, b=16 3.256 / 3.187 -> 3.086, b=32 3.662 / 3.643 -> 3.525
#: (rollout_shrink_rank_ab_b8_32.json); at 48 / 64 rows 11.17 -> 6.13 / 13.18 -> 7.26 and 6.12 -> 4.39 / 9.28 -> 4.49
#: (shrink_rank_probe_48_64.json), which moved ``decoder.FUSED_LORA_MAX_ROWS`` to 64 with it. The same split for the
#: SiLU shrink was 2x slower.
RANK_SPLIT_MAX_ROWS = 64
RANK_MAX_BLOCK = 8192
#: Warps of a by-rank program, the programs a launch aims at, and the most A values a thread holds (``rank_block``:
#: ranks x row width / threads). The same probe: 8 warps were the fastest or within 0.25 us of 4 and 16 at every
#: shape, and the fewest ranks a program that keep a launch at 128 programs the fastest ``rb`` or within 0.1 us, up
#: to 8 ranks of the 7B row (4096 columns padded, 128 values a thread); wider rows (32B: 8192) take fewer ranks a
#: program rather than more values a thread (offline sm_90: 8 ranks of an 8192-column row spill, 4 do not).
RANK_WARPS = 8
RANK_TARGET_PROGRAMS = 128
RANK_MAX_VALUES = 128


def rank_block(rows: int, rank: int, k: int) -> int:
    """Ranks per program of a by-rank shrink over rows of ``k`` columns (``block``: padded to a power of two): a
    power of two, the fewest that keep ``rows`` x blocks at most ``RANK_TARGET_PROGRAMS``, with at most
    ``RANK_MAX_VALUES`` of A a thread; or 0 where the column split serves (more rows than ``RANK_SPLIT_MAX_ROWS``,
    rows wider than ``RANK_MAX_BLOCK``, or ``schedule.SHRINK_BY_RANK`` off)."""
    block = triton.next_power_of_2(k)
    if not schedule.SHRINK_BY_RANK or rows > RANK_SPLIT_MAX_ROWS or block > RANK_MAX_BLOCK:
        return 0
    most = max(1, RANK_MAX_VALUES * 32 * RANK_WARPS // block)
    rb = 1
    while rb < min(rank, most) and rows * triton.cdiv(rank, rb) > RANK_TARGET_PROGRAMS:
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
            *common, m, k, eps, triton.cdiv(k, blocks), rank, bounds[0], bounds[1],
            HAS_DELTA=delta is not None, BLOCK=block, RB=rb, PERMUTE=_permute(permute, k), TRIGGER=pdl.enabled(h.device),
            num_warps=RANK_WARPS,
        )  # fmt: skip
        return h_out, out, u
    rp = rank_pad(rank)
    # At most 8 warps: with 16 the 128-register cap spills the double-buffered A tiles (ptxas, sm_90).
    warps = min(8, _norm_warps(block))
    nsplit, chunk, bk = _shrink_split(m, k, rp, warps)
    part = torch.empty(m * nsplit * rp, dtype=torch.float32, device=h.device)
    _rms_norm_shrink_kernel[(m, nsplit)](
        *common, part, backend.tickets(h.device, m), m, k, eps, chunk, rank, bounds[0], bounds[1],
        HAS_DELTA=delta is not None, BLOCK=block, BK=bk, RP=rp, PART_TILE=part_tile(nsplit, rp),
        PERMUTE=_permute(permute, k), TRIGGER=pdl.enabled(h.device), num_warps=warps,
    )  # fmt: skip
    return h_out, out, u


# ---------------------------------------------------------------------------------------------
# SiLU gating (+ LoRA shrink of down_proj)


@triton.jit
def _silu_gate(g_ptr, u_ptr, offs, mask, DT: tl.constexpr):
    """transformers' ``act_fn(gate) * up``: SiLU rounded to the activation dtype, then the product."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    return (act * u).to(DT)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, PERMUTE: tl.constexpr, TRIGGER: tl.constexpr):
    _trigger(TRIGGER)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dest = nibble_major(offs) if PERMUTE else offs
    tl.store(out_ptr + dest, _silu_gate(g_ptr, u_ptr, offs, mask, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_shrink_kernel(
    g_ptr, up_ptr, out_ptr, a_ptr, u_ptr, part_ptr, ticket_ptr, M, K, chunk, R,
    BK: tl.constexpr, RP: tl.constexpr, PART_TILE: tl.constexpr, PERMUTE: tl.constexpr, TRIGGER: tl.constexpr,
):
    """Program (row, split): SiLU-gate ``chunk`` columns of the row (stored in the Gluon K order with
    PERMUTE) and reduce their share of u."""
    _trigger(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    acc = tl.zeros([RP], tl.float32)
    for k0 in range(0, chunk, BK):
        cols = split * chunk + k0 + tl.arange(0, BK)
        mask = cols < K
        a = _load_a(a_ptr, K, cols, mask, R, RP)
        act = _silu_gate(g_ptr, up_ptr, row * K + cols, mask, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * K + (nibble_major(cols) if PERMUTE else cols), act, mask=mask)
        acc += _rank_dot(act, a)
    _finish_shrink(acc, row, split, tl.num_programs(1), M, R, R, R, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, permute: bool = False) -> torch.Tensor:
    """``silu(gate) * up``; ``permute`` as in ``rms_norm``."""
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, PERMUTE=_permute(permute, gate.shape[-1]),
                                              TRIGGER=pdl.enabled(gate.device), num_warps=4)  # fmt: skip
    return out


def silu_mul_shrink(gate: torch.Tensor, up: torch.Tensor, lora_a: torch.Tensor, permute: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(silu(gate) * up, u = that @ lora_a.T as a flat ``[M * R]`` buffer); ``permute`` as in ``rms_norm``
    (the first result only). Always the column split: a by-rank program would gate the whole row (18,944 columns
    at 7B) and measured 2x slower (benchmarks/NOTES.md, "Twenty-second session")."""
    k = gate.shape[-1]
    m = gate.numel() // k
    rank = lora_a.shape[0]
    rp = rank_pad(rank)
    nsplit, chunk, bk = _shrink_split(m, k, rp, 4)
    out = torch.empty_like(gate)
    u = torch.empty(m * rank, dtype=gate.dtype, device=gate.device)
    part = torch.empty(m * nsplit * rp, dtype=torch.float32, device=gate.device)
    _silu_mul_shrink_kernel[(m, nsplit)](
        gate, up, out, lora_a, u, part, backend.tickets(gate.device, m), m, k, chunk, rank,
        BK=bk, RP=rp, PART_TILE=part_tile(nsplit, rp), PERMUTE=_permute(permute, k), TRIGGER=pdl.enabled(gate.device),
        num_warps=4,
    )
    return out, u


# ---------------------------------------------------------------------------------------------
# RoPE + KV-cache write


@triton.jit
def _rotate_half(offs, D: tl.constexpr):
    """``rotate_half`` as a gather: element ``offs`` of the rotated vector is ``sign * x[partner]``."""
    return (offs + D // 2) % D, tl.where(offs < D // 2, -1.0, 1.0)


@triton.jit
def _rope(x, xr, cos, sin, DT: tl.constexpr):
    """transformers' ``q * cos + rotate_half(q) * sin`` (``xr``: the rotated partner, sign applied), each op
    rounded to the activation dtype as there."""
    a = (x * cos).to(DT).to(tl.float32)
    c = (xr * sin).to(DT).to(tl.float32)
    return (a + c).to(DT)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr,
    skb, skh, sks, svb, svh, svs,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Program (row, j): j < H ropes q head j; then k heads (into the cache); then v heads (copied)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs = tl.arange(0, D)
    partner, sign = _rotate_half(offs, D)
    pos = tl.load(pos_ptr + b)
    dt = qo_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * D + offs).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + offs).to(tl.float32)
    if j < H:
        src = q_ptr + b * (H * D) + j * D
    elif j < H + HKV:
        src = k_ptr + b * (HKV * D) + (j - H) * D
    else:
        src = v_ptr + b * (HKV * D) + (j - H - HKV) * D
    x = tl.load(src + offs).to(tl.float32)
    if j < H + HKV:
        y = _rope(x, tl.load(src + partner).to(tl.float32) * sign, cos, sin, dt)
        if j < H:
            tl.store(qo_ptr + b * (H * D) + j * D + offs, y)
        else:
            tl.store(kc_ptr + b * skb + (j - H) * skh + pos * sks + offs, y)
    else:
        tl.store(vc_ptr + b * svb + (j - H - HKV) * svh + pos * svs + offs, x.to(dt))


def rope_and_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> torch.Tensor:  # fmt: skip
    """RoPE q (returned ``[B, H, D]``) and k, write k and v into cache slot ``pos`` of each row."""
    b = q.shape[0]
    q_out = torch.empty(b, num_heads, head_dim, dtype=q.dtype, device=q.device)
    _rope_cache_kernel[(b, num_heads + 2 * num_kv_heads)](
        q, k, v, cos, sin, pos, q_out, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=num_heads, HKV=num_kv_heads, D=head_dim, num_warps=1,
    )  # fmt: skip
    return q_out


# ---------------------------------------------------------------------------------------------
# Split-K decode attention (+ LoRA shrink of o_proj)


@triton.jit
def _attn_partial_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr,
    skb, skh, sks, svb, svh, svs, scale, chunk, nsplit,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """Flash-decoding partials: program (row*kv-head, split) attends G query heads to one key chunk
    of the row's valid prefix (slots <= pos). With ROPE, q comes un-rotated and every program ropes its
    heads itself; the program whose chunk holds slot pos also ropes this step's key (``kn_ptr``) and
    writes it and the value (``vn_ptr``) into the cache before reading its chunk (``_rope_cache_kernel``'s
    work, bit for bit, without its launch)."""
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    kvh = bh % HKV
    length = tl.load(pos_ptr + b) + 1
    start = sp * chunk
    end = tl.minimum(start + chunk, length)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q_rows = q_ptr + b * (HKV * G * D) + heads[:, None] * D
    q = tl.load(q_rows + offs_d[None, :], mask=gmask[:, None], other=0.0)
    if ROPE:
        dt = q_ptr.dtype.element_ty
        partner, sign = _rotate_half(offs_d, D)
        pos = length - 1
        cos = tl.load(cos_ptr + pos * D + offs_d).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + offs_d).to(tl.float32)
        q_r = tl.load(q_rows + partner[None, :], mask=gmask[:, None], other=0.0).to(tl.float32) * sign[None, :]
        q = _rope(q.to(tl.float32), q_r, cos[None, :], sin[None, :], dt)
        if (start <= pos) & (pos < end):
            new = b * (HKV * D) + kvh * D
            k_r = tl.load(kn_ptr + new + partner).to(tl.float32) * sign
            k_new = _rope(tl.load(kn_ptr + new + offs_d).to(tl.float32), k_r, cos, sin, dt)
            tl.store(k_ptr + b * skb + kvh * skh + pos * sks + offs_d, k_new)
            tl.store(v_ptr + b * svb + kvh * svh + pos * svs + offs_d, tl.load(vn_ptr + new + offs_d))
            tl.debug_barrier()  # the chunk loop below reads slot pos back
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # The loop stops at the row's own length (``pos`` is read on the device, so one compile and one
    # CUDA graph serve every batch and KV bucket): a bucket holds up to 255 slots past a row's end, and
    # walking them masked cost 14% of this kernel at b = 64 / 128 (H200, 7B shapes, NOTES.md).
    for n0 in range(0, tl.maximum(tl.minimum(chunk, end - start), 0), BLOCK_N):
        offs_n = start + n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        k = tl.load(
            k_ptr + b * skb + kvh * skh + offs_n[:, None] * sks + offs_d[None, :], mask=nmask[:, None], other=0.0
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + b * svb + kvh * svh + offs_n[:, None] * svs + offs_d[None, :], mask=nmask[:, None], other=0.0
        )
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    slot = (b * (HKV * G) + heads) * nsplit + sp
    tl.store(m_ptr + slot, m_i, mask=gmask)
    tl.store(l_ptr + slot, l_i, mask=gmask)
    tl.store(acc_ptr + slot[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _attn_combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, a_ptr, u_ptr, part_ptr, ticket_ptr, nsplit, B, H, R,
    NSP: tl.constexpr, D: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr, PERMUTE: tl.constexpr,
    PART_TILE: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    """Program (row*head): merge the head's split partials; with LoRA, its share of ``u = out @ A.T``
    (the head's D columns of A), summed over the row's heads by the last program."""
    _trigger(TRIGGER)
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, NSP)
    offs_d = tl.arange(0, D)
    if HAS_LORA:
        a = _load_a(a_ptr, H * D, (bh % H) * D + offs_d, offs_d < D, R, RP)
    smask = offs_s < nsplit
    m = tl.load(m_ptr + bh * nsplit + offs_s, mask=smask, other=float("-inf"))
    lsum = tl.load(l_ptr + bh * nsplit + offs_s, mask=smask, other=0.0)
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - tl.max(m, axis=0)), 0.0)
    acc = tl.load(acc_ptr + (bh * nsplit + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = (tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)).to(out_ptr.dtype.element_ty)
    dest = nibble_major(bh * D + offs_d) if PERMUTE else bh * D + offs_d
    tl.store(out_ptr + dest, out)
    if HAS_LORA:
        _finish_shrink(_rank_dot(out, a), bh // H, bh % H, H, B, R, R, R, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    lora_a: torch.Tensor | None = None,
    permute: bool = False,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q ``[B, H, D]`` against cache rows ``[B, Hkv, S, D]`` (valid slots ``<= pos``) -> ``[B, H*D]``;
    with ``lora_a`` ``[R, H*D]`` also ``u = out @ lora_a.T`` (flat ``[B * R]``), else None.
    ``permute`` as in ``rms_norm`` (out only; u is the same). ``rope = (k, v, cos, sin)``: q is not rotated
    yet and this step's k / v (``[B, Hkv*D]``) are not in the cache: ``rope_and_cache``'s work is done here."""
    b, h, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = h // hkv
    block_n = 64 if d <= 64 else 32
    nsplit = max(1, min(triton.cdiv(s, block_n), _TARGET_PROGRAMS // max(1, b * hkv)))
    chunk = triton.cdiv(triton.cdiv(s, nsplit), block_n) * block_n
    nsplit = triton.cdiv(s, chunk)
    m = torch.empty(b * h * nsplit, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(b * h * nsplit, d, dtype=torch.float32, device=q.device)
    kn, vn, cos, sin = rope if rope is not None else (q, q, q, q)
    _attn_partial_kernel[(b * hkv, nsplit)](
        q, k_cache, v_cache, pos, m, lsum, acc, kn, vn, cos, sin,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale, chunk, nsplit,
        HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, ROPE=rope is not None, num_warps=4,
    )  # fmt: skip
    out = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    rank = 0 if lora_a is None else lora_a.shape[0]
    rp = rank_pad(rank)
    u = part = tickets = None
    if lora_a is not None:
        u = torch.empty(b * rank, dtype=q.dtype, device=q.device)
        part = torch.empty(b * h * rp, dtype=torch.float32, device=q.device)
        tickets = backend.tickets(q.device, b)
    _attn_combine_kernel[(b * h,)](
        m, lsum, acc, out, lora_a if lora_a is not None else out, u if u is not None else out,
        part if part is not None else m, tickets if tickets is not None else m, nsplit, b, h, rank,
        NSP=triton.next_power_of_2(nsplit), D=d, HAS_LORA=lora_a is not None, RP=rp, PERMUTE=_permute(permute, h * d),
        PART_TILE=part_tile(h, rp), TRIGGER=pdl.enabled(q.device), num_warps=4,
    )  # fmt: skip
    return out, u


# ---------------------------------------------------------------------------------------------
# Sampling


@triton.jit
def exponential(seed_ptr, step_ptr, row, cols, V):
    """The race's E ~ Exp(1) of (step, row, columns): ``-log U``, U Philox-uniform in [0, 1) at counter
    ``step * 2^32 + row * V + column`` under the key ``seed``; clamped to the smallest normal float so
    that ``log E`` stays finite (U = 0 gives E = inf: that token cannot win)."""
    counter = (tl.load(step_ptr) << 32) | (row * V + cols).to(tl.int64)
    return tl.maximum(-tl.log(tl.rand(tl.load(seed_ptr), counter)), 1.1754943508222875e-38)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_l, temp_ptr, seed_ptr, step_ptr, part_ptr, idx_ptr, ticket_ptr, tok_ptr, lp_ptr, V,
    GREEDY: tl.constexpr, BLOCK: tl.constexpr, NSP: tl.constexpr,
):  # fmt: skip
    """Program (row, split): ``BLOCK`` logits of the row -> (max, sum of exp below it, best race score,
    its index, its scaled logit); the row's last program combines the splits in split order.

    The race is ``rollout.sampling.sample``'s: ``argmax(x / T - log E)``, ``E = -log U`` exponential,
    which picks token i with probability softmax(x / T)_i; the normaliser never enters the argmax, so
    one pass over the logits gives the token and, with the splits' (max, sum), its log-prob. E comes
    from ``exponential``: a fresh, reproducible draw per step, row and token without a host round trip.
    GREEDY: no race and T = 1, i.e. the argmax and its log-prob under the unprocessed softmax.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    cols = split * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if GREEDY:
        race = x
    else:
        x = x / tl.load(temp_ptr)
        race = tl.where(mask, x - tl.log(exponential(seed_ptr, step_ptr, row, cols, V)), float("-inf"))
    best = tl.argmax(race, axis=0)  # the first of equal scores, as torch.argmax
    m = tl.max(x, axis=0)
    slot = row * NSP + split
    tl.store(part_ptr + slot * 4, m)
    tl.store(part_ptr + slot * 4 + 1, tl.sum(tl.exp(x - m), axis=0))
    tl.store(part_ptr + slot * 4 + 2, tl.max(race, axis=0))
    tl.store(part_ptr + slot * 4 + 3, tl.sum(tl.where(tl.arange(0, BLOCK) == best, x, 0.0), axis=0))
    tl.store(idx_ptr + slot, split * BLOCK + best)
    if _last_arrival(ticket_ptr, row, nsplit):
        s = tl.arange(0, NSP)
        live = s < nsplit
        base = part_ptr + (row * NSP + s) * 4
        ms = tl.load(base, mask=live, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(base + 1, mask=live, other=0.0, cache_modifier=".cg")
        races = tl.load(base + 2, mask=live, other=float("-inf"), cache_modifier=".cg")
        xs = tl.load(base + 3, mask=live, other=0.0, cache_modifier=".cg")
        top = tl.max(ms, axis=0)
        lse = top + tl.log(tl.sum(sums * tl.exp(ms - top), axis=0))
        win = tl.argmax(races, axis=0)  # the first split with the best score: the smallest index
        tl.store(tok_ptr + row, tl.load(idx_ptr + row * NSP + win, cache_modifier=".cg").to(tl.int64))
        tl.store(lp_ptr + row, tl.sum(tl.where(s == win, xs, 0.0), axis=0) - lse)
        tl.store(ticket_ptr + row, 0)


#: Logits a sampling program reads: V = 152k spreads a b=1 row over ~75 programs (the b=1 step's latency).
SAMPLE_BLOCK = 2048


def sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, greedy: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``rollout.sampling.sample`` without top-k / top-p, in one launch: ``(tokens int64 [B], log-probs fp32
    [B])`` of ``logits [B, V]`` at ``temperature`` (a 0-d tensor), drawn with Philox from the int64
    ``seed`` and ``step`` tensors (read at run time: a captured graph replays with new values). Replaces
    ~10 torch launches (a fp32 copy, log_softmax, the exponential draw, argmax, gathers) that each moved
    the whole ``[B, V]`` matrix."""
    b, v = logits.shape
    nsplit = triton.cdiv(v, SAMPLE_BLOCK)
    nsp = triton.next_power_of_2(nsplit)
    part = torch.empty(b * nsp * 4, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b * nsp, dtype=torch.int32, device=logits.device)
    tok = torch.empty(b, dtype=torch.long, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    _sample_kernel[(b, nsplit)](
        logits, logits.stride(0), temperature, seed, step, part, idx, backend.tickets(logits.device, b), tok, lp, v,
        GREEDY=greedy, BLOCK=SAMPLE_BLOCK, NSP=nsp, num_warps=4,
    )  # fmt: skip
    return tok, lp


# ---------------------------------------------------------------------------------------------
# Step bookkeeping


@triton.jit
def _finish_step_kernel(
    tok_ptr, lp_ptr, done_ptr, row_ptr, stop_ptr, step_ptr, tokens_ptr, pos_ptr, out_tok_ptr, out_lp_ptr,
    b, n_stop, pad_id, out_stride, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program for all rows: what ``native._finish_step`` does in ~12 torch ops."""
    offs = tl.arange(0, BLOCK)
    mask = offs < b
    step = tl.load(step_ptr)
    done = tl.load(done_ptr + offs, mask=mask, other=1) != 0
    tok = tl.where(done, pad_id, tl.load(tok_ptr + offs, mask=mask, other=0))
    lp = tl.where(done, 0.0, tl.load(lp_ptr + offs, mask=mask, other=0.0))
    row = tl.load(row_ptr + offs, mask=mask, other=0)
    tl.store(out_tok_ptr + row * out_stride + step, tok, mask=mask)
    tl.store(out_lp_ptr + row * out_stride + step, lp, mask=mask)
    hit = done
    for j in range(0, n_stop):
        hit = hit | (tok == tl.load(stop_ptr + j))
    tl.store(done_ptr + offs, hit, mask=mask)
    tl.store(tokens_ptr + offs, tok, mask=mask)
    tl.store(pos_ptr + offs, tl.load(pos_ptr + offs, mask=mask, other=0) + 1, mask=mask)
    tl.debug_barrier()  # every thread has read `step` before it moves on
    tl.store(step_ptr, step + 1)


def finish_step(
    tok: torch.Tensor, lp: torch.Tensor, done: torch.Tensor, row_id: torch.Tensor, stop: torch.Tensor,
    step: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, out_tok: torch.Tensor, out_lp: torch.Tensor,
    pad_id: int,
) -> None:  # fmt: skip
    """Record this step's tokens/log-probs (pad and 0 for finished rows), mark stop tokens done, feed
    the tokens back, advance positions and the step counter: one launch."""
    b = tok.shape[0]
    _finish_step_kernel[(1,)](
        tok, lp, done, row_id, stop, step, tokens, pos, out_tok, out_lp, b, stop.numel(), pad_id,
        out_tok.stride(0), BLOCK=max(16, triton.next_power_of_2(b)), num_warps=4,
    )  # fmt: skip
