"""Logits processing and token sampling shared by every qerl rollout engine.

One function, ``sample``, turns next-token logits into (token, log-prob) pairs. It is written with
static shapes and no host synchronisation so that the native engine can capture it inside its
CUDA-graph decode step; the same code runs eagerly on CPU for tests.

Semantics (the order matches transformers' processors and warpers):

0. ``adjust_logits`` (before everything else, as transformers' logits processors): the repetition
   penalty divides the positive logits, and multiplies the negative ones, of every token already in
   the prompt or the completion by ``penalty``; while fewer than ``min_tokens`` tokens are out, the
   stop tokens get ``-inf``;
1. temperature: ``logits / T``;
2. top-k: keep the ``k`` largest (``k = 0`` keeps all);
3. top-p: on the top-k-renormalised distribution, keep the smallest prefix of the sorted tokens
   whose probability mass reaches ``p`` (the token that crosses ``p`` is kept; at least one token
   always survives);
4. min-p: keep the tokens whose probability is at least ``min_p`` times the largest one (relative,
   so it does not matter which renormalised distribution it is read on);
5. draw from the renormalised survivors; the returned log-prob is the log of that processed
   probability, which is what the trainer's importance-sampling correction compares against.

``temperature == 0`` is greedy: the token is the argmax and its log-prob is taken under the
*unprocessed* softmax of the logits (there is no processed distribution to speak of: it would
be a point mass with log-prob 0, which tells the trainer nothing).

Sampling uses the exponential race (``argmax p_i / E_i`` with ``E_i ~ Exp(1)`` picks ``i`` with
probability ``p_i``) rather than ``torch.multinomial``: it is one elementwise op plus an argmax,
needs no host sync and is CUDA-graph capturable with a registered ``torch.Generator``. Without top-k /
top-p the native engine runs the same race on the GPU in one kernel (``kernels.fused_step.sample``, its
draws from Philox under a seed taken from the engine's generator): the torch ops here moved the whole
``[B, V]`` logits ~10 times a step.
"""

from __future__ import annotations

import torch

from qerl.rollout.base import SamplingParams


def make_generator(device: torch.device | str, seed: int | None) -> torch.Generator:
    """A generator on ``device`` seeded from ``seed`` (a fresh nondeterministic seed when None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def is_filtered(params: SamplingParams) -> bool:
    """True when anything beyond temperature shapes the distribution (top-k, top-p, min-p, the
    repetition penalty, min_tokens), i.e. when the torch path with ``adjust_logits`` is needed."""
    return (
        params.top_k > 0
        or params.top_p < 1.0
        or params.min_p > 0.0
        or params.repetition_penalty != 1.0
        or params.min_tokens > 0
    )


def adjust_logits(
    logits: torch.Tensor,
    seen: torch.Tensor,
    penalty: float | torch.Tensor,
    banned: torch.Tensor,
) -> torch.Tensor:
    """Logits after the repetition penalty and the ``min_tokens`` ban, in fp32 (static shapes).

    ``seen [B, V]`` marks the tokens of each row's prompt and completion so far: their logits ``l``
    become ``l / penalty`` where ``l > 0`` and ``l * penalty`` otherwise (transformers'
    ``RepetitionPenaltyLogitsProcessor``, vLLM's ``repetition_penalty``). ``banned`` (broadcast to
    ``[B, V]``) marks tokens that get ``-inf``: the stop tokens while ``min_tokens`` is not reached.
    """
    x = logits.float()
    penalised = torch.where(x > 0, x / penalty, x * penalty)
    x = torch.where(seen, penalised, x)
    return x.masked_fill(banned, float("-inf"))


def processed_logprobs(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the processed distribution in *sorted* order, and the sort permutation.

    Returns ``(sorted_logprobs [B, V], order [B, V])``: ``sorted_logprobs[b, j]`` is the log-prob of
    token ``order[b, j]`` (``-inf`` for filtered tokens). ``top_k``/``top_p``/``min_p`` may be tensors
    so that a captured graph can read new values from the same buffers.
    """
    scaled = logits.float() / temperature
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)
    k = torch.as_tensor(top_k, device=logits.device)
    k = torch.where(k > 0, k, vocab)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Mass strictly before each token: a token is kept while that mass is still below p, so the
    # token that crosses p survives and rank 0 always does.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(
        mass_before >= torch.as_tensor(top_p, device=logits.device), float("-inf")
    )
    # min-p: p_j >= min_p * p_0 (rank 0 is the largest), i.e. l_j - l_0 >= log(min_p); min_p = 0 keeps all.
    floor = torch.log(torch.as_tensor(min_p, dtype=torch.float32, device=logits.device))
    sorted_logits = sorted_logits.masked_fill(sorted_logits - sorted_logits[:, :1] < floor, float("-inf"))
    return torch.log_softmax(sorted_logits, dim=-1), order


def sample(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    generator: torch.Generator | None = None,
    *,
    min_p: float | torch.Tensor = 0.0,
    greedy: bool | None = None,
    filtered: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``; returns ``(tokens int64 [B], logprobs fp32 [B])``.

    ``greedy``/``filtered`` pick the code path statically (a captured graph cannot branch on tensor
    values); by default they are derived from the Python values of the arguments.
    """
    if greedy is None:
        greedy = float(temperature) == 0.0
    if greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = torch.argmax(logits, dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    if filtered is None:
        filtered = int(top_k) > 0 or float(top_p) < 1.0 or float(min_p) > 0.0
    if filtered:
        logp, order = processed_logprobs(logits, temperature, top_k, top_p, min_p)
    else:
        logp, order = torch.log_softmax(logits.float() / temperature, dim=-1), None
    # Clamped so that a (rare) exact zero draw cannot turn -inf - log(0) into NaN.
    race = torch.empty_like(logp).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    # argmax p / E == argmax (log p - log E); -inf log-probs can never win.
    pick = torch.argmax(logp - race.log(), dim=-1)
    chosen = logp.gather(-1, pick[:, None]).squeeze(-1)
    token = pick if order is None else order.gather(-1, pick[:, None]).squeeze(-1)
    return token, chosen
