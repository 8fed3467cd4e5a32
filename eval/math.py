"""``python -m eval.math --benchmark math500|aime24|aime25|amc23 --data PATH``: competition-maths pass@1.

Same machinery as GSM8K; answers are LaTeX and judged by math-verify, with no "last number"
fallback (in long solutions a stray number is rarely the answer).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from eval.runner import Benchmark, evaluate, make_parser
from eval.stats import Accuracy
from qerl.cli import run


def _strip(answer: str) -> str:
    """Gold as given (AMC23 stores floats such as 27.0; math-verify compares them by value)."""
    if not answer.strip():
        raise ValueError("empty gold answer")
    return answer.strip()


BENCHMARKS = {
    name: Benchmark(name=name, question_field="problem", answer_field="answer", gold=_strip, numeric=False)
    for name in ("math500", "aime24", "aime25", "amc23")
}


def main(argv: Sequence[str] | None = None) -> Accuracy:
    parser = make_parser("python -m eval.math", "Competition-maths pass@1 judged by math-verify.")
    parser.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    args = parser.parse_args(argv)
    return evaluate(args, BENCHMARKS[args.benchmark])


if __name__ == "__main__":
    sys.exit(run(main))
