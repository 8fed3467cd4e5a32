"""The trainer side of benchmarks/grpo_step.py: a real QeRLTrainer on a random model, one GRPO step
driven as transformers' inner loop drives it, and the instruments that split that step into phases.

How the phases are driven (no ``trainer.train()``): a real QeRLTrainer is built (real QeRLConfig,
trl's peft wrapping with ``qerl.load.lora.lora_config(16, train_norms=True)``, trl's fused LM head), then
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
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import random_model
from qerl.train.recompute import enable_recompute

#: The recipe whose loss and optimizer settings the benchmarked step uses (QeRLConfig's own defaults are trl's).
RECIPE = Path(__file__).resolve().parents[1] / "training" / "recipes" / "qerl_nvfp4.yaml"
#: The recipe keys that decide what one step computes; the benchmark sets its own batch, lengths and logging.
RECIPE_KEYS = (
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "max_grad_norm",
    "lr_scheduler_type",
    "warmup_steps",
    "adam_beta1",
    "adam_beta2",
    "weight_decay",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
)

#: ``--gradient-checkpointing`` of the benchmarks -> ``QeRLConfig.gradient_checkpointing`` (unset: auto on CUDA, on
#: without CUDA).
RECOMPUTE_FLAGS = {"auto": None, "on": True, "off": False}
#: The benchmarks' ``--pass-chunk-rows`` (``QeRLConfig.pass_chunk_rows``).
PASS_CHUNK_HELP = (
    "rows per forward + backward inside a training pass (QeRLConfig.pass_chunk_rows; qerl.train.chunked_pass): unset "
    "(auto) chunks without recompute where the checkpointing is auto and a whole pass does not fit the card but a "
    "chunk does; 0 never; N chunks of N rows"
)

# ---------------------------------------------------------------------------------------------- trainer


def build_model(
    shape: dict[str, int], vocab: int, nvfp4: bool, device: torch.device, dtype: torch.dtype, arch: str
) -> nn.Module:
    """A random Qwen2/Llama (``arch``) causal LM of ``shape`` on ``device``, decoder Linears as ``NVFP4Linear``
    when ``nvfp4``; not peft-wrapped. The weights of benchmarks/rollout.py's models (``common.random_model``,
    seed 0), with no BOS, EOS or pad id in the config."""
    model = random_model(
        shape, vocab, nvfp4, device, dtype, arch, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
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


def load_benchmark_tokenizer(path: str | Path, prompt: str, length: int) -> Any:
    """``build_tokenizer``'s tokenizer saved beside a checkpoint, reloaded as itself; checks that ``prompt`` is
    ``length`` ids.

    Not through ``AutoTokenizer``: transformers 5 picks the class from the config's ``model_type`` for Qwen2
    (``Qwen2Tokenizer``, a byte-level BPE) whatever the saved tokenizer is, and that one encodes every word-level
    prompt to zero ids."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    got = len(tok(prompt).input_ids)
    if got != length:
        raise ValueError(f"{path}: its tokenizer encodes a {length}-token benchmark prompt to {got} ids")
    return tok


def spread_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Cheap reward with spread across a group (decoded lengths of random ids differ), so the
    advantages, hence the gradients, are non-zero."""
    return [float(len(c) % 7) for c in completions]


def make_trainer(
    model: nn.Module, tokenizer: Any, prompt: dict[str, str], args: argparse.Namespace, out_dir: str
) -> Any:
    """A QeRLTrainer as ``qerl.train.run --config training/recipes/qerl_nvfp4.yaml`` builds one (the recipe's loss and
    optimizer settings), with the benchmark's batch and lengths (trl insists on a train_dataset: the one prompt;
    the step is driven without its dataloader)."""
    import yaml
    from datasets import Dataset

    from qerl.load.lora import lora_config
    from qerl.train.trainer import QeRLConfig, QeRLTrainer

    accumulation = args.local_n // args.micro_batch  # per process: its share of the group, in micro-batches
    recipe = yaml.safe_load(RECIPE.read_text())
    config = QeRLConfig(
        **{k: recipe[k] for k in RECIPE_KEYS},
        output_dir=out_dir,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=args.n,
        max_completion_length=args.tokens,
        max_steps=10,
        num_stages=10,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        gradient_checkpointing=RECOMPUTE_FLAGS[getattr(args, "gradient_checkpointing", "on")],
        mask_truncated_completions=False,
        is_ratio_from_loss_pass=not getattr(args, "trl_logprob_pass", False),
        pass_chunk_rows=getattr(args, "pass_chunk_rows", None),
        fused_layers=not getattr(args, "no_fused_layers", False),
        fold_lora_expand=getattr(args, "fold_lora_expand", False),
        rollout_engine=getattr(args, "rollout_engine", "native"),
        rollout_engine_kwargs=getattr(args, "rollout_engine_kwargs", None),
    )
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
    # checkpointing if the config says on (unset on CUDA: the trainer decides per pass), then `_prepare_for_training`:
    # AdamW, `accelerator.prepare(model, optimizer)` (with bf16 on CUDA this wraps the forward in bf16 autocast, as in
    # every real run) and the cosine schedule.
    if trainer.args.gradient_checkpointing:
        enable_recompute(trainer.model, trainer.args.gradient_checkpointing_kwargs)
    trainer._prepare_for_training(config.max_steps, trainer.get_train_dataloader(), None)
    # The warm-up runs as step 0 (AQN stage 0: noise-free), the timed steps as steps 1.. (noisy stages).
    trainer.state.max_steps = config.max_steps
    return trainer


def recompute_ran(trainer: Any) -> dict[str, Any]:
    """Which activation recompute the trainer's training passes ran: ``mode`` none, full or mixed, ``share`` the
    fraction of passes that recomputed (the floors' ``recompute``), ``passes`` per mode (QeRLTrainer counts them;
    trl's own trainer recomputes in every pass when its model is checkpointing, and counts nothing)."""
    passes = getattr(trainer, "recompute_passes", None)
    if passes is None:
        full = bool(trainer.model.is_gradient_checkpointing)
        return {"mode": "full" if full else "none", "share": float(full), "passes": None}
    total = passes["none"] + passes["full"]
    mode = "mixed" if passes["none"] and passes["full"] else ("full" if passes["full"] else "none")
    return {"mode": mode, "share": passes["full"] / total if total else 0.0, "passes": dict(passes)}


def chunking_ran(trainer: Any) -> dict[str, Any]:
    """How the trainer's training passes were split (beside ``recompute_ran``): ``chunked_passes`` the passes run in row
    chunks (qerl.train.chunked_pass; none recomputed unless checkpointing was on) and ``rows_per_chunk`` those passes
    by rows per chunk; the other passes ran whole; ``rollout_memory_freed`` the passes before which the engine's KV
    cache and graphs were freed (qerl.train.recompute). trl's own trainer runs every pass whole and counts nothing."""
    chunks = getattr(trainer, "chunk_passes", None) or {}
    return {
        "chunked_passes": sum(chunks.values()),
        "rows_per_chunk": {str(k): v for k, v in sorted(chunks.items())},
        "rollout_memory_freed": getattr(trainer, "rollout_memory_freed", 0),
    }


# ---------------------------------------------------------------------------------------------- timing


class PhaseClock:
    """Splits a step into contiguous segments and records wall time and peak allocated memory of each.

    ``switch(name)`` synchronizes the device, charges the time and the peak since the previous switch
    to the segment being left, resets the peak counter and enters ``name``. The segments cover the
    step without gaps, so the step's peak is the largest segment peak.
    """

    def __init__(self, device: torch.device, profile: str | None = None, python: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.stage = "build"  # coarse label for error reports: build, warm-up, step
        self.current: str | None = None
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.peak_reserved = 0  # the caching allocator's peak over the span: what a card must really hold
        self._t = 0.0
        self.profile_phase = profile  # this phase of the timed step runs under torch.profiler
        self.profile_python = python  # ... recording Python calls too (with_stack)
        self.profiled: tuple[Any, float] | None = None  # (finished profiler, its phase's seconds), once taken
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
            self.profiled = (self._profiler, self.seconds[self.current])
            self._profiler = None
        elif (
            name is not None  # switch(None) ends a span; without --profile, profile_phase is None too
            and self.stage == "step"
            and name == self.profile_phase
            and name != self.current
            and self.profiled is None
        ):
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(activities=activities, with_stack=self.profile_python)
            self._profiler.__enter__()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        # Profiler start/stop is charged to no phase.
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

    def __init__(self, trainer: Any, switch: Callable[[str], None], ragged: bool = False) -> None:
        """``ragged``: each rollout's completions are cut to lengths spread evenly from the full length down to half
        of it (no EOS: the engine still generates them all), so that the training passes see the padded rows of a
        real run instead of equal ones."""
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
            switch("rollout")
            try:
                ids, lps = generate(*a, **k)
            finally:
                switch("other")
            if ragged:
                ids, lps = ragged_rows(ids, lps)
            self.rollouts += 1
            self.completion_lengths = [len(c) for c in ids]
            # The native engine counts its decode steps; trl's own trainer and the vLLM engine do not.
            engine = trainer.rollout_engine() if hasattr(trainer, "rollout_engine") else None
            self.decode_steps = getattr(engine, "last_stats", {}).get("decode_steps")
            return ids, lps

        def old_logprobs(*a: Any, **k: Any) -> Any:
            if torch.is_grad_enabled():  # the loss's own forward: part of fwd_bwd
                return logps(*a, **k)
            switch("logprobs")
            try:
                return logps(*a, **k)
            finally:
                switch("other")

        def prepared(*a: Any, **k: Any) -> Any:
            out = prepare(*a, **k)
            switch("fwd_bwd")
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


def ragged_rows(ids: list[list[int]], logprobs: list[list[float]] | None) -> tuple[list, list | None]:
    """Completion ``i`` of ``n`` cut to ``L - floor(i * L / (2 (n - 1)))`` tokens (``L`` the full length): from ``L``
    down to ``L / 2``, the longest row still full, so the pass keeps its width and gains padding."""
    full, last = max(len(c) for c in ids), max(len(ids) - 1, 1)
    keep = [full - (i * full) // (2 * last) for i in range(len(ids))]
    return [c[:k] for c, k in zip(ids, keep, strict=True)], (
        None if logprobs is None else [lp[:k] for lp, k in zip(logprobs, keep, strict=True)]
    )


def run_step(trainer: Any, prompts: list[dict[str, str]], switch: Callable[[str], None]) -> tuple[float, float]:
    """One optimizer step as transformers' inner loop runs it with gradient accumulation: the loop hands
    ``training_step`` the generation batch (trl's sampler repeats it ``steps_per_generation`` times) once
    per micro-step; GRPO's ``_prepare_inputs`` generates, scores and computes the old log-probs of all n
    completions at the first (``trainer._step % steps_per_generation == 0``), buffers them split into
    micro-batches and returns the next slice at each later one; each micro-step's loss is divided by
    ``current_gradient_accumulation_steps`` inside trl's loss and its backward adds into the gradients.
    Then clip, optimizer and scheduler step, zero_grad, once (``switch`` marks the optimizer phase). Returns (loss summed over the micro-steps,
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
    switch("optimizer")
    grad_norm = trainer._clip_grad_norm(model)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    trainer.state.global_step += 1
    return float(torch.stack(losses).sum()), float(grad_norm)


#: Kernel kinds by name (first match wins), for the split of a profiled pass: which kind of work the device did.
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")),
    ("qerl_triton", ("nvfp4", "fp4", "dequant", "qerl")),
    ("copy_cast", ("copy", "_to_copy", "cat_", "catarray")),
    ("log_softmax", ("softmax", "cross_entropy", "nll")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("reduction", ("reduce_kernel",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_")),
)


def kernel_kind(name: str) -> str:
    """The kind of a kernel by its name (``KERNEL_KINDS``), ``other`` where none matches."""
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


#: Host events that are the CUDA runtime's, not work of ours: charged nothing in the idle table.
RUNTIME_PREFIXES = ("cuda", "cu", "Command Buffer")


def idle_table(events: list[Any], top: int = 12, min_gap_us: float = 20.0) -> dict[str, Any]:
    """Where the device waited on the host: the gaps of at least ``min_gap_us`` between the profiled span's kernels
    (their union), and what the host ran meanwhile, charged to the innermost event (an op, or a Python function where
    the profile recorded them) by its overlap with the gaps less its children's; idle time with no event open is
    ``between_events_s`` (Python between ops). ``events`` are torch.profiler's (``prof.events()``)."""
    from torch.autograd import DeviceType

    busy = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type != DeviceType.CPU)
    starts: list[float] = []
    ends: list[float] = []
    reach = busy[0][1] if busy else 0.0
    for start, stop in busy[1:]:
        if start - reach >= min_gap_us:
            starts.append(reach)
            ends.append(start)
        reach = max(reach, stop)
    prefix = [0.0]
    for g0, g1 in zip(starts, ends, strict=True):
        prefix.append(prefix[-1] + g1 - g0)

    def overlap(e: Any) -> float:
        """Microseconds of the gaps inside ``e``'s time range."""
        a, b = e.time_range.start, e.time_range.end
        i, j = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        if i >= j:
            return 0.0
        return (
            prefix[j]
            - prefix[i]
            - max(0.0, min(a, ends[i]) - starts[i])
            - max(0.0, ends[j - 1] - max(b, starts[j - 1]))
        )

    host = [
        e
        for e in events
        if e.device_type == DeviceType.CPU and not e.is_async and not e.name.startswith(RUNTIME_PREFIXES)
    ]
    ours = {id(e) for e in host}
    charged: dict[str, float] = {}
    covered = 0.0
    for e in host:
        whole = overlap(e)
        own = whole - sum(overlap(c) for c in e.cpu_children if id(c) in ours)
        if own > 0:
            charged[e.name] = charged.get(e.name, 0.0) + own
        if e.cpu_parent is None or id(e.cpu_parent) not in ours:
            covered += whole
    idle = prefix[-1]
    ranked = sorted(charged.items(), key=lambda kv: -kv[1])[:top]
    return {
        "gaps": len(starts),
        "idle_s": sig(idle / 1e6),
        "between_events_s": sig(max(idle - covered, 0.0) / 1e6),
        "host_during_idle": [{"name": name[:90], "ms": round(us / 1e3, 2)} for name, us in ranked],
    }


def profile_table(prof: Any, wall_s: float, top: int = 40) -> dict[str, Any]:
    """The profiled phase in a few lines: device-busy time against its wall time (a busy share far
    below 1 means the GPU waited on the host), device time by kernel kind (``kernel_kind``), the top
    kernels by device time, and the top host ops by self CPU time (where a per-call host cost of the
    qerl ops would show). Also printed."""
    from torch.autograd import DeviceType

    events = list(prof.key_averages())
    kernels = sorted(
        (e for e in events if e.device_type != DeviceType.CPU and e.self_device_time_total > 0),
        key=lambda e: e.self_device_time_total,
        reverse=True,
    )
    busy_us = sum(e.self_device_time_total for e in kernels)
    host = sorted(
        (e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total, reverse=True
    )

    def row(e: Any, us: float) -> dict[str, Any]:
        return {"name": e.key[:90], "calls": e.count, "ms": round(us / 1e3, 2), "share": sig(us / max(busy_us, 1), 3)}

    qerl_ops = {
        e.key: {
            "calls": e.count,
            "cpu_ms_total": round(e.cpu_time_total / 1e3, 2),
            "device_ms_total": round(e.device_time_total / 1e3, 2),
        }
        for e in events
        if e.key.startswith("qerl::") or "qerl_nvfp4" in e.key
    }
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_kind[kernel_kind(e.key)] = by_kind.get(kernel_kind(e.key), 0.0) + e.self_device_time_total
    table = {
        "wall_s": sig(wall_s),
        "device_busy_s": sig(busy_us / 1e6),
        "device_busy_share": sig(busy_us / 1e6 / wall_s, 3) if wall_s > 0 else None,
        "by_kind_s": {k: sig(us / 1e6) for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels": [row(e, e.self_device_time_total) for e in kernels[:top]],
        "host_ops": [
            {"name": e.key[:90], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in host[:top]
        ],
        "qerl_ops": qerl_ops,
        "idle": idle_table(list(prof.events())),
    }
    print(f"profile: wall {table['wall_s']} s, device busy {table['device_busy_s']} s ({table['device_busy_share']})")
    print("  by kind (s): " + ", ".join(f"{k} {v}" for k, v in table["by_kind_s"].items()))
    idle = table["idle"]
    print(f"  device idle {idle['idle_s']} s in {idle['gaps']} gaps; between host events {idle['between_events_s']} s")
    for op in idle["host_during_idle"]:
        print(f"    {op['ms']:10.2f} ms idle under  {op['name']}")
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
