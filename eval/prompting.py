"""Every prompt of an evaluation, tokenized and bounded before any model work.

A question longer than the model's context cannot be answered, and feeding it on costs minutes and
gigabytes (an 8 MB question ran 12 minutes to 14 GB before this check existed). So all prompts are
rendered first, each one's length checked against the positions the model has left beside
``--max-new-tokens``, and a prompt over that budget is refused in one line (``--long-prompts refuse``,
the default) or its question cut to fit with a warning naming it (``truncate``). No tokenizer call
sees more than the budget's worth of text: a question with more characters than the budget times
the longest vocabulary entry certainly has more tokens than the budget, so it is refused, or cut to
that many characters before tokenizing, without reading the rest. That bound grows with the model's
context (a 128K-context model let 8 MB through: 22 s and 2.7 GB for one prompt, Ctrl-C heard after
13.7 s), so it is also capped at :data:`MAX_QUESTION_CHARS`, whatever the context: every call stays
well under a second, and Ctrl-C stops the loop between questions. The chat template is held to its
bounds (``qerl.tasks.prompts``: file size, time and output per prompt), and a template past them is named
as the culprit, not the question.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from eval.data import Problem
from qerl.cli import UsageError
from qerl.tasks.prompts import ChatTemplateError, chat_messages, read_template, render, render_text

logger = logging.getLogger(__name__)

LONG_PROMPT_MODES = ("refuse", "truncate")


def use_chat_template(tokenizer: Any, model: str, template: str | None, style: str) -> str:
    """Give ``tokenizer`` the ``--chat-template`` file's template, or check that it has its own (without one,
    transformers fails deep in the first prompt with a ValueError traceback); then try it on one probe
    conversation in ``style``. Returns how messages name the template."""
    if template is not None:
        label = f"--chat-template {template}"
        try:
            tokenizer.chat_template = read_template(template)
        except ChatTemplateError as e:
            raise UsageError(f"{label}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{label}: cannot read it ({e.__class__.__name__}: {e})") from None
    elif not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            f"--model {model}: its tokenizer has no chat template (no chat_template.jinja, nor "
            "chat_template in tokenizer_config.json); pass --chat-template FILE, e.g. the base model's "
            "chat_template.jinja, to say how prompts are laid out"
        )
    else:
        label = f"--model {model}'s chat template"
    _check_template(tokenizer, label, style)
    return label


#: A question no template would produce by itself: the rendered probe must contain it.
_PROBE = "What is 1234 + 5678?"


def _check_template(tokenizer: Any, label: str, style: str) -> None:
    """Render one probe conversation through the template: a Jinja syntax error, a template that raises, loops,
    writes megabytes or drops the user's message would otherwise surface at the first question (blaming it),
    or, for the last, as an accuracy of zero."""
    try:
        text = render_text(tokenizer, chat_messages(_PROBE, style))
    except ChatTemplateError as e:
        raise UsageError(f"{label}: {e}") from None
    except (TemplateError, ValueError, TypeError, KeyError) as e:  # raise_exception() in a template: TemplateError
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise UsageError(f"{label}: not a usable Jinja chat template ({first})") from None
    if _PROBE not in text:
        raise UsageError(
            f"{label}: its output does not contain the user's message (expected it to render each message's 'content')"
        )


def prompt_budget(context: int, max_new_tokens: int) -> int:
    """Tokens a prompt may have: the model's positions less the completion budget."""
    budget = context - max_new_tokens
    if budget < 1:
        raise UsageError(
            f"--max-new-tokens {max_new_tokens}: leaves no room for a prompt in the model's "
            f"{context} positions (max_position_embeddings)"
        )
    return budget


#: The most characters of a question ever rendered and tokenized, whatever the model's context: tokenizing
#: this many takes about 0.4 s on one CPU core (~150 MB), and no benchmark question comes near it.
MAX_QUESTION_CHARS = 1 << 19


def bounded_prompts(
    tokenizer: Any, problems: Sequence[Problem], style: str, budget: int, mode: str, where: str, template: str
) -> dict[int, list[int]]:
    """Problem index -> prompt token ids, each at most ``budget`` tokens (see the module docstring).
    ``template`` names the chat template in the message of one past its bounds."""
    if mode not in LONG_PROMPT_MODES:
        raise UsageError(f"--long-prompts: expected one of {', '.join(LONG_PROMPT_MODES)}, got {mode!r}")
    max_chars = min(budget * max(len(t) for t in tokenizer.get_vocab()), MAX_QUESTION_CHARS)
    prompts = {}
    for problem in problems:
        question = problem.question
        try:
            ids = render(tokenizer, question[:max_chars], style=style)
            if len(question) <= max_chars and len(ids) <= budget:
                prompts[problem.index] = ids
                continue
            if mode == "refuse":
                over = (
                    f"({len(ids)} tokens) is longer than the {budget} tokens the model's context leaves beside "
                    "--max-new-tokens"
                    if len(question) <= max_chars
                    else f"({len(question)} characters) is longer than the {max_chars} characters read of a question"
                )
                raise UsageError(
                    f"--data {where}: record {problem.index + 1}'s prompt {over}; shorten it, or pass "
                    "--long-prompts truncate"
                )
            prompts[problem.index] = _truncated(tokenizer, question[:max_chars], style, budget)
        except ChatTemplateError as e:
            raise UsageError(f"{template}: {e} (--data {where}, record {problem.index + 1})") from None
        logger.warning(
            "--data %s: record %d's question cut to fit the %d-token prompt budget (--long-prompts truncate)",
            where,
            problem.index + 1,
            budget,
        )
    return prompts


def _truncated(tokenizer: Any, question: str, style: str, budget: int) -> list[int]:
    """The prompt of ``question``'s longest token prefix that fits ``budget`` (re-rendered, since tokens can
    merge across the cut)."""
    tokens = tokenizer(question, add_special_tokens=False)["input_ids"]
    keep = len(tokens)
    ids = render(tokenizer, question, style=style)
    while len(ids) > budget and keep > 0:
        keep = max(0, keep - (len(ids) - budget))
        ids = render(tokenizer, tokenizer.decode(tokens[:keep]), style=style)
    if len(ids) > budget:
        raise UsageError(
            f"the {style!r} prompt's own template is {len(ids)} tokens, more than the {budget} the model's "
            "context leaves beside --max-new-tokens"
        )
    return ids


__all__ = ["LONG_PROMPT_MODES", "MAX_QUESTION_CHARS", "bounded_prompts", "prompt_budget", "use_chat_template"]
