"""The register side of ``fp4_direct``'s ``mma.sync`` kernel: its A operand built straight from global memory, with no
shared memory in between. The packed weights are carried as int32 words (``word_layout``) and decoded by PTX on the
word (``word_nibble``: ``fp4_base.nibble_asm`` with the pair handed back as halves), the fp8 block scales converted two
at a time (``scale_pairs``), the K axis of both MMA operands relabelled so that each ``mma.sync``'s K halves are
adjacent registers (``pair_k``), and whole tiles loaded unmasked (``load_rows``). Each piece's instruction counts:
docs/kernels.md#direct-kernel and #direct-sass-cuts.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fp4_base import nibble_asm


@gluon.constexpr_function
def word_layout(a_linear):
    """The int32 [BN, HW / 2] layout of the A operand's int16 elements taken in pairs (``a_linear``, its linear
    layout, has the pair as its first register basis): a thread's word j holds its elements 2j and 2j + 1."""

    def half(basis):
        return [basis[0], basis[1] // 2]

    assert a_linear.reg_bases[0] == [0, 1], a_linear
    return gl.DistributedLinearLayout(
        reg_bases=[half(b) for b in a_linear.reg_bases[1:]],
        lane_bases=[half(b) for b in a_linear.lane_bases],
        warp_bases=[half(b) for b in a_linear.warp_bases],
        block_bases=[half(b) for b in a_linear.block_bases],
        shape=[a_linear.shape[0], a_linear.shape[1] // 2],
    )


#: ``fp4_base.nibble_asm`` for each nibble of an int32 word, the bf16 pair handed back as two halves.
WORD_NIBBLE_ASM = tuple(nibble_asm(i, False, halves=True) for i in range(4))


@gluon.constexpr_function
def _word_asm(i):
    """Nibble ``i``'s ``WORD_NIBBLE_ASM``, looked up at compile time."""
    return WORD_NIBBLE_ASM[i]


@gluon.jit
def _asm_pairs(asm: gl.constexpr, constraints: gl.constexpr, v, layout: gl.constexpr):
    """``asm`` on each element of ``v`` [R, C], giving two bf16 halves, as the bf16 tensor [R, 2 C] in ``layout``
    (the halves side by side: a relabelling of the registers, checked trivial at compile time)."""
    lo, hi = gl.inline_asm_elementwise(asm, constraints, [v], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    both = gl.join(lo, hi)
    return gl.convert_layout(gl.reshape(both, [both.shape[0], 2 * both.shape[1]]), layout, assert_trivial=True)


@gluon.jit
def word_nibble(w, i: gl.constexpr, a_l: gl.constexpr):
    """Code ``i`` of every int16 element of the int32 words ``w`` [BN, HW / 2] as the bf16 A operand [BN, HW]."""
    return _asm_pairs(_word_asm(i), "=h,=h,r", w, a_l)


@gluon.jit
def pair_k(t, dim: gl.constexpr, layout: gl.constexpr, ON: gl.constexpr):
    """``t`` (an mma operand in ``layout``, K along ``dim``, 64 wide) with its K axis relabelled (when ``ON``) so
    that each ``mma.sync``'s two K halves are one thread's adjacent registers. Read as loaded, a thread's x
    registers hold K offsets 8t..8t+7 and 8t+32..8t+39 and each mma pairs k with k+32: ptxas then copied the
    pairs together for every mma (24 IMAD.MOV a K step, offline sm_90). Relabelled by the same bit permutation
    on both operands (K bits 0..5 read from bits 0, 2, 5, 3, 4, 1; the sum is over the same products, in
    another order), each mma's B pair is two adjacent registers of one 16-byte load and the moves are gone
    (the K loop 373 instructions a step against 395; nothing moves at run time: the permute is a relabelling
    of registers; docs/kernels.md#direct-sass-cuts)."""
    if ON:
        if dim == 0:
            u = gl.permute(gl.reshape(t, [2, 2, 2, 2, 2, 2, t.shape[1]]), (4, 1, 2, 0, 3, 5, 6))
        else:
            u = gl.permute(gl.reshape(t, [t.shape[0], 2, 2, 2, 2, 2, 2]), (0, 5, 2, 3, 1, 4, 6))
        return gl.convert_layout(gl.reshape(u, t.shape), layout)
    return t


#: Two e4m3 scale bytes -> their bf16 pair times 2^118: e4m3 -> f16 is exact (e4m3 subnormals are f16 normals
#: with at most 3 mantissa bits, so the f16 bits' low 3 are zero); the f16 bits shifted right 3 are the bf16 bits
#: of the value times 2^-112 (the AND drops the sign, 0 for a scale, and the high half's bits that the shift
#: brought down), and two exact multiplies by 2^115 (0x7900) give 2^118. 6 instructions for 2 scales, against 10-11
#: for the fp32 path (unpack, 2 f16 -> f32, 2 FMUL, pack, and the bytes' regrouping).
SCALE_PAIR_ASM = gl.constexpr("""{
.reg .b32 t, c;
cvt.rn.f16x2.e4m3x2 t, $2;
shr.b32 t, t, 3;
and.b32 t, t, 0x0FFF0FFF;
mov.b32 c, 0x79007900;
mul.rn.bf16x2 t, t, c;
mul.rn.bf16x2 t, t, c;
mov.b32 {$0, $1}, t;
}""")


@gluon.jit
def scale_pairs(sc, s_l: gl.constexpr):
    """The int16 scale pairs ``sc`` [BN, G / 2] as the bf16 scales times 2^118 [BN, G] in ``s_l``."""
    return _asm_pairs(SCALE_PAIR_ASM, "=h,=h,h", sc, s_l)


@gluon.jit
def load_rows(ptrs, mask, other, WHOLE: gl.constexpr):
    """A K step's weights or scales; ``WHOLE`` (every tile's rows exist) loads them unmasked, which drops the
    zeroing of the destination registers a masked load needs (8 of the K loop's instructions a step)."""
    if WHOLE:
        return gl.load(ptrs)
    return gl.load(ptrs, mask=mask, other=other)
