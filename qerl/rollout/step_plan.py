"""The rollout's step plan: which implementation each op of the native engine's pass runs, chosen once per model view
and row count (a batch bucket, or a prefill chunk's tokens) instead of at every call, then bound to its tensors.

Each op that produces a projection group's input (the residual-add + RMSNorm before q/k/v and gate/up, the
attention before o, the SiLU gating before down) has three ways to run, and a ``Route`` names one:

* the torch reference (``qerl.kernels.reference``: CPU, fp32, ``QERL_TRITON=0``), the group's LoRA shrink one
  matmul after it;
* the fused Triton kernel (``qerl.kernels.fused_step``) with the group's shrink reduced inside it (at most
  ``FUSED_LORA_MAX_ROWS`` rows), or as one matmul after it;
* either kernel writing its output in the Gluon K order (``gluon_k``) when the group's one FP4 launch reads that
  order (``kernels.reads_gluon_k``, a question about the GEMM's shape): this replaces a permute launch per GEMM (4 a
  layer: ~0.34 ms of a 7B b=64 step).

The group then runs as one FP4 launch or one projection at a time (``decoder.group_op``), and the step samples with
one kernel or the torch ops (``sampler``) and records its tokens with one kernel or torch (``finish_op``). ``build``
binds every op once (the candidates are this module's ``norm_*``, ``silu_*`` and ``attention_*`` functions, so what
a plan chose reads off it); the engine then calls them with tensors only, with no branch. At batch 1 a decode step
is ~1.2 ms of weight streaming, and an unfused RMSNorm (6 launches) or RoPE (10) costs more than the matmuls around
it once multiplied by the layer count. Rounding follows transformers: RMSNorm normalises in fp32, casts to the activation
dtype, then multiplies by the weight; residual adds and SiLU-gating round to the activation dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qerl import kernels
from qerl.kernels import backend, reference, schedule
from qerl.kernels.reference import AttentionArgs, StepBooks
from qerl.rollout import decoder
from qerl.rollout.decoder import GroupOp, LoraInputs, LoraU, lora_inputs
from qerl.rollout.layers import Group, ModelView, Norm

#: Rows (decode batch) up to which LoRA shrinks are fused into the kernel producing their input (above, one cuBLAS
#: matmul per group): the by-rank RMSNorm shrink beats cuBLAS up to 64 rows (docs/kernels.md#fused-lora-rows).
FUSED_LORA_MAX_ROWS = 64
#: Whether a row-stacked group (``layers.Stacked``) runs as one FP4 launch; benchmarks/rollout.py turns it off, with a
#: fresh engine (graphs bake the choice in), for an A/B.
STACK_GROUPS = True

#: Qwen3's per-head norms as the attention kernels take them: (q weight ``[D]``, k weight ``[D]``, q eps, k eps);
#: None for the other families.
HeadNorms = tuple[torch.Tensor, torch.Tensor, float, float] | None


def qk_norm(
    q: torch.Tensor, k: torch.Tensor, norms: tuple[Norm, Norm], head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorms on q ``[..., H*D]`` and k ``[..., Hkv*D]``, before RoPE, as transformers applies
    them: over each head's D values, one weight for every head. In torch: prefill and the reference step; a kernel
    step does them in the kernel that does the RoPE."""
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


def writes_gluon_k(view: ModelView, rows: int, group: Group | None, stack: bool) -> bool:
    """Whether the op producing the group's input writes it in the Gluon K order: the group runs as one FP4 launch
    (``stack``: row-stacked groups may) that reads that order (``kernels.reads_gluon_k``), and its shrink, if any,
    has ``lora_a_gluon_k`` (used when the shrink is not fused)."""
    launch = None if group is None else group.fp4_launch()
    return (
        launch is not None
        and (stack or group.stacked is None)
        and (group.lora_a is None or group.lora_a_gluon_k is not None)
        and kernels.reads_gluon_k(rows, sum(launch[0].splits), group.in_features, view.dtype, view.device)
    )


def route(
    view: ModelView, rows: int, group: Group | None, fuse_max_rows: int, stack: bool, natural: bool = False
) -> Route:
    """The route of the op producing ``group``'s ``rows``-row input on ``view``'s device and dtype (the rules of the
    module doc); ``group`` None: an op feeding no projection (the final norm). ``natural``: that op is not one of
    these (prefill's attention), so its output stays in natural K order."""
    kernel = backend.serves(view.device)
    gluon_k = not natural and writes_gluon_k(view, rows, group, stack)
    return Route(
        kernel=kernel,
        fuse=kernel and group is not None and group.lora_a is not None and rows <= fuse_max_rows,
        gluon_k=gluon_k,
        stacked=group is not None and (gluon_k or (stack and group.stacked is not None and kernel)),
    )


# ----------------------------------------------------------------- residual add + RMSNorm

NormOp = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor, LoraInputs]]


def norm_reference(h: torch.Tensor, delta: torch.Tensor | None, *, norm: Norm, group: Group | None) -> tuple:
    x = reference.rms_norm(h, delta, norm.weight, norm.eps)
    return h, x, lora_inputs(x, group)


def norm_kernel(
    h: torch.Tensor, delta: torch.Tensor | None, *, norm: Norm, group: Group | None, gluon_k: bool
) -> tuple:
    x = kernels.step_kernels().rms_norm(h, delta, norm.weight, norm.eps, gluon_k=gluon_k)
    return h, x, lora_inputs(x, group, gluon_k)


def norm_shrink(h: torch.Tensor, delta: torch.Tensor | None, *, norm: Norm, group: Group, gluon_k: bool) -> tuple:
    h, x, flat = kernels.step_kernels().rms_norm_shrink(
        h, delta, norm.weight, norm.eps, group.lora_a, group.lora_bounds, gluon_k
    )
    return h, x, LoraU.from_kernel(flat, x, group)


def norm_op(r: Route, norm: Norm, group: Group | None) -> NormOp:
    """``(h, delta) -> (h + delta, rmsnorm(h + delta), lora inputs of group)``. The first result is the residual
    stream to carry on with: ``h`` updated in place, or a new tensor when a fused shrink needs ``h`` unchanged."""
    if not r.kernel:
        return functools.partial(norm_reference, norm=norm, group=group)
    return functools.partial(norm_shrink if r.fuse else norm_kernel, norm=norm, group=group, gluon_k=r.gluon_k)


# ----------------------------------------------------------------- SiLU gating

SiluOp = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, LoraInputs]]


def silu_reference(gate: torch.Tensor, up: torch.Tensor, *, group: Group) -> tuple:
    act = reference.silu_mul(gate, up)
    return act, lora_inputs(act, group)


def silu_kernel(gate: torch.Tensor, up: torch.Tensor, *, group: Group, gluon_k: bool) -> tuple:
    act = kernels.step_kernels().silu_mul(gate, up, gluon_k=gluon_k)
    return act, lora_inputs(act, group, gluon_k)


def silu_shrink(gate: torch.Tensor, up: torch.Tensor, *, group: Group, gluon_k: bool) -> tuple:
    act, flat = kernels.step_kernels().silu_mul_shrink(gate, up, group.lora_a, gluon_k)
    return act, LoraU.from_kernel(flat, act, group)


def silu_op(r: Route, group: Group) -> SiluOp:
    """``(gate, up) -> (silu(gate) * up, lora inputs of group)``."""
    if not r.kernel:
        return functools.partial(silu_reference, group=group)
    return functools.partial(silu_shrink if r.fuse else silu_kernel, group=group, gluon_k=r.gluon_k)


# ----------------------------------------------------------------- decode attention

AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionArgs], tuple[torch.Tensor, LoraInputs]]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: AttentionArgs,
    *,
    group: Group,
    qk_norms: tuple[Norm, Norm] | None,
) -> tuple:
    if qk_norms is not None:
        q, k = qk_norm(q, k, qk_norms, a.cos.shape[-1])
    q = reference.rope_and_cache(q, k, v, a)
    out = reference.decode_attention(q, a.k_cache, a.v_cache, a.pos, a.scale)
    return out, lora_inputs(out, group)


def attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttentionArgs, *, group: Group, norms: HeadNorms, r: Route
) -> tuple:
    """RoPE and the cache write in their own kernel (Qwen3's head norms in it), then the attention kernels."""
    fused = kernels.step_kernels()
    q = fused.rope_and_cache(q, k, v, a, norms)
    out, flat = fused.decode_attention(
        q, a.k_cache, a.v_cache, a.pos, a.scale, group.lora_a if r.fuse else None, gluon_k=r.gluon_k
    )
    return out, (LoraU.from_kernel(flat, out, group) if r.fuse else lora_inputs(out, group, r.gluon_k))


def attention_rope_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttentionArgs, *, group: Group, norms: HeadNorms, r: Route
) -> tuple:
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
    return out, (LoraU.from_kernel(flat, out, group) if r.fuse else lora_inputs(out, group, r.gluon_k))


def attention_op(r: Route, group: Group, qk_norms: tuple[Norm, Norm] | None) -> AttentionOp:
    """``(q [B, H*D], k / v [B, Hkv*D], args) -> ([B, H*D], lora inputs of group)``: Qwen3's q / k head norms
    (``qk_norms``), RoPE of this step's q and k, k / v written at slot ``pos``, then attention over each row's
    slots ``<= pos``. The kernels do the norms inside the RoPE kernel, and with ``SWITCHES.rope_in_attention``
    (read here, when the plan is built) that kernel is the attention kernel itself: one launch a layer fewer."""
    if not r.kernel:
        return functools.partial(attention_reference, group=group, qk_norms=qk_norms)
    norms = None if qk_norms is None else (qk_norms[0].weight, qk_norms[1].weight, qk_norms[0].eps, qk_norms[1].eps)
    fn = attention_rope_kernel if schedule.SWITCHES.rope_in_attention else attention_kernel
    return functools.partial(fn, group=group, norms=norms, r=r)


# ----------------------------------------------------------------- sampling and bookkeeping

#: ``(logits [B, V], temperature, seed, step, greedy) -> (tokens, log-probs)``: ``fused_step.sample``.
SampleOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]
#: ``(tokens, log-probs, books) -> None``: ``reference.finish_step`` or its kernel.
FinishOp = Callable[[torch.Tensor, torch.Tensor, StepBooks], None]


def sampler(kernel: bool) -> SampleOp | None:
    """How sampling without top-k / top-p runs: one kernel (``fused_step.sample``, its draws from a seed tensor the
    engine takes from its generator) where the kernels run and ``SWITCHES.fused_sampler``; None: the torch ops of
    ``qerl.rollout.sampling``, drawing from the engine's generator (they move the ``[B, V]`` logits ~10 times)."""
    return kernels.step_kernels().sample if kernel and schedule.SWITCHES.fused_sampler else None


def finish_op(kernel: bool) -> FinishOp:
    """The step's bookkeeping (``reference.finish_step``): one kernel where the kernels run."""
    return kernels.step_kernels().finish_step if kernel else reference.finish_step


# ----------------------------------------------------------------- the step


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
    """Every op of one pass over ``rows`` rows, chosen once (``build``): ``first_norm`` then ``layers``, then the
    sampler (``sample``: the fused kernel, or None for the torch ops) and the bookkeeping (``finish``)."""

    rows: int
    first_norm: NormOp
    layers: tuple[LayerOps, ...]
    sample: SampleOp | None
    finish: FinishOp


def build(view: ModelView, rows: int, decode: bool) -> StepPlan:
    """The plan of a pass over ``rows`` rows of ``view``: each group's ``Route`` picks its producer op and its
    projections' run, with ``FUSED_LORA_MAX_ROWS`` and ``STACK_GROUPS`` read now (a decode plan is built once per
    batch bucket and model view, a prefill plan once per chunk). ``decode``: bind the decode attention too."""
    fuse_max_rows, stack = FUSED_LORA_MAX_ROWS, STACK_GROUPS

    def routed(group: Group | None, natural: bool = False) -> Route:
        return route(view, rows, group, fuse_max_rows, stack, natural)

    def run(r: Route, group: Group) -> GroupOp:
        return decoder.group_op(group, view.device, stacked=r.stacked, gluon_k=r.gluon_k)

    layers = view.layers
    ops = []
    for i, layer in enumerate(layers):
        last = i + 1 == len(layers)
        nxt_group = None if last else layers[i + 1].qkv
        nxt_norm = view.final_norm if last else layers[i + 1].attn_norm
        o, gate_up, down = routed(layer.o, natural=not decode), routed(layer.gate_up), routed(layer.down)
        ops.append(
            LayerOps(
                qkv=run(routed(layer.qkv), layer.qkv),
                attention=attention_op(o, layer.o, layer.qk_norms) if decode else None,
                o=run(o, layer.o),
                mlp_norm=norm_op(gate_up, layer.mlp_norm, layer.gate_up),
                gate_up=run(gate_up, layer.gate_up),
                silu=silu_op(down, layer.down),
                down=run(down, layer.down),
                next_norm=norm_op(routed(nxt_group), nxt_norm, nxt_group),
            )
        )
    first = layers[0]
    kernel = backend.serves(view.device)
    first_norm = norm_op(routed(first.qkv), first.attn_norm, first.qkv)
    return StepPlan(rows, first_norm, tuple(ops), sampler(kernel), finish_op(kernel))


#: ``attend(layer, q, k, v) -> (attention output, o_proj's LoRA inputs)``: what prefill and decode differ in.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, LoraInputs]]


def run_layers(ops: StepPlan, h: torch.Tensor, attend: Attend) -> torch.Tensor:
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
