"""The decode step's RoPE: transformers' ``rotate_half`` RoPE and Qwen3's per-head q / k RMSNorms as Triton helpers
(``rope``, ``head_norm``), used by the attention's partial kernel (``step_attention``, RoPE in attention) and by
``rope_and_cache``, the kernel that ropes q and k and writes k / v into the cache on its own
(``schedule.SWITCHES.rope_in_attention`` off). Qwen3's norms run on the head the kernel already holds: no launch and
no pass over q / k of their own; without them the norm weights are None, a compile-time constant, so the other
families' kernels compile as before. Rounding follows transformers' modules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import AttentionArgs

#: Qwen3's per-head norms for the attention kernels: (q_norm weight ``[D]``, k_norm weight ``[D]``, q eps, k eps).
QKNorm = tuple[torch.Tensor, torch.Tensor, float, float]


@triton.jit
def rotate_half(offs, D: tl.constexpr):
    """``rotate_half`` as a gather: element ``offs`` of the rotated vector is ``sign * x[partner]``."""
    return (offs + D // 2) % D, tl.where(offs < D // 2, -1.0, 1.0)


@triton.jit
def rope(x, xr, cos, sin, DT: tl.constexpr):
    """transformers' ``q * cos + rotate_half(q) * sin`` (``xr``: the rotated partner, sign applied), each op
    rounded to the activation dtype as there."""
    a = (x * cos).to(DT).to(tl.float32)
    c = (xr * sin).to(DT).to(tl.float32)
    return (a + c).to(DT)


@triton.jit
def _scaled(x, rstd, w_ptr, cols, DT: tl.constexpr):
    """transformers' ``Qwen3RMSNorm`` tail: (x * rstd) rounded to the activation dtype, times the weight at
    ``cols``, rounded again; fp32 values out."""
    y = (x * rstd).to(DT).to(tl.float32)
    return (tl.load(w_ptr + cols).to(tl.float32) * y).to(DT).to(tl.float32)


@triton.jit
def head_norm(x, xr, w_ptr, eps, cols, partner, D: tl.constexpr, AXIS: tl.constexpr, DT: tl.constexpr):
    """Qwen3's per-head q / k RMSNorm of fp32 head(s) ``x`` (``[D]``, or ``[G, D]`` with ``AXIS`` 1) and of ``xr``,
    their elements at the RoPE ``partner`` columns, both scaled by the head's ``rsqrt(mean(x^2) + eps)``: the
    normed head and its normed partners, ready for ``rope``."""
    rstd = tl.expand_dims(tl.rsqrt(tl.sum(x * x, axis=AXIS) / D + eps), AXIS)
    return _scaled(x, rstd, w_ptr, cols, DT), _scaled(xr, rstd, w_ptr, partner, DT)


@triton.jit
def _rope_cache_kernel(
    q_ptr,
    qo_ptr,
    qw_ptr,
    q_eps,
    k_ptr,
    kc_ptr,
    kw_ptr,
    k_eps,
    skb,
    skh,
    sks,
    v_ptr,
    vc_ptr,
    svb,
    svh,
    svs,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
):
    """Program (row, j): j < H ropes q head j; then k heads (into the cache); then v heads (copied). With the norm
    weights ``qw_ptr`` / ``kw_ptr`` (Qwen3; None otherwise: compiled out) each q / k head is RMS-normed first.
    Arguments come grouped by tensor: each source with its destination, its norm and its cache strides."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs = tl.arange(0, D)
    partner, sign = rotate_half(offs, D)
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
        xr = tl.load(src + partner).to(tl.float32)
        if qw_ptr is not None:
            if j < H:
                x, xr = head_norm(x, xr, qw_ptr, q_eps, offs, partner, D, 0, dt)
            else:
                x, xr = head_norm(x, xr, kw_ptr, k_eps, offs, partner, D, 0, dt)
        y = rope(x, xr * sign, cos, sin, dt)
        if j < H:
            tl.store(qo_ptr + b * (H * D) + j * D + offs, y)
        else:
            tl.store(kc_ptr + b * skb + (j - H) * skh + pos * sks + offs, y)
    else:
        tl.store(vc_ptr + b * svb + (j - H - HKV) * svh + pos * svs + offs, x.to(dt))


def rope_and_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: AttentionArgs, qk_norm: QKNorm | None = None
) -> torch.Tensor:
    """RoPE q ``[B, H*D]`` (returned ``[B, H, D]``) and k ``[B, Hkv*D]``, write k and v into cache slot ``at.pos`` of
    each row; with ``qk_norm`` (Qwen3's ``(q weight, k weight, q eps, k eps)``) each q / k head RMS-normed first."""
    b, d, hkv = q.shape[0], at.cos.shape[-1], at.k_cache.shape[1]
    h = q.shape[1] // d
    q_out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    qw, kw, q_eps, k_eps = qk_norm if qk_norm is not None else (None, None, None, None)
    _rope_cache_kernel[(b, h + 2 * hkv)](
        q,
        q_out,
        qw,
        q_eps,
        k,
        at.k_cache,
        kw,
        k_eps,
        *at.k_cache.stride()[:3],
        v,
        at.v_cache,
        *at.v_cache.stride()[:3],
        at.cos,
        at.sin,
        at.pos,
        H=h,
        HKV=hkv,
        D=d,
        num_warps=1,
    )
    return q_out
