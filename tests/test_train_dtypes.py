"""What the NVFP4 training passes hand the kernels, with CUDA's routing emulated on CPU.

On the GPU a bf16/fp16 activation takes the Triton ops (dequantize + cuBLAS at M > 64); anything
else (fp32) silently takes the reference path: an fp32 dequantize and an fp32 GEMM, several times
slower. A dtype leak in training (peft's fp32 LoRA input cast, the fp32-stored trained norms, the
autocast/checkpoint interplay) would therefore show only as a slow step. Here ``ops.use_triton``
is made device-blind and the Triton module is replaced by a recording stand-in, so a tiny bf16
Qwen2 trained as the H200 benchmark trains (LoRA r16 on the 7 projections + fp32 trained norms,
non-reentrant gradient checkpointing, bf16 autocast) reports every call's path and dtype, and how
many times each weight is dequantized per forward+backward (3: forward, recompute, grad_x).
"""

from __future__ import annotations

import sys
import types
from collections import Counter

import pytest
import torch
from peft import get_peft_model
from tiny_models import tiny_model

import qerl.kernels
from qerl import nvfp4
from qerl.kernels import ops
from qerl.kernels import reference as kernel_reference
from qerl.load.linear import NVFP4Linear, replace_linears
from qerl.load.lora import lora_config
from qerl.train.trainer import keep_trainable_fp32

LAYERS = 2
LINEARS = 7 * LAYERS


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Route bf16/fp16 to the 'Triton' ops on any device and count (path, dtype) of every call."""
    seen: Counter = Counter()
    reference = kernel_reference.mm

    def matmul(x, weight, *, epilogue):
        seen["kernel_fwd", x.dtype] += 1
        return reference(x, weight, epilogue)

    def matmul_t(grad_y, weight):
        seen["kernel_grad_x", grad_y.dtype] += 1
        return grad_y @ weight.dequantize(grad_y.dtype)

    def reference_mm(x, *args, **kwargs):
        seen["reference", x.dtype] += 1
        return reference(x, *args, **kwargs)

    def dequantize(packed, scale, gscale, dtype=torch.bfloat16):
        seen["dequantize", dtype] += 1
        return real_dequantize(packed, scale, gscale, dtype)

    real_dequantize = nvfp4.dequantize
    fake = types.ModuleType("qerl.kernels.fp4_gemm")
    fake.matmul, fake.matmul_t = matmul, matmul_t
    monkeypatch.setitem(sys.modules, "qerl.kernels.fp4_gemm", fake)
    monkeypatch.setattr(qerl.kernels, "fp4_gemm", fake, raising=False)
    monkeypatch.setattr(ops, "use_triton", lambda x: x.dtype in (torch.bfloat16, torch.float16))
    monkeypatch.setattr(kernel_reference, "mm", reference_mm)
    monkeypatch.setattr(nvfp4, "dequantize", dequantize)
    return seen


def _model() -> torch.nn.Module:
    model = tiny_model(
        "qwen2", 0, vocab_size=64, num_hidden_layers=LAYERS, max_position_embeddings=64, tie_word_embeddings=False
    )
    replace_linears(model, lambda name, lin: None if name == "lm_head" else NVFP4Linear.from_linear(lin))
    model = get_peft_model(model.to(torch.bfloat16), lora_config(r=16, train_norms=True))
    assert keep_trainable_fp32(model)  # the trained norms are fp32 from here on
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no-autocast"])
def test_training_pass_stays_on_the_bf16_kernels(calls: Counter, autocast: bool) -> None:
    model = _model()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logits.float().log_softmax(-1)[..., 0].mean().backward()

    assert dict(calls) == {
        ("kernel_fwd", torch.bfloat16): 2 * LINEARS,  # forward + checkpoint recompute
        ("kernel_grad_x", torch.bfloat16): LINEARS,
        ("dequantize", torch.bfloat16): 3 * LINEARS,
    }
    # B starts at zero, so only B's gradients are non-zero after one pass: they reached every adapter.
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert len(grads) == LINEARS and all(g is not None and g.abs().sum() > 0 for g in grads)
