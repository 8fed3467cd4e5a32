"""The rollout interface shared by the trainer and evaluation.

An engine turns prompt token ids into sampled completions. Every engine (the native one over
NVFP4Linear, vLLM, transformers' generate) returns the same ``RolloutOutput`` so that the trainer
can use the sampling log-probs for importance-sampling correction and evaluation can score text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class SamplingParams:
    """What to sample. ``top_k=0``, ``top_p=1.0``, ``min_p=0.0``, ``repetition_penalty=1.0`` and
    ``min_tokens=0`` switch those off; ``temperature=0`` is greedy. Their definitions are transformers'
    and vLLM's (``qerl.rollout.sampling``); ``min_tokens`` forbids the stop tokens for the first
    ``min_tokens`` completion tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")


@dataclass
class RolloutOutput:
    """One entry per completion, prompts in order and each prompt's ``n`` completions consecutive.

    ``logprobs[i][t]`` is the log-probability of ``completion_ids[i][t]`` under the distribution it
    was sampled from (after temperature/top-k/top-p). ``finish_reasons[i]`` is ``"stop"`` when a stop
    token ended the completion (the stop token is included in ``completion_ids``) and ``"length"``
    when ``max_new_tokens`` did.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    prompt_index: list[int]


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that can sample completions for a batch of tokenized prompts."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, n: int = 1) -> RolloutOutput: ...


# Helpers every engine shares.


def resolve_pad_id(tokenizer_or_pad_id: object) -> int:
    """Accept a tokenizer (its pad, else eos, id) or a plain int; raise a one-line error otherwise."""
    if isinstance(tokenizer_or_pad_id, int):
        return tokenizer_or_pad_id
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer_or_pad_id, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"tokenizer_or_pad_id: expected an int or a tokenizer with pad/eos ids, got {type(tokenizer_or_pad_id).__name__}"
    )


def check_prompts(prompt_ids: list[list[int]], n: int) -> None:
    """One-line errors for inputs every engine rejects."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt_ids: expected a non-empty list of non-empty token id lists")


def trim_completion(tokens: list[int], stop_ids: set[int], max_new_tokens: int) -> tuple[int, str]:
    """Length of a completion (stop token included) and its finish reason."""
    for i, tok in enumerate(tokens[:max_new_tokens]):
        if tok in stop_ids:
            return i + 1, "stop"
    return min(len(tokens), max_new_tokens), "length"
