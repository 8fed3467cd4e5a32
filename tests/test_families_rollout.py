"""The native rollout engine on each ``qerl.arch`` family beyond Llama-2/Qwen2: Llama-3.x (rope_type llama3,
tied embeddings), Qwen3 (per-head q/k RMSNorm before RoPE) and Mistral (sliding window). CPU in fp32; the
GPU test (marker gpu) runs the fused kernels and CUDA graphs in bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import FAMILY_CONFIGS, nvfp4_lora, tiny_family

from benchmarks import common
from qerl import arch
from qerl.rollout import SamplingParams, get_engine
from qerl.rollout.native import NativeEngine

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [1], [40, 41, 42, 43]]
#: Long enough to pass the 64 original positions of the tiny llama3 rope, where its scaling changes the frequencies.
COMPLETIONS = [list(range(100, 180)), [100, 101, 102], [7] * 10, list(range(30, 120))]
FAMILIES = list(FAMILY_CONFIGS)


def full_forward_error(
    model: torch.nn.Module, engine: NativeEngine, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[float, float]:
    """(max |engine teacher-forced logit - transformers forward logit|, max |logit|) over every completion position."""
    got = engine.teacher_forced_logits(prompts, completions)
    device = next(model.parameters()).device
    worst = scale = 0.0
    for prompt, comp, logits in zip(prompts, completions, got, strict=True):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt + comp], device=device)).logits[0, len(prompt) - 1 : -1].float()
        assert logits.shape == ref.shape
        worst = max(worst, (logits - ref).abs().max().item())
        scale = max(scale, ref.abs().max().item())
    return worst, scale


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_logits_match_full_forward_cpu(family: str) -> None:
    """The bound the engine meets for Qwen2 (test_rollout_engines): 1e-4 in fp32, NVFP4 + LoRA + trained norms."""
    model = nvfp4_lora(tiny_family(family, 11))
    worst, _ = full_forward_error(model, NativeEngine(model, 0), PROMPTS, COMPLETIONS)
    assert worst < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_native_greedy_and_logprobs_equal_transformers(family: str) -> None:
    model = tiny_family(family, 3)
    params = SamplingParams(temperature=0.0, max_new_tokens=48)
    ref = get_engine(model, 0, kind="hf").generate(PROMPTS, params, n=2)
    out = get_engine(model, 0, kind="native").generate(PROMPTS, params, n=2)
    assert out.completion_ids == ref.completion_ids
    assert len({tuple(c) for c in out.completion_ids}) >= 3  # not a degenerate model
    flat = [abs(a - b) for la, lb in zip(out.logprobs, ref.logprobs, strict=True) for a, b in zip(la, lb, strict=True)]
    assert max(flat) < 1e-4


def test_qwen3_plan_reads_the_per_head_norms_in_place() -> None:
    """q_norm / k_norm are read by reference (a later write is seen), and only Qwen3 has them."""
    model = tiny_family("qwen3", 5)
    engine = NativeEngine(model, 0)
    before, _ = full_forward_error(model, engine, PROMPTS[:2], COMPLETIONS[:2])
    with torch.no_grad():
        model.model.layers[1].self_attn.k_norm.weight.mul_(-1.5)
    worst, _ = full_forward_error(model, engine, PROMPTS[:2], COMPLETIONS[:2])
    assert max(before, worst) < 1e-4
    assert all(layer.qk_norms is not None for layer in engine.view.layers)
    llama = NativeEngine(tiny_family("llama3"), 0)
    llama.generate([[1, 2]], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert all(layer.qk_norms is None for layer in llama.view.layers)


def test_mistral_longer_than_its_sliding_window_is_refused() -> None:
    model = tiny_family("mistral", sliding_window=32)
    engine = NativeEngine(model, 0)
    assert len(engine.generate([[1] * 8], SamplingParams(temperature=0.0, max_new_tokens=24)).completion_ids[0]) == 24
    with pytest.raises(ValueError, match=r"sliding_window \(32\)"):
        engine.generate([[1] * 8], SamplingParams(temperature=0.0, max_new_tokens=25))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_vl", "gpt2"])
def test_unsupported_model_types_are_one_line_errors(model_type: str) -> None:
    with pytest.raises(
        ValueError, match=rf"model_type '{model_type}' is not supported; .*llama, qwen2, qwen3, mistral$"
    ):
        arch.check_config({"model_type": model_type}, "config.json")
    model = tiny_family("qwen3")
    model.config.model_type = model_type
    with pytest.raises(ValueError, match=f"model_type '{model_type}'"):
        NativeEngine(model, 0).generate([[1]], SamplingParams(max_new_tokens=2))


def bf16_errors(
    family: str,
    device: str,
    lengths: tuple[tuple[int, int], ...] = ((17, 100), (250, 40), (64, 129)),
    **config: object,
) -> tuple[float, float]:
    """(engine, transformers) relative errors of bf16 NVFP4 + LoRA teacher-forced logits, head_dim 128 as the real
    models, each ``||logits - exact|| / ||exact||`` over every completion position; ``exact`` is the same model
    (the same bf16-rounded weights, NVFP4 codes and rope tables) run by transformers in fp32 on the CPU. ``lengths``:
    (prompt, completion) tokens per row; ``config`` on top of the family's.

    Why this bound and not a share of max |logit| against transformers' bf16 logits: with random weights, Llama 3
    and Mistral are ill-conditioned in bf16. Transformers' own bf16 forward is ~8% off the fp32 forward of the same
    weights (max |dlogit| ~4 of ~22), so two bf16 implementations that round in different orders differ by that
    much, whichever is right (Qwen3's q/k norms tame it: ~2%). The engine must be as exact as transformers."""
    sizes = dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=2048,
    )
    model = tiny_family(family, 12, **{**sizes, **config}).to(torch.bfloat16)
    model = nvfp4_lora(model, group_scales=True)
    with torch.no_grad():  # trained-LoRA magnitudes, not the stress-test 0.3
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.1)
    exact = copy.deepcopy(model).float()  # NVFP4Linear keeps its packed codes and scales as they are
    model = model.to(device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n, _ in lengths]
    completions = [torch.randint(0, 4096, (n,), generator=gen).tolist() for _, n in lengths]
    engine = NativeEngine(model, 0)
    got = torch.cat(engine.teacher_forced_logits(prompts, completions)).cpu()
    if device == "cuda":
        assert engine.last_stats["graphs"] >= 1
    ref, hf = [], []
    for prompt, comp in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + comp])
        with torch.no_grad():
            ref.append(exact(input_ids=ids).logits[0, len(prompt) - 1 : -1].float())
            hf.append(model(input_ids=ids.to(device)).logits[0, len(prompt) - 1 : -1].float().cpu())
    ref_all, hf_all = torch.cat(ref), torch.cat(hf)
    assert got.shape == ref_all.shape
    norm = ref_all.norm().item()
    return (got - ref_all).norm().item() / norm, (hf_all - ref_all).norm().item() / norm


def check_bf16_as_exact_as_transformers(
    family: str, device: str, cap: float = 0.15, **lengths_and_config: object
) -> None:
    ours, theirs = bf16_errors(family, device, **lengths_and_config)
    print(f"{family} bf16 nvfp4+LoRA on {device}: engine {ours:.4f}, transformers {theirs:.4f} (relative to fp32)")
    assert ours <= 1.3 * theirs + 1e-3
    assert ours < cap  # an engine bug (a wrong rope, a dropped norm) is O(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_logits_bf16_cpu(family: str) -> None:
    """The GPU test's model and bound through the engine's torch path in bf16."""
    check_bf16_as_exact_as_transformers(family, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_teacher_forced_logits_bf16(family: str) -> None:
    """bf16 NVFP4 + LoRA through the fused kernels and CUDA graphs."""
    check_bf16_as_exact_as_transformers(family, "cuda")


#: Real context lengths (issue 73): Llama 3.1's llama3 scaling from its real 8,192 original positions, crossed by the
#: completion (8,100 + 200); Mistral 7B v0.1's 4,096-position sliding window filled to the last position (3,900 + 196).
#: bf16 over such lengths drifts further from fp32 for transformers too (on CPU: 0.113 llama3, 0.112 mistral; the
#: engine 0.132, 0.126), so the absolute cap is 0.3, still far below an engine bug's O(1) (the llama3 model's fp32
#: logits with plain RoPE in place of its scaling differ from its own by 1.35 relative).
LLAMA31 = common.FAMILY_CONFIGS["llama3.1-8b"]  # the benchmarks' Llama-3.1-8B: its config.json's RoPE
LONG = {
    "llama3": dict(
        cap=0.3,
        lengths=((8100, 200),),
        max_position_embeddings=16384,
        rope_parameters={**LLAMA31["rope_scaling"], "rope_theta": LLAMA31["rope_theta"]},
    ),
    "mistral": dict(cap=0.3, lengths=((3900, 196),), sliding_window=4096, max_position_embeddings=8192),
}


@pytest.mark.parametrize("family", list(LONG))
def test_teacher_forced_logits_bf16_at_real_lengths_cpu(family: str) -> None:
    """The real-length check through the engine's torch path in bf16 (seconds on CPU)."""
    check_bf16_as_exact_as_transformers(family, "cpu", **LONG[family])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(LONG))
def test_gpu_teacher_forced_logits_bf16_at_real_lengths(family: str) -> None:
    """The bf16 check at the real models' context lengths: past Llama 3.1's 8,192 original positions, and Mistral's
    sliding window filled, head_dim 128, through the fused kernels and CUDA graphs."""
    check_bf16_as_exact_as_transformers(family, "cuda", **LONG[family])
