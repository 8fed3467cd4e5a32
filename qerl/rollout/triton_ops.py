"""Triton kernels for the native decode step (imported only where Triton and a GPU exist).

Why these four: at batch 1 a 7B decode step streams ~4.8 GB of weights in ~1.1 ms, and an unfused
RMSNorm, RoPE or attention costs 5-14 tiny launches each, times the layer count. Each kernel here
replaces one such cluster by one launch (two for attention) and reproduces transformers' rounding
(fp32 math, cast to the activation dtype where transformers' ops would round).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Aim for about two resident programs per SM (132 on an H200) in split-K attention.
_TARGET_PROGRAMS = 264


@triton.jit
def _rms_norm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = tl.load(h_ptr + row * n_cols + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * n_cols + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n_cols + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    y = (hf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` (in place, when given), then ``weight * rmsnorm(h)`` in h's dtype."""
    n_cols = h.shape[-1]
    out = torch.empty_like(h)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(h.numel() // n_cols,)](
        h, delta if delta is not None else h, weight, out, n_cols, eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, num_warps=4)
    return out


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
    half: tl.constexpr = D // 2
    partner = (offs + half) % D
    sign = tl.where(offs < half, -1.0, 1.0)
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
        xr = tl.load(src + partner).to(tl.float32) * sign
        # transformers: q * cos + rotate_half(q) * sin, each op rounded to the activation dtype
        a = (x * cos).to(dt).to(tl.float32)
        c = (xr * sin).to(dt).to(tl.float32)
        y = (a + c).to(dt)
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


@triton.jit
def _attn_partial_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
    skb, skh, sks, svb, svh, svs, scale, chunk, nsplit,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Flash-decoding partials: program (row*kv-head, split) attends G query heads to one key chunk."""
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    kvh = bh % HKV
    length = tl.load(len_ptr + b)
    start = sp * chunk
    end = tl.minimum(start + chunk, length)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * (HKV * G * D) + heads[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # The trip count ignores the row's length (masked past `end`): masked loads cost no memory traffic,
    # chunk and nsplit stay runtime arguments, so one compile serves every batch and KV bucket.
    for n0 in range(0, chunk, BLOCK_N):
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
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, nsplit, NSP: tl.constexpr, D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, NSP)
    offs_d = tl.arange(0, D)
    smask = offs_s < nsplit
    m = tl.load(m_ptr + bh * nsplit + offs_s, mask=smask, other=float("-inf"))
    lsum = tl.load(l_ptr + bh * nsplit + offs_s, mask=smask, other=0.0)
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - tl.max(m, axis=0)), 0.0)
    acc = tl.load(acc_ptr + (bh * nsplit + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(out_ptr + bh * D + offs_d, out.to(out_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``[B, H, D]`` against cache rows ``[B, Hkv, S, D]`` (valid prefix ``lengths``) -> ``[B, H*D]``."""
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
    _attn_partial_kernel[(b * hkv, nsplit)](
        q, k_cache, v_cache, lengths, m, lsum, acc,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale, chunk, nsplit,
        HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    out = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    _attn_combine_kernel[(b * h,)](m, lsum, acc, out, nsplit, NSP=triton.next_power_of_2(nsplit), D=d, num_warps=4)
    return out
