"""Calibration text for data-aware quantization (``--method gptq``).

The default is the bundled ``gsm8k_calibration.jsonl``: the last 256 rows of the GSM8K training
split (openai/gsm8k "main"; Copyright (c) 2021 OpenAI, MIT License). They are disjoint from the
first rows that ``benchmarks/quality.py`` scores and that ``tests/data`` holds, so a quality number
is never measured on the text the weights were fitted to. Each row is rendered the way training
prompts are (``qerl.tasks.prompts.chat_messages``: the system instruction and the question) followed by
the reference answer as the assistant turn, so the activations GPTQ sees are those of an RL prompt
and its completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset

from qerl.tasks.prompts import chat_messages

BUNDLED = Path(__file__).with_name("gsm8k_calibration.jsonl")
DEFAULT_SAMPLES = 128
DEFAULT_MAX_TOKENS = 512


def _read(path: Path) -> Dataset:
    if not path.exists():
        raise FileNotFoundError(f"--calibration-data {path} does not exist")
    if path.suffix in (".jsonl", ".json"):
        return Dataset.from_json(str(path))
    if path.suffix == ".parquet":
        return Dataset.from_parquet(str(path))
    raise ValueError(f"--calibration-data {path}: expected a .jsonl, .json or .parquet file")


def encode(tokenizer: Any, row: dict[str, Any]) -> list[int]:
    """Token ids of one calibration row: a ``text`` field as is, else ``question`` + ``answer`` as a
    chat turn (plain ``question\\nanswer`` for a tokenizer without a chat template). The chat
    template writes its own special tokens; plain text gets the tokenizer's (a BOS, say)."""
    if "text" in row:
        return tokenizer(str(row["text"])).input_ids
    question, answer = str(row["question"]), str(row["answer"])
    if getattr(tokenizer, "chat_template", None):
        messages = [*chat_messages(question), {"role": "assistant", "content": answer}]
        return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
    return tokenizer(f"{question}\n{answer}").input_ids


def calibration_dataset(
    tokenizer: Any, path: Path | None = None, samples: int = DEFAULT_SAMPLES, max_tokens: int = DEFAULT_MAX_TOKENS
) -> Dataset:
    """The first ``samples`` rows of ``path`` (default: the bundled GSM8K rows), tokenized and cut to
    ``max_tokens``: ``input_ids`` and ``attention_mask`` columns, as llm-compressor's oneshot takes them."""
    path = path or BUNDLED
    raw = _read(path)
    if "text" not in raw.column_names and not {"question", "answer"} <= set(raw.column_names):
        raise ValueError(
            f"--calibration-data {path}: needs a 'text' column or 'question' and 'answer' columns, "
            f"found {raw.column_names}"
        )
    if max_tokens < 1:
        raise ValueError(f"--calibration-max-tokens {max_tokens}: must be positive")
    if samples < 1 or samples > len(raw):
        raise ValueError(f"--calibration-samples {samples}: {path} has {len(raw)} rows")
    ids = [encode(tokenizer, row)[:max_tokens] for row in raw.select(range(samples))]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})


@dataclass(frozen=True)
class Calibration:
    """What ``--method gptq`` calibrates on: ``samples`` rows of ``data`` (default: the bundled
    GSM8K rows), each cut to ``max_tokens`` tokens."""

    data: Path | None = None
    samples: int = DEFAULT_SAMPLES
    max_tokens: int = DEFAULT_MAX_TOKENS

    def dataset(self, tokenizer: Any) -> Dataset:
        return calibration_dataset(tokenizer, self.data, self.samples, self.max_tokens)
