"""``QeRLTrainer``: trl's GRPOTrainer with qerl rollouts, AQN, and crash-safe checkpoints.

What is overridden, and why (tested against trl 1.16; ``TRL_RANGE`` below):

* ``_generate_single_turn``: completions come from a ``qerl.rollout`` engine (native by default,
  ``hf`` or ``vllm`` on request) instead of ``model.generate``/trl's vLLM. trl's vLLM path merges
  LoRA into the base weights before every sync, which cannot work on a 4-bit base; our engines run
  the adapter unmerged. AQN wraps exactly this call: noise in before, clean weights back after.
  These rollout-side hooks live in ``qerl.train.rollout_hooks`` (a mixin of this class).
* ``compute_loss``: with ``gradient_checkpointing`` unset, whether this training pass recomputes activations
  (``qerl.train.recompute``), and a pass in row chunks where a chunk's activations fit and the whole's do not, or
  ``--pass_chunk_rows`` asks it (``qerl.train.chunked_pass``, a mixin of this class).
* ``training_step``: trl's step under ``cudnn_attention_disabled`` (cuDNN's attention backward can
  return NaN gradients on Hopper; see that function).
* ``log``: adds sigma, rollout tokens/s and peak GPU memory to trl's metrics (reward mean/std per
  function, entropy, completion lengths and step time are trl's own).
* ``_load_optimizer_and_scheduler``: the learning rate re-derived on this run's schedule (an extended
  ``max_steps`` re-plans it instead of starting from the old plan's final rate).
* ``_save_checkpoint`` / ``train``: a checkpoint counts only once its completion marker is written
  (atomically, after everything else); resume picks the newest *complete* checkpoint and moves
  half-written ones aside, because transformers writes straight into ``checkpoint-N``. Resuming from
  a checkpoint that already reached ``max_steps`` restores it without training (transformers would
  run one more step), and ``metrics.jsonl`` drops the rows of steps after the checkpoint, which are
  about to be trained again, so that no step has two rows.

Everything else is trl's: the loss types (grpo, bnpo, dr_grpo, dapo, ...), advantages, clipping,
and the per-token log-probs/entropies, which trl 1.16 computes through its fused, chunked LM head
(``add_fused_lm_head``: never a ``[batch, seq, vocab]`` logits tensor) on top of the decoder
forward, whose NVFP4Linear layers run qerl's kernels.

**Importance-sampling (IS) correction, decided deliberately.** Our rollouts are off-policy twice
over: the engine's kernels differ numerically from the training forward, and AQN samples from a
*noisy* policy while the loss optimises the clean one. trl implements rollout/trainer mismatch
correction but gates it on ``use_vllm``; every qerl engine returns the sampling log-probs exactly
like trl's vLLM path, so the trainer switches that gate on (``self.use_vllm``) while trl's own vLLM
object is never built (``args.use_vllm`` is mapped to ``rollout_engine="vllm"``). The default mode is
**token_truncate with C=2** (FlashRL/verl's TIS): each token's loss is weighted by
``min(pi_train/pi_rollout, 2)``. trl's default, ``sequence_mask`` with C=3, multiplies the ratios of
all tokens of a sequence and *drops* the sequence beyond 3: with AQN's per-token log-prob shifts of
order 1e-2 that masks nearly every long completion, i.e. training would stall exactly when the
noise is on. Token truncation keeps every sequence, bounds the variance, and still corrects the
bias the noise introduces. ``vllm_importance_sampling_correction=False`` reproduces the paper
(noisy samples treated as on-policy).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, rotate_checkpoints
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from qerl import arch
from qerl.fsutil import atomic_write_text, umask_modes
from qerl.kernels import backend
from qerl.load.integrity import check_tensor
from qerl.load.lora import fold_lora_expand
from qerl.train.aligned_rows import AlignedRows
from qerl.train.aqn import NormNoise
from qerl.train.chunked_pass import ChunkedPass
from qerl.train.config import QeRLConfig, trl_differences, with_model_defaults
from qerl.train.fused_layers import fuse_layers
from qerl.train.is_ratio import LossPassRatio
from qerl.train.progress import use_step_lines
from qerl.train.resume import CHECKPOINT_MARKER, METRICS_FILE, MetricsFile, last_complete_checkpoint
from qerl.train.rollout_hooks import RolloutHooks

logger = logging.getLogger(__name__)

#: trl versions this subclass was tested with (its hooks are private and move between releases).
TRL_RANGE = (">=1.16.0", "<1.17")
#: ``generation_kwargs`` keys the rollout engines honour (vLLM's names: ``SamplingParams`` fields, and
#: ``ignore_eos``, which leaves the stop tokens out); any other key is refused in one line.
GENERATION_KWARGS = ("min_p", "repetition_penalty", "min_tokens", "ignore_eos")


def _check_trl_version() -> None:
    import trl
    from packaging.version import Version

    v = Version(trl.__version__)
    if not (Version("1.16.0") <= v < Version("1.17")):
        logger.warning(
            "QeRLTrainer was tested with trl %s; found trl %s (private hooks may differ)", " ".join(TRL_RANGE), v
        )


def _shown(value: Any) -> Any:
    """A setting as the user writes it: an enum (``SchedulerType.COSINE``) by its value (``'cosine'``)."""
    return value.value if isinstance(value, Enum) else value


def _output_in_input_dtype(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook: an fp32-stored module fed bf16 activations hands bf16 on (one rounding)."""
    x = args[0] if args else None
    if (
        isinstance(x, torch.Tensor)
        and isinstance(output, torch.Tensor)
        and x.is_floating_point()
        and output.dtype != x.dtype
    ):
        return output.to(x.dtype)
    return output


@contextmanager
def cudnn_attention_disabled() -> Iterator[None]:
    """SDPA without its cuDNN backend (flash / memory-efficient kernels take over), flag restored after.

    Why: cuDNN's SDPA backward on Hopper returns NaN ``grad_q`` when an attention mask is passed, the
    sequence length is 64 mod 128 and some row's log-sum-exp is below ln(FLT_MAX) ~ -88.7, e.g. a
    left-padding query row (pytorch/pytorch#196678, from torch 2.11; trl#7181 sees it on 2.13). The
    forward stays finite, so a step logs a finite loss with ``grad_norm`` NaN and every weight turns
    NaN. Seen on the H200 (torch 2.11, 2026-11-29): two of three 200-step SmolLM2 runs died at steps
    126 and 129, when a padded batch happened to have such a length. The whole training step runs
    under this (forward, the checkpoint recompute inside backward, and backward), since the backward
    kernel is the one the forward picked. CPU: only the flag changes.
    """
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


def keep_trainable_fp32(model: nn.Module) -> list[str]:
    """Store every trainable bf16/fp16 parameter in fp32; its module's output is cast back to the
    dtype of its input. Returns the upcast parameters' names.

    Why: peft keeps LoRA adapters in fp32 but leaves ``modules_to_save`` copies (the trained RMSNorms
    of ``--ln``) in the model's dtype, bf16 on GPU. AdamW moves a weight by ~lr per step (1e-5), while
    bf16's spacing near SmolLM2's median norm weight (0.27) is 2e-3: the update rounds away and the
    norms never train (on SmolLM2's 34,560 norm values, 10 AdamW steps at lr 1e-5 changed 0.3% of
    them). Nothing shows it on CPU, where models load in fp32. In fp32 they train, AQN's noise is
    added exactly, and the hook keeps the activations bf16: an RMSNorm then returns
    ``bf16(weight * bf16(normalised))``, which is what the rollout engine computes from the same weight.
    """
    upcast: list[str] = []
    for module_name, module in model.named_modules():
        names = [
            n
            for n, p in module.named_parameters(recurse=False)
            if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)
        ]
        for n in names:
            param = getattr(module, n)
            param.data = param.data.float()  # same Parameter object: optimizers built later see fp32
            upcast.append(f"{module_name}.{n}" if module_name else n)
        if names:
            module.register_forward_hook(_output_in_input_dtype)
    return upcast


class QeRLTrainer(RolloutHooks, LossPassRatio, AlignedRows, ChunkedPass, GRPOTrainer):
    """GRPO/DAPO on NVFP4 (or bf16) models with LoRA, qerl rollouts and AQN."""

    _tag_names = ["trl", "grpo", "qerl"]

    def __init__(self, model: Any, reward_funcs: Any = None, args: QeRLConfig | None = None, **kwargs: Any) -> None:
        arch.check_model(model, "QeRLTrainer")  # before trl builds anything around the model
        if args is None:  # as trl: a default config named after the model
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = QeRLConfig(f"{name.split('/')[-1]}-GRPO")
        if not isinstance(args, QeRLConfig):
            raise TypeError(
                f"QeRLTrainer: args must be a QeRLConfig (trl's GRPOConfig plus the rollout engine and AQN), "
                f"got {type(args).__name__}"
            )
        for name in ("tools", "environment_factory"):
            if kwargs.get(name):
                raise ValueError(
                    f"QeRLTrainer: {name} is not supported (trl parses tool calls out of its own generation "
                    "loop); write a rollout_func over trainer.rollout_engine() instead"
                )
        unknown = sorted(set(args.generation_kwargs or {}) - set(GENERATION_KWARGS))
        if unknown:
            raise ValueError(
                f"QeRLTrainer: --generation_kwargs key {unknown[0]!r} is not supported by qerl's rollout "
                f"engines; they honour {', '.join(GENERATION_KWARGS)}"
            )
        args = with_model_defaults(args, model)  # LR, AQN, completion budget: on our copy, not the caller's config
        _check_trl_version()
        differences = trl_differences(args)  # before the trainer's Accelerator: building a config resets its state
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        upcast = keep_trainable_fp32(self.model)  # before the optimizer, the engine and AQN see them
        if upcast:
            logger.info("%d trainable bf16/fp16 parameters (e.g. %s) are kept in fp32", len(upcast), upcast[0])
        if args.fold_lora_expand:
            logger.info("LoRA expands folded into their base outputs: %d layers", fold_lora_expand(self.model))
        if args.fused_layers and backend.serves(self.accelerator.device):
            fused = fuse_layers(self.model)
            self.layers_fused = any(fused.values())
            logger.info("fused training layers: %d RMSNorms, %d SiLU MLPs", fused["norms"], fused["mlps"])

        # trl applies its rollout-mismatch IS correction only `if self.use_vllm`: switch that gate on
        # for our engines, which return the sampling log-probs (see the module docstring). trl's
        # vLLM generation object was never created (args.use_vllm is False).
        self.use_vllm = bool(args.vllm_importance_sampling_correction)
        if args.rollout_engine == "vllm" and self.accelerator.num_processes > 1:
            raise ValueError(
                "--rollout_engine vllm runs in one process on one GPU; with accelerate launch use native or hf"
            )
        self.aqn = args.aqn_plan
        self._engine: Any = None
        self._noise: NormNoise | None = None
        self._rollout_index = (-1, 0)  # (global step, rollouts drawn at that step): seeds the sampler
        self._resume_marker: dict[str, Any] | None = None
        self.recompute_passes, self.chunk_passes = {"none": 0, "full": 0}, {}
        self.check_pass_chunks()
        self.add_callback(MetricsFile())
        use_step_lines(self)  # one line per step on the console; every metric in metrics.jsonl
        if self.rollout_func is not None:
            self.rollout_func = self._in_rollout_mode(self.rollout_func)
        if self.accelerator.is_main_process:
            logger.info(
                "settings that differ from trl's GRPOConfig defaults: %s",
                ", ".join(f"{k}={_shown(v)!r} (trl: {_shown(d)!r})" for k, (v, d) in differences.items()) or "none",
            )

    # ------------------------------------------------------------------ training step

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """trl's step (rollout when due, loss, backward) with cuDNN's attention kernels switched off."""
        with cudnn_attention_disabled():
            return super().training_step(*args, **kwargs)

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if torch.cuda.is_available() and self.model.training:
            self._metrics["train"]["memory/peak_gb"].append(torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Save as transformers does, then write the completion marker, then rotate old checkpoints
        (rotation waits for the marker so a crash can never leave fewer complete checkpoints)."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's files (its RNG state) are in before the marker
        if not self.args.should_save:
            return
        run_dir = self._get_output_dir(trial=trial)
        ckpt = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        umask_modes(ckpt)  # safetensors writes the adapter 0600: readable by the umask's users, as the rest
        marker = {
            "global_step": self.state.global_step,
            "max_steps": self.state.max_steps,
            "rollout_engine": self.args.rollout_engine,
            "aqn": None
            if self.aqn is None
            else {
                "sigma_start": self.aqn.sigma_start,
                "sigma_end": self.aqn.sigma_end,
                "num_stages": self.aqn.num_stages,
                "schedule": self.aqn.schedule,
                "resample": self.args.aqn_resample,
                "stage": self.aqn.stage(self.state.global_step, max(1, self.state.max_steps)),
                "next_sigma": self.current_sigma(),
            },
        }
        atomic_write_text(ckpt / CHECKPOINT_MARKER, json.dumps(marker, indent=1))
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """trl's card, naming a base model that is a local directory: trl names only hub ids, and its template then
        reads "a fine-tuned version of [None](https://huggingface.co/None)"."""
        super().create_model_card(*args, **kwargs)
        base, card = get_config_model_id(self.model.config), Path(self.args.output_dir) / "README.md"
        if self.is_world_process_zero() and base and Path(base).is_dir() and card.is_file():
            named = f"`{base}` (a local model directory; run_config.json records its content digest)"
            atomic_write_text(card, card.read_text().replace("[None](https://huggingface.co/None)", named))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """``resume_from_checkpoint=True`` resumes from the newest complete checkpoint of output_dir."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"--resume_from_checkpoint: no complete checkpoint in {self.args.output_dir}")
        if resume_from_checkpoint:
            path = Path(resume_from_checkpoint)
            if not (path / CHECKPOINT_MARKER).exists():
                raise ValueError(
                    f"--resume_from_checkpoint {path}: incomplete (no {CHECKPOINT_MARKER}); the save was interrupted"
                )
            self._resume_marker = json.loads((path / CHECKPOINT_MARKER).read_text())
            if 0 < self.args.max_steps <= self._resume_marker.get("global_step", 0):
                return self._restore_finished(path)
            self.add_callback(_ResumeCheck(self))
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def _restore_finished(self, checkpoint: Path) -> TrainOutput:
        """Load a checkpoint that already reached ``max_steps`` (weights and state) and train nothing:
        transformers' loop runs a step before it checks ``max_steps``, so ``train`` would overshoot."""
        self._load_from_checkpoint(str(checkpoint))
        self.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        logger.info(
            "%s is at step %d, max_steps is %d: restored, nothing left to train",
            checkpoint,
            self.state.global_step,
            self.args.max_steps,
        )
        return TrainOutput(self.state.global_step, float("nan"), {})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """transformers' restore, then each parameter group's learning rate re-derived from the restored step on
        *this* run's schedule. The optimizer file holds the rate of the checkpoint's plan: after extending
        ``--max_steps`` that was its end of schedule (0 for linear and cosine decay), and the first new step ran at it."""
        super()._load_optimizer_and_scheduler(checkpoint)
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)  # accelerate wraps it
        if checkpoint is None or not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            return
        rates = [
            base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = rates

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """transformers' restore, then the restored adapter checked as every loaded tensor is
        (``qerl.load.integrity``): a checkpoint whose adapter holds NaN would otherwise train on in NaN."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        for name, param in (model or self.model).named_parameters():
            if param.requires_grad:
                check_tensor(name, param.detach(), resume_from_checkpoint)


class _ResumeCheck(TrainerCallback):
    """After the state is restored: log the AQN stage resumed at, warn if the schedule moved."""

    def __init__(self, trainer: QeRLTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        marker = self.trainer._resume_marker or {}
        if marker.get("max_steps") not in (None, state.max_steps):
            logger.warning(
                "resumed run plans %d steps, the checkpoint's run planned %s: the learning-rate and AQN schedules are "
                "re-planned to end at step %d (learning rate now %.3g)",
                state.max_steps,
                marker.get("max_steps"),
                state.max_steps,
                self.trainer._get_learning_rate(),
            )
        if self.trainer.aqn is not None:
            logger.info(
                "resumed at step %d: AQN stage %d, sigma %.3g",
                state.global_step,
                self.trainer.aqn.stage(state.global_step, max(1, state.max_steps)),
                self.trainer.current_sigma(),
            )


__all__ = ["QeRLConfig", "QeRLTrainer", "last_complete_checkpoint", "CHECKPOINT_MARKER", "METRICS_FILE"]
