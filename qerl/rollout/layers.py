"""A flat, read-only view of a causal LM of a :data:`qerl.arch.FAMILIES` family for the native engine.

``ModelView.from_model`` walks the trainer's model once per ``generate`` and records *references*
to its tensors: the packed NVFP4 buffers (or bf16 weights), the RMSNorm weights actually used in
forward (a peft ``ModulesToSaveWrapper``'s active copy when norms are trained), and the LoRA
factors of peft-wrapped projections. Nothing heavy is copied: a CUDA graph captured over the view
reads the very tensors the optimizer and AQN update in place. (Which ops run over it is the step plan's
choice, ``qerl.rollout.step_plan``.)

The one exception is LoRA. Projections that share an input (q/k/v; gate/up) get their ``A`` factors
concatenated into one ``[sum r, K]`` buffer so that the shrink ``u = x @ A.T`` is one reduction per
group (fused into the kernel that produces x, see ``qerl.kernels.fused_step``), and each ``B`` is stored
pre-multiplied by its peft scaling, in the compute dtype. These buffers are tiny (r=16 on a 7B
model: 40M values, under 1% of the weight bytes). They outlive a view: ``from_model(model,
previous)`` hands the previous view's buffers to the new one when their shapes still match, and
``refresh_lora`` copies the current factors into them in place at the start of every ``generate``,
so CUDA graphs captured earlier (which read the buffers by address) see a trainer step without
being recaptured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from peft.tuners.lora.layer import LoraLayer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn

from qerl import arch, nvfp4
from qerl.kernels import gluon_layout
from qerl.load.linear import NVFP4Linear


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside a peft ``PeftModel`` (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    lm = get_base() if callable(get_base) else model
    arch.check_config(
        getattr(lm, "config", None) or {}, f"rollout engine ({type(lm).__name__}; kind='hf' runs any model)"
    )
    if not hasattr(lm, "lm_head"):
        raise ValueError(f"native rollout engine: {type(lm).__name__} has no lm_head; expected a *ForCausalLM")
    return lm


def active_norm(module: nn.Module) -> nn.Module:
    """The RMSNorm that forward really uses: the trained copy under peft ``modules_to_save``."""
    if isinstance(module, ModulesToSaveWrapper):
        adapters = module.active_adapters
        if not module.disable_adapters and adapters and adapters[0] in module.modules_to_save:
            return module.modules_to_save[adapters[0]]
        return module.original_module
    return module


@dataclass
class Norm:
    """An RMSNorm's weight (read in place) and epsilon."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: nn.Module) -> Norm:
        norm = active_norm(module)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            raise ValueError(f"native rollout engine: {type(norm).__name__} has no epsilon; expected an RMSNorm")
        return cls(norm.weight, float(eps))


@dataclass
class Proj:
    """One projection: its base layer (NVFP4Linear or nn.Linear) and, if LoRA-wrapped, its factors.

    ``lora_b`` is the compute-dtype ``B * scaling`` buffer; ``lora_slice`` says which columns of the
    group's shrink output ``u`` belong to this projection.
    """

    base: nn.Module
    lora_sources: list[tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=list)
    lora_b: torch.Tensor | None = None
    lora_slice: slice | None = None

    @property
    def is_nvfp4(self) -> bool:
        return isinstance(self.base, NVFP4Linear)

    @property
    def weight_ptr(self) -> int:
        return (self.base.weight_packed if self.is_nvfp4 else self.base.weight).data_ptr()


@dataclass(frozen=True)
class Stacked:
    """A group's NVFP4 weights as one row-stacked weight (``qerl.load.linear.stack_fused_groups``): views
    over the members' own storage, so the group runs as one FP4 launch with nothing copied."""

    weight: nvfp4.NVFP4Tensors  # [sum N, K/2] packed, [sum N, K/16] scales, the members' one global scale
    bias: torch.Tensor | None  # [sum N]
    splits: tuple[int, ...]  # each member's rows


def _rows_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``[sum rows, ...]`` view if the tensors lie back to back, row-contiguous, in one storage."""
    first = tensors[0]
    row = first.stride(0)  # elements per row (1 for a bias)
    offset = first.storage_offset()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or t.storage_offset() != offset
            or t.shape[1:] != first.shape[1:]
        ):
            return None
        offset += t.shape[0] * row
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _stacked(projs: list[Proj]) -> Stacked | None:
    """The group's weights as one launch's operands, when ``stack_fused_groups`` laid them out so."""
    if len(projs) < 2 or not all(p.is_nvfp4 for p in projs):
        return None
    bases = [p.base for p in projs]
    packed = _rows_view([b.weight_packed for b in bases])
    scale = _rows_view([b.weight_scale for b in bases])
    if packed is None or scale is None or len({b.weight_global_scale.data_ptr() for b in bases}) != 1:
        return None
    biases = [b.bias for b in bases]
    bias = None
    if any(b is not None for b in biases) and (any(b is None for b in biases) or (bias := _rows_view(biases)) is None):
        return None  # some members without a bias, or biases that do not lie back to back
    weight = nvfp4.NVFP4Tensors(packed, scale, bases[0].weight_global_scale)
    return Stacked(weight, bias, tuple(b.out_features for b in bases))


@dataclass
class Group:
    """Projections that read the same input; their LoRA shrinks are done as one reduction.

    With ``stacked`` weights the group's LoRA expands are one block-diagonal ``lora_b`` ``[sum N,
    sum r]`` (projection j's rows are nonzero only in its own rank columns), so the one FP4 launch
    applies them all in its epilogue; each projection's ``lora_b`` is then a view of its block.
    """

    projs: list[Proj]
    lora_a: torch.Tensor | None = None  # [sum r, K], compute dtype
    stacked: Stacked | None = None
    lora_b: torch.Tensor | None = None  # [sum N, sum r] block-diagonal, with ``stacked`` only
    #: ``lora_a`` with its K columns in the Gluon K order (``gluon_layout``), for the shrink of an x written in that
    #: order: wherever that order can be (CUDA, whole K steps; else None), made with the other LoRA buffers since
    #: captured graphs read it by address. Whether a step's shrink reads it is the step plan's choice.
    lora_a_gluon_k: torch.Tensor | None = None

    def fp4_launch(self) -> tuple[Stacked, torch.Tensor | None] | None:
        """The group as one FP4 launch: ``(operands, block-diagonal lora_b)`` from ``stacked``, or a lone
        NVFP4 projection's own tensors; None when the group cannot run as one launch."""
        if self.stacked is not None:
            return self.stacked, self.lora_b
        if len(self.projs) == 1 and self.projs[0].is_nvfp4:
            b = self.projs[0].base
            return Stacked(b.packed_weight, b.bias, (b.out_features,)), self.projs[0].lora_b
        return None

    @property
    def in_features(self) -> int:
        """K of the group's input (every projection reads it)."""
        return self.projs[0].base.in_features

    @property
    def lora_bounds(self) -> tuple[int, int]:
        """Ends of the first two rank segments (padded with ``sum r``): the kernels' u layout key."""
        ends = [p.lora_slice.stop for p in self.projs if p.lora_slice is not None]
        total = ends[-1]
        return (ends[0] if len(ends) > 1 else total, ends[1] if len(ends) > 2 else total)


@dataclass
class LayerView:
    """One decoder layer's norms and projection groups."""

    attn_norm: Norm
    qkv: Group
    o: Group
    mlp_norm: Norm
    gate_up: Group
    down: Group
    #: Qwen3's per-head RMSNorms on q and k (``arch.QK_NORMS``), None for the other families.
    qk_norms: tuple[Norm, Norm] | None = None


def _proj(module: nn.Module) -> Proj:
    """Split a (possibly peft-wrapped) Linear into its base layer and active LoRA factors."""
    if not isinstance(module, LoraLayer):
        return Proj(module)
    if module.merged:
        raise ValueError("native rollout engine: merged LoRA layers are not supported; unmerge the adapter")
    sources = []
    if not module.disable_adapters:
        for name in module.active_adapters:
            if name not in module.lora_A:
                continue
            if module.use_dora.get(name, False):
                raise ValueError(f"native rollout engine: DoRA adapter {name!r} is not supported")
            sources.append((module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])))
    return Proj(module.get_base_layer(), sources)


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, old: torch.Tensor | None) -> torch.Tensor:
    """``old`` when it already has this shape, dtype and device (so graphs keep reading it), else a new one."""
    if old is not None and old.shape == shape and old.dtype == dtype and old.device == device:
        return old
    return torch.empty(shape, dtype=dtype, device=device)


def _group(modules: list[nn.Module], dtype: torch.dtype, previous: Group | None) -> Group:
    """The group's projections and LoRA buffers (``previous``'s buffers reused where they fit)."""
    projs = [_proj(m) for m in modules]
    stacked = _stacked(projs)
    ranks = [sum(a.shape[0] for a, _, _ in p.lora_sources) for p in projs]
    if sum(ranks) == 0:
        return Group(projs, stacked=stacked)
    if sum(r > 0 for r in ranks) > 3:
        raise ValueError("native rollout engine: at most 3 LoRA-wrapped projections may share an input")
    first = next(p for p in projs if p.lora_sources)
    device = first.lora_sources[0][0].device
    in_features = first.lora_sources[0][0].shape[1]
    old_a = previous.lora_a if previous is not None else None
    group = Group(projs, _buffer((sum(ranks), in_features), dtype, device, old_a), stacked)
    if device.type == "cuda" and gluon_layout.fits(in_features):
        old = previous.lora_a_gluon_k if previous is not None else None
        group.lora_a_gluon_k = _buffer((sum(ranks), in_features), dtype, device, old)
    if stacked is not None:
        old = previous.lora_b if previous is not None else None
        group.lora_b = _buffer((sum(stacked.splits), sum(ranks)), dtype, device, old)
    old_b = [p.lora_b for p in previous.projs] if previous is not None else [None] * len(projs)
    start = row = 0
    for proj, rank, old in zip(projs, ranks, old_b, strict=True):
        out_features = proj.base.out_features
        if rank:
            proj.lora_slice = slice(start, start + rank)
            if group.lora_b is not None:
                proj.lora_b = group.lora_b[row : row + out_features, proj.lora_slice]
            else:
                proj.lora_b = _buffer((out_features, rank), dtype, device, old)
            start += rank
        row += out_features
    return group


@torch.no_grad()
def refresh_lora(group: Group) -> None:
    """Copy the current LoRA factors into the group's compute-dtype buffers (in place)."""
    if group.lora_a is None:
        return
    if group.lora_b is not None:
        group.lora_b.zero_()  # the off-diagonal blocks; the projections' own blocks are copied below
    for proj in group.projs:
        if proj.lora_b is None:
            continue
        a = torch.cat([a for a, _, _ in proj.lora_sources], dim=0)
        b = torch.cat([b * s for _, b, s in proj.lora_sources], dim=1)
        group.lora_a[proj.lora_slice].copy_(a)
        proj.lora_b.copy_(b)
    if group.lora_a_gluon_k is not None:
        group.lora_a_gluon_k.copy_(gluon_layout.to_gluon_k(group.lora_a))


@dataclass
class ModelView:
    """Everything the native forward needs, as references into the live model."""

    lm: nn.Module
    embed: nn.Module
    layers: list[LayerView]
    final_norm: Norm
    lm_head: nn.Module
    rotary: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # tokens a query sees (Mistral); None: the whole sequence
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_model(cls, model: nn.Module, previous: ModelView | None = None) -> ModelView:
        """A view of ``model``'s current modules; LoRA buffers come from ``previous`` where they fit."""
        lm = unwrap_causal_lm(model)
        cfg = lm.config
        backbone = lm.model
        dtype = backbone.embed_tokens.weight.dtype
        family = arch.FAMILIES[cfg.model_type]  # unwrap_causal_lm checked it
        old = previous.layers if previous is not None and len(previous.layers) == len(backbone.layers) else None
        layers = []
        for i, layer in enumerate(backbone.layers):
            attn, mlp = layer.self_attn, layer.mlp
            prev = old[i] if old is not None else None
            layers.append(
                LayerView(
                    attn_norm=Norm.of(layer.input_layernorm),
                    qkv=_group([getattr(attn, n) for n in arch.QKV], dtype, None if prev is None else prev.qkv),
                    o=_group([attn.o_proj], dtype, None if prev is None else prev.o),
                    mlp_norm=Norm.of(layer.post_attention_layernorm),
                    gate_up=_group(
                        [getattr(mlp, n) for n in arch.GATE_UP], dtype, None if prev is None else prev.gate_up
                    ),
                    down=_group([mlp.down_proj], dtype, None if prev is None else prev.down),
                    qk_norms=tuple(Norm.of(getattr(attn, n)) for n in arch.QK_NORMS) if family.qk_norm else None,
                )
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"native rollout engine: hidden_act={act!r} is not supported (expected silu)")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            lm=lm,
            embed=backbone.embed_tokens,
            layers=layers,
            final_norm=Norm.of(backbone.norm),
            lm_head=lm.lm_head,
            rotary=backbone.rotary_emb,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            sliding_window=arch.sliding_window(cfg),
            dtype=dtype,
            device=backbone.embed_tokens.weight.device,
        )

    def groups(self) -> list[Group]:
        return [g for layer in self.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def refresh_lora(self) -> None:
        for group in self.groups():
            refresh_lora(group)

    def signature(self) -> tuple:
        """Addresses and shapes a captured graph depends on: if any changes, graphs are recaptured."""

        def ptr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        ptrs: list[object] = [ptr(self.embed.weight), ptr(self.final_norm.weight), ptr(self.lm_head.weight)]
        for layer in self.layers:
            ptrs += [ptr(layer.attn_norm.weight), ptr(layer.mlp_norm.weight)]
            ptrs += [ptr(n.weight) for n in layer.qk_norms or ()]
            for group in (layer.qkv, layer.o, layer.gate_up, layer.down):
                ptrs.append(
                    (ptr(group.lora_a), ptr(group.lora_b), ptr(group.lora_a_gluon_k), group.stacked is not None)
                )
                ptrs += [
                    (
                        p.weight_ptr,
                        ptr(getattr(p.base, "bias", None)),
                        ptr(p.lora_b),
                        p.lora_slice and p.lora_slice.stop,
                    )
                    for p in group.projs
                ]
        return tuple(ptrs)
