"""Reliability of the commands on hostile input (issue 60): one test per class of defect, each seen to
fail before its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
GOOD = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
EVAL_FLAGS = ["--engine", "hf", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "3", "--temperature", "0"]


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def qtiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny NVFP4 chat Llama (2 decoder layers) that the evaluation and training CLIs run in about a second."""
    from tiny_models import make_tiny_chat_model

    from qerl.quantize.pipeline import quantize_checkpoint

    root = tmp_path_factory.mktemp("reliability3")
    return quantize_checkpoint(make_tiny_chat_model(root / "tiny", smollm2_dir), root / "qtiny")


def _data(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _with_config(model: Path, out: Path, **changes: object) -> Path:
    """A copy of ``model`` whose config.json has ``changes``."""
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


# --- the trl drop-in's config ------------------------------------------------------------------------------


def test_trl_differences_accepts_every_batch_shape_trl_accepts(tmp_path: Path) -> None:
    """18 completions per step in generations of 12 (4 prompts x 3): trl accepts it, and listing the settings that
    differ from trl's must not refuse it (it built its reference config without the generation batch)."""
    from qerl.train.config import QeRLConfig, trl_differences

    cfg = QeRLConfig(
        output_dir=str(tmp_path),
        report_to=[],
        per_device_train_batch_size=3,
        gradient_accumulation_steps=6,
        num_generations=4,
        generation_batch_size=12,
    )
    differences = trl_differences(cfg)
    assert "generation_batch_size" not in differences and "steps_per_generation" not in differences


def test_trl_differences_never_stops_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A reference config trl refuses (a trl release with a new rule) costs the report only."""
    from qerl.train import config

    cfg = config.QeRLConfig(output_dir=str(tmp_path), report_to=[])

    def refuse(**kwargs: object) -> None:
        raise ValueError("a rule of a newer trl")

    monkeypatch.setattr(config, "GRPOConfig", refuse)
    assert config.trl_differences(cfg) == {}
    assert "a rule of a newer trl" in caplog.text


# --- the run lock ------------------------------------------------------------------------------------------


def test_lock_refuses_a_planted_link_and_leaves_its_target_alone(tmp_path: Path) -> None:
    from qerl.cli import UsageError
    from qerl.runlock import lock_path, run_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    lock_path(out).symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"), run_lock(out):
        pass
    assert victim.read_text() == "precious\n" and lock_path(out).is_symlink()


def test_lock_is_keyed_by_the_resolved_directory(tmp_path: Path) -> None:
    """``alias`` and ``runs/real`` are one directory: a run into each at once would interleave their files."""
    from qerl.runlock import OutputBusy, run_lock

    real = tmp_path / "runs" / "real"
    real.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    (tmp_path / "runs-alias").symlink_to(tmp_path / "runs")
    with run_lock(real):
        for other in (tmp_path / "alias", tmp_path / "runs-alias" / "real", real / ".." / "real"):
            with pytest.raises(OutputBusy), run_lock(other):
                pass


# --- checkpoints and models that lie ---------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 3, -1, "2", 10**9])
def test_config_that_does_not_describe_the_weights_is_refused(
    qtiny, tiny_dense_dir, tmp_path: Path, capsys, layers: object
) -> None:
    """A config.json with fewer layers than the weights ran a truncated model with rc 0 (more: random layers, or
    gigabytes allocated first); -1 or a string: a traceback. Refused by load, eval and train before any allocation."""
    from eval import gsm8k
    from qerl.cli import run
    from qerl.load.loader import load_model
    from qerl.train import run as train

    for model in (qtiny, tiny_dense_dir):
        lying = _with_config(model, tmp_path / f"lying-{model.name}", num_hidden_layers=layers)
        with pytest.raises(ValueError, match="num_hidden_layers"):
            load_model(lying, device="cpu")
    argv = [
        "--model",
        str(lying),
        "--data",
        str(_data(tmp_path, [GOOD])),
        "--output",
        str(tmp_path / "r.jsonl"),
        *EVAL_FLAGS,
    ]
    assert "num_hidden_layers" in _one_error(run(gsm8k.main, argv), capsys.readouterr().err)
    argv = [
        "--model-name",
        str(lying),
        "--dataset",
        "arithmetic",
        "--output-dir",
        str(tmp_path / "run"),
        "--report-to",
        "none",
        "--max_steps",
        "1",
    ]
    assert "num_hidden_layers" in _one_error(run(train.main, argv), capsys.readouterr().err)
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "run").exists()


def test_model_digest_covers_the_weights_and_config_only(qtiny, tmp_path: Path) -> None:
    """A NOTES.md, or eval's lock file of an output written inside the model directory, made every adapter of the
    model 'trained on other weights'; a changed config or weight still does."""
    from qerl.load.fingerprint import model_sha256

    model = shutil.copytree(qtiny, tmp_path / "model")
    digest = model_sha256(model)
    (model / "NOTES.md").write_text("my notes\n")
    (model / ".results.jsonl.lock").write_text("123\n")
    (model / "results.jsonl").write_text("{}\n")
    assert model_sha256(model) == digest
    _with_config(model, tmp_path / "other", rms_norm_eps=1e-3)
    assert model_sha256(tmp_path / "other") != digest


def test_export_refuses_an_adapter_made_for_another_base_as_eval_does(qtiny, tmp_path: Path, capsys) -> None:
    """An adapter without qerl_base.json (made elsewhere) records its base's name only: eval refused it on another
    base, export merged it with rc 0 and no warning."""
    from peft import get_peft_model

    from eval import gsm8k
    from qerl import export
    from qerl.cli import run
    from qerl.load.loader import load_model
    from qerl.load.lora import lora_config

    adapter = tmp_path / "adapter"
    get_peft_model(load_model(qtiny, device="cpu", dtype=torch.float32), lora_config(r=2)).save_pretrained(adapter)
    assert not (adapter / "qerl_base.json").exists()
    other = shutil.copytree(qtiny, tmp_path / "other-model")
    argv = ["--model", str(other), "--lora", str(adapter), "--output", str(tmp_path / "merged")]
    line = _one_error(export.main(argv), capsys.readouterr().err)
    assert "adapter was made for base model" in line and "--allow-base-mismatch" in line, line
    eval_argv = [
        "--model",
        str(other),
        "--lora",
        str(adapter),
        "--data",
        str(_data(tmp_path, [GOOD])),
        "--output",
        str(tmp_path / "r.jsonl"),
        *EVAL_FLAGS,
    ]
    assert "adapter was made for base model" in _one_error(run(gsm8k.main, eval_argv), capsys.readouterr().err)
    assert not (tmp_path / "merged").exists()
    assert export.main(argv + ["--allow-base-mismatch"]) == 0
    assert export.main(["--model", str(qtiny), "--lora", str(adapter), "--output", str(tmp_path / "m2")]) == 0


# --- bounded inputs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["inf", "nan", "-1", "0", "1e9"])
def test_shard_size_out_of_range_is_one_line(size: str, tmp_path: Path, capsys) -> None:
    """--max-shard-gb inf: a traceback; -1: one shard per tensor; 0: silently 4 GB. Both commands refuse them."""
    import importlib.util

    from qerl import export

    spec = importlib.util.spec_from_file_location(
        "quantize_nvfp4", Path(__file__).parents[1] / "llm-compressor" / "quantize_nvfp4.py"
    )
    quantize_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quantize_cli)
    for main, argv in (
        (export.main, ["--model", "m", "--lora", "a", "--output", str(tmp_path / "o")]),
        (quantize_cli.main, ["--model", "m", "--output", str(tmp_path / "q")]),
    ):
        line = _one_error(main([*argv, "--max-shard-gb", size]), capsys.readouterr().err)
        assert "--max-shard-gb" in line and "expected a size in GB" in line, line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--samples", "100000000"], "--samples"),
    ],
)
def test_eval_numbers_out_of_range_are_one_line(qtiny, tmp_path: Path, capsys, flags: list[str], expected: str) -> None:
    """--samples 100000000 ran out of memory before any output; --temperature nan was recorded as invalid JSON."""
    from eval import gsm8k
    from qerl.cli import run

    out = tmp_path / "r.jsonl"
    argv = ["--model", str(qtiny), "--data", str(_data(tmp_path, [GOOD])), "--output", str(out), *EVAL_FLAGS, *flags]
    assert _one_error(run(gsm8k.main, argv), capsys.readouterr().err).startswith(f"error: {expected}")
    assert not out.exists()


# --- leftovers ----------------------------------------------------------------------------------------------


def test_run_that_saved_nothing_does_not_block_the_corrected_rerun(tmp_path: Path) -> None:
    """A run that crashed in step 1 refused the corrected rerun into its directory ('different settings')."""
    from qerl.cli import UsageError
    from qerl.train import resume

    out = tmp_path / "run"
    out.mkdir()
    resume.save(out, {"learning_rate": 1.0})
    (out / resume.METRICS_FILE).write_text('{"step": 1, "loss": 0.5}\n')
    assert resume.plan(out, {"learning_rate": 1e-5}, "auto", 10) == resume.Plan(changed=[], finished=None)
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / resume.CHECKPOINT_MARKER).write_text("{}")
    with pytest.raises(UsageError, match="different learning_rate"):
        resume.plan(out, {"learning_rate": 1e-5}, "auto", 10)


def test_training_prompt_filter_never_tokenizes_a_huge_question(smollm2_dir: Path, monkeypatch) -> None:
    """With --max_prompt_length 512, one 64 MB question was tokenized whole and ran out of memory in the filter."""
    from datasets import Dataset

    from qerl.load.loader import load_tokenizer
    from qerl.train import data
    from qerl.train.prompts import chat_messages, encode_chat

    def bounded(tokenizer, messages):
        assert sum(len(m["content"]) for m in messages) < 1_000_000, "a huge question reached the tokenizer"
        return encode_chat(tokenizer, messages)

    monkeypatch.setattr(data, "encode_chat", bounded)
    rows = Dataset.from_list(
        [{"prompt": chat_messages(q, "plain"), "answer": "5"} for q in ("What is 2 + 3?", "1 + 1 = ? " * 400_000)]
    )
    kept = data.filter_prompt_length(rows, load_tokenizer(smollm2_dir), 512)
    assert [p[-1]["content"] for p in kept["prompt"]] == ["What is 2 + 3?"]
