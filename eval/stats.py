"""Accuracy statistics over K samples per question.

pass@1 is the mean over questions of each question's fraction of correct samples; its standard
error is taken across questions (samples of one question are correlated, so treating all N*K
samples as independent would understate the error). pass@k uses the unbiased estimator of Chen
et al. (2021): 1 - C(K-c, k) / C(K, k) per question, averaged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Accuracy:
    """Summary of per-question correct counts, each out of ``samples``."""

    questions: int
    samples: int
    correct: int
    pass_at_1: float
    stderr: float
    pass_at_k: float

    def describe(self) -> str:
        """One line for the console, with the counts behind the percentage."""
        total = self.questions * self.samples
        line = (
            f"accuracy {self.correct}/{total} = {100 * self.correct / total:.2f}% "
            f"(pass@1 {100 * self.pass_at_1:.2f}% +- {100 * self.stderr:.2f}% s.e. over {self.questions} questions"
            f" x {self.samples} sample{'s' if self.samples > 1 else ''})"
        )
        return line + (f"; pass@{self.samples} {100 * self.pass_at_k:.2f}%" if self.samples > 1 else "")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples drawn from n (c of them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def accuracy(correct_counts: Sequence[int], samples: int) -> Accuracy:
    """pass@1 with its standard error (and pass@samples) from each question's number of correct samples."""
    if not correct_counts:
        raise ValueError("accuracy of zero questions is undefined")
    n = len(correct_counts)
    rates = [c / samples for c in correct_counts]
    mean = sum(rates) / n
    var = sum((r - mean) ** 2 for r in rates) / (n - 1) if n > 1 else 0.0
    return Accuracy(
        questions=n,
        samples=samples,
        correct=sum(correct_counts),
        pass_at_1=mean,
        stderr=math.sqrt(var / n),
        pass_at_k=sum(pass_at_k(samples, c, samples) for c in correct_counts) / n,
    )
