"""Reward functions for math RL, in trl's reward-function calling convention.

Each reward is ``fn(completions, answer=None, **kwargs) -> list[float | None]``: trl passes the
dataset's columns as keyword arguments, so ``answer`` is the gold answer column that
``qerl.data`` produces for every dataset. ``None`` means "cannot be scored" (trl turns it into NaN
and leaves the row out of the mean), which only ``math_accuracy`` uses, for gold answers
math-verify cannot parse.

Scoring one completion never crashes training: every scorer runs per completion inside a guard
that turns an exception into reward 0 plus one logged warning (``guarded`` does the same for
whole user-supplied reward functions).

Reward scales follow the reference: format rewards 0.2, GSM8K correctness 2.0, math-verify
accuracy and the DAPO ``Answer:`` score 1.0.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from qerl import answers

logger = logging.getLogger(__name__)

FORMAT_REWARD = 0.2
GSM8K_REWARD = 2.0
MATH_REWARD = 1.0
DAPO_REWARD = 1.0

_SOFT_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_STRICT_FORMAT = re.compile(r"^\s*<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\s*$", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_DAPO_ANSWER = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)
_DAPO_TAIL_CHARS = 300  # the reference scores the last 300 characters only


def completion_text(completion: Any) -> str:
    """The text of one completion: a plain string, or the last message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"completion: expected a string or a list of chat messages, got {type(completion).__name__}")


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last ``<answer>`` block, else the text after the last ``####``."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return None


def parse_number(text: str | None) -> Fraction | None:
    """The last number in ``text``, read exactly as evaluation reads it (``qerl.answers.to_number``)."""
    return None if text is None else answers.to_number(text)


def gsm8k_gold(answer: str) -> str:
    """GSM8K's gold answer: the text after ``####`` when the full solution is given."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def _score_all(
    name: str, scorer: Callable[..., float | None], completions: Sequence[Any], golds: Sequence[Any] | None
) -> list[float | None]:
    """Apply ``scorer(text[, gold])`` to each completion; an exception scores 0 and logs one warning."""
    out: list[float | None] = []
    failures = 0
    first_error = ""
    for i, completion in enumerate(completions):
        try:
            text = completion_text(completion)
            out.append(scorer(text) if golds is None else scorer(text, golds[i]))
        except Exception as e:  # a broken completion or gold must cost one reward, not the run
            failures += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            out.append(0.0)
    if failures:
        logger.warning("reward %s raised on %d/%d completions (scored 0); first error: %s", name, failures, len(out), first_error)
    return out


def _need_answer(name: str, answer: Sequence[Any] | None, n: int) -> Sequence[Any]:
    if answer is None or len(answer) != n:
        raise ValueError(f"reward {name}: needs an 'answer' column with one gold answer per completion")
    return answer


def soft_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """0.2 when ``<think>...</think>`` is followed by ``<answer>...</answer>`` anywhere in the response."""
    return _score_all("soft_format_reward", lambda t: FORMAT_REWARD if _SOFT_FORMAT.search(t) else 0.0, completions, None)


def strict_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """0.2 when the whole response is exactly the tag skeleton, each tag on its own line."""
    return _score_all("strict_format_reward", lambda t: FORMAT_REWARD if _STRICT_FORMAT.match(t) else 0.0, completions, None)


def _numeric_equal(a: Fraction | None, b: Fraction | None) -> bool:
    return a is not None and b is not None and a == b


def gsm8k_accuracy(completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """2.0 when the response's final answer (``<answer>`` block, else after ``####``) equals the gold number.

    Compared as numbers, so ``1,000``, ``$1000`` and ``1000.0`` all match ``1000``; a response
    without an answer block or ``####`` scores 0 (the number must be *stated* as the answer).
    """
    golds = _need_answer("gsm8k_accuracy", answer, len(completions))

    def score(text: str, gold: Any) -> float:
        return GSM8K_REWARD if _numeric_equal(parse_number(extract_answer(text)), parse_number(gsm8k_gold(str(gold)))) else 0.0

    return _score_all("gsm8k_accuracy", score, completions, golds)


def last_number_accuracy(completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when the *last number* of the response equals the gold, tags or not.

    A lenient signal for models too small to follow the tag format yet (SmolLM2-135M on the
    synthetic arithmetic set); easier to game than ``gsm8k_accuracy``, so not a default anywhere.
    """
    golds = _need_answer("last_number_accuracy", answer, len(completions))

    def score(text: str, gold: Any) -> float:
        return MATH_REWARD if _numeric_equal(parse_number(text), parse_number(gsm8k_gold(str(gold)))) else 0.0

    return _score_all("last_number_accuracy", score, completions, golds)


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
        pred, ref = parse_number(text), parse_number(gsm8k_gold(str(gold)))
        if pred is None or ref is None:
            return 0.0
        return float(max(Fraction(0), 1 - abs(pred - ref) / max(abs(ref), Fraction(1))))

    return _score_all("last_number_closeness", score, completions, golds)


def math_accuracy(completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when math-verify finds the response's answer equivalent to the gold; None if the gold is unparseable.

    The ``<answer>`` block is parsed when present, else the whole response (``\\boxed`` first), as
    the reference's BigMath reward did.
    """
    from math_verify import parse, verify

    golds = _need_answer("math_accuracy", answer, len(completions))

    def score(text: str, gold: Any) -> float | None:
        gold_text = str(gold)
        parsed_gold = parse(gold_text if "$" in gold_text or "\\boxed" in gold_text else f"${gold_text}$")
        if not parsed_gold:
            return None
        tagged = _ANSWER_TAG.findall(text)
        # A tagged answer is usually bare LaTeX ("\\frac{1}{2}", "x = 3"): try it inside $...$ first.
        candidates = [f"${tagged[-1].strip()}$", tagged[-1]] if tagged else [text]
        pred = []
        for candidate in candidates:
            pred = parse(candidate)  # math-verify's defaults: LaTeX (boxed first), then plain expressions
            if pred:
                break
        return MATH_REWARD if pred and verify(parsed_gold, pred) else 0.0

    return _score_all("math_accuracy", score, completions, golds)


def normalize_final_answer(text: str) -> str:
    """Minerva/DAPO-style normalisation of a short final answer before exact comparison."""
    s = text.strip()
    s = re.sub(r"\\boxed\s*\{(.*)\}", r"\1", s)
    s = re.sub(r"\\text\s*\{(.*?)\}", r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%"):
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s):
        s = s.replace(",", "")
        if "." in s:
            s = s.rstrip("0").rstrip(".")
    return s


def dapo_score(completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when the last ``Answer: X`` in the response's last 300 characters matches the gold after normalisation."""
    golds = _need_answer("dapo_score", answer, len(completions))

    def score(text: str, gold: Any) -> float:
        found = _DAPO_ANSWER.findall(text[-_DAPO_TAIL_CHARS:])
        if not found:
            return 0.0
        return DAPO_REWARD if normalize_final_answer(found[-1]) == normalize_final_answer(str(gold)) else 0.0

    return _score_all("dapo_score", score, completions, golds)


def guarded(fn: Callable[..., list[float | None]]) -> Callable[..., list[float | None]]:
    """Wrap any batch reward function so that an exception scores the batch 0 and logs a warning.

    The name is kept (trl logs rewards per function name).
    """
    if getattr(fn, "__qerl_guarded__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, completions: Sequence[Any] = (), **kwargs: Any) -> list[float | None]:
        try:
            return fn(*args, completions=completions, **kwargs)
        except Exception as e:  # a reward bug must cost this batch's reward, not the run
            logger.warning("reward %s raised %s: %s; scoring this batch 0", getattr(fn, "__name__", fn), type(e).__name__, e)
            return [0.0] * len(completions)

    wrapper.__qerl_guarded__ = True  # type: ignore[attr-defined]
    return wrapper


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


#: Rewards that judge the answer itself (the rest judge its format).
CORRECTNESS_REWARDS = ("gsm8k", "math", "dapo", "last_number")


def get_rewards(names: Sequence[str]) -> list[Callable[..., list[float | None]]]:
    """Reward functions by name, each guarded."""
    unknown = [n for n in names if n not in REWARDS]
    if unknown:
        raise ValueError(f"--rewards: unknown {unknown}; expected names from {sorted(REWARDS)}")
    return [guarded(REWARDS[n]) for n in names]
