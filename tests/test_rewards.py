"""Rewards: format, GSM8K numeric, math-verify, DAPO ``Answer:``; a parser failure scores 0 and is counted,
a malformed call raises. The
correctness rewards read answers exactly as evaluation does (``qerl.tasks.answers``), and the BigMath and DAPO
rewards as the reference's reward code did, on fixed inputs."""

from __future__ import annotations

import logging

import pytest

from qerl.tasks.answers import normalize_final_answer, score
from qerl.train.rewards import (
    dapo_score,
    get_rewards,
    gsm8k_accuracy,
    last_number_accuracy,
    last_number_closeness,
    math_accuracy,
    soft_format_reward,
    strict_format_reward,
)

TAGGED = "<think>\n2 + 2 = 4\n</think>\n<answer>\n4\n</answer>"


def test_format_rewards() -> None:
    loose = "<think>a</think> <answer>4</answer> trailing"
    assert soft_format_reward([TAGGED, loose, "<answer>4</answer>", "<think>x</think>"]) == [0.2, 0.2, 0.0, 0.0]
    assert strict_format_reward([TAGGED, loose]) == [0.2, 0.0]


def test_conversational_completions_are_read() -> None:
    convo = [[{"role": "assistant", "content": TAGGED}]]
    assert soft_format_reward(convo) == [0.2]
    assert gsm8k_accuracy(convo, answer=["4"]) == [2.0]


def test_gsm8k_accuracy_compares_numbers() -> None:
    completions = ["<answer>$1,000</answer>", "#### 1000.0", "<answer>999</answer>", "1000 is my guess", "no number"]
    gold = ["Natalia sold ... #### 1000"] * 5  # full GSM8K solution: the gold is after ####
    assert gsm8k_accuracy(completions, answer=gold) == [2.0, 2.0, 0.0, 2.0, 0.0]


# Completions in every style the numeric reading knows, right and wrong, for the gold 72.
STYLES = [
    "<think>48 / 2 = 24</think><answer>72</answer>",
    "<answer>71</answer> and 72",
    "#### 72",
    "#### 7",
    "So the total is \\boxed{72}.",
    "The answer is 72.",
    "The answer is 27. I checked 72 cases.",
    "48 + 24 = 72",
    "<think>...</think>\n<answer>\n...\n</answer>\nShe sold 72 clips.",
    "I do not know.",
    "#### 72.5",
]


def test_gsm8k_reward_is_positive_exactly_when_evaluation_counts_it_correct() -> None:
    """One reading for rewards and evaluation (issue 15 item 3): the reward is 2.0 iff eval's scorer says correct."""
    rewards = gsm8k_accuracy(STYLES, answer=["72"] * len(STYLES))
    verdicts = [score(c, "72")[1] for c in STYLES]
    assert rewards == [2.0 if ok else 0.0 for ok in verdicts]
    assert 0 < sum(verdicts) < len(STYLES)  # both kinds are present


def test_last_number_accuracy_is_the_lenient_variant() -> None:
    assert last_number_accuracy(["so 3 + 4 = 7", "7 or maybe 8", "<answer>7</answer>"], answer=["7"] * 3) == [
        1.0,
        0.0,
        1.0,
    ]


def test_math_accuracy_uses_math_verify() -> None:
    completions = [
        "<think>x</think><answer>\\frac{1}{2}</answer>",
        "so the result is \\boxed{0.5}",
        "<answer>x = 3</answer>",
        "<answer>\\sqrt{3}</answer>",
    ]
    assert math_accuracy(completions, answer=["\\frac12", "1/2", "3", "\\sqrt 2"]) == [1.0, 1.0, 1.0, 0.0]


def test_math_accuracy_reads_the_whole_completion_boxed_first_as_the_reference() -> None:
    """The reference's BigMath reward: math-verify's LaTeX extraction over the whole completion, \\boxed
    first (every boxed expression), anchored matches only. Expected values are what that reading gives."""
    cases = [
        ("\\boxed{5} then <answer>3</answer>", "5", 1.0),  # boxed wins over the tags (we used to read the tags: 0)
        ("\\boxed{5} then <answer>3</answer>", "3", 0.0),
        ("the answer is $5$ and \\boxed{6}", "6", 1.0),  # boxed before other anchors
        ("The final answer is $\\frac{1}{2}$", "0.5", 1.0),  # an anchored $...$
        ("\\boxed{1} and then \\boxed{2}", "2", 0.0),  # all boxed expressions: the set {1, 2}, not 2
        ("Therefore $x = 4$. The answer is $\\boxed{4}$ dollars", "4", 1.0),
        ("so \\boxed{x=3}", "3", 1.0),  # an equation's right-hand side
        ("\\boxed{10 \\text{ dollars}}", "10", 1.0),  # units normalised away
    ]
    got = math_accuracy([c for c, _, _ in cases], answer=[g for _, g, _ in cases])
    assert got == [r for _, _, r in cases]


def test_math_accuracy_reads_a_bare_answer_block_where_the_reference_scored_0() -> None:
    """Not copied: the reference's BigMath prompt asked for <answer> tags and its reward, needing $...$ or
    \\boxed, scored a bare tagged answer 0. Ours falls back to the tags when nothing anchored is found."""
    assert math_accuracy(["<think>2+1</think><answer>3</answer>", "$y=5$ and then 7"], answer=["3", "7"]) == [1.0, 0.0]


def test_math_accuracy_gives_none_for_unparseable_gold() -> None:
    assert math_accuracy(["<answer>1</answer>"], answer=[""]) == [None]


@pytest.mark.parametrize(
    "text,normalised",
    [
        ("x = 5", "5"),
        ("a = b = 7", "7"),  # the part after the last '='
        ("10 dollars", "10"),
        ("3 \\text{ cm}", "3"),
        ("100 meters", "100"),
        ("90^{\\circ}", "90"),  # units and degrees
        ("\\frac12", "\\frac{1}{2}"),
        ("\\dfrac34", "\\dfrac{3}{4}"),
        ("\\sqrt2", "\\sqrt{2}"),  # TeX shorthand
        ("$\\boxed{12}$.", "12"),
        ("\\text{(C)}", "(C)"),
        ("1,000", "1000"),
        ("\\$3.50", "3.50"),
        ("12.0", "12.0"),  # strings, not numbers: the reference's DAPO reward does not equate 12.0 and 12
    ],
)
def test_dapo_normaliser_matches_the_reference(text: str, normalised: str) -> None:
    assert normalize_final_answer(text) == normalised


def test_dapo_score_reads_the_last_answer_line() -> None:
    completions = [
        "Work...\nAnswer: 10\nno wait\nAnswer: $\\boxed{12}$.",
        "Answer: 12 dollars",
        "Answer: 13",
        "Answer: 12" + "x" * 400,  # the answer is outside the last 300 characters
        "Answer: 12.0",  # compared as strings, as the reference
        "answer: x = \\frac12",
    ]
    gold = ["12"] * 5 + ["\\frac{1}{2}"]
    assert dapo_score(completions, answer=gold) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_a_parser_failure_scores_zero_is_counted_and_warns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qerl.train.rewards as rewards

    def judge(text: str, gold: str, reading: str) -> bool:
        if "boom" in text:
            raise TimeoutError("math-verify timed out")
        return text.strip() == gold

    monkeypatch.setattr(rewards, "judge", judge)
    metrics: list[tuple[str, float]] = []
    with caplog.at_level(logging.WARNING, logger="qerl.train.rewards"):
        out = gsm8k_accuracy(["4", "boom", "5"], answer=["4"] * 3, log_metric=lambda k, v: metrics.append((k, v)))
    assert out == [2.0, 0.0, 0.0]
    assert metrics == [("rewards/gsm8k_accuracy/errors", 1.0)]
    assert "gsm8k_accuracy raised on 1/3" in caplog.text
    metrics.clear()
    assert soft_format_reward([TAGGED], log_metric=lambda k, v: metrics.append((k, v))) == [0.2]
    assert metrics == [("rewards/soft_format_reward/errors", 0.0)]  # logged every step, so the curve has no gaps


def test_a_malformed_call_raises() -> None:
    with pytest.raises(TypeError, match="completion: expected a string or a list of chat messages"):
        gsm8k_accuracy([TAGGED, 12345], answer=["4", "4"])
    (reward,) = get_rewards(["gsm8k"])
    assert reward is gsm8k_accuracy  # handed to trl as is: trl names, calls and logs it
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        reward(completions=["<answer>1</answer>"])


def test_unknown_reward_name() -> None:
    with pytest.raises(ValueError, match="--rewards"):
        get_rewards(["nope"])


def test_last_number_closeness_ranks_near_misses() -> None:
    got = last_number_closeness(["so 20 + 6 = 26", "it is 25", "maybe 13", "-26", "no idea", "100"], answer=["26"] * 6)
    assert got[0] == 1.0 and got[1] > got[2] > got[3] == 0.0 and got[4] == 0.0 and got[5] == 0.0
    assert abs(got[1] - (1 - 1 / 26)) < 1e-9
    assert last_number_closeness(["1"], answer=["0"]) == [0.0] and last_number_closeness(["0.5"], answer=["0"]) == [0.5]
