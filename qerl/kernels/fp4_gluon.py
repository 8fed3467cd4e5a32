"""A Marlin-structured NVFP4 decode GEMM in Gluon (Triton's explicit-layout dialect), for Hopper (sm_90) only: the
``fp4_gluon`` rule of ``fp4_gemm.ROUTES`` (docs/kernels.md#routing says which GEMMs it takes).

Why another kernel: the Triton decode kernel's time at M >= 64 went to its CTA-wide barrier every K step, global
loads of scales and x into registers and the decode's latency chains, never to the tensor cores; Triton 3.6 cannot
express the fix for a register A operand, Gluon can (docs/kernels.md#gluon-kernel). Here:

* a one-warp producer partition streams the K steps through TMA into a ``STAGES``-deep ring (x, the packed weight as
  int16 words of 4 codes, the fp8 scales) with mbarriers and no CTA barrier; a slot's weights are released once the
  consumer's loads of them are safe from the refill, its x once the step's wgmma are done
  (docs/kernels.md#gluon-early-release);
* a four-warp consumer warpgroup loads each weight tile from shared memory straight into the wgmma A-operand
  registers, decodes nibble ``i`` (``fp4_base.nibble``), multiplies by the block scale (converted once per row and
  group, broadcast by a layout checked trivial at compile time) and issues ``wgmma`` asynchronously, so the decode of
  nibble ``i + 1`` overlaps the MMA of nibble ``i``;
* x comes in the Gluon K order (``gluon_layout``), so each nibble's x slice is a contiguous block of the
  TMA tile and the wgmma B operand is read from shared memory as loaded.

``fp4_gemm.matmul``'s decode contract (the ``Epilogue``), M <= 128 padded to BM = 16..128 tokens (the wgmma N
dimension); split-K with the Triton kernel's ticket reduction, partials in 16-byte vectors
(``gluon_base.split_k_sum``), and up to ``BALANCE_MAX_BM`` tokens a balanced 1-D grid (docs/kernels.md#balanced-split);
programmatic dependent launch where the caller allows it (``pdl.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qerl.nvfp4 import NVFP4Tensors

from . import gluon_layout
from .epilogue import PLAIN, Epilogue
from .fp4_base import check_act, check_weight, segmented
from .gluon_base import launch_tail, split_k_sum, store_tile, tile_offsets
from .pdl import gemm_launch
from .schedule import balanced_split, cdiv, resolve_split, sm_count
from .wgmma_loop import acc_layout, consumer, producer

#: K codes per step (a TMA box row of scales must hold 16 bytes: BK / 16 >= 16) and weight rows per CTA
#: (one consumer warpgroup: wgmma M = 64).
BK = gluon_layout.K_STEP
BN = 64
#: Per padded token count BM: (ring stages, register cap, CTAs an SM holds, a program's fixed cost in K steps
#: for ``decode_split``). Stages and caps that fit the most CTAs an SM without spills (offline sm_90; BM=32 plans for 2
#: of its 3), the fixed cost fitted on split sweeps (docs/kernels.md#gluon-schedule).


class GluonSchedule(NamedTuple):
    """How the TMA/wgmma decode kernel runs at one padded token count BM (docs/kernels.md#gluon-schedule)."""

    stages: int  #: weight / x ring stages
    maxnreg: int | None  #: register cap per thread (None: uncapped)
    resident: int  #: CTAs an SM holds at that cap, which ``decode_split`` plans waves with
    program_steps: int  #: a program's fixed cost in K steps, ``decode_split``'s one parameter


SCHEDULE = {
    16: GluonSchedule(stages=3, maxnreg=80, resident=3, program_steps=8),
    32: GluonSchedule(stages=2, maxnreg=80, resident=2, program_steps=6),
    64: GluonSchedule(stages=2, maxnreg=128, resident=2, program_steps=6),
    128: GluonSchedule(stages=2, maxnreg=None, resident=1, program_steps=6),
}

#: Split-K partials the last program reads per round trip, per BM (``split_k_sum``, vector partials): a partial
#: is BM / 2 fp32 registers a thread, so these keep the loads in flight to 32-64 registers (two at BM=128 spilled,
#: offline sm_90; docs/kernels.md#gluon-split-chunk).
SPLIT_CHUNK = {16: 4, 32: 4, 64: 2, 128: 1}
#: The BMs whose K loop releases a weight slot right after its loads, behind a proxy fence (``consumer``); the others
#: release it after the step's wgmma are issued. Both are exact; the fence is faster at BM=64 only
#: (docs/kernels.md#fenced-release).
FENCED_RELEASE = (64,)
#: Up to this BM the split the wave model picks is balanced over the resident slots where that lightens the busiest
#: SM (``schedule.balanced_split``); at BM=128 (one CTA an SM) it lost, so that BM keeps the uniform split
#: (docs/kernels.md#balanced-split).
BALANCE_MAX_BM = 64
#: The BMs launched with programmatic dependent launch where the caller asks for it (``pdl.py``). Not 32: its split is
#: planned for 2 CTAs an SM of the 3 that fit, and the 7B engine at b=32 was 6% slower with PDL (docs/kernels.md#pdl-bm).
PDL_BM = (16, 64, 128)


@gluon.jit
def _lora_expand(
    pid_n, M, N, u_ptr, S1, S2, lb_ptr, stride_lb, R, BM: gl.constexpr, BN: gl.constexpr, RC: gl.constexpr
):
    """B[n, :] . u[m, :] for the tile as wgmma over RC-wide rank chunks staged through shared memory:
    bf16 operands, fp32 sum, as the Triton kernel's ``tl.dot``. R fp32 rank-1 updates instead (each gathering a
    column of B and a segmented column of u) cost ~300 instructions per thread per rank, 10x the tile's K loop for
    the 7B q/k/v group (R = 48), and made the engine slower than with the Triton kernel although each GEMM alone
    was faster (docs/kernels.md)."""
    mma: gl.constexpr = acc_layout(BM)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    b_s = gl.allocate_shared_memory(gl.bfloat16, [BN, RC], gl.NVMMASharedLayout.get_default_for([BN, RC], gl.bfloat16))
    u_s = gl.allocate_shared_memory(gl.bfloat16, [BM, RC], gl.NVMMASharedLayout.get_default_for([BM, RC], gl.bfloat16))
    rows_n = gl.expand_dims(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld)), 1)
    rows_m = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, ld)), 1)
    cols = gl.expand_dims(gl.arange(0, RC, layout=gl.SliceLayout(0, ld)), 0)
    lora = gl.zeros([BN, BM], gl.float32, layout=mma)
    for c in range(0, R, RC):
        r = c + cols
        b = gl.load(lb_ptr + rows_n * stride_lb + r, mask=(rows_n < N) & (r < R), other=0.0)
        u = gl.load(u_ptr + segmented(r, rows_m, M, S1, S2, R), mask=(rows_m < M) & (r < R), other=0.0)
        gl.thread_barrier()  # the previous chunk's wgmma has read both buffers
        b_s.store(b.to(gl.bfloat16))
        u_s.store(u.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        lora = warpgroup_mma(b_s, u_s.permute((1, 0)), lora)
    return lora


@gluon.jit
def _slice_of(pid, tiles, base, extra):
    """(tile, slice, the tile's slice count) of 1-D program ``pid`` under ``schedule.balanced_split``'s
    ``(base, extra)``: the ``tiles - extra`` tiles of ``base`` (longer) slices first, slice-major, then the last
    ``extra`` tiles of ``base + 1``, so the block scheduler's first round spreads the long programs over the SMs."""
    n_long = tiles - extra
    if pid < n_long * base:
        pid_n = pid % n_long
        pid_k = pid // n_long
        nsplit = base
    else:
        q = pid - n_long * base
        pid_n = n_long + q % extra
        pid_k = q // extra
        nsplit = base + 1
    return pid_n, pid_k, nsplit


@gluon.jit
def _decode_gluon_kernel(
    x_desc,
    h_desc,
    s_desc,
    g_ptr,
    y_ptr,
    part_ptr,
    ticket_ptr,
    bias_ptr,
    u_ptr,
    lb_ptr,
    M,
    N,
    K,
    base,
    extra,
    Y1,
    Y2,
    S1,
    S2,
    stride_lb,
    R,
    lora_scale,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT: gl.constexpr,
    CH: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    RC: gl.constexpr,
    FENCED: gl.constexpr,
    PDL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Program (weight tile, K slice: ``_slice_of``; a tile's slices split its K steps evenly): the
    warp-specialized K loop, then the split-K ticket epilogue. ``PDL``: the producer waits for the kernel before
    this one after the first weights (``producer``), the epilogue's warps before their global reads and stores."""
    if PDL:
        gdc_launch_dependents()
    tiles = gl.cdiv(N, BN)
    pid_n, pid_k, nsplit = _slice_of(gl.program_id(0), tiles, base, extra)
    k_steps = K // BK
    first = pid_k * k_steps // nsplit
    steps = (pid_k + 1) * k_steps // nsplit - first
    x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    h_s = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BN, BK // 4], h_desc.layout)
    s_s = gl.allocate_shared_memory(s_desc.dtype, [STAGES, BN, BK // 16], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free_w = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free_x = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free_w.index(i), count=1)
        mbarrier.init(free_x.index(i), count=1)
    fence_async_shared()
    (acc,) = gl.warp_specialize(
        [
            (consumer, (x_s, h_s, s_s, ready, free_w, free_x, steps, FENCED)),
            (producer, (x_desc, h_desc, s_desc, x_s, h_s, s_s, ready, free_w, free_x, pid_n * BN, first, steps, PDL)),
        ],
        [1],
        [24],
    )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(free_w.index(i))
        mbarrier.invalidate(free_x.index(i))
    if PDL:
        gdc_wait()  # returns at once (the producer's wait came before any x arrived); orders these warps' reads

    offs_n, offs, mask = tile_offsets(pid_n, M, N, Y1, Y2, BN, BM, acc_layout(BM))
    run = True
    if SPLIT:
        acc, run = split_k_sum(acc, pid_n, pid_k, nsplit, tiles, part_ptr, ticket_ptr, offs, mask, M, N, CH, True)
    if run:
        lora = acc
        if HAS_LORA:
            lora = _lora_expand(pid_n, M, N, u_ptr, S1, S2, lb_ptr, stride_lb, R, BM, BN, RC)
        store_tile(acc, lora, g_ptr, offs_n, offs, mask, N, y_ptr, bias_ptr, lora_scale, HAS_BIAS, HAS_LORA)


def supports(M: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Hopper, bf16 activations, M <= 128 and whole K steps: what this kernel covers."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and dtype == torch.bfloat16
        and M <= 128
        and K % BK == 0
    )


def matmul(
    x: torch.Tensor,
    weight: NVFP4Tensors,
    *,
    epilogue: Epilogue = PLAIN,
    out: torch.Tensor | None = None,
    split: int = 0,
    gluon_k: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """``fp4_gemm.matmul``'s decode contract (the ``epilogue``; operands checked there when it dispatches here)
    through the Gluon kernel; see ``supports`` for what it takes. ``gluon_k``: x is already in
    the Gluon K order (``gluon_layout``; as the rollout engine's producers write it). ``split``: K slices for every tile
    (0: ``decode_split``'s choice, balanced over the resident slots up to ``BALANCE_MAX_BM``). ``pdl``: a
    programmatic dependent launch (``pdl.py``; the caller vouches that no kernel in flight writes the weights)."""
    check_act(x)
    N, K = check_weight(weight)
    M = x.shape[0]
    if not supports(M, K, x.dtype, x.device) or x.shape[1] != K:
        raise ValueError(
            f"the Gluon decode kernel takes bf16 x [M <= 128, {K}] on sm_90 with K % {BK} == 0, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    bm = max(16, triton.next_power_of_2(M))
    stages, maxnreg, resident, program_steps = SCHEDULE[bm]
    k_steps = K // BK
    tiles = cdiv(N, BN)
    sms = sm_count(x.device)
    base = resolve_split(tiles, k_steps, split, sms * resident, program_steps)
    extra = 0
    if split <= 0 and bm <= BALANCE_MAX_BM:
        base, extra = balanced_split(tiles, base, sms * resident, k_steps, sms)
    out, tail = launch_tail(x, weight, epilogue, out, tiles=tiles, tile_size=BN * bm, slices=base + (extra > 0))
    _decode_gluon_kernel[(tiles * base + extra,)](
        *_descriptors(x if gluon_k else gluon_layout.to_gluon_k(x), weight, bm),
        base=base,
        extra=extra,
        BM=bm,
        BN=BN,
        BK=BK,
        STAGES=stages,
        CH=SPLIT_CHUNK[bm],
        FENCED=bm in FENCED_RELEASE,
        num_warps=4,
        **tail,
        **({"maxnreg": maxnreg} if maxnreg else {}),
        **gemm_launch(pdl and bm in PDL_BM, x.device, weight.weight_packed, weight.weight_scale),
    )
    return out


def _descriptors(xp: torch.Tensor, weight: NVFP4Tensors, bm: int) -> tuple[object, object, object]:
    """TMA descriptors of x (in the Gluon K order), the packed weight (int16 elements) and its scales, one kernel
    tile a box."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t: torch.Tensor, box: list[int], dtype: object) -> object:
        return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, dtype))

    return (
        desc(xp.contiguous(), [bm, BK], gl.bfloat16),
        desc(weight.weight_packed.contiguous().view(torch.int16), [BN, BK // 4], gl.int16),
        desc(weight.weight_scale.contiguous(), [BN, BK // 16], gl.float8e4nv),
    )
