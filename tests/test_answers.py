"""Answer extraction and scoring over realistic completion styles (no model; < 5 s)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from eval.stats import accuracy, pass_at_k
from qerl.tasks.answers import extract_answer, format_number, gsm8k_gold, is_correct, score, to_number, unbox

# (completion, gold, expected extracted text or None, expected method, correct?)
GSM8K_CASES = [
    # the trained tag format
    ("<think>\n48 / 2 = 24, 48 + 24 = 72\n</think>\n<answer>\n72\n</answer>", "72", "72", "tags", True),
    ("<think>She earns 12/60 per minute.</think><answer>$10</answer>", "10", "10", "tags", True),
    ("<think>...</think>\n<answer>5 + 3 = 8</answer>", "8", "8", "tags", True),
    ("<answer>x = 5</answer>", "5", "5", "tags", True),
    ("<answer>18 dollars</answer> and more text with 99 in it", "18", "18", "tags", True),
    ("<think>first try</think><answer>10</answer> wait, no: <answer>12</answer>", "12", "12", "tags", True),
    ("<think>reasoning</think>\n<answer> 1,234.50 </answer>", "1234.5", "1234.5", "tags", True),
    ("<answer>\\boxed{42}</answer>", "42", "42", "tags", True),
    ("<answer>\\$1{,}234\\text{ dollars}</answer>", "1234", "1234", "tags", True),
    ("<think>cut short by the token limit</think>\n<answer>\n17", "17", "17", "tags", True),
    # the template skeleton echoed back carries no answer: fall through to what follows
    ("<think>\n...\n</think>\n<answer>\n...\n</answer>\nSo she sold 72 clips.", "72", "72", "last-number", True),
    # GSM8K's own '####'
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", "72", "####", True),
    ("#### 240\nThe answer is: 240", "72", "240", "####", False),
    ("It costs $1,000 in total.\n#### $1,000", "1000", "1000", "####", True),
    ("#### -7", "-7", "-7", "####", True),
    ("#### 18.00", "18", "18", "####", True),
    ("#### 75%", "75", "75", "####", True),
    ("#### Step 1: add the two months\n48 + 24 = 72", "72", "72", "last-number", True),  # a heading, not a marker
    # boxed
    ("So the total is \\boxed{72}.", "72", "72", "boxed", True),
    ("Thus \\boxed{\\frac{3}{4}} of the cake is left.", "0.75", "0.75", "boxed", True),
    ("The result is \\boxed{\\dfrac{1}{3}}", "1/3", "1/3", "boxed", True),
    ("\\boxed{\\sqrt{16}}", "4", "\\sqrt{16}", "boxed", True),  # symbolic: judged by math-verify
    ("\\boxed{2^{3}}", "8", "2^{3}", "boxed", True),
    ("Final: \\boxed{\\$12.50}", "12.5", "12.5", "boxed", True),
    # "The answer is ..." with trailing chatter
    ("She needs 5 more dollars. The answer is 5.", "5", "5", "answer-is", True),
    ("The answer is 18. I hope this helps with your 2 questions!", "18", "18", "answer-is", True),
    ("Final answer: 3/4", "0.75", "0.75", "answer-is", True),
    ("Answer: \u22123 degrees", "-3", "-3", "answer-is", True),
    ("the answer is 50% of the class", "50", "50", "answer-is", True),
    # no marker: the last number
    ("She had 20 - 5 = 15 apples left.", "15", "15", "last-number", True),
    ("The temperature dropped to -4 degrees overnight", "-4", "-4", "last-number", True),
    ("He walked 2.5 miles and then 3.75 miles", "3.75", "3.75", "last-number", True),
    (
        "To solve this problem, we need to break it down step by step. We know that Weng earns $12 an hour",
        "10",
        "12",
        "last-number",
        False,
    ),
    ("Each box holds 1,200 pencils", "1200", "1200", "last-number", True),
    ("It takes 0.5 hours", ".5", "0.5", "last-number", True),
    # no answer at all
    ("I am not sure how to solve this problem.", "5", None, None, False),
    ("", "5", None, None, False),
    ("<answer></answer>", "5", None, None, False),
]


@pytest.mark.parametrize("completion,gold,text,method,correct", GSM8K_CASES)
def test_gsm8k_completion_styles(
    completion: str, gold: str, text: str | None, method: str | None, correct: bool
) -> None:
    gold = gsm8k_gold(f"work\n#### {gold}")
    extraction, ok = score(completion, gold)
    assert (extraction.text if extraction else None) == text
    assert (extraction.method if extraction else None) == method
    assert ok is correct


def test_near_misses_are_wrong() -> None:
    """Values that share a prefix, a digit string or a sign with the gold must not count (the reference's
    first-character comparison would have accepted the first three)."""
    for completion in ("#### 7", "#### 720", "#### 72.5", "#### -72", "#### 27", "<answer>seventy-two</answer>"):
        assert not score(completion, "72")[1], completion


@pytest.mark.parametrize(
    "answer,gold",
    [
        ("She sold 72.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("#### -7", "-7"),
        ("#### 0.5", "0.5"),
        ("42", "42"),
        ("$1,200", "1200"),
    ],
)
def test_gsm8k_gold(answer: str, gold: str) -> None:
    assert gsm8k_gold(answer) == gold


def test_gsm8k_gold_needs_a_number() -> None:
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold("the answer is seventy")


def test_every_reference_solution_of_the_sample_scores_correct() -> None:
    """The shipped GSM8K sample's own solutions (``... #### N``) must score 100%."""
    rows = [
        json.loads(line) for line in (Path(__file__).parent / "data" / "gsm8k_train30.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 30
    assert all(score(r["answer"], gsm8k_gold(r["answer"]))[1] for r in rows)


MATH_CASES = [
    (
        "Therefore the polar coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        True,
    ),
    ("<answer>(3, \\pi/2)</answer>", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("<answer>\\frac{\\pi}{2}</answer>", "\\left( 3, \\frac{\\pi}{2} \\right)", False),
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", True),
    ("\\boxed{-q + p}", "p - q", True),
    ("The answer is \\boxed{\\text{(C)}}", "\\text{(C)}", True),
    ("so the answer is $\\boxed{10,\\!080}$", "10,\\!080", True),
    ("\\boxed{3, 5, 7}", "3, 5, 7", True),
    ("\\boxed{7}", "3, 5, 7", False),
    ("<answer>25</answer>", "025", True),  # AIME golds keep leading zeros
    ("<answer>27</answer>", "27.0", True),  # AMC23 golds are floats
    ("Answer: 3.5", "\\frac{7}{2}", True),
    ("The sides are 3, 4 and 5 so the area is 6", "6", False),  # no last-number fallback in competition maths
]


@pytest.mark.parametrize("completion,gold,correct", MATH_CASES)
def test_math_answers(completion: str, gold: str, correct: bool) -> None:
    assert score(completion, gold, numeric=False)[1] is correct


def test_number_helpers() -> None:
    assert to_number("1,234.50") == Fraction(246_9, 2)
    assert to_number("\\frac{-3}{4}") == Fraction(-3, 4) and to_number("-\\frac{3}{4}") == Fraction(-3, 4)
    assert to_number("20-5") == 5 and to_number("1/0") is None and to_number("none") is None
    assert [format_number(Fraction(x)) for x in ("18.0", "2.50", "1/3", "-7")] == ["18", "2.5", "1/3", "-7"]
    assert unbox("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}" and unbox("\\boxed{open") is None
    assert extract_answer("nothing", numeric=False) is None and not is_correct(None, "5")


def test_pass_at_k_and_stderr() -> None:
    assert pass_at_k(4, 0, 1) == 0 and pass_at_k(4, 4, 2) == 1 and pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    acc = accuracy([2, 0, 4, 1], samples=4)
    rates = [0.5, 0.0, 1.0, 0.25]
    mean = sum(rates) / 4
    assert acc.correct == 7 and acc.pass_at_1 == pytest.approx(mean)
    assert acc.stderr == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rates) / 3 / 4))
    assert acc.pass_at_k == pytest.approx(3 / 4)
    assert "7/16" in acc.describe() and "pass@4 75.00%" in acc.describe()
    one = accuracy([1, 0, 0], samples=1)
    assert one.pass_at_1 == pytest.approx(1 / 3) and one.pass_at_k == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        accuracy([], samples=1)
