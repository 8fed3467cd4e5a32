"""The native decoder's projections and its step plan, each op matching transformers' arithmetic for the families of
``qerl.arch``.

Which implementation each small op runs (the fused Triton kernels of ``qerl.kernels.fused_step``, with or without a
group's LoRA shrink inside, writing the Gluon K order or not, or their plain-torch twins in ``qerl.kernels.reference``)
is chosen once per model and row count by ``qerl.kernels.plan`` (``step_plan``); the engine then calls one bound op
per step with no branches. At batch 1 a decode step is ~1.2 ms of weight streaming, and an unfused RMSNorm (6
launches) or RoPE (10) costs more than the matmuls around it once multiplied by the layer count.

LoRA inputs: the ops that produce a projection group's input (the RMSNorms for q/k/v and gate/up, the attention for
o, the SiLU gating for down) also return the group's shrinks ``u_j = x @ A_j.T`` in one buffer (``plan.LoraU``;
``None`` without adapters). With at most ``FUSED_LORA_MAX_ROWS`` rows on the kernels the shrink is reduced inside
the producing kernel; otherwise it is one matmul per group. ``group_forward`` then folds each ``u_j`` into its
projection (the FP4 kernel's epilogue, or an ``addmm``); a group whose NVFP4 weights are row-stacked
(``layers.Stacked``) runs as one FP4 launch with every expand in its epilogue (``stacked_forward``).

Rounding follows transformers: RMSNorm normalises in fp32, casts to the activation dtype, then multiplies by the
weight; residual adds and SiLU-gating round to the activation dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qerl import kernels
from qerl.kernels import plan
from qerl.kernels.epilogue import Epilogue
from qerl.kernels.plan import LoraInputs, LoraU, Route, lora_inputs, qk_norm
from qerl.rollout.layers import Group, ModelPlan, Proj

__all__ = [
    "Attend",
    "LoraInputs",
    "LoraU",
    "group_forward",
    "lora_inputs",
    "qk_norm",
    "run_layers",
    "stacked_forward",
    "step_plan",
]

#: Rows (decode batch) up to which LoRA shrinks are fused into the kernel producing their input (above, one cuBLAS
#: matmul per group): the by-rank RMSNorm shrink beats cuBLAS up to 64 rows (docs/kernels.md#fused-lora-rows).
FUSED_LORA_MAX_ROWS = 64

#: Whether a row-stacked group (``layers.Stacked``) runs as one FP4 launch; benchmarks/rollout.py turns it off, with a
#: fresh engine (graphs bake the choice in), for an A/B.
STACK_GROUPS = True


def step_plan(model: ModelPlan, rows: int, decode: bool) -> plan.StepPlan:
    """The ops of one pass of ``rows`` rows over ``model`` (``kernels.plan.build``), with this module's thresholds
    read now: a decode plan is built once per batch bucket and model, a prefill plan once per chunk."""
    return plan.build(
        model, rows, group_op=group_op, fuse_max_rows=FUSED_LORA_MAX_ROWS, stack=STACK_GROUPS, decode=decode
    )


#: ``attend(layer, q, k, v) -> (attention output, o_proj's LoRA inputs)``: what prefill and decode differ in.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, LoraInputs]]


def run_layers(ops: plan.StepPlan, h: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The decoder stack on embeddings ``h`` (any leading shape) -> final-normed hidden states, through the ops
    ``ops`` chose. Prefill and decode differ only in ``attend``; every norm feeds the next group's LoRA shrink."""
    h, x, lora = ops.first_norm(h, None)
    for i, layer in enumerate(ops.layers):
        q, k, v = layer.qkv(x, lora)
        attn, lora = attend(i, q, k, v)  # Qwen3's q / k norms included
        (o,) = layer.o(attn, lora)
        h, x, lora = layer.mlp_norm(h, o)
        gate, up = layer.gate_up(x, lora)
        act, lora = layer.silu(gate, up)
        (mlp,) = layer.down(act, lora)
        h, x, lora = layer.next_norm(h, mlp)
    return x


def group_op(route: Route, group: Group, device: torch.device) -> plan.GroupOp:
    """``(x, lora) -> every projection of group on x``, as the route says: one FP4 launch, or one projection at a
    time on ``device`` (on CPU the per-module dense copies of ``dense_forward`` beat dequantizing a stacked weight
    every step)."""
    if route.stacked:
        return functools.partial(stacked_forward, group=group, permuted=route.permute)
    return functools.partial(group_forward, group=group, projs=[projection_op(p, device) for p in group.projs])


def base_forward(x: torch.Tensor, proj: Proj) -> torch.Tensor:
    """The base layer on x (GPU, or a dense base on CPU): the kernels read an NVFP4 weight, nothing is copied."""
    return proj.base(x)


def dense_forward(x: torch.Tensor, proj: Proj) -> torch.Tensor:
    """An NVFP4 base on CPU, dequantized once and the dense copy kept (``NVFP4Linear.cpu_dense``, which training's
    forward reads too): the packed weight is frozen, and the reference path re-dequantizing every layer at every
    decode step dominated CPU rollouts."""
    base = proj.base
    return F.linear(x, base.cpu_dense(x.dtype), None if base.bias is None else base.bias.to(x.dtype))


def fp4_lora_forward(x: torch.Tensor, u: torch.Tensor, proj: Proj) -> torch.Tensor:
    """An NVFP4 base with LoRA on CUDA: the kernels' decode op with the expand ``u @ B.T`` folded into its epilogue."""
    base = proj.base
    bias = None if base.bias is None else base.bias.to(x.dtype)
    return kernels.nvfp4_decode(x, base.packed_weight, epilogue=Epilogue(bias, u, proj.lora_b))


def addmm_lora_forward(x: torch.Tensor, u: torch.Tensor, proj: Proj, base: ProjOp) -> torch.Tensor:
    """``base(x) + u @ B.T`` with the expand as a separate ``addmm`` (CPU, or a dense base)."""
    y = base(x)
    flat = y.reshape(-1, y.shape[-1])
    flat = torch.addmm(flat, u.reshape(-1, u.shape[-1]).to(y.dtype), proj.lora_b.t().to(y.dtype))
    return flat.reshape(y.shape)


#: ``x -> the projection's base output``.
ProjOp = Callable[[torch.Tensor], torch.Tensor]


def projection_op(proj: Proj, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``(x, u) -> base(x) + u @ (B * scaling).T`` on ``device``, bound once: the one seam where LoRA meets the base
    matmul (``u`` None and unused without an adapter)."""
    dense = proj.is_nvfp4 and device.type == "cpu"
    base = functools.partial(dense_forward if dense else base_forward, proj=proj)
    if proj.lora_b is None:
        return lambda x, u: base(x)
    if proj.is_nvfp4 and device.type == "cuda":
        return functools.partial(fp4_lora_forward, proj=proj)
    return functools.partial(addmm_lora_forward, proj=proj, base=base)


def project(x: torch.Tensor, proj: Proj, u: torch.Tensor | None) -> torch.Tensor:
    """One projection on x with its LoRA inputs ``u`` (``projection_op`` bound for x's device, then run)."""
    return projection_op(proj, x.device)(x, u)


def group_forward(x: torch.Tensor, lora: LoraInputs = None, *, group: Group, projs: list) -> list[torch.Tensor]:
    """Every projection of the group on x, each on its own (``projs``: their bound ``projection_op``); ``lora`` from
    the op that produced x."""
    us = lora.per_projection(group) if lora is not None else [None] * len(projs)
    return [op(x, u) for op, u in zip(projs, us, strict=True)]


def stacked_forward(
    x: torch.Tensor, lora: LoraInputs = None, *, group: Group, permuted: bool = False
) -> list[torch.Tensor]:
    """The group in one ``kernels.nvfp4_group_decode`` call (``Group.fp4_launch``): each output its own
    contiguous tensor, the LoRA expands (a stacked group's block-diagonal ``lora_b``) in the same
    epilogue. ``permuted``: x is in the Gluon kernel's K order (``plan.gluon_order``)."""
    st, lora_b = group.fp4_launch()
    bias = None if st.bias is None else st.bias.to(x.dtype)
    u, bounds, lora_b = (None, None, None) if lora is None else (lora.u, lora.bounds, lora_b)
    epilogue = Epilogue(bias, u, lora_b, lora_bounds=bounds)
    return kernels.nvfp4_group_decode(
        x, st.weight, st.splits, epilogue=epilogue, x_permuted=permuted, pdl=True
    )  # the base weights are frozen
