"""An NVFP4 decode GEMM for the fewest tokens (M <= 8) in Gluon: every warp loads its packed weights and
scales straight from global memory into ``mma.sync`` operand registers, one K step ahead, reads x from
its program's x slice staged in shared memory (a ring refilled every ``MAX_STEPS`` K steps of a longer
slice), and never waits for another warp inside the K loop between fills.

Why: at M = 1..8 the Triton decode kernel waits on its shared-memory ring's per-K-step barrier and has too few warps
to hide its loads; ``mma.sync`` (m16n8k16), unlike wgmma, needs neither its A operand in shared memory nor a
warpgroup to issue it (docs/kernels.md#direct-kernel). Here:

* each warp owns 16 weight rows (the MMA's M); the tokens are its N (8; rows past M are never stored);
* A is ``DotOperandLayout(k_width=8)``: per 64-element K step a thread holds two runs of 8 int16 elements (one
  16-byte load each) of each of its two rows, straight from the checkpoint's layout (no repack), loaded and carried
  as int32 words (``word_layout``; int16 elements cost PRMTs a step) and decoded on the word by
  ``fp4_base.nibble_asm`` (``word_nibble``), times the fp8 block scale converted once per (row, group)
  (``gluon_base.scale_layout``): exact, as in the other kernels;
* x comes in the Gluon K order (``gluon_layout``), so nibble ``i``'s x for a K step is 64 contiguous
  elements, cp.async'd into a ring of up to ``MAX_STEPS`` K steps (4 KB each) and read with 16-byte LDS (read from
  global memory inside the loop it missed L1 every step);
* with programmatic dependent launch (``pdl.py``) a slice's first weights are loaded before the wait for the kernel
  before it, its x after (docs/kernels.md#pdl), and the next kernel may launch once the K loop is done;
* split-K with the other decode kernels' ticket reduction (``SPLIT_CHUNK`` partials a round trip) and epilogue; the
  LoRA expand (``mma.sync`` over rank chunks) runs on each tile's last slice before its K loop (RING build: epilogue).

About 60-72 registers, no spills (sm_90, triton 3.6): 7 programs of 4 warps per SM (the RING build, 82: 5).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qerl.nvfp4 import NVFP4Tensors

from .epilogue import PLAIN, Epilogue
from .fp4_base import check_act, check_weight, segmented
from .gluon_base import launch_tail, scale_layout, split_k_sum, store_tile, tile_offsets
from .mma_decode import load_rows, pair_k, scale_pairs, word_layout, word_nibble
from .pdl import gemm_launch
from .schedule import cdiv, decode_split, resolve_split, sm_count


@gluon.constexpr_function
def _mma_layout(num_warps):
    """The accumulator's layout: ``mma.sync`` m16n8 tiles, ``num_warps`` warps stacked along the weight rows."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])


@gluon.jit
def _lora_operands(src, c, BM: gl.constexpr, BN: gl.constexpr, RC: gl.constexpr, num_warps: gl.constexpr):
    """Rank chunk ``[c, c + RC)`` of the LoRA expand's operands, loaded straight into the ``mma.sync``
    operand layouts: B's tile rows (A operand) and the segmented u (B operand), bf16 as the Triton kernel's.
    ``src``: the tile's LoRA source, ``(pid_n, M, N, u_ptr, S1, S2, lb_ptr, stride_lb, R)``."""
    pid_n, M, N, u_ptr, S1, S2, lb_ptr, stride_lb, R = src
    mma: gl.constexpr = _mma_layout(num_warps)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rows_n = gl.expand_dims(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, a_l)), 1)
    cols_r = c + gl.expand_dims(gl.arange(0, RC, layout=gl.SliceLayout(0, a_l)), 0)
    ur = c + gl.expand_dims(gl.arange(0, RC, layout=gl.SliceLayout(1, b_l)), 1)
    um = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, b_l)), 0)
    b = gl.load(lb_ptr + rows_n * stride_lb + cols_r, mask=(rows_n < N) & (cols_r < R), other=0.0)
    ut = gl.load(u_ptr + segmented(ur, um, M, S1, S2, R), mask=(um < M) & (ur < R), other=0.0)
    return b.to(gl.bfloat16), ut.to(gl.bfloat16)


@gluon.jit
def _lora_expand(lora, c0, src, BM: gl.constexpr, BN: gl.constexpr, RC: gl.constexpr, num_warps: gl.constexpr):
    """``lora`` + B[n, c0:] . u[m, c0:] for the tile (``src`` as ``_lora_operands``): ``mma.sync`` over ``RC``-wide
    rank chunks, fp32 sums of bf16 products."""
    for c in range(c0, src[8], RC):
        lb, u = _lora_operands(src, c, BM, BN, RC, num_warps)
        lora = mma_v2(lb, u, lora)
    return lora


@gluon.jit
def _stage_x(
    x_s, x_ptr, stride_xm, M, c0, last, BM: gl.constexpr, HW: gl.constexpr, STEPS: gl.constexpr, num_warps: gl.constexpr
):
    """cp.async K steps ``c0 .. c0 + STEPS - 1`` of x (clamped to ``last``) into the ring's slots, one group.
    Token rows past M are not copied (never stored). The addresses are rebuilt from scalars on every fill,
    so none of them has to stay live across the K loop."""
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    tok = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, cp_l)), 1)
    src = x_ptr + tok * stride_xm + gl.expand_dims(gl.arange(0, 4 * HW, layout=gl.SliceLayout(0, cp_l)), 0)
    for q in gl.static_range(STEPS):
        async_copy.async_copy_global_to_shared(x_s.index(q), src + gl.minimum(c0 + q, last) * (4 * HW), mask=tok < M)
    async_copy.commit_group()


@gluon.jit
def _direct_kernel(
    x_ptr,
    h_ptr,
    s_ptr,
    stride_xm,
    stride_h,
    stride_s,
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
    steps_per_split,
    Y1,
    Y2,
    S1,
    S2,
    stride_lb,
    R,
    lora_scale,
    BM: gl.constexpr,
    BN: gl.constexpr,
    HW: gl.constexpr,
    STEPS: gl.constexpr,
    RING: gl.constexpr,
    SPLIT: gl.constexpr,
    CH: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    RC: gl.constexpr,
    WHOLE: gl.constexpr,
    PDL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Program (BN weight rows, K slice ``program_id(1)`` of ``steps_per_split`` K steps, x through a ring of
    ``STEPS`` of them):
    acc[n, m] = sum over the slice's K steps (HW int16 elements = 4 * HW codes) and the 4 nibbles of
    (nibble_i(h) * scale) @ x_i^T, then the split-K ticket epilogue. x is in the Gluon K order: x_i of step
    kt is x[:, 4 HW kt + HW i : + HW]. ``PDL`` (``pdl.py``): the slice's first weights are loaded before the wait
    for the kernel before this one, everything else after it; the next kernel may launch once every program has
    finished its K loop."""
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    mma: gl.constexpr = _mma_layout(num_warps)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    s_l: gl.constexpr = gl.SliceLayout(2, scale_layout(gl.to_linear_layout(a_l, [BN, HW])))
    sp_l: gl.constexpr = word_layout(gl.to_linear_layout(s_l, [BN, HW // 4]))  # the scale bytes in pairs
    G: gl.constexpr = HW // 4
    # e2m1 * 2^-126 (the nibble's bits) * fp8 scale * 2^118 (scale_pairs) = e2m1 * scale * 2^-8, exact in bf16.

    k_steps = K // (4 * HW)
    w_l: gl.constexpr = word_layout(gl.to_linear_layout(a_l, [BN, HW]))
    rows_h = gl.expand_dims(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l)), 1)
    h_ptrs = h_ptr + rows_h * stride_h + gl.expand_dims(gl.arange(0, HW // 2, layout=gl.SliceLayout(0, w_l)), 0)
    h_mask = rows_h < N
    rows_s = gl.expand_dims(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, sp_l)), 1)
    s_ptrs = s_ptr + rows_s * stride_s + gl.expand_dims(gl.arange(0, G // 2, layout=gl.SliceLayout(0, sp_l)), 0)
    s_mask = rows_s < N

    # x in shared memory, a ring of STEPS K steps (cp.async; barriers only between fills): slot q holds step
    # c0 + q's [BM, 4 HW] for the fill starting at step c0, nibble i's x at columns [i HW, (i + 1) HW) (slots
    # past the slice repeat its last step and are never read). A slice of at most STEPS steps is one fill
    # before the loop; a longer one (``decode_split`` wants 10-20 steps for the 32B shapes) refills the ring
    # every STEPS steps instead of being cut into more, shorter programs. The refill is a block the K loop
    # skips: a loop of fills nested around the K loop compiled to 80-93 registers. The next step's weights are
    # loaded before that block, so their loads stay at the top of the step and overlap a refill's wait (after it,
    # ptxas sank them to the loop's end; docs/kernels.md#direct-ring-refill).
    x_s = gl.allocate_shared_memory(
        gl.bfloat16, [STEPS, BM, 4 * HW], gl.NVMMASharedLayout.get_default_for([BM, 4 * HW], gl.bfloat16)
    )
    first = pid_k * steps_per_split
    last = gl.minimum(first + steps_per_split, k_steps) - 1
    if not PDL:
        _stage_x(x_s, x_ptr, stride_xm, M, first, last, BM, HW, STEPS, num_warps)
    h = load_rows(h_ptrs + first * (HW // 2), h_mask, 0, WHOLE)
    sc = load_rows(s_ptrs + first * (G // 2), s_mask, 0, WHOLE)
    if PDL:  # x is the kernel before's output: staged once it has finished (the weights are in flight meanwhile)
        gdc_wait()
        _stage_x(x_s, x_ptr, stride_xm, M, first, last, BM, HW, STEPS, num_warps)

    async_copy.wait_group(0)
    gl.thread_barrier()

    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    lora_src = (pid_n, M, N, u_ptr, S1, S2, lb_ptr, stride_lb, R)  # the LoRA expand's operands (``_lora_operands``)
    # The LoRA expand rides on the tile's last (shortest) slice, before its K loop and in the shadow of the loads
    # above, instead of after the split-K round trips on the critical tail: it starts the slice's accumulator in
    # the weights' scale (store_tile multiplies the sum by 2^8 / g). The RING build keeps it in the epilogue: there
    # ptxas spilled a pointer inside the K loop (offline sm_90; docs/kernels.md#direct-lora-first).
    LORA_FIRST: gl.constexpr = HAS_LORA and not RING
    if LORA_FIRST:
        if pid_k == gl.num_programs(1) - 1:
            lora = _lora_expand(acc, 0, lora_src, BM, BN, RC, num_warps)
            acc = lora * (lora_scale * gl.load(g_ptr) / 256.0)
    for kt in range(first, last + 1):
        slot = kt - first
        ahead = gl.minimum(kt + 1, last)
        h_next = load_rows(h_ptrs + ahead * (HW // 2), h_mask, 0, WHOLE)
        sc_next = load_rows(s_ptrs + ahead * (G // 2), s_mask, 0, WHOLE)
        if RING:  # compiled only for slices longer than the ring: the check cost 2.4% of the 7B GEMMs
            slot = slot % STEPS
            if (slot == 0) & (kt > first):  # the ring is used up: every warp is done with it, refill it
                gl.thread_barrier()
                _stage_x(x_s, x_ptr, stride_xm, M, kt, last, BM, HW, STEPS, num_warps)
                async_copy.wait_group(0)
                gl.thread_barrier()
        s = scale_pairs(sc, s_l)
        sb = gl.convert_layout(
            gl.reshape(gl.expand_dims(s, 2).broadcast_to(BN, G, 4), [BN, HW]), a_l, assert_trivial=True
        )
        for i in gl.static_range(4):
            x_i = pair_k(x_s.index(slot).slice(i * HW, HW, dim=1).permute((1, 0)).load(b_l), 0, b_l, not RING)
            acc = mma_v2(pair_k(word_nibble(h, i, a_l) * sb, 1, a_l, not RING), x_i, acc)
        h = h_next
        sc = sc_next

    if PDL:
        # Here rather than at the start: the next GEMM's programs then take the slots this one's split-K tail leaves
        # (docs/kernels.md#direct-pdl-trigger).
        gdc_launch_dependents()
    offs_n, offs, mask = tile_offsets(pid_n, M, N, Y1, Y2, BN, BM, mma)
    LORA_LAST: gl.constexpr = HAS_LORA and RING
    if LORA_LAST:
        # The first rank chunk's operands are in flight during the split-K round trips below.
        lb0, u0 = _lora_operands(lora_src, 0, BM, BN, RC, num_warps)
    run = True
    if SPLIT:
        acc, run = split_k_sum(
            acc, pid_n, pid_k, gl.num_programs(1), gl.num_programs(0), part_ptr, ticket_ptr, offs, mask, M, N, CH, False
        )
    if run:
        lora = acc
        if LORA_LAST:
            first_chunk = mma_v2(lb0, u0, gl.zeros([BN, BM], gl.float32, layout=mma))
            lora = _lora_expand(first_chunk, RC, lora_src, BM, BN, RC, num_warps)
        store_tile(acc, lora, g_ptr, offs_n, offs, mask, N, y_ptr, bias_ptr, lora_scale, HAS_BIAS, LORA_LAST)


#: Tokens (the MMA's N), weight rows per warp (its M) and warps per program.
BM = 8
ROWS_PER_WARP = 16
WARPS = 4
#: int16 elements (4 codes each) per row and K step: a K step is the Gluon K order's 256 codes.
HW = 64
#: Programs an SM holds (66 registers and up to 28 KB of shared memory each allow 7), the count
#: ``decode_split`` schedules for; and the K steps of x a program's shared-memory ring holds (4 KB a step:
#: 7 keeps 7 programs per SM); 8 programs or other ring depths were no faster (docs/kernels.md#direct-resident).
#: (The RING build, 82 registers, holds 5; ``PROGRAM_STEPS`` below was fitted with 7 for every build.)
RESIDENT = 7
MAX_STEPS = 7
#: A program's fixed cost in K steps for ``decode_split``, fitted on the sweep of every split of the 7B / 32B
#: decode GEMMs: 4 to 6 pick alike (docs/kernels.md#direct-program-steps).
PROGRAM_STEPS = 5
#: Split-K partials the last program reads per round trip: 8 reads 7B down's 15 in two instead of four, at the same
#: 72 registers (offline sm_90; 16 takes 80) (docs/kernels.md#direct-split-chunk).
SPLIT_CHUNK = 8


def refills(N: int, K: int, device: torch.device) -> bool:
    """Whether this GEMM is split into K slices (``decode_split``'s choice, as ``matmul`` launches it) longer than
    the x ring, so each slice refills it (the ``RING`` build); ``fp4_gemm.gluon_kernel`` gives those GEMMs (the 32B
    down; no 7B GEMM) to the TMA/wgmma kernel instead, faster on them. A GEMM whose single slice per tile refills the
    ring (32B gate_up) stays here, faster here (docs/kernels.md#direct-ring)."""
    tiles, k_steps, slots = launch_shape(N, K, device)
    split = decode_split(tiles, k_steps, slots, PROGRAM_STEPS)
    return split > 1 and cdiv(k_steps, split) > MAX_STEPS


def launch_shape(N: int, K: int, device: torch.device) -> tuple[int, int, int]:
    """(weight-row tiles, K steps, resident program slots) of a launch: what ``decode_split`` plans its slices from,
    in ``matmul`` and in ``refills`` alike."""
    return cdiv(N, ROWS_PER_WARP * WARPS), K // (4 * HW), sm_count(device) * RESIDENT


def supports(M: int, K: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Hopper (where it was measured; ``mma.sync`` itself is sm_80+), bf16 x, 1 <= M <= 8, whole 256-code K steps."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and dtype == torch.bfloat16
        and 0 < M <= BM
        and K % (4 * HW) == 0
    )


def matmul(
    x: torch.Tensor,
    weight: NVFP4Tensors,
    *,
    epilogue: Epilogue = PLAIN,
    out: torch.Tensor | None = None,
    split: int = 0,
    pdl: bool = False,
) -> torch.Tensor:
    """``fp4_gemm.matmul``'s decode contract (the ``epilogue``; operands checked there when it dispatches here) for
    an x already in the Gluon K order (``gluon_layout``); see ``supports`` for what it takes. ``split``: K
    slices (0: ``decode_split``'s choice). ``pdl``: a programmatic dependent launch (``pdl.py``; the caller vouches
    that no kernel in flight writes the weights)."""
    check_act(x)
    N, K = check_weight(weight)
    M = x.shape[0]
    if not supports(M, K, x.dtype, x.device) or x.shape[1] != K:
        raise ValueError(
            f"the direct decode kernel takes bf16 x [1 <= M <= {BM}, {K}] on sm_90 with K % {4 * HW} == 0, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    bn = ROWS_PER_WARP * WARPS
    tiles, k_steps, slots = launch_shape(N, K, x.device)
    split = resolve_split(tiles, k_steps, split, slots, PROGRAM_STEPS)
    steps = cdiv(k_steps, split)  # per slice
    out, tail = launch_tail(x, weight, epilogue, out, tiles=tiles, tile_size=bn * BM, slices=split)
    x = x.contiguous()
    h = weight.weight_packed.contiguous().view(torch.int32)
    s = weight.weight_scale.contiguous().view(torch.int16)
    ring = steps > MAX_STEPS
    _direct_kernel[(tiles, split)](
        x,
        h,
        s,
        x.stride(0),
        h.stride(0),
        s.stride(0),
        steps_per_split=steps,
        BM=BM,
        BN=bn,
        HW=HW,
        STEPS=min(steps, MAX_STEPS),
        RING=ring,
        CH=SPLIT_CHUNK,
        WHOLE=N % bn == 0 and not ring,
        num_warps=WARPS,
        **tail,
        **gemm_launch(pdl, x.device, weight.weight_packed, weight.weight_scale),
    )
    return out
