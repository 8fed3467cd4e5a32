"""Load the model under evaluation: a base checkpoint plus, optionally, a trained LoRA adapter.

The reference evaluated NVFP4 runs without ever applying the LoRA (the reference's eval script, bug (a) there): only
the trained norms changed the output. Here the adapter goes through peft's own loader, and the
result is checked tensor by tensor against the adapter file, so a run either evaluates exactly
the trained weights or stops with a one-line error before any output is written. An adapter saved
by ``qerl.train.run`` records the digest of its base model (``qerl_base.json``), which decides whether
``--model`` is that base; the recorded name is the fallback for adapters made elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.utils import get_peft_model_state_dict

from qerl.cli import UsageError
from qerl.fingerprint import check_adapter_base
from qerl.load.adapter import CONFIG_FILE, check_patterns, read_adapter_config
from qerl.load.integrity import DamagedTensor, check_tensors
from qerl.load.lora import load_adapter


def load_base(
    model: str, load: str, dtype: torch.dtype | None, device: str | None, *, trust_remote_code: bool = False
) -> Any:
    """The model through qerl's loader, in eval mode; loader errors become one line naming --model/--load.
    (The tokenizer is the caller's: the runner reads it first, to bound the prompts before any weight.)"""
    from qerl.load.loader import load_model

    try:
        base = load_model(model, dtype=dtype, device=device, load=load, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {model} (--load {load}): {str(e).strip().splitlines()[0]}") from None
    base.eval()
    return base


def _read_adapter(adapter_dir: str) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The adapter's checked LoraConfig (``qerl.load.adapter``: the same checks as export's) and its tensors."""
    from safetensors.torch import load_file

    try:
        config, weights = read_adapter_config(Path(adapter_dir).expanduser())
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    if not isinstance(config, LoraConfig):
        raise UsageError(f"--lora {adapter_dir}: a {type(config).__name__} adapter; only LoRA adapters are supported")
    try:
        saved = load_file(weights)
    except Exception as e:  # safetensors raises several types for damaged files
        raise UsageError(f"--lora {weights}: unreadable safetensors file ({e})") from None
    try:
        check_tensors(saved, f"--lora {adapter_dir}")
    except DamagedTensor as e:
        raise UsageError(str(e)) from None
    return config, saved


def apply_adapter(model: Any, adapter_dir: str, model_arg: str, allow_base_mismatch: bool = False) -> PeftModel:
    """Wrap ``model`` with the LoRA adapter (and trained norms, peft ``modules_to_save``) saved in ``adapter_dir``.

    NVFP4 bases need the adapter's LoraConfig registered for ``NVFP4Linear`` first: peft does not save
    custom-module mappings in adapter_config.json, so the config is loaded, registered and passed in.
    Raises UsageError when the adapter was made for another base (recorded name or tensor shapes).
    """
    path = Path(adapter_dir).expanduser()
    config, saved = _read_adapter(adapter_dir)
    recorded = config.base_model_name_or_path
    check_adapter_base(path, model_arg, allow_base_mismatch)
    try:
        check_patterns(config, (name for name, _ in model.named_modules()), f"--lora {path / CONFIG_FILE}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        wrapped = load_adapter(model, str(path), config=config)
    except (RuntimeError, ValueError, KeyError) as e:
        detail = _first_mismatch(str(e)) or " ".join(str(e).split())[:300]
        raise UsageError(
            f"--lora {adapter_dir}: adapter (made for {recorded!r}) does not fit --model {model_arg!r}: {detail}"
        ) from None
    _check_loaded(wrapped, saved, adapter_dir, model_arg)
    wrapped.eval()
    return wrapped


def _first_mismatch(error: str) -> str | None:
    """torch's multi-line "size mismatch" report, reduced to its first tensor."""
    found = re.search(
        r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^\]]*\])\) from checkpoint, "
        r"the shape in current model is torch.Size\((\[[^\]]*\])\)",
        error,
    )
    if found is None:
        return None
    name, saved, live = found.groups()
    return f"size mismatch, e.g. {name} is {saved} in the adapter but {live} in the model"


def _check_loaded(wrapped: PeftModel, saved: dict[str, torch.Tensor], adapter_dir: str, model_arg: str) -> None:
    """Every tensor in the adapter file must now be in the model, with its value: peft only warns about
    keys it could not place, which would silently evaluate a partly-applied adapter."""
    live = get_peft_model_state_dict(wrapped)
    missing = sorted(set(saved) - set(live))
    if missing:
        raise UsageError(
            f"--lora {adapter_dir}: {len(missing)} adapter tensors have no place in --model {model_arg!r} "
            f"(first: {missing[0]}); was it made for a different base model?"
        )
    for key, value in saved.items():
        target = live[key]
        if tuple(target.shape) != tuple(value.shape) or not torch.equal(target.cpu(), value.to(target.dtype)):
            raise UsageError(
                f"--lora {adapter_dir}: tensor {key} did not load as saved (shape {tuple(value.shape)} "
                f"vs {tuple(target.shape)} in --model {model_arg!r})"
            )
