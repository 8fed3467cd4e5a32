"""The direct LoRA forward (``qerl.load.lora.DirectLoraForward``) against peft's own (issue 71).

peft's vanilla LoRA forward casts each projection's input to the fp32 adapter's dtype (bf16 autocast casts it
back for the GEMM) and multiplies the adapter output by ``scaling`` (1.0 at alpha = r). The direct forward skips
both. These tests hold it to peft's result bit for bit (per-token log-probs, loss and every trainable gradient of
a tiny Qwen2, NVFP4 and dense, under bf16 autocast and in plain fp32), count what it no longer runs in one
decoder layer's forward + backward, and check that every case beyond vanilla LoRA still runs peft's forward.
The ``gpu`` test runs the same exactness check on CUDA (bf16 autocast, the Triton FP4 kernels).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from tiny_models import tiny_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qerl.load.linear import NVFP4Linear, replace_linears
from qerl.load.lora import (
    DenseLoraLinear,
    DirectLoraForward,
    NVFP4LoraLinear,
    PlainLinear,
    fold_lora_expand,
    lora_config,
    register_nvfp4,
)
from qerl.train.trainer import keep_trainable_fp32

BATCH, SEQ = 2, 12  # 24 token rows: no weight of the tiny model has a dimension of 24
PROJECTIONS = 7


def lora_model(
    nvfp4: bool, dtype: torch.dtype, device: str = "cpu", train_norms: bool = True, **lora: object
) -> nn.Module:
    """A seeded tiny Qwen2 (q/k/v biases) in ``dtype``, decoder Linears NVFP4 or dense, LoRA r8 on the 7 projections
    with random non-zero A and B, trained norms (``train_norms``) kept in fp32 as the trainer keeps them; in
    training mode. ``lora``: more ``lora_config`` arguments, and ``config``: the model's."""
    model = tiny_model("qwen2", 0, vocab_size=64, max_position_embeddings=64, **lora.pop("config", {}))
    if nvfp4:
        replace_linears(model, lambda name, lin: None if name == "lm_head" else NVFP4Linear.from_linear(lin))
    model = get_peft_model(model.to(device=device, dtype=dtype), lora_config(r=8, train_norms=train_norms, **lora))
    keep_trainable_fp32(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.train()


@contextmanager
def peft_forward() -> Iterator[None]:
    """Every LoRA layer runs peft's own forward (the path before the change)."""
    with mock.patch.object(DirectLoraForward, "_direct_adapter", lambda self, x: None):
        yield


def training_pass(model: nn.Module, autocast: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(per-token log-probs, loss, every trainable gradient) of one forward + backward of a GRPO-shaped loss:
    each token's log-prob times a fixed advantage, averaged over the tokens."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logps = logits.float().log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    advantages = torch.linspace(-1, 1, logps.numel(), device=device).view_as(logps)
    loss = -(torch.exp(logps - logps.detach()) * advantages).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), loss.detach(), grads


def assert_same_pass(model: nn.Module, autocast: bool) -> None:
    """The direct forward's pass equals peft's bit for bit: log-probs, loss and every LoRA and norm gradient."""
    with peft_forward():
        old = training_pass(model, autocast)
    new = training_pass(model, autocast)
    assert torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])
    assert len(new[2]) == 2 * 2 * PROJECTIONS + 4  # A and B of 2 x 7 projections, the 2 x 2 trained norms
    differ = [name for name in old[2] if not torch.equal(old[2][name], new[2][name])]
    assert not differ, differ


@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "dense"])
@pytest.mark.parametrize(
    ("dtype", "autocast"),
    [(torch.bfloat16, True), (torch.float32, False), (torch.float32, True)],
    ids=["bf16-autocast", "fp32", "fp32-autocast"],
)
def test_direct_forward_is_bitwise_peft(nvfp4: bool, dtype: torch.dtype, autocast: bool) -> None:
    model = lora_model(nvfp4, dtype)
    layer_cls = NVFP4LoraLinear if nvfp4 else DenseLoraLinear
    assert all(type(m) is layer_cls for m in model.modules() if isinstance(m, PeftLoraLinear))
    assert_same_pass(model, autocast)


def test_a_scale_other_than_one_is_applied_as_peft_applies_it() -> None:
    """alpha = 2r: the direct forward multiplies by 2.0 as peft does (same rounding), only the 1.0 is skipped."""
    model = lora_model(True, torch.bfloat16, alpha=16)
    assert_same_pass(model, autocast=True)


@contextmanager
def folded(model: nn.Module) -> Iterator[None]:
    """Every LoRA layer of ``model`` adds its expand into the base output in one GEMM, for the block."""
    assert fold_lora_expand(model, True) == 2 * PROJECTIONS
    try:
        yield
    finally:
        fold_lora_expand(model, False)


def fold_differences(model: nn.Module, autocast: bool) -> tuple[float, float, float]:
    """(largest log-prob difference, loss relative difference, worst gradient difference over that tensor's largest
    magnitude) of the folded pass against the direct one."""
    ref = training_pass(model, autocast)
    with folded(model):
        got = training_pass(model, autocast)
    grad = max(float((got[2][n] - g).abs().max() / g.abs().max()) for n, g in ref[2].items())
    return float((got[0] - ref[0]).abs().max()), float(abs(got[1] - ref[1]) / abs(ref[1])), grad


@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "dense"])
@pytest.mark.parametrize(
    ("dtype", "autocast", "bounds"),
    [(torch.float32, False, (1e-6, 1e-6, 1e-6)), (torch.bfloat16, True, (0.01, 1e-3, 0.05))],
    ids=["fp32", "bf16-autocast"],
)
def test_the_folded_expand_is_the_direct_forward_within_a_rounding(
    nvfp4: bool, dtype: torch.dtype, autocast: bool, bounds: tuple[float, float, float]
) -> None:
    """``fold_lora_expand``: the expand's product added into the base output by one ``addmm`` gives the direct
    forward's log-probs, loss and gradients up to the order of an fp32 sum (fp32: observed bitwise), and under bf16
    autocast up to the output's rounding, once instead of twice per projection (observed: log-probs 2.1e-3 NVFP4 /
    2.8e-3 dense, gradients 2.1e-2 / 1.5e-2 of their largest magnitude; a bf16 rounding is 3.9e-3 relative). One
    decoder layer's pass runs 7 adds fewer (29 -> 22): the seven deltas' adds."""
    model = lora_model(nvfp4, dtype)
    found = fold_differences(model, autocast)
    assert all(f <= b for f, b in zip(found, bounds, strict=True)), found
    assert found[0] > 0 or not autocast  # under autocast it does change roundings: the test compares two paths
    with folded(model):
        adds = layer_adds(model)
    assert layer_adds(model) - adds == PROJECTIONS


class OpCounter(TorchDispatchMode):
    """Counts the dtype casts of token-row tensors (``[..., BATCH * SEQ rows, features]``, both directions) and the
    multiplications by the scalar 1.0 that run below autograd, backward included."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's protocol)
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_to_copy" and math.prod(args[0].shape[:-1]) == BATCH * SEQ and "dtype" in kwargs:
            self.counts[f"token rows to {kwargs['dtype']}"] += 1
        if name in ("mul", "mul_") and any(isinstance(a, float) and a == 1.0 for a in args[1:]):
            self.counts["mul by 1.0"] += 1
        if name == "add" and all(isinstance(a, torch.Tensor) and a.dim() >= 2 for a in args[:2]):
            self.counts["add of token rows"] += 1
        return func(*args, **kwargs)


def layer_ops(model: nn.Module) -> Counter:
    """What the first decoder layer's training forward + backward runs, under bf16 autocast."""
    decoder = model.base_model.model.model
    hidden = torch.randn(BATCH, SEQ, 64, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(SEQ)[None]
    rotary = decoder.rotary_emb(hidden, positions)
    with OpCounter() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = decoder.layers[0](hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        out.float().sum().backward()
    return counter.counts


def layer_adds(model: nn.Module) -> int:
    """Tensor-tensor adds (forward and backward) of the first decoder layer's training pass, under bf16 autocast."""
    return layer_ops(model)["add of token rows"]


def test_direct_forward_runs_no_cast_and_no_scale_on_the_adapter_path() -> None:
    """With adapters on, one layer casts its token rows exactly as often as with adapters off (the norms' fp32 math;
    the adapters add none) and never multiplies by 1.0. peft's forward, counted
    the same way, shows what went: per projection, the fp32 copy of the input and autocast's bf16 copy of it,
    mirrored in the backward, and ``* 1.0`` forward and backward."""
    model = lora_model(True, torch.bfloat16, train_norms=False)  # disable_adapter would also swap trained norms
    with model.disable_adapter():
        base = layer_ops(model)
    direct = layer_ops(model)
    with peft_forward():
        peft = layer_ops(model)
    casts = ("token rows to torch.float32", "token rows to torch.bfloat16")
    assert base[casts[0]] > 0  # the counter sees the norms' casts
    assert {k: direct[k] for k in casts} == {k: base[k] for k in casts}
    assert direct["mul by 1.0"] == 0
    assert {k: peft[k] - base[k] for k in casts} == {casts[0]: 2 * PROJECTIONS, casts[1]: 2 * PROJECTIONS}
    assert peft["mul by 1.0"] == 2 * PROJECTIONS


@contextmanager
def counting_peft_calls() -> Iterator[list[int]]:
    """Counts the calls that reach peft's own LoRA forward."""
    calls = [0]
    real = PeftLoraLinear.forward

    def counted(self: PeftLoraLinear, *args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return real(self, *args, **kwargs)

    with mock.patch.object(PeftLoraLinear, "forward", counted):
        yield calls


def _two_adapters(model: nn.Module) -> dict:
    model.add_adapter("second", lora_config(r=4))
    model.base_model.set_adapter(["default", "second"])
    return {}


def _dora(model: nn.Module) -> dict:
    model.add_adapter("dora", LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))
    model.set_adapter("dora")
    return {}


def _adapter_names(model: nn.Module) -> dict:
    model.eval()  # peft takes adapter_names in inference only
    return {"adapter_names": ["default"] * BATCH}


#: How each case is set up on a fresh dense fp32 model (LoRA dropout 0.1, training mode); the keyword arguments of
#: its forward.
CASES = {
    "vanilla_eval": lambda model: model.eval() and {},  # dropout in eval mode is the identity: the direct forward
    "dropout": lambda model: {},
    "dora": _dora,
    "two_adapters": _two_adapters,
    "adapter_names": _adapter_names,
    "merged": lambda model: model.merge_adapter() or {},
}


@pytest.mark.parametrize("case", [*CASES, "disabled"])
def test_anything_but_vanilla_lora_runs_peft_forward(case: str) -> None:
    """Active dropout, DoRA, several active adapters, ``adapter_names``, merged or disabled adapters: every LoRA
    layer runs peft's forward, so nothing there can silently differ. Vanilla LoRA (here: dropout in eval mode, an
    identity) takes the direct one in every layer."""
    model = lora_model(False, torch.float32, train_norms=False, dropout=0.1)  # peft mixes no batches over norms
    kwargs = CASES[case](model) if case in CASES else {}
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with counting_peft_calls() as calls, torch.no_grad():
        with model.disable_adapter() if case == "disabled" else contextlib.nullcontext():
            model(input_ids=ids, **kwargs)
    layers = sum(isinstance(m, PeftLoraLinear) for m in model.modules())
    assert layers == 2 * PROJECTIONS and calls[0] == (0 if case == "vanilla_eval" else layers)


def test_plain_linear_key_takes_nn_linear_only() -> None:
    """peft's custom-module table gets ``PlainLinear``: exact ``nn.Linear`` layers get the direct forward, a subclass
    of it (bitsandbytes' quantized Linears are) is left to peft's own dispatch."""

    class Subclass(nn.Linear):
        pass

    assert isinstance(nn.Linear(4, 4), PlainLinear) and not isinstance(Subclass(4, 4), PlainLinear)
    model = nn.Sequential()
    model.add_module("q_proj", nn.Linear(16, 16))
    model.add_module("k_proj", Subclass(16, 16))
    wrapped = get_peft_model(model, register_nvfp4(LoraConfig(r=4, target_modules=["q_proj", "k_proj"])))
    inner = wrapped.base_model.model
    assert type(inner.q_proj) is DenseLoraLinear and type(inner.k_proj) is PeftLoraLinear


@pytest.mark.gpu
@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "dense"])
def test_direct_forward_is_bitwise_peft_on_cuda(nvfp4: bool) -> None:
    """The exactness check on CUDA: a bf16 model under bf16 autocast, NVFP4 layers on the Triton kernels (token rows
    64 x 12: the split-K decode GEMM and the fused grad_x kernel; larger shapes than the CPU test's so that every
    kernel path has full tiles). Eager attention keeps the backward deterministic, so that peft's pass run twice
    is bitwise the same (checked first: a difference there is the device's, not the change's)."""
    config = {"hidden_size": 256, "intermediate_size": 688, "attn_implementation": "eager"}
    model = lora_model(nvfp4, torch.bfloat16, device="cuda", config=config)
    with peft_forward():
        first, second = training_pass(model, True), training_pass(model, True)
    assert torch.equal(first[1], second[1]) and all(torch.equal(first[2][n], second[2][n]) for n in first[2])
    assert_same_pass(model, autocast=True)


@pytest.mark.gpu
@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "dense"])
def test_the_folded_expand_is_the_direct_forward_within_a_rounding_on_cuda(nvfp4: bool) -> None:
    """The folded expand on CUDA (bf16 autocast, the Triton FP4 kernels, cuBLAS's addmm epilogue), with the CPU
    test's bf16 bounds."""
    config = {"hidden_size": 256, "intermediate_size": 688, "attn_implementation": "eager"}
    model = lora_model(nvfp4, torch.bfloat16, device="cuda", config=config)
    found = fold_differences(model, autocast=True)
    assert all(f <= b for f, b in zip(found, (0.01, 1e-3, 0.05), strict=True)), found
