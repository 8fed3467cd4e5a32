"""A whole GRPO step, end to end, beside the pipeline users run today: trl's GRPOTrainer with vLLM colocated.

The question it answers is the user's: "is my RL step faster with qerl than with what I run now?". Four arms,
each in a process of its own, on the same checkpoint shapes, prompts, lengths, LoRA and loss:

============================  =========================================================================
arm                           what runs
============================  =========================================================================
``trl_vllm_bf16``             stock trl ``GRPOTrainer`` (``use_vllm=True, vllm_mode="colocate"``), bf16 base
                              + peft LoRA; every step trl merges the adapter, pushes every weight into vLLM
                              and unmerges (its only sync path); trl's defaults otherwise
``qerl_vllm_nvfp4``           ``QeRLTrainer`` with ``rollout_engine="vllm"`` on the NVFP4 checkpoint: vLLM's
                              Marlin NVFP4 kernels, the adapter pushed per step (the QeRL reference's route)
``qerl_native_nvfp4``         ``QeRLTrainer``, the native engine over the packed weights (QeRL as shipped)
``qerl_native_bf16``          ``QeRLTrainer``, the native engine on the bf16 checkpoint
============================  =========================================================================

The work (the same in every arm): Qwen2.5-7B shapes with random weights saved as real checkpoints (bf16, and
NVFP4 from our quantize code), a 256-token prompt, every completion forced to 2048 tokens (the tokenizer's EOS id
lies outside the model's vocabulary, so no engine can sample it; trl's vLLM also gets ``ignore_eos``), LoRA r16 on
the seven projections, the DAPO loss, one optimizer step per generation (``steps_per_generation`` =
``gradient_accumulation_steps``), trl's micro-batch of 8, a reward that hashes the completion ids (non-zero
advantages without reading text). Two batch shapes: ``b8`` (1 prompt x 8 completions, the paper's Table 3) and
``b128`` (16 prompts x 8).

Each arm runs ``trainer.train()`` for ``--warmup`` + ``--steps`` optimizer steps; the timed steps are split, by
instance-level wrappers around the trainer's own methods (nothing in trl, transformers or vLLM is patched), into
``rollout`` (prefill + decode), ``sync`` (weights or adapter into the engine), ``logprobs`` (the no-grad passes:
trl's old log-probs for the IS ratio, which qerl's trainer takes from the loss forward instead: 0 there),
``fwd_bwd`` (loss forward + backward over the micro-batches), ``optimizer`` (clip, step, schedule) and ``other``.
Beside each phase: its floor from benchmarks/grpo_floors.py, rescaled to the copy bandwidth and bf16 matmul rate
measured in the same process. The training pass's floor counts the activation recompute the arm ran (each row's
``recompute``: trl's arm recomputes in every pass, its default; qerl's arms as ``--gradient-checkpointing`` says,
default auto, ``qerl.train.recompute``), and ``fwd_bwd_no_recompute`` is the floor of the same passes without any;
a pass run in row chunks (``qerl.train.chunked_pass``, each row's ``chunking``) recomputes nothing, so its floor is the
latter.

    python -m benchmarks.e2e prepare --dir .e2e                     # the two checkpoints (once per machine)
    python -m benchmarks.e2e run --dir .e2e --arms trl_vllm_bf16 --batches b8 b128 --out $OUT/e2e.json
    python -m benchmarks.e2e report --rows $OUT/rows/*.json --out benchmarks/results/e2e.json
    python -m benchmarks.e2e run --tiny --dir /tmp/e2e --arms qerl_native_nvfp4 qerl_native_bf16 --out /tmp/e2e.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    SHAPES,
    VOCAB,
    command,
    device_name,
    random_model,
    run_stoppable,
    utc_now,
    write_json,
)
from benchmarks.common import versions as package_versions
from benchmarks.grpo_floors import COPY_BW, MATMUL_FLOPS, floors, shape_counts
from benchmarks.grpo_harness import (
    PASS_CHUNK_HELP,
    RECOMPUTE_FLAGS,
    PhaseClock,
    Probe,
    build_tokenizer,
    chunking_ran,
    gb,
    load_benchmark_tokenizer,
    recompute_ran,
    sig,
)


@dataclass(frozen=True)
class Arm:
    base: str  # "bf16" | "nvfp4": which checkpoint
    trainer: str  # "trl" | "qerl"
    engine: str  # "vllm" | "native"


ARMS = {
    "trl_vllm_bf16": Arm("bf16", "trl", "vllm"),
    "qerl_vllm_nvfp4": Arm("nvfp4", "qerl", "vllm"),
    "qerl_native_nvfp4": Arm("nvfp4", "qerl", "native"),
    "qerl_native_bf16": Arm("bf16", "qerl", "native"),
}
#: (prompts, completions per prompt) of each batch shape.
BATCHES = {"b8": (1, 8), "b128": (16, 8)}
PHASES = ("rollout", "sync", "logprobs", "fwd_bwd", "optimizer", "other")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY_VOCAB = 256
#: summary key -> (numerator arm, denominator arm, batch, target): step-time ratios (> 1: the denominator is faster).
TARGETS = {
    "step_speedup_vs_trl_vllm_bf16_b8": ("trl_vllm_bf16", "qerl_native_nvfp4", "b8", 1.8),
    "step_speedup_vs_trl_vllm_bf16_b128": ("trl_vllm_bf16", "qerl_native_nvfp4", "b128", 1.5),
    "step_speedup_vs_vllm_rollout_nvfp4_b128": ("qerl_vllm_nvfp4", "qerl_native_nvfp4", "b128", 1.3),
}


# ---------------------------------------------------------------------------------------------- checkpoints


def model_shape(tiny: bool) -> tuple[dict[str, int], int]:
    """(decoder shape, vocabulary): Qwen2.5-7B's, or a 2-layer Qwen2 for CPU smoke runs (the same ``model_type``, so
    the smoke run meets what transformers does per type, e.g. its choice of tokenizer class)."""
    return (TINY, TINY_VOCAB) if tiny else (SHAPES["7b"], VOCAB)


def prepare(root: Path, tiny: bool) -> dict[str, Path]:
    """``root/bf16`` (random weights, saved as a real checkpoint with the forced-length tokenizer) and ``root/nvfp4``
    (quantized from it by ``qerl.quantize.pipeline``, as the quantize CLI does); each kept if already complete."""
    from qerl.fsutil import atomic_directory
    from qerl.quantize.pipeline import quantize_checkpoint

    shape, vocab = model_shape(tiny)
    dirs = {"bf16": root / "bf16", "nvfp4": root / "nvfp4"}
    if not (dirs["bf16"] / "config.json").exists():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # The only stop id is the tokenizer's EOS, outside the vocabulary (build_tokenizer): forced length.
        model = random_model(
            shape, vocab, False, device, torch.bfloat16, "qwen2", bos_token_id=None, eos_token_id=None, pad_token_id=0
        )
        with atomic_directory(dirs["bf16"]) as tmp:  # complete or absent
            model.save_pretrained(tmp)
            build_tokenizer(vocab).save_pretrained(tmp)
        del model
    if not (dirs["nvfp4"] / "config.json").exists():
        quantize_checkpoint(dirs["bf16"], dirs["nvfp4"])
    return dirs


# ---------------------------------------------------------------------------------------------- one arm


def hash_reward(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A reward in {0, 1/7, .., 1} from a hash of each completion's token ids: a spread inside every group (so
    non-zero advantages and gradients) that costs nothing and reads no text."""
    return [(zlib.crc32(bytes(str(ids), "ascii")) % 8) / 7 for ids in completion_ids]


def prompt_rows(prompts: int, length: int, vocab: int) -> list[dict[str, str]]:
    """``prompts`` plain-text prompts of exactly ``length`` tokens for the word-level tokenizer (no chat template)."""
    gen = torch.Generator().manual_seed(0)
    return [
        {"prompt": " ".join(f"t{i}" for i in torch.randint(1, vocab, (length,), generator=gen).tolist())}
        for _ in range(prompts)
    ]


class StepClock(PhaseClock):
    """PhaseClock that only counts while a timed step runs (``begin`` .. ``end``) and also tracks the device's
    used memory (``mem_get_info``: what vLLM's pre-allocated pool and the trainer hold together)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.active = False
        self.device_used_max = 0

    def switch(self, name: str | None) -> None:
        if not self.active:
            return
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            self.device_used_max = max(self.device_used_max, total - free)
        super().switch(name)

    def begin(self) -> None:
        self.seconds, self.peak, self.current, self.peak_reserved, self.device_used_max = {}, {}, None, 0, 0
        self.active = True
        self.switch("other")

    def end(self) -> dict[str, Any]:
        self.switch(None)
        self.active = False
        return {
            "phases_s": {p: sig(self.seconds.get(p, 0.0)) for p in PHASES},
            "step_s": sig(sum(self.seconds.values())),
            "peak_allocated_gb": gb(max(self.peak.values(), default=0)) if self.cuda else None,
            "peak_reserved_gb": gb(self.peak_reserved) if self.cuda else None,
            "device_used_gb": gb(self.device_used_max) if self.cuda else None,
        }


def instrument(trainer: Any, clock: StepClock) -> Probe:
    """``grpo_harness.Probe``'s phase marks on the trainer's own methods (rollout, no-grad log-probs, loss forward +
    backward), plus the two this benchmark adds: the weight or adapter sync inside the rollout, and the optimizer
    phase from gradient clipping on (the step runs under ``trainer.train()`` here, not ``grpo_harness.run_step``)."""
    probe = Probe(trainer, clock.switch)

    def around(owner: Any, name: str, phase: str, back: str) -> None:
        inner = getattr(owner, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            clock.switch(phase)
            try:
                return inner(*a, **k)
            finally:
                clock.switch(back)

        setattr(owner, name, wrapped)

    around(trainer, "_clip_grad_norm", "optimizer", "optimizer")
    if getattr(trainer, "vllm_generation", None) is not None:  # trl: merge, push every weight, unmerge
        around(trainer.vllm_generation, "sync_weights", "sync", "rollout")
    elif hasattr(trainer, "rollout_engine") and hasattr(trainer.rollout_engine(), "sync"):  # qerl's vLLM engine
        around(trainer.rollout_engine(), "sync", "sync", "rollout")
    return probe


def step_callback(clock: StepClock, warmup: int, steps: list[dict[str, Any]]) -> Any:
    """A TrainerCallback that times every optimizer step after the first ``warmup``."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step >= warmup:
                clock.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if clock.active:
                steps.append(clock.end())

    return Timer()


def build_trainer(arm: Arm, ckpt: Path, args: argparse.Namespace, out_dir: str) -> Any:
    """The arm's trainer as its user builds it: trl's GRPOTrainer on the checkpoint path, or QeRLTrainer on the
    model qerl's loader returns; the settings of the module docstring, each framework's defaults otherwise."""
    from datasets import Dataset

    prompts, n = BATCHES[args.batch]
    rows = prompt_rows(prompts, args.prompt, model_shape(args.tiny)[1])
    # Every arm gets the checkpoint's tokenizer as saved (AutoTokenizer would swap in Qwen2's own class).
    tokenizer = load_benchmark_tokenizer(ckpt, rows[0]["prompt"], args.prompt)
    rows = Dataset.from_list(rows)
    accumulation = prompts * n // args.micro
    common = dict(
        output_dir=out_dir,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=n,
        max_completion_length=args.tokens,
        loss_type="dapo",
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        mask_truncated_completions=False,
    )
    if arm.trainer == "trl":
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common, use_vllm=True, vllm_mode="colocate", generation_kwargs={"ignore_eos": True})
        peft = LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_r, target_modules=list(PROJECTIONS), task_type="CAUSAL_LM"
        )
        return GRPOTrainer(
            str(ckpt), [hash_reward], config, train_dataset=rows, processing_class=tokenizer, peft_config=peft
        )
    from qerl.load.loader import load_model
    from qerl.load.lora import lora_config
    from qerl.train.trainer import QeRLConfig, QeRLTrainer

    engine_kwargs = {"checkpoint": str(ckpt)} if arm.engine == "vllm" else None
    config = QeRLConfig(
        **common,
        rollout_engine=arm.engine,
        rollout_engine_kwargs=engine_kwargs,
        gradient_checkpointing=RECOMPUTE_FLAGS[args.gradient_checkpointing],
        pass_chunk_rows=args.pass_chunk_rows,
    )
    model = load_model(str(ckpt), device=config.device)
    return QeRLTrainer(
        model,
        [hash_reward],
        config,
        train_dataset=rows,
        processing_class=tokenizer,
        peft_config=lora_config(args.lora_r),
    )


def measured_rates(device: torch.device) -> dict[str, float]:
    """Copy bandwidth and dense bf16 matmul rate of this device, measured now (the floors' denominators)."""
    if device.type != "cuda":
        return {"copy_bw": COPY_BW, "matmul_flops": MATMUL_FLOPS, "measured": False}
    from benchmarks.common import copy_bandwidth, graph_time

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    rate = 2 * 8192**3 / graph_time([lambda: a @ b], target_s=50e-3)
    return {"copy_bw": copy_bandwidth()["max"], "matmul_flops": rate, "measured": True}


def arm_floors(arm: Arm, args: argparse.Namespace, rates: dict[str, float], recompute: float) -> dict[str, float]:
    """grpo_floors' phase floors for this arm's work, at the measured rates; ``sync``: the bytes the sync must move
    at least (trl: every bf16 decoder weight once into vLLM; qerl's vLLM engine: the bf16 LoRA tensors).
    ``fwd_bwd`` counts the recompute the arm's passes ran (``recompute``: the share of passes that recomputed);
    ``fwd_bwd_no_recompute`` is the same passes' floor without any."""
    shape, vocab = model_shape(args.tiny)
    prompts, n = BATCHES[args.batch]
    sizes = (prompts * n, args.prompt, args.tokens, args.lora_r, args.micro)
    f = floors(shape, vocab, arm.base == "nvfp4", *sizes, recompute=recompute)
    bw, flops = COPY_BW / rates["copy_bw"], MATMUL_FLOPS / rates["matmul_flops"]
    # The rollout floor reads the weights once per decode step for the whole batch; prompts share nothing
    # across groups, so the KV term is the batch's. Training floors are flop-bound (plus NVFP4 dequant bytes).
    c = shape_counts(shape, vocab, args.lora_r)
    sync_bytes = {"trl": c["linear_params"] * 2, "qerl": c["lora_params"] * 2 if arm.engine == "vllm" else 0}
    # trl's old-log-prob pass; qerl's trainer takes the IS ratio from the loss forward (qerl.train.is_ratio): no pass.
    logprobs = f["logprobs_s"] * flops if arm.trainer == "trl" else 0.0
    out = {
        "rollout": f["rollout_s"] * bw,
        "logprobs": logprobs,
        "fwd_bwd": f["fwd_bwd_s"] * flops,
        "fwd_bwd_no_recompute": f["fwd_bwd_no_recompute_s"] * flops,
        "optimizer": f["optimizer_s"] * bw,
        "sync": sync_bytes[arm.trainer] / rates["copy_bw"],
    }
    return {k: sig(v) for k, v in out.items()}


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    """Build, train warm-up + timed steps, and describe one (arm, batch) in one process."""
    arm = ARMS[args.arm]
    prompts, n = BATCHES[args.batch]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row: dict[str, Any] = {
        "arm": args.arm,
        "batch": args.batch,
        "prompts": prompts,
        "n": n,
        "sequences": prompts * n,
        "prompt_tokens": args.prompt,
        "new_tokens": args.tokens,
        "lora_r": args.lora_r,
        "micro_batch": args.micro,
        "status": "ok",
        **arm.__dict__,
    }
    rates = measured_rates(device)
    row["rates"] = {
        "copy_bw_tb_s": sig(rates["copy_bw"] / 1e12),
        "matmul_tflop_s": sig(rates["matmul_flops"] / 1e12),
        "measured_same_process": rates["measured"],
    }
    clock, steps = StepClock(device), []
    probe: Probe | None = None
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = build_trainer(arm, Path(args.dir) / arm.base, args, out_dir)
            row["build_s"] = round(time.perf_counter() - t0, 1)
            probe = instrument(trainer, clock)
            trainer.add_callback(step_callback(clock, args.warmup, steps))
            watched = next(p for name, p in trainer.model.named_parameters() if "lora_B" in name)
            before = watched.detach().clone()
            trainer.train()
            row["recompute"] = recompute_ran(trainer)  # over every training pass of the run, warm-up included
            row["chunking"] = chunking_ran(trainer)
            row["lora_updated"] = not torch.equal(before, watched.detach())
            row["train_s"] = round(time.perf_counter() - t0 - row["build_s"], 1)
            logged = [h for h in trainer.state.log_history if "loss" in h]
            row["loss"] = [h["loss"] for h in logged]
            row["optimizer_steps"] = trainer.state.global_step
    except Exception as e:  # recorded, so that a failing arm still leaves its exact error in the results
        row.update(
            status="oom" if isinstance(e, torch.OutOfMemoryError) else "error",
            error=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc()[-4000:],
        )
    # The training pass's floor counts the recompute the arm ran (an arm that failed: what it was asked, auto as full).
    asked = 1.0 if arm.trainer == "trl" else float(args.gradient_checkpointing != "off")
    row["floors_s"] = arm_floors(arm, args, rates, row["recompute"]["share"] if "recompute" in row else asked)
    lengths = probe.completion_lengths if probe is not None else []  # the last rollout's
    row.update(completion_lengths=sorted(set(lengths)), rollout_rows=len(lengths))
    row["forced_length"] = row["completion_lengths"] == [args.tokens]
    row["timed_steps"] = steps
    if steps:
        mean = {p: sig(sum(s["phases_s"][p] for s in steps) / len(steps)) for p in PHASES}
        row["phases_s"], row["step_s"] = mean, sig(sum(s["step_s"] for s in steps) / len(steps))
        row["peak_allocated_gb"] = max((s["peak_allocated_gb"] or 0) for s in steps) if device.type == "cuda" else None
        row["device_used_gb"] = max((s["device_used_gb"] or 0) for s in steps) if device.type == "cuda" else None
        tokens = prompts * n * args.tokens
        row["generated_tokens_per_s"] = {
            "rollout": sig(tokens / mean["rollout"]) if mean["rollout"] else None,
            "step": sig(tokens / row["step_s"]),
        }
        measured = {**mean, "fwd_bwd_no_recompute": mean["fwd_bwd"]}
        row["over_floor"] = {p: sig(measured[p] / f) for p, f in row["floors_s"].items() if f > 0}
    return row


# ---------------------------------------------------------------------------------------------- report


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets' step-time ratios from the rows that ran (``None`` where an arm is missing or failed)."""
    step = {(r["arm"], r["batch"]): r.get("step_s") for r in rows if r.get("status") == "ok"}
    summary: dict[str, Any] = {}
    for key, (slow, fast, batch, target) in TARGETS.items():
        a, b = step.get((slow, batch)), step.get((fast, batch))
        value = sig(a / b) if a and b else None
        summary[key] = value
        summary[f"{key}_target"] = target
        summary[f"{key}_met"] = None if value is None else value >= target
    return summary


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked step-time bars per arm, one panel per batch shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import save_figure

    fig, axes = plt.subplots(1, len(BATCHES), figsize=(6 * len(BATCHES), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], BATCHES, strict=True):
        ok = [r for r in rows if r["batch"] == batch and r.get("status") == "ok" and r.get("phases_s")]
        ok.sort(key=lambda r: list(ARMS).index(r["arm"]))
        bottom = [0.0] * len(ok)
        for phase in PHASES:
            vals = [r["phases_s"][phase] for r in ok]
            ax.bar(range(len(ok)), vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(range(len(ok)), [r["arm"].replace("_", "\n", 1) for r in ok], fontsize=8)
        prompts, n = BATCHES[batch]
        ax.set_title(f"{batch}: {prompts} x {n} completions")
        ax.set_ylabel("seconds per GRPO step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def report(row_files: list[Path], out: Path, argv: list[str]) -> dict[str, Any]:
    """Merge per-arm rows (the newest per (arm, batch)) into ``out`` (+ PNG beside it)."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for f in sorted(row_files, key=lambda p: p.stat().st_mtime):
        r = json.loads(f.read_text())
        latest[(r["arm"], r["batch"])] = r
    rows = sorted(latest.values(), key=lambda r: (list(BATCHES).index(r["batch"]), list(ARMS).index(r["arm"])))
    doc = {
        "date": utc_now(),
        "device": rows[0].get("device") if rows else None,
        "versions": rows[0].get("versions") if rows else None,
        "command": command("benchmarks.e2e", argv),
        "arm_commands": sorted({r["command"] for r in rows}),
        "summary": summarize(rows),
        "results": rows,
    }
    write_json(out, doc)
    if rows:
        plot(rows, out.with_suffix(".png"))
    return doc


# ---------------------------------------------------------------------------------------------- CLI


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "run", "arm"):
        s = sub.add_parser(name)
        s.add_argument("--dir", type=Path, required=True, help="where the checkpoints live (bf16/, nvfp4/)")
        s.add_argument("--tiny", action="store_true", help="a 2-layer Qwen2, short lengths: a CPU smoke run")
        if name == "prepare":
            continue
        s.add_argument("--prompt", type=int, default=None, help="prompt tokens (256; tiny 8)")
        s.add_argument("--tokens", type=int, default=None, help="new tokens per completion (2048; tiny 16)")
        s.add_argument("--lora-r", type=int, default=16)
        s.add_argument("--micro", type=int, default=8, help="completions per training pass (trl's default 8)")
        s.add_argument(
            "--gradient-checkpointing",
            choices=list(RECOMPUTE_FLAGS),
            default="auto",
            help="qerl arms' activation recompute (QeRLConfig's default auto: none while the card's free memory "
            "holds a pass's activations); the trl arm keeps trl's default (on)",
        )
        s.add_argument("--pass-chunk-rows", type=int, default=None, help=f"qerl arms: {PASS_CHUNK_HELP}")
        s.add_argument("--warmup", type=int, default=1)
        s.add_argument("--steps", type=int, default=3)
        if name == "arm":
            s.add_argument("--arm", choices=list(ARMS), required=True)
            s.add_argument("--batch", choices=list(BATCHES), required=True)
            s.add_argument("--row", type=Path, required=True, help="where this arm's row goes")
        else:
            s.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
            s.add_argument("--batches", nargs="+", choices=list(BATCHES), default=list(BATCHES))
            s.add_argument("--out", type=Path, required=True, help="the merged JSON (rows also under OUT's rows/)")
    r = sub.add_parser("report")
    r.add_argument("--rows", type=Path, nargs="+", required=True)
    r.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd in ("run", "arm"):
        args.prompt = args.prompt or (8 if args.tiny else 256)
        args.tokens = args.tokens or (16 if args.tiny else 2048)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.cmd == "prepare":
        print(json.dumps({k: str(v) for k, v in prepare(args.dir, args.tiny).items()}))
        return 0
    if args.cmd == "report":
        print(json.dumps(report(args.rows, args.out, argv)["summary"], indent=1))
        return 0
    if args.cmd == "arm":
        row = run_arm(args)
        row.update(
            date=utc_now(),
            device=device_name(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")),
            versions=package_versions("transformers", "trl", "peft", "accelerate", "vllm", "triton"),
            command=command("benchmarks.e2e", argv),
        )
        write_json(args.row, row)
        return 0 if row["status"] == "ok" else 1
    prepare(args.dir, args.tiny)
    rows_dir = args.out.parent / "rows"
    rows_dir.mkdir(parents=True, exist_ok=True)
    shared = [
        "--dir",
        str(args.dir),
        "--prompt",
        str(args.prompt),
        "--tokens",
        str(args.tokens),
        "--lora-r",
        str(args.lora_r),
        "--micro",
        str(args.micro),
        "--gradient-checkpointing",
        args.gradient_checkpointing,
        *([] if args.pass_chunk_rows is None else ["--pass-chunk-rows", str(args.pass_chunk_rows)]),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    # trl's colocated vLLM joins a process group of one; qerl's arms get the environment as it is.
    group_of_one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    for batch in args.batches:
        for arm in args.arms:
            row = rows_dir / f"{arm}_{batch}.json"
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.e2e",
                "arm",
                *shared,
                *(["--tiny"] if args.tiny else []),
                "--arm",
                arm,
                "--batch",
                batch,
                "--row",
                str(row),
            ]
            env = {**os.environ, **(group_of_one if ARMS[arm].trainer == "trl" else {})}
            code, stopped = run_stoppable(cmd, env=env)
            print(f"{arm} {batch}: exit {code}", flush=True)
            if stopped:
                break
    doc = report(sorted(rows_dir.glob("*.json")), args.out, argv)
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
