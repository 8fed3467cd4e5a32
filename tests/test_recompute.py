"""Recompute only what memory requires (``qerl.train.recompute``, issue 71): the estimate of a pass's saved
activations against a hand count and against what autograd really saves in one layer, the loss and gradients with
recompute on and off (bitwise equal: the recompute replays the same ops), the per-pass choice of an unset
``gradient_checkpointing`` inside a real QeRLTrainer step, and the flag's defaults. The ``gpu`` test repeats the
on/off equality on CUDA (bf16 autocast, the Triton FP4 kernels)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

import pytest
import torch
from test_lora_direct import BATCH, SEQ, lora_model, training_pass
from tiny_models import TINY
from torch import nn

from qerl.train import recompute
from qerl.train.recompute import HEAD_ACTIVATIONS, no_recompute_bytes, saved_activation_bytes

RANK = 8


def test_the_estimate_is_the_hand_count() -> None:
    """The tiny Qwen2 (hidden 64, intermediate 128, 4 heads of 16 over 2 KV heads, 2 layers), LoRA r8, 2 x 12 tokens,
    counted by hand in bytes per token and layer."""
    norms = 2 * (4 * 64 + 4 + 2 * 64)  # fp32 input, rsqrt, bf16 normalised input (trained weight): 776
    shrink_inputs = 2 * 64 + 2 * 64 + 2 * 128  # attention input, MLP input, down input: 512
    attention = 2 * 64 + 2 * 32 + 2 * 32 + 2 * 64 + 4 * 4  # q, k, v, SDPA output, fp32 log-sum-exp: 400
    mlp = 3 * 2 * 128  # gate, silu(gate), up: 768
    lora = 7 * 2 * RANK  # the shrinks' outputs: 112
    per_token = norms + shrink_inputs + attention + mlp + lora
    assert per_token == 2568
    assert saved_activation_bytes(TINY, BATCH, SEQ, RANK) == 2 * BATCH * SEQ * 2568
    untrained = per_token - 2 * 2 * 64
    assert saved_activation_bytes(TINY, BATCH, SEQ, RANK, trained_norms=False) == 2 * BATCH * SEQ * untrained
    # A padded batch: k and v repeated to the 4 heads (2 x 2 x 32 more) and SDPA's bf16 mask row (2 x 12).
    masked = per_token + 2 * 2 * 32 + 2 * SEQ
    assert saved_activation_bytes(TINY, BATCH, SEQ, RANK, masked=True) == 2 * BATCH * SEQ * masked
    # The whole pass adds the head and gradients (36 hidden-sized bf16 tensors per token) and, for NVFP4, two bf16
    # copies of the largest weight.
    rest = HEAD_ACTIVATIONS * BATCH * SEQ * 64 * 2
    assert no_recompute_bytes(TINY, BATCH, SEQ, RANK, nvfp4=False) == 2 * BATCH * SEQ * 2568 + rest
    assert no_recompute_bytes(TINY, BATCH, SEQ, RANK, nvfp4=True) == 2 * BATCH * SEQ * 2568 + rest + 2 * 64 * 128 * 2


def layer_saved_bytes(model: nn.Module) -> int:
    """Bytes of the token-row tensors that autograd saves in the first decoder layer's forward under bf16 autocast,
    each storage once; parameters, buffers and the RoPE tables handed in are not the layer's. (A token-row tensor:
    its size a multiple of the 24 rows; no weight of the tiny model has such a size, e.g. the dequantized ones the
    CPU reference GEMM saves.)"""
    decoder = model.base_model.model.model
    hidden = torch.randn(BATCH, SEQ, 64, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(SEQ)[None]
    rotary = decoder.rotary_emb(hidden, positions)
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *rotary]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held and t.numel() % (BATCH * SEQ) == 0:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        decoder.layers[0](hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
    return sum(saved.values())


@pytest.mark.parametrize("train_norms", [True, False], ids=["trained-norms", "frozen-norms"])
@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "dense"])
def test_the_estimate_is_what_autograd_saves(nvfp4: bool, train_norms: bool) -> None:
    """One layer of the bf16 model under autocast, as on the GPU: the count per layer is exactly what the layer's
    forward leaves for its backward."""
    model = lora_model(nvfp4, torch.bfloat16, train_norms=train_norms)
    one_layer = {**TINY, "num_hidden_layers": 1}
    assert layer_saved_bytes(model) == saved_activation_bytes(one_layer, BATCH, SEQ, RANK, trained_norms=train_norms)


def _pass(model: nn.Module, autocast: bool, on: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    if on:
        recompute.enable_recompute(model, None)
    else:
        model.gradient_checkpointing_disable()
    assert model.is_gradient_checkpointing is on
    return training_pass(model, autocast)


def assert_recompute_changes_nothing(model: nn.Module, autocast: bool) -> None:
    off, on = _pass(model, autocast, on=False), _pass(model, autocast, on=True)
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])
    differ = [name for name in off[2] if not torch.equal(off[2][name], on[2][name])]
    assert not differ and len(off[2]) == 32, differ


@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "dense"])
@pytest.mark.parametrize(("dtype", "autocast"), [(torch.bfloat16, True), (torch.float32, False)], ids=["bf16", "fp32"])
def test_recompute_on_and_off_give_bitwise_the_same_pass(nvfp4: bool, dtype: torch.dtype, autocast: bool) -> None:
    """Per-token log-probs, loss and every LoRA and norm gradient, with every layer recomputed and with none."""
    assert_recompute_changes_nothing(lora_model(nvfp4, dtype), autocast)


@pytest.mark.gpu
@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "dense"])
def test_recompute_on_and_off_give_bitwise_the_same_pass_on_cuda(nvfp4: bool) -> None:
    """The same on CUDA: bf16 under autocast, NVFP4 layers on the Triton kernels, eager attention (deterministic)."""
    config = {"hidden_size": 256, "intermediate_size": 688, "attn_implementation": "eager"}
    assert_recompute_changes_nothing(lora_model(nvfp4, torch.bfloat16, device="cuda", config=config), True)


# ---------------------------------------------------------------------------------------------- the trainer's choice


@pytest.fixture
def tiny_trainer(tmp_path) -> Iterator[tuple]:
    """A real QeRLTrainer (benchmarks.grpo_harness: tiny Llama, NVFP4, LoRA r4 + norms, bnpo) with
    ``gradient_checkpointing`` left unset as on CUDA (on CPU the config resolves it to on), and its prompts."""
    from benchmarks import grpo_harness

    shape, vocab = {k: TINY[k] for k in recompute.SHAPE_KEYS}, TINY["vocab_size"]
    args = argparse.Namespace(local_n=4, n=4, micro_batch=2, tokens=6, lora_r=4, gradient_checkpointing="auto")
    model = grpo_harness.build_model(shape, vocab, True, torch.device("cpu"), torch.float32, "llama")
    prompt = {"prompt": " ".join(f"t{i}" for i in range(1, 9))}
    torch.manual_seed(0)
    trainer = grpo_harness.make_trainer(model, grpo_harness.build_tokenizer(vocab), prompt, args, str(tmp_path))
    assert trainer.args.gradient_checkpointing is True and trainer.model.is_gradient_checkpointing  # CPU: on
    trainer.args.gradient_checkpointing = None
    trainer.args.release_rollout_memory = False  # each mocked reading is one pass's choice (the release's own tests:
    # tests/test_chunked_pass.py)
    trainer.model.gradient_checkpointing_disable()
    yield trainer, [prompt] * 4


@pytest.mark.parametrize(
    ("free_gb", "passes", "logged"),
    [
        ([100.0], {"none": 4, "full": 0}, ["none from step 0"]),
        ([0.0], {"none": 0, "full": 4}, ["full from step 0"]),
        ([100.0, 0.0, 100.0], {"none": 1, "full": 3}, ["none from step 0", "full from step 0"]),
    ],
    ids=["room", "no-room", "room-then-none"],
)
def test_unset_flag_recomputes_only_when_the_pass_would_not_fit(
    tiny_trainer: tuple, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, free_gb, passes, logged
) -> None:
    """Two steps of two passes each: while the free memory (mocked; a card of 100 GB) holds the estimate, no pass
    recomputes; once one would not fit, that pass and every later one recompute, whatever the memory says after.
    Each choice is logged in one line."""
    from benchmarks.grpo_harness import run_step

    trainer, prompts = tiny_trainer
    readings = iter(free_gb)
    last = [free_gb[-1]]

    def memory(device: torch.device) -> tuple[int, int]:
        last[0] = next(readings, last[0])
        return int(last[0] * 1e9), int(100e9)

    monkeypatch.setattr(recompute, "device_memory", memory)
    with caplog.at_level(logging.INFO, logger="qerl.train.recompute"):
        for _ in range(2):
            run_step(trainer, prompts, lambda phase: None)
    assert trainer.recompute_passes == passes
    assert trainer.model.is_gradient_checkpointing is bool(passes["full"])
    lines = [r.getMessage() for r in caplog.records if r.name == "qerl.train.recompute"]
    assert [line.split(" (")[0].removeprefix("activation recompute: ") for line in lines] == logged
    assert all("tokens needs ~" in line and "GB free besides the headroom" in line for line in lines)


def test_the_flag_defaults_and_values(tmp_path) -> None:
    """Unset means on (trl's default) without CUDA; True / False as given; the command line takes trl's spellings."""
    from qerl.train.args import parse_args
    from qerl.train.config import QeRLConfig

    assert not torch.cuda.is_available()
    assert QeRLConfig(output_dir=str(tmp_path), report_to=[]).gradient_checkpointing is True
    for value in (True, False):
        assert QeRLConfig(output_dir=str(tmp_path), gradient_checkpointing=value).gradient_checkpointing is value
    base = ["--output_dir", str(tmp_path)]
    assert parse_args(base)[1].gradient_checkpointing is True
    assert parse_args([*base, "--gradient_checkpointing", "False"])[1].gradient_checkpointing is False
    assert parse_args([*base, "--gradient_checkpointing"])[1].gradient_checkpointing is True  # trl's bare flag
