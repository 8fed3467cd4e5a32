"""The whole pipeline on each ``qerl.arch`` family beyond Llama-2/Qwen2: a tiny random Llama-3.x (rope_type
llama3, tied embeddings), Qwen3 (per-head q/k norms, tied embeddings) and Mistral (sliding window), with
SmolLM2's tokenizer, quantized by qerl, trained 2 GRPO steps with AQN on the native engine, evaluated with
the trained adapter, and exported to bf16 and NVFP4 with the logits checked as tests/test_export.py does.
CPU, fp32, one thread; a few seconds per family."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch
from test_export import BF16_MAX_REL, BF16_MEAN_REL, adapter_model, logits
from test_trainer import make_config, varied_reward
from tiny_models import FAMILY_CONFIGS, make_adapter, make_tiny_family_chat_model

from eval import gsm8k
from qerl.export import export
from qerl.load.loader import load_model, load_tokenizer
from qerl.load.lora import lora_config
from qerl.quantize.pipeline import quantize_checkpoint
from qerl.train.aqn import norm_weights
from qerl.train.data import load_dataset
from qerl.train.trainer import QeRLTrainer

torch.set_num_threads(1)

GSM8K = Path(__file__).parent / "data" / "gsm8k_train30.jsonl"


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(
    request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """One family's bf16 checkpoint, its qerl NVFP4 quantization, and a 2-step training run on it."""
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_family_chat_model(root / "bf16", request.param, smollm2_dir)
    nvfp4_dir = quantize_checkpoint(src, root / "nvfp4", backend="qerl")
    torch.manual_seed(0)
    model = load_model(nvfp4_dir, device="cpu", dtype=torch.float32)
    config = make_config(root / "run", max_steps=2, save_steps=2, num_stages=2)
    trainer = QeRLTrainer(
        model,
        [varied_reward],
        config,
        train_dataset=load_dataset("arithmetic", num_samples=16),
        processing_class=load_tokenizer(nvfp4_dir),
        peft_config=lora_config(r=4, train_norms=True),
    )
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    return {
        "name": request.param,
        "root": root,
        "src": src,
        "nvfp4": nvfp4_dir,
        "trainer": trainer,
        "lora_before": lora_before,
        "adapter": root / "run" / "checkpoint-2",
    }


def test_two_grpo_steps_train_lora_with_aqn_on_the_feeding_norms(family: dict[str, Any]) -> None:
    trainer = family["trainer"]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    changed = [
        n
        for n, p in trainer.model.named_parameters()
        if n in family["lora_before"] and not torch.equal(p, family["lora_before"][n])
    ]
    assert changed, "no LoRA parameter moved in 2 steps"
    perturbed = {name.rsplit(".", 1)[-1] for name, _ in norm_weights(trainer.model)}
    assert perturbed == {"input_layernorm", "post_attention_layernorm"}  # never Qwen3's q_norm / k_norm
    assert (family["adapter"] / "adapter_model.safetensors").is_file()


def test_eval_runs_the_trained_adapter(family: dict[str, Any]) -> None:
    out = family["root"] / "gsm8k.jsonl"
    argv = [
        "--model",
        str(family["nvfp4"]),
        "--lora",
        str(family["adapter"]),
        "--data",
        str(GSM8K),
        "--limit",
        "4",
        "--engine",
        "native",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--output",
        str(out),
    ]
    with redirect_stdout(io.StringIO()):
        gsm8k.main(argv)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(1 <= r["completion_tokens"] <= 8 for r in rows)


def test_bf16_and_nvfp4_exports_match_the_adapter_model(family: dict[str, Any]) -> None:
    """tests/test_export.py's bounds: the bf16 export within bf16 rounding of the adapter model, the NVFP4
    export within the re-quantization error (no more than 2x what quantizing the source cost) plus that."""
    root, nvfp4_dir = family["root"], family["nvfp4"]
    adapter = make_adapter(nvfp4_dir, root / "adapter")
    dense_dir, packed_dir = root / "export-bf16", root / "export-nvfp4"
    export(nvfp4_dir, adapter, dense_dir, fmt="bf16")
    record = export(nvfp4_dir, adapter, packed_dir, fmt="nvfp4")
    ref = logits(adapter_model(nvfp4_dir, adapter))
    base = logits(load_model(nvfp4_dir, device="cpu", dtype=torch.float32))
    dense = logits(load_model(dense_dir, load="bf16", device="cpu", dtype=torch.float32))
    packed = logits(load_model(packed_dir, load="nvfp4", device="cpu", dtype=torch.float32))
    source = logits(load_model(family["src"], device="cpu", dtype=torch.float32))
    scale = ref.abs().max().item()
    diff = (dense - ref).abs()
    assert diff.mean().item() <= BF16_MEAN_REL * scale and diff.max().item() <= BF16_MAX_REL * scale
    assert (ref - base).abs().mean().item() >= 10 * BF16_MEAN_REL * scale  # the adapter matters
    requant, quant = (packed - dense).abs().mean().item(), (base - source).abs().mean().item()
    assert 0 < requant <= 2 * quant
    assert (packed - ref).abs().mean().item() <= requant + BF16_MEAN_REL * scale
    assert record["lora_delta_retained"] > 0.9


def test_unsupported_model_type_is_refused_before_any_work(smollm2_dir: Path, tmp_path: Path) -> None:
    """quantize-for-training and load refuse a MoE config in one line naming it and the supported list."""
    src = make_tiny_family_chat_model(tmp_path / "src", "qwen3", smollm2_dir)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    expected = r"config.json: model_type 'qwen3_moe' is not supported; .*llama, qwen2, qwen3, mistral$"
    with pytest.raises(ValueError, match=expected):
        quantize_checkpoint(src, tmp_path / "out", backend="qerl")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=expected):
        load_model(src, device="cpu")
