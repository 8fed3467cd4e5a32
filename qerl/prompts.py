"""Prompt formats, shared by training and evaluation so that a model is scored as it was trained.

The reference's GSM8K training prompt lost its tag instruction while 2.2 of its reward still
depended on the tags (qerl_method.md §7); we put the instruction back as a system message.
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

PROMPT_STYLES = {"tags": TAG_SYSTEM_PROMPT, "dapo": DAPO_SYSTEM_PROMPT}


def chat_messages(question: str, style: str = "tags") -> list[dict[str, str]]:
    """The conversation for one question: the style's system instruction, then the question."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; expected one of {sorted(PROMPT_STYLES)}")
    return [{"role": "system", "content": PROMPT_STYLES[style]}, {"role": "user", "content": question}]


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
