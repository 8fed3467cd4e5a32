"""The warp-specialized K loop of ``fp4_gluon``'s TMA/wgmma decode kernel: a one-warp ``producer`` streaming K steps
through TMA into a ring of shared-memory slots, and a four-warp ``consumer`` decoding each weight tile into wgmma
A-operand registers against x in shared memory. The kernel (``fp4_gluon._decode_gluon_kernel``) allocates the ring and
its barriers and hands both partitions to ``gl.warp_specialize``; why it is built so: docs/kernels.md#gluon-kernel,
#gluon-early-release and #fenced-release.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_wait

from .fp4_base import nibble
from .gluon_base import scale_layout


@gluon.constexpr_function
def acc_layout(BM):
    """The accumulator's layout: one warpgroup's wgmma with BM tokens as the N dimension."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])


@gluon.jit
def _load_weights(x_desc, h_desc, s_desc, h_s, s_s, ready, slot, row, kt, BK: gl.constexpr):
    """K step ``kt``'s weight and scale tiles (rows from ``row``) into ``slot``, its ``ready`` barrier armed for them
    and the step's x, which the producer issues on its own."""
    nbytes: gl.constexpr = x_desc.block_type.nbytes + h_desc.block_type.nbytes + s_desc.block_type.nbytes
    mbarrier.expect(ready.index(slot), nbytes)
    tma.async_copy_global_to_shared(h_desc, [row, kt * (BK // 4)], ready.index(slot), h_s.index(slot))
    tma.async_copy_global_to_shared(s_desc, [row, kt * (BK // 16)], ready.index(slot), s_s.index(slot))


@gluon.jit
def producer(x_desc, h_desc, s_desc, x_s, h_s, s_s, ready, free_w, free_x, row, first, steps, PDL: gl.constexpr):
    """One warp: TMA loads of K step ``first + i`` (weight rows from ``row``) into slot ``i % STAGES``, its weights
    and scales as soon as the consumer has released the slot's previous weights (``free_w``), its x once
    those wgmma are done with the previous x (``free_x``); all three land on the slot's one ``ready`` barrier.
    ``PDL`` (``pdl.py``): the first ring's weights before the wait for the kernel before this one, its x after.
    The ring's depth and K step come from its x slots' shape ``[STAGES, BM, BK]``."""
    STAGES: gl.constexpr = x_s.shape[0]
    BK: gl.constexpr = x_s.shape[2]
    start = 0
    if PDL:  # a fresh ring's slots are free: no free_w / free_x waits for the first STAGES steps
        for i in gl.static_range(STAGES):
            if i < steps:
                _load_weights(x_desc, h_desc, s_desc, h_s, s_s, ready, i, row, first + i, BK)
        gdc_wait()
        for i in gl.static_range(STAGES):
            if i < steps:
                tma.async_copy_global_to_shared(x_desc, [0, (first + i) * BK], ready.index(i), x_s.index(i))
        start = STAGES
    for i in range(start, steps):
        slot = i % STAGES
        phase = ((i // STAGES) & 1) ^ 1  # a fresh barrier passes parity 1
        kt = first + i
        mbarrier.wait(free_w.index(slot), phase)
        _load_weights(x_desc, h_desc, s_desc, h_s, s_s, ready, slot, row, kt, BK)
        mbarrier.wait(free_x.index(slot), phase)
        tma.async_copy_global_to_shared(x_desc, [0, kt * BK], ready.index(slot), x_s.index(slot))


@gluon.jit
def consumer(x_s, h_s, s_s, ready, free_w, free_x, steps, FENCED: gl.constexpr):
    """Four warps: acc[BN, BM] += sum over the steps and nibbles of (nibble_i(h) * scale) @ x_i^T.

    A slot's weights go back to the producer (``free_w``) once its ldmatrix / scale loads can no longer see the
    refill: with ``FENCED`` right after those loads behind a proxy fence (the loads are generic-proxy reads, the TMA
    refill an async-proxy write, and only ``fence.proxy.async`` orders the two), else after the step's four wgmma are
    issued (they consume every loaded register, so the loads have landed). Released right after the loads with neither,
    the refill can land under a load in flight (seen with the balanced split: wrong weight rows in every call;
    docs/kernels.md#fenced-release). Which release is faster depends on BM (``fp4_gluon.FENCED_RELEASE``)."""
    # The ring's x slots are [STAGES, BM, BK], its weight slots [STAGES, BN, BK / 4].
    STAGES: gl.constexpr = x_s.shape[0]
    BM: gl.constexpr = x_s.shape[1]
    BK: gl.constexpr = x_s.shape[2]
    BN: gl.constexpr = h_s.shape[1]
    HW: gl.constexpr = BK // 4
    G: gl.constexpr = BK // 16
    mma: gl.constexpr = acc_layout(BM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    s3_layout: gl.constexpr = scale_layout(gl.to_linear_layout(a_layout, [BN, HW]))
    # e2m1 * 2^-126 (the nibble's bits) * fp8 scale * 2^118 = e2m1 * scale * 2^-8, exact in bf16.
    FACTOR: gl.constexpr = 3.3230699894622896e35
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        h = h_s.index(slot).load(a_layout)
        sc = s_s.index(slot).load(gl.SliceLayout(2, s3_layout))
        if FENCED:
            fence_async_shared()  # these generic-proxy reads of the slot, ordered before the TMA's (async proxy) refill
            mbarrier.arrive(free_w.index(slot))
        sc = (sc.to(gl.float32) * FACTOR).to(gl.bfloat16)
        sb = gl.reshape(gl.expand_dims(sc, 2).broadcast_to(BN, G, 4), [BN, HW])
        sb = gl.convert_layout(sb, a_layout, assert_trivial=True)
        xs = x_s.index(slot)
        for n in gl.static_range(4):
            w = nibble(h, n, False) * sb  # the Triton kernel's decode, bf16
            acc = warpgroup_mma(w, xs.slice(n * HW, HW, dim=1).permute((1, 0)), acc, is_async=True)
        if not FENCED:
            mbarrier.arrive(free_w.index(slot))  # the four wgmma hold every decoded weight: the slot's loads landed
        # All four in flight while the next nibble decodes; waiting here rather than one step later
        # keeps them that way: deferring the wait makes ptxas serialise every wgmma (offline SASS: one
        # WARPGROUP.DEPBAR per HGMMA), since the decoded A registers would live across the loop edge.
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc, xs])
        mbarrier.arrive(free_x.index(slot))
    return (acc,)
