"""``python -m eval.gsm8k``: GSM8K accuracy of a (quantized, LoRA-adapted) model.

Unlike the reference's eval script (``eval/gsm8k.py``), this evaluates GSM8K by default (not
AMC23), applies the adapter, and compares whole numeric answers rather than first characters.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from eval.runner import Benchmark, evaluate, make_parser
from eval.stats import Accuracy
from qerl.cli import run
from qerl.tasks.answers import gsm8k_gold

GSM8K = Benchmark(
    name="gsm8k",
    question_field="question",
    answer_field="answer",
    gold=gsm8k_gold,
    numeric=True,
    default_data="openai/gsm8k",
    default_config="main",
    default_split="test",
)


def main(argv: Sequence[str] | None = None) -> Accuracy:
    parser = make_parser(
        "python -m eval.gsm8k",
        "GSM8K pass@1 (answers after '####' in the gold; numbers compared exactly).",
        default_data=GSM8K.default_data,
    )
    return evaluate(parser.parse_args(argv), GSM8K)


if __name__ == "__main__":
    sys.exit(run(main))
