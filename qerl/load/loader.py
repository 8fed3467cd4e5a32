"""Load a model for qerl: NVFP4 checkpoints stay packed, bf16 checkpoints load unchanged.

An NVFP4 checkpoint's Linear layers become ``NVFP4Linear`` modules holding exactly the checkpoint's
``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` tensors, so resident memory is the
packed size (4.5 bits per weight). The model skeleton is built on the meta device, so a dense copy
of the weights never exists, not even for a moment. Every tensor is checked once where it lands
(``qerl.load.integrity``): a NaN block scale stops the load with one line instead of a model that
generates nonsense.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from qerl import arch, checkpoint, hub, model_files
from qerl.load.integrity import Verdicts
from qerl.load.linear import NVFP4Linear, replace_linears, stack_fused_groups

LoadMode = Literal["auto", "nvfp4", "bf16"]


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on accelerators; fp32 on CPU, where bf16 matmuls are emulated and slower."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def is_nvfp4_model(model: nn.Module) -> bool:
    return any(isinstance(m, NVFP4Linear) for m in model.modules())


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, with a pad token (eos when the checkpoint has none). Code the directory names
    (``auto_map``) is refused in one line unless ``trust_remote_code`` (``qerl.model_files``)."""
    model_dir = hub.local_model_dir(path)
    model_files.check_files(model_dir, trust_remote_code=trust_remote_code)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def check_supported(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> arch.Family:
    """The family of the model at ``path`` (directory, hub id or ``smollm2-135m``) once its directory, config.json
    and weights' headers passed ``qerl.model_files.checked_config``, else its one-line error: for commands that
    do other work (hashing, data) before loading."""
    return model_files.checked_config(hub.local_model_dir(path), trust_remote_code=trust_remote_code)[1]


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    load: LoadMode = "auto",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a directory, a hub id or ``smollm2-135m``.

    ``load="nvfp4"`` insists on an NVFP4 checkpoint, ``"bf16"`` on a dense one, ``"auto"`` takes
    either. ``dtype`` is the dtype of the non-quantized tensors (embeddings, norms, lm_head, biases);
    by default bf16 on GPU and fp32 on CPU. A model whose directory names code of its own (``auto_map``) is refused
    unless ``trust_remote_code``.
    """
    if load not in ("auto", "nvfp4", "bf16"):
        raise ValueError(f"--load must be auto, nvfp4 or bf16, got {load!r}")
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = dtype or default_dtype(device)
    model_dir = hub.local_model_dir(path)
    config, _ = model_files.checked_config(model_dir, trust_remote_code=trust_remote_code)
    quantized = checkpoint.is_nvfp4_config(config)
    if load == "nvfp4" and not quantized:
        raise ValueError(
            f"{model_dir}: not an NVFP4 checkpoint (no compressed-tensors nvfp4-pack-quantized config); "
            "quantize it first with llm-compressor/quantize_nvfp4.py"
        )
    if load == "bf16" and quantized:
        raise ValueError(f"{model_dir}: is an NVFP4 checkpoint but --load bf16 was asked for")
    if not quantized:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
        model = model.to(device)
        verdicts = Verdicts(model_dir)
        for name, tensor in model.state_dict().items():
            verdicts.add(name, tensor)
        verdicts.finish()
        return model
    return _load_nvfp4(model_dir, dtype, device, trust_remote_code)


def _load_nvfp4(model_dir: Path, dtype: torch.dtype, device: torch.device, trust: bool) -> PreTrainedModel:
    tensors = checkpoint.TensorIndex(model_dir, keep_open=True)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust)
    # Drop the quantization block so transformers builds plain modules; we do the swapping.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust)
    _swap_quantized_linears(model, tensors, model_dir, dtype)
    model.to_empty(device=device)
    _fill_from_checkpoint(model, tensors, model_dir)
    tensors.close()
    # Non-persistent buffers (rotary inv_freq) are not in checkpoints: recompute them the way
    # transformers does after its own meta-device loading.
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)
    model.tie_weights()
    stack_fused_groups(model)
    model.config.name_or_path = str(model_dir)
    model.eval()
    return model


def _swap_quantized_linears(
    model: nn.Module, tensors: checkpoint.TensorIndex, model_dir: Path, dtype: torch.dtype
) -> None:
    """Every Linear the checkpoint holds packed becomes an empty NVFP4Linear (filled afterwards)."""

    def make(name: str, linear: nn.Linear) -> NVFP4Linear | None:
        if f"{name}.{checkpoint.PACKED}" not in tensors:
            return None
        if linear.in_features % 16 != 0:
            raise ValueError(f"{model_dir}: {name} has in_features={linear.in_features}, not a multiple of 16")
        return NVFP4Linear.empty_like(linear, bias_dtype=dtype)

    replace_linears(model, make)


def _fill_from_checkpoint(model: nn.Module, tensors: checkpoint.TensorIndex, model_dir: Path) -> None:
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    state = model.state_dict()
    verdicts = Verdicts(model_dir)  # a GPU load reads every verdict back once, at the end
    for name, target in state.items():
        if name not in tensors:
            if name in tied or (name == "lm_head.weight" and model.config.tie_word_embeddings):
                continue
            raise ValueError(f"{model_dir}: checkpoint is missing tensor {name!r}")
        value = tensors.get(name)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{model_dir}: tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)  # casts norms/embeddings/biases to the model dtype; packed tensors keep theirs
        verdicts.add(name, target)
    verdicts.finish()
