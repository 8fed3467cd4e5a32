"""Plain-torch versions of every kernel in ``qerl.kernels``: what runs where Triton does not (CPU,
fp32, ``QERL_TRITON=0``), and what each kernel is tested against. Same signatures as the kernels,
less their fused LoRA shrinks (the rollout's step plan computes those inputs with ``decoder.lora_inputs`` here).

Rounding follows transformers' modules (fp32 norm math cast back to the activation dtype, softmax in
fp32), so the native engine on this path matches a transformers forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qerl import nvfp4
from qerl.kernels.epilogue import PLAIN, Bounds, Epilogue


def mm(x: torch.Tensor, weight: nvfp4.NVFP4Tensors, epilogue: Epilogue = PLAIN) -> torch.Tensor:
    """``x @ W_hat^T`` and its ``epilogue``: dequantize to x's dtype, then ``linear`` (``fp4_gemm.matmul``'s
    reference). Autograd flows to x, bias and the LoRA operands."""
    return linear(x, weight.dequantize(x.dtype), epilogue)


def linear(x: torch.Tensor, w: torch.Tensor, epilogue: Epilogue = PLAIN) -> torch.Tensor:
    """``x @ w^T`` for a dense ``w`` of x's dtype, and the ``epilogue`` in plain matmuls, y (and a flat ``lora_u``)
    segmented as it says; also ``fp4_gemm.matmul``'s path above the decode sizes, after a kernel dequantize."""
    y = F.linear(x, w, epilogue.bias)
    u = epilogue.lora_u
    if u is not None:
        if epilogue.lora_bounds is not None:
            u = unsegment(u, x.shape[0], epilogue.lora_bounds, epilogue.rank)
        y = y + epilogue.lora_scale * (u.to(x.dtype) @ epilogue.lora_b.to(x.dtype).t())
    return y if epilogue.out_bounds is None else segment(y, epilogue.out_bounds)


def _segments(bounds: Bounds, total: int) -> list[tuple[int, int]]:
    """Column ranges [0, S1), [S1, S2), [S2, total) of a segmented layout (empty ones included)."""
    s1, s2 = bounds
    return [(0, s1), (s1, s2), (s2, total)]


def unsegment(flat: torch.Tensor, rows: int, bounds: Bounds, total: int) -> torch.Tensor:
    """The ``[rows, total]`` matrix held in ``flat`` in the segmented layout (``fp4_base.segmented``)."""
    return torch.cat([flat[lo * rows : hi * rows].view(rows, hi - lo) for lo, hi in _segments(bounds, total)], dim=1)


def segment(mat: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """``mat`` ``[rows, total]`` as a flat buffer in the segmented layout (``unsegment``'s inverse)."""
    return torch.cat([mat[:, lo:hi].reshape(-1) for lo, hi in _segments(bounds, mat.shape[1])])


def mm_t(grad_y: torch.Tensor, weight: nvfp4.NVFP4Tensors) -> torch.Tensor:
    """``grad_y @ W_hat`` (``fp4_gemm.matmul_t``'s reference)."""
    return grad_y @ weight.dequantize(grad_y.dtype)


def rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (the residual stream), then RMSNorm of it in h's dtype."""
    if delta is not None:
        h.add_(delta)
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * hf.to(h.dtype)).to(h.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., T, H, D]``, cos/sin broadcastable ``[..., T, 1, D]``."""
    return x * cos + rotate_half(x) * sin


@dataclass(frozen=True)
class AttentionArgs:
    """What one decode step's attention reads besides q / k / v: the full ``[S, D]`` RoPE tables, each row's cache
    slot ``pos``, this layer's caches ``[B, Hkv, S, D]`` cut to the attended length, and the softmax scale."""

    cos: torch.Tensor
    sin: torch.Tensor
    pos: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: AttentionArgs) -> torch.Tensor:
    """RoPE one token per row (q ``[B, H*D]`` -> ``[B, H, D]``) and write its k / v ``[B, Hkv*D]`` at slot ``at.pos``."""
    b, d, hkv = q.shape[0], at.cos.shape[-1], at.k_cache.shape[1]
    c, s = at.cos[at.pos][:, None, :], at.sin[at.pos][:, None, :]
    rows = torch.arange(b, device=q.device)
    at.k_cache[rows, :, at.pos] = apply_rope(k.view(b, hkv, d), c, s)
    at.v_cache[rows, :, at.pos] = v.view(b, hkv, d)
    return apply_rope(q.view(b, q.shape[1] // d, d), c, s)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per row against a static cache -> ``[B, H*D]``; row ``i`` attends to slots
    ``<= pos[i]``. GQA views q as ``[B, Hkv, G, D]`` so each cache byte is read once."""
    valid = torch.arange(k_cache.shape[2], device=q.device)[None, :] <= pos[:, None]
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    qg = q.view(b, hkv, h // hkv, d)
    scores = torch.matmul(qg, k_cache.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_cache.dtype)
    return torch.matmul(probs, v_cache).reshape(b, h * d)


def is_stop(tok: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """Per row: whether ``tok`` is one of the ``stop`` ids (-1 pads never match a token)."""
    return (tok[:, None] == stop[None, :]).any(-1)


@dataclass(frozen=True)
class StepBooks:
    """The buffers a decode step's bookkeeping (``finish_step``) reads and writes: per slot the done flags, output
    rows, fed-back tokens and positions; the stop ids; the step counter; the output tokens / log-probs ``[rows, T]``;
    the pad id a finished row records."""

    done: torch.Tensor
    row_id: torch.Tensor
    stop: torch.Tensor
    step: torch.Tensor
    tokens: torch.Tensor
    pos: torch.Tensor
    out_tok: torch.Tensor
    out_lp: torch.Tensor
    pad_id: int


def finish_step(tok: torch.Tensor, lp: torch.Tensor, books: StepBooks) -> None:
    """Record this step's tokens/log-probs (pad and 0 for finished rows), mark stop tokens done, feed
    the tokens back, advance positions and the step counter."""
    done = books.done
    tok = torch.where(done, books.pad_id, tok)
    lp = torch.where(done, 0.0, lp)
    books.out_tok[books.row_id, books.step] = tok
    books.out_lp[books.row_id, books.step] = lp
    done |= is_stop(tok, books.stop)
    books.tokens.copy_(tok)
    books.pos.add_(1)
    books.step.add_(1)
