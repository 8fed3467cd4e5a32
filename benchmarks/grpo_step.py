"""One full GRPO step of qerl, NVFP4 vs bf16 base, on random weights in the real Qwen2.5-7B / 32B shapes.

What it measures, per configuration (shape x base weights), in one process on one GPU:

* the step QeRLTrainer runs: 8 completions of one 256-token prompt, each forced to 2048 new tokens
  (no early stop), LoRA r16 on all 7 projections plus trainable input/post-attention norms (``ln``),
  AQN on (stage 1 of 10), bnpo loss, token-truncated IS correction, activation recompute as
  ``--gradient-checkpointing`` says (default auto, QeRLConfig's: ``qerl.train.recompute``; the row's ``recompute``
  says what the timed passes ran, its ``chunking`` which passes ran in row chunks: ``qerl.train.chunked_pass``,
  ``--pass-chunk-rows``), AdamW on the trainable parameters, grad clip 0.2, bf16 autocast on CUDA
  (accelerate's, as in ``trainer.train()``);
* micro-batched as trl users run it (``--micro-batch``, default 2): per_device_train_batch_size = 2 and
  steps_per_generation = gradient_accumulation_steps = 8 / 2 = 4, so the rollout still generates all 8
  completions in one batch, then 4 forward+backward passes of 2 completions accumulate into ONE
  optimizer step. Only the training passes' activations shrink (by 4x); the step's math does not change:
  trl divides each micro-step's loss by ``current_gradient_accumulation_steps`` itself (bnpo/grpo/dr_grpo;
  dapo normalises by the generation batch's token count instead), transformers adds no second division
  (trl marks its loss as already scaled), so the accumulated gradient equals the one-pass gradient when
  the micro-batches hold equal token counts, as forced-length completions do (the smoke test checks
  that micro 2 and micro 4 of n=4 give the same grad norm);
* wall time and ``torch.cuda.max_memory_allocated`` of each phase, and of the whole step:
  ``rollout``   QeRLTrainer._generate_single_turn: AQN noise in, the native engine's prefill and
                2047 CUDA-graph decode steps, noise out;
  ``logprobs``  trl's no-grad ``_get_per_token_logps_and_entropies`` over prompt+completion: the old
                log-probs of the IS correction, through trl's chunked fused LM head (it never builds the
                ``[B, T, V]`` fp32 logits; the row records that tensor's size beside the phase's peak).
                0 with ``is_ratio_from_loss_pass`` (the default: the ratio comes from the loss forward,
                qerl.train.is_ratio); ``--trl-logprob-pass`` times trl's pass;
  ``fwd_bwd``   the loss forward + backward (trl's ``compute_loss``, and the recompute where it runs),
                summed over the micro-steps;
  ``optimizer`` grad clipping, ``optimizer.step()``, scheduler step, ``zero_grad``;
  ``other``     the rest of the step on the host/device (tokenising, decoding, rewards, padding,
                advantages). The phases are contiguous, so the step's peak is the largest phase peak.

How the phases are driven (no ``trainer.train()``: a real QeRLTrainer, prepared as ``Trainer.train``
prepares it, stepped as transformers' inner loop steps it, split by wrappers around its own methods)
and how an in-memory tokenizer forces every completion to full length: benchmarks/grpo_harness.py.

Before the timed step, each configuration runs an untimed warm-up: 8-token rollouts whose long
prompts land in every KV-length bucket (captures every decode graph the timed rollout replays, as
benchmarks/rollout.py does) and one short full step (compiles the training kernels and allocates the
optimizer state, as any step after the first finds them). Its time is recorded as ``warmup_s``.
A configuration that runs out of memory is recorded as ``status: "oom"`` with the phase it was in.
After each configuration the whole document so far is written to ``<out>.partial.json``.

Floors (per row, and ``--floors`` prints them without a device): rollout = (new tokens - 1) x bytes
a decode step must read (weights + bf16 LoRA copies + mean KV) / 4.24 TB/s copy bandwidth (measured
in benchmarks/results/rollout_lora_b1_b8.json); training passes = matmul + attention flops / 790 TFLOP/s
(plus, for NVFP4, the bytes of dequantizing every weight once per pass), the training pass counting the recompute
its passes ran (``fwd_bwd_s``) and none (``fwd_bwd_no_recompute_s``, the work itself; ``of_floor`` has both);
optimizer = 40 B per fp32 trainable parameter / 4.24 TB/s. docs/performance.md has the measured step beside them.

    python -m benchmarks.grpo_step --out $OUT/grpo_step.json        # the H200 run (~5-7 min, predicted)
    python -m benchmarks.grpo_step --tiny --out /tmp/grpo_tiny.json  # 2-layer Llama, 16 tokens, CPU ok
    python -m benchmarks.grpo_step --floors                          # analytic floors only
    python -m benchmarks.grpo_step --shapes 7b --bases nvfp4 --ragged [--masked-pass] --out $OUT/ragged.json
        # completions of unequal lengths, as in a real run: the aligned training pass, or trl's masked one
    python -m benchmarks.grpo_step --shapes 7b --bases nvfp4 [--no-fused-layers] --out $OUT/fused.json
        # the fused RMSNorm and SwiGLU kernels in the training pass, or transformers' modules
    python -m benchmarks.grpo_step --shapes 7b --bases nvfp4 [--fold-lora-expand] --out $OUT/fold.json
        # the LoRA expand added into the base output in one GEMM, against two GEMMs and an add
    python -m benchmarks.grpo_step --shapes 7b --profile --out $OUT/grpo_step_profile.json
        # the timed fwd_bwd under torch.profiler: device-busy share, top kernels, host cost of the qerl ops, and
        # what the host ran while the device idled (--profile-python: down to the Python functions)
    python -m benchmarks.grpo_step --shapes 72b --bases nvfp4 --steps 1 --out $OUT/grpo_step_72b.json
        # Qwen2.5-72B shape, NVFP4 only (the estimate, --floors: ~65 GB peak; target <= 80 GB)
    python -m benchmarks.grpo_step --shapes qwen3-32b --bases nvfp4 --steps 1 --out $OUT/grpo_step_qwen3_32b.json
        # Qwen3-32B shape (q/k norms, heads of 128): peak memory of one step on one GPU
    python -m benchmarks.grpo_step --shapes 7b --bases nvfp4 --out $OUT/g1.json && \
    accelerate launch --config_file training/accelerate/ddp.yaml --num_processes 2 -m benchmarks.grpo_step \
        --shapes 7b --bases nvfp4 --out $OUT/g2.json --baseline $OUT/g1.json
        # data parallel: the same global batch (8 completions) split 4 + 4 over 2 GPUs, each rank with its own
        # engine and micro-batches, gradients all-reduced in the last micro-step; rank 0 writes the JSON, whose
        # summary has ddp_throughput_ratio_7b_nvfp4 = 1-GPU step time / 2-GPU step time (target >= 1.8)

Peak memory is ``torch.cuda.max_memory_allocated`` per phase (``peak_gb``) and the allocator's reserved peak
over the step (``peak_reserved_gb_step``, what a card must hold); ``memory_estimate_gb`` is the analytic
estimate of benchmarks/grpo_floors.py beside it (its ``peak`` with full recompute, ``peak_no_recompute`` without
any), and ``estimate_of_what_ran_gb`` / ``estimate_over_measured`` the estimate of the plan the step ran (recompute,
row chunks, fused layers, the engine's cache freed) against the measured peak. Under data parallelism the row is rank
0's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import SHAPES as QWEN2_5_SHAPES
from benchmarks.common import command, device_name, model_type, utc_now, versions, vocab_size, write_json
from benchmarks.grpo_floors import (
    COPY_BW,
    MATMUL_FLOPS,
    QWEN2_5_72B,
    estimate_of_what_ran,
    floors,
    memory_estimate,
    shape_counts,
)
from benchmarks.grpo_harness import (
    PASS_CHUNK_HELP,
    RECOMPUTE_FLAGS,
    PhaseClock,
    Probe,
    build_model,
    build_tokenizer,
    capture_decode_graphs,
    chunking_ran,
    gb,
    make_trainer,
    profile_table,
    recompute_ran,
    round_up,
    run_step,
    sig,
)

SHAPES: dict[str, dict[str, int]] = {**QWEN2_5_SHAPES, "72b": QWEN2_5_72B}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY_VOCAB = 256
#: The phases a step is split into (``other``: the rest of the step between them).
PHASES = ("rollout", "logprobs", "fwd_bwd", "optimizer", "other")
#: peak_gb_72b_nvfp4: fits an 80 GB card; ddp_throughput_*: 2 GPUs vs 1 on the same global batch (--baseline).
TARGETS = {
    "peak_gb_32b_nvfp4": ("<=", 48.0),
    "step_speedup_7b": (">=", 1.3),
    "peak_gb_72b_nvfp4": ("<=", 80.0),
    "ddp_throughput_ratio_7b_nvfp4": (">=", 1.8),
}
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def measure(
    trainer: Any,
    prompts: list[dict[str, str]],
    args: argparse.Namespace,
    row: dict,
    clock: PhaseClock,
    gen: torch.Generator,
    vocab: int,
) -> None:
    """Warm up, then time one step; fills ``row``. Every tensor reference it takes dies on return, so
    the configuration's memory is freed with the trainer."""
    cuda = clock.cuda
    probe = Probe(trainer, clock.switch, ragged=args.ragged)
    trainer.align_rows = not args.masked_pass
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    row["trainable_params"] = sum(p.numel() for p in trainable)
    row["trainable_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in trainable})
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    row["optimizer"] = f"{type(optimizer).__name__} ({getattr(trainer.args.optim, 'value', trainer.args.optim)})"
    row["gradient_checkpointing"] = args.gradient_checkpointing  # asked: auto (the trainer decides per pass), on, off
    row["pass_chunk_rows"] = args.pass_chunk_rows  # asked: None auto, 0 never, N rows per chunk
    row["mixed_precision"] = trainer.accelerator.mixed_precision  # "bf16": the forward runs under bf16 autocast

    clock.stage = "warm-up"
    t0 = time.perf_counter()
    capture_decode_graphs(trainer, args, gen, vocab)
    row["capture_s"] = round(time.perf_counter() - t0, 2)  # includes the first Triton compiles
    trainer.max_completion_length = min(32, args.tokens)
    with clock.run():
        run_step(trainer, prompts, clock.switch)
    trainer.max_completion_length = args.tokens
    row["warmup_step_phases_s"] = {p: sig(clock.seconds.get(p, 0.0)) for p in PHASES}
    row["warmup_s"] = round(time.perf_counter() - t0, 2)

    clock.stage = "step"
    # ``--steps`` timed steps; the row reports the last one (steady state) and lists every step's time
    # and phases, so that a one-time cost of the first full-length step (the warm-up step is short) is
    # seen, not averaged in. ``--profile`` profiles the first timed step, which is then not the one reported
    # unless it is the only one.
    row["timed_steps"] = []
    trainer.recompute_passes, trainer.chunk_passes = {"none": 0, "full": 0}, {}  # the timed steps' passes only
    trainer.rollout_memory_freed = 0
    for _ in range(args.steps):
        probe.start_step()
        if cuda:
            row["allocated_at_step_start_gb"] = gb(torch.cuda.memory_allocated())
        row["aqn_sigma"] = trainer.current_sigma()
        with clock.run():
            loss, grad_norm = run_step(trainer, prompts, clock.switch)
        row["phases_s"] = {p: sig(clock.seconds.get(p, 0.0)) for p in PHASES}
        row["step_s"] = sig(sum(clock.seconds.values()))
        row["timed_steps"].append({"step_s": row["step_s"], "phases_s": row["phases_s"]})
    if clock.profile_phase is not None:  # its phase time includes the profiler's own overhead
        row["profile"] = {
            "phase": clock.profile_phase,
            "timed_step": 1,
            **(profile_table(*clock.profiled) if clock.profiled else {}),
        }
    row["peak_gb"] = {p: gb(clock.peak.get(p)) if cuda else None for p in PHASES}
    row["peak_gb_step"] = gb(max(clock.peak.values())) if cuda else None
    row["peak_reserved_gb_step"] = gb(clock.peak_reserved) if cuda else None
    if cuda and row["peak_gb"]["logprobs"] is not None:  # the chunked head's transient vs full_logits_fp32_gb
        row["logprobs_peak_over_start_gb"] = round(row["peak_gb"]["logprobs"] - row["allocated_at_step_start_gb"], 3)
    row["loss"], row["grad_norm"] = loss, grad_norm
    row["lora_updated"] = not torch.equal(probe.start_value, probe.watched.detach())
    row["lora_moved_during_accumulation"] = probe.weights_moved_in_accumulation
    row["rollouts"] = probe.rollouts
    row["micro_batch_rows"] = probe.micro_rows  # one entry per backward pass
    row["optimizer_steps_total"] = int(optimizer.state[probe.watched]["step"])  # warm-up + timed steps
    row["completion_lengths"] = sorted(set(probe.completion_lengths))
    row["forced_length"] = probe.completion_lengths == [args.tokens] * args.local_n
    row["ragged"], row["aligned_rows"] = args.ragged, trainer.align_rows
    row["fused_layers"] = {  # asked (QeRLConfig.fused_layers), and swapped (where the kernels serve: CUDA)
        "asked": trainer.args.fused_layers,
        "swapped": trainer.layers_fused,
    }
    row["fold_lora_expand"] = trainer.args.fold_lora_expand
    row["decode_steps"] = probe.decode_steps
    row["rollout_ms_per_token"] = round(row["phases_s"]["rollout"] / max(1, args.tokens - 1) * 1e3, 3)
    row["recompute"] = recompute_ran(trainer)
    row["chunking"] = chunking_ran(trainer)
    shape, vocab_n, _ = resolve_shape(row["shape"])
    sizes = (row["n_per_process"], args.prompt, args.tokens, args.lora_r)
    row["estimate_of_what_ran_gb"] = sig(estimate_of_what_ran(shape, vocab_n, row["base"] == "nvfp4", *sizes, row))
    if cuda:  # the estimate's check: the peak above what the process held before it built the model
        held = row["peak_gb_step"] - row["allocated_before_build_gb"]
        row["estimate_over_measured"] = sig(row["estimate_of_what_ran_gb"] / held) if held > 0 else None


def of_floor(row: dict) -> dict[str, float]:
    """Each floor over its measured time (1.0: at the floor); the training pass against the floor of the recompute it
    ran and against the floor without any recompute."""
    measured = {**row["phases_s"], "step": row["step_s"], "fwd_bwd_no_recompute": row["phases_s"]["fwd_bwd"]}
    return {
        p: sig(row["floors"][f"{p}_s"] / measured[p])
        for p in ("rollout", "logprobs", "fwd_bwd", "fwd_bwd_no_recompute", "optimizer", "step")
        if measured[p] > 0
    }


def resolve_shape(name: str) -> tuple[dict[str, int], int, str]:
    """(shape, vocabulary, architecture) of ``7b`` / ``32b`` / ``72b`` (Qwen2.5), ``qwen3-8b`` / ``qwen3-32b`` or
    ``tiny`` (2-layer Llama)."""
    return (TINY, TINY_VOCAB, "llama") if name == "tiny" else (SHAPES[name], vocab_size(name), model_type(name))


def run_config(
    shape_name: str, nvfp4: bool, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict:
    """Build, warm up and time one configuration; OOM is caught and recorded as a result."""
    shape, vocab, arch = resolve_shape(shape_name)
    base = "nvfp4" if nvfp4 else ("bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."))
    counts = shape_counts(shape, vocab, args.lora_r)
    sizes = (args.local_n, args.prompt, args.tokens, args.lora_r, args.micro_batch)  # this process's share
    row: dict[str, Any] = {
        "shape": shape_name,
        "base": base,
        "n": args.n,
        "processes": args.processes,
        "n_per_process": args.local_n,
        "micro_batch": args.micro_batch,
        "gradient_accumulation_steps": args.local_n // args.micro_batch,
        "prompt_tokens": args.prompt,
        "new_tokens": args.tokens,
        "lora_r": args.lora_r,
        "status": "ok",
        "memory_estimate_gb": {
            k.removesuffix("_gb"): sig(v) for k, v in memory_estimate(shape, vocab, nvfp4, *sizes).items()
        },
        "full_logits_fp32_gb": gb(args.local_n * args.tokens * vocab * 4),
    }
    clock = PhaseClock(device, "fwd_bwd" if args.profile else None, python=args.profile_python)
    gen = torch.Generator().manual_seed(0)
    trainer = None
    t0 = time.perf_counter()
    if clock.cuda:
        row["allocated_before_build_gb"] = gb(torch.cuda.memory_allocated())
    try:
        with tempfile.TemporaryDirectory(prefix="qerl-grpo-step-") as out_dir:
            prompt = " ".join(f"t{i}" for i in torch.randint(1, vocab, (args.prompt,), generator=gen).tolist())
            prompts = [
                {"prompt": prompt}
            ] * args.local_n  # trl's RepeatSampler: n copies of one prompt, split over ranks
            torch.manual_seed(0)  # LoRA A init and the batch shuffle: the same step whatever --micro-batch
            trainer = make_trainer(
                build_model(shape, vocab, nvfp4, device, dtype, arch), build_tokenizer(vocab), prompts[0], args, out_dir
            )
            row["build_s"] = round(time.perf_counter() - t0, 2)
            row["engine_kv_cache_gb"] = gb(
                counts["kv_bytes_per_position"]
                * args.local_n
                * round_up(args.prompt + args.tokens, trainer.rollout_engine().kv_block)
            )
            measure(trainer, prompts, args, row, clock, gen, vocab)
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on to the next configuration)
        # OOM can also surface as a CUDA RuntimeError (e.g. inside graph capture), hence the text test.
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        if not oom:
            traceback.print_exc()
        row.update(
            status="oom" if oom else "error",
            phase=f"{clock.stage}: {clock.current}",
            error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400],
        )
    finally:
        try:  # after a CUDA error the context may be unusable: record that instead of losing the row
            if trainer is not None:
                trainer.rollout_engine().release()  # KV cache and graph pool
            trainer = None
            gc.collect()  # the probe's wrappers and the trainer reference each other
            if clock.cuda:
                torch.cuda.empty_cache()
                row["allocated_after_cleanup_gb"] = gb(torch.cuda.memory_allocated())
        except Exception as e:  # noqa: BLE001
            row["cleanup_error"] = f"{type(e).__name__}: {e}"[:300]
    row["total_s"] = round(time.perf_counter() - t0, 2)
    # The training pass's floor counts the recompute that ran (the share of passes that recomputed; one not measured:
    # what was asked, auto as full).
    share = row["recompute"]["share"] if "recompute" in row else float(args.gradient_checkpointing != "off")
    row["floors"] = {k: sig(v) for k, v in floors(shape, vocab, nvfp4, *sizes, recompute=share).items()}
    if row["status"] == "ok":
        row["of_floor"] = of_floor(row)
    return row


# ---------------------------------------------------------------------------------------------- report


def summarize(rows: list[dict], baseline: list[dict] | None = None) -> dict[str, Any]:
    """Peaks and NVFP4-vs-dense step speedups per shape (the issues' keys are always present); with
    ``baseline`` (the rows of a 1-process run of the same global batch), each configuration's
    data-parallel throughput ratio: baseline step time / this step time."""
    ok = {(r["shape"], r["base"]): r for r in rows if r["status"] == "ok"}
    summary: dict[str, Any] = {
        "peak_gb_32b_nvfp4": None,
        "peak_gb_7b_nvfp4": None,
        "step_speedup_7b": None,
        "peak_gb_72b_nvfp4": None,
    }
    for r in baseline or []:
        mine = ok.get((r["shape"], r["base"]))
        if r["status"] == "ok" and mine is not None:
            summary[f"ddp_throughput_ratio_{r['shape']}_{r['base']}"] = round(r["step_s"] / mine["step_s"], 3)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for (s, base), r in ok.items():
            if s == shape:
                summary[f"peak_gb_{shape}_{base}"] = r["peak_gb_step"]
        nv = ok.get((shape, "nvfp4"))
        dense = next((r for (s, b), r in ok.items() if s == shape and b != "nvfp4"), None)
        if nv is not None and dense is not None:
            summary[f"step_speedup_{shape}"] = round(dense["step_s"] / nv["step_s"], 3)
            summary[f"rollout_speedup_{shape}"] = round(dense["phases_s"]["rollout"] / nv["phases_s"]["rollout"], 3)
    targets = {}
    for key, (op, bound) in TARGETS.items():
        value = summary.get(key)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        targets[key] = {"target": f"{op} {bound}", "value": value, "met": met}
    summary["targets"] = targets
    return summary


def environment(device: torch.device) -> dict[str, Any]:
    return {"device": device_name(device), "versions": versions("transformers", "trl", "peft", "triton")}


def document(rows: list[dict], args: argparse.Namespace, env: dict, argv: list[str], partial: str | None) -> dict:
    doc = {
        "benchmark": "one GRPO step (QeRLTrainer): rollout / old log-probs / fwd+bwd / optimizer, time and peak memory",
        "date": utc_now(),
        **env,
        "command": command("benchmarks.grpo_step", argv),
        "setup": {
            "model": "tiny Llama (2 layers)" if args.tiny else "Qwen2.5 shapes, random weights",
            "completions": args.n,
            "processes": args.processes,
            "micro_batch": args.micro_batch,
            "prompt_tokens": args.prompt,
            "new_tokens": args.tokens,
            "accumulation": f"per process, one rollout of {args.local_n}, then {args.local_n // args.micro_batch} forward+"
            f"backward passes of {args.micro_batch} completions into one optimizer step (per_device_train_batch_size="
            f"{args.micro_batch}, steps_per_generation = gradient_accumulation_steps = {args.local_n // args.micro_batch})",
            "forced_length": "EOS id outside the model vocabulary",
            "lora": f"r{args.lora_r} on {'/'.join(PROJECTIONS)} + trainable norms",
            "loss": "bnpo, token_truncate IS (C=2), AQN stage 1, mask_truncated_completions=False",
            "gradient_checkpointing": args.gradient_checkpointing,
            "pass_chunk_rows": args.pass_chunk_rows,
            "warm-up": "decode graphs of every KV bucket + one short (<= 32-token) step, untimed",
            "floor_constants": {"copy_bw_tb_s": COPY_BW / 1e12, "matmul_tflop_s": MATMUL_FLOPS / 1e12},
        },
        "summary": summarize(rows, args.baseline_rows),
        "results": rows,
    }
    if partial is not None:
        doc["partial"] = partial
    return doc


def print_floors(args: argparse.Namespace) -> None:
    for shape in args.shapes:
        for base in args.bases:
            dims, vocab, _ = resolve_shape(shape)
            sizes = (args.local_n, args.prompt, args.tokens, args.lora_r, args.micro_batch)
            f = floors(dims, vocab, base == "nvfp4", *sizes, recompute=float(args.gradient_checkpointing != "off"))
            print(f"{shape} {base:5s}: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()))
            m = memory_estimate(dims, vocab, base == "nvfp4", *sizes)
            print(
                f"{shape} {base:5s} memory (GB): " + ", ".join(f"{k.removesuffix('_gb')} {v:.3g}" for k, v in m.items())
            )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/grpo_step.json"))
    parser.add_argument("--shapes", nargs="+", default=["7b", "32b"], choices=list(SHAPES))
    parser.add_argument("--bases", nargs="+", default=["nvfp4", "bf16"], choices=["nvfp4", "bf16"])
    parser.add_argument(
        "--skip", nargs="+", default=[], metavar="SHAPE:BASE", help="configurations to leave out (e.g. 32b:bf16)"
    )
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (the GRPO group)")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=2,
        help="completions per forward+backward pass (per_device_train_batch_size); must divide --n",
    )
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=2048, help="new tokens per completion (forced)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument(
        "--gradient-checkpointing",
        choices=list(RECOMPUTE_FLAGS),
        default="auto",
        help="activation recompute in the training passes: auto (QeRLConfig's default: none while the card's free "
        "memory holds a pass's activations, else full; on without CUDA), on (full), off (none)",
    )
    parser.add_argument("--pass-chunk-rows", type=int, default=None, help=PASS_CHUNK_HELP)
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="timed steps after the warm-up; the last one is reported (steady state), all are listed",
    )
    parser.add_argument(
        "--trl-logprob-pass",
        action="store_true",
        help="time trl's separate old-log-prob pass (is_ratio_from_loss_pass False) instead of taking "
        "the IS ratio from the loss forward",
    )
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="cut the completions to lengths from the full length down to half of it after the rollout, so that the "
        "training passes get the padded rows of a real run (the rollout still generates every token)",
    )
    parser.add_argument(
        "--masked-pass",
        action="store_true",
        help="run the training passes as trl does, with the padding mask (qerl shifts padded rows and drops it: "
        "qerl.train.aligned_rows); with --ragged, the A/B of that change",
    )
    parser.add_argument(
        "--no-fused-layers",
        action="store_true",
        help="transformers' RMSNorm and MLP in the training passes instead of qerl's fused kernels "
        "(QeRLConfig.fused_layers; qerl.train.fused_layers): the A/B of that change",
    )
    parser.add_argument(
        "--fold-lora-expand",
        action="store_true",
        help="add each LoRA expand into its base output in one GEMM (QeRLConfig.fold_lora_expand): the A/B of it",
    )
    parser.add_argument("--tiny", action="store_true", help="2-layer tiny Llama, 16 new tokens, prompt 32 (CPU or GPU)")
    parser.add_argument("--floors", action="store_true", help="print the analytic floors and exit (no device)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the first timed step's fwd_bwd under torch.profiler (CPU + CUDA); its table goes into the row "
        "('profile') and its phase time includes the profiler's overhead",
    )
    parser.add_argument(
        "--profile-python",
        action="store_true",
        help="with --profile, record Python calls too (with_stack), so the device's idle time is charged to the "
        "Python functions the host ran; slows the host, so the idle share it shows is an upper bound",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a 1-process run's JSON of the same global batch: the summary gets each configuration's data-parallel "
        "throughput ratio (run this one with accelerate launch --num_processes N)",
    )
    args = parser.parse_args(argv)
    # Under `accelerate launch` every process runs this script on its own GPU and takes n / processes of the
    # group's completions (trl splits each generation batch across the ranks; the group spans them).
    args.processes = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tiny:
        args.shapes, args.tokens, args.prompt = ["tiny"], 16, 32
    for flag in ("n", "micro_batch", "prompt", "tokens", "lora_r", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected a positive integer, got {getattr(args, flag)}")
    if args.n % (args.micro_batch * args.processes):
        share = f"--n {args.n}" + (f" / {args.processes} processes" if args.processes > 1 else "")
        parser.error(f"--micro-batch: expected a divisor of {share}, got {args.micro_batch}")
    if args.profile_python and not args.profile:
        parser.error("--profile-python: goes with --profile (it records Python calls in that profile)")
    args.local_n = args.n // args.processes
    args.baseline_rows = None if args.baseline is None else baseline_rows(args.baseline, args, parser)
    return args


def baseline_rows(path: Path, args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict]:
    """The results of ``--baseline``, refused unless they ran the same global batch."""
    try:
        doc = json.loads(path.read_text())
        setup, rows = doc["setup"], doc["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--baseline {path}: not a grpo_step.py result JSON ({type(e).__name__}: {e})")
    ours = {"completions": args.n, "prompt_tokens": args.prompt, "new_tokens": args.tokens}
    theirs = {k: setup.get(k) for k in ours}
    if theirs != ours:
        parser.error(f"--baseline {path}: ran {theirs}, not this run's global batch {ours}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.floors:
        print_floors(args)
        return {}
    # This process's GPU (LOCAL_RANK under accelerate launch): the model is built there before the trainer
    # (whose accelerator would otherwise find every rank's model on cuda:0).
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    writer = int(os.environ.get("RANK", "0")) == 0  # the process that prints and writes the JSON
    if device.type == "cpu" and not args.tiny:
        sys.exit("benchmarks/grpo_step.py: the 7B/32B run needs a CUDA device (use --tiny on CPU, --floors for floors)")
    dense = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: fp32 (bf16 is emulated there)
    env = environment(device)
    partial_path = args.out.with_name(args.out.stem + ".partial.json")
    rows: list[dict] = []
    configs = [(s, b == "nvfp4") for s in args.shapes for b in args.bases if f"{s}:{b}" not in args.skip]
    for i, (shape, nvfp4) in enumerate(configs):
        row = run_config(shape, nvfp4, args, device, dense)
        rows.append(row)
        if writer:
            print(
                f"{shape} {row['base']}: {row['status']}, step {row.get('step_s')} s, phases {row.get('phases_s')}, "
                f"peak {row.get('peak_gb_step')} GB {row.get('peak_gb')}",
                flush=True,
            )
            write_json(partial_path, document(rows, args, env, argv, f"{i + 1} of {len(configs)} configurations done"))
    doc = document(rows, args, env, argv, None)
    if writer:
        write_json(args.out, doc)
        partial_path.unlink(missing_ok=True)  # the final JSON supersedes it
        print(json.dumps(doc["summary"], indent=2))
    if any(r["status"] == "error" for r in rows):
        sys.exit("benchmarks/grpo_step.py: a configuration failed (status 'error' in the JSON)")
    return doc


if __name__ == "__main__":
    main()
