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


@pytest.fixture
def own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$QERL_CACHE`` (the file-digest cache commands keep) in the test's own directory: a test's model digests
    never mix with another's, nor land in the user's cache. Modules ask for it (``pytest.mark.usefixtures``)."""
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def own_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`own_digest_cache`, and transformers' copy of a model's code (a test that trusts it writes one) too."""
    from transformers import dynamic_module_utils

    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "hf-modules"))


@pytest.fixture(scope="module")
def qtiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny NVFP4 chat Llama (2 decoder layers) that the evaluation and training CLIs run in about a second."""
    from tiny_models import make_tiny_chat_model

    from qerl.quantize.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("qtiny")
    return quantize_checkpoint(make_tiny_chat_model(root / "tiny", smollm2_dir), root / "qtiny")


@pytest.fixture(scope="session")
def chat_models(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    """Two different tiny NVFP4 chat Llamas (``qtiny``, ``qtiny2``) and an adapter bound to ``qtiny`` (its
    ``qerl_base.json`` written as ``qerl.train.run`` writes it)."""
    from peft import get_peft_model
    from tiny_models import make_tiny_chat_model

    from qerl.fingerprint import model_sha256, write_base_record
    from qerl.load.loader import load_model
    from qerl.load.lora import lora_config
    from qerl.quantize.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("chat-models")
    qtiny = quantize_checkpoint(make_tiny_chat_model(root / "tiny", smollm2_dir, seed=0), root / "qtiny")
    qtiny2 = quantize_checkpoint(make_tiny_chat_model(root / "tiny2", smollm2_dir, seed=1), root / "qtiny2")
    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(qtiny, device="cpu", dtype=torch.float32), lora_config(r=2))
    peft_model.save_pretrained(root / "adapter")
    write_base_record(root / "adapter", str(qtiny), model_sha256(qtiny))
    return {"qtiny": qtiny, "qtiny2": qtiny2, "adapter": root / "adapter"}


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny NVFP4 Llama (:data:`tiny_models.SMALL_VOCAB` tokens) and an adapter trained (randomly) on it."""
    from tiny_models import SMALL_VOCAB, make_adapter, make_tiny_llama

    from qerl.quantize.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("merge")
    model = quantize_checkpoint(make_tiny_llama(root / "bf16", vocab=SMALL_VOCAB), root / "nvfp4", backend="qerl")
    return {"model": model, "adapter": make_adapter(model, root / "adapter")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dense_dir: Path) -> Path:
    """A finished 2-step training run with checkpoints 1 and 2 (copy it, ``helpers.copy_run``, to change it)."""
    from helpers import train_argv

    from qerl.train.run import main

    out = tmp_path_factory.mktemp("trained") / "run"
    main(train_argv(tiny_dense_dir, out, steps=2))
    return out
