"""Bad input to the evaluation CLIs: a one-line UsageError (a SystemExit) naming the flag/file, and no output written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from eval import gsm8k
from eval import math as eval_math
from eval.results import meta_path

torch.set_num_threads(1)

GOOD = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _fails(argv: list[str], output: Path, *needles: str, cli=gsm8k.main) -> str:
    """Run the CLI, expect a one-line SystemExit mentioning every needle, and no output files."""
    with pytest.raises(SystemExit) as info:
        cli(argv + ["--output", str(output), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4"])
    message = str(info.value.code)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    assert not output.exists() and not meta_path(output).exists()
    return message


def test_missing_data_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "gsm8k.jsonl"
    _fails(["--data", str(missing)], tmp_path / "out.jsonl", "--data", str(missing), "no such file")
    _fails(
        ["--benchmark", "aime24", "--data", str(missing)],
        tmp_path / "out.jsonl",
        "--data",
        str(missing),
        cli=eval_math.main,
    )


def test_record_without_question_or_answer(tmp_path: Path) -> None:
    no_question = _write_jsonl(tmp_path / "q.jsonl", [GOOD, {"prompt": "What is 1 + 1?", "answer": "#### 2"}])
    _fails(["--data", str(no_question)], tmp_path / "out.jsonl", str(no_question), "record 2", "'question'")
    no_answer = _write_jsonl(tmp_path / "a.jsonl", [GOOD, GOOD, {"question": "What is 1 + 1?"}])
    _fails(["--data", str(no_answer)], tmp_path / "out.jsonl", str(no_answer), "record 3", "'answer'")
    no_gold = _write_jsonl(tmp_path / "g.jsonl", [{"question": "What is 1 + 1?", "answer": "it is two"}])
    _fails(["--data", str(no_gold)], tmp_path / "out.jsonl", str(no_gold), "record 1", "####")
    broken = tmp_path / "b.jsonl"
    broken.write_text(json.dumps(GOOD) + '\n{"question": \n', encoding="utf-8")
    _fails(["--data", str(broken)], tmp_path / "out.jsonl", f"{broken}:2", "not valid JSON")
    math_rows = _write_jsonl(tmp_path / "m.jsonl", [{"question": "1+1?", "answer": "2"}])  # math wants 'problem'
    _fails(
        ["--benchmark", "amc23", "--data", str(math_rows)],
        tmp_path / "out.jsonl",
        "'problem'",
        "--question-field",
        cli=eval_math.main,
    )


def test_hub_id_offline_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    _fails(
        ["--data", "qerl-test/no-such-dataset"],
        tmp_path / "out.jsonl",
        "--data qerl-test/no-such-dataset",
        "HF_HUB_OFFLINE=1",
        "local",
    )
    assert time.perf_counter() - start < 20


def test_bad_flags(tmp_path: Path, smollm2_dir: Path) -> None:
    data = str(_write_jsonl(tmp_path / "d.jsonl", [GOOD]))
    _fails(["--data", data, "--samples", "0"], tmp_path / "out.jsonl", "--samples")
    _fails(["--data", data, "--top-p", "0"], tmp_path / "out.jsonl", "--top-p")
    _fails(["--data", data, "--model", str(tmp_path / "no-model")], tmp_path / "out.jsonl", "--model", "no-model")
    _fails(
        ["--data", data, "--model", str(smollm2_dir), "--load", "nvfp4"],
        tmp_path / "out.jsonl",
        "--load nvfp4",
        "not an NVFP4 checkpoint",
    )


def _tiny_adapter(tiny_llama_dir: Path, out: Path) -> Path:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from qerl.load.lora import lora_config

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    get_peft_model(model, lora_config(r=2, target_modules=("q_proj", "v_proj"))).save_pretrained(out)
    return out


def test_adapter_for_another_base(tmp_path: Path, smollm2_dir: Path, tiny_llama_dir: Path) -> None:
    data = str(_write_jsonl(tmp_path / "d.jsonl", [GOOD]))
    adapter = _tiny_adapter(tiny_llama_dir, tmp_path / "tiny-adapter")
    argv = ["--data", data, "--model", str(smollm2_dir), "--lora", str(adapter)]
    _fails(argv, tmp_path / "out.jsonl", f"--lora {adapter}", "made for base model", str(tiny_llama_dir))
    # Same recorded name (or the name check waived) but the wrong shapes: still refused, by shape.
    _fails(
        argv + ["--allow-base-mismatch"], tmp_path / "out.jsonl", f"--lora {adapter}", "does not fit", "size mismatch"
    )
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(smollm2_dir)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    _fails(argv, tmp_path / "out.jsonl", f"--lora {adapter}", "does not fit")
    _fails(
        ["--data", data, "--model", str(smollm2_dir), "--lora", str(tmp_path)],
        tmp_path / "out.jsonl",
        "--lora",
        "adapter_config.json",
    )


def test_output_of_unknown_provenance_is_refused(tmp_path: Path) -> None:
    """A JSONL without our meta file may not be ours: neither resumed nor moved (other settings: test_eval_resume)."""
    data = str(_write_jsonl(tmp_path / "d.jsonl", [GOOD]))
    out = tmp_path / "out.jsonl"
    record = {
        "index": 0,
        "sample": 0,
        "question": GOOD["question"],
        "gold": "5",
        "completion": "#### 5",
        "extracted": "5",
        "method": "####",
        "correct": True,
        "finish_reason": "stop",
        "completion_tokens": 3,
    }
    out.write_text(json.dumps(record) + "\n")
    with pytest.raises(SystemExit, match="exists without"):
        gsm8k.main(["--data", data, "--output", str(out)])
    meta_path(out).write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a settings record"):
        gsm8k.main(["--data", data, "--output", str(out)])
    assert out.read_text() == json.dumps(record) + "\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "d.jsonl",
        "out.jsonl",
        "out.jsonl.meta.json",
    ]


def test_binary_data_file(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 8
    for name in ("data.jsonl", "data.json", "data.parquet"):
        (tmp_path / name).write_bytes(blob)
        _fails(["--data", str(tmp_path / name)], tmp_path / "out.jsonl", f"--data {tmp_path / name}", "not ")


def test_cli_prints_one_error_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the entry point (qerl.cli.run): `error: ...` on stderr, status 2, no traceback; flag prefixes
    are not expanded (``--max-new`` must not silently mean ``--max-new-tokens``)."""
    from qerl.cli import run

    data = str(_write_jsonl(tmp_path / "d.jsonl", [GOOD]))
    for argv, needle in (
        (["--data", data, "--max-new", "4"], "unrecognized arguments: --max-new 4"),
        (["--data", data, "--samples", "0"], "--samples: expected a positive integer"),
        (["--data", str(tmp_path / "missing.jsonl")], "no such file"),
    ):
        assert run(gsm8k.main, argv + ["--output", str(tmp_path / "out.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.jsonl").exists()


def test_corrupt_line_inside_output(tmp_path: Path) -> None:
    data = str(_write_jsonl(tmp_path / "d.jsonl", [GOOD]))
    out = tmp_path / "out.jsonl"
    argv = ["--data", data, "--output", str(out), "--temperature", "0"]
    # A finished file needs no model: write it by hand, with the meta a real run would have.
    from eval.results import ResultFile
    from eval.runner import make_parser, run_settings

    args = make_parser("x", "x", default_data="openai/gsm8k").parse_args(argv)
    ResultFile(out, run_settings(gsm8k.GSM8K, args)).start()
    good = {
        "index": 0,
        "sample": 0,
        "question": GOOD["question"],
        "gold": "5",
        "completion": "#### 5",
        "extracted": "5",
        "method": "####",
        "correct": True,
        "finish_reason": "stop",
        "completion_tokens": 3,
    }
    out.write_text("not json\n" + json.dumps(good) + "\n")
    with pytest.raises(SystemExit, match=r"out.jsonl:1: not a result record"):
        gsm8k.main(argv)
    out.write_text(json.dumps(good) + "\n")
    assert gsm8k.main(argv).correct == 1
