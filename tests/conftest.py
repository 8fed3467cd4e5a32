"""Shared fixtures. CPU tests run in fp32 on one torch thread: bf16 is emulated on this CPU, and with a
second OpenMP thread anything else running makes torch far slower (threads wait on a descheduled
sibling: a GRPO step went from 5 s to 27-160 s on a 2-vCPU machine)."""

from __future__ import annotations

import os
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
    from qerl.quantize.pipeline import quantize_checkpoint

    return quantize_checkpoint(smollm2_dir, tmp_path_factory.mktemp("nvfp4") / "smollm2-NVFP4A16", backend="qerl")


@pytest.fixture(scope="session")
def tiny_dense_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random dense (non-quantized) tiny Llama with SmolLM2's tokenizer."""
    from tiny_models import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("dense") / "tiny", smollm2_dir)


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    from tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path / "tiny-llama")
