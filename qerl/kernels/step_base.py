"""What the decode-step kernels share (``step_norm``, ``step_attention``, ``step_sampler``): the LoRA shrink's
split-K partials and per-row tickets, the programmatic-dependent-launch trigger, and the Gluon K order check.

LoRA shrinks ride along instead of costing launches of their own: ``u = x @ A.T`` (A is ``[R, K]``, R = 16-64
summed over the projections sharing x) is reduced by the kernel that *produces* x: the residual-add + RMSNorm
kernel for q/k/v and gate/up (x = the normalised row), the SiLU-gating kernel for down_proj, the attention combine
kernel for o_proj. Those kernels split the row's K columns over programs (a GEMV over R x K at b=1 would otherwise
be one SM reading ~340 KB); each program writes an fp32 partial of u, and the program that draws a row's last
ticket sums the partials (loaded as one tile, summed in a fixed order: deterministic) and writes u in the
activation dtype. Tickets (``backend.tickets``) are per row, zero between launches (the last program resets its
own). ``u`` comes back *segmented*: projection j's ``[M, r_j]`` block is contiguous (``flat[start_j * M : end_j *
M]``), so the FP4 kernel's LoRA epilogue reads it without a ``.contiguous()`` copy.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from . import gluon_layout
from .fp4_base import segmented

#: Programs split-K attention and shrinks aim at: about two an SM; four times that was slower (docs/kernels.md#design).
TARGET_PROGRAMS = 264


def rank_pad(rank: int) -> int:
    """Register width of a rank vector (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(rank))


def shrink_split(rows: int, k: int, rp: int, warps: int) -> tuple[int, int, int]:
    """(programs per row, columns per program, columns per loop step) of a split shrink.

    A loop step holds an ``[rp, bk]`` tile of A, ~32 values per thread; rows x splits aims for
    ``TARGET_PROGRAMS`` (a b=1 row is spread over the SMs, a b=64 row over few programs).
    """
    bk = max(32, min(512, triton.next_power_of_2(max(1, warps * 32 * 32 // rp))))
    nsplit = max(1, min(triton.cdiv(TARGET_PROGRAMS, rows), triton.cdiv(k, bk)))
    chunk = triton.cdiv(triton.cdiv(k, nsplit), bk) * bk
    return triton.cdiv(k, chunk), chunk, bk


@triton.jit
def trigger(ON: tl.constexpr):
    """With ``ON`` (``pdl.enabled``): let the next kernel, a decode GEMM launched with PDL, be scheduled as soon as
    every program of this one has started (``qerl/kernels/pdl.py``); it waits for this kernel before reading x."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def store_u(u_ptr, acc, row, r, M, R, S1, S2):
    """u[row, r] into the segmented layout: segments [0, S1), [S1, S2), [S2, R), each ``[M, len]``."""
    tl.store(u_ptr + segmented(r, row, M, S1, S2, R), acc.to(u_ptr.dtype.element_ty), mask=r < R)


@triton.jit
def last_arrival(ticket_ptr, row, n):
    """Take ``row``'s ticket once this program's partials are stored: True for the program that draws the
    last of ``n`` (acq_rel: it then sees every other program's partials). That program resets the ticket
    after reading them, so stream order leaves the table at zero for the next launch."""
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel") == n - 1


@triton.jit
def finish_shrink(
    acc, row, split, nsplit, M, R, S1, S2, u_ptr, part_ptr, ticket_ptr, RP: tl.constexpr, PART_TILE: tl.constexpr
):
    """``acc`` [RP] is this program's share of u[row]; the row's last program writes the sum.

    The last program loads the partials ``PART_TILE`` at a time (``part_tile``: all of them at the
    7B shapes) and sums each ``[PART_TILE, RP]`` tile in a fixed tree order, so the result stays
    deterministic. A loop over single partials cost one L2 round trip per four of them (ptxas unrolls
    by 4): ~19 for the 74 partials of the 7B down_proj shrink at b=1.
    """
    r = tl.arange(0, RP)
    if nsplit == 1:
        store_u(u_ptr, acc, row, r, M, R, S1, S2)
    else:
        tl.store(part_ptr + (row * nsplit + split) * RP + r, acc)
        if last_arrival(ticket_ptr, row, nsplit):
            total = tl.zeros([RP], tl.float32)
            for s0 in range(0, nsplit, PART_TILE):
                s = s0 + tl.arange(0, PART_TILE)[:, None]
                parts = tl.load(
                    part_ptr + (row * nsplit + s) * RP + r[None, :], mask=s < nsplit, other=0.0, cache_modifier=".cg"
                )
                total += tl.sum(parts, axis=0)
            tl.store(ticket_ptr + row, 0)
            store_u(u_ptr, total, row, r, M, R, S1, S2)


def part_tile(nsplit: int, rp: int) -> int:
    """Partials of a split shrink that its last program sums per load: all of them, up to 4096 values
    (32 registers per thread at 4 warps)."""
    return min(triton.next_power_of_2(nsplit), max(1, 4096 // rp))


@triton.jit
def load_a(a_ptr, stride_a, cols, mask, R, RP: tl.constexpr):
    """The ``[RP, len(cols)]`` tile of A (rows >= R and masked columns read as 0, no traffic).

    Callers issue it before the loads that x depends on: A comes from DRAM and x from L2, so the
    two latencies overlap instead of adding up (at b=1 latency, not bytes, is what a shrink costs).
    """
    r = tl.arange(0, RP)
    return tl.load(a_ptr + r[:, None] * stride_a + cols[None, :], mask=(r[:, None] < R) & mask[None, :], other=0.0)


@triton.jit
def rank_dot(y, a):
    """Partial u over a tile's columns: sum_k y[k] * a[r, k] (fp32 from exact products)."""
    return tl.sum(y.to(tl.float32)[None, :] * a.to(tl.float32), axis=1)


def check_gluon_k(gluon_k: bool, row: int) -> bool:
    """``gluon_k`` checked: the Gluon K order moves elements within 256-element steps of a row."""
    if gluon_k and not gluon_layout.fits(row):
        raise ValueError(
            f"an output in the Gluon decode kernel's K order needs rows of whole 256-element steps, got {row}"
        )
    return gluon_k
