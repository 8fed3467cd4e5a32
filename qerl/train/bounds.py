"""The range of every number a training run takes, in one place: :func:`check_numbers` holds a settings dataclass
(``QeRLConfig``, the CLI's ``ScriptArguments``) to :data:`BOUNDS`, every other float setting to a finite value and
every other integer one to :data:`INT_LIMIT`, and names the flag of the first value out of range in one line.

Why: trl, transformers and torch check few of these, late or not at all. ``--top_p nan`` was a traceback from trl's
sampling parameters, ``--beta nan`` made every gradient NaN, ``--epsilon nan`` trained with loss 0 (every ratio
"clipped"), ``--max_grad_norm nan`` and ``--lora_dropout nan`` were taken without a word, and
``--max_completion_length 1000000000`` asked the rollout engine for 512 GB before a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: The largest integer any setting takes: what a C ``int`` holds (seeds, ports, step counts and sizes all fit).
INT_LIMIT = 2**31 - 1
#: The largest token budget (prompt, completion, context): a million tokens, past every model's context.
MAX_TOKENS = 1 << 20
#: The largest batch dimension (prompts per device, completions per prompt, accumulation and generation steps).
MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class Bound:
    """An interval ``low .. high`` (None: unbounded on that side; ``open``: that end excluded), with why it holds."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def admits(self, value: float) -> bool:
        above = self.low is None or value > self.low or (not self.low_open and value == self.low)
        below = self.high is None or value < self.high or (not self.high_open and value == self.high)
        return math.isfinite(value) and above and below

    def describe(self, integer: bool) -> str:
        """'a positive integer', 'a number in (0, 1]', ...: what the refusal says was expected."""
        noun = "an integer" if integer else "a finite number"
        if (self.low, self.high, self.low_open) == (1, None, False) and integer:
            text = "a positive integer"
        elif (self.low, self.high, self.low_open) == (0, None, False) and not integer:
            text = "a non-negative number"
        elif self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{noun} in {left}{_text(self.low)}, {_text(self.high)}{right}"
        elif self.low is not None:
            text = f"{noun} {'>' if self.low_open else '>='} {_text(self.low)}"
        else:
            text = noun
        return f"{text} ({self.why})" if self.why else text


def _text(number: float) -> str:
    """1048576 as 1048576, not 1.04858e+06."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


_TOKENS, _BATCH = Bound(1, MAX_TOKENS), Bound(1, MAX_BATCH)
_NON_NEGATIVE, _POSITIVE, _FRACTION = Bound(0), Bound(0, low_open=True), Bound(0, 1, high_open=True)
#: Settings with a range of their own (by field name, for any settings class that has the field).
BOUNDS: dict[str, Bound] = {
    **dict.fromkeys(
        ("max_completion_length", "max_prompt_length", "heldout_max_tokens", "vllm_max_model_length"), _TOKENS
    ),
    **dict.fromkeys(
        (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "steps_per_generation",
            "num_iterations",
        ),
        _BATCH,
    ),
    "num_generations": Bound(2, MAX_BATCH, why="GRPO compares completions of one prompt"),
    **dict.fromkeys(("lora_rank", "lora_alpha", "num_samples", "generation_batch_size"), Bound(1)),
    **dict.fromkeys(("heldout", "top_k"), Bound(0)),
    "pass_chunk_rows": Bound(0, MAX_BATCH, why="0: never chunk; unset: auto"),
    **dict.fromkeys(("seed", "data_seed"), Bound(0, INT_LIMIT)),  # numpy takes no negative seed
    **dict.fromkeys(
        (
            "learning_rate",
            "beta",
            "epsilon",
            "epsilon_high",
            "max_grad_norm",
            "weight_decay",
            "adam_epsilon",
            "warmup_steps",
            "vllm_importance_sampling_clip_min",
        ),
        _NON_NEGATIVE,
    ),
    **dict.fromkeys(
        (
            "num_train_epochs",
            "logging_steps",
            "save_steps",
            "repetition_penalty",
            "delta",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_cap",
        ),
        _POSITIVE,
    ),
    "temperature": Bound(0, low_open=True, why="rollouts must sample"),
    **dict.fromkeys(("lora_dropout", "adam_beta1", "adam_beta2", "warmup_ratio"), _FRACTION),
    **dict.fromkeys(("top_p", "vllm_gpu_memory_utilization"), Bound(0, 1, low_open=True)),
    **dict.fromkeys(("min_p", "top_entropy_quantile"), Bound(0, 1)),
}


def _kinds(hint: Any) -> set[type]:
    """The number types among a field's annotation (``int | None`` -> {int}, ``list[float]`` -> {float})."""
    if typing.get_origin(hint) in (list, typing.Union, types.UnionType):  # the number types of its members
        return set().union(*(_kinds(arg) for arg in typing.get_args(hint)))
    return {hint} & {int, float}


def check_numbers(settings: Any, skip: Iterable[str] = ()) -> None:
    """Raise ValueError (``--FLAG: expected ..., got VALUE``) for the first number field of dataclass ``settings``
    out of its :data:`BOUNDS` range, not finite (floats), not an integer or past :data:`INT_LIMIT` (integers).
    ``skip`` names fields left alone (the reference's ignored flags). None and strings are left to their owners."""
    hints = typing.get_type_hints(type(settings))
    for f in dataclasses.fields(settings):
        kinds = _kinds(hints[f.name]) if f.init and f.name not in skip else set()
        value = getattr(settings, f.name)
        for item in value if isinstance(value, list) else [value]:
            if not kinds or item is None or isinstance(item, str):
                continue
            integer = float not in kinds
            bound = BOUNDS.get(f.name, Bound(-INT_LIMIT, INT_LIMIT) if integer else Bound())
            number = isinstance(item, int if integer else (int, float)) and not isinstance(item, bool)
            if not number or not bound.admits(item) or (integer and abs(item) > INT_LIMIT):
                raise ValueError(f"--{f.name}: expected {bound.describe(integer)}, got {item!r}")


__all__ = ["BOUNDS", "Bound", "INT_LIMIT", "MAX_BATCH", "MAX_TOKENS", "check_numbers"]
