"""The decoder's RMSNorms and SiLU MLPs swapped for the fused training modules (``qerl.train.fused_layers``, issue 71):
what is swapped in each family (trained norms inside peft's wrapper included), that names, parameters and the
rollout engine's view stay, that the swapped model computes what transformers' does (bitwise on the torch path; the
kernels themselves: tests/test_kernels_interp.py and test_kernels_gpu.py), and that the memory plan counts less."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from tiny_models import FAMILY_CONFIGS, TINY, tiny_model

from qerl.load.lora import lora_config
from qerl.train.fused_layers import MLP_CLASSES, NORM_CLASSES, FusedRMSNorm, FusedSwiGLU, fuse_layers
from qerl.train.recompute import saved_activation_bytes
from qerl.train.trainer import keep_trainable_fp32

FAMILIES = ["llama", "qwen2", *FAMILY_CONFIGS]


def _model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    model_type, config = FAMILY_CONFIGS.get(family, (family, {}))
    model = tiny_model(model_type, 0, vocab_size=64, max_position_embeddings=64, **config)
    model = get_peft_model(model.to(dtype), lora_config(r=4, train_norms=True))
    keep_trainable_fp32(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))).to(p.dtype) * 0.1)
    return model


def _pass(model: torch.nn.Module, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logits.float().log_softmax(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swapped_model_computes_what_transformers_does(family: str, dtype: torch.dtype) -> None:
    """Every norm (the layers' two, the final one, Qwen3's per-head q/k norms; trained copies inside peft's wrapper
    and their frozen originals) and every MLP swapped; the state dict's names and tensors unchanged; logits and every
    gradient bitwise equal to the unswapped model's (the torch path; fp32, and bf16 weights under autocast)."""
    plain, fused = _model(family, dtype), _model(family, dtype)
    layers = TINY["num_hidden_layers"]
    qk = 2 * layers if family == "qwen3" else 0
    counts = fuse_layers(fused)
    # Per layer: 2 norms, each once inside and once as the wrapper's original; the final norm; q/k norms (not trained).
    assert counts == {"norms": 2 * (2 * layers) + 1 + qk, "mlps": layers}
    assert not any(type(m).__name__ in NORM_CLASSES | MLP_CLASSES for m in fused.modules())
    assert {k: v.dtype for k, v in fused.state_dict().items()} == {k: v.dtype for k, v in plain.state_dict().items()}
    assert all(torch.equal(fused.state_dict()[k], v) for k, v in plain.state_dict().items())
    want, want_grads = _pass(plain, autocast=dtype == torch.bfloat16)
    got, got_grads = _pass(fused, autocast=dtype == torch.bfloat16)
    assert torch.equal(got, want)
    assert got_grads.keys() == want_grads.keys() and any("norm" in n for n in got_grads)
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name


def test_the_engine_still_reads_the_swapped_model() -> None:
    """The rollout engine's view reads the trained norm weights (the same tensors) and the MLP's projections."""
    from qerl.rollout.layers import ModelView

    model = _model("qwen2", torch.float32)
    fuse_layers(model)
    view = ModelView.from_model(model)
    layer = model.base_model.model.model.layers[0]
    norm = layer.input_layernorm.modules_to_save["default"]
    assert isinstance(norm, FusedRMSNorm) and isinstance(layer.mlp, FusedSwiGLU)
    assert view.layers[0].attn_norm.weight is norm.weight and view.layers[0].attn_norm.eps == norm.variance_epsilon


def test_the_memory_plan_counts_what_the_fused_layers_keep() -> None:
    """Per token and layer of the tiny Qwen2 (hidden 64, intermediate 128), LoRA r8: each norm keeps 2h + 4 bytes
    instead of 6h + 4 (trained), the MLP 2 x 2i instead of 3 x 2i."""
    plain = saved_activation_bytes(TINY, 1, 1, 8) // TINY["num_hidden_layers"]
    fused = saved_activation_bytes(TINY, 1, 1, 8, fused=True) // TINY["num_hidden_layers"]
    assert plain - fused == 2 * (4 * 64) + 2 * 128


def test_the_trainer_swaps_where_the_kernels_serve(qtiny, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QeRLTrainer swaps the layers when the kernels serve its device (CUDA; here told so while it is built) unless
    ``fused_layers`` is False, and a step of the swapped model (torch path) logs the loss and grad norm of the
    unswapped one, bitwise."""
    from helpers import loss_logs, qerl_trainer

    from qerl.kernels import backend

    logs = {}
    for name, fused in (("fused", True), ("plain", False)):
        with monkeypatch.context() as patch:
            patch.setattr(backend, "serves", lambda device: True)
            trainer = qerl_trainer(qtiny, tmp_path / name, max_steps=1, fused_layers=fused)
        swapped = [m for m in trainer.model.modules() if isinstance(m, (FusedRMSNorm, FusedSwiGLU))]
        assert bool(swapped) is fused and trainer.layers_fused is fused  # the memory plan counts what ran
        trainer.train()
        logs[name] = loss_logs(trainer)[0]
    assert (logs["fused"]["loss"], logs["fused"]["grad_norm"]) == (logs["plain"]["loss"], logs["plain"]["grad_norm"])
