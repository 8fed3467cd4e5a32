"""Shared fixtures. CPU tests run in fp32 on one torch thread: bf16 is emulated on this CPU and a
second OpenMP thread slows everything down when anything else runs (cpu_env.md §5)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than ~30 s on CPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as a bf16 safetensors directory."""
    from qerl.hub import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def smollm2_nvfp4_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default quantized by our streaming backend."""
    from qerl.quantize import quantize_checkpoint

    return quantize_checkpoint(smollm2_dir, tmp_path_factory.mktemp("nvfp4") / "smollm2-NVFP4A16", backend="qerl")


def make_tiny_llama(out_dir: Path, *, hidden: int = 64, intermediate: int = 128, layers: int = 2, vocab: int = 256,
                    seed: int = 0, **overrides) -> Path:
    """A random tiny Llama saved as a bf16 safetensors directory (for fast format/loader tests)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True,
                      **overrides)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def make_tiny_chat_model(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random tiny Llama that speaks SmolLM2's vocabulary (its tokenizer and chat template copied in):
    a model the trainer and the evaluation CLIs load and run end to end in about a second."""
    out = make_tiny_llama(out_dir, vocab=49152, bos_token_id=1, eos_token_id=2, seed=seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_dense_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random dense (non-quantized) tiny Llama with SmolLM2's tokenizer."""
    return make_tiny_chat_model(tmp_path_factory.mktemp("dense") / "tiny", smollm2_dir)


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    return make_tiny_llama(tmp_path / "tiny-llama")
