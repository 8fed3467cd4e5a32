"""One full GRPO step of qerl, NVFP4 vs bf16 base, on random weights in the real Qwen2.5-7B / 32B shapes.

What it measures, per configuration (shape x base weights), in one process on one GPU:

* the step QeRLTrainer runs: 8 completions of one 256-token prompt, each forced to 2048 new tokens
  (no early stop), LoRA r16 on all 7 projections plus trainable input/post-attention norms (``ln``),
  AQN on (stage 1 of 10), bnpo loss, token-truncated IS correction, gradient checkpointing, AdamW on the
  trainable parameters, grad clip 0.2, bf16 autocast on CUDA (accelerate's, as in ``trainer.train()``);
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
                log-probs the IS correction needs, through trl's chunked fused LM head (it never
                builds the ``[B, T, V]`` fp32 logits; the row records that tensor's size beside the
                phase's peak);
  ``fwd_bwd``   the loss forward + backward (trl's ``compute_loss`` under gradient checkpointing),
                summed over the micro-steps;
  ``optimizer`` grad clipping, ``optimizer.step()``, scheduler step, ``zero_grad``;
  ``other``     the rest of the step on the host/device (tokenising, decoding, rewards, padding,
                advantages). The phases are contiguous, so the step's peak is the largest phase peak.

How the phases are driven (no ``trainer.train()``): a real QeRLTrainer is built (real QeRLConfig,
trl's peft wrapping with ``qerl.lora.lora_config(16, train_norms=True)``, trl's fused LM head), then
prepared as ``Trainer.train`` prepares it (``gradient_checkpointing_enable``, then transformers'
``_prepare_for_training``: the trainer's own AdamW, ``accelerator.prepare`` of model and optimizer,
the cosine schedule), then one step is run the way transformers' inner training loop runs it:
``trainer.training_step(model, generation_batch)`` once per micro-step (GRPO's override: at the first,
rollout + scoring + old log-probs of all 8 completions in ``_prepare_inputs``; at each, the loss +
backward of its slice), then clip / step / schedule / zero_grad / global_step. Only those ~10 lines
of the loop are reproduced here (``Trainer.train`` fuses the step into its epoch loop, where the
phases cannot be split). The phase split comes from instance-level wrappers around the trainer's own
methods (and accelerate's ``backward``, to count the passes); nothing in trl/transformers is patched.
Each row records the passes' sizes (``micro_batch_rows``), the rollouts per step (1), the AdamW step
count after warm-up + timed steps (1 + ``--steps``) and whether a LoRA weight moved before the optimizer phase (never).

A tokenizer is built in memory (word-level, one word per model token id, so decoding for the reward
works on random ids) whose EOS id lies *outside* the model's vocabulary: the sampler can never emit
it, which forces every completion to the full length while the trainer still passes a real stop id.
Truncated completions are kept in the loss (``mask_truncated_completions=False``): masking them, the
recipe default, would drop every forced-length completion and skip the work being measured.

Before the timed step, each configuration runs an untimed warm-up: 8-token rollouts whose long
prompts land in every KV-length bucket (captures every decode graph the timed rollout replays, as
benchmarks/rollout.py does) and one short full step (compiles the training kernels and allocates the
optimizer state, as any step after the first finds them). Its time is recorded as ``warmup_s``.
A configuration that runs out of memory is recorded as ``status: "oom"`` with the phase it was in.
After each configuration the whole document so far is written to ``<out>.partial.json``.

Floors (per row, and ``--floors`` prints them without a device): rollout = (new tokens - 1) x bytes
a decode step must read (weights + bf16 LoRA copies + mean KV) / 4.24 TB/s copy bandwidth (measured
in benchmarks/results/rollout_lora_b1*.json); training passes = matmul + attention flops / 790 TFLOP/s
(plus, for NVFP4, the bytes of dequantizing every weight once per pass); optimizer = 40 B per fp32
trainable parameter / 4.24 TB/s. See benchmarks/NOTES.md "GRPO step".

    python benchmarks/grpo_step.py --out $OUT/grpo_step.json        # the H200 run (~5-7 min, predicted)
    python benchmarks/grpo_step.py --tiny --out /tmp/grpo_tiny.json  # 2-layer Llama, 16 tokens, CPU ok
    python benchmarks/grpo_step.py --floors                          # analytic floors only
    python benchmarks/grpo_step.py --shapes 7b --profile --out $OUT/grpo_step_profile.json
        # the timed fwd_bwd under torch.profiler: device-busy share, top kernels, host cost of the qerl ops
    python benchmarks/grpo_step.py --shapes 72b --bases nvfp4 --steps 1 --out $OUT/grpo_step_72b.json
        # Qwen2.5-72B shape, NVFP4 only (the estimate, --floors: ~65 GB peak; target <= 80 GB)
    python benchmarks/grpo_step.py --shapes 7b --bases nvfp4 --out $OUT/g1.json && \
    accelerate launch --config_file training/accelerate/ddp.yaml --num_processes 2 benchmarks/grpo_step.py \
        --shapes 7b --bases nvfp4 --out $OUT/g2.json --baseline $OUT/g1.json
        # data parallel: the same global batch (8 completions) split 4 + 4 over 2 GPUs, each rank with its own
        # engine and micro-batches, gradients all-reduced in the last micro-step; rank 0 writes the JSON, whose
        # summary has ddp_throughput_ratio_7b_nvfp4 = 1-GPU step time / 2-GPU step time (target >= 1.8)

Peak memory is ``torch.cuda.max_memory_allocated`` per phase (``peak_gb``) and the allocator's reserved peak
over the step (``peak_reserved_gb_step``, what a card must hold); ``memory_estimate_gb`` is the analytic
estimate of benchmarks/grpo_floors.py beside it. Under data parallelism the row is rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _load_sibling(name: str) -> Any:
    """benchmarks/NAME.py, loaded by path. This folder leaves sys.path (its kernels.py would shadow the
    ``kernels`` package that transformers probes at import); the repo root joins it, so ``qerl``
    imports without installation, as in the other benchmarks."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(here.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (here, here.parent)]
    spec = importlib.util.spec_from_file_location(f"qerl_bench_{name}", here / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_rollout = _load_sibling("rollout")  # the Qwen2.5 7B/32B shapes and the random model builder
_floors = _load_sibling("grpo_floors")  # shape counts, time floors, the memory estimate
SHAPES: dict[str, dict[str, int]] = {**_rollout.SHAPES, "72b": _floors.QWEN2_5_72B}
VOCAB: int = _rollout.VOCAB
COPY_BW, MATMUL_FLOPS = _floors.COPY_BW, _floors.MATMUL_FLOPS
shape_counts, floors, memory_estimate = _floors.shape_counts, _floors.floors, _floors.memory_estimate

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY_VOCAB = 256
PHASES = ("rollout", "logprobs", "fwd_bwd", "optimizer", "other")
#: peak_gb_72b_nvfp4: fits an 80 GB card; ddp_throughput_*: 2 GPUs vs 1 on the same global batch (--baseline).
TARGETS = {"peak_gb_32b_nvfp4": ("<=", 48.0), "step_speedup_7b": (">=", 1.3), "peak_gb_72b_nvfp4": ("<=", 80.0),
           "ddp_throughput_ratio_7b_nvfp4": (">=", 1.8)}  # fmt: skip
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


# ---------------------------------------------------------------------------------------------- model


def build_model(
    shape: dict[str, int],
    vocab: int,
    nvfp4: bool,
    device: torch.device,
    dtype: torch.dtype,
    arch: str = "qwen2",
    seed: int = 0,
) -> nn.Module:
    """A random Qwen2/Llama causal LM of ``shape`` on ``device``, decoder Linears as ``NVFP4Linear``
    when ``nvfp4``; not peft-wrapped. Built and filled by benchmarks/rollout.py's ``random_causal_lm``
    (same weights as the rollout benchmark), with no EOS or pad id in the config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(
        vocab_size=vocab,
        max_position_embeddings=4096,
        rope_theta=1e6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **shape,
    )
    model = _rollout.random_causal_lm(model_cls, cfg, nvfp4, device, dtype, seed)
    model.generation_config.eos_token_id = None  # the only stop id is the tokenizer's (never sampled)
    return model


def build_tokenizer(vocab: int) -> Any:
    """Word-level tokenizer over words ``t0 .. t{vocab-1}`` (= model ids), pad ``t0``, EOS = id ``vocab``:
    outside the model's vocabulary, so no rollout can stop early (forced length)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    words["<eos>"] = vocab
    tok = Tokenizer(WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="t0")


def spread_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Cheap reward with spread across a group (decoded lengths of random ids differ), so the
    advantages, hence the gradients, are non-zero."""
    return [float(len(c) % 7) for c in completions]


def make_trainer(
    model: nn.Module, tokenizer: Any, prompt: dict[str, str], args: argparse.Namespace, out_dir: str
) -> Any:
    """A QeRLTrainer as ``qerl.train`` builds one, with the benchmark's batch and lengths (trl insists
    on a train_dataset: the one prompt; the step is driven without its dataloader)."""
    from datasets import Dataset

    from qerl.lora import lora_config
    from qerl.trainer import QeRLConfig, QeRLTrainer

    accumulation = args.local_n // args.micro_batch  # per process: its share of the group, in micro-batches
    config = QeRLConfig(
        output_dir=out_dir, per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=args.n,
        max_completion_length=args.tokens, max_steps=10, num_stages=10, save_strategy="no", report_to=[],
        logging_steps=1, disable_tqdm=True, seed=0, gradient_checkpointing=True, mask_truncated_completions=False,
    )  # fmt: skip
    peft = lora_config(r=args.lora_r, train_norms=True)
    trainer = QeRLTrainer(
        model,
        [spread_reward],
        config,
        train_dataset=Dataset.from_list([prompt]),
        processing_class=tokenizer,
        peft_config=peft,
    )
    # What Trainer.train does before its loop (transformers 5.17, `_inner_training_loop`): gradient
    # checkpointing, then `_prepare_for_training`: AdamW, `accelerator.prepare(model, optimizer)` (with
    # bf16 on CUDA this wraps the forward in bf16 autocast, as in every real run) and the cosine schedule.
    gc_kwargs = dict(config.gradient_checkpointing_kwargs or {})
    every_n_layers, offload = gc_kwargs.pop("every_n_layers", 1), gc_kwargs.pop("offload", False)
    trainer.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=gc_kwargs or None, every_n_layers=every_n_layers, offload=offload
    )
    trainer._prepare_for_training(config.max_steps, trainer.get_train_dataloader(), None)
    # The warm-up runs as step 0 (AQN stage 0: noise-free), the timed steps as steps 1.. (noisy stages).
    trainer.state.max_steps = config.max_steps
    return trainer


# ---------------------------------------------------------------------------------------------- timing


class PhaseClock:
    """Splits a step into contiguous segments and records wall time and peak allocated memory of each.

    ``switch(name)`` synchronizes the device, charges the time and the peak since the previous switch
    to the segment being left, resets the peak counter and enters ``name``. The segments cover the
    step without gaps, so the step's peak is the largest segment peak.
    """

    def __init__(self, device: torch.device, profile: str | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.stage = "build"  # coarse label for error reports: build, warm-up, step
        self.current: str | None = None
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.peak_reserved = 0  # the caching allocator's peak over the span: what a card must really hold
        self._t = 0.0
        self.profile_phase = profile  # this phase of the timed step runs under torch.profiler
        self.profile: dict[str, Any] | None = None  # profile_table() of it, once taken
        self._profiler: Any = None

    def switch(self, name: str | None) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.current is not None:
            self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self._t
            if self.cuda:
                self.peak[self.current] = max(self.peak.get(self.current, 0), torch.cuda.max_memory_allocated())
                self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved())
        if self._profiler is not None and name != self.current:
            self._profiler.__exit__(None, None, None)  # the device is synchronized: every kernel is in
            self.profile = profile_table(self._profiler, self.seconds[self.current])
            self._profiler = None
        elif (
            name is not None  # switch(None) ends a span; without --profile, profile_phase is None too
            and self.stage == "step"
            and name == self.profile_phase
            and name != self.current
            and self.profile is None
        ):
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        # Profiler start/stop and its table are charged to no phase.
        self.current, self._t = name, time.perf_counter()

    @contextmanager
    def run(self) -> Iterator[PhaseClock]:
        """One measured span: starts in ``other``, clears earlier segments."""
        self.seconds, self.peak, self.current, self.peak_reserved = {}, {}, None, 0
        self.switch("other")
        try:
            yield self
        finally:
            self.switch(None)


class Probe:
    """Instance-level wrappers on the trainer's own methods that mark the phase boundaries."""

    def __init__(self, trainer: Any, clock: PhaseClock) -> None:
        self.completion_lengths: list[int] = []
        self.decode_steps: float | None = None
        self.rollouts = 0  # calls of the engine per step
        self.micro_rows: list[int] = []  # completions in each backward pass of the step
        self.weights_moved_in_accumulation = False  # a LoRA weight changed before the optimizer step
        generate = trainer._generate_single_turn
        logps = trainer._get_per_token_logps_and_entropies
        prepare = trainer._prepare_inputs
        backward = trainer.accelerator.backward
        self.watched = next(p for n, p in trainer.model.named_parameters() if "lora_B" in n)
        self.start_value = self.watched.detach().clone()

        def rollout(*a: Any, **k: Any) -> Any:
            clock.switch("rollout")
            try:
                ids, lps = generate(*a, **k)
            finally:
                clock.switch("other")
            self.rollouts += 1
            self.completion_lengths = [len(c) for c in ids]
            self.decode_steps = trainer.rollout_engine().last_stats.get("decode_steps")
            return ids, lps

        def old_logprobs(*a: Any, **k: Any) -> Any:
            if torch.is_grad_enabled():  # the loss's own forward: part of fwd_bwd
                return logps(*a, **k)
            clock.switch("logprobs")
            try:
                return logps(*a, **k)
            finally:
                clock.switch("other")

        def prepared(*a: Any, **k: Any) -> Any:
            out = prepare(*a, **k)
            clock.switch("fwd_bwd")
            self.micro_rows.append(int(out["completion_ids"].shape[0]))
            return out

        def backward_pass(loss: torch.Tensor, **k: Any) -> None:
            backward(loss, **k)
            # Gradients accumulate; the weights may only move in the optimizer phase (a tiny compare).
            self.weights_moved_in_accumulation |= not torch.equal(self.start_value, self.watched.detach())

        trainer._generate_single_turn = rollout
        trainer._get_per_token_logps_and_entropies = old_logprobs
        trainer._prepare_inputs = prepared
        trainer.accelerator.backward = backward_pass

    def start_step(self) -> None:
        """Forget the previous step's counts; the watched LoRA weight's value becomes the reference."""
        self.rollouts, self.micro_rows, self.weights_moved_in_accumulation = 0, [], False
        self.start_value = self.watched.detach().clone()


def grpo_step(trainer: Any, prompts: list[dict[str, str]], clock: PhaseClock) -> tuple[float, float]:
    """One optimizer step as transformers' inner loop runs it with gradient accumulation: the loop hands
    ``training_step`` the generation batch (trl's sampler repeats it ``steps_per_generation`` times) once
    per micro-step; GRPO's ``_prepare_inputs`` generates, scores and computes the old log-probs of all n
    completions at the first (``trainer._step % steps_per_generation == 0``), buffers them split into
    micro-batches and returns the next slice at each later one; each micro-step's loss is divided by
    ``current_gradient_accumulation_steps`` inside trl's loss and its backward adds into the gradients.
    Then clip, optimizer and scheduler step, zero_grad, once. Returns (loss summed over the micro-steps,
    as the loop's ``tr_loss`` sums them; pre-clip grad norm)."""
    model = trainer.model_wrapped
    accumulation = trainer.args.gradient_accumulation_steps
    trainer.current_gradient_accumulation_steps = accumulation  # set per optimizer step by the loop
    losses = []
    for i in range(accumulation):
        # The loop's prefetch sets this by hand: gradients "sync" (and trl logs per-step metrics) on the last.
        last = i == accumulation - 1
        trainer.accelerator.gradient_state._set_sync_gradients(last)
        # As the loop: under DDP the gradients are all-reduced in the last micro-step's backward only.
        with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model):
            losses.append(trainer.training_step(model, prompts, None))
    clock.switch("optimizer")
    grad_norm = trainer._clip_grad_norm(model)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    trainer.state.global_step += 1
    return float(torch.stack(losses).sum()), float(grad_norm)


def profile_table(prof: Any, wall_s: float, top: int = 12) -> dict[str, Any]:
    """The profiled phase in a few lines: device-busy time against its wall time (a busy share far
    below 1 means the GPU waited on the host), the top kernels by device time, and the top host ops
    by self CPU time (where a per-call host cost of the qerl ops would show). Also printed."""
    from torch.autograd import DeviceType

    events = list(prof.key_averages())
    kernels = sorted((e for e in events if e.device_type != DeviceType.CPU and e.self_device_time_total > 0),
                     key=lambda e: e.self_device_time_total, reverse=True)  # fmt: skip
    busy_us = sum(e.self_device_time_total for e in kernels)
    host = sorted(
        (e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total, reverse=True
    )

    def row(e: Any, us: float) -> dict[str, Any]:
        return {"name": e.key[:90], "calls": e.count, "ms": round(us / 1e3, 2), "share": sig(us / max(busy_us, 1), 3)}

    qerl_ops = {e.key: {"calls": e.count, "cpu_ms_total": round(e.cpu_time_total / 1e3, 2),
                        "device_ms_total": round(e.device_time_total / 1e3, 2)}
                for e in events if e.key.startswith("qerl::") or "qerl_nvfp4" in e.key}  # fmt: skip
    table = {
        "wall_s": sig(wall_s),
        "device_busy_s": sig(busy_us / 1e6),
        "device_busy_share": sig(busy_us / 1e6 / wall_s, 3) if wall_s > 0 else None,
        "kernels": [row(e, e.self_device_time_total) for e in kernels[:top]],
        "host_ops": [
            {"name": e.key[:90], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in host[:top]
        ],
        "qerl_ops": qerl_ops,
    }
    print(f"profile: wall {table['wall_s']} s, device busy {table['device_busy_s']} s ({table['device_busy_share']})")
    for k in table["kernels"]:
        print(f"  {k['ms']:10.2f} ms {k['share']:6.3f} {k['calls']:7d}x  {k['name']}")
    for name, v in qerl_ops.items():
        print(f"  {name}: {v}")
    return table


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def capture_decode_graphs(trainer: Any, args: argparse.Namespace, gen: torch.Generator, vocab: int) -> None:
    """Capture every (batch, KV-length) decode graph the timed rollout replays: 8-token rollouts
    through the trainer whose long prompts land in each KV bucket, largest first (sizes the cache once)."""
    kv_block = trainer.rollout_engine().kv_block
    saved = trainer.max_completion_length
    trainer.max_completion_length = 8
    try:
        for end in range(round_up(args.prompt + args.tokens, kv_block), args.prompt, -kv_block):
            ids = torch.randint(1, vocab, (end - 9,), generator=gen).tolist()
            trainer._generate_single_turn([ids] * args.local_n, None, None, args.n)
    finally:
        trainer.max_completion_length = saved


def gb(n: float | None) -> float | None:
    return None if n is None else round(n / 1e9, 3)


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (tiny-mode floors are microseconds)."""
    return float(f"{x:.{digits}g}")


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
    probe = Probe(trainer, clock)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    row["trainable_params"] = sum(p.numel() for p in trainable)
    row["trainable_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in trainable})
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    row["optimizer"] = f"{type(optimizer).__name__} ({getattr(trainer.args.optim, 'value', trainer.args.optim)})"
    row["gradient_checkpointing"] = bool(trainer.model.is_gradient_checkpointing)
    row["mixed_precision"] = trainer.accelerator.mixed_precision  # "bf16": the forward runs under bf16 autocast

    clock.stage = "warm-up"
    t0 = time.perf_counter()
    capture_decode_graphs(trainer, args, gen, vocab)
    row["capture_s"] = round(time.perf_counter() - t0, 2)  # includes the first Triton compiles
    trainer.max_completion_length = min(32, args.tokens)
    with clock.run():
        grpo_step(trainer, prompts, clock)
    trainer.max_completion_length = args.tokens
    row["warmup_step_phases_s"] = {p: sig(clock.seconds.get(p, 0.0)) for p in PHASES}
    row["warmup_s"] = round(time.perf_counter() - t0, 2)

    clock.stage = "step"
    # ``--steps`` timed steps; the row reports the last one (steady state) and lists every step's time
    # and phases, so that a one-time cost of the first full-length step (the warm-up step is short) is
    # seen, not averaged in. ``--profile`` profiles the first timed step, which is then not the one reported
    # unless it is the only one.
    row["timed_steps"] = []
    for _ in range(args.steps):
        probe.start_step()
        if cuda:
            row["allocated_at_step_start_gb"] = gb(torch.cuda.memory_allocated())
        row["aqn_sigma"] = trainer.current_sigma()
        with clock.run():
            loss, grad_norm = grpo_step(trainer, prompts, clock)
        row["phases_s"] = {p: sig(clock.seconds.get(p, 0.0)) for p in PHASES}
        row["step_s"] = sig(sum(clock.seconds.values()))
        row["timed_steps"].append({"step_s": row["step_s"], "phases_s": row["phases_s"]})
    if clock.profile_phase is not None:  # its phase time includes the profiler's own overhead
        row["profile"] = {"phase": clock.profile_phase, "timed_step": 1, **(clock.profile or {})}
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
    row["decode_steps"] = probe.decode_steps
    row["rollout_ms_per_token"] = round(row["phases_s"]["rollout"] / max(1, args.tokens - 1) * 1e3, 3)
    measured = {**row["phases_s"], "step": row["step_s"]}
    row["of_floor"] = {
        p: sig(row["floors"][f"{p}_s"] / measured[p])
        for p in ("rollout", "logprobs", "fwd_bwd", "optimizer", "step")
        if measured[p] > 0
    }


def resolve_shape(name: str) -> tuple[dict[str, int], int, str]:
    """(shape, vocabulary, architecture) of ``7b`` / ``32b`` (Qwen2.5) or ``tiny`` (2-layer Llama)."""
    return (TINY, TINY_VOCAB, "llama") if name == "tiny" else (SHAPES[name], VOCAB, "qwen2")


def run_config(
    shape_name: str, nvfp4: bool, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict:
    """Build, warm up and time one configuration; OOM is caught and recorded as a result."""
    shape, vocab, arch = resolve_shape(shape_name)
    base = "nvfp4" if nvfp4 else ("bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."))
    counts = shape_counts(shape, vocab, args.lora_r)
    sizes = (args.local_n, args.prompt, args.tokens, args.lora_r, args.micro_batch)  # this process's share
    row: dict[str, Any] = {
        "shape": shape_name, "base": base, "n": args.n, "processes": args.processes, "n_per_process": args.local_n,
        "micro_batch": args.micro_batch, "gradient_accumulation_steps": args.local_n // args.micro_batch,
        "prompt_tokens": args.prompt, "new_tokens": args.tokens, "lora_r": args.lora_r, "status": "ok",
        "floors": {k: sig(v) for k, v in floors(shape, vocab, nvfp4, *sizes).items()},
        "memory_estimate_gb": {k.removesuffix("_gb"): sig(v) for k, v in memory_estimate(shape, vocab, nvfp4, *sizes).items()},
        "full_logits_fp32_gb": gb(args.local_n * args.tokens * vocab * 4),
    }  # fmt: skip
    clock = PhaseClock(device, "fwd_bwd" if args.profile else None)
    gen = torch.Generator().manual_seed(0)
    trainer = None
    t0 = time.perf_counter()
    if clock.cuda:
        row["allocated_before_build_gb"] = gb(torch.cuda.memory_allocated())
    try:
        with tempfile.TemporaryDirectory(prefix="qerl-grpo-step-") as out_dir:
            prompt = " ".join(f"t{i}" for i in torch.randint(1, vocab, (args.prompt,), generator=gen).tolist())
            prompts = [{"prompt": prompt}] * args.local_n  # trl's RepeatSampler: n copies of one prompt, split over ranks
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
    return row


# ---------------------------------------------------------------------------------------------- report


def summarize(rows: list[dict], baseline: list[dict] | None = None) -> dict[str, Any]:
    """Peaks and NVFP4-vs-dense step speedups per shape (the issues' keys are always present); with
    ``baseline`` (the rows of a 1-process run of the same global batch), each configuration's
    data-parallel throughput ratio: baseline step time / this step time."""
    ok = {(r["shape"], r["base"]): r for r in rows if r["status"] == "ok"}
    summary: dict[str, Any] = {"peak_gb_32b_nvfp4": None, "peak_gb_7b_nvfp4": None, "step_speedup_7b": None,
                               "peak_gb_72b_nvfp4": None}  # fmt: skip
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
    import peft
    import transformers
    import trl

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                "peft": peft.__version__, "python": sys.version.split()[0]}  # fmt: skip
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    )
    return {"device": name, "versions": versions}


def document(rows: list[dict], args: argparse.Namespace, env: dict, argv: list[str], partial: str | None) -> dict:
    doc = {
        "benchmark": "one GRPO step (QeRLTrainer): rollout / old log-probs / fwd+bwd / optimizer, time and peak memory",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **env,
        "command": " ".join([Path(sys.executable).name, "benchmarks/grpo_step.py", *argv]),
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
            "gradient_checkpointing": True,
            "warm-up": "decode graphs of every KV bucket + one short (<= 32-token) step, untimed",
            "floor_constants": {"copy_bw_tb_s": COPY_BW / 1e12, "matmul_tflop_s": MATMUL_FLOPS / 1e12},
        },  # fmt: skip
        "summary": summarize(rows, args.baseline_rows),
        "results": rows,
    }
    if partial is not None:
        doc["partial"] = partial
    return doc


def write_json(path: Path, doc: dict) -> None:
    from qerl.fsutil import atomic_write_text

    atomic_write_text(path, json.dumps(doc, indent=2))


def print_floors(args: argparse.Namespace) -> None:
    for shape in args.shapes:
        for base in args.bases:
            dims, vocab, _ = resolve_shape(shape)
            sizes = (args.local_n, args.prompt, args.tokens, args.lora_r, args.micro_batch)
            f = floors(dims, vocab, base == "nvfp4", *sizes)
            print(f"{shape} {base:5s}: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()))
            m = memory_estimate(dims, vocab, base == "nvfp4", *sizes)
            print(f"{shape} {base:5s} memory (GB): " + ", ".join(f"{k.removesuffix('_gb')} {v:.3g}" for k, v in m.items()))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/grpo_step.json"))
    parser.add_argument("--shapes", nargs="+", default=["7b", "32b"], choices=list(SHAPES))
    parser.add_argument("--bases", nargs="+", default=["nvfp4", "bf16"], choices=["nvfp4", "bf16"])
    parser.add_argument("--skip", nargs="+", default=[], metavar="SHAPE:BASE", help="configurations to leave out (e.g. 32b:bf16)")
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
        "--steps",
        type=int,
        default=2,
        help="timed steps after the warm-up; the last one is reported (steady state), all are listed",
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
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
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
            print(f"{shape} {row['base']}: {row['status']}, step {row.get('step_s')} s, phases {row.get('phases_s')}, "
                  f"peak {row.get('peak_gb_step')} GB {row.get('peak_gb')}", flush=True)  # fmt: skip
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
