"""Rewards: format, GSM8K numeric, math-verify, DAPO ``Answer:``; failures score 0, never crash."""

from __future__ import annotations

import logging

import pytest

from qerl.rewards import (
    dapo_score,
    extract_answer,
    get_rewards,
    gsm8k_accuracy,
    guarded,
    last_number_accuracy,
    last_number_closeness,
    math_accuracy,
    parse_number,
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


def test_answer_extraction_and_numbers() -> None:
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("work #### 72") == "72"
    assert extract_answer("72") is None
    assert parse_number("$1,234.50") == 1234.5
    assert parse_number("3/4 of it") == 0.75
    assert parse_number("none") is None


def test_gsm8k_accuracy_compares_numbers() -> None:
    completions = ["<answer>$1,000</answer>", "#### 1000.0", "<answer>999</answer>", "1000 is my guess"]
    gold = ["Natalia sold ... #### 1000"] * 4  # full GSM8K solution: the gold is after ####
    assert gsm8k_accuracy(completions, answer=gold) == [2.0, 2.0, 0.0, 0.0]


def test_last_number_accuracy_is_the_lenient_variant() -> None:
    assert last_number_accuracy(["so 3 + 4 = 7", "7 or maybe 8", "<answer>7</answer>"], answer=["7"] * 3) == [1.0, 0.0, 1.0]


def test_math_accuracy_uses_math_verify() -> None:
    completions = [
        "<think>x</think><answer>\\frac{1}{2}</answer>",
        "so the result is \\boxed{0.5}",
        "<answer>x = 3</answer>",
        "<answer>\\sqrt{3}</answer>",
    ]
    assert math_accuracy(completions, answer=["\\frac12", "1/2", "3", "\\sqrt 2"]) == [1.0, 1.0, 1.0, 0.0]


def test_math_accuracy_gives_none_for_unparseable_gold() -> None:
    assert math_accuracy(["<answer>1</answer>"], answer=[""]) == [None]


def test_dapo_score_reads_the_last_answer_line() -> None:
    completions = [
        "Work...\nAnswer: 10\nno wait\nAnswer: $\\boxed{12}$.",
        "Answer: 12.0",
        "Answer: 13",
        "Answer: 12" + "x" * 400,  # the answer is outside the last 300 characters
    ]
    assert dapo_score(completions, answer=["12"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_a_raising_item_scores_zero_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="qerl.rewards"):
        out = gsm8k_accuracy([TAGGED, 12345], answer=["4", "4"])  # an int is not a completion
    assert out == [2.0, 0.0]
    assert "gsm8k_accuracy raised on 1/2" in caplog.text


def test_guarded_turns_a_crashing_reward_into_zeros(caplog: pytest.LogCaptureFixture) -> None:
    def broken(completions, **kwargs):
        raise KeyError("missing column")

    safe = guarded(broken)
    assert safe.__name__ == "broken"  # trl logs rewards under the function's name
    with caplog.at_level(logging.WARNING, logger="qerl.rewards"):
        assert safe(prompts=["p", "p"], completions=["a", "b"]) == [0.0, 0.0]
    assert "broken raised KeyError" in caplog.text
    assert guarded(safe) is safe


def test_missing_answer_column_is_reported_not_crashing(caplog: pytest.LogCaptureFixture) -> None:
    (reward,) = get_rewards(["gsm8k"])
    with caplog.at_level(logging.WARNING, logger="qerl.rewards"):
        assert reward(completions=["<answer>1</answer>"]) == [0.0]
    assert "needs an 'answer' column" in caplog.text


def test_unknown_reward_name() -> None:
    with pytest.raises(ValueError, match="--rewards"):
        get_rewards(["nope"])


def test_last_number_closeness_ranks_near_misses() -> None:
    got = last_number_closeness(["so 20 + 6 = 26", "it is 25", "maybe 13", "-26", "no idea", "100"], answer=["26"] * 6)
    assert got[0] == 1.0 and got[1] > got[2] > got[3] == 0.0 and got[4] == 0.0 and got[5] == 0.0
    assert abs(got[1] - (1 - 1 / 26)) < 1e-9
    assert last_number_closeness(["1"], answer=["0"]) == [0.0] and last_number_closeness(["0.5"], answer=["0"]) == [0.5]
