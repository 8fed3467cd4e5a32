"""The decode step's plan: which implementation each small op of the native engine runs, chosen once per model and
row count (a batch bucket, or a prefill chunk's tokens) instead of at every call.

Each op that produces a projection group's input (the residual-add + RMSNorm before q/k/v and gate/up, the
attention before o, the SiLU gating before down) has three ways to run, and a ``Route`` names one:

* the torch reference (``reference``: CPU, fp32, ``QERL_TRITON=0``), the group's LoRA shrink one matmul after it;
* the fused Triton kernel (``fused_step``) with the group's shrink reduced inside it (at most ``fuse_max_rows``
  rows: docs/kernels.md#fused-lora-rows), or as one matmul after it;
* either kernel writing its output in the Gluon decode kernels' K order (``gluon_k``) when the group's one FP4
  launch reads that order (``gluon_order``): this replaces a permute launch per GEMM (4 a layer: ~0.34 ms of a 7B
  b=64 step).

``op_for`` binds a route's function to its group once; the engine then calls the bound op with tensors only. The
groups, norms and layers are the rollout engine's (``qerl.rollout.layers``), read here by attribute only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qerl import kernels
from qerl.kernels import backend, reference, schedule
from qerl.kernels.reference import AttentionArgs, StepBooks

#: Qwen3's per-head norms as the attention kernels take them: (q weight ``[D]``, k weight ``[D]``, q eps, k eps).
HeadNorms = tuple[torch.Tensor, torch.Tensor, float, float]


@dataclass
class LoraU:
    """A group's LoRA shrinks ``u = x @ A.T`` (every projection's ranks side by side) in one buffer:
    ``[..., R]`` row-major (``bounds`` None: one matmul made it), or the flat segmented buffer a fused
    shrink kernel writes (``bounds`` = the group's ``lora_bounds``; projection j's ``[rows, r_j]``
    block contiguous, as ``qerl.kernels.fp4_base.segmented`` lays it out)."""

    u: torch.Tensor
    bounds: tuple[int, int] | None
    lead: torch.Size  # x's leading dims

    def per_projection(self, group: Any) -> list[torch.Tensor | None]:
        """``u_j`` ``[..., r_j]`` for every projection of ``group`` (None where it has no adapter)."""
        slices = [p.lora_slice for p in group.projs]
        if self.bounds is None:
            return [None if s is None else self.u[..., s] for s in slices]
        rows = math.prod(self.lead)
        return [
            None if s is None else self.u[s.start * rows : s.stop * rows].view(*self.lead, s.stop - s.start)
            for s in slices
        ]


LoraInputs = LoraU | None


def lora_inputs(x: torch.Tensor, group: Any, gluon_k: bool = False) -> LoraInputs:
    """``u_j = x @ A_j.T`` for every LoRA-wrapped projection of the group: one matmul (None without LoRA).
    ``gluon_k``: x is in the Gluon kernel's K order, so A's columns are taken in that order too."""
    if group is None or group.lora_a is None:
        return None
    return LoraU(x @ (group.lora_a_gluon_k if gluon_k else group.lora_a).t(), None, x.shape[:-1])


def segmented(flat: torch.Tensor, like: torch.Tensor, group: Any) -> LoraU:
    """A fused shrink kernel's segmented u buffer for the group whose input is ``like``."""
    return LoraU(flat, group.lora_bounds, like.shape[:-1])


def qk_norm(
    q: torch.Tensor, k: torch.Tensor, norms: tuple[Any, Any], head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorms on q ``[..., H*D]`` and k ``[..., Hkv*D]`` (``norms``: two objects with ``weight``
    and ``eps``), before RoPE, as transformers applies them: over each head's D values, one weight for every head.
    In torch: prefill and the reference step; a kernel step does them in the kernel that does the RoPE."""
    q_norm, k_norm = norms
    q = reference.rms_norm(q.unflatten(-1, (-1, head_dim)), None, q_norm.weight, q_norm.eps).flatten(-2)
    k = reference.rms_norm(k.unflatten(-1, (-1, head_dim)), None, k_norm.weight, k_norm.eps).flatten(-2)
    return q, k


@dataclass(frozen=True)
class Route:
    """How the op producing a group's input runs: ``kernel`` (the fused Triton kernel, else the torch reference),
    ``fuse`` (the group's LoRA shrink inside that kernel), ``gluon_k`` (its output in the Gluon K order), and
    ``stacked`` (the group's projections as one FP4 launch, ``decoder.stacked_forward``)."""

    kernel: bool
    fuse: bool = False
    gluon_k: bool = False
    stacked: bool = False


def gluon_order(like: torch.Tensor, rows: int, k: int, group: Any, stack: bool) -> bool:
    """Whether the op producing the group's input (``rows`` x ``k``) writes it in the Gluon decode kernels' K order:
    the group runs as one FP4 launch (``stack``: row-stacked groups may) that takes one of them
    (``kernels.gluon_order``), and its shrink, if any, has ``lora_a_gluon_k`` (used when the shrink is not fused)."""
    launch = None if group is None else group.fp4_launch()
    return (
        launch is not None
        and (stack or group.stacked is None)
        and (group.lora_a is None or group.lora_a_gluon_k is not None)
        and kernels.gluon_order(rows, sum(launch[0].splits), k, like)
    )


def route(
    like: torch.Tensor, rows: int, k: int | None, group: Any, fuse_max_rows: int, stack: bool, natural: bool = False
) -> Route:
    """The route of the op producing ``group``'s ``rows`` x ``k`` input on ``like``'s device and dtype (the rules
    of the module doc); ``group`` None: an op feeding no projection (the final norm). ``natural``: that op is not
    one of these (prefill's attention), so its output stays in natural K order."""
    kernel = backend.available(like)
    gluon_k = not natural and gluon_order(like, rows, k, group, stack)
    return Route(
        kernel=kernel,
        fuse=kernel and group is not None and group.lora_a is not None and rows <= fuse_max_rows,
        gluon_k=gluon_k,
        stacked=group is not None and (gluon_k or (stack and group.stacked is not None and kernel)),
    )


# ----------------------------------------------------------------- residual add + RMSNorm

NormOp = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor, LoraInputs]]


def _norm_reference(h: torch.Tensor, delta: torch.Tensor | None, *, norm: Any, group: Any) -> tuple:
    x = reference.rms_norm(h, delta, norm.weight, norm.eps)
    return h, x, lora_inputs(x, group)


def _norm_kernel(h: torch.Tensor, delta: torch.Tensor | None, *, norm: Any, group: Any, gluon_k: bool) -> tuple:
    x = kernels.step_kernels().rms_norm(h, delta, norm.weight, norm.eps, gluon_k=gluon_k)
    return h, x, lora_inputs(x, group, gluon_k)


def _norm_shrink(h: torch.Tensor, delta: torch.Tensor | None, *, norm: Any, group: Any, gluon_k: bool) -> tuple:
    h, x, flat = kernels.step_kernels().rms_norm_shrink(
        h, delta, norm.weight, norm.eps, group.lora_a, group.lora_bounds, gluon_k
    )
    return h, x, segmented(flat, x, group)


def norm_op(r: Route, norm: Any, group: Any) -> NormOp:
    """``(h, delta) -> (h + delta, rmsnorm(h + delta), lora inputs of group)``. The first result is the residual
    stream to carry on with: ``h`` updated in place, or a new tensor when a fused shrink needs ``h`` unchanged."""
    if not r.kernel:
        return functools.partial(_norm_reference, norm=norm, group=group)
    return functools.partial(_norm_shrink if r.fuse else _norm_kernel, norm=norm, group=group, gluon_k=r.gluon_k)


# ----------------------------------------------------------------- SiLU gating

SiluOp = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, LoraInputs]]


def _silu_reference(gate: torch.Tensor, up: torch.Tensor, *, group: Any) -> tuple:
    act = reference.silu_mul(gate, up)
    return act, lora_inputs(act, group)


def _silu_kernel(gate: torch.Tensor, up: torch.Tensor, *, group: Any, gluon_k: bool) -> tuple:
    act = kernels.step_kernels().silu_mul(gate, up, gluon_k=gluon_k)
    return act, lora_inputs(act, group, gluon_k)


def _silu_shrink(gate: torch.Tensor, up: torch.Tensor, *, group: Any, gluon_k: bool) -> tuple:
    act, flat = kernels.step_kernels().silu_mul_shrink(gate, up, group.lora_a, gluon_k)
    return act, segmented(flat, act, group)


def silu_op(r: Route, group: Any) -> SiluOp:
    """``(gate, up) -> (silu(gate) * up, lora inputs of group)``."""
    if not r.kernel:
        return functools.partial(_silu_reference, group=group)
    return functools.partial(_silu_shrink if r.fuse else _silu_kernel, group=group, gluon_k=r.gluon_k)


# ----------------------------------------------------------------- decode attention


AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionArgs], tuple[torch.Tensor, LoraInputs]]


def _attention_reference(q, k, v, a: AttentionArgs, *, group: Any, qk_norms: Any) -> tuple:
    if qk_norms is not None:
        q, k = qk_norm(q, k, qk_norms, a.cos.shape[-1])
    q = reference.rope_and_cache(q, k, v, a)
    out = reference.decode_attention(q, a.k_cache, a.v_cache, a.pos, a.scale)
    return out, lora_inputs(out, group)


def _attention_kernel(q, k, v, a: AttentionArgs, *, group: Any, norms: HeadNorms | None, r: Route) -> tuple:
    """RoPE and the cache write in their own kernel (Qwen3's head norms in it), then the attention kernels."""
    fused = kernels.step_kernels()
    q = fused.rope_and_cache(q, k, v, a, norms)
    out, flat = fused.decode_attention(
        q, a.k_cache, a.v_cache, a.pos, a.scale, group.lora_a if r.fuse else None, gluon_k=r.gluon_k
    )
    return out, (segmented(flat, out, group) if r.fuse else lora_inputs(out, group, r.gluon_k))


def _attention_rope_kernel(q, k, v, a: AttentionArgs, *, group: Any, norms: HeadNorms | None, r: Route) -> tuple:
    """The attention's partial kernel ropes q and this step's k and writes k / v into the cache itself."""
    out, flat = kernels.step_kernels().decode_attention(
        q.view(q.shape[0], -1, a.cos.shape[-1]),
        a.k_cache,
        a.v_cache,
        a.pos,
        a.scale,
        group.lora_a if r.fuse else None,
        gluon_k=r.gluon_k,
        rope=(k, v, a.cos, a.sin),
        qk_norm=norms,
    )
    return out, (segmented(flat, out, group) if r.fuse else lora_inputs(out, group, r.gluon_k))


def attention_op(r: Route, group: Any, qk_norms: tuple[Any, Any] | None) -> AttentionOp:
    """``(q [B, H*D], k / v [B, Hkv*D], args) -> ([B, H*D], lora inputs of group)``: Qwen3's q / k head norms
    (``qk_norms``), RoPE of this step's q and k, k / v written at slot ``pos``, then attention over each row's
    slots ``<= pos``. The kernels do the norms inside the RoPE kernel, and with ``SWITCHES.rope_in_attention``
    (read here, when the plan is built) that kernel is the attention kernel itself: one launch a layer fewer."""
    if not r.kernel:
        return functools.partial(_attention_reference, group=group, qk_norms=qk_norms)
    norms = None if qk_norms is None else (qk_norms[0].weight, qk_norms[1].weight, qk_norms[0].eps, qk_norms[1].eps)
    fn = _attention_rope_kernel if schedule.SWITCHES.rope_in_attention else _attention_kernel
    return functools.partial(fn, group=group, norms=norms, r=r)


# ----------------------------------------------------------------- sampling and bookkeeping


def fused_sampler(like: torch.Tensor) -> bool:
    """Whether sampling without top-k / top-p runs ``fused_step.sample`` (its draws from a seed tensor) on
    ``like``'s device, rather than the torch ops drawing from the engine's generator."""
    return schedule.SWITCHES.fused_sampler and backend.available(like)


def finish_step_op(like: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, StepBooks], None]:
    """The step's bookkeeping (``reference.finish_step``): one kernel where the kernels run."""
    return kernels.step_kernels().finish_step if backend.available(like) else reference.finish_step


# ----------------------------------------------------------------- the step

GroupOp = Callable[[torch.Tensor, LoraInputs], list[torch.Tensor]]


@dataclass(frozen=True)
class LayerOps:
    """One decoder layer's ops, bound to its groups: ``next_norm`` is the residual add + RMSNorm after the MLP,
    feeding the next layer's q/k/v (the final norm after the last layer); ``attention`` None in prefill, whose
    attention is the engine's own (its output, in natural K order, feeds ``o`` with ``lora_inputs``)."""

    qkv: GroupOp
    attention: AttentionOp | None
    o: GroupOp
    mlp_norm: NormOp
    gate_up: GroupOp
    silu: SiluOp
    down: GroupOp
    next_norm: NormOp


@dataclass(frozen=True)
class StepPlan:
    """Every op of one pass over ``rows`` rows, chosen once (``build``): ``first_norm`` then ``layers``."""

    rows: int
    first_norm: NormOp
    layers: tuple[LayerOps, ...]


def build(
    model: Any,
    rows: int,
    *,
    group_op: Callable[[Route, Any, torch.device], GroupOp],
    fuse_max_rows: int,
    stack: bool,
    decode: bool,
) -> StepPlan:
    """The plan of a pass over ``rows`` rows of ``model`` (a ``qerl.rollout.layers.ModelPlan``): each group's
    ``Route`` (``route``) picks its producer op here and its projections' run (``group_op``, the engine's
    stacked or per-projection forward). ``decode``: bind the decode attention too."""
    like = torch.empty(0, dtype=model.dtype, device=model.device)

    def routed(group: Any, natural: bool = False) -> Route:
        k = None if group is None else group.projs[0].base.in_features
        return route(like, rows, k, group, fuse_max_rows, stack, natural)

    layers = model.layers
    ops = []
    for i, layer in enumerate(layers):
        last = i + 1 == len(layers)
        nxt_group = None if last else layers[i + 1].qkv
        nxt_norm = model.final_norm if last else layers[i + 1].attn_norm
        o, gate_up, down = routed(layer.o, natural=not decode), routed(layer.gate_up), routed(layer.down)
        ops.append(
            LayerOps(
                qkv=group_op(routed(layer.qkv), layer.qkv, model.device),
                attention=attention_op(o, layer.o, layer.qk_norms) if decode else None,
                o=group_op(o, layer.o, model.device),
                mlp_norm=norm_op(gate_up, layer.mlp_norm, layer.gate_up),
                gate_up=group_op(gate_up, layer.gate_up, model.device),
                silu=silu_op(down, layer.down),
                down=group_op(down, layer.down, model.device),
                next_norm=norm_op(routed(nxt_group), nxt_norm, nxt_group),
            )
        )
    first = layers[0]
    return StepPlan(rows, norm_op(routed(first.qkv), first.attn_norm, first.qkv), tuple(ops))
