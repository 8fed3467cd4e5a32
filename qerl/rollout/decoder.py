"""The native decoder's projections: a group's projections run on their input x with the LoRA inputs the op that
produced x returned, each matching transformers' arithmetic for the families of ``qerl.arch``.

LoRA inputs: the ops that produce a projection group's input (the RMSNorms for q/k/v and gate/up, the attention for
o, the SiLU gating for down) also return the group's shrinks ``u_j = x @ A_j.T`` in one buffer (``LoraU``; ``None``
without adapters): reduced inside the producing kernel (``LoraU.from_kernel``), or one matmul per group
(``lora_inputs``). ``group_forward`` then folds each ``u_j`` into its projection (the FP4 kernel's epilogue, or an
``addmm``); a group whose NVFP4 weights are row-stacked (``layers.Stacked``) runs as one FP4 launch with every expand
in its epilogue (``stacked_forward``). Which of these a step runs is the step plan's choice (``step_plan``), made once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qerl import kernels
from qerl.kernels.epilogue import Epilogue
from qerl.rollout.layers import Group, Proj


@dataclass
class LoraU:
    """A group's LoRA shrinks ``u = x @ A.T`` (every projection's ranks side by side) in one buffer:
    ``[..., R]`` row-major (``bounds`` None: one matmul made it), or the flat segmented buffer a fused
    shrink kernel writes (``bounds`` = the group's ``lora_bounds``; projection j's ``[rows, r_j]``
    block contiguous, as ``qerl.kernels.fp4_base.segmented`` lays it out)."""

    u: torch.Tensor
    bounds: tuple[int, int] | None
    lead: torch.Size  # x's leading dims

    @classmethod
    def from_kernel(cls, flat: torch.Tensor, like: torch.Tensor, group: Group) -> LoraU:
        """A fused shrink kernel's segmented u buffer for the group whose input is ``like``."""
        return cls(flat, group.lora_bounds, like.shape[:-1])

    def per_projection(self, group: Group) -> list[torch.Tensor | None]:
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


def lora_inputs(x: torch.Tensor, group: Group | None, gluon_k: bool = False) -> LoraInputs:
    """``u_j = x @ A_j.T`` for every LoRA-wrapped projection of the group: one matmul (None without LoRA).
    ``gluon_k``: x is in the Gluon K order, so A's columns are taken in that order too (``lora_a_gluon_k``)."""
    if group is None or group.lora_a is None:
        return None
    return LoraU(x @ (group.lora_a_gluon_k if gluon_k else group.lora_a).t(), None, x.shape[:-1])


#: ``(x, lora) -> every projection of a group on x``.
GroupOp = Callable[[torch.Tensor, LoraInputs], list[torch.Tensor]]


def group_op(group: Group, device: torch.device, *, stacked: bool, gluon_k: bool) -> GroupOp:
    """``(x, lora) -> every projection of group on x``: one FP4 launch (``stacked``, x in the Gluon K order with
    ``gluon_k``), or one projection at a time on ``device`` (on CPU the per-module dense copies of
    ``dense_forward`` beat dequantizing a stacked weight every step)."""
    if stacked:
        return functools.partial(stacked_forward, group=group, gluon_k=gluon_k)
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
    """An NVFP4 base with LoRA on CUDA: the kernels' FP4 forward with the expand ``u @ B.T`` folded into its epilogue."""
    base = proj.base
    bias = None if base.bias is None else base.bias.to(x.dtype)
    return kernels.nvfp4_forward(x, base.packed_weight, epilogue=Epilogue(bias, u, proj.lora_b))


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


def group_forward(x: torch.Tensor, lora: LoraInputs = None, *, group: Group, projs: list) -> list[torch.Tensor]:
    """Every projection of the group on x, each on its own (``projs``: their bound ``projection_op``); ``lora`` from
    the op that produced x."""
    us = lora.per_projection(group) if lora is not None else [None] * len(projs)
    return [op(x, u) for op, u in zip(projs, us, strict=True)]


def stacked_forward(
    x: torch.Tensor, lora: LoraInputs = None, *, group: Group, gluon_k: bool = False
) -> list[torch.Tensor]:
    """The group in one ``kernels.nvfp4_group_decode`` call (``Group.fp4_launch``): each output its own
    contiguous tensor, the LoRA expands (a stacked group's block-diagonal ``lora_b``) in the same
    epilogue. ``gluon_k``: x is in the Gluon K order (``gluon_layout``)."""
    st, lora_b = group.fp4_launch()
    bias = None if st.bias is None else st.bias.to(x.dtype)
    u, bounds, lora_b = (None, None, None) if lora is None else (lora.u, lora.bounds, lora_b)
    epilogue = Epilogue(bias, u, lora_b, lora_bounds=bounds)
    return kernels.nvfp4_group_decode(
        x, st.weight, st.splits, epilogue=epilogue, gluon_k=gluon_k, pdl=True
    )  # the base weights are frozen
