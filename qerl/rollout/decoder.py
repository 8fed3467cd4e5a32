"""The small ops of the native decoder, each matching transformers' arithmetic for the families of ``qerl.arch``.

Each op dispatches: CUDA inputs take the fused Triton kernel of ``qerl.kernels.fused_step`` when
``qerl.kernels.backend.available``, everything else its plain-torch twin in ``qerl.kernels.reference``
(CPU tests, fp32, ``QERL_TRITON=0``): at batch 1 a decode step is ~1.2 ms of
weight streaming, and an unfused RMSNorm (6 launches) or RoPE (10) costs more than the matmuls
around it once multiplied by the layer count.

LoRA inputs: the ops that produce a projection group's input (``rms_norm`` for q/k/v and gate/up,
``decode_attention`` for o, ``silu_mul`` for down) take that group and also return ``lora``, the
group's shrinks ``u_j = x @ A_j.T`` in one buffer (:class:`LoraU`; ``None`` without adapters). On
CUDA with at most ``FUSED_LORA_MAX_ROWS`` rows the shrink is reduced inside the producing kernel (no
launch of its own); otherwise it is one matmul per group. ``group_forward`` then folds each ``u_j``
into its projection (the FP4 kernel's epilogue, or an ``addmm``); a group whose NVFP4 weights are
row-stacked (``layers.Stacked``) runs as one FP4 launch with every expand in its epilogue.

Gluon K order: on Hopper the decode GEMMs of more than 16 rows (more than 8 for GEMMs of at least
``schedule.GLUON_MIN_WEIGHTS`` weights), and of at most 8, run Gluon kernels that
read x with each 256-element K step permuted (``qerl.kernels.fp4_base.nibble_major``). The ops producing
such a GEMM's input write it in that order (``_gluon_order`` decides per group and row count); a fused
shrink still reduces the values in natural order, and an unfused one (above ``FUSED_LORA_MAX_ROWS``) uses
A with the same column order (``Group.lora_a_gluon``), so nothing is permuted per call.

Rounding follows transformers: RMSNorm normalises in fp32, casts to the activation dtype, then
multiplies by the weight; residual adds and SiLU-gating round to the activation dtype.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qerl import kernels
from qerl.kernels import backend, reference, schedule
from qerl.rollout.layers import Group, Norm, Proj

#: Rows (decode batch) up to which LoRA shrinks are fused into the kernel producing their input (above, one
#: cuBLAS matmul per group). 64: with the RMSNorm shrink split over u's ranks up to 64 rows
#: (``step_norm.RANK_SPLIT_MAX_ROWS``) the fused path beats cuBLAS there too (docs/kernels.md#fused-lora-rows).
FUSED_LORA_MAX_ROWS = 64


@dataclass
class LoraU:
    """A group's LoRA shrinks ``u = x @ A.T`` (every projection's ranks side by side) in one buffer:
    ``[..., R]`` row-major (``bounds`` None: one matmul made it), or the flat segmented buffer a fused
    shrink kernel writes (``bounds`` = the group's ``lora_bounds``; projection j's ``[rows, r_j]``
    block contiguous, as ``qerl.kernels.fp4_base.segmented`` lays it out)."""

    u: torch.Tensor
    bounds: tuple[int, int] | None
    lead: torch.Size  # x's leading dims

    def per_projection(self, group: Group) -> list[torch.Tensor | None]:
        """``u_j`` ``[..., r_j]`` for every projection (None where it has no adapter)."""
        slices = [p.lora_slice for p in group.projs]
        if self.bounds is None:
            return [None if s is None else self.u[..., s] for s in slices]
        rows = math.prod(self.lead)
        return [
            None if s is None else self.u[s.start * rows : s.stop * rows].view(*self.lead, s.stop - s.start)
            for s in slices
        ]


LoraInputs = LoraU | None

#: Whether a row-stacked group (``layers.Stacked``) runs as one FP4 launch; benchmarks/rollout.py
#: turns it off, with a fresh engine (graphs bake the choice in), for a same-run A/B.
STACK_GROUPS = True


def _fuse_lora(x: torch.Tensor, rows: int, group: Group | None) -> bool:
    """Whether the group's shrink over ``rows`` rows is reduced inside the kernel producing x."""
    return group is not None and group.lora_a is not None and backend.available(x) and rows <= FUSED_LORA_MAX_ROWS


def lora_inputs(x: torch.Tensor, group: Group | None, permuted: bool = False) -> LoraInputs:
    """``u_j = x @ A_j.T`` for every LoRA-wrapped projection of the group: one matmul (None without LoRA).
    ``permuted``: x is in the Gluon kernel's K order, so A's columns are taken in that order too."""
    if group is None or group.lora_a is None:
        return None
    return LoraU(x @ (group.lora_a_gluon if permuted else group.lora_a).t(), None, x.shape[:-1])


def _gluon_order(like: torch.Tensor, rows: int, k: int, group: Group | None) -> bool:
    """Whether the op producing the group's input (``rows`` x ``k``) writes it in the Gluon decode
    kernels' K order: the group runs as one FP4 launch (``group_forward``) that takes one of them
    (``kernels.gluon_order``), and its shrink, if any, has ``lora_a_gluon`` (used when the shrink is not
    fused). This replaces a permute launch per GEMM (4 a layer: ~0.34 ms of a 7B b=64 step, H200)."""
    launch = None if group is None else group.fp4_launch()
    return (
        launch is not None
        and (STACK_GROUPS or group.stacked is None)
        and (group.lora_a is None or group.lora_a_gluon is not None)
        and kernels.gluon_order(rows, launch[0].packed.shape[0], k, like)
    )


def _segmented(flat: torch.Tensor, like: torch.Tensor, group: Group) -> LoraInputs:
    """A fused shrink kernel's segmented u buffer for the group producing ``like``."""
    return LoraU(flat, group.lora_bounds, like.shape[:-1])


def rms_norm(
    h: torch.Tensor, norm: Norm, delta: torch.Tensor | None = None, group: Group | None = None
) -> tuple[torch.Tensor, torch.Tensor, LoraInputs]:
    """Residual add and RMSNorm: returns ``(h + delta, rmsnorm(h + delta), lora inputs of group)``.

    The first result is the residual stream to carry on with: ``h`` itself updated in place, or a
    new tensor when a fused shrink needs ``h`` unchanged while it runs.
    """
    if backend.available(h):
        fused = kernels.step_kernels()
        rows = h.numel() // h.shape[-1]
        permuted = _gluon_order(h, rows, h.shape[-1], group)
        if _fuse_lora(h, rows, group):
            h, x, flat = fused.rms_norm_shrink(
                h, delta, norm.weight, norm.eps, group.lora_a, group.lora_bounds, permuted
            )
            return h, x, _segmented(flat, x, group)
        x = fused.rms_norm(h, delta, norm.weight, norm.eps, permute=permuted)
        return h, x, lora_inputs(x, group, permuted)
    x = reference.rms_norm(h, delta, norm.weight, norm.eps)
    return h, x, lora_inputs(x, group)


def qk_norm(
    q: torch.Tensor, k: torch.Tensor, norms: tuple[Norm, Norm], head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorms on q ``[..., H*D]`` and k ``[..., Hkv*D]``, before RoPE, as transformers
    applies them (over each head's D values, one weight shared by every head).

    In torch: the prefill (once per prompt) and every CPU step. A GPU decode step runs them inside the
    kernel that does the RoPE (``rope_attention``): in torch they were ~14 launches a layer."""
    q_norm, k_norm = norms
    q = reference.rms_norm(q.unflatten(-1, (-1, head_dim)), None, q_norm.weight, q_norm.eps).flatten(-2)
    k = reference.rms_norm(k.unflatten(-1, (-1, head_dim)), None, k_norm.weight, k_norm.eps).flatten(-2)
    return q, k


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    group: Group | None = None,
    qk_norms: tuple[Norm, Norm] | None = None,
) -> tuple[torch.Tensor, LoraInputs]:
    """Qwen3's q / k head norms (``qk_norms``), RoPE of this step's q and k, k / v written at slot ``pos``,
    then ``decode_attention``: q ``[B, H*D]``, k / v ``[B, Hkv*D]``, cos / sin the full ``[S, D]`` tables,
    caches ``[B, Hkv, S, D]`` views of this layer cut to the attended length. On the GPU the kernel that
    does the RoPE does the norms too, and with ``schedule.SWITCHES.rope_in_attention`` that kernel is the attention
    kernel itself (one launch fewer, the same bits)."""
    d = cos.shape[-1]
    b, hkv = q.shape[0], k_cache.shape[1]
    if not backend.available(q):
        if qk_norms is not None:
            q, k = qk_norm(q, k, qk_norms, d)
        q = reference.rope_and_cache(q, k, v, cos, sin, pos, k_cache, v_cache, q.shape[1] // d, hkv, d)
        return decode_attention(q, k_cache, v_cache, pos, scale, group)
    norms = None if qk_norms is None else (qk_norms[0].weight, qk_norms[1].weight, qk_norms[0].eps, qk_norms[1].eps)
    if schedule.SWITCHES.rope_in_attention:
        return decode_attention(
            q.view(b, -1, d), k_cache, v_cache, pos, scale, group, rope=(k, v, cos, sin), qk_norm=norms
        )
    q = kernels.step_kernels().rope_and_cache(q, k, v, cos, sin, pos, k_cache, v_cache, q.shape[1] // d, hkv, d, norms)
    return decode_attention(q, k_cache, v_cache, pos, scale, group)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, group: Group | None = None) -> tuple[torch.Tensor, LoraInputs]:
    """``(silu(gate) * up, lora inputs of group)``."""
    if backend.available(gate):
        fused = kernels.step_kernels()
        rows = gate.numel() // gate.shape[-1]
        permuted = _gluon_order(gate, rows, gate.shape[-1], group)
        if _fuse_lora(gate, rows, group):
            act, flat = fused.silu_mul_shrink(gate, up, group.lora_a, permuted)
            return act, _segmented(flat, act, group)
        act = fused.silu_mul(gate, up, permute=permuted)
        return act, lora_inputs(act, group, permuted)
    act = reference.silu_mul(gate, up)
    return act, lora_inputs(act, group)


#: CPU only: dense copies of frozen NVFP4 weights, keyed by module (dropped with it).
_CPU_DENSE: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def base_forward(x: torch.Tensor, proj: Proj) -> torch.Tensor:
    """The base layer on x. On CPU an NVFP4 base is dequantized once and the dense copy kept: the
    packed weight is frozen, and the reference path re-dequantizing every layer at every decode step
    dominated CPU rollouts. On GPU the packed weight is read by the kernels and nothing is copied."""
    base = proj.base
    if not (proj.is_nvfp4 and x.device.type == "cpu"):
        return base(x)
    dense = _CPU_DENSE.get(base)
    if dense is None or dense.dtype != x.dtype:
        dense = _CPU_DENSE[base] = base.dequantized_weight(x.dtype)
    return F.linear(x, dense, None if base.bias is None else base.bias.to(x.dtype))


def project(x: torch.Tensor, proj: Proj, u: torch.Tensor | None) -> torch.Tensor:
    """base(x) + u @ (B * scaling).T: the one seam where LoRA meets the base matmul.

    On CUDA an NVFP4 base with LoRA goes to the kernel helper's decode op with the expand folded into
    its epilogue when ``qerl.kernels`` offers one; otherwise the expand is a separate ``addmm``.
    """
    if u is None or proj.lora_b is None:
        return base_forward(x, proj)
    if proj.is_nvfp4 and x.is_cuda:
        base = proj.base
        bias = None if base.bias is None else base.bias.to(x.dtype)
        return kernels.nvfp4_decode(
            x, base.weight_packed, base.weight_scale, base.weight_global_scale, bias, u, proj.lora_b
        )
    y = base_forward(x, proj)
    flat = y.reshape(-1, y.shape[-1])
    flat = torch.addmm(flat, u.reshape(-1, u.shape[-1]).to(y.dtype), proj.lora_b.t().to(y.dtype))
    return flat.reshape(y.shape)


def group_forward(x: torch.Tensor, group: Group, lora: LoraInputs = None) -> list[torch.Tensor]:
    """Every projection of the group on x; ``lora`` from the op that produced x (computed here if None).

    Where the kernels run (``backend.available``) a row-stacked group is one FP4 launch
    (``stacked_forward``). Elsewhere each projection runs on its own: on CPU the per-module dense
    copies of ``base_forward`` are far faster than dequantizing the stacked weight at every step.
    """
    permuted = _gluon_order(x, x.numel() // x.shape[-1], x.shape[-1], group)
    if lora is None:
        lora = lora_inputs(x, group, permuted)
    if permuted or (STACK_GROUPS and group.stacked is not None and backend.available(x)):
        return stacked_forward(x, group, lora, permuted)
    us = lora.per_projection(group) if lora is not None else [None] * len(group.projs)
    return [project(x, p, u) for p, u in zip(group.projs, us, strict=True)]


def stacked_forward(x: torch.Tensor, group: Group, lora: LoraInputs, permuted: bool = False) -> list[torch.Tensor]:
    """The group in one ``kernels.nvfp4_group_decode`` call (``Group.fp4_launch``): each output its own
    contiguous tensor, the LoRA expands (a stacked group's block-diagonal ``lora_b``) in the same
    epilogue. ``permuted``: x is in the Gluon kernel's K order (``_gluon_order``)."""
    st, lora_b = group.fp4_launch()
    bias = None if st.bias is None else st.bias.to(x.dtype)
    u, bounds, lora_b = (None, None, None) if lora is None else (lora.u, lora.bounds, lora_b)
    return kernels.nvfp4_group_decode(
        x, st.packed, st.scale, st.gscale, bias, st.splits, u, bounds, lora_b, permuted, pdl=True
    )  # the base weights are frozen


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    group: Group | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> tuple[torch.Tensor, LoraInputs]:
    """One query token per row against a static cache -> ``([B, H*D], lora inputs of group)``.

    q ``[B, H, D]``; caches ``[B, Hkv, S, D]`` (already holding this step's key/value); row ``i``
    attends to slots ``<= pos[i]``. GQA views q as ``[B, Hkv, G, D]`` so each cache byte is read once.
    ``rope`` and ``qk_norm`` (``rope_attention``, kernels only): ``fused_step.decode_attention``'s, q not
    rotated yet.
    """
    if rope is not None and not backend.available(q):
        raise ValueError("decoder.decode_attention: rope= needs the fused kernels (a CUDA tensor with triton)")
    if backend.available(q):
        permuted = _gluon_order(q, q.shape[0], q.shape[1] * q.shape[2], group)
        fuse = _fuse_lora(q, q.shape[0], group)
        out, flat = kernels.step_kernels().decode_attention(
            q,
            k_cache,
            v_cache,
            pos,
            scale,
            group.lora_a if fuse else None,
            permute=permuted,
            rope=rope,
            qk_norm=qk_norm,
        )
        return out, (_segmented(flat, out, group) if fuse else lora_inputs(out, group, permuted))
    out = reference.decode_attention(q, k_cache, v_cache, pos, scale)
    return out, lora_inputs(out, group)
