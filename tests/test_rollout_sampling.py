"""Statistical and exactness tests of qerl.rollout.sampling (CPU, fp32, a few seconds)."""

from __future__ import annotations

import math

import pytest
import torch

from qerl.rollout.base import SamplingParams
from qerl.rollout.sampling import adjust_logits, make_generator, sample

torch.set_num_threads(1)

# Softmax of these at T=1 is roughly [.40, .25, .15, .10, .06, .04]: cumulative mass .40/.65/.80/.90/.96.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
LOGITS = PROBS.log().float() + 1.7  # an offset must not matter
N = 200_000


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent float64 reference: softmax(l/T), keep top-k, renormalise, keep the top-p prefix."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(p[i].item() for i in keep)
    kept, acc = [], 0.0
    for i in keep:
        if acc >= top_p:
            break
        kept.append(i)
        acc += p[i].item() / mass
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; a token with expected probability 0 but a count fails outright."""
    n = counts.sum().double()
    zero = expected_probs == 0
    if counts[zero].sum() > 0:
        return 0.0
    exp = expected_probs[~zero] * n
    stat = ((counts[~zero].double() - exp) ** 2 / exp).sum()
    df = int((~zero).sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draw(temperature: float, top_k: int, top_p: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    logits = LOGITS.expand(N, -1).contiguous()
    return sample(logits, temperature, top_k, top_p, make_generator("cpu", seed))


CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.7), (0.8, 4, 0.85), (1.0, 0, 0.05)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_empirical_distribution_matches(temperature: float, top_k: int, top_p: float) -> None:
    tokens, _ = draw(temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=len(PROBS))
    assert chi2_pvalue(counts, reference_probs(LOGITS, temperature, top_k, top_p)) > 1e-3


@pytest.mark.parametrize(
    "drawn,wrong",
    [
        ((1.0, 0, 1.0), (1.15, 0, 1.0)),  # temperature off by 15%
        ((0.7, 0, 1.0), (1.0, 0, 1.0)),
        ((1.0, 0, 0.7), (1.0, 0, 0.85)),  # top_p keeps one token too many
        ((1.0, 0, 0.85), (1.0, 0, 0.7)),  # ... or too few
        ((1.3, 3, 1.0), (1.3, 4, 1.0)),  # top_k off by one
    ],
)
def test_chi_square_rejects_wrong_distribution(drawn: tuple, wrong: tuple) -> None:
    """The goodness-of-fit test has power: the same samples fail against a wrong T/top_p/top_k."""
    tokens, _ = draw(*drawn)
    counts = torch.bincount(tokens, minlength=len(PROBS))
    assert chi2_pvalue(counts, reference_probs(LOGITS, *drawn)) > 1e-3
    assert chi2_pvalue(counts, reference_probs(LOGITS, *wrong)) < 1e-6


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_logprob_is_processed_probability(temperature: float, top_k: int, top_p: float) -> None:
    tokens, logprobs = draw(temperature, top_k, top_p)
    ref = reference_probs(LOGITS, temperature, top_k, top_p)
    torch.testing.assert_close(logprobs.double(), ref[tokens].log(), atol=2e-6, rtol=0)


def test_greedy_logprob_is_unprocessed() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    tokens, logprobs = sample(logits, 0.0, top_k=2, top_p=0.1)  # the filters do not apply to greedy
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


def test_seed_reproducible() -> None:
    a, _ = draw(1.0, 0, 0.9, seed=11)
    b, _ = draw(1.0, 0, 0.9, seed=11)
    c, _ = draw(1.0, 0, 0.9, seed=12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_tensor_knobs_match_python_knobs() -> None:
    """The graph path passes T/top-k/top-p as tensors; it must draw the very same tokens."""
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(5)) * 3
    py = sample(logits, 0.8, 20, 0.9, make_generator("cpu", 1))
    tt = sample(
        logits,
        torch.tensor(0.8),
        torch.tensor(20),
        torch.tensor(0.9),
        make_generator("cpu", 1),
        greedy=False,
        filtered=True,
    )
    assert torch.equal(py[0], tt[0])
    torch.testing.assert_close(py[1], tt[1])
    assert math.isfinite(float(py[1].min()))


def min_p_reference(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """Independent float64 reference: softmax(l/T), keep p >= min_p * max p, renormalise."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    kept = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
    return kept / kept.sum()


@pytest.mark.parametrize("temperature,min_p,wrong", [(1.0, 0.3, 0.2), (0.7, 0.2, 0.3), (1.3, 0.12, 0.3)])
def test_min_p_distribution_matches_its_definition(temperature: float, min_p: float, wrong: float) -> None:
    logits = LOGITS.expand(N, -1).contiguous()
    tokens, logprobs = sample(logits, temperature, generator=make_generator("cpu", 1), min_p=min_p)
    counts = torch.bincount(tokens, minlength=len(PROBS))
    expected = min_p_reference(LOGITS, temperature, min_p)
    assert chi2_pvalue(counts, expected) > 1e-3
    assert chi2_pvalue(counts, min_p_reference(LOGITS, temperature, wrong)) < 1e-6  # the test has power
    torch.testing.assert_close(logprobs[:100].double(), expected.log()[tokens[:100]], atol=1e-5, rtol=0)


def test_adjust_logits_is_the_repetition_penalty_and_min_tokens_ban() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    seen = torch.tensor([[True, True, False, False, False]])
    banned = torch.tensor([False, False, False, False, True])
    out = adjust_logits(logits, seen, 2.0, banned)
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0, float("-inf")]]  # seen: 2/2, -1*2; unseen kept; banned -inf
    assert adjust_logits(logits, seen, 1.0, torch.zeros(5, dtype=torch.bool)).tolist() == logits.tolist()


def test_new_sampling_params_are_validated() -> None:
    for bad in (dict(min_p=1.5), dict(repetition_penalty=0.0), dict(min_tokens=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
