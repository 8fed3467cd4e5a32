"""Data sets become prompt (chat messages with the restored instruction) + answer rows."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
from datasets import Dataset

from qerl.tasks.data_sets import spec
from qerl.tasks.prompts import DAPO_SYSTEM_PROMPT, TAG_SYSTEM_PROMPT
from qerl.train.data import (
    ARITHMETIC_LEVELS,
    arithmetic,
    filter_prompt_length,
    load_dataset,
    to_rows,
    train_heldout_split,
)
from qerl.train.rewards import gsm8k_accuracy

SAMPLE = Path(__file__).parent / "data" / "gsm8k_train30.jsonl"


def test_gsm8k_local_jsonl_gets_the_bare_question_and_numeric_gold() -> None:
    ds = load_dataset("gsm8k", str(SAMPLE))
    assert len(ds) == 30 and sorted(ds.column_names) == ["answer", "prompt"]
    row = ds[0]
    assert len(row["prompt"]) == 1  # the reference's GSM8K prompt: no system message
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("Natalia sold clips")
    assert row["answer"] == "72"
    tagged = load_dataset("gsm8k", str(SAMPLE), style="tags")[0]["prompt"]
    assert tagged == [{"role": "system", "content": TAG_SYSTEM_PROMPT}, row["prompt"][0]]


def test_parquet_and_directory_sources(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:5]]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    assert (
        load_dataset("gsm8k", str(tmp_path / "train.parquet"))["answer"]
        == load_dataset("gsm8k", str(tmp_path))["answer"]
    )


def test_math_style_sets_keep_the_gold_and_dapo_uses_its_prompt(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "What is $1+1$?", "solution": "long", "answer": "2"}) + "\n")
    big = load_dataset("bigmath", str(path))
    assert big[0]["answer"] == "2" and big[0]["prompt"][0]["content"] == TAG_SYSTEM_PROMPT
    with pytest.raises(ValueError, match="--prompt-style source: data set row has no source_prompt"):
        load_dataset("dapomath", str(path))  # the reference's spelling; DAPO's own prompt is missing here
    dapo = load_dataset("dapomath", str(path), style="dapo")
    assert dapo[0]["prompt"][0]["content"] == DAPO_SYSTEM_PROMPT
    with pytest.raises(ValueError, match="--prompt-style: unknown 'fancy'"):
        load_dataset("gsm8k", str(SAMPLE), style="fancy")


def test_num_samples_is_a_seeded_subset() -> None:
    a = load_dataset("gsm8k", str(SAMPLE), num_samples=5, seed=1)
    b = load_dataset("gsm8k", str(SAMPLE), num_samples=5, seed=1)
    assert len(a) == 5 and a["answer"] == b["answer"]


def test_arithmetic_is_reproducible_and_correct() -> None:
    a, b = arithmetic(50, seed=3), arithmetic(50, seed=3)
    assert a["question"] == b["question"] and a["question"] != arithmetic(50, seed=4)["question"]
    for q, ans in zip(a["question"], a["answer"], strict=True):
        assert str(eval(q.removeprefix("What is ").removesuffix("?"))) == ans  # noqa: S307 - our own digits
    ds = load_dataset("arithmetic", num_samples=8)
    assert len(ds) == 8
    assert gsm8k_accuracy([f"<answer>{x}</answer>" for x in ds["answer"]], answer=ds["answer"]) == [2.0] * 8


def _parse(question: str) -> tuple[list[int], list[str]]:
    """Operands and operators of a generated 'What is a op b [op c]?' question."""
    tokens = question.removeprefix("What is ").removesuffix("?").split()
    return [int(t) for t in tokens[::2]], tokens[1::2]


@pytest.mark.parametrize("level", sorted(ARITHMETIC_LEVELS))
def test_arithmetic_levels_bound_the_questions_and_answer_them(level: str) -> None:
    lv = ARITHMETIC_LEVELS[level]
    ds = arithmetic(300, seed=5, level=level)
    assert len(set(ds["question"])) == 300  # distinct, so no held-out question can also be a training one
    counts = set()
    for q, ans in zip(ds["question"], ds["answer"], strict=True):
        assert re.fullmatch(r"What is \d+( [-+*] \d+)+\?", q), q
        operands, ops = _parse(q)
        counts.add(len(operands))
        assert all(1 <= x <= lv.max_operand for x in operands) and set(ops) <= set(lv.ops), q
        assert str(eval(q.removeprefix("What is ").removesuffix("?"))) == ans  # noqa: S307 - our own digits
        assert not (lv.non_negative and int(ans) < 0), q
    assert counts == set(lv.term_counts)


def test_easy_is_one_small_addition_or_subtraction_and_hard_keeps_the_original_stream() -> None:
    easy = arithmetic(200, seed=0, level="easy")
    ops = {_parse(q)[1][0] for q in easy["question"]}
    assert ops == {"+", "-"} and max(max(_parse(q)[0]) for q in easy["question"]) <= 20
    # The original generator's first questions for seed 3 (hard is the default level, as before).
    assert arithmetic(3, seed=3)["question"] == ["What is 38 + 35?", "What is 39 * 31 + 41?", "What is 31 * 17?"]
    assert easy["question"] != arithmetic(200, seed=0, level="hard")["question"]


def test_arithmetic_level_is_seeded_and_heldout_is_disjoint() -> None:
    a = load_dataset("arithmetic", num_samples=120, seed=7, arithmetic_level="easy")
    assert a["prompt"] == load_dataset("arithmetic", num_samples=120, seed=7, arithmetic_level="easy")["prompt"]
    assert a["prompt"] != load_dataset("arithmetic", num_samples=120, seed=8, arithmetic_level="easy")["prompt"]
    train, held = train_heldout_split(a, 40, seed=7)
    assert len(train) == 80 and len(held) == 40
    assert not {p[-1]["content"] for p in train["prompt"]} & {p[-1]["content"] for p in held["prompt"]}


def test_arithmetic_level_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--num-samples 700: arithmetic level 'easy' has only 610 distinct"):
        arithmetic(700, level="easy")
    with pytest.raises(ValueError, match="--arithmetic-level: unknown 'trivial'"):
        load_dataset("arithmetic", num_samples=4, arithmetic_level="trivial")
    with pytest.raises(ValueError, match="--arithmetic-level: applies only"):
        load_dataset("gsm8k", str(SAMPLE), arithmetic_level="easy")


def test_bad_names_and_paths_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--dataset"):
        spec("imagenet")
    with pytest.raises(FileNotFoundError, match="--dataset_path"):
        load_dataset("gsm8k", "./does/not/exist.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected a .jsonl"):
        load_dataset("gsm8k", str(tmp_path / "x.csv"))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "q"}) + "\n")
    with pytest.raises(ValueError, match="no question column"):
        load_dataset("gsm8k", str(tmp_path / "bad.jsonl"))


def test_heldout_split_is_disjoint() -> None:
    train, held = train_heldout_split(load_dataset("gsm8k", str(SAMPLE)), 5, seed=0)
    assert len(train) == 25 and len(held) == 5
    assert not {r[-1]["content"] for r in train["prompt"]} & {r[-1]["content"] for r in held["prompt"]}
    with pytest.raises(ValueError, match="--heldout"):
        train_heldout_split(held, 5)


def test_filter_prompt_length(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ds = load_dataset("gsm8k", str(SAMPLE))
    lengths = [
        len(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"]) for p in ds["prompt"]
    ]
    cut = sorted(lengths)[10]
    kept = filter_prompt_length(ds, tok, cut)
    assert len(kept) == sum(n <= cut for n in lengths) and 0 < len(kept) < len(ds)


def test_a_ctrl_c_cannot_land_where_datasets_swallows_it(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``datasets`` derives a transform's fingerprint by pickling its function under a bare ``except:``, so a
    Ctrl-C landing there was swallowed and the training ran on to its end with status 0 (``test_faults``' SIGINT
    test, 3 of 40 signal times). Our transforms give the fingerprint: ``datasets`` pickles none of their functions."""
    from datasets.fingerprint import Hasher
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    raw = Dataset.from_list(
        [{"question": "What is 2 + 3?", "answer": "#### 5"}, {"question": "1 + 1?", "answer": "#### 2"}]
    )
    hashed: list[object] = []

    plain = Hasher.hash

    def interrupted(cls: type, value: object) -> str:
        if not isinstance(value, types.FunctionType):  # its own settings (a format name): quick to hash
            return plain(value)
        hashed.append(value)
        raise KeyboardInterrupt  # a Ctrl-C landing while it pickles a function

    monkeypatch.setattr(Hasher, "hash", classmethod(interrupted))
    kept = filter_prompt_length(to_rows(raw, spec("gsm8k"), "tags"), tok, 10_000)
    assert hashed == [] and kept["answer"] == ["5", "2"]


# --- bounded prompts -------------------------------------------------------------------------------------------------


def test_training_prompt_filter_never_tokenizes_a_huge_question(smollm2_dir: Path, monkeypatch) -> None:
    """With --max_prompt_length 512, one 64 MB question was tokenized whole and ran out of memory in the filter."""
    from datasets import Dataset

    from qerl.load.loader import load_tokenizer
    from qerl.tasks.prompts import chat_messages, encode_chat
    from qerl.train import data

    def bounded(tokenizer, messages):
        assert sum(len(m["content"]) for m in messages) < 1_000_000, "a huge question reached the tokenizer"
        return encode_chat(tokenizer, messages)

    monkeypatch.setattr(data, "encode_chat", bounded)
    rows = Dataset.from_list(
        [{"prompt": chat_messages(q, "plain"), "answer": "5"} for q in ("What is 2 + 3?", "1 + 1 = ? " * 400_000)]
    )
    kept = data.filter_prompt_length(rows, load_tokenizer(smollm2_dir), 512)
    assert [p[-1]["content"] for p in kept["prompt"]] == ["What is 2 + 3?"]
