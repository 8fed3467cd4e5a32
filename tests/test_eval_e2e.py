"""End to end: ``python -m eval.gsm8k`` on 30 GSM8K training questions with SmolLM2-135M (CPU, fp32).

One 30-question run (48 new tokens, one batch, greedy so that a resumed run must reproduce it)
is shared by the tests of this module: ~40 s on one core, plus ~15 s for the resumed tail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eval import gsm8k
from eval.results import meta_path
from qerl.tasks.answers import gsm8k_gold

torch.set_num_threads(1)

DATA = Path(__file__).parent / "data" / "gsm8k_train30.jsonl"
FIELDS = {
    "index",
    "sample",
    "question",
    "gold",
    "completion",
    "extracted",
    "method",
    "correct",
    "finish_reason",
    "completion_tokens",
}


def _argv(model: Path, output: Path) -> list[str]:
    return [
        "--model",
        str(model),
        "--data",
        str(DATA),
        "--engine",
        "hf",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-new-tokens",
        "48",
        "--batch-size",
        "30",
        "--temperature",
        "0",
        "--output",
        str(output),
    ]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def first_run(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, str]:
    out = tmp_path_factory.mktemp("eval") / "gsm8k.jsonl"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        result = gsm8k.main(_argv(smollm2_dir, out))
    return out, result, buf.getvalue()


def test_complete_jsonl_and_accuracy_is_its_recount(first_run) -> None:
    out, result, printed = first_run
    rows = _lines(out)
    questions = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(rows) == 30
    assert all(set(r) == FIELDS for r in rows)
    assert sorted(r["index"] for r in rows) == list(range(30)) and {r["sample"] for r in rows} == {0}
    for r in rows:
        q = questions[r["index"]]
        assert r["question"] == q["question"] and r["gold"] == gsm8k_gold(q["answer"])
        assert r["finish_reason"] in ("stop", "length") and 1 <= r["completion_tokens"] <= 48
        assert r["completion"].strip()
    recount = sum(r["correct"] for r in rows)
    assert result.correct == recount and result.questions == 30 and result.samples == 1
    assert result.pass_at_1 == pytest.approx(recount / 30)
    assert f"accuracy {recount}/30 = " in printed
    # The extraction is really exercised: a 48-token budget cuts most answers, so most come from the
    # last-number fallback, and every record with an extraction agrees with re-scoring its completion.
    from qerl.tasks.answers import score

    for r in rows:
        extraction, correct = score(r["completion"], r["gold"])
        assert (extraction.text if extraction else None) == r["extracted"] and correct == r["correct"]


def test_resume_after_truncation_regenerates_only_missing(
    first_run, smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, result, _ = first_run
    resumed = tmp_path / "gsm8k.jsonl"
    shutil.copy(meta_path(out), meta_path(resumed))
    raw = out.read_bytes().split(b"\n")
    kept = b"\n".join(raw[:20]) + b"\n"
    resumed.write_bytes(kept + raw[20][: len(raw[20]) // 2])  # 20 whole lines, then a line cut mid-way

    from qerl.rollout.hf import HFEngine

    generated: list[int] = []
    original = HFEngine.generate

    def counting(self, prompt_ids, params, n=1):
        generated.append(len(prompt_ids) * n)
        return original(self, prompt_ids, params, n)

    monkeypatch.setattr(HFEngine, "generate", counting)
    again = gsm8k.main(_argv(smollm2_dir, resumed))

    assert generated == [10]
    assert resumed.read_bytes().startswith(kept)  # done lines untouched, the cut line replaced
    rows = _lines(resumed)
    assert len(rows) == 30 and sorted(r["index"] for r in rows) == list(range(30))
    assert again == result
    assert sorted(rows, key=lambda r: r["index"]) == sorted(_lines(out), key=lambda r: r["index"])

    # A finished file is only recounted (the model is not even loaded), and the count is the file's:
    # flipping one record's verdict moves the reported accuracy by exactly one.
    monkeypatch.setattr("eval.loading.load_base", lambda *a, **k: pytest.fail("model loaded for a finished run"))
    assert gsm8k.main(_argv(smollm2_dir, resumed)) == result
    lines = resumed.read_text(encoding="utf-8").splitlines()
    flipped = json.loads(lines[3])
    flipped["correct"] = not flipped["correct"]
    resumed.write_text("\n".join(lines[:3] + [json.dumps(flipped)] + lines[4:]) + "\n", encoding="utf-8")
    recount = gsm8k.main(_argv(smollm2_dir, resumed))
    assert recount.correct == result.correct + (1 if flipped["correct"] else -1)
    assert generated == [10]


def test_math_cli_on_the_same_machinery(smollm2_dir: Path, tmp_path: Path) -> None:
    """``eval.math`` reads problem/answer records (AMC23 stores float answers) and scores with math-verify."""
    from eval import math as eval_math

    data = tmp_path / "amc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": i, "problem": f"What is ${i} + {i}$?", "answer": float(2 * i)}) + "\n" for i in (1, 2)
        )
    )
    out = tmp_path / "amc.jsonl.out"
    result = eval_math.main(
        [
            "--benchmark",
            "amc23",
            "--data",
            str(data),
            "--model",
            str(smollm2_dir),
            "--engine",
            "hf",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-new-tokens",
            "8",
            "--samples",
            "2",
            "--temperature",
            "0.6",
            "--seed",
            "3",
            "--output",
            str(out),
        ]
    )
    rows = _lines(out)
    assert sorted((r["index"], r["sample"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["gold"] for r in sorted(rows, key=lambda r: r["index"])] == ["2.0", "2.0", "4.0", "4.0"]
    assert result.samples == 2 and result.questions == 2 and result.correct == sum(r["correct"] for r in rows)
    assert json.loads((tmp_path / "amc.jsonl.out.meta.json").read_text())["benchmark"] == "amc23"
