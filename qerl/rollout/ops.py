"""The small ops of the native decoder, each matching transformers' Llama/Qwen2 arithmetic.

Every op has a plain-torch version (CPU tests, fp32) and, where a fused Triton kernel exists in
``qerl.rollout.fused``, CUDA inputs take that instead: at batch 1 a decode step is ~1.2 ms of
weight streaming, and an unfused RMSNorm (6 launches) or RoPE (10) costs more than the matmuls
around it once multiplied by the layer count.

Rounding follows transformers: RMSNorm normalises in fp32, casts to the activation dtype, then
multiplies by the weight; residual adds and SiLU-gating round to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl.rollout import fused
from qerl.rollout.layers import Group, Proj


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if fused.available(x):
        return fused.kernels_module().rms_norm(x, None, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (the residual stream), then return ``rms_norm(h)``."""
    if fused.available(h):
        return fused.kernels_module().rms_norm(h, delta, weight, eps)
    h.add_(delta)
    return rms_norm(h, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., T, H, D]``, cos/sin broadcastable ``[..., T, 1, D]``."""
    return x * cos + rotate_half(x) * sin


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Decode: RoPE one token per row (q ``[B, H*D]`` -> ``[B, H, D]``), write its k/v at slot ``pos``.

    cos/sin are the full ``[S, D]`` tables; caches are ``[B, Hkv, S, D]`` views of this layer.
    """
    b, d = q.shape[0], cos.shape[-1]
    if fused.available(q):
        return fused.kernels_module().rope_and_cache(
            q, k, v, cos, sin, pos, k_cache, v_cache, num_heads, num_kv_heads, d
        )
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    rows = torch.arange(b, device=q.device)
    k_cache[rows, :, pos] = apply_rope(k.view(b, num_kv_heads, d), c, s)
    v_cache[rows, :, pos] = v.view(b, num_kv_heads, d)
    return apply_rope(q.view(b, num_heads, d), c, s)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if fused.available(gate):
        return fused.kernels_module().silu_mul(gate, up)
    return F.silu(gate) * up


def lora_shrink(x: torch.Tensor, group: Group) -> torch.Tensor | None:
    """u = x @ A_cat.T for every LoRA-wrapped projection of the group at once (None without LoRA)."""
    if group.lora_a is None:
        return None
    return x.to(group.lora_a.dtype) @ group.lora_a.t()


def project(x: torch.Tensor, proj: Proj, u: torch.Tensor | None) -> torch.Tensor:
    """base(x) + u[:, slice] @ (B * scaling).T: the one seam where LoRA meets the base matmul.

    On CUDA an NVFP4 base with LoRA goes to the kernel helper's decode op with the expand folded into
    its epilogue when ``qerl.kernels`` offers one; otherwise the expand is a separate ``addmm``.
    """
    if u is None or proj.lora_b is None:
        return proj.base(x)
    ui = u[..., proj.lora_slice]
    fused_op = fused.nvfp4_lora_op(x) if proj.is_nvfp4 else None
    if fused_op is not None:
        base = proj.base
        bias = None if base.bias is None else base.bias.to(x.dtype)
        return fused_op(x, base.weight_packed, base.weight_scale, base.weight_global_scale, bias, ui, proj.lora_b)
    y = proj.base(x)
    flat = y.reshape(-1, y.shape[-1])
    flat = torch.addmm(flat, ui.reshape(-1, ui.shape[-1]).to(y.dtype), proj.lora_b.t().to(y.dtype))
    return flat.reshape(y.shape)


def group_forward(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    u = lora_shrink(x, group)
    return [project(x, p, u) for p in group.projs]


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per row against a static cache -> ``[B, H*D]``.

    q ``[B, H, D]``; caches ``[B, Hkv, S, D]`` (already holding this step's key/value); row ``i``
    attends to slots ``< lengths[i]``. GQA views q as ``[B, Hkv, G, D]`` so each cache byte is read once.
    """
    if fused.available(q):
        return fused.kernels_module().decode_attention(q, k_cache, v_cache, lengths, scale)
    valid = torch.arange(k_cache.shape[2], device=q.device)[None, :] < lengths[:, None]
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    qg = q.view(b, hkv, h // hkv, d)
    scores = torch.matmul(qg, k_cache.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_cache.dtype)
    return torch.matmul(probs, v_cache).reshape(b, h * d)
