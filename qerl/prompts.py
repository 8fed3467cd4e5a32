"""Prompt formats, shared by training and evaluation so that a model can be scored as it was trained.

Styles (``--prompt-style``): ``plain``, the question alone as the user turn (the chat template adds
its own default system prompt, if any): the reference's GSM8K training prompt; ``tags``, a system
instruction to reason in ``<think>`` and answer in ``<answer>`` (the reference's BigMath prompt and
its GSM8K *evaluation* prompt; the paper's instruction); ``dapo``, the DAPO/MiroMind instruction to end
with ``Answer: X``. Training also knows ``source``: a row's own conversation (DAPO-Math's
``source_prompt``), which is what the reference trained DAPO-Math on.

The reference's GSM8K prompt asked for no tags while 2.2 of its reward depended on them
(qerl_method.md §7). Ours keeps that prompt by default but reads the answer wherever it is stated
(``qerl.answers``), so only the 0.2 format reward still needs the tags; ``--prompt-style tags`` asks
for them.
"""

from __future__ import annotations

from typing import Any

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


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat-templated conversation, ending with the assistant turn's header.

    transformers 5 returns a BatchEncoding from ``apply_chat_template(tokenize=True)``; older
    versions a plain list: both become a list of ints here.
    """
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def render(tokenizer: Any, question: str, style: str = "tags") -> list[int]:
    """Token ids of one question's prompt in the given style."""
    return encode_chat(tokenizer, chat_messages(question, style))
