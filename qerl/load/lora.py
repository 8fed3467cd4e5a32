"""LoRA over ``NVFP4Linear`` through peft's public custom-module API.

peft's own LoRA Linear does the work (A/B init, scaling, dropout, saving, loading); we only tell it
where the base layer lives and refuse to merge, because a bf16 delta cannot be folded into 4-bit
codes without re-quantizing. The adapter therefore always stays unmerged, as QeRL's RL loop needs;
``qerl.export`` writes a merged checkpoint (bf16, or re-quantized NVFP4) for serving.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from qerl import arch
from qerl.load.linear import NVFP4Linear

#: LoRA on every decoder Linear (QeRL's setting).
DEFAULT_TARGETS = arch.LINEAR_TARGETS


class NVFP4LoraLinear(PeftLoraLinear):
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


def register_nvfp4(config: LoraConfig) -> LoraConfig:
    """Teach a LoraConfig to wrap NVFP4Linear modules; returns the same config."""
    config._register_custom_module({NVFP4Linear: NVFP4LoraLinear})
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
