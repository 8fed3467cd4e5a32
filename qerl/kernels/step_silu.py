"""The decode step's SiLU gating (transformers' ``act_fn(gate) * up``) before down_proj, with down_proj's LoRA shrink
fused in (``step_base``: a column split whose partials each row's last program sums), writing its output in the Gluon
decode kernel's K order when the GEMM after it reads that order (``gluon_k``). One launch each, transformers'
rounding (the SiLU rounded to the activation dtype before the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend, pdl
from .fp4_base import gluon_k_offsets
from .step_base import check_gluon_k, finish_shrink, load_a, part_tile, rank_dot, rank_pad, shrink_split, trigger


@triton.jit
def _silu_gate(g_ptr, u_ptr, offs, mask, DT: tl.constexpr):
    """transformers' ``act_fn(gate) * up``: SiLU rounded to the activation dtype, then the product."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    return (act * u).to(DT)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, GLUON_K: tl.constexpr, TRIGGER: tl.constexpr):
    trigger(TRIGGER)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dest = gluon_k_offsets(offs) if GLUON_K else offs
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
    GLUON_K: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program (row, split): SiLU-gate ``chunk`` columns of the row (stored in the Gluon K order with
    GLUON_K) and reduce their share of u."""
    trigger(TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    acc = tl.zeros([RP], tl.float32)
    for k0 in range(0, chunk, BK):
        cols = split * chunk + k0 + tl.arange(0, BK)
        mask = cols < K
        a = load_a(a_ptr, K, cols, mask, R, RP)
        act = _silu_gate(g_ptr, up_ptr, row * K + cols, mask, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * K + (gluon_k_offsets(cols) if GLUON_K else cols), act, mask=mask)
        acc += rank_dot(act, a)
    finish_shrink(acc, row, split, tl.num_programs(1), M, R, R, R, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, gluon_k: bool = False) -> torch.Tensor:
    """``silu(gate) * up``; ``gluon_k`` as in ``rms_norm``."""
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](
        gate,
        up,
        out,
        n,
        BLOCK=1024,
        GLUON_K=check_gluon_k(gluon_k, gate.shape[-1]),
        TRIGGER=pdl.enabled(gate.device),
        num_warps=4,
    )
    return out


def silu_mul_shrink(
    gate: torch.Tensor, up: torch.Tensor, lora_a: torch.Tensor, gluon_k: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up, u = that @ lora_a.T as a flat ``[M * R]`` buffer); ``gluon_k`` as in ``rms_norm``
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
    tickets = backend.tickets(gate.device, m)
    _silu_mul_shrink_kernel[(m, nsplit)](
        gate,
        up,
        out,
        lora_a,
        u,
        part,
        tickets,
        m,
        k,
        chunk,
        rank,
        BK=bk,
        RP=rp,
        PART_TILE=part_tile(nsplit, rp),
        GLUON_K=check_gluon_k(gluon_k, k),
        TRIGGER=pdl.enabled(gate.device),
        num_warps=4,
    )
    return out, u
