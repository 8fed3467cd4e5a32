"""The command line of ``python -m qerl.train``: ``ScriptArguments`` (model, data, LoRA) and ``parse_args``, which
reads a ``--config`` recipe (``qerl.train.recipe``) and the flags with trl's parser, every mistake one line.

Kept apart from the run itself (``qerl.train.run``) so that what a user may say and what is refused reads on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml
from trl import TrlParser

from qerl.cli import StrictParsing, UsageError, one_line, usage_errors
from qerl.load.lora import DEFAULT_TARGETS
from qerl.tasks import data_sets
from qerl.train import data
from qerl.train.bounds import check_numbers
from qerl.train.config import QeRLConfig
from qerl.train.recipe import load_recipe

#: Reference flags kept only so that its scripts parse; they change nothing here.
IGNORED_REFERENCE_FLAGS = (
    "max_seq_length",
    "fast_inference",
    "random_state",
    "load_in_4bit",
    "load_in_8bit",
    "full_finetuning",
    "gpu_memory_utilization",
    "use_gradient_checkpointing",
    "activation_offloading",
)

#: ``--damaged_checkpoint``: what a resume does when the newest complete checkpoint is damaged.
DAMAGED_CHECKPOINT_CHOICES = ("refuse", "previous")


@dataclass
class ScriptArguments:
    """Model, data and adapter choices (the training knobs live in QeRLConfig)."""

    model_name: str = field(
        default="smollm2-135m", metadata={"help": "Model dir, hub id, or smollm2-135m (embedded default)."}
    )
    load: str = field(default="auto", metadata={"help": "auto | nvfp4 | bf16: what the checkpoint must be."})
    dataset: str = field(
        default="gsm8k", metadata={"help": f"One of {sorted(data_sets.DATASETS)} (or the reference's dapomath)."}
    )
    dataset_path: str | None = field(
        default=None, metadata={"help": "Local .jsonl/.parquet/dir or hub id (default: the set's hub id)."}
    )
    num_samples: int | None = field(default=None, metadata={"help": "Use N rows (seeded shuffle)."})
    arithmetic_level: str | None = field(
        default=None,
        metadata={"help": f"Difficulty of --dataset arithmetic: {sorted(data.ARITHMETIC_LEVELS)} (default hard)."},
    )
    prompt_style: str | None = field(
        default=None,
        metadata={
            "help": "plain | tags | dapo | source (a row's own "
            "conversation); unset: the reference's for the data set (gsm8k plain, bigmath "
            "tags, dapo-math source, arithmetic tags). See qerl/tasks/prompts.py."
        },
    )
    heldout: int = field(
        default=0, metadata={"help": "Hold out N rows; their greedy accuracy is measured before and after."}
    )
    heldout_max_tokens: int = field(default=256, metadata={"help": "Completion budget of the held-out evaluation."})
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Drop prompts longer than this many tokens (default: 4096, or what the model's context leaves "
            "after --max_completion_length when that is less)."
        },
    )
    rewards: list[str] | None = field(default=None, metadata={"help": "Reward names (default: the data set's)."})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank (reference scripts: 16; paper: 32)."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default: the rank)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS), metadata={"help": "LoRA targets."})
    ln: bool = field(
        default=True, metadata={"help": "Also train the input/post-attention RMSNorm weights (all reference scripts)."}
    )
    resume: str = field(
        default="auto",
        metadata={
            "help": "auto: continue output_dir's run if its settings match "
            "(a finished one is a no-op), refuse otherwise; force: continue anyway."
        },
    )
    damaged_checkpoint: str = field(
        default="refuse",
        metadata={
            "help": "refuse: a damaged newest checkpoint stops "
            "the resume in one line; previous: move it aside and resume from the one before."
        },
    )
    force: bool = field(
        default=False,
        metadata={"help": "Run even where the estimated peak GPU memory exceeds the card's free memory."},
    )
    plot: bool = field(default=True, metadata={"help": "Write reward/entropy/sigma curves at the end."})
    max_seq_length: int | None = field(default=None, metadata={"help": "Ignored (reference leftover)."})
    fast_inference: bool | None = field(default=None, metadata={"help": "Ignored (reference leftover)."})
    random_state: int | None = field(default=None, metadata={"help": "Ignored (reference leftover; use --seed)."})
    load_in_4bit: bool | None = field(
        default=None, metadata={"help": "Ignored (reference leftover; NVFP4 comes from the checkpoint)."}
    )
    load_in_8bit: bool | None = field(default=None, metadata={"help": "Ignored (reference leftover)."})
    full_finetuning: bool | None = field(default=None, metadata={"help": "Ignored (reference leftover)."})
    gpu_memory_utilization: float | None = field(
        default=None, metadata={"help": "Ignored (use --vllm_gpu_memory_utilization)."}
    )
    use_gradient_checkpointing: str | None = field(
        default=None, metadata={"help": "Ignored (use --gradient_checkpointing)."}
    )
    activation_offloading: bool | None = field(default=None, metadata={"help": "Ignored (reference leftover)."})


class _Parser(StrictParsing, TrlParser):
    """trl's parser (YAML recipes, both flag spellings) without flag abbreviations, one-line errors."""


def parse_args(argv: Sequence[str] | None = None) -> tuple[ScriptArguments, QeRLConfig]:
    """(script arguments, trainer config) from the command line and its ``--config`` recipe; any
    mistake in either is a UsageError naming the flag or the recipe key."""
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    if argv and argv[-1] == "--config":
        raise UsageError("--config: expected a YAML recipe path")
    if recipe is not None:  # checked whole before trl reads it: trl would expand aliases and take any value
        try:
            load_recipe(recipe, (ScriptArguments, QeRLConfig))
        except yaml.MarkedYAMLError as e:
            where = f", line {e.problem_mark.line + 1}" if e.problem_mark else ""
            raise UsageError(f"--config {recipe}: not valid YAML ({e.problem or e.context}{where})") from None
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise UsageError(f"--config {recipe}: {one_line(e)}") from None
    parser = _Parser((ScriptArguments, QeRLConfig), prog="python -m qerl.train")
    try:
        script, config, unknown_keys, unknown_args = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except (ValueError, TypeError) as e:  # a value the config classes refused; their messages name the flag
        raise UsageError(one_line(e)) from None
    if unknown_keys:
        keys = ", ".join(k.removeprefix("--") for k in unknown_keys[::2])
        raise UsageError(f"--config {recipe}: unknown key(s) {keys} (see python -m qerl.train --help)")
    if unknown_args:
        raise UsageError(f"unrecognized arguments: {' '.join(unknown_args)} (see python -m qerl.train --help)")
    _check_values(script)
    if config.max_completion_length is None:  # the reference scripts' budget for this data set (None: 8192)
        with usage_errors(ValueError):
            config.max_completion_length = data_sets.spec(script.dataset).completion_length
    return script, config


def _check_values(script: ScriptArguments) -> None:
    """Values no library checks before training starts: the script's numbers in their ranges (``QeRLConfig`` checks
    its own, ``qerl.train.bounds``) and its choices."""
    with usage_errors(ValueError):
        check_numbers(script, skip=IGNORED_REFERENCE_FLAGS)
    if script.damaged_checkpoint not in DAMAGED_CHECKPOINT_CHOICES:
        raise UsageError(
            f"--damaged_checkpoint: expected one of {', '.join(DAMAGED_CHECKPOINT_CHOICES)}, "
            f"got {script.damaged_checkpoint!r}"
        )
