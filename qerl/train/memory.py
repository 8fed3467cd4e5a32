"""Refuse before, not after: a training run's peak GPU memory, estimated from ``config.json`` and the flags before
anything heavy is loaded, and the one-line refusal of a run that would not fit on its card.

Without this a run that cannot fit loaded the weights, built the engine, sampled a whole generation batch and died
of an out-of-memory error minutes in, in its first training pass. The estimate is a sum of named terms
(:class:`MemoryEstimate`), in bytes, of what a GRPO step holds at its peak, the training pass (forward + backward of
one micro-batch):

* ``weights``: the decoder Linears, packed NVFP4 (4.5 bits a weight: 4-bit codes and one FP8 scale per 16) or bf16
  (2 B; an NVFP4 checkpoint's ``quantization_config.ignore`` list keeps some in bf16), the bf16 embeddings and the LM
  head (none more when tied to the embeddings; packed when the checkpoint quantized it);
* ``trainable_states``: the LoRA matrices and the trained norms in fp32 with their fp32 gradient and AdamW's two
  moments, fp32 (16 B a parameter) or 8-bit under an ``adamw_8bit``-like ``--optim`` (bitsandbytes: one byte per
  moment plus an fp32 scale per 256, for tensors of at least 4096 values; smaller ones stay fp32);
* ``engine_lora`` and ``kv_cache``: the native engine's bf16 copies of the LoRA weights and its static KV cache,
  sized for one generation batch (``per_device_train_batch_size x steps_per_generation`` completions, rounded up to
  a power of two) at the longest prompt plus ``--max_completion_length`` (rounded up to its 256-position block); the
  ``hf`` engine's cache is the same without the rounding; it stays allocated between rollouts;
* ``engine_pool``: with ``--rollout_engine vllm``, vLLM's share of the card (``--vllm_gpu_memory_utilization``) in
  place of the two terms above;
* the training pass at ``--per_device_train_batch_size`` rows of that length: with recompute (gradient
  checkpointing: on, or unset = auto, whose fallback it is) one bf16 hidden state per layer and token
  (``checkpointed``), one layer's recomputed activations and, for NVFP4, two bf16 copies of its largest dequantized
  weight (``layer_recompute``), and ``qerl.train.recompute.HEAD_ACTIVATIONS`` hidden-sized bf16 tensors per token for
  the LM head and the activation gradients (``head_and_grads``: trl's chunked log-prob head, whose logit tiles of
  4096 tokens x 32768 vocabulary entries are the bulk of it at these lengths, and the gradients flowing back);
  without recompute (``--gradient_checkpointing False``) ``no_recompute_pass``, the estimate the trainer's auto mode
  weighs (``qerl.train.recompute.no_recompute_bytes``, with the attention mask a padded batch has, and the smaller
  saved tensors of the fused layers where the trainer will swap them in);
* ``released``: the native engine's KV cache and LoRA copies, which the trainer frees before a pass that would not
  fit beside them (``--release_rollout_memory``, unset: where needed): the peak is then the larger of the rollout's
  and the pass's with them freed.

Not counted: the rollout's own transients (a prefill chunk's activations, the sampling logits), smaller than the
training pass in every recorded run. ``benchmarks/grpo_floors.py`` reports the same terms for its benchmarks, and
``tests/test_memory.py`` holds the estimate within 10% of every peak recorded in ``benchmarks/results/`` (the
grpo_step and e2e rows; the figures are in docs/training.md, "Will it fit").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl.arch import LINEAR_TARGETS
from qerl.checkpoint import is_nvfp4_config, read_config
from qerl.cli import UsageError
from qerl.kernels import backend
from qerl.train.recompute import HEADROOM, no_recompute_bytes, recompute_terms

logger = logging.getLogger(__name__)

GB = 1e9
#: Bytes per packed NVFP4 weight: a 4-bit code and 1/16 of an FP8 block scale.
NVFP4_BYTES = 9 / 16
#: ``NativeEngine``'s default ``kv_block``: its cache length is a multiple of it (``tests/test_memory.py`` checks it).
NATIVE_KV_BLOCK = 256
#: bitsandbytes' 8-bit optimizers keep 32-bit state for tensors smaller than this (its ``min_8bit_size``).
EIGHT_BIT_MIN_SIZE = 4096
#: Bytes per parameter of two 8-bit moments with an fp32 absmax per block of 256 values each.
EIGHT_BIT_MOMENTS = 2 * (1 + 4 / 256)
#: The length step a refusal suggests for ``--max_prompt_length`` and ``--max_completion_length``.
LENGTH_STEP = 256


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its decoder shape from ``config.json`` and how its weights are stored."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    nvfp4: bool = False
    packed_head: bool = False
    #: decoder Linear weights an NVFP4 checkpoint keeps in bf16 (its ``quantization_config.ignore`` list)
    dense_linear_params: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any], nvfp4: bool | None = None) -> ModelShape:
        """The shape of a config.json mapping (``nvfp4`` unset: whether it is an NVFP4A16 checkpoint's); a one-line
        ValueError naming the field that is not a positive integer."""
        heads = config.get("num_attention_heads")
        values = {key: config.get(key) for key in ("hidden_size", "intermediate_size", "num_hidden_layers")}
        values |= {"num_attention_heads": heads, "num_key_value_heads": config.get("num_key_value_heads") or heads}
        values["vocab_size"] = config.get("vocab_size")
        if config.get("head_dim") is not None:
            values["head_dim"] = config["head_dim"]
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {key} is {value!r}; expected a positive integer")
        h, heads = values["hidden_size"], values["num_attention_heads"]
        shape = cls(
            hidden=h,
            intermediate=values["intermediate_size"],
            layers=values["num_hidden_layers"],
            heads=heads,
            kv_heads=values["num_key_value_heads"],
            head_dim=values.get("head_dim", h // heads),
            vocab=values["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
        )
        quantized = is_nvfp4_config(dict(config)) if nvfp4 is None else nvfp4
        if not quantized:
            return shape
        # A shape without a checkpoint's quantization_config (the benchmarks'): the quantizer's default, lm_head bf16.
        ignore = (config.get("quantization_config") or {"ignore": ["lm_head"]}).get("ignore") or []
        dense = sum(a * b for name, (a, b) in shape.named_linears() if _ignored(name, ignore))
        packed_head = not shape.tied and not _ignored("lm_head", ignore)
        return dataclasses.replace(shape, nvfp4=True, packed_head=packed_head, dense_linear_params=dense)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each decoder Linear of one layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))
        return dict(zip(LINEAR_TARGETS, shapes, strict=True))

    def named_linears(self) -> Iterator[tuple[str, tuple[int, int]]]:
        """Every decoder Linear by its module name (``model.layers.N.self_attn.q_proj``), with its (in, out)."""
        for layer in range(self.layers):
            for name, size in self.projections().items():
                block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                yield f"model.layers.{layer}.{block}.{name}", size

    @property
    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.projections().values())

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V of every layer for one token, bf16."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 2

    def dims(self) -> dict[str, int]:
        """The mapping ``qerl.train.recompute``'s estimates read."""
        return {
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
        }

    def trainable_tensors(self, lora_r: int, targets: tuple[str, ...], trained_norms: bool) -> list[int]:
        """The sizes of the trainable tensors: LoRA's A (r x in) and B (out x r) on each target, and the two norms
        of each layer that ``--ln`` trains. An unknown target name (``all-linear``, a regex) counts as all seven."""
        known = [t for t in targets if t in LINEAR_TARGETS]
        chosen = known if len(known) == len(targets) else list(LINEAR_TARGETS)
        per_layer = [n for t in chosen for n in (lora_r * self.projections()[t][0], self.projections()[t][1] * lora_r)]
        return per_layer * self.layers + ([self.hidden] * 2 * self.layers if trained_norms else [])


def _ignored(name: str, ignore: list[str]) -> bool:
    """Whether compressed-tensors' ``ignore`` list (names, or ``re:`` patterns) keeps module ``name`` unquantized."""
    return any(e == name or (e.startswith("re:") and re.match(e[3:], name)) for e in ignore if isinstance(e, str))


@dataclass(frozen=True)
class RunShape:
    """What the estimate needs of a run's settings (one process of it)."""

    rollout_rows: int  # completions per generation batch on this process
    micro_batch: int  # rows per training pass
    prompt_tokens: int
    completion_tokens: int
    lora_r: int
    lora_targets: tuple[str, ...] = LINEAR_TARGETS
    trained_norms: bool = True
    eight_bit: bool = False  # 8-bit optimizer moments
    recompute: bool = True  # gradient checkpointing (on, or the fallback of auto)
    masked: bool = True  # the pass has padding (its attention mask is saved per layer without recompute)
    fused: bool = False  # the trainer's fused RMSNorm / SwiGLU layers (qerl.train.fused_layers) keep less
    release_engine: bool = False  # the native engine's KV cache and LoRA copies may be freed for the pass
    engine: str = "native"
    engine_share: float = 0.0  # vLLM's gpu_memory_utilization
    kv_block: int = NATIVE_KV_BLOCK

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class MemoryEstimate:
    """The terms of the module docstring, in bytes; a term that does not apply is 0."""

    weights: int
    trainable_states: int
    engine_lora: int
    kv_cache: int
    engine_pool: int
    checkpointed: int
    layer_recompute: int
    head_and_grads: int
    no_recompute_pass: int
    #: What the native engine frees before the pass where the run lets it (``--release_rollout_memory``).
    released: int = 0

    @property
    def resident(self) -> int:
        """What the step holds before its training pass (weights, trainable state, the engine's memory)."""
        return self.weights + self.trainable_states + self.engine_lora + self.kv_cache + self.engine_pool

    @property
    def training_pass(self) -> int:
        return self.checkpointed + self.layer_recompute + self.head_and_grads + self.no_recompute_pass

    @property
    def peak(self) -> int:
        """The larger of the rollout's (the resident terms) and the pass's, for which the engine frees ``released``."""
        return max(self.resident, self.resident - self.released + self.training_pass)

    def summary(self) -> str:
        """'weights 5.9 + LoRA and optimizer 0.6 + rollout engine 1.1 + training pass 3.0 GB', and where the engine's
        memory is freed for the pass, how much."""
        engine = self.engine_lora + self.kv_cache + self.engine_pool
        parts = (self.weights, self.trainable_states, engine, self.training_pass)
        names = ("weights", "LoRA and optimizer", "rollout engine", "training pass")
        terms = " + ".join(f"{name} {size / GB:.1f}" for name, size in zip(names, parts, strict=True)) + " GB"
        return terms + (f", the engine's {self.released / GB:.1f} GB freed for the pass" if self.released else "")


def _bucket(n: int) -> int:
    """The native engine's row bucket: the smallest power of two >= n."""
    return 1 << (max(n, 1) - 1).bit_length()


def estimate(model: ModelShape, run: RunShape, card_total: int = 0) -> MemoryEstimate:
    """The peak of one GRPO step of ``run`` on ``model`` (``card_total``: the card's bytes, for vLLM's share)."""
    h = model.hidden
    packed = model.linear_params - model.dense_linear_params if model.nvfp4 else 0
    head = 0 if model.tied else model.vocab * h * (NVFP4_BYTES if model.packed_head else 2)
    weights = packed * NVFP4_BYTES + (model.linear_params - packed) * 2 + model.vocab * h * 2 + head
    tensors = model.trainable_tensors(run.lora_r, run.lora_targets, run.trained_norms)
    moments = [EIGHT_BIT_MOMENTS if run.eight_bit and n >= EIGHT_BIT_MIN_SIZE else 8 for n in tensors]
    states = sum(n * (8 + m) for n, m in zip(tensors, moments, strict=True))
    lora = sum(tensors) - (model.layers * 2 * h if run.trained_norms else 0)
    native, vllm = run.engine == "native", run.engine == "vllm"
    rows = _bucket(run.rollout_rows) if native else run.rollout_rows
    length = -(-run.tokens // run.kv_block) * run.kv_block if native else run.tokens
    recompute = recompute_terms(model.dims(), run.micro_batch, run.tokens, nvfp4=model.nvfp4)
    flags = {"nvfp4": model.nvfp4, "trained_norms": run.trained_norms, "masked": run.masked, "fused": run.fused}
    no_recompute = no_recompute_bytes(model.dims(), run.micro_batch, run.tokens, run.lora_r, **flags)
    engine_lora, kv_cache = (lora * 2 if native else 0), (0 if vllm else model.kv_bytes_per_position * rows * length)
    return MemoryEstimate(
        weights=int(weights),
        trainable_states=int(states),
        engine_lora=engine_lora,
        kv_cache=kv_cache,
        engine_pool=int(run.engine_share * card_total) if vllm else 0,
        **{k: v if run.recompute else 0 for k, v in recompute.items()},
        no_recompute_pass=0 if run.recompute else no_recompute,
        released=engine_lora + kv_cache if native and run.release_engine else 0,
    )


def planned_run(script: Any, config: Any, prompt_tokens: int) -> RunShape:
    """The :class:`RunShape` of ``python -m qerl.train``'s parsed flags (``qerl.train.args``), prompts of at most
    ``prompt_tokens``."""
    kwargs = dict(config.rollout_engine_kwargs or {})
    vllm = config.rollout_engine == "vllm"
    optim = str(getattr(config.optim, "value", config.optim))
    return RunShape(
        rollout_rows=config.per_device_train_batch_size * config.steps_per_generation,
        micro_batch=config.per_device_train_batch_size,
        prompt_tokens=prompt_tokens,
        completion_tokens=config.max_completion_length,
        lora_r=script.lora_rank,
        lora_targets=tuple(script.target_modules),
        trained_norms=script.ln,
        eight_bit="8bit" in optim,
        recompute=config.gradient_checkpointing is not False,
        fused=bool(config.fused_layers) and backend.enabled(),  # the trainer swaps them where Triton serves CUDA
        release_engine=config.release_rollout_memory is not False,  # auto frees it where the pass needs it
        engine=config.rollout_engine,
        engine_share=float(kwargs.get("gpu_memory_utilization", config.vllm_gpu_memory_utilization)) if vllm else 0.0,
        kv_block=max(1, int(kwargs.get("kv_block") or NATIVE_KV_BLOCK)),
    )


def check_fits(script: Any, config: Any, prompt_tokens: int, model_dir: Path) -> MemoryEstimate | None:
    """Refuse (a one-line :class:`UsageError`) a run whose estimated peak exceeds the free memory of this process's
    card less ``HEADROOM`` of it, naming the estimate, the free memory and the flag that would make it fit; with
    ``--force`` log the same line and go on. Logs the estimate of a run that fits; without CUDA, no check (one line).
    Reads only config.json (in ``model_dir``, ``--model_name``'s directory): call it before the model, the data or
    anything else heavy."""
    if config.use_cpu or not torch.cuda.is_available():
        logger.info("memory check skipped: no CUDA device (the run trains on the CPU)")
        return None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    free, total = torch.cuda.mem_get_info(device)
    room = free - HEADROOM * total
    try:
        model = ModelShape.from_config(read_config(model_dir))
    except ValueError as e:
        raise UsageError(f"--model_name {script.model_name}: {e}") from None
    run = planned_run(script, config, prompt_tokens)
    need = estimate(model, run, total)
    card = f"{torch.cuda.get_device_properties(device).name} ({device})"
    if need.peak <= room:
        logger.info(
            "memory: peak estimated at %.1f GB (%s); %s has %.1f GB free",
            need.peak / GB,
            need.summary(),
            card,
            free / GB,
        )
        return need
    line = (
        f"will not fit on {card}: the run's peak is estimated at {need.peak / GB:.1f} GB ({need.summary()}) and the "
        f"card has {free / GB:.1f} GB free of {total / GB:.1f} GB ({HEADROOM:.0%} of it kept as headroom); "
        + _fix(model, run, config, room, total, prompt_defaulted=script.max_prompt_length is None)
    )
    if not script.force:
        raise UsageError(f"{line}, or --force runs it anyway")
    logger.warning("%s; running anyway (--force)", line)
    return need


def _fix(model: ModelShape, run: RunShape, config: Any, room: float, total: int, *, prompt_defaulted: bool) -> str:
    """The first setting of :func:`_candidates` under which the run fits in ``room``, as the flags to pass."""
    for flags, candidate in _candidates(model, run, config, total, prompt_defaulted):
        fits = estimate(model, candidate, total)
        if fits.peak <= room:
            return f"{flags} would fit it (~{fits.peak / GB:.1f} GB)"
    knobs = "--vllm_gpu_memory_utilization, " if run.engine == "vllm" else ""
    return (
        f"no single change of --gradient_checkpointing, {knobs}--per_device_train_batch_size or the lengths makes it "
        "fit (a smaller model or a card with more free memory would)"
    )


def _candidates(
    model: ModelShape, run: RunShape, config: Any, total: int, prompt_defaulted: bool
) -> Iterator[tuple[str, RunShape]]:
    """Settings that lower the peak, in the order a refusal tries them, each from its largest value down: those that
    keep the experiment first (the native engine's memory freed for the pass; recompute; vLLM's share, down to what
    its weights and cache need; ``--max_prompt_length`` where it was left at its default bound, which most data
    sets' prompts are far below; the micro-batch, with the accumulation that keeps the step's batch), then
    ``--max_completion_length``."""
    replace = dataclasses.replace
    if run.engine == "native" and not run.release_engine:
        yield "--release_rollout_memory unset (or True)", replace(run, release_engine=True)
    if not run.recompute:
        yield "--gradient_checkpointing True", replace(run, recompute=True)
    if run.engine == "vllm":
        floor = estimate(model, run).weights + model.kv_bytes_per_position * run.rollout_rows * run.tokens
        for share in (s / 20 for s in range(int(run.engine_share * 20 - 1e-9), 0, -1)):
            if share * total >= floor:
                yield f"--vllm_gpu_memory_utilization {share:g}", replace(run, engine_share=share)
    for length in _shorter(run.prompt_tokens) if prompt_defaulted else ():
        yield f"--max_prompt_length {length}", replace(run, prompt_tokens=length)
    steps, accumulation = config.steps_per_generation, config.gradient_accumulation_steps
    for micro in (d for d in range(run.micro_batch - 1, 0, -1) if run.micro_batch % d == 0):
        k = run.micro_batch // micro
        flags = f"--per_device_train_batch_size {micro} --gradient_accumulation_steps {accumulation * k}"
        yield (
            flags + (f" --steps_per_generation {steps * k}" if steps != accumulation else ""),
            replace(run, micro_batch=micro),
        )
    for length in _shorter(run.completion_tokens):
        yield f"--max_completion_length {length}", replace(run, completion_tokens=length)


def _shorter(length: int) -> range:
    """Lengths below ``length`` in steps of :data:`LENGTH_STEP`, longest first."""
    return range((length - 1) // LENGTH_STEP * LENGTH_STEP, 0, -LENGTH_STEP)


__all__ = ["MemoryEstimate", "ModelShape", "RunShape", "check_fits", "estimate", "planned_run"]
