"""The decode step's attention: split-K flash-decoding over the static cache (``decode_attention``: a partial kernel
per key chunk, a combine kernel per head that also reduces o_proj's LoRA shrink, ``step_base``). With ``rope=`` the
partial kernel ropes q and writes this step's k / v itself (``step_rope``), one launch a layer fewer
(``schedule.SWITCHES.rope_in_attention``), Qwen3's per-head q / k RMSNorms (``qk_norm=``) included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend, pdl
from .fp4_base import gluon_k_offsets
from .step_base import TARGET_PROGRAMS, check_gluon_k, finish_shrink, load_a, part_tile, rank_dot, rank_pad, trigger
from .step_rope import QKNorm, head_norm, rope, rotate_half


@triton.jit
def _attn_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    kn_ptr,
    vn_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    q_eps,
    k_eps,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    scale,
    chunk,
    nsplit,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Flash-decoding partials: program (row*kv-head, split) attends G query heads to one key chunk
    of the row's valid prefix (slots <= pos). With ROPE, q comes un-rotated and every program ropes its
    heads itself; the program whose chunk holds slot pos also ropes this step's key (``kn_ptr``) and
    writes it and the value (``vn_ptr``) into the cache before reading its chunk (``step_rope.rope_and_cache``'s
    work, bit for bit, without its launch), Qwen3's q / k head norms included when ``qw_ptr`` is given."""
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
        partner, sign = rotate_half(offs_d, D)
        pos = length - 1
        cos = tl.load(cos_ptr + pos * D + offs_d).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + offs_d).to(tl.float32)
        q_r = tl.load(q_rows + partner[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        q = q.to(tl.float32)
        if qw_ptr is not None:
            q, q_r = head_norm(q, q_r, qw_ptr, q_eps, offs_d[None, :], partner[None, :], D, 1, dt)
        q = rope(q, q_r * sign[None, :], cos[None, :], sin[None, :], dt)
        if (start <= pos) & (pos < end):
            new = b * (HKV * D) + kvh * D
            k_r = tl.load(kn_ptr + new + partner).to(tl.float32)
            k_new = tl.load(kn_ptr + new + offs_d).to(tl.float32)
            if qw_ptr is not None:
                k_new, k_r = head_norm(k_new, k_r, kw_ptr, k_eps, offs_d, partner, D, 0, dt)
            k_new = rope(k_new, k_r * sign, cos, sin, dt)
            tl.store(k_ptr + b * skb + kvh * skh + pos * sks + offs_d, k_new)
            tl.store(v_ptr + b * svb + kvh * svh + pos * svs + offs_d, tl.load(vn_ptr + new + offs_d))
            tl.debug_barrier()  # the chunk loop below reads slot pos back
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # The loop stops at the row's own length (``pos`` is read on the device, so one compile and one
    # CUDA graph serve every batch and KV bucket): a bucket holds up to 255 slots past a row's end, and
    # walking them masked cost 14% of this kernel at b = 64 / 128 (H200, 7B shapes, docs/kernels.md).
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
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    a_ptr,
    u_ptr,
    part_ptr,
    ticket_ptr,
    nsplit,
    B,
    H,
    R,
    NSP: tl.constexpr,
    D: tl.constexpr,
    HAS_LORA: tl.constexpr,
    RP: tl.constexpr,
    GLUON_K: tl.constexpr,
    PART_TILE: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """Program (row*head): merge the head's split partials; with LoRA, its share of ``u = out @ A.T``
    (the head's D columns of A), summed over the row's heads by the last program."""
    trigger(TRIGGER)
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, NSP)
    offs_d = tl.arange(0, D)
    if HAS_LORA:
        a = load_a(a_ptr, H * D, (bh % H) * D + offs_d, offs_d < D, R, RP)
    smask = offs_s < nsplit
    m = tl.load(m_ptr + bh * nsplit + offs_s, mask=smask, other=float("-inf"))
    lsum = tl.load(l_ptr + bh * nsplit + offs_s, mask=smask, other=0.0)
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - tl.max(m, axis=0)), 0.0)
    acc = tl.load(acc_ptr + (bh * nsplit + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = (tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)).to(out_ptr.dtype.element_ty)
    dest = gluon_k_offsets(bh * D + offs_d) if GLUON_K else bh * D + offs_d
    tl.store(out_ptr + dest, out)
    if HAS_LORA:
        finish_shrink(rank_dot(out, a), bh // H, bh % H, H, B, R, R, R, u_ptr, part_ptr, ticket_ptr, RP, PART_TILE)


def _partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    qk_norm: QKNorm | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Launch ``_attn_partial_kernel``: ``(m, l, acc, nsplit)``, each (row, head)'s ``nsplit`` key-chunk partials.
    The split aims at ``TARGET_PROGRAMS`` programs in chunks of whole ``BLOCK_N`` key blocks."""
    b, h, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = h // hkv
    block_n = 64 if d <= 64 else 32
    nsplit = max(1, min(triton.cdiv(s, block_n), TARGET_PROGRAMS // max(1, b * hkv)))
    chunk = triton.cdiv(triton.cdiv(s, nsplit), block_n) * block_n
    nsplit = triton.cdiv(s, chunk)
    m = torch.empty(b * h * nsplit, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(b * h * nsplit, d, dtype=torch.float32, device=q.device)
    kn, vn, cos, sin = rope if rope is not None else (q, q, q, q)
    qw, kw, q_eps, k_eps = qk_norm if qk_norm is not None else (None, None, None, None)
    _attn_partial_kernel[(b * hkv, nsplit)](
        q,
        k_cache,
        v_cache,
        pos,
        m,
        lsum,
        acc,
        kn,
        vn,
        cos,
        sin,
        qw,
        kw,
        q_eps,
        k_eps,
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        scale,
        chunk,
        nsplit,
        HKV=hkv,
        G=g,
        GP=max(16, triton.next_power_of_2(g)),
        D=d,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        ROPE=rope is not None,
        num_warps=4,
    )
    return m, lsum, acc, nsplit


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    lora_a: torch.Tensor | None = None,
    gluon_k: bool = False,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q ``[B, H, D]`` against cache rows ``[B, Hkv, S, D]`` (valid slots ``<= pos``) -> ``[B, H*D]``;
    with ``lora_a`` ``[R, H*D]`` also ``u = out @ lora_a.T`` (flat ``[B * R]``), else None.
    ``gluon_k`` as in ``rms_norm`` (out only; u is the same). ``rope = (k, v, cos, sin)``: q is not rotated
    yet and this step's k / v (``[B, Hkv*D]``) are not in the cache: ``step_rope.rope_and_cache``'s work is done
    here, ``qk_norm`` (with ``rope`` only) included."""
    if qk_norm is not None and rope is None:
        raise ValueError("decode_attention: qk_norm= comes with rope= (the norms precede the RoPE)")
    b, h, d = q.shape
    m, lsum, acc, nsplit = _partials(q, k_cache, v_cache, pos, scale, rope, qk_norm)
    out = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    rank = 0 if lora_a is None else lora_a.shape[0]
    rp = rank_pad(rank)
    u = part = tickets = None
    if lora_a is not None:
        u = torch.empty(b * rank, dtype=q.dtype, device=q.device)
        part = torch.empty(b * h * rp, dtype=torch.float32, device=q.device)
        tickets = backend.tickets(q.device, b)
    _attn_combine_kernel[(b * h,)](
        m,
        lsum,
        acc,
        out,
        lora_a if lora_a is not None else out,
        u if u is not None else out,
        part if part is not None else m,
        tickets if tickets is not None else m,
        nsplit,
        b,
        h,
        rank,
        NSP=triton.next_power_of_2(nsplit),
        D=d,
        HAS_LORA=lora_a is not None,
        RP=rp,
        GLUON_K=check_gluon_k(gluon_k, h * d),
        PART_TILE=part_tile(h, rp),
        TRIGGER=pdl.enabled(q.device),
        num_warps=4,
    )
    return out, u
