"""The tiny random models of every ``qerl.arch`` family the tests build, in one place.

Every builder seeds torch's global generator first, so a test that names a seed gets the same
weights on every run and machine. ``tiny_model`` is the one constructor; the others add what a
group of tests needs: the rollout-engine variants (``tiny_llama``, ``tiny_qwen2``, ``FAMILY_MODELS``, ``nvfp4_lora``)
and checkpoints on disk (``make_tiny_llama``, ``make_tiny_chat_model``) with an adapter trained on one
(``make_adapter``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from benchmarks import common
from qerl import arch, nvfp4
from qerl.load.linear import NVFP4Linear, replace_linears
from qerl.load.loader import load_model
from qerl.load.lora import lora_config, register_nvfp4

#: The tiny decoder: 2 layers, hidden 64, intermediate 128, 4 heads over 2 KV heads, 256 tokens.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
#: The rollout-engine tests' additions: 512 positions, and peaked logits (initializer range 0.2) so
#: that greedy paths do not collapse into one loop.
ENGINE = dict(max_position_embeddings=512, initializer_range=0.2)
_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}

#: Each family's distinguishing config on top of ``TINY``, as its real checkpoints have it.
#: llama3: Llama-3.1's rope_type llama3 scaling (benchmarks.common's, its original context cut to 64 positions so
#: that the tests' sequences reach the scaled low frequencies) and Llama-3.2's tied embeddings. qwen3: head_dim 32, so
#: heads x head_dim (128) differs from hidden (64) as in Qwen3, tied embeddings. mistral: a sliding
#: window (longer than the tests' sequences).
_LLAMA31 = common.FAMILY_CONFIGS["llama3.1-8b"]
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                **_LLAMA31["rope_scaling"],
                "rope_theta": _LLAMA31["rope_theta"],
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),
    "mistral": ("mistral", dict(sliding_window=400, rope_theta=1e6)),
}


def tiny_model(arch: str = "llama", seed: int = 0, **config: Any) -> PreTrainedModel:
    """A random ``arch`` (a ``_ARCHS`` model type) causal LM of ``TINY`` updated by ``config``, in fp32,
    its weights drawn after ``torch.manual_seed(seed)``."""
    config_cls, model_cls = _ARCHS[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**TINY, **config}))


def tiny_llama(seed: int = 0, **config: Any) -> nn.Module:
    """The rollout-engine tests' Llama (``ENGINE``, rope theta 500), in eval mode."""
    return tiny_model("llama", seed, **{**ENGINE, "rope_theta": 500.0, **config}).eval()


def tiny_qwen2(seed: int = 0, **config: Any) -> nn.Module:
    """The rollout-engine tests' Qwen2: q/k/v biases N(0, 0.5), tied embeddings, rope theta 20000, eval mode."""
    model = tiny_model("qwen2", seed, **{**ENGINE, "tie_word_embeddings": True, "rope_theta": 20000.0, **config}).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def tiny_family(family: str, seed: int = 0, **config: Any) -> nn.Module:
    """The rollout-engine tests' model of a ``FAMILY_CONFIGS`` family (``ENGINE`` sizes), in eval mode;
    Qwen3's q_norm / k_norm weights are drawn around 1 so that a missing per-head norm shows."""
    model_type, family_config = FAMILY_CONFIGS[family]
    model = tiny_model(model_type, seed, **{**ENGINE, **family_config, **config}).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn(p.shape))
    return model


def nvfp4_lora(model: nn.Module, seed: int = 1, group_scales: bool = False) -> nn.Module:
    """Swap decoder Linears for NVFP4Linear, wrap in peft LoRA r=4 with a nonzero B, perturb the norms.

    ``group_scales``: q/k/v and gate/up share one global scale (their minimum), as in a checkpoint
    of ``qerl.quantize.pipeline`` or llm-compressor, so ``stack_fused_groups`` can stack them."""
    shared: dict[str, torch.Tensor] = {}
    if group_scales:
        for module in model.modules():
            for names in arch.FUSED_GROUPS:
                if all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
                    g = min(nvfp4.global_scale(getattr(module, n).weight) for n in names)
                    shared.update({id(getattr(module, n)): g for n in names})
    replace_linears(
        model, lambda name, lin: None if name == "lm_head" else NVFP4Linear.from_linear(lin, shared.get(id(lin)))
    )
    peft_model = get_peft_model(model, lora_config(r=4, train_norms=True)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "modules_to_save" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return peft_model


def make_tiny_llama(
    out_dir: Path,
    *,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    vocab: int = 256,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A random tiny Llama (tied embeddings, matrices N(0, 0.05)) saved as a bf16 safetensors directory
    (for fast format/loader tests)."""
    model = tiny_model(
        "llama",
        seed,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        vocab_size=vocab,
        tie_word_embeddings=True,
        **overrides,
    )
    return _save_bf16(model, out_dir)


def make_tiny_family(out_dir: Path, family: str, *, seed: int = 0, **config: Any) -> Path:
    """A random tiny model of a ``FAMILY_CONFIGS`` family (``TINY`` sizes, ``config`` on top) saved as a bf16
    safetensors directory, as :func:`make_tiny_llama` saves a Llama."""
    model_type, family_config = FAMILY_CONFIGS[family]
    return _save_bf16(tiny_model(model_type, seed, **{**family_config, **config}), out_dir)


def _save_bf16(model: PreTrainedModel, out_dir: Path) -> Path:
    """``model`` with its matrices redrawn N(0, 0.05), saved as a bf16 safetensors directory."""
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> Path:
    """``tokenizer_dir``'s tokenizer and chat template copied into the model directory ``out``."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def make_tiny_chat_model(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random tiny Llama that speaks SmolLM2's vocabulary (its tokenizer and chat template copied in):
    a model the trainer and the evaluation CLIs load and run end to end in about a second."""
    return copy_tokenizer(
        tokenizer_dir, make_tiny_llama(out_dir, vocab=49152, bos_token_id=1, eos_token_id=2, seed=seed)
    )


def make_tiny_family_chat_model(out_dir: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """``make_tiny_chat_model`` for a ``FAMILY_CONFIGS`` family: the trainer, eval and export run on it."""
    model_type, family_config = FAMILY_CONFIGS[family]
    model = tiny_model(model_type, seed, vocab_size=49152, bos_token_id=1, eos_token_id=2, **family_config)
    return copy_tokenizer(tokenizer_dir, _save_bf16(model, out_dir))


#: A vocabulary small enough for an export's merge of a tiny model to take a second.
SMALL_VOCAB = 256


def make_adapter(model_dir: Path, out: Path, lora_scale: float = 0.05, config: LoraConfig | None = None) -> Path:
    """A peft adapter over ``model_dir`` with random B (x ``lora_scale``) and norms perturbed by 10%."""
    torch.manual_seed(0)
    model = get_peft_model(
        load_model(model_dir, device="cpu", dtype=torch.float32),
        register_nvfp4(config) if config else lora_config(r=4, alpha=8, train_norms=True),
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * lora_scale)
            elif "modules_to_save" in name:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out
