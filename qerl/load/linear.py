"""``NVFP4Linear``: a frozen Linear whose weight stays packed (4.5 bits per weight) in memory.

It hides the format behind a small API: build it from a dense weight (``from_linear``) or from
checkpoint tensors (``from_tensors``), call it like ``nn.Linear``, ask for ``dequantized_weight()``
when a dense copy is really needed. The forward goes through ``qerl.kernels.nvfp4_linear``, which
picks the Triton kernels on CUDA and the dequantize-then-matmul reference elsewhere; on CPU it reads the dense copy
the rollout engine keeps (``cpu_dense``) when there is one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qerl import kernels, nvfp4

#: CPU only: a dense copy of each frozen NVFP4 weight, ``module -> (the packed tensor it came from, dense)``, made by
#: the rollout engine (``qerl.rollout.decoder``: re-dequantizing every layer at every decode step dominated CPU
#: rollouts) and read by the module's own forward. Training's forward used to dequantize a fresh copy per layer,
#: which autograd kept until the backward: a second dense model (0.4 GiB of SmolLM2-135M's 2.8 GiB of saved tensors).
_CPU_DENSE: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


class NVFP4Linear(nn.Module):
    """y = x @ W_hat.T + b with W_hat held as NVFP4 buffers (never trained; LoRA goes on top)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        nvfp4.check_quantizable((out_features, in_features))
        self.in_features = in_features
        self.out_features = out_features
        # Buffers, not parameters: optimizers, peft and `requires_grad_` must never see them.
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // nvfp4.GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_tensors(cls, q: nvfp4.NVFP4Tensors, bias: torch.Tensor | None = None) -> NVFP4Linear:
        out_features, half_k = q.weight_packed.shape
        layer = cls(half_k * 2, out_features, bias=bias is not None, device="meta")
        layer.weight_packed = q.weight_packed.contiguous()
        layer.weight_scale = q.weight_scale.contiguous()
        layer.weight_global_scale = q.weight_global_scale.reshape(1).float()
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @classmethod
    def empty_like(cls, linear: nn.Linear, bias_dtype: torch.dtype = torch.bfloat16) -> NVFP4Linear:
        """An unfilled meta-device NVFP4Linear of ``linear``'s shape, for building models without
        ever allocating their dense weights (the loader fills it from a checkpoint)."""
        return cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", bias_dtype=bias_dtype
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, gscale: torch.Tensor | None = None) -> NVFP4Linear:
        """Quantize a dense Linear (round-to-nearest, compressed-tensors semantics)."""
        return cls.from_tensors(nvfp4.quantize(linear.weight.data, gscale), linear.bias)

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)``, ``.half()``, ``.bfloat16()`` move the packed tensors but never recast them:
        an fp8 block scale or fp32 global scale cast to bf16 would silently change the weights."""
        packed = dict(self._buffers)
        self._buffers = {}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buf in packed.items():
                moved = fn(buf) if buf is not None else None
                self._buffers[name] = moved if moved is None or moved.dtype == buf.dtype else buf.to(moved.device)
        return self

    @property
    def qweight(self) -> torch.Tensor:
        """The packed weight under the name peft (and GPTQ-style tooling) probes to find a quantized
        layer's device; its uint8 dtype tells peft not to cast adapters to it."""
        return self.weight_packed

    @property
    def packed_weight(self) -> nvfp4.NVFP4Tensors:
        """The three buffers as the one weight operand the kernels take (built on each call: ``stack_fused_groups``
        and ``.to()`` replace the buffers, so a cached copy could go stale)."""
        return nvfp4.NVFP4Tensors(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.packed_weight.dequantize(dtype)

    def cpu_dense(self, dtype: torch.dtype, make: bool = True) -> torch.Tensor | None:
        """The dense weight in ``dtype`` kept for this module on CPU (:data:`_CPU_DENSE`), made now when ``make``;
        None when there is none and ``make`` is False. Valid while the module holds the packed tensor it came from."""
        kept = _CPU_DENSE.get(self)
        if kept is not None and kept[0] is self.weight_packed and kept[1].dtype == dtype:
            return kept[1]
        if not make:
            return None
        dense = self.dequantized_weight(dtype)
        _CPU_DENSE[self] = (self.weight_packed, dense)
        return dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        dense = self.cpu_dense(x.dtype, make=False) if x.device.type == "cpu" else None
        if dense is not None:  # the values the reference path would dequantize, and autograd keeps no copy of them
            return F.linear(x, dense, bias)
        return kernels.nvfp4_linear(x, self.packed_weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format=nvfp4"


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None]) -> None:
    """Put ``make(name, linear)`` in place of every ``nn.Linear`` of ``model`` (full module name
    given); where it returns None the Linear stays. One walk for the loader (driven by the
    checkpoint's tensors), the benchmarks (empty packed layers) and the tests (quantize in place)."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                new = make(f"{parent_name}.{child_name}" if parent_name else child_name, child)
                if new is not None:
                    setattr(parent, child_name, new)


def _stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Row-wise concatenation (fp8 through its bytes: ``cat`` has no float8 kernel on every build)."""
    if tensors[0].dtype == torch.float8_e4m3fn:
        return torch.cat([t.view(torch.uint8) for t in tensors]).view(torch.float8_e4m3fn)
    return torch.cat(tensors)


@torch.no_grad()
def stack_fused_groups(model: nn.Module) -> int:
    """Store each q/k/v and gate/up group's packed weights (and biases) as one row-stacked tensor.

    Every member keeps its own ``weight_packed`` / ``weight_scale`` / ``bias``, now row views of the
    group's stacked tensors, and the members share one global-scale tensor. Nothing is duplicated
    (each group is rebuilt in turn, so the transient extra memory is one group), the training forward
    is unchanged, and the rollout engine sees that the group is contiguous and runs it as one FP4
    launch (``qerl.kernels.nvfp4_group_decode``). A group is left as it is where its members differ
    in input size, device or bias presence, or where their global scales differ (llm-compressor and
    ``qerl.quantize.pipeline`` give fused groups one global scale, as vLLM needs; that check reads the scales
    once, at load). Returns the number of groups stacked.
    """
    from qerl import arch

    stacked = 0
    for module in model.modules():
        for names in arch.FUSED_GROUPS:
            # A peft wrapper's base layer is the one that holds the weights.
            members = [getattr(m, "get_base_layer", lambda m=m: m)() for m in (getattr(module, n, None) for n in names)]
            if not all(isinstance(m, NVFP4Linear) for m in members):
                continue
            first = members[0]
            if any(
                m.in_features != first.in_features
                or m.weight_packed.device != first.weight_packed.device
                or (m.bias is None) != (first.bias is None)
                for m in members
            ):
                continue
            scales = torch.cat([m.weight_global_scale.reshape(1) for m in members])
            if not bool((scales == scales[0]).all()):
                continue
            packed = _stack_rows([m.weight_packed for m in members])
            scale = _stack_rows([m.weight_scale for m in members])
            bias = None if first.bias is None else torch.cat([m.bias.data for m in members])
            start = 0
            for m in members:
                rows = slice(start, start + m.out_features)
                m.weight_packed, m.weight_scale = packed[rows], scale[rows]
                m.weight_global_scale = first.weight_global_scale
                if bias is not None:
                    m.bias = nn.Parameter(bias[rows], requires_grad=m.bias.requires_grad)
                start += m.out_features
            stacked += 1
    return stacked
