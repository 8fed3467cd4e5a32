"""The evaluation loader really applies a saved LoRA adapter and its trained norms (CPU, fp32).

The reference's NVFP4 evaluation silently dropped the LoRA (the reference's eval script, bug (a) there). Here an
adapter with nonzero B and modified RMSNorm weights is built in memory, saved, and reloaded through
``eval.loading``: the logits must differ from the base model's and equal the in-memory PeftModel's,
for the bf16 checkpoint and for our NVFP4 checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import get_peft_model

from eval.loading import apply_adapter, load_base
from qerl.arch import NORM_MODULES
from qerl.load.linear import NVFP4Linear
from qerl.load.loader import load_tokenizer
from qerl.load.lora import lora_config

torch.set_num_threads(1)

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def _make_adapter(model_dir: Path, out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Save an adapter whose LoRA and norms both matter; return (base logits, adapted logits) in memory."""
    base, tokenizer = load_base(str(model_dir), "auto", torch.float32, "cpu"), load_tokenizer(model_dir)
    base_logits = _logits(base, tokenizer)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        base, lora_config(r=4, target_modules=("q_proj", "v_proj", "down_proj"), train_norms=True)
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)  # peft initialises B to zero: an untrained adapter is a no-op
            elif "modules_to_save" in name and any(n in name for n in NORM_MODULES):
                param.mul_(1.0 + 0.1 * torch.randn_like(param))
    peft_model.eval()
    adapted = _logits(peft_model, tokenizer)
    peft_model.save_pretrained(out)
    return base_logits, adapted


@pytest.mark.parametrize("checkpoint", ["smollm2_dir", "smollm2_nvfp4_dir"])
def test_loaded_adapter_changes_outputs_like_in_memory_peft(
    checkpoint: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = request.getfixturevalue(checkpoint)
    base_logits, adapted = _make_adapter(model_dir, tmp_path / "adapter")

    fresh, tokenizer = load_base(str(model_dir), "auto", torch.float32, "cpu"), load_tokenizer(model_dir)
    assert torch.equal(_logits(fresh, tokenizer), base_logits)  # the reload starts from the same base
    loaded = apply_adapter(fresh, str(tmp_path / "adapter"), str(model_dir))

    if checkpoint == "smollm2_nvfp4_dir":  # LoRA went onto the packed layers, which stayed packed
        assert isinstance(
            loaded.get_submodule("base_model.model.model.layers.0.self_attn.q_proj").base_layer, NVFP4Linear
        )
    norm = loaded.get_submodule("base_model.model.model.layers.3.input_layernorm")
    assert norm.active_adapters == ["default"] and not torch.equal(
        norm.modules_to_save["default"].weight, norm.original_module.weight
    )
    got = _logits(loaded, tokenizer)
    assert (got - base_logits).abs().max() > 0.05
    torch.testing.assert_close(got, adapted, rtol=0, atol=1e-5)
    with loaded.disable_adapter():  # and the change is the adapter's, nothing else
        torch.testing.assert_close(_logits(loaded, tokenizer), base_logits, rtol=0, atol=1e-5)
