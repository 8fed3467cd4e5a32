"""The analytic side of benchmarks/grpo_step.py: shape counts, time floors and a peak-memory estimate
of one GRPO step, with no device and no model (``python -m benchmarks.grpo_step --floors`` prints them).

The memory estimate is ``qerl.train.memory``'s, the one ``python -m qerl.train`` refuses a run with before loading
it (its docstring lists the terms): :func:`memory_estimate` reports its terms for a benchmark's shape and sizes, with
gradient checkpointing and without, keeping the keys earlier result files hold.

``HEAD_ACTIVATIONS`` (``qerl.train.recompute``) is the estimate's one fitted constant: the H200 rows of
benchmarks/results/grpo_step.json (7B and 32B NVFP4, n=8, 2048 new tokens, micro-batch 2) leave 1.13 and 1.75 GB of
their training pass's peak unexplained by the other terms, 34 and 37 hidden-sized tensors per token; 36 makes the
estimate 10.7 GB for the 7B (measured 10.9) and 34.2 GB for the 32B (measured 34.1 above what the previous
configuration left allocated). On the rows it was not fitted on it gives 65.2 GB for the 72B NVFP4 step
(benchmarks/results/grpo_step_72b.json, measured 64.3) and 19.8 GB for the 7B bf16 step (measured 20.2);
tests/test_grpo_step_smoke.py holds both to 3%, and tests/test_memory.py every recorded row to 10%.
"""

from __future__ import annotations

import dataclasses

from qerl.arch import LINEAR_TARGETS
from qerl.train.memory import ModelShape, RunShape, estimate

#: Device-to-device copy bandwidth measured on the H200 (benchmarks/results/rollout_lora_b1_b8.json).
COPY_BW = 4.24e12
#: Dense bf16 matmul rate used as the training floor (H200 dense bf16 tensor-core rate).
MATMUL_FLOPS = 790e12
#: AdamW + clipping bytes per fp32 trainable parameter: read p, g, m, v and write p, m, v (28 B),
#: the clip's norm read of g and its in-place scale (12 B).
OPTIMIZER_BYTES_PER_PARAM = 40
#: Qwen2.5-72B(-Instruct) config.json: hidden 8192, intermediate 29568, 80 layers, 64 heads, 8 KV heads
#: (vocabulary 152064 as the 7B / 32B, untied LM head).
QWEN2_5_72B = dict(
    hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8
)


def shape_counts(shape: dict[str, int], vocab: int, lora_r: int) -> dict[str, int]:
    """Parameter and byte counts of a Llama/Qwen2 shape that the floors need (``qerl.train.memory.ModelShape``'s)."""
    model = ModelShape.from_config({**shape, "vocab_size": vocab}, nvfp4=False)
    return {
        "layers": model.layers,
        "hidden": model.hidden,
        "attention_width": model.heads * model.head_dim,  # heads x head_dim: what QK^T and PV run over
        "linear_params": model.linear_params,
        "lm_head_params": model.hidden * vocab,
        "lora_params": sum(model.trainable_tensors(lora_r, LINEAR_TARGETS, trained_norms=False)),
        "norm_params": model.layers * 2 * model.hidden,
        "kv_bytes_per_position": model.kv_bytes_per_position,  # K and V, bf16
    }


def floors(
    shape: dict[str, int],
    vocab: int,
    nvfp4: bool,
    n: int,
    prompt: int,
    tokens: int,
    lora_r: int,
    micro: int | None = None,
    recompute: float = 1.0,
) -> dict[str, float]:
    """Lower bounds (seconds) of each phase; the derivation is in the module docstring.
    ``micro`` (default n) completions per training pass: NVFP4 dequantizes every weight once per pass.
    ``recompute``: the share of training passes that recompute every layer's forward in the backward (gradient
    checkpointing; 1.0 all, 0.0 none), which ``fwd_bwd_s`` counts; ``fwd_bwd_no_recompute_s`` is the pass without
    any recompute, the floor of the work itself, and the floor of a pass run in row chunks (qerl.train.chunked_pass:
    the same flops, nothing recomputed; the dequantization it repeats per chunk is not counted)."""
    c = shape_counts(shape, vocab, lora_r)
    passes = n // (micro or n)
    weight_bytes = c["linear_params"] * (9 / 16 if nvfp4 else 2) + c["lm_head_params"] * 2
    kv_mean = n * c["kv_bytes_per_position"] * (prompt + tokens / 2)
    step_bytes = weight_bytes + c["lora_params"] * 2 + kv_mean
    seq = prompt + tokens
    # Forward flops: every token through the decoder Linears, only completion tokens through the LM
    # head (trl scores those only), causal attention QK^T + PV = 2 * layers * heads * head_dim * seq^2 per row.
    decoder = 2 * c["linear_params"] * n * seq
    head = 2 * c["lm_head_params"] * n * tokens
    linear = decoder + head
    attention = 2 * c["layers"] * c["attention_width"] * seq * seq * n
    dequant = passes * c["linear_params"] * (9 / 16 + 2) / COPY_BW if nvfp4 else 0.0  # read FP4, write bf16, per pass

    # The training pass: forward + input-gradient backward of the decoder Linears (2x; LoRA weight gradients are < 1%
    # and left out), flash attention's forward and its ~2x backward (3x), trl's fused LM head 3x (forward, its own
    # recompute of the logits tiles in the backward, input gradient); gradient checkpointing adds a second forward of
    # every decoder layer (Linears, attention, dequantization) in ``recompute`` of the passes.
    def training_s(r: float) -> float:
        return ((2 + r) * decoder + 3 * head + (3 + r) * attention) / MATMUL_FLOPS + (2 + r) * dequant

    phases = {
        "rollout_s": (tokens - 1) * step_bytes / COPY_BW,
        "logprobs_s": (linear + attention) / MATMUL_FLOPS + dequant,
        "fwd_bwd_s": training_s(recompute),
        "optimizer_s": (c["lora_params"] + c["norm_params"]) * OPTIMIZER_BYTES_PER_PARAM / COPY_BW,
    }
    return {
        "decode_step_ms": step_bytes / COPY_BW * 1e3,
        **phases,
        "fwd_bwd_no_recompute_s": training_s(0.0),
        "step_s": sum(phases.values()),
        "weight_gb": weight_bytes / 1e9,
        "step_flops_tflop": (linear + attention + (2 + recompute) * decoder + 3 * head + (3 + recompute) * attention)
        / 1e12,
    }


def estimate_of_what_ran(
    shape: dict[str, int], vocab: int, nvfp4: bool, n: int, prompt: int, tokens: int, lora_r: int, ran: dict
) -> float:
    """GB: ``qerl.train.memory.estimate``'s peak for the plan a benchmarked step ran, as ``ran`` (a grpo_step row)
    records it: its micro-batch, or the largest row chunk where every pass ran in chunks; full recompute or none; the
    padding mask where trl's masked forward ran on unequal lengths; the fused layers where they were swapped; the
    engine's cache freed where it was. Beside the measured peak, this is the estimate's check on every row."""
    chunks, recompute = ran["chunking"], ran["recompute"]
    passes = sum((recompute.get("passes") or {}).values())
    sizes = [int(k) for k in chunks["rows_per_chunk"]]
    rows = max(sizes) if sizes and chunks["chunked_passes"] == passes else ran["micro_batch"]
    run = RunShape(
        n,
        rows,
        prompt_tokens=prompt,
        completion_tokens=tokens,
        lora_r=lora_r,
        recompute=recompute["mode"] != "none",
        masked=ran["ragged"] and not ran["aligned_rows"],
        fused=ran["fused_layers"]["swapped"],
        release_engine=chunks.get("rollout_memory_freed", 0) > 0,
    )
    return estimate(ModelShape.from_config({**shape, "vocab_size": vocab}, nvfp4=nvfp4), run).peak / 1e9


def memory_estimate(
    shape: dict[str, int], vocab: int, nvfp4: bool, n: int, prompt: int, tokens: int, lora_r: int, micro: int
) -> dict[str, float]:
    """Peak memory (GB) of one GRPO step on one device, ``qerl.train.memory.estimate``'s terms with gradient
    checkpointing, their sum (``peak_gb``) and the part held at the step's start (``start_gb``). ``n``: completions on
    this device (LoRA r on the seven projections, trained norms, AdamW, the native engine, forced-length completions:
    no padding). Beside them, the training pass without recompute (``no_recompute_pass_gb``: the estimate the
    trainer's auto mode weighs), the same for one row (``no_recompute_row_gb``: the smallest chunk of a pass in row
    chunks, ``qerl.train.chunked_pass``) and the step's peak with it in place of the three checkpointing terms
    (``peak_no_recompute_gb``)."""
    model = ModelShape.from_config({**shape, "vocab_size": vocab}, nvfp4=nvfp4)
    run = RunShape(n, micro, prompt_tokens=prompt, completion_tokens=tokens, lora_r=lora_r, masked=False)
    full, none = estimate(model, run), estimate(model, dataclasses.replace(run, recompute=False))
    row = estimate(model, dataclasses.replace(run, recompute=False, micro_batch=1))
    terms = ("weights", "trainable_states", "engine_lora", "kv_cache", "checkpointed", "layer_recompute")
    return {
        **{f"{k}_gb": getattr(full, k) / 1e9 for k in (*terms, "head_and_grads")},
        "start_gb": full.resident / 1e9,
        "peak_gb": full.peak / 1e9,
        "no_recompute_pass_gb": none.training_pass / 1e9,
        "no_recompute_row_gb": row.training_pass / 1e9,
        "peak_no_recompute_gb": none.peak / 1e9,
    }
