"""The named training data sets: where each lives, the prompt style the reference used for it, the rewards it trains
with, how its answers are read (``qerl.tasks.answers``) and the completion budget of the reference's scripts.

Reading the rows is training's (``qerl.train.data``); what a name means is here, beside the prompts and answers it
refers to, so that the flags (``qerl.train.args``), the run and its held-out accuracy read one table.
"""

from __future__ import annotations

from dataclasses import dataclass

from qerl.tasks.prompts import PROMPT_STYLES, SOURCE_STYLE

#: The reference scripts' completion budget for a data set without a preset of its own.
DEFAULT_COMPLETION_LENGTH = 8192


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named data set lives and how it is prompted and rewarded."""

    hub_id: str | None
    config: str | None
    style: str  # the prompt style the reference used for it (qerl.tasks.prompts)
    rewards: tuple[str, ...]
    reading: str  # how its answers are read and judged: one of qerl.tasks.answers.READINGS
    completion_length: int = DEFAULT_COMPLETION_LENGTH  # the reference scripts' budget for this set
    question_fields: tuple[str, ...] = ("question", "problem", "prompt")
    answer_fields: tuple[str, ...] = ("answer", "solution", "final_answer")


_BIGMATH = "open-r1/Big-Math-RL-Verified-Processed"
#: Prompt styles and completion budgets are the reference's (its run scripts and its prompt code); ``arithmetic`` is
#: ours, with the tag prompt its recipes were calibrated on.
DATASETS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("openai/gsm8k", "main", "plain", ("soft_format", "gsm8k"), "numeric", 2048),
    "bigmath": DatasetSpec(_BIGMATH, "level_3_4_5", "tags", ("soft_format", "math"), "math", 4096),
    "bigmath_hard": DatasetSpec(_BIGMATH, "level_4_5", "tags", ("soft_format", "math"), "math", 4096),
    "dapo-math": DatasetSpec("open-r1/DAPO-Math-17k-Processed", "en", SOURCE_STYLE, ("dapo",), "dapo"),
    "arithmetic": DatasetSpec(None, None, "tags", ("soft_format", "gsm8k"), "numeric"),
}
#: The reference's spellings.
ALIASES = {"dapomath": "dapo-math", "dapo_math": "dapo-math", "bigmath-hard": "bigmath_hard"}


def canonical(name: str) -> str:
    """The name :data:`DATASETS` knows a data set by (the reference's spellings resolved)."""
    return ALIASES.get(name, name)


def spec(name: str) -> DatasetSpec:
    key = canonical(name)
    if key not in DATASETS:
        raise ValueError(f"--dataset: unknown {name!r}; expected one of {sorted(DATASETS)}")
    return DATASETS[key]


def prompt_style(name: str, style: str | None) -> str:
    """The prompt style a run uses: ``style`` when given (checked), else the data set's own."""
    if style is None:
        return spec(name).style
    if style not in (*PROMPT_STYLES, SOURCE_STYLE):
        raise ValueError(f"--prompt-style: unknown {style!r}; expected one of {sorted((*PROMPT_STYLES, SOURCE_STYLE))}")
    return style
