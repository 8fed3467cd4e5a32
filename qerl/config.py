"""``QeRLConfig``: the training settings, with the reference's defaults, and the defaults that can only
be filled in once the model is known (``with_model_defaults``).

Kept apart from ``qerl.trainer`` so that what a run is configured to do (defaults, validation) and how
the trainer does it can be read separately.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub import get_token
from torch import nn
from trl import GRPOConfig

from qerl.aqn import RESAMPLE_MODES, SCHEDULES, AQNSchedule
from qerl.rollout import KINDS

logger = logging.getLogger(__name__)

_BNB_OPTIMIZERS = ("8bit", "bnb", "lion_32bit", "paged_")
#: Learning rates of the reference recipes (qerl_method.md §6.2): NVFP4+LoRA, bf16 LoRA.
LR_NVFP4, LR_BF16 = 1e-5, 5e-6
#: Completion budget of the reference's scripts for data sets without a preset of their own (and its
#: QeRLConfig default); ``qerl.data`` holds the presets (gsm8k 2048, bigmath 4096).
DEFAULT_COMPLETION_LENGTH = 8192


@dataclass
class QeRLConfig(GRPOConfig):
    """GRPOConfig with the QeRL recipe's defaults, the rollout engine choice and AQN.

    Defaults that differ from trl's are the reference's scripts' (qerl_method.md §6): epsilon_high
    0.28, beta 0, bnpo (token-level) loss, truncated completions masked, grad clip 0.2, cosine schedule
    with 10% warmup, AdamW betas (0.9, 0.99), weight decay 0.1, one epoch, AQN sigma 1e-2 -> 1e-4 over
    10 stages. Three defaults depend on the model or the data and are filled in later, when those are
    known (``with_model_defaults``; ``qerl.train`` for the data set): ``learning_rate`` (1e-5 NVFP4,
    5e-6 bf16), ``aqn`` (on for NVFP4 models only) and ``max_completion_length`` (the reference
    scripts' preset for the data set; 8192 when there is none).
    """

    learning_rate: float | None = field(
        default=None, metadata={"help": "Peak LR; unset: 1e-5 for NVFP4 models, 5e-6 for bf16."}
    )
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the data (the reference's 1; trl's 3)."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Completion token budget; unset: the reference scripts' preset for "
                                        "--dataset (gsm8k 2048, bigmath 4096, else 8192)."}
    )
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip (DAPO clip-higher)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient (0: no reference model)."})
    loss_type: str = field(default="bnpo", metadata={"help": "grpo | bnpo | dr_grpo | dapo (trl's loss types)."})
    mask_truncated_completions: bool = field(
        default=True, metadata={"help": "Drop completions without EOS from the loss."}
    )
    max_grad_norm: float = field(default=0.2, metadata={"help": "Gradient clipping."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "LR schedule."})
    warmup_steps: float = field(default=0.1, metadata={"help": "Warmup steps, or a fraction of the run if < 1."})
    warmup_ratio: float | None = field(
        default=None, metadata={"help": "Reference spelling of a fractional warmup_steps."}
    )
    adam_beta2: float = field(default=0.99, metadata={"help": "AdamW beta2."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 autocast; unset: on with CUDA, off on CPU."})
    vllm_importance_sampling_mode: str = field(
        default="token_truncate", metadata={"help": "Rollout IS correction mode (see qerl.trainer docstring)."}
    )
    vllm_importance_sampling_clip_max: float | None = field(default=2.0, metadata={"help": "IS cap C."})
    # Data parallelism (`accelerate launch`): the buffers are the frozen packed weights, identical on every
    # rank (each loads the same checkpoint), so DDP must not re-broadcast them (tens of GB) every forward;
    # every trainable tensor (LoRA, norms) is used in every forward, so DDP need not search for unused ones.
    ddp_broadcast_buffers: bool | None = field(default=False, metadata={"help": "DDP: re-broadcast buffers each forward."})
    ddp_find_unused_parameters: bool | None = field(default=False, metadata={"help": "DDP: look for unused parameters."})
    push_to_hub: bool = field(
        default=False, metadata={"help": "Upload checkpoints and the final adapter to the Hub repo --hub_model_id "
                                         "(default: the output dir's name); only with a token configured, else a note."}
    )

    rollout_engine: str = field(default="native", metadata={"help": f"Rollout engine: one of {KINDS}."})
    rollout_engine_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Extra engine constructor arguments (JSON)."}
    )

    aqn: bool | None = field(
        default=None, metadata={"help": "Adaptive Quantization Noise on the rollout's q/k/v and gate/up norms; "
                                        "unset: on for NVFP4 models only (as the reference)."}
    )
    sigma_start: float = field(default=1e-2, metadata={"help": "AQN sigma of stage 1."})
    sigma_end: float = field(default=1e-4, metadata={"help": "AQN sigma of the last stage (the reference's scripts)."})
    num_stages: int = field(default=10, metadata={"help": "AQN stages over the run (stage 0 is noise-free)."})
    aqn_schedule: str = field(default="exponential", metadata={"help": f"AQN decay: one of {SCHEDULES}."})
    aqn_resample: str = field(default="step", metadata={"help": f"AQN draw frequency: one of {RESAMPLE_MODES}."})

    def __post_init__(self) -> None:
        if self.warmup_ratio is not None:
            if not 0 <= self.warmup_ratio < 1:
                raise ValueError(f"--warmup_ratio: expected a fraction in [0, 1), got {self.warmup_ratio}")
            self.warmup_steps = self.warmup_ratio
        if self.bf16 is None and not self.fp16:
            self.bf16 = torch.cuda.is_available()
        if not torch.cuda.is_available():  # what makes `accelerate launch` give CPU-only processes gloo DDP
            self.use_cpu = True
        if self.use_vllm:  # the reference's --use-vllm True: our vLLM engine, not trl's (see qerl.trainer's docstring)
            self.rollout_engine, self.use_vllm = "vllm", False
        if isinstance(self.rollout_engine_kwargs, str):
            try:
                self.rollout_engine_kwargs = json.loads(self.rollout_engine_kwargs)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"--rollout_engine_kwargs: expected a JSON object, got {self.rollout_engine_kwargs!r} ({e})"
                ) from None
        if self.rollout_engine not in KINDS:
            raise ValueError(f"--rollout_engine: expected one of {KINDS}, got {self.rollout_engine!r}")
        if self.aqn_resample not in RESAMPLE_MODES:
            raise ValueError(f"--aqn_resample: expected one of {RESAMPLE_MODES}, got {self.aqn_resample!r}")
        if self.aqn is not False:  # on, or on for an NVFP4 model: either way the schedule must be valid
            AQNSchedule(self.sigma_start, self.sigma_end, self.num_stages, self.aqn_schedule)  # validates
        if self.push_to_hub and not (self.hub_token or get_token()):
            logger.warning("--push_to_hub: no Hugging Face token is configured (HF_TOKEN, `hf auth login` or "
                           "--hub_token), so nothing will be uploaded; the run stays in --output_dir %s", self.output_dir)
            self.push_to_hub = False
        if any(tag in str(self.optim) for tag in _BNB_OPTIMIZERS) and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                f"--optim {self.optim}: needs bitsandbytes, which is not installed (pip install bitsandbytes)"
            )
        super().__post_init__()

    @property
    def aqn_plan(self) -> AQNSchedule | None:
        return AQNSchedule(self.sigma_start, self.sigma_end, self.num_stages, self.aqn_schedule) if self.aqn else None


def with_model_defaults(args: QeRLConfig, model: Any) -> QeRLConfig:
    """A copy of ``args`` with the model-dependent defaults filled in (the caller's config is left as is).

    AQN defaults to on exactly when the model is NVFP4, as the reference (it switched its noise
    scheduler on only for those); it tested the *path* for the substring ``nvfp4``, we test the loaded
    model for NVFP4 layers, so a renamed checkpoint cannot change the experiment.
    """
    from qerl.loader import is_nvfp4_model

    nvfp4 = isinstance(model, nn.Module) and is_nvfp4_model(model)
    args = copy.copy(args)
    if args.learning_rate is None:
        args.learning_rate = LR_NVFP4 if nvfp4 else LR_BF16
    if args.aqn is None:
        args.aqn = nvfp4
        logger.info("AQN %s (default for a%s model; set --aqn to choose)", "on" if nvfp4 else "off",
                    "n NVFP4" if nvfp4 else " dense")
    if args.max_completion_length is None:
        args.max_completion_length = DEFAULT_COMPLETION_LENGTH
    return args


__all__ = ["QeRLConfig", "with_model_defaults", "LR_NVFP4", "LR_BF16", "DEFAULT_COMPLETION_LENGTH"]
