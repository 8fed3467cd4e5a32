"""``QeRLConfig``: trl's ``GRPOConfig`` plus the rollout engine and AQN, and the defaults that can only
be filled in once the model is known (``with_model_defaults``).

``QeRLConfig()`` keeps every trl default except the few QeRL's method or qerl's engines need otherwise
(``TRL_DEFAULT_OVERRIDES`` lists them with the reason); the reference's DAPO recipe (bnpo loss,
clip-higher 0.28, truncated completions masked, grad clip 0.2, cosine schedule, weight decay 0.1, one
epoch) is spelled out in ``training/recipes/*.yaml``, where a run shows what it uses. A trl user's
working ``GRPOConfig`` settings therefore mean the same here.

Kept apart from ``qerl.train.trainer`` so that what a run is configured to do (defaults, validation) and how
the trainer does it can be read separately.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub import get_token
from torch import nn
from trl import GRPOConfig

from qerl.rollout import KINDS
from qerl.train.aqn import RESAMPLE_MODES, SCHEDULES, AQNSchedule
from qerl.train.bounds import check_numbers

logger = logging.getLogger(__name__)

_BNB_OPTIMIZERS = ("8bit", "bnb", "lion_32bit", "paged_")
#: Learning rates of the reference recipes (the reference's run scripts): NVFP4+LoRA, bf16 LoRA.
LR_NVFP4, LR_BF16 = 1e-5, 5e-6
#: trl's own default, used by the trainer when ``max_completion_length`` is left unset outside the CLI.
TRL_COMPLETION_LENGTH = 512
#: The fields whose ``QeRLConfig`` default differs from trl's ``GRPOConfig`` default, and why.
TRL_DEFAULT_OVERRIDES: dict[str, str] = {
    "learning_rate": "unset: 1e-5 for NVFP4 models, 5e-6 for bf16 (the paper's LoRA rates; trl's 1e-6 is a "
    "full fine-tuning rate, and LoRA barely moves at it)",
    "max_completion_length": "unset: trl's 512 in the trainer; the CLI fills in the data set's budget",
    "vllm_importance_sampling_mode": "token_truncate: AQN shifts every token's log-prob, and trl's sequence_mask "
    "would drop almost every noisy completion",
    "vllm_importance_sampling_clip_max": "2.0 with token_truncate (FlashRL/verl's TIS cap); trl's 3.0 is its "
    "sequence-level cap",
    "bf16": "unset: on with CUDA, off on CPU (bf16 autocast is emulated, and many times slower, on CPUs)",
    "gradient_checkpointing": "unset: with CUDA, no recompute while the card's free memory holds the training pass's "
    "activations, else full (qerl.train.recompute); without CUDA on, as trl",
    "ddp_broadcast_buffers": "False: the packed NVFP4 weights are buffers, identical on every rank; "
    "re-broadcasting tens of GB each forward would dominate the step",
    "ddp_find_unused_parameters": "False: every LoRA/norm parameter is used in every forward",
    "use_cpu": "True without CUDA, so that `accelerate launch` gives CPU processes gloo DDP",
}


@dataclass
class QeRLConfig(GRPOConfig):
    """GRPOConfig with trl's defaults except ``TRL_DEFAULT_OVERRIDES``, plus the rollout engine and AQN.

    Three defaults depend on the model or the data and are filled in later, when those are known
    (``with_model_defaults``; ``qerl.train.run`` for the data set): ``learning_rate`` (1e-5 NVFP4, 5e-6
    bf16), ``aqn`` (on for NVFP4 models only) and ``max_completion_length`` (trl's 512; the CLI: the
    reference scripts' budget for the data set). The reference's DAPO recipe is in ``training/recipes``.
    """

    learning_rate: float | None = field(
        default=None, metadata={"help": "Peak LR; unset: 1e-5 for NVFP4 models, 5e-6 for bf16."}
    )
    max_completion_length: int | None = field(
        default=None,
        metadata={
            "help": "Completion token budget; unset: trl's 512 (python -m qerl.train: the "
            "reference scripts' budget for --dataset: gsm8k 2048, bigmath 4096, else 8192)."
        },
    )
    warmup_ratio: float | None = field(
        default=None, metadata={"help": "Reference spelling of a fractional warmup_steps."}
    )
    bf16: bool | None = field(default=None, metadata={"help": "bf16 autocast; unset: on with CUDA, off on CPU."})
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Recompute activations in the backward: True full, False none; unset (null): auto with CUDA (none "
            "while the card's free memory holds the pass's activations, else full; qerl.train.recompute), on without "
            "CUDA.",
            # A bare --gradient_checkpointing means True, as with trl's flag (argparse reads these keys).
            "nargs": "?",
            "const": True,
        },
    )
    pass_chunk_rows: int | None = field(
        default=None,
        metadata={
            "help": "Rows (completions) per forward + backward of a training pass, the loss and metrics still the "
            "micro-batch's (qerl.train.chunked_pass); unset (null): chunks without recompute where the "
            "checkpointing is auto and a whole pass does not fit the card but a chunk does; 0: never; N: chunks of N."
        },
    )
    release_rollout_memory: bool | None = field(
        default=None,
        metadata={
            "help": "Free the native engine's KV cache and decode graphs before the training pass (the next rollout "
            "allocates them again and captures its graphs anew): True every step, False never; unset (null): only "
            "where the pass would not fit beside them even with full recompute (qerl.train.recompute).",
            "nargs": "?",
            "const": True,
        },
    )
    fused_layers: bool = field(
        default=True,
        metadata={
            "help": "On CUDA, run the decoder's RMSNorms and SiLU MLPs through one Triton kernel each way, keeping "
            "less for the backward (qerl.train.fused_layers); False: transformers' modules."
        },
    )
    fold_lora_expand: bool = field(
        default=False,
        metadata={
            "help": "Add each LoRA expand into its base projection's output in one GEMM (addmm): the delta is never "
            "written and read back, and the sum is rounded once instead of twice (qerl.load.lora.DirectLoraForward)."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate", metadata={"help": "Rollout IS correction mode (see qerl.train.trainer docstring)."}
    )
    vllm_importance_sampling_clip_max: float | None = field(default=2.0, metadata={"help": "IS cap C."})
    is_ratio_from_loss_pass: bool = field(
        default=True,
        metadata={
            "help": "Take the rollout IS ratio from the loss forward's log-probs when each "
            "generation feeds one optimizer step, skipping trl's extra no-grad pass over "
            "the batch (the same ratio: qerl.train.is_ratio); False: trl's separate pass."
        },
    )
    # Data parallelism (`accelerate launch`): the buffers are the frozen packed weights, identical on every
    # rank (each loads the same checkpoint), so DDP must not re-broadcast them (tens of GB) every forward;
    # every trainable tensor (LoRA, norms) is used in every forward, so DDP need not search for unused ones.
    ddp_broadcast_buffers: bool | None = field(
        default=False, metadata={"help": "DDP: re-broadcast buffers each forward."}
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "DDP: look for unused parameters."}
    )
    push_to_hub: bool = field(
        default=False,
        metadata={
            "help": "Upload checkpoints and the final adapter to the Hub repo --hub_model_id "
            "(default: the output dir's name); only with a token configured, else a note."
        },
    )

    rollout_engine: str = field(default="native", metadata={"help": f"Rollout engine: one of {KINDS}."})
    rollout_engine_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra engine constructor arguments (JSON)."}
    )

    aqn: bool | None = field(
        default=None,
        metadata={
            "help": "Adaptive Quantization Noise on the rollout's q/k/v and gate/up norms; "
            "unset: on for NVFP4 models only (as the reference)."
        },
    )
    sigma_start: float = field(default=1e-2, metadata={"help": "AQN sigma of stage 1."})
    sigma_end: float = field(default=1e-4, metadata={"help": "AQN sigma of the last stage (the reference's scripts)."})
    num_stages: int = field(default=10, metadata={"help": "AQN stages over the run (stage 0 is noise-free)."})
    aqn_schedule: str = field(default="exponential", metadata={"help": f"AQN decay: one of {SCHEDULES}."})
    aqn_resample: str = field(default="step", metadata={"help": f"AQN draw frequency: one of {RESAMPLE_MODES}."})

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.warmup_ratio is not None:
            self.warmup_steps = self.warmup_ratio
        if self.bf16 is None and not self.fp16:
            self.bf16 = torch.cuda.is_available()
        if self.gradient_checkpointing is None and not torch.cuda.is_available():
            self.gradient_checkpointing = True  # no device memory to weigh the recompute against: trl's default
        if not torch.cuda.is_available():  # what makes `accelerate launch` give CPU-only processes gloo DDP
            self.use_cpu = True
        if (
            self.use_vllm
        ):  # the reference's --use-vllm True: our vLLM engine, not trl's (see qerl.train.trainer's docstring)
            self.rollout_engine, self.use_vllm = "vllm", False
        if isinstance(self.rollout_engine_kwargs, str):
            try:
                self.rollout_engine_kwargs = json.loads(self.rollout_engine_kwargs)
            except RecursionError:
                raise ValueError("--rollout_engine_kwargs: nested too deeply to read; expected a JSON object") from None
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"--rollout_engine_kwargs: expected a JSON object, got {self.rollout_engine_kwargs!r} ({e})"
                ) from None
        if self.rollout_engine not in KINDS:
            raise ValueError(f"--rollout_engine: expected one of {KINDS}, got {self.rollout_engine!r}")
        if (
            self.loss_type == "vespo"
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
        ):  # trl refuses it only with its own vLLM; the correction is on for every qerl engine
            raise ValueError(
                "--loss_type vespo: needs --vllm_importance_sampling_mode token_truncate or token_mask (trl's rule), "
                f"got {self.vllm_importance_sampling_mode}; or --vllm_importance_sampling_correction False"
            )
        if self.aqn_resample not in RESAMPLE_MODES:
            raise ValueError(f"--aqn_resample: expected one of {RESAMPLE_MODES}, got {self.aqn_resample!r}")
        if self.aqn is not False:  # on, or on for an NVFP4 model: either way the schedule must be valid
            AQNSchedule(self.sigma_start, self.sigma_end, self.num_stages, self.aqn_schedule)  # validates
        if self.push_to_hub and not (self.hub_token or get_token()):
            logger.warning(
                "--push_to_hub: no Hugging Face token is configured (HF_TOKEN, `hf auth login` or "
                "--hub_token), so nothing will be uploaded; the run stays in --output_dir %s",
                self.output_dir,
            )
            self.push_to_hub = False
        if any(tag in str(self.optim) for tag in _BNB_OPTIMIZERS) and importlib.util.find_spec("bitsandbytes") is None:
            # The GPU recipes ask for 8-bit AdamW; without bitsandbytes (CPU installs) a recipe must still run.
            # Only LoRA and norm weights train, so 32-bit states cost little: ~0.3 GB at rank 16 on a 7B model.
            logger.warning(
                "--optim %s: bitsandbytes is not installed, using adamw_torch "
                "(pip install bitsandbytes for the 8-bit optimizer)",
                self.optim,
            )
            self.optim = "adamw_torch"
        super().__post_init__()

    def _check_numbers(self) -> None:
        """Every number in its range (``qerl.train.bounds``), before trl and transformers take values they fail on
        only later (a ZeroDivisionError building the config, a traceback in the first step, NaN weights, a run that
        never samples), in one line naming the flag."""
        steps = self.max_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not (steps == -1 or steps >= 1):
            raise ValueError(
                f"--max_steps: expected a positive integer (or -1: --num_train_epochs decides), got {steps!r}"
            )
        check_numbers(self)

    @property
    def aqn_plan(self) -> AQNSchedule | None:
        return AQNSchedule(self.sigma_start, self.sigma_end, self.num_stages, self.aqn_schedule) if self.aqn else None


def with_model_defaults(args: QeRLConfig, model: Any) -> QeRLConfig:
    """A copy of ``args`` with the model-dependent defaults filled in (the caller's config is left as is).

    AQN defaults to on exactly when the model is NVFP4, as the reference (it switched its noise
    scheduler on only for those); it tested the *path* for the substring ``nvfp4``, we test the loaded
    model for NVFP4 layers, so a renamed checkpoint cannot change the experiment.
    """
    from qerl.load.loader import is_nvfp4_model

    nvfp4 = isinstance(model, nn.Module) and is_nvfp4_model(model)
    args = copy.copy(args)
    if args.learning_rate is None:
        args.learning_rate = LR_NVFP4 if nvfp4 else LR_BF16
    if args.aqn is None:
        args.aqn = nvfp4
        logger.info(
            "AQN %s (default for a%s model; set --aqn to choose)",
            "on" if nvfp4 else "off",
            "n NVFP4" if nvfp4 else " dense",
        )
    if args.max_completion_length is None:
        args.max_completion_length = TRL_COMPLETION_LENGTH
    return args


def trl_differences(args: GRPOConfig) -> dict[str, tuple[Any, Any]]:
    """``{field: (value in args, trl's GRPOConfig default)}`` for every GRPOConfig field that differs.

    Why: a run's behaviour should never differ from trl's for a reason the user cannot see; the trainer
    logs this once at start-up. trl's defaults come from a ``GRPOConfig`` built with the same output_dir,
    batch shape (the generation batch included: without it trl refuses every optimizer batch that is not a
    multiple of ``num_generations``, which a set generation batch makes valid) and device choice (trl's own
    default cannot be built on a CPU-only machine), so values trl derives from those (logging dir) are not
    reported. A reference trl still refuses only costs the report (a warning): logging never stops a run.
    """
    same = (
        "output_dir",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_generations",
        "use_cpu",
        "steps_per_generation",
    )
    try:  # steps_per_generation alone: trl derives the generation batch from it and refuses both at once
        reference = GRPOConfig(**{name: getattr(args, name) for name in same})
    except (ValueError, TypeError) as e:
        logger.warning("could not list the settings that differ from trl's defaults (%s)", e)
        return {}
    same += ("generation_batch_size",)
    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if not f.init or f.name in same:
            continue
        ours, theirs = getattr(args, f.name, None), getattr(reference, f.name, None)
        if ours != theirs:
            out[f.name] = (ours, theirs)
    return out


__all__ = [
    "QeRLConfig",
    "with_model_defaults",
    "trl_differences",
    "TRL_DEFAULT_OVERRIDES",
    "LR_NVFP4",
    "LR_BF16",
    "TRL_COMPLETION_LENGTH",
]
