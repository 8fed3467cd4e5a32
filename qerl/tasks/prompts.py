"""Prompt formats, shared by training and evaluation so that a model can be scored as it was trained.

Styles (``--prompt-style``): ``plain``, the question alone as the user turn (the chat template adds
its own default system prompt, if any): the reference's GSM8K training prompt; ``tags``, a system
instruction to reason in ``<think>`` and answer in ``<answer>`` (the reference's BigMath prompt and
its GSM8K *evaluation* prompt; the paper's instruction); ``dapo``, the DAPO/MiroMind instruction to end
with ``Answer: X``. Training also knows ``source``: a row's own conversation (DAPO-Math's
``source_prompt``), which is what the reference trained DAPO-Math on.

The reference's GSM8K prompt asked for no tags while 2.2 of its reward depended on them
(the reference's prompt and reward code). Ours keeps that prompt by default but reads the answer wherever it is stated
(``qerl.tasks.answers``), so only the 0.2 format reward still needs the tags; ``--prompt-style tags`` asks
for them.

A chat template is a program (Jinja), so it is held to bounds like any other input: a template file
larger than :data:`MAX_TEMPLATE_BYTES` is not read, and each rendering may take at most
:data:`TEMPLATE_SECONDS` and add at most :data:`MAX_TEMPLATE_CHARS` characters of its own to the
messages; past either a :class:`ChatTemplateError` says so (one that loops or writes megabytes per
prompt otherwise runs for minutes, or is blamed on the question for the prompt's length).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qerl.fsutil import read_small

TAG_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process step by step and then provides the user with "
    "the answer. The reasoning process is enclosed within <think> </think> and the final answer within "
    "<answer> </answer> tags, i.e.:\n<think>\n...\n</think>\n<answer>\n...\n</answer>"
)

DAPO_SYSTEM_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)

#: Style -> its system instruction (None: no system message of ours).
PROMPT_STYLES: dict[str, str | None] = {"plain": None, "tags": TAG_SYSTEM_PROMPT, "dapo": DAPO_SYSTEM_PROMPT}
#: The training-only style that takes each row's own conversation.
SOURCE_STYLE = "source"


def chat_messages(question: str, style: str = "tags") -> list[dict[str, str]]:
    """The conversation for one question: the style's system instruction (if any), then the question."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"--prompt-style: unknown {style!r}; expected one of {sorted(PROMPT_STYLES)}")
    system = PROMPT_STYLES[style]
    return ([] if system is None else [{"role": "system", "content": system}]) + [{"role": "user", "content": question}]


#: The largest chat template file read. Real ones are a few kB (Qwen3's, with tool calling: 4 kB).
MAX_TEMPLATE_BYTES = 1 << 20
#: The most characters a template may add to one conversation's messages (headers, a default system prompt).
MAX_TEMPLATE_CHARS = 100_000
#: The longest one rendering may take (a real template: about a millisecond).
TEMPLATE_SECONDS = 2.0


class ChatTemplateError(ValueError):
    """A chat template past its bounds; the message leaves naming the template to the caller, who knows it."""


def read_template(path: str | Path) -> str:
    """The chat template file at ``path``, refused unread when it is larger than :data:`MAX_TEMPLATE_BYTES` or not a
    regular file (a FIFO would hang the read: ``qerl.fsutil.read_small``)."""
    path = Path(path).expanduser()
    try:
        data = read_small(path, MAX_TEMPLATE_BYTES)
    except ValueError as e:
        raise ChatTemplateError(f"{str(e).removeprefix(f'{path}: ')}; not a chat template") from None
    return data.decode("utf-8")


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`ChatTemplateError` in the block after ``seconds`` (a SIGALRM timer, so that Jinja's
    Python loop is stopped where it is). Only the main thread receives signals: elsewhere (and where a
    timer is already running, which is not ours to take) the block runs unbounded."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise ChatTemplateError(f"rendering one prompt took longer than {seconds:g} s (a loop?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The chat-templated text of a conversation, ending with the assistant turn's header, within the
    template's bounds (:data:`TEMPLATE_SECONDS`, :data:`MAX_TEMPLATE_CHARS`)."""
    with _time_limit(TEMPLATE_SECONDS):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    own = len(text) - sum(len(m["content"]) for m in messages)
    if own > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"it adds {own} characters to one prompt's messages (at most {MAX_TEMPLATE_CHARS})")
    return text


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat-templated conversation, ending with the assistant turn's header: the bounded
    :func:`render_text`, tokenized as ``apply_chat_template(tokenize=True)`` does (no special tokens added)."""
    return list(tokenizer(render_text(tokenizer, messages), add_special_tokens=False)["input_ids"])


def render(tokenizer: Any, question: str, style: str = "tags") -> list[int]:
    """Token ids of one question's prompt in the given style."""
    return encode_chat(tokenizer, chat_messages(question, style))
