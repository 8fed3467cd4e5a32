"""The models and timing that every rollout benchmark mode shares (benchmarks/rollout.py, rollout_ab.py): random
Qwen2.5-shaped models on the GPU with peft LoRA (NVFP4, bf16 or bitsandbytes NF4 decoder Linears), the bytes a decode
step reads, the copy bandwidth they are measured against, and the ms/step timing of an engine. One module, so the
main runs and the A/B modes time the same way."""

from __future__ import annotations

import gc
import sys
import time

import torch
from torch import nn

from benchmarks import common
from benchmarks.common import PROMPT, SHAPES, versions

DEVICE = "cuda"


def build_model(shape: str, nvfp4: bool, lora_r: int = 16, seed: int = 0) -> nn.Module:
    """A random model of ``shape`` on the GPU (bf16 or NVFP4 decoder Linears) wrapped in peft LoRA."""
    return with_lora(random_lm(shape, nvfp4, seed), lora_r)


def random_lm(shape: str, nvfp4: bool, seed: int = 0) -> nn.Module:
    """A random model of ``shape`` (Qwen2.5, or the family ``common.MODEL_TYPES`` names) on the GPU, decoder
    Linears bf16 or NVFP4 (no adapter)."""
    return common.random_model(
        SHAPES[shape],
        common.vocab_size(shape),
        nvfp4,
        torch.device(DEVICE),
        torch.bfloat16,
        arch=common.model_type(shape),
        seed=seed,
        **common.family_config(shape),
    ).eval()


def with_lora(model: nn.Module, lora_r: int = 16) -> nn.Module:
    """peft LoRA r on all seven projections, with a random (nonzero) B."""
    from peft import get_peft_model

    from qerl.load.lora import lora_config

    peft_model = get_peft_model(model, lora_config(r=lora_r)).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    return peft_model


def build_bnb_model(shape: str, lora_r: int = 16, seed: int = 0) -> nn.Module:
    """The random bf16 Qwen2 with every decoder Linear as a bitsandbytes NF4 ``Linear4bit``, + peft LoRA."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        sys.exit("benchmarks/rollout.py: --bnb needs bitsandbytes (pip install bitsandbytes)")
    from qerl.load.linear import replace_linears

    def nf4(name: str, lin: nn.Linear) -> nn.Module | None:
        if name == "lm_head":
            return None
        q = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=torch.bfloat16,
            quant_type="nf4",
            device="meta",
        )
        # Params4bit quantizes when moved to the GPU (the documented path), so hand it host data.
        q.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, quant_type="nf4").to(DEVICE)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        return q

    model = random_lm(shape, nvfp4=False, seed=seed)
    replace_linears(model, nf4)
    model.is_loaded_in_4bit = True  # peft dispatches its bnb LoRA layer only for models marked so
    gc.collect()
    torch.cuda.empty_cache()
    return with_lora(model, lora_r)


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of everything a decode step reads once except the embedding table, LoRA bytes in bf16)."""
    total = lora = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or "rotary" in name:
            continue
        if "lora_" in name:
            lora += t.numel() * 2  # the engine reads bf16 copies
        else:
            total += t.numel() * t.element_size()
    return total, lora


def copy_bandwidth() -> float:
    """The copy ceiling, bytes read + written per second (``common.copy_bandwidth``'s larger way)."""
    return common.copy_bandwidth()["max"]


def kv_bytes_per_step(shape: str, batch: int, tokens: int) -> float:
    """Mean K+V bytes attention must read per decode step over a generation of ``tokens``."""
    s = SHAPES[shape]
    per_pos = s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * 128 * 2
    return batch * per_pos * (PROMPT + tokens / 2)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def ms_per_step(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(decode ms/step, prefill+1-token s) for ``engine`` after a warm-up of the same shape."""
    from qerl.rollout import SamplingParams

    full = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0)
    one = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0)
    kv_block = getattr(engine, "kv_block", None)
    if kv_block is None:  # transformers: one warm-up run of the same shape
        engine.generate(prompts, full)
    else:
        # Capture every (batch, KV-length) graph the timed run needs with a few short generates whose
        # long prompts land in each KV bucket, largest first so the cache is sized once.
        total = len(prompts[0]) + tokens
        for end in range(-(-total // kv_block) * kv_block, len(prompts[0]), -kv_block):
            long = [(p * (end // len(p) + 1))[: end - 9] for p in prompts]
            engine.generate(long, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    # The timed prompts' own prefill shape may still compile kernels (the first variant of a run once
    # measured -0.4 ms/step because its t_one held a compile): run it once untimed.
    engine.generate(prompts, one)
    t_one = timed(lambda: engine.generate(prompts, one))
    out = []
    t_full = timed(lambda: out.append(engine.generate(prompts, full)))
    assert all(len(c) == tokens for c in out[0].completion_ids), "a completion stopped early"
    return (t_full - t_one) / (tokens - 1) * 1e3, t_one


def environment() -> dict:
    """Device, versions (bitsandbytes where this run used it) and the decode schedules this run used."""
    from qerl.kernels import schedule

    found = versions("transformers")
    if "bitsandbytes" in sys.modules:
        found["bitsandbytes"] = sys.modules["bitsandbytes"].__version__
    return {
        "device": torch.cuda.get_device_name(),
        "versions": found,
        # ``QERL_DECODE_CONFIG``, or the code's per-BM defaults.
        "decode_config": str(schedule.SWITCHES.decode_config or schedule.DECODE_BY_BM),
    }
