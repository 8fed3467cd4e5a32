"""QeRLTrainer on a bf16 model, the dtype every GPU run loads: trained norms must really train.

peft leaves ``modules_to_save`` copies (the ``ln`` RMSNorms) in the model's dtype; in bf16 an AdamW
step of ~lr rounds away. The trainer stores them in fp32 and keeps the activations bf16. A tiny
random Llama in bf16 on CPU (slow per flop, but 2 layers of width 64) shows both.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from tiny_models import make_tiny_llama

from qerl.load.loader import load_model, load_tokenizer
from qerl.load.lora import lora_config
from qerl.train.aqn import norm_weights
from qerl.train.data import load_dataset
from qerl.train.trainer import QeRLConfig, QeRLTrainer, keep_trainable_fp32


def varied_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Deterministic reward with spread, so the advantages (hence the norms' gradients) are non-zero."""
    return [float(len(c[-1]["content"]) % 3) for c in completions]


def test_keep_trainable_fp32_upcasts_trainable_low_precision_params_only() -> None:
    norm = torch.nn.LayerNorm(8).to(torch.bfloat16)
    frozen = torch.nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
    model = torch.nn.Sequential(norm, frozen)
    assert keep_trainable_fp32(model) == ["0.weight", "0.bias"]
    assert norm.weight.dtype == torch.float32 and frozen.weight.dtype == torch.bfloat16
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16  # the hook hands bf16 on
    assert model(x).dtype == torch.bfloat16
    assert keep_trainable_fp32(model) == []  # idempotent


def test_bf16_model_trains_its_norms(tmp_path: Path, smollm2_dir: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", vocab=49152, bos_token_id=1, eos_token_id=2)  # SmolLM2's tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, model_dir / name)
    torch.manual_seed(0)
    model = load_model(model_dir, device="cpu", dtype=torch.bfloat16)
    config = QeRLConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        report_to=[],
        seed=0,
        num_stages=2,
        warmup_steps=0,
        learning_rate=1e-5,
        mask_truncated_completions=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = QeRLTrainer(
        model,
        [varied_reward],
        config,
        train_dataset=load_dataset("arithmetic", num_samples=16),
        processing_class=load_tokenizer(model_dir),
        peft_config=lora_config(r=4, train_norms=True),
    )
    norms = [w for _, w in norm_weights(trainer.model)]
    dtypes = {w.dtype for w in norms}
    seen: list[torch.dtype] = []
    q_proj = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    q_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    before = [w.detach().clone() for w in norms]
    trainer.train()
    moved = sum(int((w != b).sum()) for w, b in zip(norms, before, strict=True)) / sum(w.numel() for w in norms)
    assert moved > 0.9, f"only {moved:.1%} of the trained norm weights changed at lr 1e-5"
    assert dtypes == {torch.float32}
    assert seen and set(seen) == {torch.bfloat16}  # the norms' fp32 weights do not leak fp32 activations
    params: list[dict[str, Any]] = trainer.optimizer.param_groups
    assert all(p.dtype == torch.float32 for g in params for p in g["params"])
