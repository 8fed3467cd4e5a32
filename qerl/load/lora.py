"""LoRA over ``NVFP4Linear`` (and plain ``nn.Linear``) through peft's public custom-module API.

peft's own LoRA Linear does the work (A/B init, scaling, dropout, saving, loading); we tell it where
the base layer lives, refuse to merge into packed weights (a bf16 delta cannot be folded into 4-bit
codes without re-quantizing: the adapter always stays unmerged, as QeRL's RL loop needs;
``qerl.export`` writes a merged checkpoint for serving), and give both layer kinds the same adapter
forward, ``DirectLoraForward``, for the vanilla case a training pass runs.
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from qerl import arch
from qerl.load.linear import NVFP4Linear

#: LoRA on every decoder Linear (QeRL's setting).
DEFAULT_TARGETS = arch.LINEAR_TARGETS
#: Activation dtypes that an fp32 adapter weight holds exactly, so peft's cast of them to fp32 changes no value.
_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)


class DirectLoraForward:
    """peft's vanilla LoRA forward without its per-call dtype round trip and its ``* 1.0``.

    Why: peft keeps the adapters in fp32 and, for each projection, casts the input to the adapter's
    dtype (``_cast_input_dtype``: a copy of the bf16 activation to fp32) which bf16 autocast then
    casts back to bf16 for the GEMM; ``* scaling`` multiplies by 1.0 when alpha equals r (qerl's
    default). Those two casts, the multiply, and their mirror images in the backward ran for every
    projection of every layer (docs/performance.md, "Training pass"). Here, under autocast, the
    activation goes to ``lora_A`` as it is (autocast casts the fp32 weights, as it did), the scale
    is applied only when it is not 1.0, and the delta is added to the base output once.

    Exact: an fp32 weight holds every bf16/fp16 value, so bf16 -> fp32 -> bf16 is the identity; the
    GEMMs see the same operands; ``x * 1.0`` is ``x``. Anything beyond that vanilla case (dropout that
    is active, a LoRA variant such as DoRA, ``adapter_names``, several active adapters, merged or
    disabled adapters, a cast that would change values, extra arguments) runs peft's own forward.

    ``fold_expand`` (off unless :func:`fold_lora_expand` sets it): the expand GEMM adds its product into the base
    output itself (``addmm``, whose epilogue reads it), so the delta is never written and read back: two passes over
    the output instead of four, the largest for gate/up. The sum is then rounded once instead of twice, so it is not
    bitwise the path above: within one rounding of the output (``tests/test_lora_direct.py``).
    """

    fold_expand = False

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._direct_adapter(x) if not (args or kwargs) else None
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        shrunk, expand, scaling = self.lora_A[adapter](x), self.lora_B[adapter], self.scaling[adapter]
        if self.fold_expand and expand.bias is None:
            rows = result.reshape(-1, result.shape[-1])
            summed = torch.addmm(rows, shrunk.reshape(-1, shrunk.shape[-1]), expand.weight.t(), alpha=scaling)
            return summed.view(result.shape)
        delta = expand(shrunk)
        if scaling != 1.0:
            delta = delta * scaling
        return (result + delta).to(result.dtype)

    def _direct_adapter(self, x: torch.Tensor) -> str | None:
        """The one active adapter when the direct forward computes exactly what peft's would, else None."""
        if self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        adapter = self.active_adapters[0]
        if adapter not in self.lora_A or adapter in self.lora_variant:
            return None
        dropout = self.lora_dropout[adapter]
        if not isinstance(dropout, nn.Identity) and dropout.training:
            return None
        weight_dtype = self.lora_A[adapter].weight.dtype
        if x.dtype == weight_dtype:  # peft casts nothing either
            return adapter
        # Under autocast the GEMM sees x in the autocast dtype whichever way it comes: skipping peft's cast to the
        # adapter's dtype is exact when that dtype holds x exactly (an fp32 adapter, a float activation).
        autocast = torch.is_autocast_enabled(x.device.type)
        return adapter if autocast and weight_dtype == torch.float32 and x.dtype in _EXACT_IN_FP32 else None


def fold_lora_expand(model: nn.Module, on: bool = True) -> int:
    """Set ``DirectLoraForward.fold_expand`` on every such layer of ``model``; how many there are."""
    layers = [m for m in model.modules() if isinstance(m, DirectLoraForward)]
    for layer in layers:
        layer.fold_expand = on
    return len(layers)


class NVFP4LoraLinear(DirectLoraForward, PeftLoraLinear):
    """peft's LoRA Linear over a packed NVFP4 base; adapters stay in their own (fp32) dtype.

    peft finds the base layer's device through ``NVFP4Linear.qweight``; being uint8, it leaves the
    adapter dtype alone.
    """

    def _get_in_out_features(self, module: NVFP4Linear) -> tuple[int, int]:
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NotImplementedError(
            "LoRA cannot be merged into NVFP4 weights in place; it stays unmerged by design. To serve a trained "
            "adapter, write a merged checkpoint: python -m qerl.export --model NVFP4_DIR --lora ADAPTER --output DIR"
        )

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        a = self.lora_A[adapter].weight
        b = self.lora_B[adapter].weight
        return (b @ a) * self.scaling[adapter]


class DenseLoraLinear(DirectLoraForward, PeftLoraLinear):
    """peft's LoRA Linear over a bf16 (or fp32) ``nn.Linear``, with the direct forward: the bf16 arm's passes
    lose the same casts as the NVFP4 arm's. Merging and everything else are peft's."""


class _PlainLinearType(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return type(obj) is nn.Linear


class PlainLinear(metaclass=_PlainLinearType):
    """``isinstance(m, PlainLinear)``: ``m`` is a ``torch.nn.Linear`` itself, not a subclass. peft's custom-module
    table matches with ``isinstance``; keyed by ``nn.Linear`` it would also take the subclasses that peft's own
    dispatchers handle (bitsandbytes' quantized Linears), which this key leaves to them."""


def register_nvfp4(config: LoraConfig) -> LoraConfig:
    """Teach a LoraConfig qerl's LoRA layers (NVFP4Linear, plain nn.Linear); returns the same config."""
    config._register_custom_module({NVFP4Linear: NVFP4LoraLinear, PlainLinear: DenseLoraLinear})
    return config


def lora_config(
    r: int = 16,
    alpha: int | None = None,
    dropout: float = 0.0,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
    train_norms: bool = False,
) -> LoraConfig:
    """The QeRL LoRA recipe (alpha defaults to r), ready for NVFP4 and bf16 models alike."""
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else r,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        modules_to_save=list(arch.NORM_MODULES) if train_norms else None,
        task_type="CAUSAL_LM",
    )
    return register_nvfp4(cfg)


def load_adapter(
    model: torch.nn.Module, adapter_dir: str, *, is_trainable: bool = False, config: LoraConfig | None = None
) -> PeftModel:
    """``PeftModel.from_pretrained`` for NVFP4 and bf16 bases alike.

    peft does not save custom-module mappings in adapter_config.json, so the saved LoraConfig (``config``, when the
    caller read and checked it already: ``qerl.load.adapter``) is registered for NVFP4Linear and passed in explicitly.
    """
    config = config if config is not None else LoraConfig.from_pretrained(adapter_dir)
    return PeftModel.from_pretrained(model, adapter_dir, config=register_nvfp4(config), is_trainable=is_trainable)
