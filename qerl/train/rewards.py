"""Reward functions for math RL, in trl's reward-function calling convention.

Each reward is ``fn(completions, answer=None, **kwargs) -> list[float | None]``: trl passes the
dataset's columns as keyword arguments, so ``answer`` is the gold answer column that
``qerl.train.data`` produces for every dataset. ``None`` means "cannot be scored" (trl turns it into NaN
and leaves the row out of the mean), which only ``math_accuracy`` uses, for gold answers
math-verify cannot parse.

These are called exactly as trl calls any reward function, and a user's own reward functions go to
trl untouched (sync or ``async def``; an exception fails the step, as in trl). Only the answer
*parsers* inside these built-in rewards are guarded: math-verify can time out or raise on odd LaTeX,
and one unreadable completion must cost its own reward, not the run. Each such failure scores 0, is
counted in the metric ``rewards/<name>/errors`` (through trl's ``log_metric`` keyword; logged every
step, 0 included) and logged as one warning per batch. A malformed call (no ``answer`` column, a
completion that is neither text nor a chat turn) raises.

Reward scales follow the reference: format rewards 0.2, GSM8K correctness 2.0, math-verify
accuracy and the DAPO ``Answer:`` score 1.0.

Answers are read by ``qerl.tasks.answers`` only, the same reading evaluation and the held-out accuracy use:
a correctness reward is positive exactly when ``answers.judge`` (and so ``eval``) counts the answer
correct. Where this departs from the reference it is on purpose: its GSM8K reward compared the
``<answer>`` text (or the whole response) with the gold as *strings* ("$1,000" != "1000"), and its
BigMath reward ignored the ``<answer>`` tags its own prompt asked for (see ``qerl.tasks.answers``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from qerl.tasks.answers import gsm8k_gold, judge, math_gold_parses, to_number

logger = logging.getLogger(__name__)

FORMAT_REWARD = 0.2
GSM8K_REWARD = 2.0
MATH_REWARD = 1.0
DAPO_REWARD = 1.0

_SOFT_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_STRICT_FORMAT = re.compile(r"^\s*<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\s*$", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of one completion: a plain string, or the last message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"completion: expected a string or a list of chat messages, got {type(completion).__name__}")


def _score_all(
    name: str,
    scorer: Callable[..., float | None],
    completions: Sequence[Any],
    golds: Sequence[Any] | None,
    log_metric: Callable[[str, float], None] | None = None,
) -> list[float | None]:
    """Apply ``scorer(text[, gold])`` to each completion; a scorer exception scores 0, is counted in
    ``rewards/<name>/errors`` (when trl passes ``log_metric``) and logged once per batch."""
    texts = [completion_text(c) for c in completions]  # a malformed completion is the caller's bug: raise
    out: list[float | None] = []
    failures = 0
    first_error = ""
    for i, text in enumerate(texts):
        try:
            out.append(scorer(text) if golds is None else scorer(text, golds[i]))
        except Exception as e:  # a parser failure (math-verify timeout, odd LaTeX) costs one reward, not the run
            failures += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            out.append(0.0)
    if log_metric is not None:
        log_metric(f"rewards/{name}/errors", float(failures))
    if failures:
        logger.warning(
            "reward %s raised on %d/%d completions (scored 0); first error: %s", name, failures, len(out), first_error
        )
    return out


def _need_answer(name: str, answer: Sequence[Any] | None, n: int) -> Sequence[Any]:
    if answer is None or len(answer) != n:
        raise ValueError(f"reward {name}: needs an 'answer' column with one gold answer per completion")
    return answer


def _format_reward(name: str, matches: Callable[[str], Any], doc: str) -> Callable[..., list[float | None]]:
    """A reward of FORMAT_REWARD for each response ``matches`` accepts, else 0; named ``name`` (trl logs it under its
    function's name, and pickling finds it under that module-level name)."""

    def reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        return _score_all(
            name, lambda t: FORMAT_REWARD if matches(t) else 0.0, completions, None, kwargs.get("log_metric")
        )

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = doc
    return reward


soft_format_reward = _format_reward(
    "soft_format_reward",
    _SOFT_FORMAT.search,
    "0.2 when ``<think>...</think>`` is followed by ``<answer>...</answer>`` anywhere in the response.",
)
strict_format_reward = _format_reward(
    "strict_format_reward",
    _STRICT_FORMAT.match,
    "0.2 when the whole response is exactly the tag skeleton, each tag on its own line.",
)


def _numeric_equal(a: Fraction | None, b: Fraction | None) -> bool:
    return a is not None and b is not None and a == b


def _judged(
    name: str,
    reading: str,
    scale: float,
    completions: Sequence[Any],
    answer: Sequence[Any] | None,
    kwargs: dict[str, Any],
) -> list[float | None]:
    """``scale`` for each completion ``answers.judge`` finds correct under ``reading``, else 0."""
    golds = _need_answer(name, answer, len(completions))
    return _score_all(
        name,
        lambda text, gold: scale if judge(text, str(gold), reading) else 0.0,
        completions,
        golds,
        kwargs.get("log_metric"),
    )


def gsm8k_accuracy(
    completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """2.0 when the response's answer equals the gold number, read as evaluation reads it (``numeric``).

    The answer is the last ``<answer>`` block, else ``####``, ``\\boxed``, "the answer is", else the last
    number; compared as numbers, so ``1,000``, ``$1000`` and ``1000.0`` all match ``1000``. The gold
    may be a number or a full GSM8K solution ending in ``#### N``.
    """
    return _judged("gsm8k_accuracy", "numeric", GSM8K_REWARD, completions, answer, kwargs)


def last_number_accuracy(
    completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the *last number* of the response equals the gold, tags or not.

    A lenient signal for models too small to follow the tag format yet (SmolLM2-135M on the
    synthetic arithmetic set): unlike ``gsm8k_accuracy`` a stated answer does not win over a later
    number, so it is easier to game, and not a default anywhere.
    """
    golds = _need_answer("last_number_accuracy", answer, len(completions))

    def score(text: str, gold: Any) -> float:
        return MATH_REWARD if _numeric_equal(to_number(text), to_number(gsm8k_gold(str(gold)))) else 0.0

    return _score_all("last_number_accuracy", score, completions, golds, kwargs.get("log_metric"))


def last_number_closeness(
    completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """``max(0, 1 - |last number - gold| / max(|gold|, 1))``: a shaped, dense reward in [0, 1].

    Why: a 135M model in NVFP4 gets almost no easy sum exactly right when sampling (0 of 8 greedy,
    0 rewarded in 8 quickstart steps on 2026-11-29), so an exact-match reward alone gives GRPO
    all-zero groups and no gradient. Closeness ranks near misses above far ones, so every group has
    a signal; pair it with ``last_number`` so that being exact still pays most. Not for real runs.
    """
    golds = _need_answer("last_number_closeness", answer, len(completions))

    def score(text: str, gold: Any) -> float:
        pred, ref = to_number(text), to_number(gsm8k_gold(str(gold)))
        if pred is None or ref is None:
            return 0.0
        return float(max(Fraction(0), 1 - abs(pred - ref) / max(abs(ref), Fraction(1))))

    return _score_all("last_number_closeness", score, completions, golds, kwargs.get("log_metric"))


def math_accuracy(completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when math-verify finds the response's answer equivalent to the gold; None if the gold is unparseable.

    As the reference's BigMath reward, the whole response is read with ``\\boxed`` first (the
    ``math`` reading of ``qerl.tasks.answers``), and a row whose gold math-verify cannot read is left out
    (None) rather than scored 0; unlike it, a bare ``<answer>`` block counts when nothing else is found.
    """
    golds = _need_answer("math_accuracy", answer, len(completions))

    def score(text: str, gold: Any) -> float | None:
        if not math_gold_parses(str(gold)):
            return None
        return MATH_REWARD if judge(text, str(gold), "math") else 0.0

    return _score_all("math_accuracy", score, completions, golds, kwargs.get("log_metric"))


def dapo_score(completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when the last ``Answer: X`` in the response's last 300 characters equals the gold after the
    reference's normalisation (``answers.normalize_final_answer``); 0 otherwise, as the reference's code
    returns (its docstring said -1)."""
    return _judged("dapo_score", "dapo", DAPO_REWARD, completions, answer, kwargs)


#: Reward names accepted by ``--rewards`` / recipes.
REWARDS: dict[str, Callable[..., list[float | None]]] = {
    "soft_format": soft_format_reward,
    "strict_format": strict_format_reward,
    "gsm8k": gsm8k_accuracy,
    "last_number": last_number_accuracy,
    "closeness": last_number_closeness,
    "math": math_accuracy,
    "dapo": dapo_score,
}


def get_rewards(names: Sequence[str]) -> list[Callable[..., list[float | None]]]:
    """The built-in reward functions named (``REWARDS``), as trl will call them."""
    unknown = [n for n in names if n not in REWARDS]
    if unknown:
        raise ValueError(f"--rewards: unknown {unknown}; expected names from {sorted(REWARDS)}")
    return [REWARDS[n] for n in names]
